"""Every script in scripts/ still runs against today's code, at least as far as its ``--help``:
its imports resolve and its arguments parse. A script that no longer runs is deleted, not kept
(git history keeps it); a measurement worth repeating belongs in the CLI.

The llama.cpp install scripts run in ``make setup`` and in tests/test_install.py and
tests/test_exact.py; here they only have to parse, as do the ``llama-bench`` command files kept
with their records in benchmarks/, which holds no Python."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPTS = ROOT / "scripts"
HELPERS = {"local_server.py"}  # imported by the scripts, not run
PYTHON_SCRIPTS = sorted(p.name for p in SCRIPTS.glob("*.py") if p.name not in HELPERS)
SHELL_SCRIPTS = sorted(str(p.relative_to(ROOT)) for p in [*SCRIPTS.glob("*.sh"), *(ROOT / "benchmarks").rglob("*.sh")])


def _env() -> dict[str, str]:
    src = str(ROOT / "src")
    path = os.environ.get("PYTHONPATH")
    return {**os.environ, "PYTHONPATH": f"{src}{os.pathsep}{path}" if path else src}


def test_there_are_scripts_to_check():
    assert PYTHON_SCRIPTS and SHELL_SCRIPTS


@pytest.mark.parametrize("name", PYTHON_SCRIPTS)
def test_a_script_answers_help(name: str) -> None:
    done = subprocess.run(
        [sys.executable, str(SCRIPTS / name), "--help"], capture_output=True, text=True, env=_env(), timeout=120
    )
    assert done.returncode == 0, f"scripts/{name} --help: exit {done.returncode}\n{done.stderr[-2000:]}"
    assert "usage:" in done.stdout, done.stdout


@pytest.mark.parametrize("path", SHELL_SCRIPTS)
def test_a_shell_script_parses(path: str) -> None:
    done = subprocess.run(["bash", "-n", str(ROOT / path)], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr


def test_the_helper_module_imports() -> None:
    done = subprocess.run(
        [sys.executable, "-c", "import local_server; print(local_server.free_port())"],
        capture_output=True,
        text=True,
        cwd=SCRIPTS,
        env=_env(),
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    assert int(done.stdout) > 0


def test_benchmarks_hold_no_python_scripts() -> None:
    assert sorted(str(p.relative_to(ROOT)) for p in (ROOT / "benchmarks").rglob("*.py")) == []
