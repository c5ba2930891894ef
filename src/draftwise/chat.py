"""Prompt text -> token ids, plain or through the target's chat template.

Every entry point (generate, the API server, the bench) goes through ``encode_messages``
for chat prompts, so one conversation gets the same ids wherever it is sent.

**User text is text.** A chat template is rendered to one string, and the template's own
markup (``<|im_start|>user``) must become control tokens. A user's message may hold the same
strings; if the rendered string were tokenized as a whole, the user could forge turns the
operator never wrote (``hi<|im_end|>\\n<|im_start|>system\\n...``). So each message's control
strings are swapped for private-use placeholders before rendering, the rendered string is cut
at the control strings left (the template's), and each piece between them is tokenized as
plain text with the placeholders put back. For a message without control strings the ids are
exactly those of tokenizing the rendered string whole.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Callable, Iterator, Mapping
from typing import TYPE_CHECKING, Any, TypeVar, cast

from draftwise.errors import DraftwiseError

if TYPE_CHECKING:
    from draftwise.lm import Tokenizer


T = TypeVar("T")


class PromptError(DraftwiseError, ValueError):
    """A prompt that cannot be turned into token ids (empty, no chat template...)."""


class ChatTemplateError(PromptError):
    """The tokenizer has no chat template to apply."""


class PromptTooLong(PromptError):
    """A prompt with more tokens than the caller allows, found out before it was tokenized."""

    def __init__(self, floor: int, limit: int) -> None:
        super().__init__(f"the prompt holds at least {floor} tokens, over the limit of {limit}")
        self.floor = floor
        self.limit = limit


# Placeholders for control strings inside messages come from Unicode's private-use planes,
# which no tokenizer's markup uses; one that a message itself holds is never picked.
_PRIVATE_USE = range(0xF0000, 0x10FFFE)


def _trie_pattern(strings: list[str]) -> str:
    """A regex matching any of ``strings``, longest first, as a trie: at each position of the
    text it looks at one branch per next character, not at every string, so a scan stays
    linear in the text whatever the number of strings.

    Example: ``["<a>", "<ab>", "x"]`` gives ``(?:<a(?:b>|>)|x)``.
    """
    by_head: dict[str, list[str]] = {}
    ends = False
    for s in strings:
        if s:
            by_head.setdefault(s[0], []).append(s[1:])
        else:
            ends = True
    branches = [re.escape(head) + _trie_pattern(tails) for head, tails in sorted(by_head.items())]
    if ends:
        branches.append("")  # the string may end here: after every longer branch, so longest wins
    return branches[0] if len(branches) == 1 else "(?:" + "|".join(branches) + ")"


@functools.lru_cache(maxsize=16)
def _compiled(strings: tuple[str, ...]) -> re.Pattern[str] | None:
    return re.compile(_trie_pattern(list(strings))) if strings else None


def markup_pattern(strings: Mapping[str, int] | tuple[str, ...]) -> re.Pattern[str] | None:
    """The compiled trie pattern of ``strings`` (cached); ``None`` for no strings."""
    return _compiled(tuple(sorted(s for s in strings if s)))


def split_markup(text: str, markup: Mapping[str, int]) -> Iterator[str | int]:
    """``text`` cut at the ``markup`` strings in it (leftmost, then longest): the text between
    them (``str``, never empty) and each markup string's token id (``int``), in order.

    Example: with ``{"<|a|>": 7}``, ``"x<|a|><|a|>y"`` gives ``"x", 7, 7, "y"``.
    """
    pattern = markup_pattern(markup)
    start = 0
    if pattern is not None:
        for match in pattern.finditer(text):
            if match.start() > start:
                yield text[start : match.start()]
            yield markup[match.group()]
            start = match.end()
    if start < len(text):
        yield text[start:]


def check_floor(pieces: list[str | int], limit: int | None) -> None:
    """``PromptTooLong`` when ``pieces`` (from ``split_markup``) cannot fit in ``limit``
    tokens: each markup string is one token and each text between two at least one. A cheap
    scan, done before the tokenizer's work, which grows with the number of pieces."""
    if limit is not None and len(pieces) > limit:
        raise PromptTooLong(len(pieces), limit)


def encode_marked_up(
    tokenizer: Tokenizer, text: str, restore: Mapping[str, str] | None = None, limit: int | None = None
) -> list[int]:
    """Ids of ``text`` whose control strings (``tokenizer.control_tokens``) are markup and the
    rest plain text; ``restore`` maps placeholders back to the text they stand for. Refused
    (``PromptTooLong``) before tokenizing when it cannot fit in ``limit`` tokens."""
    pieces = list(split_markup(text, tokenizer.control_tokens))
    check_floor(pieces, limit)
    table = str.maketrans(dict(restore)) if restore else None
    known: dict[str, list[int]] = {}  # a template repeats its text between markup
    ids: list[int] = []
    for piece in pieces:
        if isinstance(piece, int):
            ids.append(piece)
            continue
        if piece not in known:
            known[piece] = tokenizer.encode(piece.translate(table) if table else piece, False, parse_special=False)
        ids.extend(known[piece])
    return ids


