"""Stop conditions and incremental detokenization.

A step can emit several tokens at once, so stops are checked token by token inside the
step and everything past a stop is dropped, however many tokens the target accepted.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any


class TextStream:
    """Releases decoded text as tokens arrive.

    Text is held back while it ends in an incomplete UTF-8 sequence or could still be the
    start of a stop string, so a stop string never leaks into the output.
    """

    def __init__(self, tokenizer: Any, stop: Sequence[str]) -> None:
        self.tokenizer = tokenizer
        self.stop = tuple(stop)
        self.tokens: list[int] = []
        self.released = 0  # characters of the decoded text already handed out

    def decode(self, tokens: Sequence[int]) -> str:
        return self.tokenizer.decode(list(tokens), skip_special_tokens=True)

    def find_stop(self, text: str) -> int:
        """Index where the first stop string starts in ``text``, or -1."""
        hits = [i for i in (text.find(s) for s in self.stop) if i >= 0]
        return min(hits) if hits else -1

    def _holdback(self, text: str) -> int:
        """Characters at the end of ``text`` that may not be released yet."""
        if text.endswith("\ufffd"):  # an incomplete multi-byte character
            return 1
        longest = 0
        for s in self.stop:
            for n in range(min(len(s) - 1, len(text)), 0, -1):
                if text.endswith(s[:n]):
                    longest = max(longest, n)
                    break
        return longest

    def push(self, tokens: Sequence[int]) -> tuple[int, str, bool]:
        """Append ``tokens``; return (how many to keep, new text, whether a stop string hit).

        On a stop-string hit only the tokens needed to reach it are kept, and the text ends
        before the stop string.
        """
        if not self.stop:
            self.tokens.extend(tokens)
            text = self.decode(self.tokens)
            end = len(text) - (1 if text.endswith("\ufffd") else 0)
            return len(tokens), self._release(text, end), False
        for n in range(1, len(tokens) + 1):
            text = self.decode(self.tokens + list(tokens[:n]))
            cut = self.find_stop(text)
            if cut >= 0:
                self.tokens.extend(tokens[:n])
                return n, self._release(text, cut), True
        self.tokens.extend(tokens)
        text = self.decode(self.tokens)
        return len(tokens), self._release(text, len(text) - self._holdback(text)), False

    def flush(self) -> str:
        """Release whatever was held back (at the end of generation)."""
        text = self.decode(self.tokens)
        return self._release(text, len(text))

    def _release(self, text: str, end: int) -> str:
        if end <= self.released:
            return ""
        out = text[self.released : end]
        self.released = end
        return out


def first_eos(tokens: Sequence[int], eos_ids: set[int]) -> int:
    """Index of the first EOS token in ``tokens``, or -1."""
    for i, token in enumerate(tokens):
        if token in eos_ids:
            return i
    return -1
