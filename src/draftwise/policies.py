"""Draft policies: which source drafts in the next step, and how many tokens.

Each step the drafter says what each of its sources could propose (``Offer``: the model
drafter, n-gram lookup, ...), and the policy picks one of them with a draft length, or
plain decoding (``PLAIN``). After the step it learns what the step did and cost
(``Outcome``). The decode loop never asks which drafter or policy it has.
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

from draftwise.config import DraftConfig
from draftwise.lm import PassInfo


@dataclass(frozen=True)
class Offer:
    """What one source of a drafter could propose for the next step.

    ``limit`` is the most tokens it has (an n-gram continuation found in the context), None
    for as many as asked. ``behind`` counts context tokens the source must feed before it can
    draft (a draft model that skipped the prompt, or steps it sat out): a cost paid once.
    ``key`` names the acceptance statistics the source's proposals share (n-gram lookups
    keep one per match length: a 3-token match is right far more often than a 1-token one).
    ``cost_hint`` guesses a draft token's cost as a share of one plain target pass, until
    the source's own cost is measured. A ``grounded`` source copies text the output is
    expected to follow (a prediction, an n-gram copy in progress): the cost policy may give it
    blocks past ``k_max`` once it has been right long enough (``CostAwareK``). The first
    ``sure`` tokens of a block are forced by a grammar, drafted at no cost and priced as
    accepted (the mask allows nothing else there but another spelling of the same text); the
    source's acceptance and cost price the tokens after them (a forced key, then a value).
    """

    source: str
    limit: int | None = None
    behind: int = 0
    key: str = ""
    cost_hint: float = 0.5
    grounded: bool = False
    sure: int = 0

    @property
    def stats_key(self) -> str:
        return self.key or self.source


@dataclass(frozen=True)
class Choice:
    """Draft ``k`` tokens from ``offer`` (None with ``k == 0``: plain decoding)."""

    offer: Offer | None
    k: int

    @property
    def source(self) -> str | None:
        return self.offer.source if self.offer is not None else None


PLAIN = Choice(None, 0)


@dataclass(frozen=True)
class Outcome:
    """What a step did and cost, as the policy learns it."""

    choice: Choice
    n_proposed: int
    n_accepted: int
    draft_seconds: float  # drafting only: catching up on missed context is ``catchup_seconds``
    verify_seconds: float
    catchup_seconds: float = 0.0
    catchup_tokens: int = 0
    # The target pass that verified the block, where the backend reports it: with other
    # streams' rows batched in, its rows and time say more than verify_seconds does.
    pass_info: PassInfo | None = None

    @property
    def own_rows(self) -> int:
        return self.n_proposed + 1

    @property
    def others_rows(self) -> int:
        """Rows of other streams in the same pass."""
        return max(0, self.pass_info.rows - self.own_rows) if self.pass_info is not None else 0


class DraftPolicy(Protocol):
    def choose(self, offers: Sequence[Offer], remaining: int) -> Choice:
        """What to draft next; ``remaining`` tokens are left in the budget."""

    def update(self, outcome: Outcome) -> None:
        """Learn what the last step did and cost."""


def _first(offers: Sequence[Offer], k: int) -> Choice:
    """The drafter's preferred offer (its first), ``k`` tokens at most."""
    if not offers or k <= 0:
        return PLAIN
    offer = offers[0]
    return Choice(offer, k if offer.limit is None else min(k, offer.limit))


class FixedK:
    """Always ``k`` tokens from the drafter's preferred source."""

    def __init__(self, k: int) -> None:
        self.k = k

    def choose(self, offers: Sequence[Offer], remaining: int) -> Choice:
        return _first(offers, self.k)

    def update(self, outcome: Outcome) -> None:
        pass


