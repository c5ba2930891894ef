"""The one family of errors draftwise reports to its users.

Every ``DraftwiseError`` carries a one-line message written for the user, and a kind that
says whose fault it is: the CLI prints the message and exits with the kind's code, the
servers answer with the kind's HTTP status. Anything else that escapes is a bug.
"""

from __future__ import annotations

from typing import ClassVar


class DraftwiseError(Exception):
    """A failure with a message for the user (one line)."""

    exit_code: ClassVar[int] = 2  # the CLI's exit status: 2 = the user's input cannot work
    status: ClassVar[int] = 400  # the servers' HTTP status


class ModelLoadError(DraftwiseError, ValueError):
    """A model source could not be loaded; the message says why."""


class IncompatibleModelsError(DraftwiseError, ValueError):
    """The draft's tokenizer differs from the target's; the message names the difference."""


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
