"""Writes ``benchmarks/data/code_edit.jsonl``: 25 code-edit tasks for ``draftwise load --edit``.

What a coding tool sends when it asks a model to edit a file: the instruction, the whole file,
and (OpenAI's Predicted Outputs) the file as it is now as the predicted answer, since most of
the edited file is the old one word for word. Each task is one JSON line::

    {"id", "subtask": "code_edit", "category": KIND, "instruction", "file", "prediction",
     "expected_edit", "source", "turns": [PROMPT]}

``turns`` holds the chat prompt the user sends (the format ``draftwise.bench.dataset.read_prompts``
reads): the instruction, the file in a fenced python block, then "Reply with the whole updated
file in one ```python code block and nothing else." ``prediction`` is the answer if nothing
changed: "```python\\n" + file + "```" (the file ends with a newline). ``category`` is the kind of
edit, so ``--limit N`` takes the kinds in turn.

How the files were made. Each file is a contiguous run of top-level statements of one module of
the Python standard library of the interpreter that runs this script (the committed file: CPython
3.11.7), from the statement whose first line starts with ``start`` to the first statement from
there whose first line starts with ``end``, cut at statement boundaries and copied verbatim (about
1,800 to 3,200 characters, 500 to 800 tokens). The modules and slices are listed in ``TASKS``
below, one edit per file, five of each kind:

- rename: a function defined in the file, and every use of it there;
- add_parameter: a parameter with a default, and what it does;
- add_docstring: a docstring for a function that has none;
- add_guard: a guard clause at a function's start;
- change_constant: one module-level constant's value.

No randomness: the same interpreter gives the same file, byte for byte. A slice that no longer
fits (another Python version) is an error naming the task, not a silent change.

    .venv/bin/python scripts/make_code_edit.py            # writes benchmarks/data/code_edit.jsonl
    .venv/bin/python scripts/make_code_edit.py --out FILE
"""

from __future__ import annotations

import argparse
import ast
import json
import platform
import re
import sys
import sysconfig
from dataclasses import dataclass
from pathlib import Path

OUT = Path(__file__).resolve().parent.parent / "benchmarks" / "data" / "code_edit.jsonl"
SUBTASK = "code_edit"
KINDS = ("rename", "add_parameter", "add_docstring", "add_guard", "change_constant")
MIN_CHARS, MAX_CHARS = 1800, 3200
REPLY = "Reply with the whole updated file in one ```python code block and nothing else."
FENCE = "```"


@dataclass(frozen=True)
class Task:
    module: str  # a standard-library module, by import name
    start: str  # first line of the slice's first top-level statement starts with this
    end: str  # ... and of its last one
    kind: str  # one of KINDS
    target: str  # the function (or constant) edited: it must be in the file
    instruction: str
    expected_edit: str


