"""The pass curve: what one target pass over n new rows costs on this machine, for each n.

Every speed question of this project comes back to it: a drafted block of k tokens is
verified in one pass of k + 1 rows, so whether drafting pays on a host is whether that pass
costs much more than a one-row step. The curve differs a lot between hosts, and grows with
the context the rows attend to, so ``draftwise curve`` times it where the question is asked:
on this machine, after ``context`` tokens (an edit's own file length, say). The timing is the
cost policy's own (``draftwise.costs.time_passes``), so the numbers are the ones it calibrates.
"""

from __future__ import annotations

from datetime import date
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, field_validator

from draftwise.config import ModelOptions
from draftwise.costs import CONTEXT, plain_context, time_draft, time_passes
from draftwise.cpu import cpu_name
from draftwise.events import MODEL
from draftwise.lm import LanguageModel
from draftwise.registry import DEFAULT_TARGET

ROWS = (1, 2, 4, 8, 16, 32, 64)
MAX_ROWS = 512  # llama.cpp's default batch: one pass holds at most this many rows


class CurveConfig(BaseModel):
    """What ``draftwise curve`` times; its flags derive from these fields."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    target: str = Field(DEFAULT_TARGET, description="model whose passes to time: registry name, folder or .gguf")
    draft: str | None = Field(
        None, description="also time this draft model's drafted token and catch-up token, for the profile --out writes"
    )
    rows: tuple[int, ...] = Field(ROWS, description="pass sizes to time: new rows scored in one pass")
    context: int = Field(CONTEXT, ge=1, le=131_072, description="tokens in the cache before each timed pass")
    repeats: int = Field(3, ge=1, le=100, description="each size is the fastest of this many passes")
    out: Path | None = Field(
        None,
        description="also write the curve here as a host profile (JSON): what --costs reads to price drafting "
        "as on this machine",
    )

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


def measure(lm: LanguageModel, config: CurveConfig, unit: bool = False) -> list[CurvePoint]:
    """The curve of ``lm`` after ``config.context`` tokens of plain text, a point per size (a
    one-row pass is timed too, as the unit of ``steps``, and with ``unit`` reported too)."""
    sizes = sorted({1, *config.rows})
    times = time_passes(lm, sizes, plain_context(lm, config.context), config.repeats)
    one = times[1]
    return [
        CurvePoint(rows=n, ms=1e3 * s, ms_per_row=1e3 * s / n, rows_per_s=n / s, steps=s / one)
        for n, s in sorted(times.items())
        if n in config.rows or unit
    ]


def sure_limit(points: list[CurvePoint]) -> CurvePoint | None:
    """The pass size that turns the most rows into tokens per plain step: were every drafted
    token kept, blocks of its rows less one would run at ``rows / steps`` times plain decoding,
    the most drafting can give on this host (a prediction, an earlier answer repeated, a
    grammar's forced text).

    Example: passes of 1, 4 and 16 rows at 1.0, 2.4 and 8.3 plain steps: 4 / 2.4 = 1.67 and
    16 / 8.3 = 1.93, so 16 rows, at most 1.93x plain decoding.
    """
    return max(points, key=lambda p: p.rows / p.steps, default=None)


def host_profile(
    config: CurveConfig, points: list[CurvePoint], target: LanguageModel, draft: LanguageModel | None, threads: int
) -> dict[str, Any]:
    """What ``--out`` writes: the curve as a host profile (``draftwise.profile.read_host`` reads
    its ``pass_ms``, ``draft_token_ms`` and ``catchup_token_ms``), with what it was timed on:
    the CPU, the threads, and the target's fingerprint, which names its kernel choice; with a
    draft model, that model's drafted and catch-up tokens (``draftwise.costs.time_draft``).
    ``points`` must hold the one-row pass (``measure(unit=True)``): every price is read against it."""
    record: dict[str, Any] = {
        "host": f"{cpu_name()}, {threads} threads",
        "measured": f"{date.today().isoformat()}: draftwise curve, the fastest of {config.repeats} passes "
        f"after {config.context} tokens",
        "target": config.target,
        "draft": config.draft,
        "fingerprint": target.fingerprint,
        "pass_ms": {str(p.rows): round(p.ms, 3) for p in points},
    }
    best = sure_limit(points)
    if best is not None:
        record["sure_drafts"] = {"rows": best.rows, "speedup": round(best.rows / best.steps, 3)}
    if draft is not None:
        token, catchup = time_draft(draft)
        record["draft_token_ms"] = {MODEL: round(1e3 * token, 3)}
        record["catchup_token_ms"] = {MODEL: round(1e3 * catchup, 3)}
    return {
        **record,
        "config": config.model_dump(mode="json"),
        "cpu": cpu_name(),
        "threads": threads,
        "points": [p.model_dump() for p in points],
    }
