"""Writes ``benchmarks/data/tool_calls.jsonl``: 24 tool-call tasks for ``draftwise load --structured``.

What an agent sends: a request and the tools it may call, answered with one call
(``tool_choice: "required"``, ``parallel_tool_calls: false``). Each task is one JSON line::

    {"id", "subtask": "tool_call", "source", "expected", "turns": [REQUEST], "tools": [...],
     "tool_choice": "required", "parallel_tool_calls": false}

How the tasks were made. The tools are public functions of the Python standard library of the
interpreter that runs this script (the committed file: CPython 3.11.7), described as OpenAI
function tools: the name is ``module_function``, the description the docstring's first line, and
the parameters come from the signature (a parameter with a default is optional and typed by its
default: bool, integer, number or string; one without is required and may be any JSON value;
``*args`` is an array; ``**kwargs`` is left out). Each task's request (``TASKS``, written by hand)
asks for what one function does, in words; its tools are that function and 1 to 4 others (the
ones after it in ``TASKS``, cycling), so every task has 2 to 5 tools. ``expected`` names the
function the request describes. No randomness: the same interpreter gives the same file.

    .venv/bin/python scripts/make_tool_calls.py            # writes benchmarks/data/tool_calls.jsonl
    .venv/bin/python scripts/make_tool_calls.py --out FILE
"""

from __future__ import annotations

import argparse
import importlib
import inspect
import json
import platform
from pathlib import Path
from typing import Any

OUT = Path(__file__).resolve().parent.parent / "benchmarks" / "data" / "tool_calls.jsonl"
SUBTASK = "tool_call"
TASKS = (
    ("shutil.which", "Find where the executable 'python3' is on the PATH."),
    ("textwrap.dedent", "Remove the common indentation from the text '    x = 1\\n    y = 2'."),
    ("textwrap.indent", "Indent every line of 'a\\nb' with the prefix '> '."),
    ("fnmatch.fnmatch", "Does the file name 'report.txt' match the pattern '*.txt'?"),
    ("fnmatch.translate", "Turn the shell pattern 'data_??.csv' into a regular expression."),
    ("glob.escape", "Escape the special characters in the path 'photos[2024]/*.jpg'."),
    ("colorsys.rgb_to_hls", "Convert the RGB colour (0.2, 0.4, 0.6) to HLS."),
    ("heapq.nlargest", "Give me the 3 largest of the numbers 5, 1, 9, 7, 3."),
    ("json.dumps", "Serialize the object {'a': 1} to a JSON string with an indent of 2."),
    ("json.loads", "Parse the JSON text '[1, 2, 3]'."),
    ("string.capwords", "Capitalize each word of 'hello big world'."),
    ("calendar.monthrange", "On what weekday does February 2028 start, and how many days does it have?"),
    ("base64.b64encode", "Encode the bytes 'draftwise' in base64."),
    ("base64.b32decode", "Decode the base32 string 'MZXW6YTBOI======'."),
    ("difflib.get_close_matches", "Which of 'apple', 'ape' and 'peach' are close matches for 'appel'?"),
    ("shlex.split", "Split the command line 'ls -l \"my file.txt\"' into its arguments."),
    ("shlex.quote", 'Quote the string "it\'s here" so a shell reads it as one word.'),
    ("statistics.median", "What is the median of 3, 1, 4, 1 and 5?"),
    ("statistics.mode", "What is the most common value in 2, 2, 3, 3, 3, 4?"),
    ("tempfile.mkdtemp", "Create a temporary directory whose name starts with 'build-'."),
    ("pprint.pformat", "Pretty-print the dictionary {'b': 2, 'a': 1} as a string at most 20 characters wide."),
    ("zipfile.is_zipfile", "Is the file 'archive.zip' a valid zip file?"),
    ("shutil.copyfileobj", "Copy the open file src into the open file dst, 65536 bytes at a time."),
    ("heapq.merge", "Merge the sorted lists [1, 4, 7] and [2, 5, 8] into one sorted sequence."),
)
TYPES = {bool: "boolean", int: "integer", float: "number", str: "string"}


def _parameter(p: inspect.Parameter) -> dict[str, Any] | None:
    if p.kind is p.VAR_KEYWORD:
        return None
    if p.kind is p.VAR_POSITIONAL:
        return {"type": "array"}
    if p.default is p.empty or type(p.default) not in TYPES:
        return {}
    return {"type": TYPES[type(p.default)]}


def tool(path: str) -> dict[str, Any]:
    """``path``'s function as an OpenAI function tool."""
    module, _, name = path.rpartition(".")
    function = getattr(importlib.import_module(module), name)
    properties, required = {}, []
    for p in inspect.signature(function).parameters.values():
        schema = _parameter(p)
        if schema is None:
            continue
        properties[p.name] = schema
        if p.default is p.empty and p.kind is not p.VAR_POSITIONAL:
            required.append(p.name)
    description = (inspect.getdoc(function) or name).splitlines()[0]
    return {
        "type": "function",
        "function": {
            "name": f"{module}_{name}",
            "description": description,
            "parameters": {"type": "object", "properties": properties, "required": required},
        },
    }


def task(index: int) -> dict[str, Any]:
    path, request = TASKS[index]
    others = [TASKS[(index + 1 + j) % len(TASKS)][0] for j in range(index % 4 + 1)]
    return {
        "id": f"tool_{path.replace('.', '_')}",
        "subtask": SUBTASK,
        "source": f"CPython {platform.python_version()}",
        "expected": tool(path)["function"]["name"],
        "turns": [request],
        "tools": [tool(p) for p in [path, *others]],
        "tool_choice": "required",
        "parallel_tool_calls": False,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=OUT)
    out = parser.parse_args().out
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text("".join(json.dumps(task(i)) + "\n" for i in range(len(TASKS))))
    print(f"wrote {len(TASKS)} tasks to {out}")


if __name__ == "__main__":
    main()