TASKS = (
    Task(
        "glob",
        "def _iglob(",
        "def _glob2(",
        "rename",
        "_glob0",
        "Rename the function `_glob0` to `_glob_literal`, and update every call of it in this file.",
        "def _glob0 -> def _glob_literal; its calls in _iglob and glob0 renamed",
    ),
    Task(
        "fnmatch",
        '"""Filename matching',
        "def fnmatchcase(",
        "add_parameter",
        "filter",
        "Add a parameter `invert=False` to `filter`: when it is true, `filter` returns the names that do "
        "NOT match `pat` instead of those that do. Mention it in the docstring.",
        "filter(names, pat, invert=False); both branches keep a name when (match is None) == invert",
    ),
    Task(
        "urllib.parse",
        "def _splitparams(",
        "def _check_bracketed_host(",
        "add_docstring",
        "_splitnetloc",
        "Add a docstring to `_splitnetloc` that says what it returns and what `start` is.",
        "a docstring in _splitnetloc: (netloc, rest) split at the first '/', '?' or '#' after start",
    ),
    Task(
        "textwrap",
        "def wrap(",
        "_leading_whitespace_re",
        "add_guard",
        "shorten",
        "At the start of `shorten`, return the empty string at once when `text` is empty or only whitespace.",
        "shorten begins with: if not text.strip(): return ''",
    ),
    Task(
        "secrets",
        "__all__",
        "def token_urlsafe(",
        "change_constant",
        "DEFAULT_ENTROPY = 32",
        "Change `DEFAULT_ENTROPY` from 32 to 64 bytes.",
        "DEFAULT_ENTROPY = 64",
    ),
    Task(
        "colorsys",
        "def rgb_to_hls(",
        "def hsv_to_rgb(",
        "rename",
        "_v",
        "Rename the helper `_v` to `_hue_to_channel`, and update every call of it in this file.",
        "def _v -> def _hue_to_channel; its three calls in hls_to_rgb renamed",
    ),
    Task(
        "bisect",
        "def insort_right(",
        "insort =",
        "add_parameter",
        "insort_right",
        "Add a keyword-only parameter `unique=False` to `insort_right`: when it is true, do not insert `x` "
        "if an equal item is already in `a`. Mention it in the docstring.",
        "insort_right(..., key=None, unique=False): skips the insert when a[lo - 1] equals x",
    ),
    Task(
        "shutil",
        "def _copytree(",
        "def _copytree(",
        "add_docstring",
        "_copytree",
        "Add a docstring to `_copytree` that says what it copies, what it returns and when it raises Error.",
        "a docstring in _copytree: copies the entries into dst recursively, returns dst, raises Error",
    ),
    Task(
        "json",
        "def detect_encoding(",
        "def load(",
        "add_guard",
        "detect_encoding",
        "At the start of `detect_encoding`, return 'utf-8' at once when `b` is empty.",
        "detect_encoding begins with: if not b: return 'utf-8'",
    ),
    Task(
        "quopri",
        "MAXLINESIZE",
        "def encode(",
        "change_constant",
        "MAXLINESIZE = 76",
        "Change `MAXLINESIZE` from 76 to 72.",
        "MAXLINESIZE = 72",
    ),
    Task(
        "html",
        "_invalid_codepoints",
        "def unescape(",
        "rename",
        "_replace_charref",
        "Rename the function `_replace_charref` to `_decode_charref`, and update every use of it in this file.",
        "def _replace_charref -> def _decode_charref; the use in unescape renamed",
    ),
    Task(
        "base64",
        "def b64decode(",
        "def urlsafe_b64decode(",
        "add_parameter",
        "urlsafe_b64encode",
        "Add a parameter `padding=True` to `urlsafe_b64encode`: when it is false, strip the trailing '=' "
        "padding from the result. Mention it in the docstring.",
        "urlsafe_b64encode(s, padding=True): the result's trailing b'=' stripped when not padding",
    ),
    Task(
        "base64",
        "def _85encode(",
        "def a85encode(",
        "add_docstring",
        "_85encode",
        "Add a docstring to `_85encode` that says what it encodes and what each of its parameters does.",
        "a docstring in _85encode: base-85 encoding of b with chars/chars2, pad, foldnuls, foldspaces",
    ),
    Task(
        "calendar",
        "class IllegalWeekdayError",
        "def _nextmonth(",
        "add_guard",
        "leapdays",
        "At the start of `leapdays`, return 0 at once when `y2` is not greater than `y1`.",
        "leapdays begins with: if y2 <= y1: return 0",
    ),
    Task(
        "http.client",
        "_MAXLINE",
        "def _strip_ipv6_iface(",
        "change_constant",
        "_MAXHEADERS = 100",
        "Change `_MAXHEADERS` from 100 to 200.",
        "_MAXHEADERS = 200",
    ),
    Task(
        "getopt",
        "def do_longs(",
        "def short_has_arg(",
        "rename",
        "long_has_args",
        "Rename the function `long_has_args` to `match_long_option`, and update every call of it in this file.",
        "def long_has_args -> def match_long_option; its call in do_longs renamed",
    ),
    Task(
        "tempfile",
        "def mkdtemp(",
        "def mktemp(",
        "add_parameter",
        "mkdtemp",
        "Add a parameter `mode=0o700` to `mkdtemp` and create the directory with that mode instead of "
        "the fixed 0o700. Mention it in the docstring.",
        "mkdtemp(suffix=None, prefix=None, dir=None, mode=0o700); _os.mkdir(file, mode)",
    ),
    Task(
        "uuid",
        "def _parse_mac(",
        "def _find_mac_under_heading(",
        "add_docstring",
        "_parse_mac",
        "Add a docstring to `_parse_mac` that says what it accepts and what it returns.",
        "a docstring in _parse_mac: a MAC address word (bytes) to its int, None when it is not one",
    ),
    Task(
        "quopri",
        "def decode(",
        "def unhex(",
        "add_guard",
        "decodestring",
        "At the start of `decodestring`, return b'' at once when `s` is empty.",
        "decodestring begins with: if not s: return b''",
    ),
    Task(
        "gzip",
        "import struct",
        "def write32u(",
        "change_constant",
        "_COMPRESS_LEVEL_TRADEOFF = 6",
        "Change `_COMPRESS_LEVEL_TRADEOFF` from 6 to 5.",
        "_COMPRESS_LEVEL_TRADEOFF = 5",
    ),
    Task(
        "heapq",
        "def heappush(",
        "def _siftdown(",
        "rename",
        "_siftdown",
        "Rename the function `_siftdown` to `_bubble_up`, and update every call of it in this file.",
        "def _siftdown -> def _bubble_up; its call in heappush renamed",
    ),
    Task(
        "genericpath",
        "def exists(",
        "def samefile(",
        "add_parameter",
        "exists",
        "Add a keyword-only parameter `follow_symlinks=True` to `exists`: when it is false, use `os.lstat` "
        "instead of `os.stat`, so that a broken symbolic link counts as existing. Mention it in the docstring.",
        "exists(path, *, follow_symlinks=True): os.stat or os.lstat by follow_symlinks",
    ),
    Task(
        "glob",
        "def _iterdir(",
        "def _isrecursive(",
        "add_docstring",
        "_rlistdir",
        "Add a docstring to `_rlistdir` that says what it yields and what `dironly` and `include_hidden` do.",
        "a docstring in _rlistdir: yields the relative paths below dirname recursively",
    ),
    Task(
        "filecmp",
        '"""Utilities for comparing',
        "def _do_cmp(",
        "add_guard",
        "cmp",
        "At the start of `cmp`, return True at once when `f1` and `f2` are the same path (equal arguments).",
        "cmp begins with: if f1 == f2: return True",
    ),
    Task(
        "base64",
        "MAXLINESIZE",
        "def main(",
        "change_constant",
        "MAXLINESIZE = 76",
        "Change `MAXLINESIZE` from 76 to 64.",
        "MAXLINESIZE = 64 (MAXBINSIZE follows from it)",
    ),
)


