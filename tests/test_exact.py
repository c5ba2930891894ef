"""``--exact`` on llama.cpp: with draftwise's patches on ggml (patches/llama.cpp), a row's
scores are bit-identical whatever else its pass holds, so speculative, chunked and batched
output equals plain one-token decoding, token for token.

Each real-model check runs ``exact_probe.py`` in a process of its own: ggml fixes its kernels
once per process, and this session's other tests run llama.cpp without ``--exact``. The
targets are SmolLM2 as shipped (Q4_1) and a Q4_K_M file made from it with llama.cpp's own
quantizer (repacked Q4_K and tiled-kernel Q6_K weights, the two that rounded by batch size).
"""

from __future__ import annotations

import ctypes
import json
import os
import subprocess
import sys
import tarfile
from pathlib import Path
from typing import Any

import pytest

from draftwise.backends import llamacpp
from draftwise.backends.llamacpp_kernels import PatchSwitches
from draftwise.registry import REGISTRY, model_path

from real_support import (
    ROOT,
    SMOL,
    built_llama_cpp_bin,
    llama_cpp_missing,
    missing,
    needs,
    needs_smol_on_llama_cpp,
)

PROBE = Path(__file__).with_name("exact_probe.py")
Q4_K_M = 15  # llama.cpp's LLAMA_FTYPE_MOSTLY_Q4_K_M
pytestmark = [pytest.mark.slow]


def _patched_llama_cpp_missing() -> str | None:
    missing = llamacpp.library().missing_row_invariance()
    return f"{missing} (make setup builds it)" if missing else None


needs_patched = needs(llama_cpp_missing, _patched_llama_cpp_missing)


@pytest.fixture(scope="module")
def smol() -> Path:
    return model_path(REGISTRY[SMOL])


@pytest.fixture(scope="module")
def smol_q4_k(tmp_path_factory: pytest.TempPathFactory, smol: Path) -> Path:
    """SmolLM2 requantized to Q4_K_M by llama.cpp's quantizer (its widths that are not a
    multiple of 256 fall back to other types, as in any Q4_K_M file of such a model)."""
    out = tmp_path_factory.mktemp("exact") / "smollm2-q4_k_m.gguf"
    api = llamacpp.library().api
    params = api.llama_model_quantize_default_params()
    params.nthread, params.ftype, params.allow_requantize = 2, Q4_K_M, True
    assert api.llama_model_quantize(str(smol).encode(), str(out).encode(), ctypes.byref(params)) == 0
    return out


def _probe(name: str, target: Path, draft: Path, threads: int = 2, env: dict[str, str] | None = None) -> dict[str, Any]:
    command = [sys.executable, str(PROBE), name, str(target), str(draft), str(threads)]
    environment = {**os.environ, **(env or {})}
    done = subprocess.run(command, capture_output=True, text=True, timeout=1200, cwd=ROOT, env=environment)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@needs_smol_on_llama_cpp
@needs_patched
# Each file type and each thread count once (a pairwise cover, not all four pairs): a probe is
# mostly its 2,000-token prefill under --exact, the longest part of the suite.
@pytest.mark.parametrize(("file", "threads"), [("q4_k_m", 2), pytest.param("shipped", 1, marks=pytest.mark.one_core)])
def test_a_positions_scores_are_the_same_alone_and_in_blocks_of_2_to_16(request, smol, file, threads):
    target = request.getfixturevalue("smol_q4_k") if file == "q4_k_m" else smol
    result = _probe("rows", target, smol, threads)
    assert result["compared"] == 3 * sum(range(2, 17))
    assert result["differences"] == []


@needs_smol_on_llama_cpp
@needs_patched
def test_greedy_speculative_output_is_plain_output_on_long_prompts(smol, smol_q4_k):
    result = _probe("speculative", smol_q4_k, smol)
    assert result == {"compared": 6, "differences": []}


@needs_smol_on_llama_cpp
@needs_patched
def test_output_does_not_depend_on_the_prefill_chunk_size(smol_q4_k, smol):
    assert _probe("chunks", smol_q4_k, smol) == {"compared": 2, "differences": []}


@needs_smol_on_llama_cpp
@needs_patched
def test_a_reused_prompt_start_scores_as_a_fresh_prefill(smol_q4_k, smol):
    assert _probe("reuse", smol_q4_k, smol) == {"compared": 4, "differences": []}


@needs_smol_on_llama_cpp
@needs_patched
def test_batched_streams_give_what_each_gives_alone(smol_q4_k, smol):
    assert _probe("batched", smol_q4_k, smol) == {"compared": 4, "differences": []}


