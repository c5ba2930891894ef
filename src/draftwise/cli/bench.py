"""``draftwise bench``: Spec-Bench (or your prompts) through draftwise and other decoders, side by side.

draftwise's methods (plain decoding, model drafter, n-gram, hybrid) run against anchors, other
projects' decoding loops on the same model files: llama.cpp's (plain, prompt lookup, its own
speculation) on the llamacpp backend, the default, and transformers' (assisted generation,
prompt lookup, plain generate) on the hf backend.

Flags derive from ``BenchConfig`` and its ``GenerationConfig`` through
``draftwise.cli.options.with_flags``; defaults and help texts are those fields' own. Shorter
names: ``--threshold`` (``confidence_threshold``), ``--chat`` (``chat_template``). ``--quick``
swaps in a small pair and a short run for a first look.
"""

from __future__ import annotations

import shlex
import sys
from typing import TYPE_CHECKING, Any

import typer

from draftwise.bench.config import METHODS, BenchConfig
from draftwise.bench.dataset import SPEC_BENCH_SUBTASKS
from draftwise.cli.options import (
    Flags,
    aliases_of,
    built,
    generation_config,
    progress_bar,
    split,
    with_cluster_options,
    with_flags,
    with_model_options,
)
from draftwise.config import DraftConfig, GenerationConfig, ModelOptions, SamplingConfig
from draftwise.scale import BenchWorkers

if TYPE_CHECKING:
    from draftwise.bench.runner import Measure

# A first look: the 135M model, drafting for itself (the 'model' method) and with n-grams,
# one prompt per subtask, 64 tokens.
QUICK = {"target": "smollm2-135m", "draft": "smollm2-135m", "limit": 1, "max_new_tokens": 64}


def _with_defaults(model: Any, name: str) -> str:
    """Help text of a flag whose default depends on --quick."""
    field = model.model_fields[name]
    default = "all" if field.default is None else field.default
    text = f"{field.description}; " if field.description else ""
    return f"{text}default {default}, with --quick {QUICK[name]}"


def _subtasks(value: str) -> tuple[str, ...] | None:
    return split(value) or None  # an empty list: every subtask, as when not given


FLAGS = (
    Flags(
        BenchConfig,
        include=("target", "draft", "other_drafts", "methods", "sweep", "data", "subtasks", "limit"),
        help={
            "target": _with_defaults(BenchConfig, "target"),
            "draft": _with_defaults(BenchConfig, "draft"),
            "other_drafts": "comma-separated draft models, each also run with the methods that draft with a model "
            "(named METHOD@DRAFT), on the same prompts; default none",
            "methods": f"comma-separated methods, of: {', '.join(METHODS)}; 'baseline' always runs; default: "
            + ",".join(BenchConfig.model_fields["methods"].default),
            "sweep": "comma-separated fixed draft lengths (1..64): each drafting method of --methods runs again at "
            "each under the fixed policy, named METHOD/kK (model/k4), and the report compares the default policy "
            "with the best of them in hindsight; default none",
            "subtasks": f"comma-separated subtasks (Spec-Bench: {', '.join(SPEC_BENCH_SUBTASKS)}); default all",
            "limit": _with_defaults(BenchConfig, "limit"),
        },
        parse={"methods": split, "other_drafts": split, "sweep": split, "subtasks": _subtasks},
    ),
    Flags(
        GenerationConfig,
        include=("max_new_tokens",),
        help={"max_new_tokens": _with_defaults(GenerationConfig, "max_new_tokens")},
    ),
    Flags(
        DraftConfig,
        include=("k_policy", "k", "k_max", "confidence_threshold", "ngram_max"),
        aliases={"confidence_threshold": "threshold"},
    ),
    Flags(SamplingConfig, include=("temperature", "top_k", "top_p", "seed")),
    Flags(
        BenchConfig,
        include=("chat_template", "warmup", "out", "llama_cpp_bin"),
        aliases={"chat_template": "chat"},
    ),
)
ALIASES = aliases_of(*FLAGS)
_QUICK = typer.Option(
    False, "--quick", help="a first look: the small pair, one prompt per subtask, 64 tokens (explicit flags still win)"
)
_ON_RAY = (
    "run the prompts on Ray workers (each loads the models once, runs whole prompts), on a local Ray (127.0.0.1) "
    "or --ray-address (needs draftwise[ray])"
)


@with_model_options()
@with_cluster_options(BenchWorkers, _ON_RAY)
@with_flags(*FLAGS)
def bench(
    given: dict[Any, dict[str, Any]],
    quick: bool = _QUICK,
    progress: bool = typer.Option(True, "--progress/--no-progress", help="show a progress bar"),
    models: ModelOptions = ModelOptions(),
    models_given: dict | None = None,
    ray: BenchWorkers | None = None,
) -> None:
    """Benchmark draftwise (baseline, model drafter, n-gram, hybrid) against anchors on the same prompts
    in one process: llama.cpp's own decoding (plain, prompt lookup, speculation) on the llamacpp backend,
    transformers' (assisted generation, prompt lookup, generate) on hf; an interrupted run resumes."""
    settings, generation = dict(given[BenchConfig]), dict(given[GenerationConfig])
    if quick:  # the preset fills what was not given
        for name in ("target", "draft", "limit"):
            settings.setdefault(name, QUICK[name])
        generation.setdefault("max_new_tokens", QUICK["max_new_tokens"])
    config = built(
        BenchConfig,
        aliases=ALIASES,
        **settings,
        models=models,
        ray=ray,
        generation=generation_config({**given, GenerationConfig: generation}, ALIASES),
    )
    _run(config, progress)


def register(app: typer.Typer) -> None:
    app.command()(bench)


def _run(config: BenchConfig, progress: bool) -> None:
    """Run the bench with a progress bar; an interrupted run keeps what it finished."""
    from rich.console import Console
    from rich.progress import TextColumn

    from draftwise.bench.runner import Bench, run_bench

    measure = _on_ray() if config.ray is not None else None  # before any prompt is loaded or line printed
    console = Console(stderr=True)
    try:
        pending = Bench(config).pending()
        console.print(
            f"bench: {pending} runs to do ({config.target} / {config.draft}, "
            f"{config.generation.max_new_tokens} tokens) -> {config.out}"
        )
        bar = progress_bar(console, progress, TextColumn("[cyan]{task.fields[speedup]}"))
        with bar:
            command = shlex.join(["draftwise", *sys.argv[1:]])
            report = run_bench(config, command=command, progress=bar, measure=measure)
    except KeyboardInterrupt:
        console.print(f"interrupted: finished results are kept in {config.out}; run the same command to resume")
        raise typer.Exit(130) from None
    console.print(f"report: {report}")


def _on_ray() -> Measure:
    """What runs the units with ``--ray``: the command, not the bench runner, chooses, so the
    bench stays below the Ray code. Fails here, in one line, when Ray is not installed."""
    from draftwise.cluster.bench import measure_on_ray
    from draftwise.cluster.runtime import check_installed

    check_installed()
    return measure_on_ray