class TaskError(ValueError):
    """A task that does not fit the interpreter's standard library."""


def stdlib() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def module_path(name: str) -> Path:
    """The module's source file in the interpreter's standard library (frozen modules too)."""
    base = stdlib() / name.replace(".", "/")
    for path in (base.with_name(base.name + ".py"), base / "__init__.py"):
        if path.is_file():
            return path
    raise TaskError(f"{name}: no Python source in {stdlib()}")


def statement_lines(source: str) -> list[tuple[str, int, int]]:
    """(first line, first line number, last line number) of each top-level statement, decorators included."""
    lines = source.splitlines(keepends=True)
    spans = []
    for node in ast.parse(source).body:
        decorators = getattr(node, "decorator_list", [])
        first = min([node.lineno, *(d.lineno for d in decorators)])
        spans.append((lines[first - 1], first, node.end_lineno or node.lineno))
    return spans


def file_of(task: Task) -> tuple[str, str]:
    """The task's file (its slice of the module, ending with a newline) and where it comes from."""
    path = module_path(task.module)
    source = path.read_text(encoding="utf-8")
    spans = statement_lines(source)
    starts = [i for i, span in enumerate(spans) if span[0].startswith(task.start)]
    if not starts:
        raise TaskError(f"{task.module}: no top-level statement starts with {task.start!r}")
    ends = [i for i in range(starts[0], len(spans)) if spans[i][0].startswith(task.end)]
    if not ends:
        raise TaskError(f"{task.module}: no top-level statement after {task.start!r} starts with {task.end!r}")
    first, last = spans[starts[0]][1], spans[ends[0]][2]
    text = "".join(source.splitlines(keepends=True)[first - 1 : last])
    text = text if text.endswith("\n") else text + "\n"
    where = path.relative_to(stdlib()).as_posix()
    return text, f"Lib/{where} lines {first}-{last} (Python {platform.python_version()})"


