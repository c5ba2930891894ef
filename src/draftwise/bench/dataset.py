"""Bench prompts: the packaged Spec-Bench set, or any JSONL file of prompts.

Spec-Bench (Xia et al., 2024; Apache-2.0; see ``draftwise/data/spec_bench/SOURCE.md``) has
480 prompts in 6 subtasks. Its first 80 rows are MT-Bench's 8 categories with 2 turns each,
which Spec-Bench groups as the ``mt_bench`` subtask; the other 5 subtasks are single-turn.

A user file holds one JSON object per line, either ``{"prompt": "..."}`` or a Spec-Bench
row ``{"question_id": ..., "category": ..., "turns": [...]}``; optional ``id`` and
``subtask`` (or ``category``) fields name the prompt and group it.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

from draftwise.bench.config import SPEC_BENCH
from draftwise.errors import DraftwiseError

MT_BENCH_CATEGORIES = ("writing", "roleplay", "reasoning", "math", "coding", "extraction", "stem", "humanities")
SPEC_BENCH_SUBTASKS = ("mt_bench", "translation", "summarization", "qa", "math_reasoning", "rag")
DEFAULT_SUBTASK = "custom"


class DatasetError(DraftwiseError, ValueError):
    """The prompt file or the subtask selection is unusable; the message says why."""


@dataclass(frozen=True)
class Prompt:
    id: str  # unique within the data set
    subtask: str  # the group reported on (Spec-Bench subtask)
    category: str  # finer label (MT-Bench category), equal to subtask otherwise
    turns: tuple[str, ...]  # user messages; turn i + 1 follows the model's own answer to turn i


def spec_bench_path() -> Path:
    return Path(str(resources.files("draftwise") / "data" / "spec_bench" / "question.jsonl"))


def _subtask_of(category: str) -> str:
    return "mt_bench" if category in MT_BENCH_CATEGORIES else category


def _parse_row(row: object, line: int) -> Prompt:
    if not isinstance(row, dict):
        raise DatasetError(f"line {line}: expected a JSON object, got {type(row).__name__}")
    if "turns" in row:
        turns = row["turns"]
        if not isinstance(turns, list) or not turns or not all(isinstance(t, str) and t for t in turns):
            raise DatasetError(f"line {line}: 'turns' must be a non-empty list of non-empty strings")
    elif "prompt" in row:
        if not isinstance(row["prompt"], str) or not row["prompt"]:
            raise DatasetError(f"line {line}: 'prompt' must be a non-empty string")
        turns = [row["prompt"]]
    else:
        raise DatasetError(f"line {line}: needs a 'prompt' string or a 'turns' list")
    category = str(row.get("category") or row.get("subtask") or DEFAULT_SUBTASK)
    subtask = str(row.get("subtask") or _subtask_of(category))
    prompt_id = row.get("id", row.get("question_id", line))
    return Prompt(id=str(prompt_id), subtask=subtask, category=category, turns=tuple(turns))


def read_prompts(path: Path) -> list[Prompt]:
    """Every prompt in a JSONL file, in file order."""
    if not path.is_file():
        raise DatasetError(f"prompt file not found: {path}")
    prompts: list[Prompt] = []
    with path.open(encoding="utf-8") as f:
        for line_no, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as exc:
                raise DatasetError(f"{path}, line {line_no}: not valid JSON ({exc.msg})") from exc
            prompts.append(_parse_row(row, line_no))
    if not prompts:
        raise DatasetError(f"{path} holds no prompts")
    ids = [p.id for p in prompts]
    if len(set(ids)) != len(ids):
        duplicate = next(i for i in ids if ids.count(i) > 1)
        raise DatasetError(f"{path}: prompt id {duplicate!r} appears more than once")
    return prompts


def _round_robin(prompts: Sequence[Prompt]) -> list[Prompt]:
    """Interleave categories in order of first appearance (file order within each), so the
    first N prompts of ``mt_bench`` cover its categories evenly rather than all 'writing'."""
    by_category: dict[str, list[Prompt]] = {}
    for p in prompts:
        by_category.setdefault(p.category, []).append(p)
    queues = list(by_category.values())
    ordered: list[Prompt] = []
    for i in range(max(len(q) for q in queues)):
        ordered.extend(q[i] for q in queues if i < len(q))
    return ordered


def select(prompts: Iterable[Prompt], subtasks: Sequence[str] | None, limit: int | None) -> list[Prompt]:
    """The prompts to run: grouped by subtask (first appearance order, or the order asked),
    at most ``limit`` per subtask. Deterministic: no randomness, only the file's order."""
    grouped: dict[str, list[Prompt]] = {}
    for p in prompts:
        grouped.setdefault(p.subtask, []).append(p)
    if subtasks:
        unknown = [s for s in subtasks if s not in grouped]
        if unknown:
            raise DatasetError(f"unknown subtask(s) {', '.join(unknown)}; available: {', '.join(grouped)}")
        grouped = {s: grouped[s] for s in dict.fromkeys(subtasks)}
    chosen: list[Prompt] = []
    for group in grouped.values():
        chosen.extend(_round_robin(group)[:limit])
    return chosen


def load_prompts(data: str, subtasks: Sequence[str] | None = None, limit: int | None = None) -> list[Prompt]:
    """Prompts from ``data`` ('spec_bench' or a JSONL path), selected as ``select`` says."""
    path = spec_bench_path() if data == SPEC_BENCH else Path(data).expanduser()
    return select(read_prompts(path), subtasks, limit)


def subtask_order(prompts: Sequence[Prompt]) -> list[str]:
    """Subtasks in the order they are run (Spec-Bench's order for Spec-Bench)."""
    return list(dict.fromkeys(p.subtask for p in prompts))
