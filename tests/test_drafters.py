"""Drafters: n-gram lookup rules and the draft model's cache across steps."""

from __future__ import annotations

import pytest
import torch

from draftwise import (
    DraftConfig,
    Drafter,
    GenerationConfig,
    HybridDrafter,
    ModelDrafter,
    NGramDrafter,
    SamplingConfig,
    SpeculativeEngine,
)
from draftwise.drafters import Proposal, build_drafter
from draftwise.lm import drive
from draftwise.offers import Offer
from draftwise.target import LocalTarget
from draftwise.verify import Verdict


def ngram(context: list[int], k: int = 3, ngram_max: int = 3, ngram_min: int = 1) -> list[int]:
    drafter = NGramDrafter()
    drafter.start(context, GenerationConfig(draft=DraftConfig(ngram_max=ngram_max, ngram_min=ngram_min)), None)
    proposal = drive(drafter.propose(context, k))
    assert proposal.probs is None  # a point mass: no draft distribution
    return proposal.tokens.tolist()


def test_ngram_proposes_what_followed_the_suffix():
    assert ngram([1, 2, 3, 9, 8, 1, 2, 3], k=2) == [9, 8]


def test_ngram_uses_the_latest_earlier_occurrence():
    assert ngram([1, 2, 5, 1, 2, 6, 1, 2], k=1) == [6]


def test_ngram_tries_longest_n_first():
    context = [1, 2, 3, 8, 2, 3, 9, 1, 2, 3]
    assert ngram(context, k=1, ngram_max=3) == [8]  # [1 2 3] matches, followed by 8
    assert ngram(context, k=1, ngram_max=2) == [9]  # only [2 3]: its latest match is followed by 9


def test_ngram_falls_back_to_shorter_n():
    assert ngram([5, 2, 3, 7, 1, 2, 3], k=1) == [7]  # no earlier [1 2 3]; [2 3] matches


def test_ngram_never_matches_the_suffix_itself():
    assert ngram([1, 2, 3]) == []
    assert ngram([4, 4], k=3) == [4]  # the earlier 4 matches; what follows is the final 4


def test_ngram_empty_when_no_match_or_below_ngram_min():
    assert ngram([1, 2, 3, 4]) == []
    assert ngram([3, 1, 3], ngram_min=2) == []
    assert ngram([3, 1, 3], ngram_min=1) == [1, 3]


def test_ngram_proposal_is_cut_to_k_and_to_the_context():
    context = [7, 1, 2, 3, 4, 5, 7]
    assert ngram(context, k=3) == [1, 2, 3]
    assert ngram(context, k=10) == [1, 2, 3, 4, 5, 7]
    assert ngram(context, k=0) == []


def test_ngram_index_follows_a_growing_context():
    drafter = NGramDrafter()
    context = [1, 2, 3, 4]
    drafter.start(context, GenerationConfig(draft=DraftConfig(ngram_max=2)), None)
    assert drive(drafter.propose(context, 2)).tokens.tolist() == []
    for token in [1, 2, 7, 1, 2]:
        context.append(token)
        drafter.observe(context, Verdict(n_accepted=0, next_token=token, n_proposed=0))
        assert drive(drafter.propose(context, 2)).tokens.tolist() == ngram(context, k=2, ngram_max=2)
    assert drive(drafter.propose(context, 2)).tokens.tolist() == [7, 1]


def test_build_drafter_makes_each_named_drafter(tiny_random_draft):
    assert isinstance(build_drafter("ngram", None), NGramDrafter)
    model = build_drafter("model", tiny_random_draft)
    assert isinstance(model, ModelDrafter) and model.lm is tiny_random_draft
    hybrid = build_drafter("hybrid", tiny_random_draft)
    assert isinstance(hybrid, HybridDrafter) and hybrid.model.lm is tiny_random_draft
    for kind in ("model", "hybrid"):
        with pytest.raises(ValueError, match=f"drafter '{kind}' needs a draft model"):
            build_drafter(kind, None)


# --- the draft model ---------------------------------------------------------------------------


def fresh_greedy(lm, context: list[int], k: int) -> list[int]:
    """Greedy continuation computed from scratch, without the drafter's cache."""
    lm.reset()
    out = []
    logits = lm.forward(context, last=1)
    for _ in range(k):
        out.append(int(logits[0].argmax()))
        logits = lm.forward([out[-1]], last=1)
    return out


@pytest.mark.parametrize("sampling", [{}, {"temperature": 0.9, "seed": 5}])
def test_model_drafter_cache_stays_consistent(tiny_target, tiny_near_draft, sampling):
    drafter = ModelDrafter(tiny_near_draft)
    engine = SpeculativeEngine(LocalTarget(tiny_target), drafter, tokenizer=tiny_target.tokenizer)
    prompt = tiny_target.tokenizer.encode("Once upon a time")
    cfg = GenerationConfig(
        max_new_tokens=30,
        ignore_eos=True,
        sampling=SamplingConfig(**sampling),
        draft=DraftConfig(k_policy="fixed", k=3, confidence_threshold=0.0),
    )
    context = list(prompt)
    steps = 0
    for event in engine.stream(prompt, cfg):
        context += event.tokens
        if event.finished:
            break
        steps += 1
        held = drafter.lm.tokens
        # After observe the draft cache holds a prefix of the committed context, at most
        # two tokens short (the bonus and the last accepted token are fed next time).
        assert held == context[: len(held)] and len(held) >= len(context) - 2
        assert drafter.lm.cache.length == len(held)
    assert steps > 3
    # Drafting from the rolled-back cache gives what a fresh run gives.
    drafter.start(prompt, cfg.model_copy(update={"sampling": SamplingConfig()}), None)
    proposal = drive(drafter.propose(context, 3))
    assert proposal.tokens.tolist() == fresh_greedy(tiny_near_draft.fork(), context, 3)