def functions_of(text: str) -> dict[str, ast.FunctionDef]:
    return {n.name: n for n in ast.walk(ast.parse(text)) if isinstance(n, ast.FunctionDef)}


def check(task: Task, text: str) -> None:
    """The file is the right size and holds what the instruction edits."""
    if not MIN_CHARS <= len(text) <= MAX_CHARS:
        raise TaskError(f"{task.module} {task.start!r}: {len(text)} characters, not {MIN_CHARS}-{MAX_CHARS}")
    if task.kind == "change_constant":
        if not any(line.startswith(task.target) for line in text.splitlines()):
            raise TaskError(f"{task.module}: no line {task.target!r} in the file")
        return
    function = functions_of(text).get(task.target)
    if function is None:
        raise TaskError(f"{task.module}: no function {task.target} in the file")
    if task.kind == "add_docstring" and ast.get_docstring(function) is not None:
        raise TaskError(f"{task.module}: {task.target} already has a docstring")
    if task.kind == "rename" and len(re.findall(rf"\b{task.target}\b", text)) < 2:
        raise TaskError(f"{task.module}: {task.target} is not used in the file")


def predicted(text: str) -> str:
    """The answer if nothing changed: the file in the fenced block the prompt asks for."""
    return f"{FENCE}python\n{text}{FENCE}"


def prompt_of(instruction: str, text: str) -> str:
    """What the user sends: the instruction, the file, and how to reply."""
    return f"{instruction}\n\n{predicted(text)}\n\n{REPLY}"


def rows() -> list[dict[str, object]]:
    """Every task's JSON row, in TASKS' order."""
    out: list[dict[str, object]] = []
    for number, task in enumerate(TASKS, start=1):
        text, source = file_of(task)
        check(task, text)
        out.append(
            {
                "id": f"edit-{number:02d}-{task.kind}-{task.module.replace('.', '_')}",
                "subtask": SUBTASK,
                "category": task.kind,
                "instruction": task.instruction,
                "file": text,
                "prediction": predicted(text),
                "expected_edit": task.expected_edit,
                "source": source,
                "turns": [prompt_of(task.instruction, text)],
            }
        )
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description="Write the code-edit tasks of draftwise load --edit.")
    parser.add_argument("--out", type=Path, default=OUT, help=f"where to write (default: {OUT})")
    args = parser.parse_args()
    try:
        made = rows()
    except TaskError as exc:
        sys.exit(f"error: {exc}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    with args.out.open("w", encoding="utf-8") as sink:
        for row in made:
            sink.write(json.dumps(row, ensure_ascii=False) + "\n")
    sizes = [len(str(row["file"])) for row in made]
    print(f"{args.out}: {len(made)} tasks, files of {min(sizes)}-{max(sizes)} characters")


if __name__ == "__main__":
    main()
