"""Generation metrics, built from step events: data, not log lines."""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from draftwise.events import StepEvent


@dataclass
class GenerationMetrics:
    new_tokens: int = 0
    target_passes: int = 0
    proposed: int = 0
    accepted: int = 0
    proposed_at: list[int] = field(default_factory=list)  # per block position: proposals reaching it
    accepted_at: list[int] = field(default_factory=list)  # per block position: accepted there
    accepted_length_counts: Counter[int] = field(default_factory=Counter)  # n_accepted -> steps
    proposed_by_source: Counter[str] = field(default_factory=Counter)  # draft tokens each source proposed
    kept_by_source: Counter[str] = field(default_factory=Counter)  # of those, accepted and in the output
    prefill_seconds: float = 0.0
    draft_seconds: float = 0.0
    verify_seconds: float = 0.0
    other_seconds: float = 0.0
    first_token_seconds: float | None = None  # prefill + first step
    finish_reason: str | None = None

    def add(self, event: StepEvent) -> None:
        if event.finished:
            self.finish_reason = event.finish_reason
        self.prefill_seconds += event.prefill_seconds
        if not event.target_pass:  # a closing event: no block was verified, no token emitted
            return
        self.new_tokens += len(event.tokens)
        self.target_passes += 1
        n_proposed = len(event.proposed)
        self.proposed += n_proposed
        self.accepted += event.n_accepted
        while len(self.proposed_at) < n_proposed:
            self.proposed_at.append(0)
            self.accepted_at.append(0)
        for i in range(n_proposed):
            self.proposed_at[i] += 1
            self.accepted_at[i] += int(i < event.n_accepted)
        self.accepted_length_counts[event.n_accepted] += 1
        for source, proposed, kept in event.drafted_by():
            self.proposed_by_source[source] += proposed
            self.kept_by_source[source] += kept
        self.draft_seconds += event.draft_seconds
        self.verify_seconds += event.verify_seconds
        self.other_seconds += event.other_seconds
        if self.first_token_seconds is None:
            self.first_token_seconds = event.prefill_seconds + event.step_seconds

    @classmethod
    def from_events(cls, events: Iterable[StepEvent]) -> GenerationMetrics:
        metrics = cls()
        for event in events:
            metrics.add(event)
        return metrics

    @property
    def total_seconds(self) -> float:
        return self.prefill_seconds + self.draft_seconds + self.verify_seconds + self.other_seconds

    def prediction_tokens(self, source: str) -> tuple[int, int]:
        """(accepted, rejected) draft tokens of ``source`` as OpenAI counts a prediction's:
        accepted ones appear in the completion; rejected ones were proposed and are not in
        it (their rows were computed and thrown away)."""
        kept = self.kept_by_source[source]
        return kept, self.proposed_by_source[source] - kept

    @property
    def acceptance_rate(self) -> float:
        """Accepted / proposed draft tokens."""
        return self.accepted / self.proposed if self.proposed else 0.0

    @property
    def mean_accepted_length(self) -> float:
        """Tokens emitted per target pass (accepted + the correction or bonus)."""
        return self.new_tokens / self.target_passes if self.target_passes else 0.0

    @property
    def acceptance_by_position(self) -> list[float]:
        return [a / p if p else 0.0 for a, p in zip(self.accepted_at, self.proposed_at)]

    @property
    def tokens_per_second(self) -> float:
        return self.new_tokens / self.total_seconds if self.total_seconds > 0 else 0.0

    def to_dict(self) -> dict[str, Any]:
        return {
            "new_tokens": self.new_tokens,
            "target_passes": self.target_passes,
            "proposed": self.proposed,
            "accepted": self.accepted,
            "acceptance_rate": self.acceptance_rate,
            "mean_accepted_length": self.mean_accepted_length,
            "acceptance_by_position": self.acceptance_by_position,
            "accepted_length_histogram": {str(k): v for k, v in sorted(self.accepted_length_counts.items())},
            "proposed_by_source": dict(self.proposed_by_source),
            "kept_by_source": dict(self.kept_by_source),
            "prefill_seconds": self.prefill_seconds,
            "draft_seconds": self.draft_seconds,
            "verify_seconds": self.verify_seconds,
            "other_seconds": self.other_seconds,
            "total_seconds": self.total_seconds,
            "first_token_seconds": self.first_token_seconds,
            "tokens_per_second": self.tokens_per_second,
            "finish_reason": self.finish_reason,
        }
