"""CLI options derived from the pydantic config classes, so ``config.py`` stays the one source
of truth: every scalar field of ``GenerationConfig``, ``SamplingConfig``, ``DraftConfig`` and
``ModelOptions`` becomes a flag (``top_p`` -> ``--top-p``) whose help text and default are the
field's own. A new config field therefore shows up on the command line without touching the CLI.

Flags default to ``None`` (not given), and only given values reach pydantic, so defaults
live in one place; pydantic's validation errors become one line naming the flag
(``draftwise.errors.built``).
"""

from __future__ import annotations

import functools
import inspect
import types
import typing
from collections.abc import Callable, Iterable
from typing import Any, List, Literal, Optional

import typer
from pydantic import BaseModel

from draftwise.config import DraftConfig, GenerationConfig, ModelOptions, SamplingConfig
from draftwise.errors import ConfigError, built, flag

# Section name -> config class; "" is GenerationConfig's own scalar fields.
SECTIONS: dict[str, type[BaseModel]] = {"": GenerationConfig, "sampling": SamplingConfig, "draft": DraftConfig}
# Fields a user does not set by hand on the command line (the models supply EOS ids).
SKIPPED = {"eos_token_ids"}

__all__ = [
    "ConfigError",
    "cluster_settings",
    "config_from_values",
    "config_parameters",
    "field_option",
    "flag",
    "given_model_options",
    "note",
    "settings_from_flags",
    "settings_parameters",
    "warn_if_exposed",
    "with_cluster_options",
    "with_model_options",
]


def field_option(model: type[BaseModel], name: str, *flags: str, help: str | None = None, **kwargs: Any) -> Any:
    """A typer option whose default and help text come from ``model``'s field ``name``
    (a required field stays required)."""
    field = model.model_fields[name]
    default = ... if field.is_required() else field.default
    return typer.Option(default, *flags, help=help or field.description or "", **kwargs)


def note(text: str) -> None:
    """A line for the user on stderr (progress, where a server listens), apart from the output."""
    typer.echo(text, err=True)


def warn_if_exposed(host: str, api_key: object | None) -> None:
    """Warn on stderr when a server binds beyond loopback without a key: anyone who can reach
    it can use it (both servers bind 127.0.0.1 unless told otherwise)."""
    if host not in ("127.0.0.1", "localhost", "::1") and api_key is None:
        typer.echo(f"warning: listening on {host} without --api-key: anyone who can reach it can use it", err=True)


def _scalar_fields(cls: type[BaseModel], skip: Iterable[str] = ()) -> list[tuple[str, Any]]:
    return [
        (name, field)
        for name, field in cls.model_fields.items()
        if name not in skip and not (inspect.isclass(field.annotation) and issubclass(field.annotation, BaseModel))
    ]


def _fields() -> list[tuple[str, str, Any]]:
    """(section, field name, field info) for every scalar generation-config field."""
    return [(section, name, field) for section, cls in SECTIONS.items() for name, field in _scalar_fields(cls, SKIPPED)]


def _cli_type(annotation: Any) -> tuple[Any, str]:
    """The type typer parses a field as, plus a note on allowed values."""
    args = [a for a in typing.get_args(annotation) if a is not type(None)]
    origin = typing.get_origin(annotation)
    if origin is Literal:
        return Optional[str], "one of " + ", ".join(map(str, typing.get_args(annotation)))
    if origin is tuple:
        return Optional[List[args[0]]], "repeatable"  # type: ignore[valid-type]  # a type made at run time, for typer
    if origin in (typing.Union, types.UnionType) and len(args) == 1:
        if typing.get_origin(args[0]) is Literal:
            return Optional[str], "one of " + ", ".join(map(str, typing.get_args(args[0])))
        return Optional[args[0]], ""
    return Optional[annotation], ""


def _parameter(name: str, field: Any) -> inspect.Parameter:
    cli_type, note = _cli_type(field.annotation)
    option_flag = flag(name)
    flags = (f"{option_flag}/--no-{option_flag[2:]}",) if field.annotation is bool else (option_flag,)
    default = "none" if field.default is None else field.default
    if isinstance(default, tuple):
        default = ", ".join(default) or "none"
    parts = [field.description or "", note, f"default: {default}"]
    option = typer.Option(None, *flags, help="; ".join(p for p in parts if p), show_default=False)
    return inspect.Parameter(name, inspect.Parameter.KEYWORD_ONLY, default=option, annotation=cli_type)


def config_parameters() -> list[inspect.Parameter]:
    """Keyword parameters, one per generation-config field, for a typer command's signature."""
    return [_parameter(name, field) for _section, name, field in _fields()]


