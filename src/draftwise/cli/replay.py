"""``draftwise replay``: what every source would draft along the target's own answers, and the
cost policy and every fixed configuration replayed over it on host profiles.

Flags derive from ``ReplayConfig`` (``draftwise.bench.replay``) through
``draftwise.cli.options.with_flags``; the model flags (``--threads``, ``--backend``, ...) are
``ModelOptions``', for ``--record``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import typer

from draftwise.bench.replay import ReplayConfig
from draftwise.cli.options import Flags, aliases_of, built, note, split, with_flags, with_model_options
from draftwise.config import ModelOptions
from draftwise.errors import ConfigError

FLAGS = (Flags(ReplayConfig, parse={"hosts": lambda value: tuple(Path(p) for p in split(value))}),)
ALIASES = aliases_of(*FLAGS)


@with_model_options()
@with_flags(*FLAGS)
def replay(given: dict[Any, dict[str, Any]], models: ModelOptions = ModelOptions(), models_given: dict | None = None):
    """Record what the draft model and n-gram lookup would draft at every position of the
    target's greedy answers (--record FILE), or read such a recording (--recording FILE), and
    replay plain decoding, the cost policy from a cold start and every fixed configuration over
    it on each host profile (--hosts a.json,b.json): tokens per second by subtask, and the
    best fixed configuration in hindsight."""
    from rich.console import Console
    from rich.table import Table

    from draftwise.bench.replay import by_subtask, compare, read_hosts, read_recordings, record_prompts

    config = built(ReplayConfig, aliases=ALIASES, **given[ReplayConfig])
    source = config.recording or config.record
    if source is None:
        raise ConfigError("--record FILE (decode the prompts now) or --recording FILE (replay one): give one")
    hosts = read_hosts(config.hosts)
    if not hosts:
        raise ConfigError("--hosts: name at least one host profile (JSON with pass_ms, as tests/data/hosts)")
    if config.record is not None:
        note(f"recording to {record_prompts(config, models, note)}")
    groups = by_subtask(read_recordings(source))
    for name, host in hosts.items():
        table = Table(
            "subtask",
            "prompts",
            "plain tok/s",
            "policy tok/s",
            "best fixed",
            "policy / plain",
            "policy / best",
            title=f"replayed on {name}",
        )
        for subtask, recordings in groups.items():
            result = compare(recordings, host)
            best, rate = result.best_fixed
            table.add_row(
                subtask,
                str(len(recordings)),
                f"{result.plain:.1f}",
                f"{result.policy:.1f}",
                f"{best} ({rate:.1f})",
                f"{result.policy / result.plain:.2f}x",
                f"{result.policy / rate:.2f}",
            )
        Console(width=max(120, Console().width)).print(table)


def register(app: typer.Typer) -> None:
    app.command()(replay)
