"""Every command's settings flags, derived from the typed config through one helper.

A command names, per settings class (``GenerationConfig``, ``ServerSettings``, ``BenchConfig``,
``LoadConfig``, ...), which fields are flags and under which names: a ``Flags`` (an include list,
and an alias map where the command's flag is shorter, ``serve --timeout`` for
``request_timeout``). ``with_flags`` turns them into typer options whose help text and default
are the field's own, and hands the command the values given; ``built`` builds the settings and
names a rejected field by that same alias map, so an error always names a flag the command has.
A new field in an included class shows up on the command line without touching the CLI.

Flags default to ``None`` (not given), and only given values reach pydantic, so defaults
live in one place; pydantic's validation errors become one line naming the flag.
"""

from __future__ import annotations

import functools
import inspect
import types
import typing
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, List, Literal, Optional, TypeVar

import typer
from pydantic import BaseModel, SecretStr

from draftwise.config import DraftConfig, GenerationConfig, ModelOptions, SamplingConfig
from draftwise.errors import ConfigError, validation_message

Model = TypeVar("Model", bound=BaseModel)
NO_ALIASES: Mapping[str, str] = types.MappingProxyType({})

__all__ = [
    "ConfigError",
    "Flags",
    "aliases_of",
    "built",
    "cluster_settings",
    "flag",
    "GENERATION_FLAGS",
    "generation_config",
    "note",
    "progress_bar",
    "settings_from_flags",
    "split",
    "warn_if_exposed",
    "with_cluster_options",
    "with_flags",
    "with_model_options",
]


def flag(name: str, aliases: Mapping[str, str] = NO_ALIASES) -> str:
    """The command-line flag of a settings field, as a command with ``aliases`` spells it:
    ``top_p`` -> ``--top-p``; ``request_timeout`` -> ``--timeout`` under ``serve``'s map."""
    return "--" + aliases.get(name, name).replace("_", "-")


def built(cls: type[Model], /, *, aliases: Mapping[str, str] = NO_ALIASES, **fields: Any) -> Model:
    """``cls(**fields)``, or a ``ConfigError`` whose message is pydantic's first complaint, with
    fields named as the command's flags (``aliases``: the command's alias map)."""
    from pydantic import ValidationError

    try:
        return cls(**fields)
    except ValidationError as exc:
        raise ConfigError(validation_message(exc, name=functools.partial(flag, aliases=aliases))) from None


def split(value: str) -> tuple[str, ...]:
    """A comma-separated flag's items: ``"a, b,"`` -> ``("a", "b")``."""
    return tuple(x.strip() for x in value.split(",") if x.strip())


def _frozen(mapping: Mapping[str, Any]) -> Mapping[str, Any]:
    return types.MappingProxyType(dict(mapping))


