"""CLI options derived from the pydantic config classes, so ``config.py`` stays the one source
of truth: every scalar field of ``GenerationConfig``, ``SamplingConfig`` and ``DraftConfig``
becomes a flag (``top_p`` -> ``--top-p``) whose help text and default are the field's own.
A new config field therefore shows up on the command line without touching the CLI.

Flags default to ``None`` (not given), and only given values reach pydantic, so defaults
live in one place; pydantic's validation errors become one line naming the flag.
"""

from __future__ import annotations

import inspect
import types
import typing
from typing import Any, List, Literal, Optional

import typer
from pydantic import BaseModel, ValidationError

from draftwise.config import DraftConfig, GenerationConfig, SamplingConfig

# Section name -> config class; "" is GenerationConfig's own scalar fields.
SECTIONS: dict[str, type[BaseModel]] = {"": GenerationConfig, "sampling": SamplingConfig, "draft": DraftConfig}
# Fields a user does not set by hand on the command line (the models supply EOS ids).
SKIPPED = {"eos_token_ids"}


class ConfigError(ValueError):
    """A flag value the config rejects; the message is one line."""


def field_option(model: type[BaseModel], name: str, *flags: str, help: str | None = None, **kwargs: Any) -> Any:
    """A typer option whose default and help text come from ``model``'s field ``name``
    (a required field stays required)."""
    field = model.model_fields[name]
    default = ... if field.is_required() else field.default
    return typer.Option(default, *flags, help=help or field.description or "", **kwargs)


def warn_if_exposed(host: str, api_key: object | None) -> None:
    """Warn on stderr when a server binds beyond loopback without a key: anyone who can reach
    it can use it (both servers bind 127.0.0.1 unless told otherwise)."""
    if host not in ("127.0.0.1", "localhost", "::1") and api_key is None:
        typer.echo(f"warning: listening on {host} without --api-key: anyone who can reach it can use it", err=True)


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def _fields() -> list[tuple[str, str, Any]]:
    """(section, field name, field info) for every scalar config field."""
    out = []
    for section, cls in SECTIONS.items():
        for name, field in cls.model_fields.items():
            if name in SKIPPED or (inspect.isclass(field.annotation) and issubclass(field.annotation, BaseModel)):
                continue
            out.append((section, name, field))
    return out


def _cli_type(annotation: Any) -> tuple[Any, str]:
    """The type typer parses a field as, plus a note on allowed values."""
    args = [a for a in typing.get_args(annotation) if a is not type(None)]
    origin = typing.get_origin(annotation)
    if origin is Literal:
        return Optional[str], "one of " + ", ".join(map(str, typing.get_args(annotation)))
    if origin is tuple:
        return Optional[List[args[0]]], "repeatable"
    if origin in (typing.Union, types.UnionType) and len(args) == 1:
        return Optional[args[0]], ""
    return Optional[annotation], ""


def config_parameters() -> list[inspect.Parameter]:
    """Keyword parameters, one per config field, for a typer command's signature."""
    params = []
    for _section, name, field in _fields():
        cli_type, note = _cli_type(field.annotation)
        flag = _flag(name)
        flags = (f"{flag}/--no-{flag[2:]}",) if field.annotation is bool else (flag,)
        default = "none" if field.default is None else field.default
        if isinstance(default, tuple):
            default = ", ".join(default) or "none"
        parts = [field.description or "", note, f"default: {default}"]
        option = typer.Option(None, *flags, help="; ".join(p for p in parts if p), show_default=False)
        params.append(inspect.Parameter(name, inspect.Parameter.KEYWORD_ONLY, default=option, annotation=cli_type))
    return params


def config_from_values(values: dict[str, Any]) -> GenerationConfig:
    """Build the config from the flags given (``None`` = not given); one-line errors."""
    given: dict[str, dict[str, Any]] = {section: {} for section in SECTIONS}
    for section, name, _field in _fields():
        value = values.get(name)
        if value is not None:
            given[section][name] = tuple(value) if isinstance(value, list) else value
    try:
        sampling = SamplingConfig(**given["sampling"])
        draft = DraftConfig(**given["draft"])
        return GenerationConfig(**given[""], sampling=sampling, draft=draft)
    except ValidationError as exc:
        error = exc.errors()[0]
        where = ", ".join(_flag(str(part)) for part in error["loc"])
        message = error["msg"].removeprefix("Value error, ")
        got = f" (got {error['input']!r})" if error["loc"] and "input" in error else ""
        raise ConfigError(f"{where}: {message}{got}" if where else message) from None
