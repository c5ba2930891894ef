"""Chi-square helpers for the tests that check sampled tokens against an exact distribution
(``test_sampling_stats.py`` and ``test_crossvocab.py`` on tiny models, ``test_llamacpp.py`` on a
real one), and the end-to-end sampling of a generation's first two tokens they share."""

from __future__ import annotations

from collections import Counter
from collections.abc import Hashable, Sequence

import torch
from scipy.stats import chisquare

from draftwise import DraftConfig, GenerationConfig, SamplingConfig, SpeculativeEngine
from draftwise.lm import LanguageModel
from draftwise.verify import logits_to_probs

# Strict enough that a correct rule passes deterministically with the tests' fixed seeds, loose
# enough that a wrong rule is still caught.
ALPHA = 1e-3


def chi2_pvalue(counts: Counter, expected: dict[Hashable, float]) -> float:
    """p-value of ``counts`` under the distribution ``expected``.

    Cells expected fewer than 5 times are pooled (the chi-square approximation needs it); a
    sample in a cell of probability zero is an outright failure (p-value 0).
    """
    n = sum(counts.values())
    if any(expected.get(key, 0.0) <= 0.0 for key in counts):
        return 0.0
    observed, wanted, pooled_obs, pooled_exp = [], [], 0, 0.0
    for key, prob in expected.items():
        if prob * n >= 5:
            observed.append(counts.get(key, 0))
            wanted.append(prob * n)
        else:
            pooled_obs += counts.get(key, 0)
            pooled_exp += prob * n
    if pooled_exp > 0:
        observed.append(pooled_obs)
        wanted.append(pooled_exp)
    total = sum(wanted)
    wanted = [w * n / total for w in wanted]  # absorb float round-off so the sums agree
    return float(chisquare(observed, wanted).pvalue)


def as_dist(p: torch.Tensor) -> dict[int, float]:
    """A probability vector as {token: probability}, zeros left out."""
    return {i: float(v) for i, v in enumerate(p.double().tolist()) if v > 0}


# --- end to end: the first two tokens of a generation ---------------------------------------------

N_E2E = 600
SAMPLING = {"temperature": 1.0, "top_k": 3}


def next_probs(lm: LanguageModel, ids: Sequence[int]) -> torch.Tensor:  # [V]
    lm.reset()
    return logits_to_probs(lm.forward(ids, last=1), SAMPLING["temperature"], SAMPLING["top_k"])[0]


def exact_pairs(lm: LanguageModel, prompt: list[int]) -> dict[tuple[int, int], float]:
    """The exact distribution of the first two generated tokens (few pairs thanks to top_k)."""
    first = next_probs(lm, prompt)
    return {
        (a, b): pa * pb for a, pa in as_dist(first).items() for b, pb in as_dist(next_probs(lm, prompt + [a])).items()
    }


def sample_pairs(engine: SpeculativeEngine, prompt: list[int], draft: DraftConfig) -> tuple[Counter, set[int]]:
    """Counts of the first two generated tokens over N_E2E seeds, and the set of
    ``n_accepted`` values seen in the first step (to check speculation really happened)."""
    counts, outcomes = Counter(), set()
    for seed in range(N_E2E):
        config = GenerationConfig(
            max_new_tokens=2, ignore_eos=True, draft=draft, sampling=SamplingConfig(**SAMPLING, seed=seed)
        )
        events = list(engine.stream(prompt, config))
        counts[tuple(t for e in events for t in e.tokens)] += 1
        assert len(events[0].proposed) == (1 if engine.drafter is not None else 0)
        outcomes.add(events[0].n_accepted)
    return counts, outcomes
