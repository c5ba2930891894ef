"""The load benchmark's prompts: raw code completions, chat turns and code edits, one list in a
fixed order.

Code prompts go to ``/v1/completions`` as they are (no template); chat prompts (the first
turn of each Spec-Bench question, or of a user file) go to ``/v1/chat/completions`` as one
user message, so each server applies its own chat template, as its users would get it. Code
edits (``--edit``, made by ``scripts/make_code_edit.py``) are chat prompts too, each with the
answer a coding tool predicts (the file unchanged), sent as OpenAI's ``prediction`` to the
servers that take it (``config.sends_prediction``).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from draftwise.bench.dataset import read_prompts, select, spec_bench_path
from draftwise.loadbench.config import CODE_COMPLETION, NONE, SPEC_BENCH, LoadConfig, LoadError

PREDICTION = "prediction"  # an --edit task's field (and the request's): the expected answer
# A --structured task's fields that go into its requests as they are: a JSON schema, or tools.
STRUCTURED_FIELDS = ("response_format", "tools", "tool_choice", "parallel_tool_calls")


@dataclass(frozen=True)
class LoadPrompt:
    id: str  # unique within the run
    subtask: str
    text: str
    chat: bool  # a chat turn (chat endpoint) or a raw prompt (completions endpoint)
    prediction: str | None = None  # an edit task's expected answer (OpenAI's Predicted Outputs)
    # A structured-output task's request fields (response_format, or tools and tool_choice), for every server.
    structured: dict[str, Any] | None = None

    def body(self, model: str, max_tokens: int, predict: bool = False) -> dict[str, Any]:
        """The request both kinds of server take: greedy, streamed, with token usage at the end;
        with ``predict``, an edit task's prediction too."""
        common: dict[str, Any] = {
            "model": model,
            "max_tokens": max_tokens,
            "temperature": 0,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        if predict and self.prediction is not None:
            common[PREDICTION] = {"type": "content", "content": self.prediction}
        common.update(self.structured or {})
        if self.chat:
            return {**common, "messages": [{"role": "user", "content": self.text}]}
        return {**common, "prompt": self.text}

    @property
    def path(self) -> str:
        return "/v1/chat/completions" if self.chat else "/v1/completions"

    @property
    def kind(self) -> str:
        """``code``, ``chat``, ``edit`` (a chat prompt with a prediction) or ``structured`` (one
        with a response format)."""
        if self.prediction is not None:
            return "edit"
        if self.structured is not None:
            return "structured"
        return "chat" if self.chat else "code"


def _read(data: str) -> list[Any]:
    if data == SPEC_BENCH:
        return read_prompts(spec_bench_path())
    path = Path(data).expanduser()
    if data == CODE_COMPLETION and not path.is_file():
        raise LoadError(f"no {CODE_COMPLETION} here: run in the draftwise repository, or give --code FILE or none")
    return read_prompts(path)


def _source(data: str, chat: bool, subtasks: Sequence[str] | None, limit: int | None) -> list[LoadPrompt]:
    if data == NONE:
        return []
    chosen = [p for p in _read(data) if not subtasks or p.subtask in subtasks]
    return [LoadPrompt(id=p.id, subtask=p.subtask, text=p.turns[0], chat=chat) for p in select(chosen, None, limit)]


# What a task file's row adds to its prompt: (row, its line number, its task number) -> LoadPrompt fields.
Extras = Callable[[dict[str, Any], int, int], dict[str, Any]]


def _task_extras(path: Path, extras: Extras) -> list[dict[str, Any]]:
    """``extras`` of every task of a task file, in file order (one per non-empty line, as
    ``read_prompts`` reads the prompts, which checks first that every line is JSON)."""
    found: list[dict[str, Any]] = []
    for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), start=1):
        if line.strip():
            row = json.loads(line)
            found.append(extras(row if isinstance(row, dict) else {}, number, len(found) + 1))
    return found


def _edit_extras(path: Path) -> Extras:
    def extras(row: dict[str, Any], line: int, task: int) -> dict[str, Any]:
        prediction = row.get(PREDICTION)
        if not isinstance(prediction, str) or not prediction:
            raise LoadError(f"--edit {path}, line {line}: a task needs a '{PREDICTION}' string")
        return {"prediction": prediction}

    return extras


def _structured_extras(path: Path) -> Extras:
    def extras(row: dict[str, Any], line: int, task: int) -> dict[str, Any]:
        found = {k: row[k] for k in STRUCTURED_FIELDS if k in row}
        if "response_format" not in found and "tools" not in found:
            raise LoadError(f"--structured {path}, task {task}: a task needs a 'response_format' or 'tools'")
        return {"structured": found}

    return extras


def _task_source(
    data: str, extras: Callable[[Path], Extras], subtasks: Sequence[str] | None, limit: int | None
) -> list[LoadPrompt]:
    """The chat prompts of a task file (--edit, --structured), each with what its row adds."""
    if data == NONE:
        return []
    path = Path(data).expanduser()
    prompts = read_prompts(path)
    found = dict(zip([p.id for p in prompts], _task_extras(path, extras(path))))
    chosen = [p for p in prompts if not subtasks or p.subtask in subtasks]
    return [
        LoadPrompt(id=p.id, subtask=p.subtask, text=p.turns[0], chat=True, **found[p.id])
        for p in select(chosen, None, limit)
    ]


def load_prompts(config: LoadConfig) -> list[LoadPrompt]:
    """The prompts of a run: the code prompts, the chat prompts, the edit tasks, then the
    structured-output tasks, at most ``limit`` per subtask; ``subtasks`` picks among the
    subtasks of all the sources."""
    prompts = (
        _source(config.code, False, config.subtasks, config.limit)
        + _source(config.data, True, config.subtasks, config.limit)
        + _task_source(config.edit, _edit_extras, config.subtasks, config.limit)
        + _task_source(config.structured, _structured_extras, config.subtasks, config.limit)
    )
    missing = [s for s in config.subtasks or () if s not in {p.subtask for p in prompts}]
    if missing:
        raise LoadError(f"unknown subtask(s) {', '.join(missing)} in --code, --data, --edit and --structured")
    if not prompts:
        raise LoadError("no prompts selected")
    if len({p.id for p in prompts}) != len(prompts):
        # The sources may use the same ids: keep them apart by kind.
        prompts = [replace(p, id=f"{p.kind}:{p.id}") for p in prompts]
    return prompts
