"""The ``draftwise`` command line: a thin typer app.

Each command lives in its own module with a ``register(app)`` function and keeps its heavy
imports (torch, transformers, servers) inside the command body, so ``draftwise --help`` is
instant.

A ``DraftwiseError`` (a user's mistake, or a failure the user should read about) is printed as
one line, ``error: ...``, and the command exits with the error's code; so is a mistake the
command line's parser finds (an unknown flag, a value of the wrong type: exit status 2).
Anything else is a bug and keeps its traceback. ``draftwise --debug COMMAND`` (or ``DRAFTWISE_DEBUG=1``) shows the
traceback of a ``DraftwiseError`` too.
"""

from __future__ import annotations

import functools
import inspect
import os
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import typer
from typer.core import TyperGroup

try:  # typer 0.2x carries its own copy of click; older ones use click itself
    from typer._click import exceptions as click_errors
except ImportError:  # pragma: no cover
    from click import exceptions as click_errors  # type: ignore[no-redef]

from draftwise.cli import bench, curve, dashboard, generate, load, models, replay, serve, verifier
from draftwise.errors import DraftwiseError

DEBUG_ENV = "DRAFTWISE_DEBUG"  # set to 1: errors come with their traceback
HELP = "Lossless speculative decoding: a cheap drafter proposes, the target verifies."
_CONTEXT = "_draftwise_context"  # the parameter through which typer hands a command its context


@dataclass(frozen=True)
class Options:
    """The root command's options, handed to every command through the context's object."""

    debug: bool = False


def _debugging(ctx: typer.Context | None) -> bool:
    """``--debug`` was given to the root command, or ``DRAFTWISE_DEBUG`` is set."""
    if os.environ.get(DEBUG_ENV):
        return True
    options = ctx.find_object(Options) if ctx is not None else None
    return options is not None and options.debug


def _reporting(command: Callable[..., Any]) -> Callable[..., Any]:
    """A command whose ``DraftwiseError`` is printed as one line (``error: ...``) with the
    error's exit code; anything else is a bug and keeps its traceback (as does every error
    with ``--debug``)."""
    signature = inspect.signature(command)

    @functools.wraps(command)
    def run(*args: Any, **kwargs: Any) -> Any:
        ctx = kwargs.pop(_CONTEXT, None)
        try:
            return command(*args, **kwargs)
        except DraftwiseError as exc:
            if _debugging(ctx):
                raise
            typer.echo(f"error: {exc}", err=True)
            raise typer.Exit(exc.exit_code) from None

    # typer hands the context to a parameter annotated typer.Context.
    context = inspect.Parameter(_CONTEXT, inspect.Parameter.KEYWORD_ONLY, annotation=typer.Context)
    run.__signature__ = signature.replace(  # type: ignore[attr-defined]
        parameters=[*signature.parameters.values(), context]
    )
    return run


def _usage_line(exc: click_errors.ClickException) -> str:
    """The parser's complaint as one line in the commands' own form: ``--port: problem``."""
    param = getattr(exc, "param", None)
    short = (
        isinstance(exc, click_errors.BadParameter)
        and not isinstance(exc, click_errors.MissingParameter)
        and not exc.param_hint
    )
    if short and param is not None and param.opts:
        text = f"{param.opts[0]}: {exc.message}"
    else:
        text = exc.format_message()
        if text[:1].isupper() and text[1:2].islower():
            text = text[0].lower() + text[1:]  # "No such option" -> "no such option", as every error reads
    ctx = getattr(exc, "ctx", None)
    where = f" (see `{ctx.command_path} --help`)" if ctx is not None else ""
    return "error: " + " ".join(text.split()).rstrip(".") + where


class _Group(TyperGroup):
    """The root command, whose parser's complaints read as every other error: one line on stderr,
    exit status 2 (typer would draw a box of several lines)."""

    def main(
        self,
        args: Sequence[str] | None = None,
        prog_name: str | None = None,
        complete_var: str | None = None,
        standalone_mode: bool = True,
        windows_expand_args: bool = True,
        **extra: Any,
    ) -> Any:
        run = functools.partial(super().main, args, prog_name, complete_var, False, windows_expand_args, **extra)
        if not standalone_mode:
            return run()
        try:
            # Not standalone: the parser's errors come back here rather than being drawn.
            code = run()
        except click_errors.NoArgsIsHelpError as exc:
            exc.show()
            sys.exit(exc.exit_code)
        except click_errors.ClickException as exc:
            typer.echo(_usage_line(exc), err=True)
            sys.exit(exc.exit_code)
        except typer.Abort:
            typer.echo("Aborted!", err=True)
            sys.exit(1)
        sys.exit(code if isinstance(code, int) else 0)


def _root(
    ctx: typer.Context,
    debug: bool = typer.Option(False, "--debug", help=f"show the traceback of every error (as {DEBUG_ENV}=1 does)"),
) -> None:
    """Lossless speculative decoding: a cheap drafter proposes, the target verifies."""
    ctx.obj = Options(debug=debug)


def build_app() -> typer.Typer:
    app = typer.Typer(
        name="draftwise",
        cls=_Group,
        help=HELP,
        no_args_is_help=True,
        add_completion=False,
        pretty_exceptions_enable=False,
    )
    app.callback()(_root)
    for module in (generate, models, serve, verifier, bench, curve, replay, load, dashboard):
        module.register(app)
    for info in app.registered_commands:
        if info.callback is not None:
            info.callback = _reporting(info.callback)
    return app


def main() -> None:
    build_app()()
