"""The install files a new user's `make setup` reads: constraints.txt and the llama.cpp scripts."""

import re
import subprocess
from pathlib import Path

import pytest

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


def _fake_tools(folder: Path, gpu: str | None) -> Path:
    """A folder of stand-ins for nvcc and nvidia-smi: nvidia-smi lists one GPU of compute
    capability ``gpu`` ("9.0"), or none (exits 6, as with no driver) when it is None."""
    folder.mkdir()
    (folder / "nvcc").write_text("#!/bin/sh\necho 'Cuda compilation tools, release 13.0'\n")
    if gpu is None:
        smi = "#!/bin/sh\nexit 6\n"
    else:
        smi = f'#!/bin/sh\ncase "$*" in *compute_cap*) echo "{gpu}" ;; *) echo "GPU 0: NVIDIA H100 (UUID: x)" ;; esac\n'
    (folder / "nvidia-smi").write_text(smi)
    for tool in folder.iterdir():
        tool.chmod(0o755)
    return folder


def _head_of(script: str, last_line_prefix: str, show: str, env: dict[str, str]) -> subprocess.CompletedProcess:
    """Run ``script``'s lines before the first that starts with ``last_line_prefix``, then
    print ``show``: the script's own set-up, without the build that follows it."""
    lines = (ROOT / "scripts" / script).read_text().splitlines()
    head = "\n".join(lines[: next(i for i, ln in enumerate(lines) if ln.startswith(last_line_prefix))])
    head = head.replace('"$(dirname "$0")/.."', f'"{ROOT}"').replace('"$(dirname "${BASH_SOURCE[0]}")/.."', f'"{ROOT}"')
    return subprocess.run(
        ["bash", "-c", f"{head}\nprintf '%s' \"{show}\"", "install", "/nowhere/bin"],
        capture_output=True,
        text=True,
        env=env,
    )


def _backend(tmp_path: Path, gpu: str | None, nvcc: bool = True, **settings: str) -> subprocess.CompletedProcess:
    tools = _fake_tools(tmp_path / "tools", gpu)
    if not nvcc:
        (tools / "nvcc").unlink()
    env = {"PATH": f"{tools}:/usr/bin:/bin", "HOME": str(tmp_path), **settings}
    return subprocess.run(
        [
            "bash",
            "-c",
            f'set -euo pipefail; source "{ROOT}/scripts/llama_cpp_backend.sh"; '
            'printf "%s|%s" "$llama_cpp_backend" "$llama_cpp_cmake_args"',
        ],
        capture_output=True,
        text=True,
        env=env,
    )


@pytest.mark.parametrize(
    ("gpu", "nvcc", "settings", "expected"),
    [
        ("9.0", True, {}, "cuda90|-DGGML_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=90"),
        (None, True, {}, "cpu|"),  # nvcc without a GPU (this project's CPU machines ship nvcc)
        ("9.0", False, {}, "cpu|"),
        ("9.0", True, {"DRAFTWISE_CUDA": "0"}, "cpu|"),
        (None, True, {"DRAFTWISE_CUDA": "1"}, "cudanative|-DGGML_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=native"),
        ("9.0", True, {"DRAFTWISE_CUDA_ARCH": "89"}, "cuda89|-DGGML_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=89"),
    ],
)
def test_llama_cpp_is_built_for_cuda_where_nvcc_and_a_gpu_are_or_when_asked(tmp_path, gpu, nvcc, settings, expected):
    done = _backend(tmp_path, gpu, nvcc, **settings)
    assert done.returncode == 0, done.stderr
    assert done.stdout == expected


@pytest.mark.parametrize(
    ("setting", "message"),
    [("1", "DRAFTWISE_CUDA=1 builds llama.cpp for CUDA, but nvcc is not on the path"), ("yes", "is 1 (build for")],
)
def test_a_cuda_build_that_cannot_be_made_is_one_line(tmp_path, setting, message):
    done = _backend(tmp_path, "9.0", nvcc=False, DRAFTWISE_CUDA=setting)
    assert done.returncode == 2 and done.stdout == ""
    assert done.stderr.startswith("error: ") and message in done.stderr and done.stderr.count("\n") == 1


def test_the_cached_wheel_and_the_programs_folder_name_their_backend(tmp_path):
    env = {"PATH": f"{_fake_tools(tmp_path / 'tools', '9.0')}:/usr/bin:/bin", "HOME": str(tmp_path)}
    cuda = _head_of("install_llama_cpp.sh", "if ! ls", "$wheels", env)
    cpu = _head_of("install_llama_cpp.sh", "if ! ls", "$wheels", {**env, "DRAFTWISE_CUDA": "0"})
    assert cuda.returncode == cpu.returncode == 0, cuda.stderr + cpu.stderr
    assert re.fullmatch(
        rf"{tmp_path}/.cache/draftwise/wheels/llama-cpp-python-[\d.]+-cuda90-[0-9a-f]{{12}}", cuda.stdout
    )
    assert cpu.stdout == cuda.stdout.replace("-cuda90-", "-cpu-")
    programs = _head_of("build_llama_cpp.sh", "bin=", "$work", env)
    assert programs.returncode == 0, programs.stderr
    assert programs.stdout == f"{ROOT}/build/llama-cpp-{dict(_pins())['llama-cpp-python']}-cuda90"
