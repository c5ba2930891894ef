"""The ``draftwise`` command line: a thin typer app.

Each command lives in its own module with a ``register(app)`` function and keeps its heavy
imports (torch, transformers, servers) inside the command body, so ``draftwise --help`` is
instant.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable
from typing import Any

import typer

from draftwise.cli import bench, dashboard, generate, models, serve, verifier
from draftwise.errors import DraftwiseError

DEBUG_ENV = "DRAFTWISE_DEBUG"  # set to 1: errors come with their traceback


def _reporting(command: Callable[..., Any]) -> Callable[..., Any]:
    """A command whose ``DraftwiseError`` is printed as one line (``error: ...``) with the
    error's exit code; anything else is a bug and keeps its traceback."""

    @functools.wraps(command)
    def run(*args: Any, **kwargs: Any) -> Any:
        try:
            return command(*args, **kwargs)
        except DraftwiseError as exc:
            if os.environ.get(DEBUG_ENV):
                raise
            typer.echo(f"error: {exc}", err=True)
            raise typer.Exit(exc.exit_code) from None

    return run


def build_app() -> typer.Typer:
    app = typer.Typer(
        name="draftwise",
        help="Lossless speculative decoding: a cheap drafter proposes, the target verifies.",
        no_args_is_help=True,
        add_completion=False,
        pretty_exceptions_enable=False,
    )

    @app.callback()
    def _root() -> None:
        """Lossless speculative decoding: a cheap drafter proposes, the target verifies."""

    for module in (generate, models, serve, verifier, bench, dashboard):
        module.register(app)
    for info in app.registered_commands:
        info.callback = _reporting(info.callback)
    return app


def main() -> None:
    build_app()()
