"""Every ``draftwise ...`` command the README shows parses: its command exists and its flags are
the CLI's own (no model is loaded, nothing runs).

Commands are read from the README's code blocks (fenced, or indented by four spaces): shell line
continuations are joined, comments dropped, pipelines and ``&&`` lists split, and environment
assignments (``OMP_NUM_THREADS=2 draftwise ...``) skipped. Each command is then parsed by the
click command behind ``draftwise`` exactly as the shell would hand it over, which rejects an
unknown command, an unknown flag, a flag without its value or a missing argument.
"""

from __future__ import annotations

import re
import shlex
from pathlib import Path
from typing import Any

import pytest
import typer
from typer.core import TyperGroup

from draftwise.cli import build_app

try:  # typer 0.2x carries its own copy of click; older ones use click itself
    from typer._click.exceptions import UsageError
except ImportError:  # pragma: no cover
    from click.exceptions import UsageError

README = Path(__file__).resolve().parents[1] / "README.md"
SHELLS = {"", "bash", "sh", "shell", "console", "zsh"}
FENCE = re.compile(r"^(\s*)(```|~~~)\s*([\w+-]*)")
ENV_ASSIGNMENT = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*=")
SEPARATORS = {"|", "||", "&&", ";", "&"}
REDIRECTS = {">", ">>", "<", ">&", "&>", "<<", "<<<"}


def code_blocks(text: str) -> list[list[str]]:
    """The lines of every shell code block in ``text``: fenced (``bash``, ``sh``, ``console`` or no
    language) or indented by four spaces after a blank line or a heading."""
    blocks: list[list[str]] = []
    lines = text.splitlines()
    i = 0
    while i < len(lines):
        fence = FENCE.match(lines[i])
        if fence:
            end = next((j for j in range(i + 1, len(lines)) if lines[j].strip().startswith(fence.group(2))), len(lines))
            if fence.group(3).lower() in SHELLS:
                blocks.append(lines[i + 1 : end])
            i = end + 1
            continue
        opens = i == 0 or not lines[i - 1].strip() or lines[i - 1].lstrip().startswith("#")
        if lines[i].startswith("    ") and lines[i].strip() and opens:
            block = []
            while i < len(lines) and (lines[i].startswith("    ") or not lines[i].strip()):
                block.append(lines[i][4:])
                i += 1
            blocks.append(block)
            continue
        i += 1
    return blocks


def _logical_lines(block: list[str]) -> list[str]:
    """``block``'s lines with shell line continuations (a trailing backslash) and quotes that
    span lines (a JSON body in single quotes) joined."""
    out: list[str] = []
    pending = ""
    for line in block:
        if line.rstrip().endswith("\\"):
            pending += line.rstrip()[:-1] + " "
            continue
        pending += line
        try:
            _tokens(pending)
        except ValueError:  # a quote still open: the command goes on on the next line
            pending += "\n"
            continue
        out.append(pending)
        pending = ""
    if pending:
        out.append(pending)
    return out


def _tokens(line: str) -> list[str]:
    """Shell words and operators of ``line``; ``$(...)`` stands for one word, comments go."""
    line = re.sub(r"\$\([^()]*\)", "SUBSTITUTED", line)
    line = re.sub(r"(?<=\s)\d+(?=>)", "", line)  # 2>/dev/null: the descriptor goes with the redirect
    lexer = shlex.shlex(line, posix=True, punctuation_chars="|&;<>")
    lexer.whitespace_split = True
    lexer.commenters = "#"
    return list(lexer)


def commands(line: str) -> list[list[str]]:
    """The argument lists of the ``draftwise`` commands in one shell line (after the program name)."""
    found: list[list[str]] = []
    simple: list[str] = []
    for token in [*_tokens(line), ";"]:
        if token not in SEPARATORS:
            simple.append(token)
            continue
        words = list(simple)
        simple = []
        while words and (ENV_ASSIGNMENT.match(words[0]) or words[0] in ("env", "nice", "time", "exec")):
            words.pop(0)
        if words and (words[0] == "draftwise" or words[0].endswith("/draftwise")):
            found.append(_without_redirects(words[1:]))
    return found


def _without_redirects(words: list[str]) -> list[str]:
    out: list[str] = []
    skip = False
    for word in words:
        if skip:
            skip = False
        elif word in REDIRECTS:
            skip = True  # the redirect's target
        else:
            out.append(word)
    return out


def readme_commands(text: str) -> list[list[str]]:
    return [args for block in code_blocks(text) for line in _logical_lines(block) for args in commands(line)]


