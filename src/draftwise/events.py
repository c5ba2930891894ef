"""The per-step event: what one speculation step proposed, kept, emitted and cost.

Everything downstream (CLI, servers, dashboard, bench, metrics) consumes these.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from draftwise.verify import TokenSource


@dataclass(frozen=True)
class StepEvent:
    step: int  # 0-based index of the target pass
    k: int  # draft length the policy asked for
    source: str | None  # the drafter's source that proposed ("model", "ngram"); None = nothing drafted
    proposed: list[int]  # draft tokens proposed (may be fewer than k)
    draft_probs: list[float]  # q(x_i) of each proposed token (1.0 for deterministic drafters)
    target_probs: list[float]  # p(x_i) of each proposed token under the target
    n_accepted: int  # proposed tokens the target kept
    next_token: int  # the correction (n_accepted < len(proposed)) or bonus token
    tokens: list[int]  # tokens emitted by this step, after stop truncation
    sources: list[TokenSource]  # provenance of each emitted token
    text: str  # new text released by this step ("" without a tokenizer)
    prefill_seconds: float  # time to prefill the prompt (first step only)
    draft_seconds: float
    verify_seconds: float
    step_seconds: float  # whole step, including bookkeeping
    finished: bool = False
    finish_reason: str | None = None  # "length" | "eos" | "stop"
    extra: dict[str, Any] = field(default_factory=dict)  # backend-specific timings (e.g. network)

    @property
    def other_seconds(self) -> float:
        """Time of the step outside the two models: the loop's own overhead."""
        return max(0.0, self.step_seconds - self.draft_seconds - self.verify_seconds)

    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        data["sources"] = [s.value for s in self.sources]
        return data
