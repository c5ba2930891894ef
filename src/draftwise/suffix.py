"""Drafting from what was written before: a suffix source across requests.

An agent re-emits the same tool-call JSON turn after turn; a pipeline asks one template over
hundreds of records; a refine loop rewrites its last answer in a fresh conversation. Their
prompts do not hold that text, so prompt lookup (``draftwise.drafters.NGramDrafter``) cannot
draft it, but the server wrote it before. SuffixDecoding (Oliaro et al., 2025) drafts from a
tree over earlier outputs; here:

- ``SuffixIndex`` keeps the earlier outputs of one scope as one token sequence (each after
  the last few tokens of its prompt, and a separator), with an index from each suffix of a
  few lengths (``SuffixConfig.orders``) to where it ended most recently;
- ``SuffixStore`` holds the indexes of every scope under one cap in tokens, evicting the
  oldest output first, behind one lock (streams read it in the rounds while finished
  outputs are added from another thread);
- ``SuffixDrafter`` is the source: the longest suffix of the context found among earlier
  outputs, and the continuation most of its occurrences share.

Example (orders 2 and 4): earlier outputs ``[7 1 2 3 4 -]`` and ``[9 1 2 3 5 -]``, context
``[... 1 2 3]``. ``2 3`` ended at both, each continued differently: no majority, no block.
Context ``[... 8 1 2]``: ``1 2`` ended at both, both go on with ``3``, then split (``4``
against ``5``): the block is ``[3]``. A third output ``[1 2 3 4 6 -]`` gives ``4`` two of
three votes, and the block is ``[3 4]``.
"""

from __future__ import annotations

import hashlib
import json
import os
import threading
from collections import Counter, deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from draftwise.config import MAX_BLOCK, GenerationConfig, SuffixConfig
from draftwise.drafters import EMPTY_PROPOSAL, Proposal
from draftwise.events import SUFFIX
from draftwise.lm import Passes, Tokenizer, ready
from draftwise.offers import Offer
from draftwise.verify import Verdict

SEPARATOR = -1  # ends each output in an index: no continuation runs past it
CACHE_FORMAT = "draftwise-suffix-cache/1"


@dataclass(frozen=True)
class Match:
    """The context's last ``order`` tokens ended earlier outputs at ``ends`` (absolute
    positions in the index, oldest first)."""

    order: int
    ends: tuple[int, ...]


def suffix_keys(tokens: Sequence[int], orders: Sequence[int]) -> list[tuple[int, int, int]]:
    """(order, hash, offset of its last token) of every suffix of ``tokens`` worth indexing:
    those with a token after them (the last token's continuation is the separator)."""
    return [
        (order, hash(tuple(tokens[i + 1 - order : i + 1])), i)
        for i in range(len(tokens) - 1)
        for order in orders
        if i + 1 >= order
    ]