class HeuristicK:
    """transformers' rule: k += 2 after a fully accepted block, else k = max(1, k - 1)."""

    def __init__(self, k: int, k_max: int) -> None:
        self.k = max(1, k)
        self.k_max = k_max

    def choose(self, offers: Sequence[Offer], remaining: int) -> Choice:
        return _first(offers, self.k)

    def update(self, outcome: Outcome) -> None:
        if outcome.n_proposed == 0:  # nothing was proposed (e.g. no n-gram match): nothing learnt
            return
        full = outcome.n_accepted == outcome.n_proposed
        self.k = min(self.k_max, self.k + 2) if full else max(1, self.k - 1)


def expected_tokens(alpha: float, k: int) -> float:
    """Tokens a step emits on average when it drafts ``k`` and each draft token is accepted
    with probability ``alpha`` (until the first rejection), plus the target's own token."""
    if k == 0:
        return 1.0
    alpha = min(alpha, 0.999)
    return (1.0 - alpha ** (k + 1)) / (1.0 - alpha)


def expected_speedup(alpha: float, k: int, cost_ratio: float) -> float:
    """Expected tokens per unit of plain-decoding time for draft length ``k``.

    A step emits ``expected_tokens(alpha, k)`` tokens and costs ``1 + k c`` target passes'
    worth of time, where ``c`` is the cost of one draft token relative to one target pass
    (Leviathan et al. 2023).

    Example: alpha = 0.8, k = 4, c = 0.1 -> 3.36 tokens / 1.4 = 2.40x; with c = 0.43
    the same k gives only 1.21x.
    """
    if k == 0:
        return 1.0
    return expected_tokens(alpha, k) / (1.0 + k * cost_ratio)


class PassTimes:
    """Seconds of a target pass by the number of tokens it scores, as measured.

    Each measured size keeps a decayed mean. A size never measured is read off the line
    between its measured neighbours; beyond the largest measured size, the line through the
    two largest continues (flat while only one size is known); below the smallest, the
    smallest's time stands. No global line is fitted on purpose: on a CPU the cost is far
    from linear in the block size (kernels change with the number of rows; llama.cpp's
    quantized products run rows in groups of four, so a 4-token pass can cost less than a
    3-token one), and a line through the multi-token passes misprices the one-token pass
    that plain decoding is made of.

    Each size also keeps a decayed variance of its passes, so that ``noise`` can tell a
    real dip in the curve from the scatter of a few passes (see ``CostAwareK``).

    Example: measured {1: 0.28, 6: 0.61} -> at(3) = 0.28 + 2/5 * 0.33 = 0.412, at(9) = 0.808.
    """

    WEIGHT = 0.3  # of the newest measurement in a size's mean

    def __init__(self) -> None:
        self._mean: dict[int, float] = {}
        self._var: dict[int, float] = {}  # decayed variance of one pass about the mean
        self._sizes: list[int] = []  # the measured sizes, in order

    def add(self, tokens: int, seconds: float) -> None:
        old = self._mean.get(tokens)
        self._mean[tokens] = _decayed(old, seconds, self.WEIGHT)
        if old is None:
            self._var[tokens] = 0.0
            bisect.insort(self._sizes, tokens)
            return
        deviation = min(seconds, OUTLIER * old) - old
        self._var[tokens] = (1 - self.WEIGHT) * (self._var[tokens] + self.WEIGHT * deviation**2)

    def known(self, tokens: int) -> bool:
        return tokens in self._mean

    @property
    def sizes(self) -> int:
        """How many sizes were measured."""
        return len(self._mean)

    def noise(self, tokens: int) -> float:
        """The standard error of ``at(tokens)``: the scatter of a decayed mean of passes that
        scatter as measured (variance times ``WEIGHT / (2 - WEIGHT)``); for a size never
        measured, the larger of its measured neighbours'. 0 until a size has two passes."""
        if tokens in self._var:
            variance = self._var[tokens]
        else:
            _, below, above = self._neighbours(tokens)
            variance = max((self._var[s] for s in (below, above) if s is not None), default=0.0)
        return math.sqrt(variance * self.WEIGHT / (2 - self.WEIGHT))

    def _neighbours(self, tokens: int) -> tuple[int | None, int | None, int | None]:
        """The measured sizes just below ``tokens`` (the two nearest) and just above it."""
        sizes = self._sizes
        i = bisect.bisect_left(sizes, tokens)
        below = sizes[i - 2] if i >= 2 else None, sizes[i - 1] if i >= 1 else None
        return (*below, sizes[i] if i < len(sizes) else None)

    def at(self, tokens: int) -> float | None:
        if not self._mean:
            return None
        if tokens in self._mean:
            return self._mean[tokens]
        second, below, above = self._neighbours(tokens)
        if below is None:
            assert above is not None  # some size is measured
            return self._mean[above]
        if above is not None:
            lo, hi = below, above
        elif second is not None:
            lo, hi = second, below
        else:
            return self._mean[below]
        slope = max(0.0, (self._mean[hi] - self._mean[lo]) / (hi - lo))
        return self._mean[lo] + slope * (tokens - lo)


