"""Statistical checks that speculative sampling emits tokens distributed exactly as the
target alone would: chi-square tests with fixed seeds, many samples and a strict p-value
threshold (so a correct rule passes deterministically and a wrong rule is caught).
"""

from __future__ import annotations

from collections import Counter

import pytest
import torch

from draftwise import (
    DraftConfig,
    HybridDrafter,
    ModelDrafter,
    NGramDrafter,
    SpeculativeEngine,
    autoregressive,
)
from draftwise.config import SuffixConfig
from draftwise.suffix import SuffixStore
from draftwise.verify import sample, verify_sampling

from stats_support import ALPHA, as_dist, chi2_pvalue, exact_pairs, next_probs, sample_pairs


def test_sample_follows_the_distribution_and_skips_zeros():
    # Zeros at both ends and in the middle; unnormalised on purpose.
    weights = torch.tensor([0.0, 2.0, 0.0, 1.0, 5.0, 0.0])
    generator = torch.Generator().manual_seed(0)
    counts = Counter(sample(weights, generator) for _ in range(N_SYNTHETIC))
    assert chi2_pvalue(counts, as_dist(weights / weights.sum())) > ALPHA


# --- synthetic p and q -----------------------------------------------------------------------

P = torch.tensor([0.10, 0.20, 0.30, 0.40, 0.00])
Q = torch.tensor([0.40, 0.30, 0.10, 0.10, 0.10])
P1 = torch.tensor([0.35, 0.05, 0.00, 0.25, 0.35])
Q1 = torch.tensor([0.05, 0.30, 0.30, 0.05, 0.30])
N_SYNTHETIC = 8_000


def first_token_model_drafter(generator: torch.Generator) -> int:
    """Draft x ~ q, verify, return the first emitted token."""
    x = torch.multinomial(Q, 1, generator=generator)
    verdict = verify_sampling(x, Q[None], torch.stack([P, P]), generator)
    return int(x) if verdict.n_accepted else verdict.next_token


def test_first_token_matches_p_with_model_drafter():
    generator = torch.Generator().manual_seed(0)
    counts = Counter(first_token_model_drafter(generator) for _ in range(N_SYNTHETIC))
    assert chi2_pvalue(counts, as_dist(P)) > ALPHA


@pytest.mark.parametrize("guess", [0, 3, 4])
def test_first_token_matches_p_with_point_mass_drafter(guess):
    # An n-gram drafter proposes a fixed token with no probabilities; 4 has p = 0.
    generator = torch.Generator().manual_seed(guess)
    x = torch.tensor([guess])
    counts = Counter()
    for _ in range(N_SYNTHETIC):
        verdict = verify_sampling(x, None, torch.stack([P, P]), generator)
        counts[guess if verdict.n_accepted else verdict.next_token] += 1
    assert chi2_pvalue(counts, as_dist(P)) > ALPHA


@pytest.mark.parametrize("point_mass", [False, True])
def test_first_two_tokens_match_p_across_a_block(point_mass):
    """Two-token blocks: rejection at position 0 or 1 and full acceptance all occur; the
    first two emitted tokens must be distributed as p0 x p1 (the synthetic target's rows do
    not depend on the context)."""
    generator = torch.Generator().manual_seed(1)
    target = torch.stack([P, P1, P])
    counts = Counter()
    for _ in range(N_SYNTHETIC):
        if point_mass:
            draft, q = torch.tensor([3, 0]), None
        else:
            draft = torch.cat(
                [torch.multinomial(Q, 1, generator=generator), torch.multinomial(Q1, 1, generator=generator)]
            )
            q = torch.stack([Q, Q1])
        verdict = verify_sampling(draft, q, target, generator)
        emitted = draft[: verdict.n_accepted].tolist() + [verdict.next_token]
        if len(emitted) == 1:  # rejected at once: the next step samples position 1 from p1
            emitted.append(int(torch.multinomial(P1, 1, generator=generator)))
        counts[tuple(emitted[:2])] += 1
    joint = {(a, b): pa * pb for a, pa in as_dist(P).items() for b, pb in as_dist(P1).items()}
    assert chi2_pvalue(counts, joint) > ALPHA


