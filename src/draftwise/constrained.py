"""Drafting under a grammar: its forced text as a free source, other sources' drafts cut where
it forbids them.

A grammar (``draftwise.grammar``) forces text wherever it leaves no choice (keys, quotes,
separators, a tool call's wrapper): those tokens are drafted at no cost as the source
``grammar``, and are always accepted. Another source's draft ends at its first token the
grammar forbids, so that no verified row is spent on a token the mask would refuse anyway;
a sampled draft's ``q`` at that token goes along, since the token after the block must then
correct it (``draftwise.verify.verify_sampling``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from typing import Any

import torch

from draftwise.constraint import Constraint, Triggered
from draftwise.drafters import EMPTY_PROPOSAL, Drafter, Proposal
from draftwise.events import GRAMMAR
from draftwise.lm import Passes
from draftwise.offers import Offer
from draftwise.verify import Verdict


class Constrained:
    """A drafter under a grammar: the grammar's forced tokens wherever it forces some (a
    source that costs nothing and is always grounded), elsewhere ``inner``'s drafts cut at
    their first token the grammar forbids. ``inner`` may be None (plain decoding but for the
    forced text).

    Where the grammar forces text, each of ``inner``'s sources is also offered after it, as
    one block: ``grammar+<source>`` drafts the forced tokens, then what the source drafts
    from the context as it will be once they are committed (forced tokens are the only ones
    the mask allows, so that context is certain).

    Example: an extraction's JSON with ``{"name": "`` committed and a value chosen; the
    grammar forces ``", "raises": [`` (5 tokens); an n-gram copy in progress offers 9
    more. ``grammar+ngram`` drafts all 14 in one pass: the policy prices the forced five as
    sure and the rest at the copy's acceptance (``Offer.sure``). The proposal is the
    n-gram drafter's, with its first five tokens marked ``forced`` (counted as the grammar's).
    """

    def __init__(self, inner: Drafter | None, constraint: Constraint | Triggered) -> None:
        self.inner = inner
        self.constraint = constraint
        self._forced: list[int] = []

    def start(self, prompt: Sequence[int], config: Any, generator: torch.Generator | None) -> None:
        if self.inner is not None:
            self.inner.start(prompt, config, generator)

    def offers(self, context: Sequence[int]) -> tuple[Offer, ...]:
        self._forced = self.constraint.forced()
        if not self._forced:
            return self.inner.offers(context) if self.inner is not None else ()
        sure = len(self._forced)
        own = Offer(GRAMMAR, limit=sure, cost_hint=0.0, grounded=True, sure=sure)
        if self.inner is None:
            return (own,)
        after = self.inner.offers([*context, *self._forced])
        return (own, *(_after_forced(offer, sure) for offer in after))

    def propose(self, context: Sequence[int], k: int, source: str | None = None) -> Passes[Proposal]:
        forced = self._forced[:k]
        if source == GRAMMAR or (source is None and forced) or (forced and len(forced) == k):
            return Proposal(tokens=torch.tensor(forced, dtype=torch.long), source=GRAMMAR, forced=len(forced))
        if self.inner is None:
            return EMPTY_PROPOSAL
        if source is not None and source.startswith(MIXED):
            source = source.removeprefix(MIXED)
        proposal = yield from self.inner.propose([*context, *forced], k - len(forced), source)
        return _joined(forced, _cut(proposal, self.constraint.cut(proposal.tokens.tolist(), forced)))

    def observe(self, context: Sequence[int], verdict: Verdict) -> None:
        if self.inner is not None:
            self.inner.observe(context, verdict)


MIXED = GRAMMAR + "+"  # the prefix of a source drafted after the grammar's forced tokens


def _after_forced(offer: Offer, sure: int) -> Offer:
    """``offer``, made after ``sure`` forced tokens, as a block that drafts them first."""
    return replace(
        offer,
        source=MIXED + offer.source,
        limit=None if offer.limit is None else sure + offer.limit,
        key=MIXED + offer.stats_key,
        sure=sure,
    )


def _cut(proposal: Proposal, keep: int) -> Proposal:
    """The first ``keep`` tokens of ``proposal``, whose next one the grammar refuses: that
    token's ``q`` stays as ``refused`` (verification rejects the token, see
    ``draftwise.verify.verify_sampling``)."""
    if keep == len(proposal):
        return proposal
    probs = proposal.probs[:keep] if proposal.probs is not None else None
    refused = proposal.probs[keep] if proposal.probs is not None else None
    return replace(proposal, tokens=proposal.tokens[:keep], probs=probs, refused=refused)


def _joined(forced: list[int], proposal: Proposal) -> Proposal:
    """``forced`` tokens, then ``proposal``'s, as one block (the forced ones a point mass)."""
    if not forced:
        return proposal
    head = torch.tensor(forced, dtype=torch.long)  # [f]
    probs = proposal.probs  # [k, V] or None
    if probs is not None:
        point = torch.zeros(len(forced), probs.shape[1], dtype=probs.dtype)  # [f, V]
        point[torch.arange(len(forced)), head] = 1.0
        probs = torch.cat([point, probs])  # [f + k, V]
    return replace(proposal, tokens=torch.cat([head, proposal.tokens]), probs=probs, forced=len(forced))