class SuffixIndex:
    """One scope's earlier outputs: the tokens, and where each suffix of ``orders`` ended.
    Not locked itself: ``SuffixStore`` holds the lock around every use."""

    def __init__(self, orders: Sequence[int], occurrences: int) -> None:
        self.orders = tuple(orders)
        self.occurrences = occurrences
        self._tokens: list[int] = []
        self._base = 0  # the absolute position of _tokens[0]: evicted outputs leave from the front
        self._lengths: deque[int] = deque()  # each output's length with its separator, oldest first
        # order -> hash of a suffix of that length -> where it ended, latest last
        self._ends: dict[int, dict[int, list[int]]] = {order: {} for order in self.orders}

    @property
    def size(self) -> int:
        return len(self._tokens)

    @property
    def documents(self) -> int:
        return len(self._lengths)

    def documents_tokens(self) -> list[list[int]]:
        """Each output as added, oldest first."""
        found, start = [], 0
        for length in self._lengths:
            found.append(self._tokens[start : start + length - 1])
            start += length
        return found

    def add(self, tokens: Sequence[int], keys: Sequence[tuple[int, int, int]]) -> None:
        """Keep ``tokens``, whose ``suffix_keys`` are ``keys`` (hashed before the lock is taken)."""
        start = self._base + len(self._tokens)
        self._tokens.extend(tokens)
        self._tokens.append(SEPARATOR)
        self._lengths.append(len(tokens) + 1)
        for order, key, offset in keys:
            ends = self._ends[order].setdefault(key, [])
            ends.append(start + offset)
            if len(ends) > self.occurrences:
                del ends[0]

    def evict_oldest(self) -> int:
        """Drop the oldest output; the tokens freed."""
        length = self._lengths.popleft()
        base = self._base + length
        for order, key, _ in suffix_keys(self._tokens[: length - 1], self.orders):
            ends = self._ends[order].get(key)
            if ends is None:
                continue
            while ends and ends[0] < base:  # the oldest output's positions are everyone's smallest
                del ends[0]
            if not ends:
                del self._ends[order][key]
        del self._tokens[:length]
        self._base = base
        return length

    def match(self, context: Sequence[int]) -> Match | None:
        """The longest indexed suffix of ``context`` that ended an earlier output."""
        for order in reversed(self.orders):
            if len(context) < order:
                continue
            tail = list(context[len(context) - order :])
            ends = self._ends[order].get(hash(tuple(tail)))
            # A hash names a suffix; the tokens say whether it is this one.
            real = tuple(e for e in ends or () if self._at(e + 1 - order, e + 1) == tail)
            if real:
                return Match(order, real)
        return None

    def _at(self, start: int, end: int) -> list[int]:
        return self._tokens[start - self._base : end - self._base]

    def continuation(self, match: Match, limit: int) -> list[int]:
        """Up to ``limit`` tokens after ``match``: at each position the token most of the
        occurrences still followed share, while more than half of them share it."""
        base = self._base
        # What followed each occurrence; every output ends with a separator, where its own stops.
        follows = [self._tokens[e + 1 - base : e + 1 - base + limit] for e in match.ends]
        block: list[int] = []
        while follows:
            # As far as they all agree (the common case: text repeated), no vote is needed.
            common = list(os.path.commonprefix(follows))
            if SEPARATOR in common:
                return block + common[: common.index(SEPARATOR)]
            block += common
            depth = len(common)
            nexts = [f[depth] if depth < len(f) else SEPARATOR for f in follows]
            token, count = Counter(nexts).most_common(1)[0]
            if token == SEPARATOR or 2 * count <= len(follows):
                break
            follows = [f[depth + 1 :] for f, t in zip(follows, nexts) if t == token]
            block.append(token)
        return block[:limit]


class SuffixStore:
    """Earlier outputs by scope, under one cap, behind one lock: a request drafts from its
    scope's (``drafter``), a finished one adds its output (``add``)."""

    def __init__(self, config: SuffixConfig) -> None:
        self.config = config
        self._lock = threading.Lock()
        self._indexes: dict[str, SuffixIndex] = {}
        self._order: deque[str] = deque()  # the scope of each output, oldest first
        self._size = 0

    def scope(self, key: str | None) -> str | None:
        """The scope of a request sending API key ``key`` (None: it sent none); None where
        the server shares nothing. Keys are kept as digests, never as themselves."""
        if self.config.scope == "none" or self.config.cap_tokens == 0:
            return None
        if self.config.scope == "global" or key is None:
            return ""
        return hashlib.sha256(key.encode()).hexdigest()[:16]

    @property
    def size(self) -> int:
        """Tokens kept, separators included."""
        return self._size

    @property
    def documents(self) -> int:
        return len(self._order)

    def add(self, scope: str, prompt: Sequence[int], output: Sequence[int]) -> None:
        """Keep ``output`` (after the end of ``prompt``) in ``scope``; with ``config.prompts``,
        the prompt too. The oldest outputs go while the store is over its cap."""
        lead = self.config.lead_tokens
        docs = [list(prompt)] if self.config.prompts and prompt else []
        if output:
            docs.append(list(prompt[len(prompt) - lead :] if lead else ()) + list(output))
        self._add(scope, docs)

    def _add(self, scope: str, docs: Sequence[list[int]]) -> None:
        """Keep ``docs`` in ``scope``, each cut to its last tokens that fit the cap. The hashing
        is done before the lock is taken: streams look up under it between their passes."""
        config = self.config
        cut = [doc[max(0, len(doc) + 1 - config.cap_tokens) :] for doc in docs]
        keyed = [(doc, suffix_keys(doc, config.orders)) for doc in cut if doc]
        with self._lock:
            for doc, keys in keyed:
                self._keep(scope, doc, keys)

    def _keep(self, scope: str, doc: list[int], keys: list[tuple[int, int, int]]) -> None:
        config = self.config
        self._indexes.setdefault(scope, SuffixIndex(config.orders, config.occurrences)).add(doc, keys)
        self._order.append(scope)
        self._size += len(doc) + 1
        while self._size > config.cap_tokens and self._order:
            oldest = self._order.popleft()
            index = self._indexes[oldest]
            self._size -= index.evict_oldest()
            if not index.documents:
                del self._indexes[oldest]

    def draft(self, scope: str, context: Sequence[int], limit: int) -> tuple[int, list[int]]:
        """(the match's length, its continuation of up to ``limit`` tokens) in ``scope``;
        (0, []) without one."""
        with self._lock:
            index = self._indexes.get(scope)
            found = index.match(context) if index is not None else None
            if index is None or found is None:
                return 0, []
            return found.order, index.continuation(found, limit)

    def drafter(self, scope: str) -> SuffixDrafter:
        return SuffixDrafter(lambda context, limit: self.draft(scope, context, limit), self.config.orders[-1])

    def save(self, path: Path, vocabulary: str) -> None:
        """Write every scope's outputs, oldest first, for ``load`` after a restart."""
        with self._lock:
            docs = [[scope, tokens] for scope, index in self._indexes.items() for tokens in index.documents_tokens()]
        path.write_text(json.dumps({"format": CACHE_FORMAT, "vocabulary": vocabulary, "documents": docs}))

    def load(self, path: Path, vocabulary: str) -> str | None:
        """Read what ``save`` wrote; what went wrong in one line (the store stays empty), or None."""
        try:
            data = json.loads(path.read_text())
            if data.get("format") != CACHE_FORMAT or data.get("vocabulary") != vocabulary:
                return f"suffix cache {path}: written for another model or version; starting empty"
            docs = [(str(scope), [int(t) for t in tokens]) for scope, tokens in data["documents"]]
        except FileNotFoundError:
            return None
        except (OSError, ValueError, TypeError, KeyError, AttributeError) as exc:
            return f"suffix cache {path} unreadable ({type(exc).__name__}); starting empty"
        for scope, tokens in docs:
            self._add(scope, [tokens])
        return None


