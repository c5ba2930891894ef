"""Writes ``benchmarks/data/agentic.jsonl``: requests that repeat themselves, as agents and
batch jobs send them, for ``draftwise load --data`` at one client (sent in file order).

Two subtasks, each a sequence whose later requests can draft from the earlier answers:

- ``tool_schemas``: one conversion template over 50 records, as a pipeline runs it: the
  signature of a public function of the Python standard library (of the interpreter that runs
  this script; the committed file: CPython 3.11.7), to be written as an OpenAI tool
  definition in JSON. Every answer has the same structure around other names.
- ``agent``: a tool-calling agent loop of 12 turns over a fixed set of four tools: each
  request is the whole conversation so far (the task, each earlier call and its result),
  asking for the next call as one JSON object. The earlier calls are scripted, so every
  server sees the same requests.

Each line: ``{"id", "subtask", "turn", "turns": [PROMPT]}``. No randomness: the same
interpreter gives the same file, byte for byte.

    .venv/bin/python scripts/make_agentic.py            # writes benchmarks/data/agentic.jsonl
    .venv/bin/python scripts/make_agentic.py --out FILE
"""

from __future__ import annotations

import argparse
import importlib
import inspect
import json
import platform
from pathlib import Path

OUT = Path(__file__).resolve().parent.parent / "benchmarks" / "data" / "agentic.jsonl"
MODULES = ("textwrap", "shutil", "fnmatch", "glob", "os.path", "json", "base64", "difflib", "string", "html")
RECORDS = 50
TEMPLATE = (
    "Write an OpenAI tool definition for this Python function, as one JSON object of the form "
    '{{"type": "function", "function": {{"name": ..., "description": ..., "parameters": {{"type": "object", '
    '"properties": {{...}}, "required": [...]}}}}}}. Give each parameter a JSON type and a short description. '
    "Answer with the JSON only.\n\n{module}.{name}{signature}"
)
TOOLS = (
    ("list_files", "list the files under a folder", '{"folder": string}'),
    ("read_file", "read a file", '{"path": string}'),
    ("search", "search the files for a text", '{"text": string, "folder": string}'),
    ("write_file", "write a file", '{"path": string, "content": string}'),
)
TASK = "The tests of the project in /repo fail with an ImportError. Find the cause and fix it."
# The scripted loop: each call, and what the tool answered.
CALLS = (
    ("list_files", {"folder": "/repo"}, "README.md\nsetup.py\nsrc/\ntests/"),
    ("list_files", {"folder": "/repo/tests"}, "test_parser.py\ntest_cli.py"),
    ("read_file", {"path": "/repo/tests/test_parser.py"}, "from repo.parsing import parse\n\ndef test_parse(): ..."),
    ("search", {"text": "def parse", "folder": "/repo/src"}, "/repo/src/repo/parser.py:12: def parse(text):"),
    ("list_files", {"folder": "/repo/src/repo"}, "__init__.py\nparser.py\ncli.py"),
    ("read_file", {"path": "/repo/src/repo/__init__.py"}, "from repo.parser import parse\n"),
    ("search", {"text": "repo.parsing", "folder": "/repo"}, "/repo/tests/test_parser.py:1\n/repo/src/repo/cli.py:3"),
    ("read_file", {"path": "/repo/src/repo/cli.py"}, "import sys\n\nfrom repo.parsing import parse\n"),
    ("write_file", {"path": "/repo/src/repo/cli.py", "content": "import sys\n\nfrom repo.parser import parse\n"}, "ok"),
    (
        "write_file",
        {"path": "/repo/tests/test_parser.py", "content": "from repo.parser import parse\n\ndef test_parse(): ..."},
        "ok",
    ),
    ("search", {"text": "repo.parsing", "folder": "/repo"}, "no matches"),
    ("read_file", {"path": "/repo/README.md"}, "# repo\n\nRun the tests with pytest."),
)


def public_functions() -> list[tuple[str, str, str]]:
    """(module, name, signature) of the first ``RECORDS`` public functions of ``MODULES``."""
    found = []
    for module_name in MODULES:
        module = importlib.import_module(module_name)
        for name, value in sorted(vars(module).items()):
            if name.startswith("_") or not inspect.isfunction(value) or value.__module__ != module.__name__:
                continue
            try:
                signature = str(inspect.signature(value))
            except (TypeError, ValueError):
                continue
            found.append((module_name, name, signature))
    return found[:RECORDS]


def agent_prompt(turn: int) -> str:
    """The conversation before call ``turn`` (0-based), asking for that call."""
    tools = "\n".join(f"- {name}: {what}; arguments {args}" for name, what, args in TOOLS)
    lines = [
        "You are a coding agent. You act only through these tools:",
        tools,
        'Answer with the next call only, as one JSON object: {"tool": NAME, "arguments": {...}}.',
        "",
        f"Task: {TASK}",
    ]
    for name, arguments, result in CALLS[:turn]:
        lines += ["", "Call: " + json.dumps({"tool": name, "arguments": arguments}), "Result:", result]
    return "\n".join(lines + ["", "Next call:"])


def rows() -> list[dict[str, object]]:
    found: list[dict[str, object]] = []
    for turn, (module, name, signature) in enumerate(public_functions(), start=1):
        text = TEMPLATE.format(module=module, name=name, signature=signature)
        found.append({"id": f"tool_schemas_{turn:02d}", "subtask": "tool_schemas", "turn": turn, "turns": [text]})
    for turn in range(len(CALLS)):
        found.append(
            {"id": f"agent_{turn + 1:02d}", "subtask": "agent", "turn": turn + 1, "turns": [agent_prompt(turn)]}
        )
    return found


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=OUT)
    args = parser.parse_args()
    made = rows()
    if sum(r["subtask"] == "tool_schemas" for r in made) < RECORDS:
        raise SystemExit(f"fewer than {RECORDS} public functions in {', '.join(MODULES)}")
    args.out.write_text("".join(json.dumps(row) + "\n" for row in made))
    print(f"wrote {len(made)} requests to {args.out} (Python {platform.python_version()})")


if __name__ == "__main__":
    main()