# By rows of a stream's block, 0 up: (seconds they add to the pass, the noise of its time).
Prices = list[tuple[float | None, float]]

# A measurement more than this many times the running mean counts as this many times it: a
# pass that stalled (another process took the CPU) says more about the machine than about
# the block size, and one such stall must not switch drafting off for many steps.
OUTLIER = 2.0


def _decayed(old: float | None, new: float, weight: float = 0.3) -> float:
    """A running mean with exponential forgetting, robust to one-off stalls."""
    if old is None:
        return new
    return (1 - weight) * old + weight * min(new, OUTLIER * old)


@dataclass
class CostProfile:
    """What drafting costs with one target and drafter on one machine, learnt as steps run.

    It outlives a generation (an engine keeps one), so the second request of a server, or
    the second prompt of a bench run, starts from what the first measured. Acceptance is
    kept too, per statistics key, as the prior of the next generation.

    Passes shared with other streams are kept apart from passes a stream ran alone
    (``shared_times``): under load a row costs what it costs among the other streams' rows and
    contexts, which calibration on an idle machine does not show. Measured at 4 clients, a
    4-row pass took 170 ms against 109 calibrated while the 5-row size, never run under that
    load, kept its calibrated 127: one curve mixing the two made a fifth row look free.
    """

    pass_times: PassTimes = field(default_factory=PassTimes)  # passes alone, and calibration
    shared_times: PassTimes = field(default_factory=PassTimes)  # passes that held other streams' rows
    draft_token_seconds: dict[str, float] = field(default_factory=dict)  # per source
    catchup_token_seconds: dict[str, float] = field(default_factory=dict)  # per source
    acceptance: dict[str, tuple[float, float]] = field(default_factory=dict)  # key -> (accepted, rejected)
    # Rows other streams put in the passes this stream's rows rode in lately (batched backends):
    # the next generation starts from the load the last one saw, not from an empty machine.
    others_rows: float = 0.0
    # The shared pass learnt last: every stream in a pass reports it, and it counts once.
    _last_shared: PassInfo | None = field(default=None, repr=False)

    def learn(self, outcome: Outcome) -> None:
        info = outcome.pass_info
        if info is None:
            self.pass_times.add(outcome.own_rows, outcome.verify_seconds)
        elif outcome.others_rows == 0:
            self.pass_times.add(info.rows, info.seconds)
        elif info != self._last_shared:
            self.shared_times.add(info.rows, info.seconds)
            self._last_shared = info
        source = outcome.choice.source
        if source is None or outcome.n_proposed == 0:
            return
        self.draft_token_seconds[source] = _decayed(
            self.draft_token_seconds.get(source), outcome.draft_seconds / outcome.n_proposed
        )
        if outcome.catchup_tokens:
            self.catchup_token_seconds[source] = _decayed(
                self.catchup_token_seconds.get(source), outcome.catchup_seconds / outcome.catchup_tokens
            )


