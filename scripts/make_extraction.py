"""Writes ``benchmarks/data/extraction.jsonl``: 24 JSON-schema extraction tasks for
``draftwise load --structured``.

What an extraction pipeline sends: a text and a JSON schema, answered with one JSON record that
follows it (OpenAI's ``response_format: {"type": "json_schema", ...}``). Each task is one JSON
line::

    {"id", "subtask": "extraction", "source", "turns": [PROMPT], "response_format": {...}}

How the tasks were made. The text of each is the source of one public function of the Python
standard library of the interpreter that runs this script (the committed file: CPython 3.11.7),
copied verbatim: the functions listed in ``FUNCTIONS`` below, cut after ``MAX_LINES`` lines. The
prompt asks for facts about the function; the schema (``SCHEMA``, the same for every task) bounds
every string and list, so every answer ends within ``max_tokens`` 256. No randomness: the same
interpreter gives the same file, byte for byte.

    .venv/bin/python scripts/make_extraction.py            # writes benchmarks/data/extraction.jsonl
    .venv/bin/python scripts/make_extraction.py --out FILE
"""

from __future__ import annotations

import argparse
import importlib
import inspect
import json
import platform
from pathlib import Path

OUT = Path(__file__).resolve().parent.parent / "benchmarks" / "data" / "extraction.jsonl"
SUBTASK = "extraction"
MAX_LINES = 40
FUNCTIONS = (
    "textwrap.dedent",
    "textwrap.indent",
    "shutil.copyfileobj",
    "shutil.which",
    "fnmatch.fnmatch",
    "fnmatch.translate",
    "glob.escape",
    "colorsys.rgb_to_hls",
    "heapq.nlargest",
    "heapq.merge",
    "json.dumps",
    "json.loads",
    "pprint.pformat",
    "zipfile.is_zipfile",
    "string.capwords",
    "calendar.monthrange",
    "base64.b64encode",
    "base64.b32decode",
    "difflib.get_close_matches",
    "shlex.split",
    "shlex.quote",
    "statistics.median",
    "statistics.mode",
    "tempfile.mkdtemp",
)
SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 40},
        "parameters": {
            "type": "array",
            "maxItems": 8,
            "items": {
                "type": "object",
                "properties": {
                    "name": {"type": "string", "maxLength": 30},
                    "has_default": {"type": "boolean"},
                },
                "required": ["name", "has_default"],
                "additionalProperties": False,
            },
        },
        "returns_value": {"type": "boolean"},
        "raises": {"type": "array", "maxItems": 4, "items": {"type": "string", "maxLength": 30}},
        "summary": {"type": "string", "maxLength": 160},
    },
    "required": ["name", "parameters", "returns_value", "raises", "summary"],
    "additionalProperties": False,
}
ASK = (
    "Extract facts about this Python function as JSON: its name, its parameters (each with its name and "
    "whether it has a default), whether it returns a value, the exception classes it raises, and a "
    "one-sentence summary."
)


def task(path: str) -> dict:
    module, _, name = path.rpartition(".")
    source = inspect.getsource(getattr(importlib.import_module(module), name))
    text = "".join(source.splitlines(keepends=True)[:MAX_LINES])
    return {
        "id": f"extract_{path.replace('.', '_')}",
        "subtask": SUBTASK,
        "source": f"CPython {platform.python_version()} {path}",
        "turns": [f"{ASK}\n\n```python\n{text}```"],
        "response_format": {"type": "json_schema", "json_schema": {"name": "function_facts", "schema": SCHEMA}},
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=OUT)
    out = parser.parse_args().out
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text("".join(json.dumps(task(path)) + "\n" for path in FUNCTIONS))
    print(f"wrote {len(FUNCTIONS)} tasks to {out}")


if __name__ == "__main__":
    main()
