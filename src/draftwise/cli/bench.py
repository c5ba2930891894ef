"""``draftwise bench``: Spec-Bench (or your prompts) through draftwise and transformers, side by side.

Flags map onto ``BenchConfig`` and its ``GenerationConfig``; defaults and help texts are
those fields' own. ``--quick`` swaps in a small pair and a short run for a first look.
"""

from __future__ import annotations

import shlex
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

import typer

from draftwise.bench.config import METHODS, BenchConfig
from draftwise.bench.dataset import SPEC_BENCH_SUBTASKS
from draftwise.cli.options import field_option, progress_bar, with_cluster_options, with_model_options
from draftwise.config import DraftConfig, GenerationConfig, ModelOptions, SamplingConfig
from draftwise.errors import built
from draftwise.serving import BenchWorkers

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


def _split(value: str | None) -> tuple[str, ...] | None:
    return tuple(x.strip() for x in value.split(",") if x.strip()) if value else None


def _default(model: Any, name: str, given: Any, quick: bool) -> Any:
    """A flag whose default depends on --quick: the value given, else the preset's, else the field's."""
    return given or (QUICK.get(name) if quick else None) or model.model_fields[name].default


_METHODS = typer.Option(
    ",".join(BenchConfig.model_fields["methods"].default),
    help=f"comma-separated methods, of: {', '.join(METHODS)}; 'baseline' always runs",
)
_SUBTASKS = typer.Option(
    None, help=f"comma-separated subtasks (Spec-Bench: {', '.join(SPEC_BENCH_SUBTASKS)}); default all"
)
_QUICK = typer.Option(
    False, "--quick", help="a first look: the small pair, one prompt per subtask, 64 tokens (explicit flags still win)"
)
_ON_RAY = (
    "run the prompts on Ray workers (each loads the models once, runs whole prompts), on a local Ray (127.0.0.1) "
    "or --ray-address (needs draftwise[ray])"
)


@with_model_options()
@with_cluster_options(BenchWorkers, _ON_RAY)
def bench(
    target: str | None = typer.Option(None, help=_with_defaults(BenchConfig, "target")),
    draft: str | None = typer.Option(None, help=_with_defaults(BenchConfig, "draft")),
    methods: str = _METHODS,
    data: str = field_option(BenchConfig, "data"),
    subtasks: str | None = _SUBTASKS,
    limit: int | None = typer.Option(None, help=_with_defaults(BenchConfig, "limit")),
    max_new_tokens: int | None = typer.Option(None, help=_with_defaults(GenerationConfig, "max_new_tokens")),
    k_policy: str = field_option(DraftConfig, "k_policy"),
    k: int = field_option(DraftConfig, "k"),
    k_max: int = field_option(DraftConfig, "k_max"),
    threshold: float = field_option(DraftConfig, "confidence_threshold", "--threshold"),
    ngram_max: int = field_option(DraftConfig, "ngram_max"),
    temperature: float = field_option(SamplingConfig, "temperature"),
    top_k: int = field_option(SamplingConfig, "top_k"),
    top_p: float = field_option(SamplingConfig, "top_p"),
    seed: int | None = field_option(SamplingConfig, "seed"),
    chat: bool = typer.Option(True, "--chat/--no-chat", help=BenchConfig.model_fields["chat_template"].description),
    warmup: bool = typer.Option(True, "--warmup/--no-warmup", help=BenchConfig.model_fields["warmup"].description),
    out: Path = field_option(BenchConfig, "out"),
    quick: bool = _QUICK,
    progress: bool = typer.Option(True, "--progress/--no-progress", help="show a progress bar"),
    llama_cpp_bin: Path | None = field_option(BenchConfig, "llama_cpp_bin"),
    models: ModelOptions = ModelOptions(),
    models_given: dict | None = None,
    ray: BenchWorkers | None = None,
) -> None:
    """Benchmark draftwise (baseline, model drafter, n-gram) against transformers (assisted generation,
    prompt lookup, plain generate) on the same prompts in one process; an interrupted run resumes."""
    generation = built(
        GenerationConfig,
        max_new_tokens=_default(GenerationConfig, "max_new_tokens", max_new_tokens, quick),
        sampling=built(SamplingConfig, temperature=temperature, top_k=top_k, top_p=top_p, seed=seed),
        draft=built(
            DraftConfig, k_policy=k_policy, k=k, k_max=k_max, confidence_threshold=threshold, ngram_max=ngram_max
        ),
    )
    config = built(
        BenchConfig,
        target=_default(BenchConfig, "target", target, quick),
        draft=_default(BenchConfig, "draft", draft, quick),
        methods=_split(methods) or (),
        data=data,
        subtasks=_split(subtasks),
        limit=limit if limit is not None else (QUICK["limit"] if quick else None),
        models=models,
        llama_cpp_bin=llama_cpp_bin,
        chat_template=chat,
        warmup=warmup,
        out=out,
        ray=ray,
        generation=generation,
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
