"""The pass curve: what one target pass over n new rows costs on this machine, for each n.

Every speed question of this project comes back to it: a drafted block of k tokens is
verified in one pass of k + 1 rows, so whether drafting pays on a host is whether that pass
costs much more than a one-row step. The curve differs a lot between hosts, and grows with
the context the rows attend to, so ``draftwise curve`` times it where the question is asked:
on this machine, after ``context`` tokens (an edit's own file length, say). The timing is the
cost policy's own (``draftwise.costs.time_passes``), so the numbers are the ones it calibrates.
"""

from __future__ import annotations

from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field, field_validator

from draftwise.config import ModelOptions
from draftwise.costs import CONTEXT, plain_context, time_passes
from draftwise.lm import LanguageModel
from draftwise.registry import DEFAULT_TARGET

ROWS = (1, 2, 4, 8, 16, 32, 64)
MAX_ROWS = 512  # llama.cpp's default batch: one pass holds at most this many rows


class CurveConfig(BaseModel):
    """What ``draftwise curve`` times; its flags derive from these fields."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    target: str = Field(DEFAULT_TARGET, description="model whose passes to time: registry name, folder or .gguf")
    rows: tuple[int, ...] = Field(ROWS, description="pass sizes to time: new rows scored in one pass")
    context: int = Field(CONTEXT, ge=1, le=131_072, description="tokens in the cache before each timed pass")
    repeats: int = Field(3, ge=1, le=100, description="each size is the fastest of this many passes")
    out: Path | None = Field(None, description="also write the curve here, as JSON")

    @field_validator("rows")
    @classmethod
    def _rows(cls, rows: tuple[int, ...]) -> tuple[int, ...]:
        if not rows or min(rows) < 1 or max(rows) > MAX_ROWS:
            raise ValueError(f"each size must be between 1 and {MAX_ROWS}")
        return tuple(sorted(set(rows)))

    def model_options(self, models: ModelOptions) -> ModelOptions:
        """``models`` with room for the context and the largest pass after it."""
        needed = self.context + max(self.rows)
        return models if (models.context or 0) >= needed else models.model_copy(update={"context": needed})


class CurvePoint(BaseModel):
    """One pass size: its fastest time, and what that means per row and against one row."""

    rows: int
    ms: float
    ms_per_row: float
    rows_per_s: float
    steps: float = Field(description="this pass over a one-row pass: how many plain steps it costs")


def measure(lm: LanguageModel, config: CurveConfig) -> list[CurvePoint]:
    """The curve of ``lm`` after ``config.context`` tokens of plain text, a point per size
    (a one-row pass is timed too, as the unit of ``steps``)."""
    sizes = sorted({1, *config.rows})
    times = time_passes(lm, sizes, plain_context(lm, config.context), config.repeats)
    one = times[1]
    return [
        CurvePoint(rows=n, ms=1e3 * s, ms_per_row=1e3 * s / n, rows_per_s=n / s, steps=s / one)
        for n, s in sorted(times.items())
        if n in config.rows
    ]