class CostAwareK:
    """Pick the offer and draft length with the most expected tokens per second, or none.

    Acceptance ``alpha`` is estimated per statistics key as accepted / (accepted +
    rejections) with exponential forgetting (the maximum-likelihood estimate when each draft
    token is accepted independently with probability alpha). Drafting ``k`` tokens from an
    offer is expected to emit ``expected_tokens(alpha, k)`` tokens and to take
    ``k t_draft + t_verify(k + 1)``, plus the offer's catch-up (``behind`` tokens fed at the
    measured catch-up rate) spread over the steps left in the budget, at most
    ``CATCHUP_HORIZON`` of them; plain decoding emits one token in ``t_verify(1)``.
    ``t_draft`` per source and ``t_verify`` per block size (``PassTimes``) are measured and
    kept in a ``CostProfile`` across generations.

    Until the profile knows a plain pass, the policy decodes plainly (to measure what
    drafting must beat; ``draftwise.costs.calibrate`` measures it, and every block size,
    before the first step). An offer whose acceptance was never observed is tried once with
    the configured k, if its catch-up would cost no more than a few plain steps (a draft
    model that has not read a long prompt is not worth a prefill just to find out). A source
    whose draft cost is unmeasured is priced by its ``cost_hint``. When no offer beats plain
    decoding the policy drafts nothing, and after ``probe_every`` such steps it drafts once
    with the best offer whose catch-up is cheap enough, to re-measure. A probe that does not
    bring drafting back doubles the wait before the next one (up to ``PROBE_BACKOFF`` times
    ``probe_every``): on text the drafter cannot predict, probes are pure cost, and a model
    drafter's probe also pays to catch up on the steps it sat out.

    Example, times in plain passes: verifying 3 tokens costs 1.9, drafting one costs 0.2,
    alpha = 0.6: k = 2 gives 1.96 tokens / 2.3 = 0.85 tokens per plain pass, below plain
    decoding's 1, so the policy drafts nothing; with alpha = 0.9, k = 2 gives 2.71 / 2.3 = 1.18.

    **Batched with other streams** (a server whose slots share passes), a step's rows ride in
    a pass the other streams fill with ``B`` rows anyway, so they are priced at what they add
    to it, ``T(B + k + 1) - T(B)``, not at a pass of their own (and at least
    ``MARGINAL_FLOOR`` of a plain pass a row, so that a cheaper bigger shape never makes
    rows free), with ``T`` read off the passes shared with other streams
    (``CostProfile.shared_times``) once two sizes of them are known. ``B`` is learnt from
    the passes' reports (``Outcome.pass_info``).

    Example, with the pass times 1/2/3/4/8/16 rows = 65/88/101/86/152/169 ms: alone, drafting
    3 tokens at alpha 0.5 gives 1.875 tokens in 86 ms against plain's 1 in 65: it drafts.
    Beside 4 other rows, plain adds T(5) - T(4) and 3 drafted tokens add T(8) - T(4) = 66 ms;
    beside 8 rows, 8 more rows add only T(16) - T(8) = 17 ms, so long drafts pay; past the
    measured curve each row adds its slope, and drafting pays only at an acceptance no
    stream reaches, so it stops.

    **Long blocks.** A grounded offer (a prediction, an n-gram copy in progress, see ``Offer``) may
    draft past ``k_max``, up to ``k_long``, but no more than ``GROWTH`` times its current run:
    the tokens it got accepted in a row since its last rejection. That bounds the waste of a
    long block that fails early: it can cost at most the rows of a pass ``GROWTH`` times as
    long as the run of right tokens that earned it, and a source that fails early keeps its
    blocks at ``k_max`` and below, where its measured acceptance prices them.

    Example, ``k_max`` 12, ``k_long`` 48: a prediction that got 7 tokens right in a row may
    draft 12; after 20 in a row, 40; after 30, 48; a rejection starts its run at 0 again.

    **Noise.** Under load the passes of one size scatter (the streams' contexts differ, prompt
    pieces come and go), and a few passes per size leave means that cross: a curve learnt at 4
    clients read T(4) = 147, T(5) = 162, T(6) = 157 ms, so a row beside plain decoding's
    looked free and half-right one-token drafts won on paper and lost on the machine. Beside
    ``B`` rows, drafting ``k`` tokens expected to emit ``E`` beats plain decoding when
    ``E (T(B+1) - T(B)) > T(B+k+1) - T(B)``, that is when ``G = E T(B+1) - (E-1) T(B) -
    T(B+k+1)`` is positive; alone, ``T(B)`` drops out. Each mean carries its standard error
    (``PassTimes.noise``), so ``G`` has one, and a block is priced ``noise_margin`` of them
    above its measured cost: drafting must win by more than the scatter could have made up. A
    curve measured without scatter (calibration, a quiet machine) keeps its dips, so a stream
    still fills a cheap shape.

    Example: the curve above, each size's passes scattering by 30 ms (standard errors of
    12.6 ms), a one-token draft at acceptance 0.5 (E = 1.5): G = 243 - 73.5 - 157 = 12.5 ms
    in drafting's favour, with a standard error of 12.6 x sqrt(0.5^2 + 1.5^2 + 1) = 23.6 ms;
    at ``noise_margin`` 2 the draft would need a G above 47 ms, so the stream decodes plainly.
    """

    DECAY = 0.9
    PRIOR = (2.1, 0.9)  # alpha = 0.7, worth three tokens, until evidence says otherwise
    # Catch-up runs as a prefill, many tokens per pass: a token of it costs a small share of
    # a one-token plain pass (until measured).
    CATCHUP_GUESS = 0.05
    EXPLORE_STEPS = 8.0  # most plain passes' worth of catch-up spent to try a source once
    PROBE_BACKOFF = 8  # the longest wait between probes, in multiples of probe_every
    # A catch-up is priced as if repaid within this many steps, not over the whole budget:
    # once paid it is sunk, and the source may turn out worse than its record.
    CATCHUP_HORIZON = 16.0
    MARGINAL_FLOOR = 0.05  # least price of a row in a shared pass, in one-token plain passes
    # A probe re-measures acceptance; it is worth its cost only if some acceptance could make
    # drafting pay. If even a drafter right this often would lose to plain decoding at the
    # current costs (a big batch, a draft as slow as the target), there is nothing to learn.
    PROBE_CEILING = 0.95
    OTHERS_WEIGHT = 0.3  # of the newest pass in the running mean of other streams' rows
    GROWTH = 2  # a grounded source's longest block, in multiples of its run of accepted tokens

    def __init__(self, config: DraftConfig, profile: CostProfile | None = None) -> None:
        self.k_max = config.k_max
        self.k_long = max(config.k_max, config.k_long)
        self._runs: dict[str, int] = {}  # statistics key -> tokens accepted in a row since its last rejection
        self.k_start = max(1, min(config.k, config.k_max))
        self.probe_every = config.probe_every
        self.noise_margin = config.noise_margin
        self.profile = profile or CostProfile()
        self._counts = {key: _prior(counts) for key, counts in self.profile.acceptance.items()}
        self._idle_steps = 0
        self._probe_gap = self.probe_every  # idle steps before the next probe
        self._others = self.profile.others_rows  # rows other streams put in the passes ours ride in

    @property
    def pass_times(self) -> PassTimes:
        return self.profile.pass_times

    def alpha_of(self, key: str) -> float:
        accepted, rejected = self._counts.get(key, self.PRIOR)
        return accepted / (accepted + rejected)

    @property
    def alpha(self) -> float:
        """Acceptance of the most used key (the only one for single-source drafters)."""
        if not self._counts:
            return self.alpha_of("")
        return self.alpha_of(max(self._counts, key=lambda key: sum(self._counts[key])))

    def rate(
        self, offer: Offer | None, k: int, remaining: int, alpha: float | None = None, table: Prices | None = None
    ) -> float | None:
        """Expected tokens per second of drafting ``k`` from ``offer`` (plain for k == 0) at
        the offer's measured acceptance, or at ``alpha``; None until the costs are measured.
        ``table``: ``_prices`` of at least ``k + 1`` rows, read once for many calls."""
        table = table or self._prices(k + 1)
        if offer is None or k == 0:
            verify = table[1][0]
            return 1.0 / verify if verify else None
        return self._rates(offer, k, remaining, alpha, table)[k - 1]

    def _rates(self, offer: Offer, top: int, remaining: int, alpha: float | None, table: Prices) -> list[float | None]:
        """``rate`` of drafting 1 to ``top`` tokens from ``offer``, what does not depend on the
        length read once. A block is priced ``noise_margin`` standard errors of what the
        measured curve says drafting gains over plain decoding above its cost (see "Noise")."""
        plain = self.pass_times.at(1)
        measured = self.profile.draft_token_seconds.get(offer.source)
        accept = self.alpha_of(offer.stats_key) if alpha is None else alpha
        catchup = self._catchup_seconds(offer)
        below = table[0][1] if round(self._others) else 0.0
        rates: list[float | None] = []
        for k in range(1, top + 1):
            verify, noise = table[k + 1]
            if verify is None:
                rates.append(None)
                continue
            draft = measured if measured is not None else offer.cost_hint * (plain or verify)
            sure, guessed = min(k, offer.sure), max(0, k - offer.sure)
            tokens = sure + expected_tokens(accept, guessed)
            doubt = self.noise_margin * math.hypot((tokens - 1) * below, tokens * table[1][1], noise)
            steps = min(max(1.0, remaining / tokens), self.CATCHUP_HORIZON)
            seconds = verify + doubt + guessed * draft + (catchup / steps if guessed else 0.0)
            rates.append(tokens / seconds if seconds > 0 else None)
        return rates

    def _prices(self, rows: int) -> Prices:
        """For 0 to ``rows`` rows of this stream: the seconds they add to the pass they ride in
        (a whole pass alone; beside the other streams' rows, the difference they make, and at
        least ``MARGINAL_FLOOR`` of a plain pass a row) and the noise of that pass's time."""
        curve, others = self._curve(), round(self._others)
        base, plain = curve.at(others) or 0.0, self.pass_times.at(1)
        prices: Prices = [(None, curve.noise(others))]
        for n in range(1, rows + 1):
            total = curve.at(others + n)
            if total is not None and others:
                total = max(total - base, self.MARGINAL_FLOOR * (plain or total) * n)
            prices.append((total, curve.noise(others + n)))
        return prices

    def _curve(self) -> PassTimes:
        """The pass times to price rows on: passes shared with other streams while there are
        others (once two sizes of them are known), else passes alone."""
        shared = self.profile.shared_times
        return shared if round(self._others) > 0 and shared.sizes >= 2 else self.pass_times

    def _catchup_seconds(self, offer: Offer) -> float:
        per_token = self.profile.catchup_token_seconds.get(offer.source)
        if per_token is None:
            per_token = self.CATCHUP_GUESS * (self.pass_times.at(1) or 0.0)
        return offer.behind * per_token

    def _affordable(self, offers: Sequence[Offer]) -> list[Offer]:
        """The offers whose catch-up costs at most ``EXPLORE_STEPS`` plain passes: the only
        ones worth trying just to find out (a probe, or a source never tried)."""
        budget = self.EXPLORE_STEPS * (self.pass_times.at(1) or 0.0)
        return [offer for offer in offers if self._catchup_seconds(offer) <= budget]

    def _exploration(self, offers: Sequence[Offer]) -> Choice | None:
        """An offer whose acceptance was never observed, if trying it is cheap enough."""
        for offer in self._affordable(offers):
            if offer.stats_key not in self._counts and not _all_sure(offer):
                k = offer.sure + self.k_start
                return Choice(offer, k if offer.limit is None else min(k, offer.limit))
        return None

    def longest(self, offer: Offer) -> int:
        """The longest block ``offer`` may draft now (see "Long blocks"): its forced tokens,
        then as many as its source may draft."""
        top = self.k_max
        if offer.grounded:
            top = max(top, min(self.k_long, self.GROWTH * self._runs.get(offer.stats_key, 0)))
        top += offer.sure
        return top if offer.limit is None else min(top, offer.limit)

    def _best(self, offers: Sequence[Offer], remaining: int, alpha: float | None = None) -> tuple[Choice, float]:
        """The drafting choice with the best expected rate (``PLAIN`` if none is priced), at
        each offer's measured acceptance or at ``alpha``."""
        best, best_rate = PLAIN, 0.0
        table = self._prices(max((self.longest(offer) for offer in offers), default=0) + 1)
        for offer in offers:
            for k, rate in enumerate(self._rates(offer, self.longest(offer), remaining, alpha, table), start=1):
                if rate is not None and rate > best_rate:
                    best, best_rate = Choice(offer, k), rate
        return best, best_rate

    def choose(self, offers: Sequence[Offer], remaining: int) -> Choice:
        if not self.pass_times.known(1) or not offers:
            return PLAIN  # one plain step first: it measures what drafting has to beat
        explore = self._exploration(offers)
        if explore is not None:
            return explore
        best, rate = self._best(offers, remaining)
        plain = self.rate(None, 0, remaining) or 0.0
        if rate > plain:
            self._idle_steps, self._probe_gap = 0, self.probe_every
            return best
        self._idle_steps += 1
        if self._idle_steps < self._probe_gap:
            return PLAIN
        affordable = self._affordable(offers)
        if self._best(affordable, remaining, self.PROBE_CEILING)[1] <= plain:
            return PLAIN  # no acceptance a probe could find would make drafting pay
        probe, _ = self._best(affordable, remaining)
        if probe is not PLAIN:
            self._idle_steps = 0
            self._probe_gap = min(2 * self._probe_gap, self.PROBE_BACKOFF * self.probe_every)
        return probe

    def update(self, outcome: Outcome) -> None:
        self.profile.learn(outcome)
        if outcome.pass_info is not None:
            self._others += self.OTHERS_WEIGHT * (outcome.others_rows - self._others)
            self.profile.others_rows = self._others
        offer = outcome.choice.offer
        # Only the tokens after the forced ones, where the forced ones were kept, tell the
        # source's acceptance.
        if offer is None or outcome.n_proposed <= offer.sure or outcome.n_accepted < offer.sure:
            return
        key = offer.stats_key
        accepted, rejected = self._counts.get(key, self.PRIOR)
        rejection = 1 if outcome.n_accepted < outcome.n_proposed else 0
        kept = outcome.n_accepted - offer.sure
        self._runs[key] = 0 if rejection else self._runs.get(key, 0) + kept
        counts = (self.DECAY * accepted + kept, self.DECAY * rejected + rejection)
        self._counts[key] = counts
        self.profile.acceptance[key] = counts


def _all_sure(offer: Offer) -> bool:
    """Whether every token ``offer`` has is forced: nothing about it to learn."""
    return offer.limit is not None and offer.sure >= offer.limit


def _prior(counts: tuple[float, float]) -> tuple[float, float]:
    """A previous generation's acceptance, scaled to the weight of the default prior."""
    accepted, rejected = counts
    total = accepted + rejected
    weight = sum(CostAwareK.PRIOR)
    return (weight * accepted / total, weight * rejected / total) if total > 0 else CostAwareK.PRIOR


def make_policy(config: DraftConfig, profile: CostProfile | None = None) -> DraftPolicy:
    if config.k_policy == "fixed":
        return FixedK(config.k)
    if config.k_policy == "heuristic":
        return HeuristicK(config.k, config.k_max)
    return CostAwareK(config, profile)
