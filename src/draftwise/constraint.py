"""One stream's grammar state, and how a grammar fails.

``Constraint`` follows a stream's committed tokens with an llguidance matcher: the tokens the
grammar allows at each row of a block (masks), the text it forces next, where another
source's draft must be cut. ``Triggered`` is one that applies only from its trigger on (a
tool call's opening tag). ``Grammars`` (``draftwise.grammar``) compiles them.

A grammar that cannot be compiled or followed raises ``GrammarError``, one line long
(``llguidance_reason`` shortens llguidance's complaints); an answer that reaches a point its
grammar allows no way on from ends with ``GrammarDeadEnd``.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch

from draftwise.errors import DraftwiseError

REASON_CHARS = 200  # the longest piece of llguidance's complaint a message quotes

# llguidance's complaints: a row over its item limit, and the stop reasons that mean the
# grammar allows no further text.
_ROW = re.compile(r"current row has (\d+) items; max is (\d+)", re.IGNORECASE)
_NO_WAY_ON = frozenset({"NoExtension", "NoExtensionBias"})
_TOO_COMPLEX = frozenset({"ParserTooComplex", "LexerTooComplex"})


class GrammarError(DraftwiseError, ValueError):
    """A grammar or schema that cannot be compiled or cannot be followed; the message says
    why (one line)."""


class GrammarDeadEnd(GrammarError):
    """An answer reached a point where its grammar allows no way on: llguidance hit one of its
    limits (too many alternatives at once, a lexer too large) on text the check before the
    answer could not see coming, or the grammar can never be completed. The answer ends
    there with this error, never as a normal stop with text that breaks the grammar.

    Its status stays a 400: what fails is the request's own schema or grammar (a client that
    sends it again gets the same failure), not the server, and the server answers every
    fault of a request's with a 400 (its API document lists no 422)."""


def llguidance_reason(message: str) -> str:
    """llguidance's complaint as a short line: its first line only (what follows is the parser's
    state and the grammar itself, up to hundreds of KB, or a panic's backtrace), no longer
    than ``REASON_CHARS``.

    Example: ``"Parser Error: Current row has 12007 items; max is 2000; ...\\n<state>..."``
    gives ``"too many alternatives at one point (12007 parser items, the limit is 2000), as
    with many optional properties"``.
    """
    lines = [line.strip() for line in message.splitlines()]
    first = next((line for line in lines if line and not line.startswith("<")), "")
    row = _ROW.search(first)
    if first.startswith("panic"):
        # An assertion inside llguidance (a grammar of more than 65,000 symbols is one).
        return "llguidance failed on it (an internal limit: the grammar is probably too large)"
    if row is not None:
        return (
            f"too many alternatives at one point ({row[1]} parser items, the limit is {row[2]}), "
            "as with many optional properties"
        )
    if first in _NO_WAY_ON:
        return "no text can complete it"
    if first in _TOO_COMPLEX:
        return "it is too complex for llguidance"
    if not first:
        return "llguidance gave no reason"
    return first if len(first) <= REASON_CHARS else first[: REASON_CHARS - 1] + "…"


class Constraint:
    """One stream's grammar state: what it allows next, given the tokens committed so far.

    The matcher only ever holds committed tokens: a block is walked through (``masks``) and
    rolled back at once.
    """

    def __init__(self, matcher: Any, vocab_size: int, name: str = "grammar") -> None:
        self.matcher = matcher
        self.vocab_size = vocab_size
        self.words = (vocab_size + 31) // 32
        self.name = name  # what messages call the grammar ("JSON schema", ...)

    def _dead_end(self) -> GrammarDeadEnd:
        reason = llguidance_reason(self.matcher.get_error()) if self.matcher.is_error() else "no text can complete it"
        return GrammarDeadEnd(f"the output reached a point the {self.name} cannot go past: {reason}")

    def _alive(self) -> None:
        """Raise ``GrammarDeadEnd`` once llguidance has put the matcher in its error state. It
        never leaves that state, and its masks then allow nothing but the end of the text: the
        answer would stop there, broken, as if it were complete."""
        if self.matcher.is_error():
            raise self._dead_end()

    def forced(self) -> list[int]:
        """Tokens the grammar forces next (empty where the model has a choice)."""
        self._alive()
        forced = [] if self.matcher.is_stopped() else list(self.matcher.compute_ff_tokens())
        self._alive()
        return forced

    def cut(self, tokens: Sequence[int], after: Sequence[int] = ()) -> int:
        """How many of ``tokens`` the grammar allows in a row from here (once ``after`` is committed too)."""
        entered = self._enter(after) if len(tokens) else None
        if entered is None:
            self._alive()
            return 0
        try:
            return int(self.matcher.validate_tokens(list(tokens)))
        finally:
            self._leave(entered)
            self._alive()

    def _enter(self, tokens: Sequence[int]) -> int | None:
        """Follow ``tokens`` for a moment (``_leave(n)`` undoes it, ``n`` returned here), or
        None where the grammar does not take them all (then nothing is followed)."""
        tokens = [int(t) for t in tokens]
        if self.matcher.validate_tokens(tokens) < len(tokens):
            return None
        return self._follow(tokens)

    def _follow(self, tokens: Sequence[int]) -> int:
        """Consume ``tokens``, each one the grammar takes, and return how many the matcher's
        history holds: a rollback must undo that many, no more. A stopped matcher takes its
        end token without keeping it (llguidance), so nothing is fed once it has stopped.

        Example: JSON schema, committed ``{"ok": ``, block ``f a l s e } <eos>``: the
        matcher has stopped after ``}``; 6 are followed and rolled back, not 7, which would
        undo the space after the colon too.
        """
        followed = 0
        for token in tokens:
            if self.matcher.is_stopped():
                break
            self.matcher.consume_token(int(token))
            followed += 1
        return followed

    def _leave(self, followed: int) -> None:
        if followed:
            self.matcher.rollback(followed)

    def masks(self, block: Sequence[int], after: Sequence[int] = ()) -> torch.Tensor:  # [k + 1, W] int32
        """The allowed tokens at each row a verification of ``block`` scores (row i: after
        ``block[:i]``), once ``after`` is committed as well, as a bitmask
        (``draftwise.verify.pack_bits``: bit ``j % 32`` of word ``j // 32`` allows token ``j``).
        Rows past a token the grammar refuses allow nothing (drafts are cut before that).

        Example: grammar ``"ab" | "ac"``, spelt one character a token, nothing committed,
        block ``[a]``: row 0 allows ``a`` only, row 1 allows ``b`` and ``c``.
        """
        bits = np.zeros((len(block) + 1, self.words), dtype=np.int32)
        entered = self._enter(after)
        if entered is None:
            raise self._dead_end()
        # Only what the grammar takes is walked: a refused token would leave the matcher broken.
        tokens = [int(t) for t in block]
        valid = tokens[: self.matcher.validate_tokens(tokens)] if tokens else []
        followed = 0
        for i in range(len(valid) + 1):
            row = bits[i]
            self.matcher.unsafe_compute_mask_ptr(row.ctypes.data, row.nbytes)
            if i < len(valid):
                followed += self._follow(valid[i : i + 1])
        # A limit hit anywhere on the walk (a drafted token the target may yet refuse
        # included) leaves the matcher in its error state for good: the answer cannot go on
        # under the grammar, whichever token the target picks.
        self._alive()
        self._leave(followed)
        self._leave(entered)
        return torch.from_numpy(bits)

    def commit(self, tokens: Sequence[int]) -> None:
        """Follow the committed ``tokens`` (a finished grammar takes nothing more); raise
        ``GrammarDeadEnd`` where the grammar cannot take them."""
        for token in tokens:
            self._alive()
            if self.matcher.is_stopped():
                return
            if not self.matcher.consume_token(int(token)):
                raise self._dead_end()
        self._alive()

    @property
    def finished(self) -> bool:
        """Whether the text so far is complete under the grammar."""
        return bool(self.matcher.is_accepting())