def config_from_values(values: dict[str, Any]) -> GenerationConfig:
    """Build the config from the flags given (``None`` = not given); one-line errors."""
    given: dict[str, dict[str, Any]] = {section: {} for section in SECTIONS}
    for section, name, _field in _fields():
        value = values.get(name)
        if value is not None:
            given[section][name] = tuple(value) if isinstance(value, list) else value
    sampling = built(SamplingConfig, **given["sampling"])
    draft = built(DraftConfig, **given["draft"])
    return built(GenerationConfig, **given[""], sampling=sampling, draft=draft)


def given_model_options(values: dict[str, Any], skip: Iterable[str] = ()) -> dict[str, Any]:
    """The ``ModelOptions`` flags among ``values`` that were given (not None)."""
    return {name: values[name] for name, _ in _scalar_fields(ModelOptions, skip) if values.get(name) is not None}


def with_model_options(skip: Iterable[str] = ()) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Decorator for a typer command: one flag per ``ModelOptions`` field (but ``skip``), handed
    to the command as a validated ``models: ModelOptions`` (a bad value: one line, exit 2), and
    the flags given as ``models_given`` (what to pass on to a child command)."""
    skipped = set(skip)

    def decorate(command: Callable[..., Any]) -> Callable[..., Any]:
        signature = inspect.signature(command)
        names = [name for name, _ in _scalar_fields(ModelOptions, skipped)]

        @functools.wraps(command)
        def wrapper(**kwargs: Any) -> Any:
            given = given_model_options({n: kwargs.pop(n) for n in names}, skipped)
            return command(**kwargs, models=built(ModelOptions, **given), models_given=given)

        kept = [p for p in signature.parameters.values() if p.name not in ("models", "models_given")]
        extra = [_parameter(name, field) for name, field in _scalar_fields(ModelOptions, skipped)]
        wrapper.__signature__ = signature.replace(parameters=kept + extra)  # type: ignore[attr-defined]
        return wrapper

    return decorate


def settings_parameters(model: type[BaseModel]) -> list[inspect.Parameter]:
    """Keyword parameters, one per field of ``model``, for a typer command's signature: flags
    that default to ``None`` (not given), their help naming the field's own default."""
    return [_parameter(name, field) for name, field in model.model_fields.items()]


def settings_from_flags(model: type[BaseModel], enabled: bool, values: dict[str, Any], switch: str) -> Any:
    """``model`` from the flags given (``values``: ``None`` = not given) when the option
    ``switch`` that they belong to is on (``enabled``); ``None`` when it is off, where one of
    those flags is an error rather than silently ignored."""
    given = {name: value for name, value in values.items() if value is not None}
    if not enabled:
        if given:
            raise ConfigError(f"{', '.join(flag(name) for name in given)} only applies with {switch}")
        return None
    return built(model, **given)


def cluster_settings(model: type[BaseModel], enabled: bool, values: dict[str, Any]) -> Any:
    """``model`` (cluster settings) from the cluster flags given, with ``--ray``; ``None``
    without it, where a cluster flag is an error rather than silently ignored."""
    return settings_from_flags(model, enabled, values, "--ray")


def with_cluster_options(
    model: type[BaseModel], switch_help: str
) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Decorator for a typer command: ``--ray`` (help ``switch_help``) and one flag per field of
    ``model`` (``--ray-address``, ``--replicas``, ...; not given unless set), handed to the command
    as ``ray``: a validated ``model`` with ``--ray``, else ``None``."""
    names = list(model.model_fields)

    def decorate(command: Callable[..., Any]) -> Callable[..., Any]:
        signature = inspect.signature(command)

        @functools.wraps(command)
        def wrapper(**kwargs: Any) -> Any:
            enabled = kwargs.pop("use_ray")
            values = {name: kwargs.pop(name) for name in names}
            return command(**kwargs, ray=cluster_settings(model, enabled, values))

        kept = [p for p in signature.parameters.values() if p.name != "ray"]
        switch = inspect.Parameter(
            "use_ray",
            inspect.Parameter.KEYWORD_ONLY,
            annotation=bool,
            default=typer.Option(False, "--ray", help=switch_help),
        )
        wrapper.__signature__ = signature.replace(parameters=kept + [switch] + settings_parameters(model))  # type: ignore[attr-defined]
        return wrapper

    return decorate


def progress_bar(console: Any, enabled: bool, *extra: Any) -> Any:
    """The long commands' progress bar on ``console``: description, bar, done of total, time
    elapsed, then ``extra`` columns (rich's ``Progress``; ``enabled`` False shows nothing)."""
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(), *extra)
    return Progress(*columns, console=console, disable=not enabled)
