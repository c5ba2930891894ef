"""``draftwise load``: draftwise's server and llama.cpp's own under concurrent streaming clients.

Flags map onto ``LoadConfig`` (``draftwise.loadbench.config``); defaults and help texts are
those fields' own. The model flags (``--backend``, ``--threads``, ...) are ``ModelOptions``'.
"""

from __future__ import annotations

import shlex
import sys
from pathlib import Path

import typer

from draftwise.cli.options import field_option, progress_bar, with_model_options
from draftwise.config import ModelOptions
from draftwise.errors import built
from draftwise.loadbench.config import SERVERS, LoadConfig, parse_concurrency, parse_servers


def _default(name: str) -> str:
    return ",".join(map(str, LoadConfig.model_fields[name].default))


def _split(value: str | None) -> tuple[str, ...] | None:
    return tuple(x.strip() for x in value.split(",") if x.strip()) if value else None


_SERVERS = typer.Option(
    _default("servers"), help=f"comma-separated servers, of: {', '.join(SERVERS)} (with --url: the one name to report)"
)
_CONCURRENCY = typer.Option(
    _default("concurrency"), help="comma-separated concurrencies C: C clients, and C slots in each started server"
)
_SUBTASKS = typer.Option(None, help="comma-separated subtasks of --code and --data (code_completion, mt_bench, ...)")


@with_model_options(skip=("context",))
def load(
    servers: str = _SERVERS,
    concurrency: str = _CONCURRENCY,
    target: str = field_option(LoadConfig, "target"),
    draft: str | None = field_option(LoadConfig, "draft"),
    drafter: str | None = field_option(LoadConfig, "drafter"),
    context: int = field_option(LoadConfig, "context"),
    max_tokens: int = field_option(LoadConfig, "max_tokens"),
    code: str = field_option(LoadConfig, "code"),
    data: str = field_option(LoadConfig, "data"),
    subtasks: str | None = _SUBTASKS,
    limit: int | None = field_option(LoadConfig, "limit"),
    url: str | None = field_option(LoadConfig, "url"),
    llama_cpp_bin: Path | None = field_option(LoadConfig, "llama_cpp_bin"),
    spec_draft_n_max: int = field_option(LoadConfig, "spec_draft_n_max"),
    spec_draft_n_min: int = field_option(LoadConfig, "spec_draft_n_min"),
    spec_draft_p_min: float = field_option(LoadConfig, "spec_draft_p_min"),
    warmup: bool = typer.Option(True, "--warmup/--no-warmup", help=LoadConfig.model_fields["warmup"].description),
    audit: bool = typer.Option(True, "--audit/--no-audit", help=LoadConfig.model_fields["audit"].description),
    out: Path = field_option(LoadConfig, "out"),
    startup_timeout: float = field_option(LoadConfig, "startup_timeout"),
    request_timeout: float = field_option(LoadConfig, "request_timeout"),
    progress: bool = typer.Option(True, "--progress/--no-progress", help="show a progress bar"),
    models: ModelOptions = ModelOptions(),
    models_given: dict | None = None,
) -> None:
    """Measure servers under concurrent streaming clients: draftwise serve --slots C against
    llama.cpp's llama-server -np C (plain and with its own speculation) on the same GGUF files,
    threads and prompts; tokens/s, TTFT, latency, and answers identical to the same request alone."""
    config = built(
        LoadConfig,
        servers=parse_servers(servers),
        concurrency=parse_concurrency(concurrency),
        target=target,
        draft=draft,
        drafter=drafter,
        models=models,
        context=context,
        max_tokens=max_tokens,
        code=code,
        data=data,
        subtasks=_split(subtasks),
        limit=limit,
        url=url,
        llama_cpp_bin=llama_cpp_bin,
        spec_draft_n_max=spec_draft_n_max,
        spec_draft_n_min=spec_draft_n_min,
        spec_draft_p_min=spec_draft_p_min,
        warmup=warmup,
        audit=audit,
        out=out,
        startup_timeout=startup_timeout,
        request_timeout=request_timeout,
    )
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
