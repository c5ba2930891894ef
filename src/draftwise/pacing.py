"""How a long prompt goes in pieces beside streams that are generating: what a pass is priced
at, and how many rows of prompt one pass may take (the scheduler's step 3, ``draftwise.scheduler``).

A stream generating beside a long prompt sees its next chunk only after each step, so the
prompt's pieces may add at most ``PacingConfig.piece_seconds`` to a step. The prompt pays for
it: a pass that short runs the kernels at a worse rate per row than the batch's largest
pieces (far worse deep into a long prompt, where small passes attend without tiles), so its
first token comes later than it would in those. The bound is chosen for the streams already
answering, over the one still waiting to start; ``piece_min_rows`` keeps the prompt moving
where a row is dear.
"""

from __future__ import annotations

from collections.abc import Callable

from draftwise.config import PacingConfig
from draftwise.lm import Batch

# Seconds of one pass over n rows of a model, as measured (a cost profile's ``PassTimes``);
# None while nothing is known.
Curve = Callable[[int], "float | None"]


def never() -> bool:
    return False


class Pace:
    """How one batch's passes are priced: its curve, times how much slower than the curve its
    recent bounded passes ran (never less than the curve). The curve was timed after a short
    context: a piece deep into a long prompt reads more positions, and a busy machine runs
    every pass slower, which only measuring shows.

    Past the sizes a step uses, a calibrated curve is a line through its two largest sizes,
    whose slope is noise (a row more than a block); there a row is priced at no less than
    the rate per row of a pass of ``reference_rows``, where the kernels run near their best.
    """

    def __init__(
        self, batch: Batch, curve: Curve, others: Callable[[], bool] = never, settings: PacingConfig = PacingConfig()
    ) -> None:
        self.batch, self.curve, self.others, self.settings = batch, curve, others, settings
        self.slower = 1.0

    def _curve(self, rows: int) -> float | None:
        size = self.settings.reference_rows
        seconds, reference = self.curve(rows), self.curve(size)
        if seconds is None or reference is None:
            return seconds
        return max(seconds, reference * rows / size)

    def price(self, rows: int) -> float | None:
        seconds = self._curve(rows)
        return None if seconds is None else seconds * self.slower

    def measured(self, rows: int, seconds: float) -> None:
        priced = self._curve(rows) if rows > 0 else None
        if priced:
            weight = self.settings.pace_weight
            self.slower = max(1.0, (1 - weight) * self.slower + weight * seconds / priced)


def piece_rows(
    curve: Curve, steps: int, feeds: int, budget: float, settings: PacingConfig = PacingConfig()
) -> tuple[int | None, float]:
    """(most rows of a pass over ``steps`` rows of steps and ``feeds`` rows of prompts, one
    batch's, beside streams that wait on the round; what its pieces add to the pass): every
    step whole, and pieces of the prompts that add at most ``budget`` seconds to what the
    steps cost alone, as ``curve`` prices them (at least ``piece_min_rows`` where the whole
    budget is left: the first piece of the others' step; none once it is spent). None: no
    bound (no prompt here, or no price known yet).

    Example: a one-row step beside a prompt, a curve of 0.03 s for 1 row and 0.015 s a row
    more, a budget of 0.4 s: 1 + 26 rows, priced 0.42 s, where 1 + 27 would be 0.435 s (over
    0.03 + 0.4); the pieces add 0.39 s.
    """
    base = curve(steps) if steps else 0.0
    if not feeds or base is None:
        return None, 0.0
    if budget <= 0:
        return steps, 0.0
    limit = base + budget
    whole = budget >= settings.piece_seconds  # the first piece of the others' step
    floor = min(feeds, settings.piece_min_rows) if whole else 0
    lo, hi = steps + floor, steps + feeds  # the answer is in [lo, hi]: the curve rises
    while lo < hi:
        mid = (lo + hi + 1) // 2
        price = curve(mid)
        if price is not None and price <= limit:
            lo = mid
        else:
            hi = mid - 1
    price = curve(lo) if lo > steps else base
    return lo, (price - base if price is not None else budget)
