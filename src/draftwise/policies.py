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


class _DecayedLine:
    """Least-squares line ``y = a + b x`` over exponentially forgotten samples.

    Used for the verification time as a function of the tokens scored in one pass: on a
    GPU the line is nearly flat, on a CPU it can climb steeply, and the best k differs.
    """

    def __init__(self, decay: float) -> None:
        self.decay = decay
        self._w = self._x = self._xx = self._y = self._xy = 0.0

    def add(self, x: float, y: float) -> None:
        d = self.decay
        self._w, self._x, self._xx = d * self._w + 1, d * self._x + x, d * self._xx + x * x
        self._y, self._xy = d * self._y + y, d * self._xy + x * y

    @property
    def empty(self) -> bool:
        return self._w == 0

    def fit(self) -> tuple[float, float]:
        """(intercept, slope); the slope is 0 until the samples differ in x, never negative."""
        spread = self._w * self._xx - self._x * self._x
        slope = (self._w * self._xy - self._x * self._y) / spread if spread > 1e-9 * self._w**2 else 0.0
        slope = max(0.0, slope)
        return (self._y - slope * self._x) / self._w, slope

    def at(self, x: float) -> float:
        a, b = self.fit()
        return a + b * x


class CostAwareK:
    """Pick the k that maximises expected tokens/s from measured acceptance and timings.

    Acceptance ``alpha`` is estimated as accepted / (accepted + rejections) with exponential
    forgetting (the maximum-likelihood estimate when each draft token is accepted
    independently with probability alpha). The cost of one more draft token, relative to a
    plain decoding step, is ``c = (t_draft + t_verify_slope) / t_verify(1)``: the measured
    time of one draft token plus what one more token adds to the verification pass (fitted
    from measured passes of different sizes), over the measured time of a one-token pass.
    When no k >= 1 beats plain decoding, the policy drafts nothing, and every
    ``probe_every`` such steps it drafts once to re-measure.

    Example: t_verify(1) = 0.4 s growing by 0.12 s per extra token, free n-gram drafts and
    alpha = 0.25: c = 0.3, and no k beats plain decoding (k = 1 gives 1.25 / 1.3), so the
    policy turns drafting off rather than lose speed.
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
        self._verify = _DecayedLine(self.DECAY)  # seconds of a verification pass vs tokens scored
        self._idle_steps = 0

    @property
    def alpha(self) -> float:
        return self._accepted / (self._accepted + self._rejected)

    @property
    def cost_ratio(self) -> float | None:
        if self._draft_token_seconds is None or self._verify.empty:
            return None
        one_token = self._verify.at(1)
        if one_token <= 0:
            return None
        return (self._draft_token_seconds + self._verify.fit()[1]) / one_token

    def best_k(self, minimum: int = 0) -> int:
        c = self.cost_ratio
        if c is None:
            return self.k_start
        return max(range(minimum, self.k_max + 1), key=lambda k: expected_speedup(self.alpha, k, c))

    def next_k(self) -> int:
        k = self.best_k()
        if k > 0:
            self._idle_steps = 0
            return k
        self._idle_steps += 1
        if self._idle_steps >= self.probe_every:
            self._idle_steps = 0
            return self.best_k(minimum=1)
        return 0

    def update(self, k: int, n_proposed: int, n_accepted: int, draft_seconds: float, verify_seconds: float) -> None:
        self._verify.add(n_proposed + 1, verify_seconds)
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
