"""The real-model gates themselves (``real_support``): they skip on a developer's machine and
fail under ``DRAFTWISE_STRICT_TESTS=1``, so that CI cannot pass on tests that never ran."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path
from xml.etree import ElementTree

import pytest

import real_support
from real_support import BIN_ENV, STRICT_ENV, llama_cpp_bin, missing, require, require_module

TESTS = Path(__file__).resolve().parent

# A suite of its own, run in a child pytest with this folder's conftest.py: one test per road
# to a skip, and a module whose test extra is missing.
GATED = """
import pytest
from real_support import needs

@needs(lambda: "the model is away")
def test_gated():
    pass

@pytest.mark.slow
def test_slow_skip():
    pytest.skip("no model here")

def test_plain_skip():
    pytest.skip("nothing to do with a model")

@pytest.mark.slow
@pytest.mark.xfail(reason="known")
def test_slow_xfail():
    assert False

@needs(lambda: None)
def test_present():
    pass
"""
MISSING_EXTRA = 'from real_support import require_module\nrequire_module("no_such_module_draftwise")\n'


def test_a_missing_part_skips_by_default(monkeypatch):
    monkeypatch.delenv(STRICT_ENV, raising=False)
    with pytest.raises(pytest.skip.Exception, match="the model is away"):
        missing("the model is away")


def test_a_missing_part_fails_under_strict_mode(monkeypatch):
    monkeypatch.setenv(STRICT_ENV, "1")
    with pytest.raises(pytest.fail.Exception, match=f"{STRICT_ENV}=1 .*the model is away"):
        missing("the model is away")


def test_require_stops_at_the_first_missing_part_and_passes_when_all_are_there(monkeypatch):
    monkeypatch.setenv(STRICT_ENV, "1")
    require(lambda: None, lambda: None)
    with pytest.raises(pytest.fail.Exception, match="first"):
        require(lambda: None, lambda: "first", lambda: "second")
    with pytest.raises(pytest.fail.Exception, match="no_such_module_draftwise is not installed"):
        require_module("no_such_module_draftwise")
    assert require_module("json").dumps(1) == "1"


def test_llama_cpp_programs_come_from_the_environment_or_the_build_folder(monkeypatch, tmp_path):
    monkeypatch.setenv(BIN_ENV, str(tmp_path))
    assert llama_cpp_bin() == tmp_path
    assert real_support.llama_program_missing("llama-server")() is not None
    (tmp_path / "llama-server").write_text("")
    assert real_support.llama_program_missing("llama-server")() is None
    monkeypatch.delenv(BIN_ENV)
    # What scripts/build_llama_cpp.sh prints: build/llama-cpp-VERSION/build/bin, VERSION pinned.
    pin = re.search(r"^llama-cpp-python==(\S+)", (real_support.ROOT / "constraints.txt").read_text(), re.MULTILINE)
    assert pin is not None
    assert llama_cpp_bin() == real_support.ROOT / "build" / f"llama-cpp-{pin.group(1)}" / "build" / "bin"


def _outcomes(folder: Path, strict: bool) -> tuple[int, dict[str, str]]:
    """Runs the suite in ``folder``: its exit status and each test's outcome, read from JUnit XML
    (a skipped or failed collection is a test case named after its module)."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(TESTS), os.environ.get("PYTHONPATH", "")])}
    env[STRICT_ENV] = "1" if strict else "0"
    xml = folder / "report.xml"
    args = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--continue-on-collection-errors"]
    args += ["--rootdir", str(folder), f"--junitxml={xml}", str(folder)]
    status = subprocess.run(args, cwd=folder, env=env, capture_output=True, timeout=300).returncode
    outcomes = {}
    for case in ElementTree.parse(xml).iter("testcase"):
        found = [child for child in case if child.tag in ("skipped", "failure", "error")]
        outcome = found[0].tag if found else "passed"
        outcomes[case.get("name", "")] = "xfail" if found and found[0].get("type") == "pytest.xfail" else outcome
    return status, outcomes


def test_strict_mode_turns_every_real_model_skip_into_a_failure(tmp_path):
    shutil.copy(TESTS / "conftest.py", tmp_path / "conftest.py")
    (tmp_path / "pytest.ini").write_text("[pytest]\nmarkers =\n    slow\n    needs\n")
    (tmp_path / "test_gated.py").write_text(GATED)
    (tmp_path / "test_extra.py").write_text(MISSING_EXTRA)
    status, relaxed = _outcomes(tmp_path, strict=False)
    assert status == 0, relaxed
    assert relaxed == {
        "test_gated": "skipped",
        "test_slow_skip": "skipped",
        "test_plain_skip": "skipped",
        "test_slow_xfail": "xfail",
        "test_present": "passed",
        "test_extra": "skipped",
    }
    status, strict = _outcomes(tmp_path, strict=True)
    assert status == 1, strict
    assert strict == {
        "test_gated": "error",  # the gate runs at setup, before any fixture loads the model
        "test_slow_skip": "failure",
        "test_plain_skip": "skipped",  # not a real-model test: strict mode leaves it alone
        "test_slow_xfail": "xfail",
        "test_present": "passed",
        "test_extra": "error",  # a collection error
    }
