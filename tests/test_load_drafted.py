"""What each server of the load benchmark drafted: read from llama-server's log and from
draftwise's /metrics, stored with the run and shown beside its speed."""

from __future__ import annotations

import json

from draftwise.loadbench.drafted import Drafted, from_llama_log, from_metrics
from draftwise.loadbench.report import ratio_table, rows_table
from draftwise.loadbench.stats import against_llama

from cli_support import run_cli

# As llama-server writes them: the warm-up (task 0) drafts 3 and keeps 1; task 5 drafts nothing
# (no acceptance line); tasks 6 and 7 draft 24 and 64.
LLAMA_LOG = """\
0.00.006.012 I srv    load_model: loading model 'target.gguf'
0.03.190.120 I slot print_timing: id  3 | task 0 | prompt eval time =    3190.12 ms /    89 tokens
0.03.868.570 I slot print_timing: id  3 | task 0 |        eval time =     678.45 ms /     8 tokens
0.03.868.600 I slot print_timing: id  3 | task 0 | draft acceptance = 0.33333 (    1 accepted /     3 generated)
0.09.100.000 I slot print_timing: id  1 | task 5 | prompt eval time =     847.97 ms /    15 tokens
0.12.100.000 I slot print_timing: id  0 | task 6 | prompt eval time =    2335.66 ms /    60 tokens
0.12.100.010 I slot print_timing: id  0 | task 6 | draft acceptance = 0.50000 (   12 accepted /    24 generated)
0.19.400.000 I slot print_timing: id  2 | task 7 | draft acceptance = 0.93750 (   60 accepted /    64 generated)
0.19.500.000 I srv    operator(): cleaning up before exit...
"""


def test_a_llama_server_log_gives_the_tokens_each_request_drafted_and_kept():
    assert from_llama_log(LLAMA_LOG, skip_first=True) == Drafted(24 + 64, 12 + 60)
    assert from_llama_log(LLAMA_LOG, skip_first=False) == Drafted(3 + 24 + 64, 1 + 12 + 60)
    plain = "\n".join(line for line in LLAMA_LOG.splitlines() if "draft acceptance" not in line)
    assert from_llama_log(plain, skip_first=True) == Drafted(0, 0)  # a configuration that drafted nothing


def test_draftwise_metrics_give_its_draft_tokens_and_others_none():
    page = (
        "# HELP draftwise_draft_tokens_proposed_total draft tokens proposed\n"
        "draftwise_draft_tokens_proposed_total 992.0\n"
        "draftwise_draft_tokens_proposed_created 1.79e+09\n"
        "draftwise_draft_tokens_accepted_total 169.0\n"
        'draftwise_draft_tokens_by_source_total{kept="yes",source="ngram"} 161.0\n'
    )
    assert from_metrics(page) == Drafted(992, 169)
    assert from_metrics(page) - Drafted(900, 100) == Drafted(92, 69)
    assert from_metrics("") is None and from_metrics("llamacpp:prompt_tokens_total 12\n") is None


def _row(server: str, tok_s: float, drafted: dict[str, int] | None) -> dict:
    return {
        "server": server,
        "concurrency": 4,
        "requests": 7,
        "errors": 0,
        "completion_tokens": 640,
        "wall_s": 60.0,
        "tok_s": tok_s,
        "request_tok_s_p50": None,
        "decode_tok_s": None,
        "decode_after_first_chunk_tok_s": None,
        "ttft_p50_s": None,
        "ttft_p95_s": None,
        "latency_p50_s": None,
        "latency_p95_s": None,
        "accepted_prediction_tokens": None,
        "rejected_prediction_tokens": None,
        "compared_to_alone": None,
        "identical_to_alone": None,
        "drafted": drafted,
    }


def test_the_report_says_what_each_server_drafted_and_whether_the_best_llama_server_drafted_at_all():
    rows = [
        _row("draftwise", 10.0, {"proposed": 40, "kept": 30}),
        _row("llama-server", 10.5, None),
        _row("llama-server-ngram-mod", 12.0, {"proposed": 0, "kept": 0}),
    ]
    table = "\n".join(rows_table(rows))
    assert "| draftwise | 4 |" in table and table.count("| 40 (75% kept) |") == 1
    assert "| llama-server-ngram-mod | 4 |" in table and table.splitlines()[-1].endswith("| 0 |")
    ratios = against_llama(rows)
    assert ratios[0]["best"] == "llama-server-ngram-mod" and ratios[0]["best_drafted"] == {"proposed": 0, "kept": 0}
    assert "| 12.0 | 0 | 0.83x |" in "\n".join(ratio_table(ratios))


def test_a_run_records_what_draftwise_drafted_with_and_without_its_drafter(tmp_path):
    """In process, a code edit with its prediction: draftwise drafts (at least its probe of the
    prediction) and keeps at least the prediction's tokens its answer reports; draftwise-off
    drafts nothing."""
    edits = tmp_path / "edits.jsonl"
    code = "def f(x):\n    return x + 1\n\n\ndef g(y):\n    return y * 2\n"
    row = {"id": "e0", "subtask": "code_edit", "turns": [f"Keep it.\n\n```python\n{code}```"]}
    edits.write_text(json.dumps(row | {"prediction": f"```python\n{code}```"}) + "\n")
    out = tmp_path / "run"
    args = ["--target", "tiny:0", "--servers", "draftwise,draftwise-off", "--code", "none", "--data", "none"]
    args += ["--edit", str(edits), "--max-tokens", "16", "--concurrency", "1", "--in-process"]
    done = run_cli("load", *args, "--out", str(out), "--no-progress")
    assert done.returncode == 0, done.stderr
    records = [json.loads(line) for line in (out / "results.jsonl").read_text().splitlines()]
    runs = {r["server"]: r for r in records if r["kind"] == "run"}
    assert runs["draftwise-off"]["drafted"] == {"proposed": 0, "kept": 0}
    requests = [r for r in records if r["kind"] == "request" and r["server"] == "draftwise"]
    accepted = sum(r["accepted_prediction_tokens"] or 0 for r in requests)
    drafted = runs["draftwise"]["drafted"]
    assert drafted["proposed"] > 0 and drafted["proposed"] >= drafted["kept"] >= accepted  # it tried the prediction
    assert "| drafted |" in (out / "report.md").read_text()
