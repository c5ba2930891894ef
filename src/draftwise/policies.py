"""Draft-length policies: how many tokens to draft in the next step."""

from __future__ import annotations

from typing import Protocol

from draftwise.config import DraftConfig


class DraftLengthPolicy(Protocol):
    def next_k(self) -> int:
        """Draft length for the next step (0 = plain decoding for this step)."""

    def update(self, k: int, n_proposed: int, n_accepted: int, draft_seconds: float, verify_seconds: float) -> None:
        """Feed back what the last step did and cost."""


class FixedK:
    def __init__(self, k: int) -> None:
        self.k = k

    def next_k(self) -> int:
        return self.k

    def update(self, k: int, n_proposed: int, n_accepted: int, draft_seconds: float, verify_seconds: float) -> None:
        pass


class HeuristicK:
    """transformers' rule: k += 2 after a fully accepted block, else k = max(1, k - 1)."""

    def __init__(self, k: int, k_max: int) -> None:
        self.k = max(1, k)
        self.k_max = k_max

    def next_k(self) -> int:
        return self.k

    def update(self, k: int, n_proposed: int, n_accepted: int, draft_seconds: float, verify_seconds: float) -> None:
        if n_proposed == 0:  # nothing was proposed (e.g. no n-gram match): nothing learnt
            return
        self.k = min(self.k_max, self.k + 2) if n_accepted == n_proposed else max(1, self.k - 1)


def expected_speedup(alpha: float, k: int, cost_ratio: float) -> float:
    """Expected tokens per unit of plain-decoding time for draft length ``k``.

    With per-token acceptance ``alpha`` a step emits ``(1 - alpha^(k+1)) / (1 - alpha)``
    tokens on average and costs ``1 + k c`` target passes' worth of time, where ``c`` is
    the cost of one draft token relative to one target pass (Leviathan et al. 2023).

    Example: alpha = 0.8, k = 4, c = 0.1 -> 3.36 tokens / 1.4 = 2.40x; with c = 0.43
    the same k gives only 1.21x.
    """
    if k == 0:
        return 1.0
    alpha = min(alpha, 0.999)
    tokens = (1.0 - alpha ** (k + 1)) / (1.0 - alpha)
    return tokens / (1.0 + k * cost_ratio)


class PassTimes:
    """Seconds of a target pass by the number of tokens it scores, as measured.

    Each measured size keeps a decayed mean. A size never measured is read off the line
    between its measured neighbours; beyond the largest measured size, the line through the
    two largest continues (flat while only one size is known); below the smallest, the
    smallest's time stands. No global line is fitted on purpose: on a CPU the cost is far
    from linear (Qwen2.5-Coder-1.5B, float32 packed for one row: 280, 482, 589, 612, 714 ms
    for 1, 2, 4, 6, 9 tokens), and a line through the 2- to 6-token passes puts a one-token
    pass at 430 to 550 ms, making plain decoding look slower than it is.

    Example: measured {1: 0.28, 6: 0.61} -> at(3) = 0.28 + 2/5 * 0.33 = 0.412, at(9) = 0.808.
    """

    WEIGHT = 0.3  # of the newest measurement in a size's mean

    def __init__(self) -> None:
        self._mean: dict[int, float] = {}

    def add(self, tokens: int, seconds: float) -> None:
        old = self._mean.get(tokens)
        self._mean[tokens] = seconds if old is None else (1 - self.WEIGHT) * old + self.WEIGHT * seconds

    def known(self, tokens: int) -> bool:
        return tokens in self._mean

    def at(self, tokens: int) -> float | None:
        if not self._mean:
            return None
        if tokens in self._mean:
            return self._mean[tokens]
        sizes = sorted(self._mean)
        below = [s for s in sizes if s < tokens]
        above = [s for s in sizes if s > tokens]
        if not below:
            return self._mean[above[0]]
        if above:
            lo, hi = below[-1], above[0]
        elif len(below) >= 2:
            lo, hi = below[-2], below[-1]
        else:
            return self._mean[below[-1]]
        slope = max(0.0, (self._mean[hi] - self._mean[lo]) / (hi - lo))
        return self._mean[lo] + slope * (tokens - lo)