def test_model_drafter_greedy_proposal_matches_fresh_run_each_step(tiny_target, tiny_near_draft):
    drafter = ModelDrafter(tiny_near_draft)
    prompt = tiny_target.tokenizer.encode("abc abc")
    cfg = GenerationConfig(draft=DraftConfig(confidence_threshold=0.0))
    drafter.start(prompt, cfg, None)
    context = list(prompt)
    reference_lm = tiny_near_draft.fork()  # same weights, its own cache
    for step in range(4):
        proposal = drive(drafter.propose(context, 3))
        assert proposal.tokens.tolist() == fresh_greedy(reference_lm, context, 3)
        assert proposal.probs.shape == (3, tiny_near_draft.vocab_size)
        torch.testing.assert_close(proposal.probs.sum(-1), torch.ones(3))
        assert proposal.tokens.tolist() == proposal.probs.argmax(-1).tolist()
        # Pretend the target kept `step % 3` tokens and corrected the next one to 65 + step.
        kept = step % 3
        context += proposal.tokens[:kept].tolist() + [65 + step]
        drafter.observe(context, Verdict(n_accepted=kept, next_token=65 + step, n_proposed=3))
        assert drafter.lm.tokens == context[: len(drafter.lm.tokens)]


@pytest.mark.parametrize("threshold", [0.0, 0.3, 0.6, 0.9, 1.0])
def test_confidence_early_stop(tiny_near_draft, threshold):
    drafter = ModelDrafter(tiny_near_draft)
    prompt = list(b"The quick brown fox")
    drafter.start(prompt, GenerationConfig(draft=DraftConfig(confidence_threshold=threshold)), None)
    proposal = drive(drafter.propose(prompt, 8))
    top = proposal.probs.max(-1).values.tolist()
    if threshold == 0.0:
        assert len(proposal) == 8
    else:
        # Every position but the last was confident; drafting stopped at the first that was not.
        assert all(t >= threshold for t in top[:-1])
        assert len(proposal) == 8 or top[-1] < threshold
    if threshold == 1.0:
        assert len(proposal) == 1


def test_confidence_early_stop_proposes_fewer_tokens(tiny_near_draft):
    def total(threshold: float) -> int:
        drafter = ModelDrafter(tiny_near_draft)
        cfg = GenerationConfig(draft=DraftConfig(confidence_threshold=threshold))
        count = 0
        for text in (b"The quick brown fox", b"hello world", b"0123456789"):
            drafter.start(list(text), cfg, None)
            count += len(drive(drafter.propose(list(text), 8)))
        return count

    assert total(0.0) == 24
    assert total(0.9) < total(0.0)


def test_model_drafter_zero_k_drafts_nothing(tiny_near_draft):
    drafter = ModelDrafter(tiny_near_draft)
    drafter.start([1, 2, 3], GenerationConfig(), None)
    assert len(drive(drafter.propose([1, 2, 3], 0))) == 0


class _FixedModel(ModelDrafter):
    """A stand-in for the draft model: always proposes ``[7, 7, ...]`` and counts calls."""

    def __init__(self) -> None:
        self.calls = 0

    def start(self, prompt, config, generator) -> None:
        pass

    def offers(self, context) -> tuple[Offer, ...]:
        return (Offer("model"),)

    def propose(self, context, k, source=None):
        yield from ()  # no pass
        self.calls += 1
        return Proposal(tokens=torch.full((k,), 7, dtype=torch.long))

    def observe(self, context, verdict) -> None:
        pass


def _hybrid(context: list[int], k: int) -> tuple[list[int], int]:
    """(proposal, calls to the draft model) of a fresh hybrid drafter on ``context``."""
    model = _FixedModel()
    hybrid = HybridDrafter(model)
    hybrid.start(context, GenerationConfig(), None)
    return drive(hybrid.propose(context, k)).tokens.tolist(), model.calls


def test_hybrid_looks_up_repeats_of_three_tokens_and_asks_the_model_otherwise():
    assert isinstance(HybridDrafter(_FixedModel()), Drafter)
    assert _hybrid([1, 2, 3, 4, 5, 9, 1, 2, 3], 3) == ([4, 5, 9], 0)  # "1 2 3" seen before: free
    assert _hybrid([1, 2, 3, 4, 8, 2, 3], 3) == ([7, 7, 7], 1)  # only "2 3" repeats: too short
    assert _hybrid([5, 5, 5, 5], 3) == ([7, 7, 7], 1)  # the match is continued by one token only
    assert _hybrid([5, 5, 5, 5], 1) == ([7], 1)  # ... too little to displace the model, whatever k


def test_ngram_keeps_copying_the_passage_it_copies():
    drafter = NGramDrafter()
    passage = [10, 11, 12, 13, 20, 21, 12, 13, 99]
    config = GenerationConfig(draft=DraftConfig(ngram_max=2, ngram_min=1))
    drafter.start(passage, config, None)
    context = passage + [10, 11]
    assert drive(drafter.propose(context, 2)).tokens.tolist() == [12, 13]
    # Both were written: the copy goes on at 20, though "12 13" last occurred before 99.
    context += [12, 13]
    assert drive(drafter.propose(context, 2)).tokens.tolist() == [20, 21]
    # A fresh lookup (no copy in progress) takes the latest occurrence.
    fresh = NGramDrafter()
    fresh.start(context, config, None)
    assert drive(fresh.propose(context, 1)).tokens.tolist() == [99]
    # Where the context leaves the passage, the lookup starts over.
    context += [77, 12, 13]
    assert drive(drafter.propose(context, 1)).tokens.tolist() == [77]  # the latest "12 13" now
