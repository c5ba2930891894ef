"""The install files a new user's `make setup` reads: constraints.txt and the llama.cpp scripts."""

import re
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _pins() -> list[tuple[str, str]]:
    lines = (ROOT / "constraints.txt").read_text().splitlines()
    pins = [line.split("==") for line in lines if line.strip() and not line.startswith("#")]
    return [(name.strip().lower(), version.strip()) for name, version in pins]


def test_constraints_pin_each_package_once():
    names = [name for name, _ in _pins()]
    assert sorted({n for n in names if names.count(n) > 1}) == []


def test_scripts_read_one_llama_cpp_version():
    # A duplicated pin once made the install script pass "0.3.36\n0.3.36" to pip.
    expected = dict(_pins())["llama-cpp-python"]
    for script in ("install_llama_cpp.sh", "build_llama_cpp.sh"):
        line = next(ln for ln in (ROOT / "scripts" / script).read_text().splitlines() if ln.startswith("version="))
        command = f'here="{ROOT}"; root="{ROOT}"; {line}; printf %s "$version"'
        out = subprocess.run(["bash", "-c", command], capture_output=True, text=True, check=True)
        assert out.stdout == expected, script
        assert re.fullmatch(r"\d+\.\d+\.\d+", out.stdout)