def test_a_wrong_correction_rule_is_caught():
    """Negative control: drawing the correction from p instead of max(0, p - q) skews the
    output towards tokens the draft over-proposes; the same test must reject it."""
    generator = torch.Generator().manual_seed(0)
    counts = Counter()
    for _ in range(N_SYNTHETIC):
        x = int(torch.multinomial(Q, 1, generator=generator))
        keep = float(torch.rand(1, generator=generator)) < min(1.0, float(P[x] / Q[x]))
        counts[x if keep else int(torch.multinomial(P, 1, generator=generator))] += 1
    assert chi2_pvalue(counts, as_dist(P)) < ALPHA


# --- end to end on a tiny model -----------------------------------------------------------------


@pytest.fixture(scope="module")
def prompt(tiny_target) -> list[int]:
    return tiny_target.tokenizer.encode("The cat sat on the mat. The cat")


@pytest.fixture(scope="module")
def ngram_prompt(tiny_target) -> list[int]:
    """A prompt whose n-gram guess for the next token has a target probability strictly
    between 0 and 1, so both acceptance and rejection happen. Built as ``[... a y ... a]``:
    the lookup of the final ``a`` proposes ``y``; we pick the first ``y`` that works."""
    base = tiny_target.tokenizer.encode("Hello world, ")
    for y in range(tiny_target.vocab_size):
        ids = base + [y] + base
        if 0.15 < float(next_probs(tiny_target, ids)[y]) < 0.85:
            return ids
    raise AssertionError("no suitable n-gram prompt found")


def test_e2e_plain_sampling_matches_exact_distribution(tiny_target, prompt):
    counts, _ = sample_pairs(autoregressive(tiny_target), prompt, DraftConfig())
    assert chi2_pvalue(counts, exact_pairs(tiny_target, prompt)) > ALPHA


def test_e2e_model_drafter_matches_exact_distribution(tiny_target, tiny_near_draft, prompt):
    engine = SpeculativeEngine.from_models(tiny_target, tiny_near_draft)
    draft = DraftConfig(k_policy="fixed", k=4, confidence_threshold=0.0)
    counts, outcomes = sample_pairs(engine, prompt, draft)
    exact = exact_pairs(tiny_target, prompt)
    assert chi2_pvalue(counts, exact) > ALPHA
    assert outcomes == {0, 1}  # the draft token was both accepted and rejected
    # The draft disagrees with the target on its own: had its tokens passed unchecked, the
    # same test would have failed.
    assert chi2_pvalue(counts, exact_pairs(tiny_near_draft, prompt)) < ALPHA


def test_e2e_ngram_drafter_matches_exact_distribution(tiny_target, ngram_prompt):
    engine = SpeculativeEngine.from_models(tiny_target, NGramDrafter())
    counts, outcomes = sample_pairs(engine, ngram_prompt, DraftConfig(k_policy="fixed", k=4))
    assert chi2_pvalue(counts, exact_pairs(tiny_target, ngram_prompt)) > ALPHA
    assert outcomes == {0, 1}  # the n-gram guess was both accepted and rejected


def test_e2e_hybrid_drafter_matches_exact_distribution(tiny_target, tiny_near_draft, ngram_prompt):
    # The prompt ends in a repeat, so the first block comes from lookup (a point mass) and
    # later ones from the draft model (its q): the rule must stay exact across both.
    engine = SpeculativeEngine.from_models(tiny_target, HybridDrafter(ModelDrafter(tiny_near_draft)))
    counts, outcomes = sample_pairs(engine, ngram_prompt, DraftConfig(k_policy="fixed", k=4, confidence_threshold=0.0))
    assert chi2_pvalue(counts, exact_pairs(tiny_target, ngram_prompt)) > ALPHA
    assert outcomes == {0, 1}


def test_e2e_suffix_drafter_matches_exact_distribution(tiny_target):
    # An earlier output went on after this prompt's end with a token the target gives a
    # probability strictly between 0 and 1: the suffix source proposes it as a point mass.
    base = tiny_target.tokenizer.encode("Hello world, ")
    probs = next_probs(tiny_target, base)
    guess = next(t for t in range(tiny_target.vocab_size) if 0.15 < float(probs[t]) < 0.85)
    store = SuffixStore(SuffixConfig(scope="global"))
    store.add("", base, [guess, guess])
    engine = SpeculativeEngine.from_models(tiny_target, store.drafter(""))
    counts, outcomes = sample_pairs(engine, base, DraftConfig(k_policy="fixed", k=4))
    assert chi2_pvalue(counts, exact_pairs(tiny_target, base)) > ALPHA
    assert outcomes == {0, 1}  # the earlier output's token was both accepted and rejected
