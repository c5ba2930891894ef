"""Text between two vocabularies: what a draft model with another tokenizer needs to draft.

The target's committed tokens are read as text (``TokenText``) and that text is encoded in
the draft's vocabulary (``TextTokens``); the draft's tokens are read back as text, which
the target's tokenizer encodes into the ids that are proposed (``proposal_ids``).

Text is only ever cut at whole characters: one token may hold part of a UTF-8 character
(byte-level vocabularies do), whose text is known once the rest of it arrives. Each side
works a few tokens at a time, so a step costs the same whatever the context's length.
"""

from __future__ import annotations

from collections.abc import Sequence

from draftwise.lm import Tokenizer

REPLACEMENT = "\ufffd"  # what decoding writes for a character it has only part of

# Text a draft must be able to write, read back unchanged, to draft for any target: letters
# with and without accents, other scripts, an emoji, code, runs of white space.
ROUND_TRIP_PROBE = (
    "Hello, World! 0123456789 +-*/=<>()[]{}#@$%^&_|~`'\"\\;:?.\n"
    "def f(x):\n\treturn x ** 2  # café, naïve, Straße, señor, ½ € …\n"
    "  Здравствуй, мир. 你好，世界。 こんにちは。 안녕하세요. مرحبا. 🙂\n\n"
)


def added_text(tokenizer: Tokenizer, anchor: Sequence[int], new: Sequence[int], *, whole: bool = True) -> str | None:
    """The text ``new`` adds after ``anchor`` (the few tokens before it, which end on a whole
    character); None while it ends inside a character, or without ``whole``, the text up to
    that character.

    Decoded with its anchor, a token reads as it does inside the sequence: some tokenizers
    write a token's leading space differently at the start of a text.
    """
    before = tokenizer.decode(list(anchor))
    after = tokenizer.decode([*anchor, *new])
    if not after.startswith(before) or (whole and after.endswith(REPLACEMENT)):
        return None
    return after[len(before) :].rstrip(REPLACEMENT)


def lead_ids(tokenizer: Tokenizer) -> list[int]:
    """What ``tokenizer`` puts before a text of its own (a BOS token, for some models)."""
    whole, plain = tokenizer.encode("x"), tokenizer.encode("x", add_special_tokens=False)
    at = next((i for i in range(len(whole) - len(plain) + 1) if whole[i : i + len(plain)] == plain), 0)
    return whole[:at]


def round_trip_loss(tokenizer: Tokenizer, text: str = ROUND_TRIP_PROBE) -> str | None:
    """None when ``tokenizer`` reads back every character of ``text`` as written; else the
    first character it loses, and what it read instead (``'é' read as '<unk>'``)."""
    back = tokenizer.decode(tokenizer.encode(text, add_special_tokens=False, parse_special=False))
    if back == text:
        return None
    at = next((i for i, (a, b) in enumerate(zip(text, back)) if a != b), min(len(text), len(back)))
    lost = text[at] if at < len(text) else "the end of the text"
    return f"{lost!r} read back as {back[at : at + 8]!r}"


class TokenText:
    """The text of a token sequence that grows at its end (a generation's committed
    context), read a token at a time.

    ``text`` is the text of the first ``clean`` tokens: those after it hold part of a
    character. ``cuts`` maps the token indices among the last ``WINDOW`` that fall between
    whole characters to their offset in ``text``.

    Example: ids ``[5 9 200 17]`` where 200 and 17 are the two bytes of ``é``: after reading
    200, ``clean`` stays 2 and ``text`` ends before ``é``; after 17 it is 4 and ``é`` is in.
    """

    WINDOW = 8  # cuts kept for the last this many tokens
    ANCHOR = 2  # tokens decoded before new ones (see added_text)
    MAX_PENDING = 8  # a run this long that never decodes whole is taken as it reads

    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer
        self.reset([])

    def reset(self, tokens: Sequence[int]) -> None:
        """Read ``tokens`` from scratch: all but the last few in one decode."""
        head = max(0, len(tokens) - self.WINDOW)
        text = self.tokenizer.decode(list(tokens[:head])) if head else ""
        while head and text.endswith(REPLACEMENT):  # back off to a whole character
            head -= 1
            text = self.tokenizer.decode(list(tokens[:head]))
        self.tokens: list[int] = list(tokens[:head])
        self.text = text
        self.clean = head
        self.cuts: dict[int, int] = {head: len(text)}
        self.follow(tokens)

    def follow(self, tokens: Sequence[int]) -> None:
        """Read the tokens of ``tokens`` past those read so far; a sequence that does not
        extend what was read is read from scratch."""
        n = len(self.tokens)
        if len(tokens) < n or (n and tokens[n - 1] != self.tokens[-1]):
            self.reset(tokens)
            return
        for token in tokens[n:]:
            self.tokens.append(token)
            self._settle()

    def _settle(self) -> None:
        pending = self.tokens[self.clean :]
        piece = added_text(self.tokenizer, self.tokens[max(0, self.clean - self.ANCHOR) : self.clean], pending)
        if piece is None:
            if len(pending) < self.MAX_PENDING:
                return
            piece = self.tokenizer.decode(pending).replace(REPLACEMENT, "")
        self.text += piece
        self.clean = len(self.tokens)
        self.cuts[self.clean] = len(self.text)
        stale = self.clean - self.WINDOW
        while (first := next(iter(self.cuts))) < stale:  # the cuts are in increasing order
            del self.cuts[first]


