"""Stop conditions and incremental detokenization.

A step can emit several tokens at once, so stops are checked token by token inside the
step and everything past a stop is dropped, however many tokens the target accepted.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from draftwise.lm import Tokenizer


class TextStream:
    """Releases decoded text as tokens arrive.

    Text is held back while it ends in an incomplete UTF-8 sequence or could still be the
    start of a stop string, so a stop string never leaks into the output.

    Each push decodes only a short window, never the whole generation (which would make
    streaming quadratic in its length): the text of ``tokens[_prefix:]`` minus that of
    ``tokens[_prefix:_read]``. The context tokens before ``_read`` keep tokenizers honest
    that decode a word's leading space differently at the start of a string.
    """

    def __init__(self, tokenizer: Tokenizer, stop: Sequence[str]) -> None:
        self.tokenizer = tokenizer
        self.stop = tuple(stop)
        self.tokens: list[int] = []
        self._prefix = 0  # decode windows start at this token
        self._read = 0  # text of tokens before this one is settled (complete characters)
        self._base = ""  # text of tokens[_prefix:_read]
        self._pending = ""  # settled text not released yet (a possible stop-string start)

    def decode(self, tokens: Sequence[int]) -> str:
        return self.tokenizer.decode(list(tokens), skip_special_tokens=True)

    def find_stop(self, text: str) -> int:
        """Index where the first stop string starts in ``text``, or -1."""
        hits = [i for i in (text.find(s) for s in self.stop) if i >= 0]
        return min(hits) if hits else -1

    def _tail(self, extra: Sequence[int] = ()) -> str:
        """Text of the tokens after ``_read`` (plus ``extra``), decoded in context."""
        window = self.decode(self.tokens[self._prefix :] + list(extra))
        return window[len(self._base) :]

    def _settle(self) -> str:
        """Move the tail into the settled text when it ends on a complete character;
        return what is still unsettled."""
        tail = self._tail()
        if not tail or tail.endswith("\ufffd"):  # an incomplete multi-byte character
            return tail
        self._pending += tail
        self._prefix, self._read = self._read, len(self.tokens)
        self._base = self.decode(self.tokens[self._prefix : self._read])
        return ""

    def _stop_prefix(self, text: str) -> int:
        """Length of the longest end of ``text`` that could begin a stop string."""
        longest = 0
        for s in self.stop:
            for n in range(min(len(s) - 1, len(text)), longest, -1):
                if text.endswith(s[:n]):
                    longest = n
                    break
        return longest

    def push(self, tokens: Sequence[int]) -> tuple[int, str, bool]:
        """Append ``tokens``; return (how many to keep, new text, whether a stop string hit).

        On a stop-string hit only the tokens needed to reach it are kept, and the text ends
        before the stop string.
        """
        if self.stop:
            for n in range(1, len(tokens) + 1):
                # A stop string cannot start in released text: its start would have been
                # held back, so the unreleased text is all that needs searching.
                text = self._pending + self._tail(tokens[:n])
                cut = self.find_stop(text)
                if cut >= 0:
                    self.tokens.extend(tokens[:n])
                    self._pending = ""
                    return n, text[:cut], True
        self.tokens.extend(tokens)
        self._settle()
        # An unsettled tail is never released; of the settled text, everything but a
        # possible stop-string start goes out.
        end = len(self._pending) - self._stop_prefix(self._pending)
        out, self._pending = self._pending[:end], self._pending[end:]
        return len(tokens), out, False

    def flush(self) -> str:
        """Release whatever was held back (at the end of generation)."""
        out = self._pending + self._tail()
        self._pending = ""
        self._prefix = self._read = len(self.tokens)
        self._base = ""
        return out


def first_eos(tokens: Sequence[int], eos_ids: set[int]) -> int:
    """Index of the first EOS token in ``tokens``, or -1."""
    for i, token in enumerate(tokens):
        if token in eos_ids:
            return i
    return -1
