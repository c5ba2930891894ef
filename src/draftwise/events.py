"""The per-step event: what one speculation step proposed, kept, emitted and cost.

Everything downstream (CLI, servers, dashboard, bench, metrics) consumes these.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from draftwise.verify import TokenSource

# The next_token of the event that closes a run the target could not take further (its
# context was full, a remote verifier refused or went away): that event made no target pass.
NO_TOKEN = -1
# The sources a block comes from, by name, in one place: each source's statistics, the
# events and the metrics key on them.
MODEL = "model"  # a draft model (``draftwise.drafters.ModelDrafter``)
NGRAM = "ngram"  # lookup in the context (``draftwise.drafters.NGramDrafter``)
PREDICTION = "prediction"  # a request's predicted output (``draftwise.prediction``)
SUFFIX = "suffix"  # what the server wrote for earlier requests (``draftwise.suffix``)
GRAMMAR = "grammar"  # a grammar's forced text (``draftwise.grammar``): a block may start with it
FORCED = GRAMMAR


@dataclass(frozen=True)
class StepEvent:
    step: int  # 0-based index of the target pass
    k: int  # draft length the policy asked for
    source: str | None  # the drafter's source that proposed ("model", "ngram"); None = nothing drafted
    proposed: list[int]  # draft tokens proposed (may be fewer than k)
    draft_probs: list[float]  # q(x_i) of each proposed token (1.0 for deterministic drafters)
    target_probs: list[float]  # p(x_i) of each proposed token under the target
    n_accepted: int  # proposed tokens the target kept
    next_token: int  # the correction (n_accepted < len(proposed)) or bonus token; NO_TOKEN: no target pass
    tokens: list[int]  # tokens emitted by this step, after stop truncation
    sources: list[TokenSource]  # provenance of each emitted token
    text: str  # new text released by this step ("" without a tokenizer)
    prefill_seconds: float  # time to prefill the prompt (first step only)
    draft_seconds: float
    verify_seconds: float
    step_seconds: float  # whole step, including bookkeeping
    finished: bool = False
    finish_reason: str | None = None  # "length" | "eos" | "stop" | "error" (the target went away)
    extra: dict[str, Any] = field(default_factory=dict)  # backend timings (e.g. network); "detail": why it ended
    forced: int = 0  # the first this many proposed tokens were a grammar's forced text
    # Why this block: the arms the policy weighed, the one taken first, each as (source or
    # "plain", k, expected tokens per second); empty for a policy that weighs none.
    arms: list[tuple[str, int, float]] = field(default_factory=list)

    def drafted_by(self) -> list[tuple[str, int, int]]:
        """(source, proposed, kept) of each part of the block: its forced tokens as
        ``FORCED``'s, the rest as ``source``'s. An accepted token past a stop is not in the
        output: it counts as not kept."""
        if self.source is None or not self.proposed:
            return []
        forced = min(self.forced, len(self.proposed))
        kept = min(self.n_accepted, len(self.tokens))
        parts = [(FORCED, forced, min(kept, forced)), (self.source, len(self.proposed) - forced, max(0, kept - forced))]
        return [part for part in parts if part[1]]

    @property
    def target_pass(self) -> bool:
        """Whether the target verified a block in this step (all but a run's closing event
        after the target refused)."""
        return self.next_token != NO_TOKEN

    @property
    def other_seconds(self) -> float:
        """Time of the step outside the two models: the loop's own overhead."""
        return max(0.0, self.step_seconds - self.draft_seconds - self.verify_seconds)

    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        data["sources"] = [s.value for s in self.sources]
        return data
