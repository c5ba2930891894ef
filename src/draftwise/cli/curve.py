"""``draftwise curve``: time the target's passes over 1, 2, 4, ... rows on this machine.

Flags derive from ``CurveConfig`` (``draftwise.bench.curve``) through
``draftwise.cli.options.with_flags``; the model flags (``--threads``, ``--backend``, ...)
are ``ModelOptions``'.
"""

from __future__ import annotations

import json
from typing import Any

import typer

from draftwise.bench.curve import CurveConfig
from draftwise.cli.options import Flags, aliases_of, built, note, with_flags, with_model_options
from draftwise.config import ModelOptions
from draftwise.errors import whole_numbers

FLAGS = (Flags(CurveConfig, parse={"rows": lambda value: whole_numbers(value, "--rows")}),)
ALIASES = aliases_of(*FLAGS)


@with_model_options(skip=("context", "costs"))  # the curve's own --context is the cache before each pass
@with_flags(*FLAGS)
def curve(given: dict[Any, dict[str, Any]], models: ModelOptions = ModelOptions(), models_given: dict | None = None):
    """Time the target's forward passes over 1, 2, 4, ... 64 new rows after a context of plain
    text, each the fastest of a few: what a drafted block costs to verify on this machine
    against one plain step. With --out, write them as a host profile, which --costs reads."""
    from rich.console import Console
    from rich.table import Table

    from draftwise.bench.curve import host_profile, measure, sure_limit
    from draftwise.cpu import cpu_name, default_threads
    from draftwise.loading import load_pair

    config = built(CurveConfig, aliases=ALIASES, **given[CurveConfig])
    note(f"loading {config.target}{'' if config.draft is None else f' and {config.draft}'} ...")
    lm, draft = load_pair(config.target, config.draft, config.model_options(models), log=note)
    note(f"timing passes of {', '.join(map(str, config.rows))} rows after {config.context} tokens")
    points = measure(lm, config, unit=config.out is not None)
    threads = models.threads or default_threads()
    title = f"{config.target} on {cpu_name()}, {threads} threads, after {config.context} tokens"
    table = Table("rows", "ms", "ms per row", "rows/s", "plain steps", title=title)
    for p in points:
        table.add_row(str(p.rows), f"{p.ms:.1f}", f"{p.ms_per_row:.2f}", f"{p.rows_per_s:.1f}", f"{p.steps:.2f}")
    Console().print(table)
    best = sure_limit(points)
    if best is not None:
        note(
            f"sure drafts: at most {best.rows / best.steps:.2f}x plain decoding here, were every drafted token "
            f"kept (passes of {best.rows} rows)"
        )
    if config.out is not None:
        profile = host_profile(config, points, lm, draft, threads)
        config.out.write_text(json.dumps(profile, indent=1) + "\n")
        note(f"host profile: {config.out} (--costs {config.out} prices drafting as on this machine)")


def register(app: typer.Typer) -> None:
    app.command()(curve)
