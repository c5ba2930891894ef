"""Chi-square helpers for the tests that check sampled tokens against an exact distribution
(``test_sampling_stats.py`` on tiny models, ``test_llamacpp.py`` on a real one)."""

from __future__ import annotations

from collections import Counter
from collections.abc import Hashable

import torch
from scipy.stats import chisquare

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
