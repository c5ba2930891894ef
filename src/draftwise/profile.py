"""What drafting costs with one pair on one machine, as measured and learnt while it runs.

``PassTimes`` holds a target pass's seconds by its rows, ``Acceptance`` a source's chance of
keeping each position of its block, and ``CostProfile`` both with each source's own draft
and catch-up costs; the cost policy (``draftwise.policies.CostAwareK``) prices its choices on
them, and ``draftwise.costs`` calibrates the curve before the first step.
"""

from __future__ import annotations

import bisect
import json
import math
from dataclasses import dataclass, field
from pathlib import Path

from draftwise.config import CostPolicyConfig
from draftwise.errors import ConfigError
from draftwise.lm import PassInfo
from draftwise.offers import Outcome

DEFAULTS = CostPolicyConfig()  # frozen: the settings of a profile or count made without any


class PassTimes:
    """Seconds of a target pass by the number of rows it scores, as measured.

    Each measured size keeps a decayed mean. A size never measured is read off the line
    between its measured neighbours; beyond the largest measured size, the line through the
    two largest continues (flat while only one size is known); below the smallest, the
    smallest's time stands. No global line is fitted on purpose: on a CPU the cost is far
    from linear in the block size (kernels change with the number of rows; llama.cpp's
    quantized products run rows in groups of four, so a 4-token pass can cost less than a
    3-token one), and a line through the multi-token passes misprices the one-token pass
    that plain decoding is made of.

    Example: measured {1: 0.28, 6: 0.61} -> at(3) = 0.28 + 2/5 * 0.33 = 0.412, at(9) = 0.808.
    """

    def __init__(self, settings: CostPolicyConfig = DEFAULTS) -> None:
        self.settings = settings  # ``pass_weight`` and ``outlier``: how a size's mean moves
        self._mean: dict[int, float] = {}
        self._sizes: list[int] = []  # the measured sizes, in order

    def add(self, tokens: int, seconds: float) -> None:
        if tokens not in self._mean:
            bisect.insort(self._sizes, tokens)
        self._mean[tokens] = decayed(self._mean.get(tokens), seconds, self.settings)

    def known(self, tokens: int) -> bool:
        return tokens in self._mean

    @property
    def sizes(self) -> int:
        """How many sizes were measured."""
        return len(self._mean)

    def row(self) -> float:
        """Seconds a row of the largest measured pass costs (0 with none): the price of a
        prompt's token read in a large pass, and an upper bound on a draft model's catch-up
        token until that is measured, since the draft is the smaller model."""
        return self._mean[self._sizes[-1]] / self._sizes[-1] if self._sizes else 0.0

    def at(self, tokens: int, rising: bool = False) -> float | None:
        """Seconds of a pass over ``tokens`` rows; ``rising``: never less than a smaller
        measured size's (for passes timed under load, where the scatter between sizes, not the
        kernels, makes most dips: at 4 clients T(4) = 147, T(5) = 162, T(6) = 157 ms)."""
        value = self._at(tokens)
        if rising and value is not None:
            return max([value, *(self._mean[n] for n in self._sizes if n <= tokens)])
        return value

    def _at(self, tokens: int) -> float | None:
        if not self._mean:
            return None
        if tokens in self._mean:
            return self._mean[tokens]
        sizes = self._sizes
        i = bisect.bisect_left(sizes, tokens)
        if i == 0:
            return self._mean[sizes[0]]
        lo, hi = (sizes[i - 1], sizes[i]) if i < len(sizes) else (sizes[i - 2] if i >= 2 else None, sizes[i - 1])
        if lo is None:
            return self._mean[hi]
        slope = max(0.0, (self._mean[hi] - self._mean[lo]) / (hi - lo))
        return self._mean[lo] + slope * (tokens - lo)


def decayed(old: float | None, new: float, settings: CostPolicyConfig = DEFAULTS) -> float:
    """A running mean with exponential forgetting (``settings.pass_weight`` of the newest), robust
    to one-off stalls: a measurement over ``settings.outlier`` times the mean counts as that many
    times it, since a pass that stalled (another process took the CPU) says more about the
    machine than about the block size, and one stall must not switch drafting off for many steps."""
    if old is None:
        return new
    return (1 - settings.pass_weight) * old + settings.pass_weight * min(new, settings.outlier * old)


