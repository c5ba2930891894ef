"""``draftwise load``: draftwise's server and llama.cpp's own under concurrent streaming clients.

Flags derive from ``LoadConfig`` (``draftwise.loadbench.config``) through
``draftwise.cli.options.with_flags``, one per field; defaults and help texts are those fields'
own. The model flags (``--backend``, ``--threads``, ...) are ``ModelOptions``'.
"""

from __future__ import annotations

import shlex
import sys
from typing import Any

import typer

from draftwise.cli.options import Flags, aliases_of, built, progress_bar, split, with_flags, with_model_options
from draftwise.config import ModelOptions
from draftwise.loadbench.config import SERVERS, LoadConfig, parse_concurrency, parse_servers


def _default(name: str) -> str:
    return ",".join(map(str, LoadConfig.model_fields[name].default))


def _subtasks(value: str) -> tuple[str, ...] | None:
    return split(value) or None  # an empty list: every subtask, as when not given


FLAGS = (
    Flags(
        LoadConfig,
        help={
            "servers": f"comma-separated servers, of: {', '.join(SERVERS)} (with --url: the one name to report); "
            f"default: {_default('servers')}",
            "concurrency": "comma-separated concurrencies C: C clients, and C slots in each started server; "
            f"default: {_default('concurrency')}",
            "subtasks": "comma-separated subtasks of --code, --data and --edit (code_completion, mt_bench, "
            "code_edit, ...)",
        },
        # Read by the load bench's own parsers, whose errors say what a list should look like.
        parse={"servers": parse_servers, "concurrency": parse_concurrency, "subtasks": _subtasks},
    ),
)
ALIASES = aliases_of(*FLAGS)


@with_model_options(skip=("context",))  # LoadConfig's own --context sizes every server alike
@with_flags(*FLAGS)
def load(
    given: dict[Any, dict[str, Any]],
    progress: bool = typer.Option(True, "--progress/--no-progress", help="show a progress bar"),
    models: ModelOptions = ModelOptions(),
    models_given: dict | None = None,
) -> None:
    """Measure servers under concurrent streaming clients: draftwise serve --slots C against
    llama.cpp's llama-server -np C (plain, and with its own speculation: a draft model or n-grams)
    on the same GGUF files, threads and prompts (code-edit tasks with --edit: their predicted
    output goes to draftwise only); tokens/s, decode tokens/s, TTFT, latency, prediction tokens
    accepted and rejected, and answers identical to the same request alone."""
    config = built(LoadConfig, aliases=ALIASES, **given[LoadConfig], models=models)
    _run(config, progress)


def register(app: typer.Typer) -> None:
    app.command()(load)


def _run(config: LoadConfig, progress: bool) -> None:
    """Run the benchmark with a progress bar on stderr; finished runs survive an interruption."""
    from rich.console import Console

    from draftwise.loadbench.runner import run_load

    console = Console(stderr=True)
    bar = progress_bar(console, progress)
    command = shlex.join(["draftwise", *sys.argv[1:]])

    def say(line: str) -> None:
        # Plain text, never wrapped: paths and server messages are copied out of it as they are.
        console.print(line, markup=False, highlight=False, soft_wrap=True)

    try:
        with bar:
            report = run_load(config, command, progress=bar, log=say)
    except KeyboardInterrupt:
        say(f"interrupted: finished runs are kept in {config.out}; run the same command to resume")
        raise typer.Exit(130) from None
    say(f"report: {report}")
