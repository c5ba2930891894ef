"""Predicted Outputs: the expected output as a drafter.

A request may say what its answer will mostly be (OpenAI's ``prediction``: a coding tool
sends the file it asked to edit). ``PredictionDrafter`` keeps an alignment between the output
so far and the prediction, and proposes the prediction's next tokens from there. The
proposals are point masses, verified like n-gram lookups: greedy output stays the target's
own, sampled output follows the target's distribution. A wrong prediction costs rejected
rows, which the cost policy sees and stops paying for.

After the output leaves the prediction (an inserted, deleted or changed span), the drafter
finds its place again:

1. **by tokens**: where the last few output tokens occur in the prediction's tokens, looking
   forward from the old place first, then anywhere;
2. **by text**: where the output's last few dozen characters occur in the prediction's text,
   so that a change inside a token does not lose the rest. When that place falls inside one
   of the prediction's tokens, the text up to its next token boundary is encoded after the
   committed tokens (``proposal_ids``, or alone where it would merge into them) and proposed
   first.

A rename is carried through the rest: where the span the output replaced, widened to the
word around it, was a name and became another (``_glob0`` -> ``_glob_literal``), the rest of
the prediction is rewritten with the new name before drafting goes on, so its later uses are
drafted right instead of rejected one by one.

Example: prediction ``def area(r):\\n    return 3.14 * r * r\\n``, instruction "rename area to
disc_area". The output writes ``def`` (on the prediction), then `` disc`` (off it: no offer
while the last tokens occur nowhere in the prediction); once it has written ``_area(r):`` the
last three tokens ``_area`` ``(r`` ``):`` occur in the prediction, and drafting resumes with
``\\n    return 3.14 * r * r\\n``.
"""

from __future__ import annotations

import re
from array import array
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from draftwise.config import GenerationConfig
from draftwise.drafters import EMPTY_PROPOSAL, Drafter, Proposal, Sources
from draftwise.events import PREDICTION
from draftwise.lm import Passes, Tokenizer, ready
from draftwise.offers import Offer
from draftwise.retokenize import TokenText, added_text, proposal_ids
from draftwise.verify import Verdict


def token_offsets(tokenizer: Tokenizer, ids: Sequence[int]) -> tuple[str, dict[int, int]]:
    """The text of ``ids``, and the character offset in it -> the index of the token that
    starts there, for every token that starts on a whole character (and the end: its length
    -> ``len(ids)``)."""
    read = _WholeText(tokenizer)
    read.follow(ids)
    return read.text, {offset: index for index, offset in read.cuts.items()}


class _WholeText(TokenText):
    WINDOW = 1 << 62  # every cut is kept: a prediction is read once, whole


@dataclass(frozen=True)
class EncodedPrediction:
    """A prediction as its drafter reads it: ``source``, the text as given; its ``ids``; the
    ``text`` they read back as, and ``offsets`` in it (``token_offsets``). It costs an encode
    and a read token by token, linear in the prediction: a server makes it when it admits
    the request (``encode_prediction``), so that none of it runs in the rounds every stream
    waits on."""

    source: str
    ids: tuple[int, ...]
    text: str
    offsets: dict[int, int]


def encode_prediction(tokenizer: Tokenizer, source: str, ids: Sequence[int] | None = None) -> EncodedPrediction:
    """``source`` encoded as plain text (no string in it becomes a control token) and read back;
    ``ids``: its ids where they were encoded so already (a server's check of its size), so that
    it is not tokenized a second time."""
    if ids is None:
        ids = tokenizer.encode(source, add_special_tokens=False, parse_special=False) if source else []
    text, offsets = token_offsets(tokenizer, ids) if ids else ("", {})
    return EncodedPrediction(source, tuple(ids), text, offsets)


_WIDTH = array("I").itemsize  # bytes per id in ``_ids_bytes``


def _find(haystack: bytes, needle: bytes, start: int) -> int:
    """The first token index at or after token ``start`` where the token run ``needle`` occurs
    in the token run ``haystack`` (both from ``_ids_bytes``), or -1: a byte search, kept to
    matches that start on an id."""
    at = haystack.find(needle, _WIDTH * start)
    while at >= 0 and at % _WIDTH:
        at = haystack.find(needle, at + 1)
    return at // _WIDTH if at >= 0 else -1


_NAME = re.compile(r"[^\W\d]\w+")  # a name a rename is carried for: two or more word characters
_WORD_END = re.compile(r"\w+$")
_WORD_START = re.compile(r"\w+")


def _ids_bytes(ids: Sequence[int]) -> bytes:
    return array("I", ids).tobytes()