class CostAwareK:
    """Pick the k that maximises expected tokens/s from measured acceptance and timings.

    Acceptance ``alpha`` is estimated as accepted / (accepted + rejections) with exponential
    forgetting (the maximum-likelihood estimate when each draft token is accepted
    independently with probability alpha). A step that drafts k tokens is expected to emit
    ``(1 - alpha^(k+1)) / (1 - alpha)`` tokens and to take ``k t_draft + t_verify(k+1)``,
    where ``t_draft`` is the measured time of one draft token and ``t_verify`` the measured
    time of a target pass by block size (``PassTimes``); plain decoding emits one token in
    ``t_verify(1)``. The policy starts with one plain step (to measure ``t_verify(1)``
    directly) and one step of the configured k, then picks the best k each step. When no
    k >= 1 beats plain decoding it drafts nothing, and every ``probe_every`` such steps it
    drafts once to re-measure.

    Example: t_verify = 0.28 s for 1 token and 0.54 s for 3, t_draft = 0.06 s, alpha = 0.6:
    k = 2 gives 1.96 tokens / 0.66 s = 2.97 tokens/s, below plain decoding's 3.57, so the
    policy drafts nothing; with alpha = 0.9, k = 2 gives 2.71 / 0.66 = 4.1 tokens/s.
    """

    DECAY = 0.9

    def __init__(self, config: DraftConfig) -> None:
        self.k_max = config.k_max
        self.k_start = max(1, min(config.k, config.k_max))
        self.probe_every = config.probe_every
        # Prior worth a few tokens: alpha = 0.7 until evidence says otherwise.
        self._accepted = 2.1
        self._rejected = 0.9
        self._draft_token_seconds: float | None = None
        self.pass_times = PassTimes()
        self._idle_steps = 0

    @property
    def alpha(self) -> float:
        return self._accepted / (self._accepted + self._rejected)

    def tokens_per_second(self, k: int) -> float | None:
        """Expected rate of steps that draft ``k`` tokens; None until measured enough."""
        verify = self.pass_times.at(k + 1)
        if verify is None or (k > 0 and self._draft_token_seconds is None):
            return None
        seconds = verify + k * (self._draft_token_seconds or 0.0)
        return expected_speedup(self.alpha, k, 0.0) / seconds if seconds > 0 else None

    def best_k(self, minimum: int = 0) -> int:
        if not self.pass_times.known(1):
            return max(minimum, 0)  # one plain step first: it measures what drafting must beat
        if self._draft_token_seconds is None:
            return self.k_start
        return max(range(minimum, self.k_max + 1), key=lambda k: self.tokens_per_second(k) or 0.0)

    def next_k(self) -> int:
        k = self.best_k()
        if k > 0 or not self.pass_times.known(1):
            self._idle_steps = 0
            return k
        self._idle_steps += 1
        if self._idle_steps >= self.probe_every:
            self._idle_steps = 0
            return self.best_k(minimum=1)
        return 0

    def update(self, k: int, n_proposed: int, n_accepted: int, draft_seconds: float, verify_seconds: float) -> None:
        self.pass_times.add(n_proposed + 1, verify_seconds)
        if n_proposed == 0:
            return
        per_token = draft_seconds / n_proposed
        self._draft_token_seconds = (
            per_token if self._draft_token_seconds is None else 0.7 * self._draft_token_seconds + 0.3 * per_token
        )
        self._accepted = self.DECAY * self._accepted + n_accepted
        self._rejected = self.DECAY * self._rejected + (1 if n_accepted < n_proposed else 0)


def make_policy(config: DraftConfig) -> DraftLengthPolicy:
    if config.k_policy == "fixed":
        return FixedK(config.k)
    if config.k_policy == "heuristic":
        return HeuristicK(config.k, config.k_max)
    return CostAwareK(config)
