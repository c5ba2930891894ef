"""The ``draftwise`` command line: a thin typer app.

Each command lives in its own module with a ``register(app)`` function and keeps its heavy
imports (torch, transformers, servers) inside the command body, so ``draftwise --help`` is
instant.
"""

from __future__ import annotations

import typer

from draftwise.cli import bench, dashboard, generate, models, serve, verifier


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
    return app


def main() -> None:
    build_app()()