class PredictionDrafter:
    """Drafts the prediction of ``GenerationConfig.prediction`` from where the output follows
    it (see the module's docstring). Offers nothing without a prediction, while lost, or once
    the prediction is used up."""

    MIN_TOKENS = 3  # a re-synchronisation by tokens matches at least this many output tokens
    MAX_TOKENS = 8
    MIN_CHARS = 12  # by text, at least this many characters
    MAX_CHARS = 48
    MAX_EDIT = 8  # a rename is carried through the rest when it replaced at most this many tokens by as many

    def __init__(self, tokenizer: Tokenizer, prediction: EncodedPrediction | None = None) -> None:
        """``prediction``: the one this drafter drafts, encoded ahead (``encode_prediction``),
        whatever the config says; None: the config's, encoded at ``start``."""
        self.tokenizer = tokenizer
        self.prediction = prediction
        self.start([], GenerationConfig(), None)

    def start(self, prompt: Sequence[int], config: GenerationConfig, generator: torch.Generator | None) -> None:
        prediction = self.prediction
        if prediction is None:
            prediction = encode_prediction(self.tokenizer, config.prediction or "")
        self._take(prediction.ids, prediction.text, prediction.offsets)
        self.prompt_len = len(prompt)
        self.read = TokenText(self.tokenizer)
        self.read.reset(prompt)
        self._prompt_chars = len(self.read.text)
        self.bridge: list[int] = []  # re-encoded ids proposed before ids[pos:] (a resync inside a token)
        self.pos: int | None = 0 if self.ids else None  # next prediction token; None: lost
        self._hint = 0  # where the last alignment was: searches look forward from here first
        self._left: tuple[int, int] | None = None  # (prediction token, context position) where the output left it
        self._confirmed = False  # whether the output followed the prediction since it last found its place
        self.seen = len(prompt)  # the context length the alignment is for

    def _load(self, ids: list[int]) -> None:
        """Take ``ids`` as the prediction's tokens (and the text they read as)."""
        self._take(ids, *(token_offsets(self.tokenizer, ids) if ids else ("", {})))

    def _take(self, ids: Sequence[int], text: str, offsets: dict[int, int]) -> None:
        """Take ``ids`` as the prediction's tokens, ``text`` as they read back (what the output's
        text is compared with) and ``offsets`` as ``token_offsets`` gives them."""
        self.ids = list(ids)
        self._bytes = _ids_bytes(ids)
        self.text, self._offsets = text, offsets
        self._starts = {index: offset for offset, index in self._offsets.items()}  # the same, token -> offset
        self._boundaries = sorted(self._offsets)

    @property
    def left(self) -> int:
        """Prediction tokens ahead of the output (0 while lost)."""
        return 0 if self.pos is None else len(self.bridge) + len(self.ids) - self.pos

    def _advance(self, new: Sequence[int]) -> int:
        """Move along the prediction over committed tokens ``new``; how many of them it
        followed (fewer than all where the output left it)."""
        for done, token in enumerate(new):
            if self.bridge:
                if self.bridge[0] != token:
                    return done
                self.bridge.pop(0)
            elif self.pos is not None and self.pos < len(self.ids) and self.ids[self.pos] == token:
                self.pos += 1
            else:
                return done
        return len(new)

    def _follow(self, context: Sequence[int]) -> None:
        """Bring the alignment up to ``context``: 1. advance along the prediction; 2. where the
        output leaves it, note where; 3. resync, and carry the edit it saw through the rest."""
        if len(context) == self.seen or not self.ids:
            return
        self.read.follow(context)
        if self.pos is not None:
            new = context[self.seen :]
            followed = self._advance(new)
            self._confirmed = self._confirmed or followed > 0
            if followed == len(new) > 0:
                self.seen = len(context)
                return
            # The output left the prediction at its token ``pos``, at context position seen + followed.
            self._left = None if self.bridge else (self.pos, self.seen + followed)
            self._hint = self.pos
        self.bridge, self.pos, self._confirmed = [], None, False
        self._resync(context)
        self.seen = len(context)

    def _resync(self, context: Sequence[int]) -> None:
        matched = self._resync_tokens(context[self.prompt_len :])
        if matched:
            self._propagate(context, matched)
        else:
            self._resync_text(context)
        if self.pos is not None:
            self._hint = self.pos

    def _resync_tokens(self, output: Sequence[int]) -> int:
        """Align after the last output tokens where they occur in the prediction; how many
        matched (0: none)."""
        for m in range(min(self.MAX_TOKENS, len(output)), self.MIN_TOKENS - 1, -1):
            tail = _ids_bytes(output[-m:])
            at = _find(self._bytes, tail, self._hint)
            at = at if at >= 0 else _find(self._bytes, tail, 0)
            if at >= 0:
                self.pos = at + m
                return m
        return 0

    def _propagate(self, context: Sequence[int], matched: int) -> None:
        """Carry a rename the output just made through the rest of the prediction: where the
        span it replaced, widened to the word it sits in, is a name (``_glob0``) and so is what
        replaced it (``_glob_literal``), every later whole-word occurrence of the old name is
        replaced too, and the rest is encoded again."""
        left, self._left = self._left, None
        if left is None or self.pos is None:
            return
        (p0, o0), p1, o1 = left, self.pos - matched, len(context) - matched
        starts = self._starts
        if not (p0 < p1 <= p0 + self.MAX_EDIT and o1 - o0 <= self.MAX_EDIT and p0 in starts and p1 in starts):
            return
        written = added_text(self.tokenizer, context[max(self.prompt_len, o0 - 2) : o0], context[o0:o1])
        if written is None:
            return
        s0, s1 = starts[p0], starts[p1]
        before = _WORD_END.search(self.text[:s0])
        after = _WORD_START.match(self.text, s1)
        head, tail = before.group() if before else "", after.group() if after else ""
        old, new = head + self.text[s0:s1] + tail, head + written + tail
        if old == new or not (_NAME.fullmatch(old) and _NAME.fullmatch(new)):
            return
        rest = self.text[starts[self.pos] :] if self.pos in starts else None
        if rest is None:
            return
        renamed = re.sub(rf"(?<!\w){re.escape(old)}(?!\w)", new, rest)
        if renamed != rest:
            ids = self.tokenizer.encode(renamed, add_special_tokens=False, parse_special=False)
            self._load(self.ids[: self.pos] + ids)

    def _resync_text(self, context: Sequence[int]) -> bool:
        output = self.read.text[self._prompt_chars :]
        hint = self._starts.get(self._hint, 0)
        for size in (self.MAX_CHARS, 2 * self.MIN_CHARS, self.MIN_CHARS):
            if len(output) < size:
                continue
            tail = output[-size:]
            found = self.text.find(tail, hint)
            found = found if found >= 0 else self.text.find(tail)
            if found >= 0:
                return self._place(context, found + size)
        return False

    def _place(self, context: Sequence[int], offset: int) -> bool:
        """Align at character ``offset`` of the prediction: on a token boundary directly, else
        through the ids of the text up to the next boundary, written after ``context``."""
        if offset in self._offsets:
            self.pos = self._offsets[offset]
            return True
        following = [b for b in self._boundaries if b > offset]
        if not following:
            return False
        rest = self.text[offset : following[0]]
        # As the tokenizer writes it after the context; where it would merge into the
        # committed tokens, as it reads alone (the target may still write it so: it decides).
        bridge = proposal_ids(self.tokenizer, context, self.read, rest) or self.tokenizer.encode(
            rest, add_special_tokens=False, parse_special=False
        )
        self.bridge, self.pos = bridge, self._offsets[following[0]]
        return True

    def offers(self, context: Sequence[int]) -> tuple[Offer, ...]:
        self._follow(context)
        if not self.left:
            return ()
        # Acceptance is kept apart for a place just found (a guess the output has not
        # followed yet), whose blocks stay short, and a place the output follows, grounded.
        if not self._confirmed:
            return (Offer(PREDICTION, limit=self.left, key=f"{PREDICTION}:found", cost_hint=0.0),)
        return (Offer(PREDICTION, limit=self.left, key=PREDICTION, cost_hint=0.0, grounded=True, follows=True),)

    def propose(self, context: Sequence[int], k: int, source: str | None = None) -> Passes[Proposal]:
        self._follow(context)
        if k <= 0 or not self.left or self.pos is None:
            return ready(EMPTY_PROPOSAL)
        block = (self.bridge + self.ids[self.pos : self.pos + k])[:k]
        return ready(Proposal(tokens=torch.tensor(block, dtype=torch.long), source=PREDICTION))

    def observe(self, context: Sequence[int], verdict: Verdict) -> None:
        """Nothing to do now: the next ``offers`` follows the committed tokens."""


def with_prediction(
    drafter: Drafter | None, tokenizer: Tokenizer | None, prediction: str | EncodedPrediction | None
) -> Drafter | None:
    """The drafter of one generation: ``drafter`` alone, or, with a ``prediction`` (its text,
    or encoded ahead: ``encode_prediction``), the prediction wherever the output follows it
    and ``drafter`` elsewhere (where the output left it, until it finds its place again, and
    once it is used up). While it follows, the other sources would mostly copy the same text;
    the user's own word on what comes next is the one to draft and to count."""
    if prediction is None:
        return drafter
    if tokenizer is None:
        raise ValueError("a prediction is text: it needs the target's tokenizer")
    if isinstance(prediction, str):
        prediction = encode_prediction(tokenizer, prediction)
    return _first(PredictionDrafter(tokenizer, prediction), drafter)


def _first(prediction: PredictionDrafter, drafter: Drafter | None) -> Drafter:
    return prediction if drafter is None else Sources((prediction, drafter), first_only=True)
