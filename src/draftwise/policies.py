"""Draft policies: which source drafts in the next step, and how many tokens.

Each step the drafter says what each of its sources could propose (``Offer``), and the
policy picks one of them with a draft length, or plain decoding (``PLAIN``); after the step
it learns what the step did and cost (``Outcome``; all three in ``draftwise.offers``). The
cost policy prices its choices on what this machine measured (``draftwise.profile``). The
decode loop never asks which drafter or policy it has.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from draftwise.config import DraftConfig
from draftwise.offers import PLAIN, Choice, Offer, Outcome
from draftwise.profile import Acceptance, CostProfile, PassTimes


class DraftPolicy(Protocol):
    # The arms weighed at the last choice (the one taken first, then the best others and
    # plain decoding), for whoever shows why; empty for a policy that weighs none.
    weighed: tuple[Arm, ...]

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

    weighed: tuple[Arm, ...] = ()

    def __init__(self, k: int) -> None:
        self.k = k

    def choose(self, offers: Sequence[Offer], remaining: int) -> Choice:
        return _first(offers, self.k)

    def update(self, outcome: Outcome) -> None:
        pass


class HeuristicK:
    """transformers' rule: k += 2 after a fully accepted block, else k = max(1, k - 1)."""

    weighed: tuple[Arm, ...] = ()

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


@dataclass(frozen=True)
class Arm:
    """One way to run the next step, priced: draft ``k`` from ``offer`` (none: plain)."""

    choice: Choice
    rate: float  # expected tokens per second of the rounds the step runs in
    seconds: float  # what the step itself is expected to take, a catch-up left out
    failed: float = 1.0  # tokens its rounds emit, all streams', if no guessed token is kept
    catchup: float = 0.0  # what the source must feed before it drafts, whole (paid once)
    bare: float = 0.0  # ``rate`` without the catch-up: the source's rate once it has caught up

    def describe(self) -> tuple[str, int, float]:
        """(source or "plain", k, expected tokens per second): what the events carry."""
        return self.choice.source or "plain", self.choice.k, self.rate


