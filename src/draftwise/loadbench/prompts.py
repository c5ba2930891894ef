"""The load benchmark's prompts: raw code completions and chat turns, one list in a fixed order.

Code prompts go to ``/v1/completions`` as they are (no template); chat prompts (the first
turn of each Spec-Bench question, or of a user file) go to ``/v1/chat/completions`` as one
user message, so each server applies its own chat template, as its users would get it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from draftwise.bench.dataset import read_prompts, select, spec_bench_path
from draftwise.loadbench.config import CODE_COMPLETION, NONE, SPEC_BENCH, LoadConfig, LoadError


@dataclass(frozen=True)
class LoadPrompt:
    id: str  # unique within the run
    subtask: str
    text: str
    chat: bool  # a chat turn (chat endpoint) or a raw prompt (completions endpoint)

    def body(self, model: str, max_tokens: int) -> dict[str, Any]:
        """The request both kinds of server take: greedy, streamed, with token usage at the end."""
        common = {
            "model": model,
            "max_tokens": max_tokens,
            "temperature": 0,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        if self.chat:
            return {**common, "messages": [{"role": "user", "content": self.text}]}
        return {**common, "prompt": self.text}

    @property
    def path(self) -> str:
        return "/v1/chat/completions" if self.chat else "/v1/completions"


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


def load_prompts(config: LoadConfig) -> list[LoadPrompt]:
    """The prompts of a run: the code prompts, then the chat prompts, at most ``limit`` per
    subtask; ``subtasks`` picks among the subtasks of both sources."""
    prompts = _source(config.code, False, config.subtasks, config.limit) + _source(
        config.data, True, config.subtasks, config.limit
    )
    missing = [s for s in config.subtasks or () if s not in {p.subtask for p in prompts}]
    if missing:
        raise LoadError(f"unknown subtask(s) {', '.join(missing)} in --code and --data")
    if not prompts:
        raise LoadError("no prompts selected")
    if len({p.id for p in prompts}) != len(prompts):
        # The two sources may use the same ids: keep them apart by kind.
        prompts = [LoadPrompt(f"{'chat' if p.chat else 'code'}:{p.id}", p.subtask, p.text, p.chat) for p in prompts]
    return prompts