class Acceptance:
    """How often one source's draft tokens are kept, by their position in the block.

    ``tried[i]`` counts the blocks whose i-th guessed token was checked (every one before it
    was kept), ``kept[i]`` those where it was kept too; each block forgets the older counts,
    at every position, by ``acceptance_memory``: by default they remember about three blocks,
    so a source that turns wrong is seen within three (``tests/test_policies.py`` shows it). The
    chance that position i is kept once reached is ``kept[i]`` over ``tried[i]``, shrunk towards
    the source's pooled rate (Laplace's rule over all positions: even odds with no evidence) by
    ``shrink`` tries' worth, so that a position tried once does not decide alone. A draft
    model is often right early in a block and wrong late: one rate per source cannot say so.

    Example (no forgetting): blocks of 4 with 4, 4 and 1 kept: tried [3, 3, 2, 2], kept
    [3, 2, 2, 2]; pooled (9 + 1) / (10 + 2) = 0.83; position 1: (2 + 2 * 0.83) / (3 + 2) = 0.73;
    positions 3 and on: (2 + 2 * 0.83) / (2 + 2) = 0.92.
    """

    def __init__(self, settings: CostPolicyConfig = DEFAULTS) -> None:
        self.settings = settings  # ``acceptance_memory``, ``shrink`` and ``optimism_cap``
        self.tried: list[float] = []
        self.kept: list[float] = []

    def under(self, settings: CostPolicyConfig) -> Acceptance:
        """A copy of these counts, read and kept by ``settings`` from now on."""
        counts = Acceptance(settings)
        counts.tried, counts.kept = list(self.tried), list(self.kept)
        return counts

    def add(self, proposed: int, accepted: int) -> None:
        """A block of ``proposed`` guessed tokens of which the first ``accepted`` were kept."""
        reached = min(proposed, accepted + 1)
        grow = reached - len(self.tried)
        if grow > 0:
            self.tried += [0.0] * grow
            self.kept += [0.0] * grow
        memory = self.settings.acceptance_memory
        for i in range(len(self.tried)):
            self.tried[i] = memory * self.tried[i] + (i < reached)
            self.kept[i] = memory * self.kept[i] + (i < accepted)

    def pooled(self) -> float:
        return (sum(self.kept) + 1) / (sum(self.tried) + 2)

    def rates(self, k: int, optimistic: bool = False, steps: int = 0) -> list[float]:
        """The chance of keeping each of the first ``k`` positions once reached; optimistic: one
        Hoeffding width above, at confidence ``1 / steps`` (``sqrt(ln(steps) / 2n)`` after n
        tries, as UCB1 explores; ``sqrt(1 / 2n)`` in the first steps), at most ``optimism_cap``: a
        source whose first blocks failed by chance is tried again, ever more rarely, as the
        steps go by. A position never reached takes the last reached one's (a block gets no
        easier further on), or the pooled rate where none was."""
        confidence = max(1.0, math.log(steps)) if steps > 1 else 1.0
        pooled = self.pooled()
        shrink, cap = self.settings.shrink, self.settings.optimism_cap
        shrunk = [(kept + shrink * pooled) / (tried + shrink) for tried, kept in zip(self.tried, self.kept)]
        out = []
        for i in range(k):
            rate = shrunk[min(i, len(shrunk) - 1)] if shrunk else pooled
            tried = self.tried[i] if i < len(self.tried) else 0.0
            out.append(min(cap, rate + math.sqrt(0.5 * confidence / (tried + 1))) if optimistic else rate)
        return out

    def expected(self, k: int, optimistic: bool = False, steps: int = 0, floor: float = 0.0) -> list[float]:
        """Tokens a block of 0 to ``k`` guessed tokens is expected to emit: those kept in a row,
        plus the target's own; each position's rate at least ``floor``.

        Example: rates [0.9, 0.5] -> [1, 1.9, 2.35]; with floor 0.8 -> [1, 1.9, 2.62]."""
        tokens, reach = [1.0], 1.0
        for rate in self.rates(k, optimistic, steps):
            reach *= max(rate, floor)
            tokens.append(tokens[-1] + reach)
        return tokens