@dataclass(frozen=True)
class Flags:
    """How one command spells the fields of one settings class as flags.

    ``include``: the fields that are flags, in order (None: every scalar field but ``skip``).
    ``aliases``: field -> flag name where the command's differs (``request_timeout`` ->
    ``timeout``); ``also``: more names of a flag (``--workers`` for ``--slots``). ``help``: the
    command's own help text of a field; ``defaults``: the command's own default of a field (where
    the class has none); ``parse``: fields given as one string (comma-separated lists), with the
    function that reads it; ``options``: more typer options of a flag (``envvar``).
    """

    model: type[BaseModel]
    include: tuple[str, ...] | None = None
    skip: frozenset[str] = frozenset()
    aliases: Mapping[str, str] = field(default_factory=dict)
    also: Mapping[str, tuple[str, ...]] = field(default_factory=dict)
    help: Mapping[str, str] = field(default_factory=dict)
    defaults: Mapping[str, Any] = field(default_factory=dict)
    parse: Mapping[str, Callable[[str], Any]] = field(default_factory=dict)
    options: Mapping[str, Mapping[str, Any]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        # Read-only views: a command's flags are fixed once declared.
        for name in ("aliases", "also", "help", "defaults", "parse", "options"):
            object.__setattr__(self, name, _frozen(getattr(self, name)))

    def fields(self) -> list[tuple[str, Any]]:
        """(field name, field info) of every field that is a flag, in order."""
        if self.include is None:
            return _scalar_fields(self.model, self.skip)
        return [(name, self.model.model_fields[name]) for name in self.include]

    def flags(self, name: str) -> tuple[str, ...]:
        """Every name of the flag of field ``name`` (the first is the one errors use)."""
        return (flag(name, self.aliases), *self.also.get(name, ()))

    def parameters(self) -> list[inspect.Parameter]:
        """Keyword parameters, one per flag, for a typer command's signature."""
        return [self._parameter(name, info) for name, info in self.fields()]

    def given(self, values: dict[str, Any]) -> dict[str, Any]:
        """Take this class's flags out of ``values`` (a command's keyword arguments); those
        given (not None), read as the field takes them."""
        given: dict[str, Any] = {}
        for name, _info in self.fields():
            value = values.pop(name)
            if value is None:
                continue
            if name in self.parse:
                value = self.parse[name](value)
            given[name] = tuple(value) if isinstance(value, list) else value
        return given

    def _parameter(self, name: str, info: Any) -> inspect.Parameter:
        cli_type, choices = (Optional[str], "") if name in self.parse else _cli_type(info.annotation)
        names = self.flags(name)
        if info.annotation is bool:
            names = (f"{names[0]}/--no-{names[0][2:]}", *names[1:])
        default = self.defaults.get(name, ... if info.is_required() else None)
        if name in self.help:
            text = self.help[name]
        else:
            shown = self.defaults.get(name, info.default)
            text = "; ".join(p for p in (info.description or "", choices, f"default: {_shown(shown)}") if p)
        extra = {"show_default": False, **self.options.get(name, {})}
        option = typer.Option(default, *names, help=text, **extra)
        return inspect.Parameter(name, inspect.Parameter.KEYWORD_ONLY, default=option, annotation=cli_type)


def _shown(default: Any) -> str:
    if isinstance(default, tuple):
        return ", ".join(map(str, default)) or "none"
    return "none" if default is None else str(default)


def aliases_of(*sets: Flags) -> Mapping[str, str]:
    """A command's alias map (field -> flag name), over all its ``Flags``: what ``built`` takes."""
    merged: dict[str, str] = {}
    for flags in sets:
        merged.update(flags.aliases)
    return _frozen(merged)


def with_flags(*sets: Flags) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Decorator for a typer command: the flags of ``sets`` after the command's own parameters,
    handed to the command as ``given``: settings class -> {field: value given}.

    The command's ``flag_sets`` attribute lists every ``Flags`` it has (across decorators), for
    the help and the tests."""

    def decorate(command: Callable[..., Any]) -> Callable[..., Any]:
        signature = inspect.signature(command)

        @functools.wraps(command)
        def wrapper(**kwargs: Any) -> Any:
            given: dict[type[BaseModel], dict[str, Any]] = {}
            for flags in sets:  # a class may lend flags in two places (for the order of the help)
                given.setdefault(flags.model, {}).update(flags.given(kwargs))
            return command(**kwargs, given=given)

        kept = [p for p in signature.parameters.values() if p.name != "given"]
        extra = [p for flags in sets for p in flags.parameters()]
        wrapper.__signature__ = signature.replace(parameters=kept + extra)  # type: ignore[attr-defined]
        _add_flag_sets(wrapper, command, sets)
        return wrapper

    return decorate


def _add_flag_sets(wrapper: Any, command: Any, sets: Iterable[Flags]) -> None:
    wrapper.flag_sets = (*getattr(command, "flag_sets", ()), *sets)


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
        if args[0] is SecretStr:  # a key is typed as text; pydantic keeps it secret
            return Optional[str], ""
        return Optional[args[0]], ""
    return Optional[annotation], ""


# generate's generation flags: every scalar field of the three classes but the EOS ids, which
# the models supply.
GENERATION_FLAGS = (
    # generate: --prediction FILE, --json-schema FILE, --grammar FILE
    Flags(GenerationConfig, skip=frozenset({"eos_token_ids", "prediction", "grammar"})),
    Flags(SamplingConfig),
    Flags(DraftConfig),
)


def generation_config(given: Mapping[type[BaseModel], dict[str, Any]], aliases: Mapping[str, str]) -> GenerationConfig:
    """The ``GenerationConfig`` from the flags given (``given``: what ``with_flags`` hands a
    command; classes without flags given stay at their defaults); one-line errors."""
    sampling = built(SamplingConfig, aliases=aliases, **given.get(SamplingConfig, {}))
    draft = built(DraftConfig, aliases=aliases, **given.get(DraftConfig, {}))
    return built(GenerationConfig, aliases=aliases, **given.get(GenerationConfig, {}), sampling=sampling, draft=draft)


def with_model_options(skip: Iterable[str] = ()) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Decorator for a typer command: one flag per ``ModelOptions`` field (but ``skip``), handed
    to the command as a validated ``models: ModelOptions`` (a bad value: one line, exit 2), and
    the flags given as ``models_given`` (what to pass on to a child command)."""
    flags = Flags(ModelOptions, skip=frozenset(skip))

    def decorate(command: Callable[..., Any]) -> Callable[..., Any]:
        signature = inspect.signature(command)

        @functools.wraps(command)
        def wrapper(**kwargs: Any) -> Any:
            given = flags.given(kwargs)
            return command(**kwargs, models=built(ModelOptions, **given), models_given=given)

        kept = [p for p in signature.parameters.values() if p.name not in ("models", "models_given")]
        wrapper.__signature__ = signature.replace(parameters=kept + flags.parameters())  # type: ignore[attr-defined]
        _add_flag_sets(wrapper, command, [flags])
        return wrapper

    return decorate


def settings_from_flags(model: type[BaseModel], enabled: bool, given: dict[str, Any], switch: str) -> Any:
    """``model`` from the flags given (``given``: only those given) when the option ``switch``
    that they belong to is on (``enabled``); ``None`` when it is off, where one of those flags is
    an error rather than silently ignored."""
    if not enabled:
        if given:
            raise ConfigError(f"{', '.join(flag(name) for name in given)} only applies with {switch}")
        return None
    return built(model, **given)


def cluster_settings(model: type[BaseModel], enabled: bool, given: dict[str, Any]) -> Any:
    """``model`` (cluster settings) from the cluster flags given, with ``--ray``; ``None``
    without it, where a cluster flag is an error rather than silently ignored."""
    return settings_from_flags(model, enabled, given, "--ray")


def with_cluster_options(
    model: type[BaseModel], switch_help: str
) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Decorator for a typer command: ``--ray`` (help ``switch_help``) and one flag per field of
    ``model`` (``--ray-address``, ``--replicas``, ...; not given unless set), handed to the command
    as ``ray``: a validated ``model`` with ``--ray``, else ``None``."""
    flags = Flags(model)

    def decorate(command: Callable[..., Any]) -> Callable[..., Any]:
        signature = inspect.signature(command)

        @functools.wraps(command)
        def wrapper(**kwargs: Any) -> Any:
            enabled = kwargs.pop("use_ray")
            ray = cluster_settings(model, enabled, flags.given(kwargs))  # takes its flags out of kwargs
            return command(**kwargs, ray=ray)

        kept = [p for p in signature.parameters.values() if p.name != "ray"]
        switch = inspect.Parameter(
            "use_ray",
            inspect.Parameter.KEYWORD_ONLY,
            annotation=bool,
            default=typer.Option(False, "--ray", help=switch_help),
        )
        wrapper.__signature__ = signature.replace(parameters=kept + [switch] + flags.parameters())  # type: ignore[attr-defined]
        _add_flag_sets(wrapper, command, [flags])
        return wrapper

    return decorate


def progress_bar(console: Any, enabled: bool, *extra: Any) -> Any:
    """The long commands' progress bar on ``console``: description, bar, done of total, time
    elapsed, then ``extra`` columns (rich's ``Progress``; ``enabled`` False shows nothing)."""
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(), *extra)
    return Progress(*columns, console=console, disable=not enabled)