class Triggered:
    """A grammar that applies only from its trigger on: the output is free text until its text
    holds the ``trigger`` (a tool call's opening tag, which the grammar itself starts with), and
    follows the grammar from there, the trigger included. Same interface as ``Constraint``.

    The trigger is found in the text, not in its tokenizer's tokens for it: a model may write
    the tag in other tokens (SmolLM2 writes ``" <tool_call>"`` as ``" <"``, ``"tool"``, ...),
    and a call written so must not go unconstrained (a second call, a broken one). The grammar
    is then given the trigger's text, from its first byte to the end of the token that
    completes it, in the tokenizer's own tokens (the same bytes, so the same grammar state).

    Example: trigger ``"T"`` (token ``T``), block ``[a, T, b]``: rows 0 and 1 (scoring ``a``
    and ``T``) are free text; row 2 scores the token after ``a T``, the grammar's first after
    its opening ``T``, and row 3 the one after ``T b``.
    """

    def __init__(
        self, inner: Constraint, trigger: str, spelling: Sequence[bytes], tokenize: Callable[[bytes], list[int]]
    ) -> None:
        self.inner = inner
        self.opening = trigger.encode("utf-8")
        self.spelling = spelling  # each token's bytes
        self.tokenize = tokenize  # bytes to the tokenizer's own tokens
        self.active = False
        self._tail = b""  # the end of the committed text, while waiting (a trigger may span commits)

    def _start(self, tokens: Sequence[int]) -> tuple[int, list[int]] | None:
        """Where the trigger first ends in ``tokens``: (the index just past the token that
        completes it, the tokens the grammar takes for the text from the trigger's first byte
        to that token's end); None if it does not end there."""
        text = self._tail
        for i, token in enumerate(tokens):
            text += self._spelt(token)
            at = text.find(self.opening)
            if at >= 0:
                return i + 1, self.tokenize(text[at:])
        return None

    def _spelt(self, token: int) -> bytes:
        token = int(token)
        return self.spelling[token] if token < len(self.spelling) else b""  # past the tokenizer: padding ids

    def forced(self) -> list[int]:
        return self.inner.forced() if self.active else []

    def cut(self, tokens: Sequence[int], after: Sequence[int] = ()) -> int:
        if self.active:
            return self.inner.cut(tokens, after)
        # Forced text (``after``) comes only once the grammar is active.
        found = self._start(tokens)
        return len(tokens) if found is None else found[0] + self.inner.cut(tokens[found[0] :], found[1])

    def masks(self, block: Sequence[int]) -> torch.Tensor | None:  # [k + 1, W] int32, None: all allowed
        if self.active:
            return self.inner.masks(block)
        found = self._start(block)
        if found is None:
            return None
        start, opening = found
        rows = torch.full((len(block) + 1, self.inner.words), -1, dtype=torch.int32)  # every bit: free
        rows[start:] = self.inner.masks(block[start:], opening)
        return rows

    def commit(self, tokens: Sequence[int]) -> None:
        if self.active:
            self.inner.commit(tokens)
            return
        found = self._start(tokens)
        if found is None:
            keep = len(self.opening) - 1  # what could be the trigger's start
            text = self._tail + b"".join(self._spelt(t) for t in tokens)
            self._tail = text[-keep:] if keep else b""
            return
        start, opening = found
        self.active = True
        self.inner.commit(opening)
        self.inner.commit(tokens[start:])

    @property
    def finished(self) -> bool:
        return self.active and self.inner.finished
