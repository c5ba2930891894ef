"""The device check's own parts, on the CPU: the random models it makes (scripts/random_gguf.py)
load and run on llama.cpp, and what scripts/cuda_check.py makes of the load bench's records
(edit tasks, the greedy comparison, the goals' ratios) is right in closed form. The check as a
whole is rehearsed on the CPU with a CPU pack (its docstring)."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

from cli_support import run_cli
from real_support import SMOL, needs_smol_on_llama_cpp

ROOT = Path(__file__).resolve().parents[1]


def _script(name: str):
    spec = importlib.util.spec_from_file_location(name, ROOT / "scripts" / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # a dataclass finds its module's names there
    spec.loader.exec_module(module)
    return module


check = _script("cuda_check")


@pytest.mark.slow
@needs_smol_on_llama_cpp
def test_a_random_model_walks_as_built_and_a_draft_of_the_same_walk_is_right(tmp_path):
    import gguf

    from draftwise import GenerationConfig, autoregressive
    from draftwise.config import ModelOptions
    from draftwise.loading import load_lm
    from draftwise.registry import REGISTRY, model_path

    random_gguf = _script("random_gguf")
    vocab = str(model_path(REGISTRY[SMOL]))
    target, draft = tmp_path / "target.gguf", tmp_path / "draft.gguf"
    assert random_gguf.main(["--vocab", vocab, "--shape", "tiny", "--out", str(target)]) == 0
    assert random_gguf.main(["--vocab", vocab, "--shape", "tiny", "--out", str(draft), "--seed", "1"]) == 0
    fields = gguf.GGUFReader(str(target)).fields
    assert fields["qwen2.block_count"].contents() == random_gguf.SHAPES["tiny"].layers
    lm = load_lm(str(target), ModelOptions(backend="llamacpp", threads=1, context=256))
    # The answer ends at the chat template's end of turn, as in the real files.
    (end,) = lm.tokenizer.encode(random_gguf.END_OF_TURN, add_special_tokens=False)
    assert fields["tokenizer.ggml.eos_token_id"].contents() == end and end in lm.eos_token_ids

    prompt = lm.tokenizer.encode("def fib(n):", add_special_tokens=False)
    out = autoregressive(lm).generate(prompt, GenerationConfig(max_new_tokens=24, ignore_eos=True)).tokens
    walk = random_gguf.walk(fields["tokenizer.ggml.tokens"].contents(), 0, 1.0)
    assert out == [int(walk[t]) for t in [prompt[-1], *out[:-1]]]  # each token follows the last, as built
    assert lm.tokenizer.encode(lm.tokenizer.decode(out), add_special_tokens=False) == out  # text gives it back

    argv = ["generate", "--target", str(target), "--draft", str(draft), "--drafter", "model", "--threads", "1"]
    done = run_cli(*argv, "--k-policy", "fixed", "--k", "4", "--max-new-tokens", "32", "--ignore-eos", "--json", "hi")
    assert done.returncode == 0, done.stderr[-2000:]
    metrics = json.loads(done.stdout.strip().splitlines()[-1])["metrics"]
    assert metrics["proposed"] >= 16 and metrics["accepted"] >= 0.9 * metrics["proposed"]


def test_a_file_without_a_tokenizer_is_refused_in_one_line(tmp_path):
    script = ROOT / "scripts" / "random_gguf.py"
    argv = [sys.executable, str(script), "--vocab", str(tmp_path / "none.gguf"), "--shape", "tiny", "--out", "x"]
    done = subprocess.run(argv, capture_output=True, text=True)
    assert done.returncode == 2 and done.stderr == f"error: no file {tmp_path / 'none.gguf'}\n"


def test_the_edit_predicts_the_plain_answer_with_a_quarter_cut_from_its_middle():
    task = check.edit_task({"id": "a", "prompt": "say a"}, "0123456789abcdef")
    assert task == {"id": "a-edited", "subtask": "edited", "prompt": "say a", "prediction": "012345abcdef"}


def test_the_load_prompts_are_sixteen_and_each_ends_with_a_word_of_its_own():
    prompts = check.load_prompts(ROOT / "benchmarks" / "data")
    assert len(prompts) == 16 and len({p["id"] for p in prompts}) == 16
    assert len({p["prompt"].rsplit("\n", 1)[1] for p in prompts}) == 16


def _request(server: str, level: int, prompt: str, text: str, ok: bool = True) -> dict:
    return {"kind": "request", "server": server, "concurrency": level, "prompt_id": prompt, "text": text, "ok": ok}


def test_draftwise_answers_are_compared_with_its_own_plain_answer_to_the_same_prompt():
    records = [
        _request("draftwise-off", 1, "p", "x"),
        _request("draftwise-off", 1, "q", "y"),
        _request("draftwise", 1, "p", "x"),
        _request("draftwise", 1, "q", "z"),
        _request("draftwise", 4, "p", "x"),
        _request("draftwise", 4, "q", "?", ok=False),
        _request("llama-server", 1, "p", "w"),
        {"kind": "run", "server": "draftwise"},
    ]
    assert check.same_as_plain(records) == {
        "draftwise-off@1": {"compared": 2, "identical": 2},
        "draftwise@1": {"compared": 2, "identical": 1},
        "draftwise@4": {"compared": 1, "identical": 1},
    }


def test_the_goals_are_ratios_against_llama_servers_best_configuration_in_the_same_run():
    def row(server: str, level: int, tok_s: float, decode: float) -> dict:
        return {"server": server, "concurrency": level, "tok_s": tok_s, "decode_tok_s": decode}

    load = [
        row("draftwise-off", 1, 90, 100),
        row("llama-server", 1, 100, 125),
        row("draftwise", 4, 300, 0),
        row("llama-server", 4, 200, 0),
        row("llama-server-ngram-mod", 4, 250, 0),
    ]
    edit = [row("draftwise", 1, 0, 900), row("llama-server-ngram-simple", 1, 0, 300), row("draftwise-off", 1, 0, 99)]
    same = {"draftwise@1": {"compared": 4, "identical": 3}}
    steps = {
        "load": {"result": {"summary": load, "same_as_plain": same}},
        "edit": {"result": {"summary": edit, "same_as_plain": same}},
    }
    assert check.goals({"steps": steps}) == {
        "plain_vs_llama_server_c1": 0.8,
        "edit_decode_vs_llama_server_best": 3.0,
        "c4_vs_llama_server_best": 1.2,
        "identical_to_plain": "6/8",
    }
    assert check.goals({"steps": {}})["plain_vs_llama_server_c1"] is None  # a step that never ran


def test_the_check_without_a_pack_and_the_pack_for_an_unknown_backend_are_one_line(tmp_path):
    argv = [sys.executable, str(ROOT / "scripts" / "cuda_check.py"), "--pack", str(tmp_path), "--out", "x.json"]
    done = subprocess.run(argv, capture_output=True, text=True)
    assert done.returncode == 2 and done.stderr.startswith("error: ") and done.stderr.count("\n") == 1
    pack = subprocess.run(
        [str(ROOT / "scripts" / "cuda_check_pack.sh"), str(tmp_path), "rocm"], capture_output=True, text=True
    )
    assert pack.returncode == 2 and pack.stderr == "error: the backend is cuda or cpu, not 'rocm'\n"
