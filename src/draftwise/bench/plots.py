"""PNG plots of a bench run (matplotlib, Agg backend: no display needed)."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from draftwise.bench.analysis import OVERALL
from draftwise.bench.config import METHODS, REFERENCE
from draftwise.bench.store import Record

# Plain decoders (each project's own) emit one token per target pass: the accepted-length plot leaves them out.
PLAIN = (REFERENCE, "hf-baseline", "llamacpp-plain")


def _color(method: str) -> str:
    """The same colour for a method in every plot."""
    return f"C{METHODS.index(method)}" if method in METHODS else "gray"


def _pyplot() -> Any:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _grouped_bars(ax: Any, xs: Sequence[float], series: dict[str, list[float]]) -> None:
    """One bar per series at each x, side by side, in each method's colour."""
    width = 0.8 / max(1, len(series))
    for i, (method, values) in enumerate(series.items()):
        ax.bar([x + (i - (len(series) - 1) / 2) * width for x in xs], values, width, label=method, color=_color(method))


def _save(plt: Any, fig: Any, ax: Any, path: Path, legend: bool) -> None:
    if legend:
        ax.legend(fontsize="small")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_speedup(path: Path, groups: dict[str, dict[str, dict[str, Any]]], methods: Sequence[str]) -> None:
    plt = _pyplot()
    names = [g for g in groups if g != OVERALL] + [OVERALL]
    others = [m for m in methods if m != REFERENCE]
    fig, ax = plt.subplots(figsize=(max(6.0, 1.4 * len(names)), 4.0))
    _grouped_bars(ax, range(len(names)), {m: [groups[g][m].get("speedup") or 0.0 for g in names] for m in others})
    ax.axhline(1.0, color="black", linewidth=0.8, linestyle="--")
    ax.set_xticks(range(len(names)), names)
    ax.set_ylabel("speedup over baseline (x)")
    ax.set_title("Speedup per subtask")
    _save(plt, fig, ax, path, legend=bool(others))


def plot_accepted_length(path: Path, overall: dict[str, dict[str, Any]], methods: Sequence[str]) -> None:
    plt = _pyplot()
    shown = [m for m in methods if m not in PLAIN and overall[m].get("tokens_per_pass_histogram")]
    longest = max((max(overall[m]["tokens_per_pass_histogram"]) for m in shown), default=1)
    fig, ax = plt.subplots(figsize=(max(6.0, 0.5 * longest + 2), 4.0))
    xs = range(1, longest + 1)
    shares = {}
    for m in shown:
        hist = overall[m]["tokens_per_pass_histogram"]
        total = sum(hist.values())
        shares[m] = [hist.get(x, 0) / total for x in xs]
    _grouped_bars(ax, xs, shares)
    ax.set_xlabel("tokens per target pass (accepted + 1)")
    ax.set_ylabel("share of target passes")
    ax.set_title("Accepted length")
    _save(plt, fig, ax, path, legend=bool(shown))


def plot_rate_over_run(path: Path, records: Sequence[Record], methods: Sequence[str]) -> None:
    plt = _pyplot()
    ordered = sorted(records, key=lambda r: r["finished_at"])
    fig, ax = plt.subplots(figsize=(8.0, 4.0))
    for m in methods:
        points = [(i, r["tokens_per_second"]) for i, r in enumerate(ordered) if r["method"] == m]
        if points:
            ax.plot([p[0] for p in points], [p[1] for p in points], marker=".", linewidth=0.8, label=m, color=_color(m))
    ax.set_xlabel("result number (run order)")
    ax.set_ylabel("tokens/s")
    ax.set_title("tokens/s over the run")
    _save(plt, fig, ax, path, legend=True)


def write_plots(out: Path, summary: dict[str, Any], records: Sequence[Record], methods: Sequence[str]) -> list[Path]:
    paths = [out / "speedup.png", out / "accepted_length.png", out / "tokens_per_second.png"]
    plot_speedup(paths[0], summary["groups"], methods)
    plot_accepted_length(paths[1], summary["groups"][OVERALL], methods)
    plot_rate_over_run(paths[2], records, methods)
    return paths