@dataclass
class CostProfile:
    """What drafting costs with one target and drafter on one machine, learnt as steps run.

    It outlives a generation (an engine keeps one), so the second request of a server, or
    the second prompt of a bench run, starts from what the first measured: costs, and each
    source's acceptance by position.

    Passes shared with other streams are kept apart from passes a stream ran alone
    (``shared_times``): under load a row costs what it costs among the other streams' rows and
    contexts, which calibration on an idle machine does not show.
    """

    pass_times: PassTimes = field(default_factory=PassTimes)  # passes alone, and calibration
    shared_times: PassTimes = field(default_factory=PassTimes)  # passes that held other streams' rows
    draft_token_seconds: dict[str, float] = field(default_factory=dict)  # per source: its own passes
    catchup_token_seconds: dict[str, float] = field(default_factory=dict)  # per source
    acceptance: dict[str, Acceptance] = field(default_factory=dict)  # per statistics key
    # Rows and streams of others in the last pass this stream's rows rode in (batched backends):
    # the next generation starts from the load the last one saw, not from an empty machine.
    others_rows: int = 0
    others_streams: int = 0
    # Per source: seconds exploring it may still lose (``CostAwareK``, step 4), for every stream
    # and generation of this profile together: each opens once, when its source is first
    # offered, not once a request, so that a server's requests do not each pay again to learn
    # what drafting is worth on this host.
    budgets: dict[str, float] = field(default_factory=dict)
    # The shared pass learnt last: every stream in a pass reports it, and it counts once.
    _last_shared: PassInfo | None = field(default=None, repr=False)

    # Prices from a host profile (``read_host``), held as they are: the policy then chooses as
    # it would on that host, whatever this machine's passes take. Acceptance is learnt all the same.
    fixed: bool = False

    @classmethod
    def under(cls, settings: CostPolicyConfig, fixed: bool = False) -> CostProfile:
        """An empty profile whose times move by ``settings`` (``pass_weight``, ``outlier``)."""
        return cls(pass_times=PassTimes(settings), shared_times=PassTimes(settings), fixed=fixed)

    def learn(self, outcome: Outcome) -> None:
        info = outcome.pass_info
        if info is not None:
            self.others_rows, self.others_streams = outcome.others_rows, outcome.others_streams
        if not self.fixed:
            self._learn_times(outcome)

    def seconds_of(self, outcome: Outcome) -> tuple[float, float, float]:
        """(drafting, catching up, verifying) of a step: as measured, or where the prices are
        ``fixed``, as the profile's host would take them, so that the policy's accounts hold
        that host's gains and losses, not this machine's."""
        if not self.fixed:
            return outcome.draft_seconds, outcome.catchup_seconds, outcome.verify_seconds
        return self.price(outcome)

    def price(self, outcome: Outcome) -> tuple[float, float, float]:
        """(drafting, catching up, verifying) of a step on this profile's costs: its drafted and
        catch-up tokens at their sources' prices (0 where none is known), its pass off the curve."""
        source = outcome.choice.source or ""
        rows = outcome.pass_info.rows if outcome.pass_info is not None else outcome.own_rows
        return (
            outcome.n_proposed * self.draft_token_seconds.get(source, 0.0),
            outcome.catchup_tokens * self.catchup_token_seconds.get(source, 0.0),
            self.pass_times.at(rows) or 0.0,
        )

    def _learn_times(self, outcome: Outcome) -> None:
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
        own = outcome.draft_seconds if outcome.draft_pass_seconds is None else outcome.draft_pass_seconds
        settings = self.pass_times.settings
        self.draft_token_seconds[source] = decayed(
            self.draft_token_seconds.get(source), own / outcome.n_proposed, settings
        )
        if outcome.catchup_tokens:
            self.catchup_token_seconds[source] = decayed(
                self.catchup_token_seconds.get(source), outcome.catchup_seconds / outcome.catchup_tokens, settings
            )


def read_host(path: Path, settings: CostPolicyConfig = DEFAULTS) -> CostProfile:
    """The costs a host profile file holds (``draftwise curve --out`` writes one; more in
    ``tests/data/hosts``): a target pass's milliseconds by its rows (``pass_ms``, one row among
    them), and per source a drafted token's and a catch-up token's (``draft_token_ms``,
    ``catchup_token_ms``); ``fixed``, so that a policy prices its blocks as on that host. A file
    that is missing or holds no such curve: ``ConfigError``, one line."""
    try:
        data = json.loads(path.read_text())
        profile = CostProfile.under(settings, fixed=True)
        for rows, ms in data["pass_ms"].items():
            profile.pass_times.add(int(rows), float(ms) / 1e3)
        for name, costs in (
            ("draft_token_ms", profile.draft_token_seconds),
            ("catchup_token_ms", profile.catchup_token_seconds),
        ):
            costs.update({source: float(ms) / 1e3 for source, ms in data.get(name, {}).items()})
    except OSError as error:
        raise ConfigError(f"host profile {path}: {error.strerror or error}") from None
    except (ValueError, KeyError, TypeError, AttributeError) as error:
        raise ConfigError(f"host profile {path}: not a profile `draftwise curve --out` writes ({error!r})") from None
    if not profile.pass_times.known(1):
        raise ConfigError(f"host profile {path}: its pass_ms has no one-row pass, the unit of every price")
    return profile
