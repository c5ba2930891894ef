"""A ``draftwise bench`` output folder, made browsable: tables per subtask and method, plots.

The folder holds ``results.jsonl`` (one record per prompt, turn and method), ``summary.json``
(statistics per subtask and method, written when the run finished), ``report.md`` and PNG
plots. The summary is preferred; a folder whose run was interrupted (results but no summary
yet) still shows its results, with per-method means computed here.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pandas as pd

from draftwise.errors import DraftwiseError

RESULTS, SUMMARY, REPORT = "results.jsonl", "summary.json", "report.md"
OVERALL = "overall"
REFERENCE = "baseline"

# summary.json statistic -> column title, in display order.
METHOD_COLUMNS = {
    "prompts": "prompts",
    "tokens_per_second": "tokens/s",
    "speedup": "speedup",
    "predicted_speedup": "predicted",
    "acceptance_rate": "acceptance",
    "mean_accepted_length": "mean accepted length",
    "ttft_seconds": "TTFT s",
    "latency_p50_ms": "latency p50 ms",
    "latency_p95_ms": "latency p95 ms",
    "identical": "identical",
    "perplexity": "PPL",
}


class ReportError(DraftwiseError, ValueError):
    """The path is not a bench output; the message says what was expected."""


@dataclass
class BenchResults:
    folder: Path
    records: list[dict[str, Any]]
    summary: dict[str, Any] | None
    plots: list[Path] = field(default_factory=list)
    report_md: str | None = None

    @property
    def methods(self) -> list[str]:
        if self.summary:
            return list(self.summary["groups"][OVERALL])
        return list(dict.fromkeys(r["method"] for r in self.records))

    @property
    def groups(self) -> list[str]:
        """'overall', then the subtasks."""
        if self.summary:
            names = list(self.summary["groups"])
        else:
            names = list(dict.fromkeys(r["subtask"] for r in self.records))
        return [OVERALL] + [n for n in names if n != OVERALL]

    def headline(self) -> str:
        """One line on what was run: models, when, command."""
        if not self.summary:
            return f"{len(self.records)} results in {self.folder / RESULTS} (no summary.json: the run has not finished)"
        config = self.summary.get("config", {})
        return (
            f"target `{config.get('target')}`, draft `{config.get('draft')}`; {self.summary.get('date')}; "
            f"`{self.summary.get('command') or 'library call'}`"
        )


def _read_records(path: Path) -> list[dict[str, Any]]:
    records = []
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            record = json.loads(line)
        except json.JSONDecodeError:  # a line cut short by an interrupted run: the bench drops it too
            continue
        if isinstance(record, dict) and "method" in record:
            records.append(record)
    return records


def load_bench(path: str | Path) -> BenchResults:
    """Read a bench output folder, or the folder of one of its files."""
    given = Path(str(path).strip()).expanduser()
    if not str(path).strip():
        raise ReportError("give the path of a `draftwise bench` output folder (or of its results.jsonl)")
    if not given.exists():
        raise ReportError(f"{given} does not exist")
    folder = given if given.is_dir() else given.parent
    results, summary_path = folder / RESULTS, folder / SUMMARY
    if not results.exists() and not summary_path.exists():
        raise ReportError(f"{folder} holds no {RESULTS} or {SUMMARY}: is it a `draftwise bench --out` folder?")
    records = _read_records(results) if results.exists() else []
    summary = None
    if summary_path.exists():
        try:
            summary = json.loads(summary_path.read_text(encoding="utf-8"))
        except json.JSONDecodeError as exc:
            raise ReportError(f"{summary_path} is not valid JSON ({exc})") from None
        if not isinstance(summary, dict) or OVERALL not in summary.get("groups", {}):
            raise ReportError(f"{summary_path} is not a bench summary (no 'groups.overall')")
    names = (summary or {}).get("plots") or sorted(p.name for p in folder.glob("*.png"))
    plots = [folder / n for n in names if (folder / n).exists()]
    report = folder / REPORT
    return BenchResults(
        folder=folder,
        records=records,
        summary=summary,
        plots=plots,
        report_md=report.read_text(encoding="utf-8") if report.exists() else None,
    )


def _acceptance(records: list[dict[str, Any]]) -> float | None:
    steps = [r["steps"] for r in records if r.get("steps")]
    proposed = sum(sum(s.get("proposed") or []) for s in steps)
    accepted = sum(sum(s.get("accepted") or []) for s in steps)
    return accepted / proposed if proposed else None


def _in_group(record: dict[str, Any], group: str) -> bool:
    return group == OVERALL or record.get("subtask") == group


def _stats_from_records(results: BenchResults, group: str) -> dict[str, dict[str, Any]]:
    """Per-method means over the group's records (a run without summary.json yet)."""
    chosen = [r for r in results.records if _in_group(r, group)]
    stats: dict[str, dict[str, Any]] = {}
    for method in results.methods:
        mine = [r for r in chosen if r["method"] == method]
        if not mine:
            continue
        tokens = sum(r["new_tokens"] for r in mine)
        seconds = sum(r["wall_seconds"] for r in mine)
        passes = sum(len(r.get("step_tokens") or []) for r in mine)
        ttfts = [r["ttft_seconds"] for r in mine if r.get("ttft_seconds") is not None]
        stats[method] = {
            "prompts": len({r["prompt_id"] for r in mine}),
            "tokens_per_second": tokens / seconds if seconds > 0 else None,
            "acceptance_rate": _acceptance(mine),
            "mean_accepted_length": tokens / passes if passes else None,
            "ttft_seconds": sum(ttfts) / len(ttfts) if ttfts else None,
        }
    reference = stats.get(REFERENCE, {}).get("tokens_per_second")
    for s in stats.values():
        s["speedup"] = s["tokens_per_second"] / reference if reference and s["tokens_per_second"] else None
    return stats


def method_table(results: BenchResults, group: str) -> pd.DataFrame:
    """One row per method for ``group`` ('overall' or a subtask)."""
    if results.summary:
        stats = results.summary["groups"].get(group, {})
    else:
        stats = _stats_from_records(results, group)
    rows = []
    for method, s in stats.items():
        row: dict[str, Any] = {"method": method}
        for key, title in METHOD_COLUMNS.items():
            value = s.get(key)
            if key == "identical":
                value = (
                    "(reference)"
                    if method == REFERENCE
                    else f"{s['identical']}/{s['compared']}"
                    if s.get("compared")
                    else None
                )
            row[title] = value
        rows.append(row)
    frame = pd.DataFrame(rows, columns=["method", *METHOD_COLUMNS.values()]).set_index("method")
    return frame.dropna(axis=1, how="all")


def record_table(results: BenchResults, group: str, method: str) -> pd.DataFrame:
    """One row per prompt and turn of ``method`` in ``group``."""
    rows = []
    for r in results.records:
        if r["method"] != method or not _in_group(r, group):
            continue
        rows.append(
            {
                "prompt": r["prompt_id"],
                "subtask": r.get("subtask"),
                "turn": r.get("turn", 0) + 1,
                "new tokens": r.get("new_tokens"),
                "tokens/s": r.get("tokens_per_second"),
                "TTFT s": r.get("ttft_seconds"),
                "acceptance": _acceptance([r]),
                "finish": r.get("finish_reason"),
                "text": (r.get("text") or "")[:120],
            }
        )
    return pd.DataFrame(
        rows, columns=["prompt", "subtask", "turn", "new tokens", "tokens/s", "TTFT s", "acceptance", "finish", "text"]
    )