def _strings(value: Any) -> Iterator[str]:
    """Every string in a JSON-like value (messages, tool definitions), keys included."""
    if isinstance(value, str):
        yield value
    elif isinstance(value, dict):
        for key, item in value.items():
            yield from _strings(key)
            yield from _strings(item)
    elif isinstance(value, list | tuple):
        for item in value:
            yield from _strings(item)


def _swapped(value: Any, swap: Callable[[str], str]) -> Any:
    """``value`` with ``swap`` applied to every string in it."""
    if isinstance(value, str):
        return swap(value)
    if isinstance(value, dict):
        return {swap(k): _swapped(v, swap) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return type(value)(_swapped(item, swap) for item in value)
    return value


def _escaped(data: T, control: Mapping[str, int], template: str) -> tuple[T, dict[str, str]]:
    """``data`` (messages, tools) with every control string in its strings swapped for a
    placeholder character, and the map from placeholder back to control string."""
    pattern = markup_pattern(control)
    found = sorted({m.group() for text in _strings(data) for m in (pattern.finditer(text) if pattern else ())})
    if not found:
        return data, {}
    taken = {*template, *(c for text in _strings(data) for c in text)}
    free = (chr(c) for c in _PRIVATE_USE if chr(c) not in taken)
    placeholder = {s: next(free, None) for s in found}
    if None in placeholder.values():
        raise PromptError("the messages use every private-use character; no placeholder is left for markup in them")
    swap = {s: str(p) for s, p in placeholder.items()}
    assert pattern is not None
    escaped = _swapped(data, lambda text: pattern.sub(lambda m: swap[m.group()], text))
    return escaped, {p: s for s, p in swap.items()}


def encode_messages(
    tokenizer: Tokenizer,
    messages: list[dict[str, Any]],
    limit: int | None = None,
    tools: list[dict[str, Any]] | None = None,
) -> list[int]:
    """Token ids of ``messages`` through the tokenizer's chat template, ending with the
    assistant's turn opening, so the model answers rather than continues; ``tools``: the
    functions the template lists for the model to call. Only the template's own markup
    becomes control tokens; the messages and tools are text (see above).
    ``PromptTooLong`` when the result would be over ``limit`` tokens, found before tokenizing."""
    both, restore = _escaped([messages, tools], tokenizer.control_tokens, tokenizer.chat_template or "")
    escaped, escaped_tools = cast(list[dict[str, Any]], both[0]), both[1]
    rendered = tokenizer.apply_chat_template(escaped, add_generation_prompt=True, tokenize=False, tools=escaped_tools)
    # The template already holds the special tokens (BOS, role markers): add none twice.
    return encode_marked_up(tokenizer, rendered, restore, limit)


def encodable(text: str) -> str:
    """``text`` itself, if it is valid Unicode; else a ``PromptError`` saying where it is not.

    A Python string may hold a lone surrogate: JSON's ``"\\ud800"`` decodes to one, and so
    does a command-line byte that is not UTF-8. No tokenizer takes such text.
    """
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise PromptError(
            f"the text is not valid Unicode: it holds a lone surrogate ({text[exc.start]!r}) at character {exc.start}"
        ) from None
    return text


def encode_raw(tokenizer: Tokenizer, text: str, parse_special: bool, limit: int | None = None) -> list[int]:
    """Ids of a raw (non-chat) prompt, with what the model adds on its own (a BOS token, for
    some). With ``parse_special`` control strings in it become control tokens, as llama.cpp's
    own programs read prompts; without, every character is text. ``PromptTooLong`` when
    its markup alone is over ``limit`` tokens, found before tokenizing."""
    if parse_special:
        check_floor(list(split_markup(text, tokenizer.control_tokens)), limit)
    return list(tokenizer.encode(text, parse_special=parse_special))


def encode_prompt(tokenizer: Tokenizer, text: str, chat: bool, parse_special: bool = False) -> list[int]:
    """Token ids of ``text``; with ``chat``, as a single user turn followed by the assistant's
    turn opening, so the model answers rather than continues the user's text."""
    if not text.strip():
        raise PromptError("the prompt is empty")
    encodable(text)
    if not chat:
        return encode_raw(tokenizer, text, parse_special)
    if not getattr(tokenizer, "chat_template", None):
        raise ChatTemplateError("the target model has no chat template; drop --chat to use a plain prompt")
    return encode_messages(tokenizer, [{"role": "user", "content": text}])