def parse(args: list[str]) -> None:
    """Parse ``draftwise ARGS`` as the CLI would, without running anything; a ``UsageError``
    for an unknown command or flag, a flag without its value, a value of the wrong type or a
    missing argument."""
    group: Any = typer.main.get_command(build_app())
    ctx = group.context_class(group, info_name="draftwise")
    with ctx.scope(cleanup=False):
        # The root's own options (--debug), parsed as a plain command's (the group's own
        # parse_args would set the command aside); what is left is the command and its arguments.
        rest = super(TyperGroup, group).parse_args(ctx, list(args))
        name, command, rest = group.resolve_command(ctx, rest)
    assert command is not None and name is not None
    try:
        command.make_context(name, rest, parent=ctx)
    except typer.Exit:
        pass  # --help (eager) prints the help and stops: parsed


def test_the_readme_shows_draftwise_commands():
    assert readme_commands(README.read_text(encoding="utf-8")), "no `draftwise ...` command found in README.md"


@pytest.mark.parametrize("args", readme_commands(README.read_text(encoding="utf-8")), ids=shlex.join)
def test_a_readme_command_parses(args: list[str]) -> None:
    if any("$" in arg for arg in args):
        pytest.skip("a shell variable stands for a value")  # its type cannot be checked here
    try:
        parse(args)
    except UsageError as exc:
        pytest.fail(f"`draftwise {shlex.join(args)}` does not parse: {exc.format_message()}")


SAMPLE = """\
Intro text mentioning draftwise generate --not-a-command.

```bash
OMP_NUM_THREADS=2 draftwise bench --target tiny:0 \\
    --limit 1 --out /tmp/x   # a comment
echo "hi" | draftwise generate - --json && draftwise models
python other.py --flag
```

```python
draftwise = "not shell"
```

## CLI
    draftwise pull default                 # or: draftwise pull smollm2-135m
    draftwise generate "$(cat prompt.txt)" --chat 2>/dev/null
"""


def test_commands_are_read_from_fenced_and_indented_blocks():
    assert readme_commands(SAMPLE) == [
        ["bench", "--target", "tiny:0", "--limit", "1", "--out", "/tmp/x"],
        ["generate", "-", "--json"],
        ["models"],
        ["pull", "default"],
        ["generate", "SUBSTITUTED", "--chat"],
    ]


@pytest.mark.parametrize(
    "args",
    [
        ["generate", "hello", "--no-such-flag"],
        ["generate", "hello", "--top-p"],  # a flag without its value
        ["no-such-command"],
        ["serve", "--port", "eighty"],
        ["pull"],  # a missing argument
        ["--no-such-root-flag", "models"],
        ["generate", "one", "two"],  # an extra argument
    ],
)
def test_a_command_that_does_not_parse_is_caught(args: list[str]) -> None:
    with pytest.raises(UsageError):
        parse(args)


@pytest.mark.parametrize(
    "args",
    [
        ["generate", "hello", "--chat", "--top-p", "0.9", "--drafter", "ngram"],
        ["--debug", "generate", "-", "--json"],
        ["serve", "--help"],
        ["bench", "--quick", "--methods", "baseline,ngram", "--no-progress"],
    ],
)
def test_a_command_that_parses_passes(args: list[str]) -> None:
    parse(args)


def layout_paths(text: str) -> list[str]:
    """The files and folders the README's layout table names: each backticked ``*.py`` or
    ``name/`` in its module column, a file in a folder's parentheses read inside that folder."""
    section = text.split("## Layout", 1)[1].split("\n## ", 1)[0]
    paths = []
    for row in section.splitlines():
        if not row.startswith("| ") or row.startswith(("| concept", "|---")):
            continue
        cell = row.rstrip(" |").rsplit(" | ", 1)[1]
        folder = re.match(r"`(\w+/)` \((.*)\)", cell)
        if folder:
            paths += [folder.group(1) + name for name in re.findall(r"`([\w.]+\.py)`", folder.group(2))]
            cell = cell[: folder.start()] + cell[folder.end() :]
        paths += re.findall(r"`([\w.]+\.py|\w+/)`", cell)
    return paths


def test_every_module_the_layout_names_is_there():
    package = Path(__file__).resolve().parents[1] / "src" / "draftwise"
    paths = layout_paths(README.read_text())
    assert len(paths) > 30 and "api/pool.py" in paths and "engine.py" in paths
    assert [p for p in paths if not (package / p).exists()] == []


def test_the_layout_reader_reads_folders_and_files():
    table = "## Layout\n\n| concept | module |\n|---|---|\n| a | `x.py`, `y.py`; `z/` |\n| b | `api/` (`a.py`) |\n"
    assert layout_paths(table) == ["x.py", "y.py", "z/", "api/a.py"]