def vocabulary_digest(tokenizer: Tokenizer) -> str:
    """What names a vocabulary: a cache of token ids means nothing under another one."""
    return hashlib.sha256(b"\0".join(tokenizer.token_bytes())).hexdigest()[:16]


class SuffixDrafter:
    """Drafts the continuation earlier outputs share after the context's longest suffix
    found among them (``lookup``: a scope of a ``SuffixStore``).

    While the output follows the block it drafted, the block goes on from where the output
    is, with no new lookup: a copy in progress, whose acceptance is kept apart. Otherwise
    acceptance is kept per match length: a 32-token match is right far more often than a
    2-token one. Only a copy whose match is as long as the longest looked up (``longest``) is
    grounded, so that the cost policy may give it long blocks: another request's answer
    leaves the output where their values differ, and a long block lost there costs a pass of
    many rows.
    """

    def __init__(self, lookup: Callable[[Sequence[int], int], tuple[int, list[int]]], longest: int) -> None:
        self.lookup = lookup
        self.longest = longest
        self._order = 0  # the match's length: the lookup's, grown by each token copied since
        self._block: list[int] = []
        self._at = -1  # the context length the block follows
        self.copying = False

    def start(self, prompt: Sequence[int], config: GenerationConfig, generator: torch.Generator | None) -> None:
        self._order, self._block, self._at, self.copying = 0, [], -1, False

    def _follow(self, context: Sequence[int]) -> None:
        grown = len(context) - self._at
        if grown == 0:
            return
        if 0 < grown < len(self._block) and list(context[self._at :]) == self._block[:grown]:
            self._block, self._order, self.copying = self._block[grown:], self._order + grown, True
        else:
            (self._order, self._block), self.copying = self.lookup(context, MAX_BLOCK), False
        self._at = len(context)

    def offers(self, context: Sequence[int]) -> tuple[Offer, ...]:
        self._follow(context)
        if not self._block:
            return ()
        key = f"{SUFFIX}:copy" if self.copying else f"{SUFFIX}:{self._order}"
        grounded = self.copying and self._order >= self.longest
        return (Offer(SUFFIX, limit=len(self._block), key=key, cost_hint=0.0, grounded=grounded),)

    def propose(self, context: Sequence[int], k: int, source: str | None = None) -> Passes[Proposal]:
        self._follow(context)
        if k <= 0 or not self._block:
            return ready(EMPTY_PROPOSAL)
        return ready(Proposal(tokens=torch.tensor(self._block[:k], dtype=torch.long), source=SUFFIX))

    def observe(self, context: Sequence[int], verdict: Verdict) -> None:
        """Nothing to learn: the next ``offers`` follows the committed tokens."""
