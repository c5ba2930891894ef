"""Every settings flag of every command, given a bad value: one line that names a flag the
command has, exit status 2 (what the README promises for a user's mistake).

The commands, their flags and the fields behind them are read from the CLI itself (the
``Flags`` each command declares); the bad values are made from each field's own constraints
(bounds, choices, a number's type), so a new field or flag is checked without editing this file.
Everything runs in process, through the CLI's click command; no model is loaded.
"""

from __future__ import annotations

import re
import types
import typing
from typing import Any, Literal

import annotated_types
import pytest
import typer
from typer.testing import CliRunner

from draftwise.cli import build_app
from draftwise.cli.options import Flags

APP = build_app()
# What a command needs besides the flag under test for that flag to be read at all: a required
# flag, the switch a group of flags belongs to, the prompt.
NEEDS: dict[str, list[str]] = {"generate": ["hello"], "serve-verifier": ["--target", "tiny:0"]}
SWITCHES = {"RayOptions": ["--ray"], "ClientSettings": ["--verifier", "http://127.0.0.1:9"]}
FLAG = re.compile(r"(?<![\w-])--[a-z][a-z0-9-]*")


def _commands() -> dict[str, tuple[Flags, ...]]:
    found = {}
    for info in APP.registered_commands:
        assert info.callback is not None
        name = info.name or info.callback.__name__.replace("_", "-")
        found[name] = getattr(info.callback, "flag_sets", ())
    return found


def _command_flags(name: str) -> set[str]:
    """Every flag that ``draftwise NAME`` accepts, as click parses them."""
    command: Any = typer.main.get_command(APP).commands[name]  # type: ignore[attr-defined]
    return {opt for param in command.params for opt in (*param.opts, *param.secondary_opts)} | {"--help"}


def _bare(annotation: Any) -> Any:
    """``annotation`` without ``None`` (an optional field's type) and a tuple's element type."""
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        annotation = next(a for a in typing.get_args(annotation) if a is not type(None))
    if typing.get_origin(annotation) is tuple:
        annotation = typing.get_args(annotation)[0]
    return annotation


def bad_values(info: Any) -> list[str]:
    """Values the field rejects, from its own constraints."""
    kind = _bare(info.annotation)
    if typing.get_origin(kind) is Literal:
        return ["no-such-choice"]
    bad = ["abc"] if kind in (int, float) else []
    step = 1 if kind is int else 0.5
    for rule in info.metadata:
        if isinstance(rule, annotated_types.Gt):
            bad.append(str(rule.gt))
        elif isinstance(rule, annotated_types.Ge):
            bad.append(str(rule.ge - step))
        elif isinstance(rule, annotated_types.Lt):
            bad.append(str(rule.lt))
        elif isinstance(rule, annotated_types.Le):
            bad.append(str(rule.le + step))
    return bad


def _cases() -> list[Any]:
    cases = []
    for command, sets in _commands().items():
        for flags in sets:
            switch = next((v for k, v in SWITCHES.items() if k in [c.__name__ for c in flags.model.__mro__]), [])
            for name, info in flags.fields():
                for value in bad_values(info):
                    args = [command, *NEEDS.get(command, []), *switch, flags.flags(name)[0], value]
                    cases.append(pytest.param(args, flags.flags(name)[0], id=" ".join(args[:1] + args[-2:])))
    return cases


CASES = _cases()


def test_every_command_declares_its_settings_flags():
    commands = _commands()
    for name in ("generate", "serve", "serve-verifier", "bench", "load", "dashboard"):
        assert commands[name], f"{name} declares no settings flags"
    assert len(CASES) > 100  # bounds and choices of every command were found


@pytest.mark.parametrize(("args", "flag"), CASES)
def test_a_bad_value_is_one_line_naming_a_flag_of_the_command(args, flag):
    result = CliRunner().invoke(APP, args)
    lines = [line for line in result.output.splitlines() if line.strip()]
    assert result.exit_code == 2, result.output
    assert len(lines) == 1 and lines[0].startswith("error: "), result.output
    named = set(FLAG.findall(lines[0]))
    assert flag in named, lines[0]
    assert named <= _command_flags(args[0]), f"{named - _command_flags(args[0])} are not flags of {args[0]}"


@pytest.mark.parametrize(
    ("args", "says"),
    [
        (["serve", "--timeout", "0"], "error: --timeout: Input should be greater than 0"),
        (["bench", "--threshold", "2"], "error: --threshold: Input should be less than or equal to 1"),
        (["serve-verifier", "--target", "tiny:0", "--idle-timeout", "0"], "error: --idle-timeout:"),
        (["serve", "--max-tokens", "0"], "error: --max-tokens:"),
        (["serve", "--workers", "0"], "error: --slots:"),  # the old name of --slots
        (["serve", "--port", "eighty"], "error: --port:"),
        (["generate", "hello", "--no-such-flag"], "error: no such option: --no-such-flag"),
        (["serve-verifier"], "error: missing option '--target'"),
        (["models", "extra"], "error: got unexpected extra argument"),
    ],
)
def test_named_mistakes_read_alike(args, says):
    result = CliRunner().invoke(APP, args)
    assert result.exit_code == 2
    assert result.output.startswith(says) and len(result.output.strip().splitlines()) == 1, result.output


def test_the_load_bench_starts_serve_with_flags_serve_has():
    from draftwise.config import ModelOptions
    from draftwise.loadbench.config import LoadConfig
    from draftwise.loadbench.servers import draftwise_server

    models = ModelOptions(backend="hf", threads=2, dtype="float32", draft_quant="int8", device="cpu")
    config = LoadConfig(servers=("draftwise",), target="tiny:0", draft="tiny:1", drafter="model", models=models)
    argv = list(draftwise_server(config, slots=2).argv)
    used = {word for word in argv[argv.index("serve") + 1 :] if word.startswith("--")}
    assert used <= _command_flags("serve"), used - _command_flags("serve")
    assert {"--backend", "--dtype", "--draft-quant", "--device", "--timeout"} <= used