class TextTokens:
    """The ids of a text that grows at its end, in one vocabulary (a draft model's view of
    the target's text).

    New text is encoded together with the end of the text before it, back to the last cut
    at least ``REENCODE`` characters before the end, so the ids near the end are those the
    whole text would get (a word that grew by a token is one token again) without encoding
    the whole text each step.
    """

    REENCODE = 48

    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer
        self.lead = lead_ids(tokenizer)
        self.reset("")

    def reset(self, text: str) -> None:
        self.ids: list[int] = []
        self.text = ""
        self.cuts: list[tuple[int, int]] = [(0, 0)]  # (ids before, characters before)
        self.follow(text)

    def follow(self, text: str) -> None:
        """Take ``text``, which extends the text so far (else it is encoded from scratch)."""
        if not text.startswith(self.text):
            self.reset(text)
            return
        if len(text) == len(self.text):
            return
        n_ids, offset = self.cuts[-1]
        if len(self.text) - offset >= self.REENCODE:  # the last piece is long enough: start another
            n_ids, offset = len(self.ids), len(self.text)
            self.cuts.append((n_ids, offset))
        ids = self.tokenizer.encode(text[offset:], add_special_tokens=False, parse_special=True)
        if n_ids == 0 and self.lead and ids[: len(self.lead)] != self.lead:
            ids = self.lead + ids
        self.ids[n_ids:] = ids
        self.text = text


def settled(tokenizer: Tokenizer, ids: Sequence[int], k: int) -> bool:
    """Whether the first ``k`` of ``ids`` (a drafted text's encoding) stay as they are
    whatever text follows: the next id starts a new word (a space after a non-space, or
    punctuation after a letter or digit), where tokenizers split their text before merging.

    Example, ``k = 1``: ``" the" " ca"`` is settled (``" the"`` stays, however ``" ca"``
    goes on); ``" wea" "th"`` is not (``" weather"`` may be one token).
    """
    if len(ids) <= k or k <= 0:
        return False
    before = tokenizer.decode(list(ids[max(0, k - TokenText.ANCHOR) : k]))
    after = added_text(tokenizer, ids[max(0, k - TokenText.ANCHOR) : k], ids[k : k + 1], whole=False) or ""
    last, first = before[-1:], after[:1]
    if not last or not first:
        return False
    new_word = first.isspace() and not last.isspace()
    punctuation = last.isalnum() and not (first.isalnum() or first.isspace())
    return new_word or punctuation


def proposal_ids(
    tokenizer: Tokenizer, context: Sequence[int], read: TokenText, text: str, lookbehind: int = 4
) -> list[int]:
    """The ids ``tokenizer`` gives ``text`` written after ``context`` (whose text ``read``
    holds): ``text`` is encoded together with the last few committed tokens' text, and kept
    only where that reproduces those tokens, so no id is proposed that the tokenizer would
    not write there. Empty when ``text`` merges into the committed tokens.

    Example: committed ``... " the"``, text ``" cat sat"``: ``" the cat sat"`` encodes as
    ``" the" " cat" " sat"``, so ``" cat" " sat"`` is proposed. Committed ``... " th"``,
    text ``"e cat"``: ``" the" " cat"`` does not start with ``" th"``, so nothing is.
    """
    starts = sorted(i for i in read.cuts if len(context) - lookbehind <= i < len(context))
    for start in starts:
        ids = tokenizer.encode(read.text[read.cuts[start] :] + text, add_special_tokens=False, parse_special=True)
        settled = list(context[start:])
        if ids[: len(settled)] == settled:
            return ids[len(settled) :]
    return []