@needs_smol_on_llama_cpp
@needs_patched
def test_a_sequence_rounds_as_alone_when_another_frees_cells_below_it(smol_q4_k, smol):
    assert _probe("holes", smol_q4_k, smol) == {"compared": 8, "differences": []}
    # the probe can tell: with llama.cpp's usual cell search the rows land in the freed cells
    assert _probe("holes-unordered", smol_q4_k, smol)["differences"] != []


# --- what --exact refuses ---------------------------------------------------------------------


def test_a_llama_cpp_without_the_patches_is_named(monkeypatch):
    class Stock:  # a libllama with no switches of draftwise's patches
        ggml_cpu_row_invariant = None

    assert PatchSwitches.of(Stock()) is None  # type: ignore[arg-type]
    monkeypatch.setattr(llamacpp.library(), "switches", None)
    missing = llamacpp.library().missing_row_invariance()
    assert missing is not None and "built without draftwise's patches" in missing


@needs_smol_on_llama_cpp
@needs_patched
@pytest.mark.parametrize(
    ("probe", "env", "invariant", "ordered"),
    [
        ("switches", {}, False, True),  # cells in order always
        ("switches", {"LLAMA_KV_ORDERED": "0"}, False, False),  # unless the user says not
        ("switches-exact", {"LLAMA_KV_ORDERED": "0"}, True, True),  # which --exact overrides
    ],
)
def test_a_load_sets_the_patches_switches_and_writes_no_environment(smol, probe, env, invariant, ordered):
    result = _probe(probe, smol, smol, env=env)
    assert result == {"row_invariant": invariant, "kv_ordered": ordered, "environment": []}


@needs_smol_on_llama_cpp
@needs_patched
@pytest.mark.one_core
def test_exact_is_fixed_per_process_and_refuses_file_types_it_does_not_cover(smol, tmp_path):
    script = (
        "import sys\n"
        "from pathlib import Path\n"
        "from draftwise.backends.llamacpp import load_llamacpp\n"
        "from draftwise.config import ModelOptions\n"
        "from draftwise.errors import ModelLoadError\n"
        "path = Path(sys.argv[1])\n"
        "load_llamacpp('smol', path, ModelOptions(threads=1, context=256, exact=True), draft=True)\n"
        "for exact in (False, True):\n"
        "    try:\n"
        "        load_llamacpp('smol', path, ModelOptions(threads=1, context=256, exact=exact))\n"
        "        print('loaded')\n"
        "    except ModelLoadError as exc:\n"
        "        print(exc)\n"
    )
    q4_0 = llamacpp.requantized(smol, "int4", 2, lambda note: None)  # Q4_0: repacked, not covered
    done = subprocess.run([sys.executable, "-c", script, str(q4_0)], capture_output=True, text=True, timeout=300)
    lines = done.stdout.strip().splitlines()
    assert "already runs llama.cpp with --exact" in lines[0]
    assert "holds Q4_0 weights" in lines[1] and "drop --exact" in lines[1]


# --- the patch set ------------------------------------------------------------------------------


def _sdist() -> Path | None:
    found = sorted((built_llama_cpp_bin().parents[1] / "sdist").glob("llama_cpp_python-*.tar.gz"))
    return found[0] if found else None


def test_the_patches_apply_to_the_pinned_llama_cpp_once(tmp_path):
    sdist = _sdist()
    if sdist is None:
        missing("no llama-cpp-python sdist under build/: run `make llama-cpp-bin`")
    with tarfile.open(sdist) as archive:
        folders = ("ggml", "src", "include")
        members = [m for m in archive.getmembers() if any(f"/vendor/llama.cpp/{d}/" in m.name for d in folders)]
        archive.extractall(tmp_path, members=members, filter="data")
    tree = next(tmp_path.glob("*/vendor/llama.cpp"))
    script = ROOT / "scripts" / "patch_llama_cpp.sh"
    assert subprocess.run([str(script), str(tree)], capture_output=True, text=True).returncode == 0
    assert "draftwise" in (tree / "ggml/src/ggml-cpu/ops.cpp").read_text()
    assert "LLAMA_KV_ORDERED" in (tree / "src/llama-kv-cache.cpp").read_text()
    assert "llama_kv_set_ordered" in (tree / "include/llama.h").read_text()
    again = subprocess.run([str(script), str(tree)], capture_output=True, text=True)
    assert again.returncode == 1
    assert again.stderr.strip().count("\n") == 0 and "0001-" in again.stderr and "does not apply" in again.stderr
