"""The one family of errors draftwise reports to its users.

Every ``DraftwiseError`` carries a one-line message written for the user, and a kind that
says whose fault it is: the CLI prints the message and exits with the kind's code, the
servers answer with the kind's HTTP status. Anything else that escapes is a bug.

pydantic's complaints about a setting become one such line through ``validation_message``
(the one formatter of validation errors). It names fields as the caller spells them: the API
by their JSON path, the CLI by the flag the command has (``draftwise.cli.options.built``), so
this core module knows nothing of flags.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from pydantic import ValidationError

# Parts of a pydantic error location that name no field: the request body, and the tags of
# union branches and validators ("str", "list[int]", "function-after[...]").
_NOT_FIELDS = {"body", "str", "int", "float", "bool"}


class DraftwiseError(Exception):
    """A failure with a message for the user (one line).

    ``exit_code`` and ``status`` are class defaults; a subclass (or an instance, such as an
    ``APIError`` carrying its own HTTP status) may set its own.
    """

    exit_code: int = 2  # the CLI's exit status: 2 = the user's input cannot work
    status: int = 400  # the servers' HTTP status


class ConfigError(DraftwiseError, ValueError):
    """A setting (a flag, a field of a settings object) that the config rejects; one line."""


def whole_numbers(text: str, flag: str, error: type[ConfigError] = ConfigError) -> tuple[int, ...]:
    """A flag's comma-separated whole numbers, in the order given: ``"4, 1,2"`` -> ``(4, 1, 2)``;
    anything else is ``error``, one line naming ``flag``."""
    parts = [p.strip() for p in text.split(",") if p.strip()]
    if not parts or not all(p.isdigit() for p in parts):
        raise error(f"{flag}: expected comma-separated whole numbers such as 1,2,4,8 (got {text!r})")
    return tuple(int(p) for p in parts)


class ModelLoadError(DraftwiseError, ValueError):
    """A model source could not be loaded; the message says why."""


class IncompatibleModelsError(DraftwiseError, ValueError):
    """The draft's tokenizer differs from the target's; the message names the difference."""


class SlotsFullError(DraftwiseError):
    """Every sequence (slot) of a model's batched context is taken: one stream more than the
    model was loaded for. A server sizes its slots at start, so this is its capacity, not the
    user's input."""

    exit_code = 1
    status = 503


class TargetError(DraftwiseError):
    """The target cannot take the next step of a generation under way (a remote verifier
    refused or went away); the message says why.

    ``SpeculativeEngine.stream`` ends the generation there with what it has produced, finish
    reason ``"error"``, rather than raise the text away.
    """

    exit_code = 1  # not necessarily the user's mistake: a server may be down


class ContextLengthError(TargetError):
    """The sequence holds as many tokens as the target (or the draft model) can: the engine
    ends the generation with finish reason ``"length"``."""

    exit_code = 2


def field_path(loc: Sequence[Any]) -> list[str]:
    """The field names in a pydantic error location (``body``, union and validator tags dropped)."""
    parts = [str(part) for part in loc]
    return [p for p in parts if p not in _NOT_FIELDS and "[" not in p and not p.startswith("function-")]


def _problem(error: Mapping[str, Any]) -> str:
    if error.get("type") == "extra_forbidden":
        return "unknown field (not supported)"
    return str(error.get("msg", "invalid value")).removeprefix("Value error, ")


def _line(error: Mapping[str, Any], name: Callable[[str], str] | None) -> str:
    parts = field_path(error.get("loc", ()))
    if not parts:
        return _problem(error)
    if name is None:
        return f"{'.'.join(parts)}: {_problem(error)}"
    got = f" (got {error['input']!r})" if "input" in error else ""
    # A list field's element shows up as its index (methods.0): the field alone names it.
    names = [p for p in parts if not p.isdigit()]
    return f"{', '.join(name(p) for p in names)}: {_problem(error)}{got}"


def validation_message(
    exc: ValidationError | Sequence[Mapping[str, Any]],
    prefix: str = "",
    *,
    name: Callable[[str], str] | None = None,
    every: bool = False,
) -> str:
    """pydantic's complaint as one line: ``field.path: problem``.

    ``exc`` is a ``ValidationError`` or its ``errors()``. ``name``: how the caller spells a
    field (the CLI: as the command's flag, ``--top-p: problem (got 0)``, with the value given);
    None: the dotted field path. ``every``: every distinct complaint, joined by ``"; "``; else
    only the first.
    """
    errors = exc if isinstance(exc, Sequence) else exc.errors()
    lines = [_line(error, name) for error in (errors if every else errors[:1])]
    return prefix + "; ".join(dict.fromkeys(lines))
