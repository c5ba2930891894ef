"""Chart tables of one run (pandas frames, indexed by the chart's x axis)."""

from __future__ import annotations

import pandas as pd

from draftwise.dashboard.live import LiveRun


def per_step(run: LiveRun) -> pd.DataFrame:
    """Per target pass: draft length asked for (k), proposed, accepted, emitted."""
    frame = pd.DataFrame(
        {
            "k": [s.k for s in run.steps],
            "proposed": [s.proposed for s in run.steps],
            "accepted": [s.accepted for s in run.steps],
            "emitted": [s.emitted for s in run.steps],
        },
        index=pd.Index([s.index + 1 for s in run.steps], name="target pass"),
    )
    return frame.astype("float64")  # k may be unknown (NaN) when the server does not report it


def policy_view(run: LiveRun) -> pd.DataFrame:
    """Per target pass: the tokens/s the policy expected of the arm it took, and of plain
    decoding, the choice it beat (NaN where the server does not say)."""
    frame = pd.DataFrame(
        {"arm taken": [s.expected for s in run.steps], "plain decoding": [s.expected_plain for s in run.steps]},
        index=pd.Index([s.index + 1 for s in run.steps], name="target pass"),
    )
    return frame.astype("float64")


def acceptance_by_position(run: LiveRun) -> pd.DataFrame:
    """Share of proposals accepted at each position of the draft block (1 = first drafted)."""
    longest = max((s.proposed for s in run.steps), default=0)
    reached = [sum(s.proposed > i for s in run.steps) for i in range(longest)]
    kept = [sum(s.accepted > i for s in run.steps) for i in range(longest)]
    return pd.DataFrame(
        {"acceptance": [k / r if r else 0.0 for k, r in zip(kept, reached, strict=True)], "proposals": reached},
        index=pd.Index(range(1, longest + 1), name="position in block"),
    )


def tokens_vs_passes(run: LiveRun) -> pd.DataFrame:
    """Tokens produced against target passes, next to plain decoding's one token per pass."""
    tokens, total = [], 0
    for s in run.steps:
        total += s.emitted
        tokens.append(total)
    passes = range(1, len(run.steps) + 1)
    return pd.DataFrame(
        {"speculative": tokens, "plain decoding": list(passes)}, index=pd.Index(passes, name="target passes")
    )


def running_rate(run: LiveRun) -> pd.DataFrame:
    """Tokens per second so far, after each step.

    On the engine's clock (prefill included) when the server reports step timings, so that
    drawing the page does not slow the curve down; else on arrival at the client.
    """
    engine = run.engine_seconds is not None
    times, rates, total, clock = [], [], 0, 0.0
    for s in run.steps:
        total += s.emitted
        clock = clock + s.engine_seconds if engine else s.arrived  # type: ignore[operator]
        times.append(clock)
        rates.append(total / clock if clock > 0 else 0.0)
    name = "engine seconds" if engine else "seconds since the request"
    return pd.DataFrame({"tokens/s": rates}, index=pd.Index(times, name=name))
