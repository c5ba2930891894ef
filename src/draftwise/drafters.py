"""Drafters: cheap proposers of the next few tokens.

Every drafter speaks the same protocol, so the decode loop never asks which one it has:
``start`` once per sequence, ``propose`` a block, ``observe`` the verdict.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import torch

from draftwise.config import DrafterKind, GenerationConfig
from draftwise.lm import LanguageModel, prefill, sync
from draftwise.verify import Verdict, logits_to_probs, sample


@dataclass(frozen=True)
class Proposal:
    """A proposed block of draft tokens.

    ``probs`` holds the draft distribution ``q`` at each position (what the rejection rule
    needs); ``None`` means the drafter is deterministic (a point mass on each token).
    """

    tokens: torch.Tensor  # [k] long
    probs: torch.Tensor | None = None  # [k, V] float32 or None

    def __len__(self) -> int:
        return int(self.tokens.shape[0])

    def token_probs(self) -> list[float]:
        """q(x_i) of each proposed token (1.0 for a point mass)."""
        if self.probs is None:
            return [1.0] * len(self)
        return self.probs.gather(1, self.tokens[:, None]).squeeze(1).tolist()


EMPTY_PROPOSAL = Proposal(tokens=torch.empty(0, dtype=torch.long))


@runtime_checkable
class Drafter(Protocol):
    """The one interface every drafter implements."""

    def start(self, prompt: Sequence[int], config: GenerationConfig, generator: torch.Generator | None) -> None:
        """Begin a new sequence (e.g. prefill a draft model's cache)."""

    def propose(self, context: Sequence[int], k: int) -> Proposal:
        """Propose up to ``k`` tokens to follow ``context`` (the committed tokens so far)."""

    def observe(self, context: Sequence[int], verdict: Verdict) -> None:
        """Learn the verdict on the last proposal; ``context`` is the committed sequence after it."""


class ModelDrafter:
    """A smaller LM sharing the target's tokenizer drafts autoregressively.

    Confidence early stop: once the draft's top-1 probability at a position falls below
    ``confidence_threshold``, that token is still proposed (its cost is already paid and the
    target checks it for free within the same pass) but no further token is drafted.
    """

    def __init__(self, lm: LanguageModel) -> None:
        self.lm = lm
        self._config = GenerationConfig()
        self._generator: torch.Generator | None = None

    def start(self, prompt: Sequence[int], config: GenerationConfig, generator: torch.Generator | None) -> None:
        self._config = config
        self._generator = generator
        prefill(self.lm, prompt)

    def propose(self, context: Sequence[int], k: int) -> Proposal:
        if k <= 0:
            return EMPTY_PROPOSAL
        sampling = self._config.sampling
        threshold = self._config.draft.confidence_threshold
        # proposal_top narrows q to its N most likely tokens; lossless because the rejection
        # rule receives exactly the q sampled from. Greedy drafting only reports q.
        top_k, top_n = sampling.top_k, self._config.draft.proposal_top
        if top_n and not sampling.greedy:
            top_k = min(top_k or top_n, top_n)
        feed = sync(self.lm, context)
        tokens: list[int] = []
        rows: list[torch.Tensor] = []
        for _ in range(k):
            logits = self.lm.forward(feed, last=1)  # [1, V]
            q = logits_to_probs(logits, sampling.temperature, top_k, sampling.top_p)[0]
            if sampling.greedy:
                token = int(logits[0].argmax())
            else:
                token = sample(q, self._generator)
            tokens.append(token)
            rows.append(q)
            if threshold > 0 and float(q.max()) < threshold:
                break
            feed = [token]
        return Proposal(tokens=torch.tensor(tokens, dtype=torch.long), probs=torch.stack(rows))

    def observe(self, context: Sequence[int], verdict: Verdict) -> None:
        # Drop rejected draft tokens now so the cache never holds more than it must.
        sync(self.lm, context)


class NGramDrafter:
    """Prompt lookup: find the latest earlier occurrence of the context's last ``n`` tokens
    and propose what followed it, trying ``n`` from ``ngram_max`` down to ``ngram_min``.

    An index from each n-gram to the latest position where it ended is kept up to date
    incrementally, so a lookup costs O(1) rather than a scan of the context.

    Example: context ``[a b c x a b]`` with n = 2: the suffix ``a b`` last occurred ending at
    position 1, followed by ``c x a ...``, so ``[c, x, a]`` is proposed for k = 3.
    """

    def __init__(self, min_n: int = 1) -> None:
        self.min_n = min_n  # floor under the config's ngram_min
        self._config = GenerationConfig()
        self._index: dict[int, dict[tuple[int, ...], int]] = {}
        self._indexed = 0  # n-grams ending before this position are in the index

    def start(self, prompt: Sequence[int], config: GenerationConfig, generator: torch.Generator | None) -> None:
        self._config = config
        draft = config.draft
        self._index = {n: {} for n in range(min(max(draft.ngram_min, self.min_n), draft.ngram_max),
                                            draft.ngram_max + 1)}
        self._indexed = 0

    def _extend_index(self, context: Sequence[int]) -> None:
        # The n-grams ending at the last position are left out: the suffix must match an
        # *earlier* occurrence, not itself.
        for end in range(self._indexed, len(context) - 1):
            for n, table in self._index.items():
                if end + 1 >= n:
                    table[tuple(context[end + 1 - n : end + 1])] = end
        self._indexed = max(self._indexed, len(context) - 1)

    def propose(self, context: Sequence[int], k: int) -> Proposal:
        if k <= 0 or not context:
            return EMPTY_PROPOSAL
        self._extend_index(context)
        for n in sorted(self._index, reverse=True):
            if n > len(context):
                continue
            end = self._index[n].get(tuple(context[len(context) - n :]))
            if end is not None:
                follow = list(context[end + 1 : end + 1 + k])
                return Proposal(tokens=torch.tensor(follow, dtype=torch.long))
        return EMPTY_PROPOSAL

    def observe(self, context: Sequence[int], verdict: Verdict) -> None:
        """Nothing to learn: the index catches up with the context on the next proposal."""


class HybridDrafter:
    """Prompt lookup where the context repeats itself, the draft model everywhere else.

    Each step asks the n-gram drafter first, with suffixes of at least ``min_n`` tokens
    (a one-token match is too often wrong to displace a real draft): a match costs nothing
    and, where the output copies its context (summaries, answers quoting a document, a second
    turn reusing the first), it is usually right for many tokens. With no match, or one that
    would propose fewer than two tokens, the draft model proposes. Both observe every
    verdict; the draft model's cache catches up with tokens it did not draft when it is next
    asked (``draftwise.lm.sync``).

    Example: context ``[5 8 2 9 4 1 ... 5 8 2]`` with ``k = 3``: the suffix ``5 8 2`` occurred
    before, so ``[9 4 1]`` comes from the context for free; had only ``8 2`` repeated, the
    draft model would draft.
    """

    def __init__(self, model: ModelDrafter, min_n: int = 3) -> None:
        self.model = model
        self.ngram = NGramDrafter(min_n=min_n)

    def start(self, prompt: Sequence[int], config: GenerationConfig, generator: torch.Generator | None) -> None:
        self.model.start(prompt, config, generator)
        self.ngram.start(prompt, config, generator)

    def propose(self, context: Sequence[int], k: int) -> Proposal:
        lookup = self.ngram.propose(context, k)
        if len(lookup) >= min(k, 2):
            return lookup
        return self.model.propose(context, k)

    def observe(self, context: Sequence[int], verdict: Verdict) -> None:
        self.model.observe(context, verdict)
        self.ngram.observe(context, verdict)


def build_drafter(kind: DrafterKind, draft: LanguageModel | None) -> Drafter:
    """The drafter called ``kind``, drafting with ``draft`` where it needs a model."""
    if kind == "ngram":
        return NGramDrafter()
    if draft is None:
        raise ValueError(f"drafter {kind!r} needs a draft model")
    model = ModelDrafter(draft)
    return HybridDrafter(model) if kind == "hybrid" else model
