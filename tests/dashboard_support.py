"""Shared set-up of the dashboard tests: a live tiny API server and a finished tiny bench run."""

from __future__ import annotations

import json
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from draftwise.api.app import create_app
from draftwise.api.settings import ServerSettings
from draftwise.bench.config import BenchConfig
from draftwise.bench.runner import run_bench
from draftwise.config import GenerationConfig
from draftwise.lm import LanguageModel
from draftwise.prepare import Pair, prepare

from server_support import serve_in_background

MODEL = "tiny:0"
# Fixed k and no confidence stop: every step drafts, so acceptances and corrections both occur.
FIXED = {"k_policy": "fixed", "k": 4, "k_max": 12, "confidence_threshold": 0.0}
BENCH_PROMPTS = [
    {"id": "p1", "subtask": "alpha", "prompt": "The cat sat on the mat. The cat sat on"},
    {"id": "p2", "subtask": "beta", "prompt": "1 2 3 4 1 2 3 4 1 2"},
]


@contextmanager
def live_api(target: LanguageModel, draft: LanguageModel | None = None) -> Iterator[str]:
    """A real draftwise API server on 127.0.0.1 (a free port) over in-process tiny models."""
    app = create_app(
        ServerSettings(target=MODEL, draft="tiny-draft" if draft is not None else None), Pair(target, draft).fork()
    )
    with serve_in_background(app) as url:
        yield url


def tiny_bench(folder: Path, target: LanguageModel, draft: LanguageModel) -> Path:
    """A finished `draftwise bench` run (baseline, draft, ngram) on two one-prompt subtasks."""
    data = folder / "prompts.jsonl"
    data.write_text("".join(json.dumps(row) + "\n" for row in BENCH_PROMPTS))
    config = BenchConfig(
        target=MODEL,
        draft="tiny:1",
        data=str(data),
        out=folder / "out",
        warmup=False,
        methods=("baseline", "model", "ngram"),
        generation=GenerationConfig(max_new_tokens=8),
    )
    pair = prepare(target, draft, config.generation.draft)  # as the bench prepares the pair it loads
    run_bench(config, command="draftwise bench (dashboard test)", models=pair)
    return config.out