class CostAwareK:
    """Draft from the source and to the length with the most expected tokens per second, as
    measured on this host, or not at all; explore and lose only within a stated budget.

    One step:

    1. **Price.** Beside the ``B`` rows the other streams put in the last pass (0 alone), a
       pass over ``n`` rows takes ``T(B + n)``, read off the measured curve (calibrated up to
       the longest block; passes shared with other streams once two sizes of them are known).
       A token of a source that runs a model pass (``Offer.passes``) costs that pass, timed on
       its own, plus the round it waits in, ``T(B)``; a catch-up (``behind`` tokens at the
       measured prefill rate; until measured, a row of the target's largest measured pass,
       which the smaller draft model cannot exceed) is spread over the steps it may repay, at
       most ``catchup_horizon``. The numbers named here are ``DraftConfig.cost``'s.
    2. **Value.** A block of ``k`` tokens past the ``sure`` forced ones is expected to emit
       ``sure + E(k)`` tokens, ``E`` from the source's acceptance by position (``Acceptance``).
    3. **Choose** the arm whose rounds emit the most tokens per second, counting a token for
       each of the ``S`` other streams in each round it takes: ``(S (1 + r) + E) / (r (T(B) +
       d) + T(B + k + 1) + c)`` with ``r`` model passes of ``d`` seconds each, against plain
       decoding's ``(S + 1) / T(B + 1)``. Alone that is ``E / (r d + T(k + 1) + c)`` against
       ``1 / T(1)``; in a full round a stream's extra rows slow everyone's pass and its draft
       passes keep it out of ``r`` rounds, so only sure, cheap drafts pay. Streams, not rows:
       a prompt fed in pieces puts many rows in a pass and emits nothing (counted as rows, it
       made a 12-token draft model block look free beside it).
    4. **Explore.** Where some arm, at an optimistic acceptance, would beat the choice, the
       most promising such arm is tried instead, a source never tried first (while another's
       probes run, its catch-up only grows), if its source's budget covers what the block loses
       against plain decoding when nothing is kept, and the source's catch-up (a draft model
       that has not read the prompt) too, or else the catch-up is at most ``allowance`` of the
       plain time of the tokens left in the run's budget, and at most what the source, at its
       optimistic acceptance, would save over as many tokens as the run has emitted: a run
       lasts, as likely as not, at least as long again as it has lasted. The budget alone says
       nothing of that (an answer may stop far short of it): priced on it, a draft model was
       prefilled for answers of 20 tokens. The optimistic acceptance is one Hoeffding width
       above the record at confidence ``1 / steps``, as UCB1 explores (``Acceptance.rates``),
       at most ``optimism_cap``: a source whose first blocks failed by chance is tried again,
       ever more rarely. Probes start short and grow with what the source keeps: of its arms
       that could beat the choice, only those that lose, if nothing is kept, at most ``growth``
       times what the cheapest of them loses, times the deepest position the source's blocks
       have reached (at least one), are probed. A source never checked looks best at its
       longest block, where a short one tells as much (whether its first guess is kept) for a
       fraction of the loss. Each source's budget (shared by the streams and requests of its
       profile, ``CostProfile.budgets``) opens at ``opening`` plain tokens' time, refills at
       its share of ``allowance`` of the time decoded, and pays for the probes that lost; a
       source that loses uses up no other's budget.
    5. **Guard.** Each source has an account, opened at ``opening`` plain tokens' time, that
       every step pays its share of ``allowance`` of the step's time into, and every drafting
       step of the source what it earned against plain decoding: the tokens its rounds emitted
       times the measured time of a plain token (the mean of the generation's plain steps,
       ``plain_token``), less its own measured time (negative when it lost). A catch-up is an
       investment that the steps after it repay, not the block's loss, and is left out. While a
       source's account is below zero, it guesses nothing (a grammar's forced tokens, sure and
       free, still go). So on any host, and whatever the estimates get wrong, drafting costs a
       run at most ``allowance`` of its decoding time, plus per source its opening and the loss
       of the one step that overdrew its account (with the default ``k_max``, a 13-row pass
       against a one-row one), plus the catch-ups of its probes, each within its budget or at
       most ``allowance`` of the run (step 4). An unlucky first block of a good source does not
       shut it out, and a source that loses shuts out no other.

    **Beside other streams** a step's loss is everyone's: its rows slow the pass the ``S``
    others ride in. So steps 4 and 5 count in the round's tokens (a plain token takes the
    plain round over its ``S + 1`` streams; a step earns for the others' tokens too), and each
    stream pays in and opens with its ``1 / (S + 1)`` share: the streams of a round together
    lose at most ``allowance`` of its time, not ``S + 1`` times that.

    Example, alone, on a host where passes of 1 / 5 rows take 63 / 100 ms and a draft token
    12 ms: a source right 95% of the time at every position, k = 4, emits 4.52 tokens in
    148 ms, 30.5 tokens/s against plain's 15.9: it drafts. With 29 / 110 ms, it emits
    4.52 in 158 ms, 28.6 against 34.5: it decodes plainly.

    **Long blocks.** A grounded offer (a prediction, an n-gram copy in progress, see ``Offer``)
    may draft past ``k_max``, up to ``k_long``, but no more than ``growth`` times its current
    run of tokens kept in a row: a long block that fails early then wastes at most the rows
    its run earned, and a source that fails early keeps to ``k_max``.
    """

    def __init__(self, config: DraftConfig, profile: CostProfile | None = None) -> None:
        self.k_max = config.k_max
        self.k_long = max(config.k_max, config.k_long)
        self.settings = config.cost  # the numbers this docstring names (``CostPolicyConfig``)
        self.profile = profile or CostProfile.under(config.cost)
        # Per source: seconds its drafting is ahead of plain decoding, plus its allowance (step 5).
        self.accounts: dict[str, float] = {}
        self._exploring = False  # whether the last choice was a probe (step 4), not the best arm
        self.steps = 0  # steps learnt from: the optimistic acceptance's confidence grows with them
        self.emitted = 0  # tokens this stream has emitted: how long its run has lasted so far
        self.others_rows = self.profile.others_rows  # rows of other streams in the last pass ours rode in
        self.others_streams = self.profile.others_streams  # and the streams they belong to
        # This stream's acceptance, from the last generation's (a prompt of its own may differ).
        # A server builds it off the rounds that update the tables: ``tuple`` takes them in one
        # step under the interpreter's lock, and ``under`` copies each count list likewise.
        tables = tuple(self.profile.acceptance.items())
        self._acceptance = {key: counts.under(self.settings) for key, counts in tables}
        # Per count of streams in a round: the seconds and the number of this generation's plain
        # steps among as many, whose mean (a round's time over its streams) prices a plain token.
        self._plain_steps: dict[int, tuple[float, int]] = {}
        self._runs: dict[str, int] = {}  # statistics key -> tokens kept in a row since its last rejection
        self.weighed: tuple[Arm, ...] = ()

    @property
    def pass_times(self) -> PassTimes:
        return self.profile.pass_times

    def acceptance(self, key: str) -> Acceptance:
        return self._acceptance.setdefault(key, Acceptance(self.settings))

    def _curve(self, others: int) -> PassTimes:
        """Passes shared with other streams while there are others (once two sizes of them are
        known), else passes alone."""
        shared = self.profile.shared_times
        return shared if others > 0 and shared.sizes >= 2 else self.pass_times

    def _pass(self, rows: int) -> float:
        """``T(rows)`` where the rows ride beside the other streams' (``T(0)`` = 0): on the
        shared curve, read rising, and never below a pass of as many rows alone. Under load the
        shared sizes measured are few and far apart (the rounds' few rows, a prompt piece's
        many): the line between them prices the sizes in between below what the kernels take
        even on an idle machine, which made a block beside a round look nearly free."""
        if rows <= 0:
            return 0.0
        alone = self.pass_times.at(rows) or 0.0
        curve = self._curve(self.others_rows)
        if curve is self.pass_times:
            return alone
        return max(alone, curve.at(rows, rising=True) or 0.0)

    def longest(self, offer: Offer) -> int:
        """The longest block ``offer`` may draft now: its forced tokens, then as many as its
        source may draft (see "Long blocks")."""
        top = self.k_max
        if offer.grounded:
            top = max(top, min(self.k_long, int(self.settings.growth * self._runs.get(offer.stats_key, 0))))
        top += offer.sure
        return top if offer.limit is None else min(top, offer.limit)

    def plain(self) -> Arm:
        seconds = self._pass(self.others_rows + 1)
        return Arm(PLAIN, (self.others_streams + 1) / seconds if seconds > 0 else 0.0, seconds)

    def arms(self, offer: Offer, remaining: int, optimistic: bool = False) -> list[Arm]:
        """Each block length ``offer`` may draft, priced (steps 1 to 3)."""
        others, top = self.others_rows, min(self.longest(offer), remaining - 1)  # the target adds a token
        plain = self.pass_times.at(1) or 0.0
        # A draft token's and a catch-up token's cost until measured: at their dearest when
        # choosing (``cost_hint``, a whole target pass for a model; a row of the target's
        # largest measured pass), free when exploring, as an unknown acceptance is taken at its
        # best: the first block measures them.
        draft = self._price(self.profile.draft_token_seconds, offer.source, offer.cost_hint * plain, optimistic)
        catchup = offer.behind * self._price(
            self.profile.catchup_token_seconds, offer.source, self.pass_times.row(), optimistic
        )
        run = self._runs.get(offer.stats_key, 0)
        floor = (run + 1) / (run + 2) if offer.follows else 0.0  # Laplace's rule over its run (``Offer``)
        expected = self.acceptance(offer.stats_key).expected(max(0, top - offer.sure), optimistic, self.steps, floor)
        arms = []
        for k in range(1, top + 1):
            guessed = max(0, k - offer.sure)
            tokens = min(k, offer.sure) + expected[guessed]
            rounds = guessed if offer.passes else 0
            fed = catchup if guessed else 0.0  # forced tokens alone need no model
            seconds = guessed * draft + rounds * self._pass(others) + self._pass(others + k + 1)
            spread = seconds + fed / min(max(1.0, remaining / tokens), self.settings.catchup_horizon)
            others_tokens = self.others_streams * (1 + rounds)
            rate = (others_tokens + tokens) / spread if spread > 0 else 0.0
            bare = (others_tokens + tokens) / seconds if seconds > 0 else 0.0
            arms.append(Arm(Choice(offer, k), rate, seconds, others_tokens + min(k, offer.sure) + 1, fed, bare))
        return arms

    @staticmethod
    def _price(measured: dict[str, float], source: str, dearest: float, optimistic: bool) -> float:
        if source in measured:
            return measured[source]
        return 0.0 if optimistic else dearest

    def choose(self, offers: Sequence[Offer], remaining: int) -> Choice:
        plain = self.plain()
        if plain.seconds <= 0:
            self.weighed = (plain,)
            return PLAIN  # one plain step first: it measures what drafting has to beat
        for offer in offers:  # a source offered for the first time opens its account and budget
            self.accounts.setdefault(offer.source, self.settings.opening / plain.rate)
            self.profile.budgets.setdefault(offer.source, self.settings.opening / plain.rate)
        priced = sorted((a for o in offers for a in self.arms(o, remaining) if self._allows(a)), key=lambda a: -a.rate)
        best = priced[0] if priced and priced[0].rate > plain.rate else plain
        taken = self._explore(offers, remaining, best, plain)
        self._exploring = taken is not best
        self.weighed = tuple(dict.fromkeys((taken, best, *priced[:2], plain)))[:4]
        return taken.choice

    def _allows(self, arm: Arm) -> bool:
        """Step 5: whether the guard lets ``arm`` go: its source's account is not overdrawn, or
        it guesses nothing (a block of a grammar's forced tokens alone: sure, and free)."""
        offer = arm.choice.offer
        return offer is None or self.accounts.get(offer.source, 0.0) >= 0 or arm.choice.k <= offer.sure

    def _explore(self, offers: Sequence[Offer], remaining: int, best: Arm, plain: Arm) -> Arm:
        """Step 4: the arm that could do best among those the guard allows and whose failure
        their source's budget covers, else ``best``."""
        hopes = (a for o in offers for a in self._probes(o, remaining, best, plain) if self._allows(a))
        affordable = [a for a in hopes if self._affords(a, remaining, plain)]
        # A source never tried goes first: while another's probes run, its catch-up only grows.
        return max(affordable, key=lambda a: (self._untried(a), a.rate)) if affordable else best

    def _probes(self, offer: Offer, remaining: int, best: Arm, plain: Arm) -> list[Arm]:
        """The blocks ``offer`` may probe (step 4): those that, at the optimistic acceptance,
        beat ``best``, and lose, if nothing is kept, at most ``growth`` times what the cheapest
        of them loses, times the deepest position its source's blocks have reached (at least
        one)."""
        hopes = [arm for arm in self.arms(offer, remaining, optimistic=True) if arm.rate > best.rate]
        if not hopes:
            return []
        reached = len(self.acceptance(offer.stats_key).tried)
        least = min(self._lost(arm, plain) for arm in hopes)
        cap = self.settings.growth * max(1, reached) * max(0.0, least)
        return [arm for arm in hopes if self._lost(arm, plain) <= cap]

    @staticmethod
    def _lost(arm: Arm, plain: Arm) -> float:
        """What ``arm``'s step loses against plain decoding if no guessed token is kept."""
        return arm.seconds - arm.failed / plain.rate

    def _untried(self, arm: Arm) -> bool:
        return arm.choice.offer is not None and not self.acceptance(arm.choice.offer.stats_key).tried

    def _affords(self, arm: Arm, remaining: int, plain: Arm) -> bool:
        offer = arm.choice.offer
        assert offer is not None  # plain decoding is never explored
        lost, budget = self._lost(arm, plain), self.profile.budgets[offer.source]
        if lost + arm.catchup <= budget:
            return True
        # A catch-up beyond the budget goes if it is at most ``allowance`` of the plain time of
        # the tokens left in the run's budget, and if the source, at its optimistic acceptance,
        # would repay it over as many tokens as the run has emitted: a run lasts, as likely as
        # not, at least as long again as it has lasted (and no longer than its budget).
        ahead = min(remaining, self.emitted)
        saved = ahead / plain.rate - ahead / arm.bare if arm.bare > 0 else 0.0
        return lost <= budget and arm.catchup <= min(saved, self.settings.allowance * remaining / plain.rate)

    def update(self, outcome: Outcome) -> None:
        self.profile.learn(outcome)
        self.steps += 1
        self.emitted += outcome.n_accepted + 1
        if outcome.pass_info is not None:
            self.others_rows, self.others_streams = outcome.others_rows, outcome.others_streams
        drafting, catchup, verifying = self.profile.seconds_of(outcome)
        seconds = drafting + catchup + verifying
        streams = outcome.others_streams + 1  # who share the round's time, and its allowance
        offer = outcome.choice.offer
        if offer is None:
            total, count = self._plain_steps.get(streams, (0.0, 0))
            self._plain_steps[streams] = (total + verifying / streams, count + 1)
        plain_token = self.plain_token(streams) or verifying / streams
        self._pay_in(self.settings.allowance * seconds / streams, self.settings.opening * plain_token)
        if offer is None:
            return
        source = offer.source
        rounds = max(0, outcome.n_proposed - offer.sure) if offer.passes else 0
        emitted = (streams - 1) * (1 + rounds) + outcome.n_accepted + 1  # every stream's, in its rounds
        # A catch-up is an investment the steps after it repay, not the block's loss: step 4
        # bounds each one that a probe makes.
        earned = emitted * plain_token - (seconds - catchup)
        self.accounts[source] = self.accounts.get(source, 0.0) + earned
        budgets = self.profile.budgets
        if source in budgets and earned < 0 and self._exploring:
            budgets[source] += earned  # a probe's loss
        # Only the tokens after the forced ones, where the forced ones were kept, tell the
        # source's acceptance.
        if outcome.n_proposed <= offer.sure or outcome.n_accepted < offer.sure:
            return
        key, kept = offer.stats_key, outcome.n_accepted - offer.sure
        self.acceptance(key).add(outcome.n_proposed - offer.sure, kept)
        self.profile.acceptance[key] = self.acceptance(key)
        rejected = outcome.n_accepted < outcome.n_proposed
        self._runs[key] = 0 if rejected else self._runs.get(key, 0) + kept

    def plain_token(self, streams: int) -> float | None:
        """A plain token's price in rounds of ``streams`` streams (step 5): the mean of this
        generation's plain steps among as many, else the curve's plain round over its streams
        (None before any pass is known). A mean over all of them, not a running mean: the
        policy starts drafting when a stall has just raised its prices of plain decoding, and a
        running mean, frozen at that height while no plain step runs, credited each drafting
        step with time plain decoding would not have taken: a losing draft model looked like a
        winning one (``docs/speed.md``, "The guard")."""
        total, count = self._plain_steps.get(streams, (0.0, 0))
        if count:
            return total / count
        rate = self.plain().rate
        return 1 / rate if rate > 0 else None

    def _pay_in(self, allowance: float, cap: float) -> None:
        """Each step's ``allowance`` into the accounts and the budgets, split evenly among the
        sources (the budgets at most ``cap``)."""
        for pots in (self.accounts, self.profile.budgets):
            for source in pots:
                pots[source] += allowance / len(pots)
        for source, budget in self.profile.budgets.items():
            self.profile.budgets[source] = min(budget, cap)


def make_policy(config: DraftConfig, profile: CostProfile | None = None) -> DraftPolicy:
    if config.k_policy == "fixed":
        return FixedK(config.k)
    if config.k_policy == "heuristic":
        return HeuristicK(config.k, config.k_max)
    return CostAwareK(config, profile)
