"""What a bench method is and what one run of it yields, apart from the methods themselves:
draftwise's methods (``draftwise.bench.methods``) and the anchors (``anchors_hf``,
``anchors_llamacpp``) all import these, and ``methods`` builds the anchors, so these cannot
live in ``methods`` without an import loop.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from draftwise.config import GenerationConfig


@dataclass
class Trace:
    """What one method did on one prompt."""

    tokens: list[int]
    arrivals: list[float]  # seconds from the call's start to each delivery of tokens
    step_tokens: list[int]  # tokens in each delivery (one delivery per target pass)
    wall_seconds: float
    finish_reason: str | None
    steps: dict[str, list[float]] | None = None  # draftwise only: per target pass, see DraftwiseMethod
    metrics: dict[str, Any] | None = None  # draftwise only: GenerationMetrics.to_dict()
    rollback_seconds: float | None = None  # draftwise only: time spent in KV-cache rollbacks
    # False for a method that reports only its total time (llama.cpp's binary): arrivals then
    # hold one delivery of every token at wall_seconds, and time to first token, per-token
    # latency and tokens per pass are unknown rather than measured.
    timed_deliveries: bool = True


class Method(Protocol):
    name: str

    def run(self, prompt_ids: Sequence[int], config: GenerationConfig) -> Trace:
        """Generate after ``prompt_ids`` and report what happened and when."""
