"""Bench records made by hand, for the bench's analysis and report tests."""

from __future__ import annotations

from draftwise.bench.dataset import Prompt


def bench_record(method: str, prompt: Prompt, new: int, wall: float, ttft: float | None) -> dict:
    """A record of ``method`` on ``prompt``: ``new`` tokens in ``wall`` seconds, the first after
    ``ttft`` (None: the method reports no delivery times)."""
    timed = ttft is not None
    return {
        "method": method,
        "prompt_id": prompt.id,
        "subtask": prompt.subtask,
        "turn": 0,
        "new_tokens": new,
        "tokens": list(range(new)),
        "wall_seconds": wall,
        "ttft_seconds": ttft,
        "timed_deliveries": timed,
        "arrivals": [ttft, wall] if timed else [wall],
        "step_tokens": [1, new - 1] if timed else [new],
        "steps": None,
        "metrics": None,
        "rollback_seconds": None,
        "perplexity": 2.0,
    }
