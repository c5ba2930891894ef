"""The dashboard's logic: stream chunks -> tokens and steps, HTML, chart tables, requests, bench reports.

Hand-made chunks pin the parsing rules; a live tiny API server checks the same parsing on
the real stream against the engine's own step events.
"""

from __future__ import annotations

import json
import socket
from pathlib import Path

import pytest

pytest.importorskip("pandas")
pytest.importorskip("fastapi")

from draftwise.config import DraftConfig, GenerationConfig, SamplingConfig
from draftwise.dashboard import charts
from draftwise.dashboard.client import ApiClient, DashboardApiError, RunRequest
from draftwise.dashboard.live import LiveRun, compare
from draftwise.dashboard.render import legend_html, token_title, tokens_html, visible
from draftwise.dashboard.report import ReportError, load_bench, method_table, record_table
from draftwise.drafters import ModelDrafter
from draftwise.engine import SpeculativeEngine
from draftwise.target import LocalTarget

from dashboard_support import FIXED, MODEL, live_api, tiny_bench

PROMPT = "Once upon a time"


def _token(id_: int, text: str, source: str, **extra) -> dict:
    return {
        "id": id_,
        "text": text,
        "source": source,
        "draft_prob": None,
        "target_prob": None,
        "rejected": None,
        **extra,
    }


def _step(index: int, k: int, proposed: list[tuple[int, str]], n_accepted: int) -> dict:
    return {
        "index": index,
        "k": k,
        "n_accepted": n_accepted,
        "prefill_seconds": 0.5 if index == 0 else 0.0,
        "draft_seconds": 0.01,
        "verify_seconds": 0.02,
        "step_seconds": 0.04,
        "proposed": [
            {"id": i, "text": t, "draft_prob": 0.9, "target_prob": 0.1 * (n + 1)} for n, (i, t) in enumerate(proposed)
        ],
    }


def _chunks() -> list[dict]:
    """Three target passes: a correction after one accepted token (two proposals thrown away),
    a fully accepted block with its bonus, then a step from a server that sends no ``step``."""
    return [
        {
            "choices": [{"text": "a<", "finish_reason": None}],
            "provenance": [_token(10, "a", "accepted", draft_prob=0.9, target_prob=0.8), _token(11, "<", "corrected")],
            "step": _step(0, 4, [(10, "a"), (20, "x"), (21, "y")], 1),
        },
        {
            "choices": [{"text": "bc\x07", "finish_reason": None}],
            "provenance": [
                _token(12, "b", "accepted", draft_prob=0.7, target_prob=0.6),
                _token(13, "c", "accepted", draft_prob=0.5, target_prob=0.9),
                _token(7, "\x07", "bonus"),
            ],
            "step": _step(1, 2, [(12, "b"), (13, "c")], 2),
        },
        {
            "choices": [{"text": "d", "finish_reason": None}],
            "provenance": [_token(14, "d", "corrected", rejected={"id": 30, "draft_prob": 0.4, "target_prob": 0.05})],
        },
        {"choices": [{"text": "", "finish_reason": "length"}], "speculative": {"tokens_per_second": 42.0}},
    ]


def _run() -> LiveRun:
    run = LiveRun(drafter="model")
    for at, chunk in zip((0.6, 0.7, 0.8, 0.8), _chunks(), strict=True):
        run.add_chunk(chunk, at)
    return run


def test_chunks_become_tokens_and_steps() -> None:
    run = _run()
    assert run.text == "a<bc\x07d" and run.finish_reason == "length"
    assert [t.source for t in run.tokens] == ["accepted", "corrected", "accepted", "accepted", "bonus", "corrected"]
    assert [t.step for t in run.tokens] == [0, 0, 1, 1, 1, 2]
    assert [(s.k, s.proposed, s.accepted, s.emitted) for s in run.steps] == [
        (4, 3, 1, 2),
        (2, 2, 2, 3),
        (None, 1, 0, 1),
    ]
    correction = run.tokens[1]
    # The target rejected "x" (judged); "y" came after the rejection and was thrown away unjudged.
    assert [(d.text, d.checked) for d in correction.rejected] == [("x", True), ("y", False)]
    assert correction.rejected[0].target_prob == pytest.approx(0.2)
    # Without ``step`` only the first rejected proposal is known, and without its text.
    assert [(d.id, d.text) for d in run.tokens[5].rejected] == [(30, None)]
    assert (run.passes, run.proposed, run.accepted) == (3, 6, 3)
    assert run.acceptance_rate == pytest.approx(0.5)
    assert run.tokens_per_second == 42.0  # the engine's rate, once the server reported it
    assert run.wall_rate == pytest.approx(6 / 0.8)
    assert run.steps[0].engine_seconds == pytest.approx(0.54)


def test_html_colours_strikes_and_escapes() -> None:
    run = _run()
    page = tokens_html(run)
    for source in ("accepted", "corrected", "bonus"):
        assert f'class="dw-tok dw-{source}"' in page
    assert page.count('class="dw-rejected"') == 3
    # The rejected proposals sit right before the correction that replaced them.
    assert page.index(">x</span>") < page.index(">y</span>") < page.index("&lt;</span>")
    assert "\x07" not in page and "\u2407" in page  # control characters drawn visibly
    assert "#30" in page  # a rejected proposal without text shows its id
    assert "draft q=0.900, target p=0.800" in token_title(run.tokens[0])
    assert "replaced draft token 20 (draft q=0.900, target p=0.200)" in token_title(run.tokens[1])
    assert visible('"<&>') == "&quot;&lt;&amp;&gt;"
    legend = legend_html()
    assert all(word in legend for word in ("accepted draft token", "target correction", "bonus token", "rejected"))
    assert "press Generate" in tokens_html(LiveRun("model"), "press Generate")


def test_chart_tables() -> None:
    run = _run()
    steps = charts.per_step(run)
    assert list(steps.index) == [1, 2, 3]
    assert list(steps["accepted"]) == [1, 2, 0] and steps["k"].isna().tolist() == [False, False, True]
    position = charts.acceptance_by_position(run)
    # Position 1 was reached by all three steps and kept twice; 2 by two steps, kept once; 3 once, never kept.
    assert list(position["proposals"]) == [3, 2, 1]
    assert list(position["acceptance"]) == pytest.approx([2 / 3, 1 / 2, 0.0])
    passes = charts.tokens_vs_passes(run)
    assert list(passes["speculative"]) == [2, 5, 6] and list(passes["plain decoding"]) == [1, 2, 3]
    # The third step came without timings: the running rate falls back to arrival times.
    assert list(charts.running_rate(run)["tokens/s"]) == pytest.approx([2 / 0.6, 5 / 0.7, 6 / 0.8])
    timed = LiveRun(drafter="model")
    for chunk in _chunks()[:2]:
        timed.add_chunk(chunk, 9.0)  # arrival times do not matter once the engine's clock is known
    rate = charts.running_rate(timed)
    assert rate.index.name == "engine seconds" and list(rate.index) == pytest.approx([0.54, 0.58])
    assert list(rate["tokens/s"]) == pytest.approx([2 / 0.54, 5 / 0.58])
    assert timed.tokens_per_second == pytest.approx(5 / 0.58)  # before the server's final statistics


def test_the_policys_reasons_per_step() -> None:
    run = _run()
    assert charts.policy_view(run)["arm taken"].isna().all()  # these steps carry no arms
    why = LiveRun(drafter="hybrid")
    arms = [
        {"source": "model", "k": 4, "tokens_per_second": 22.5},
        {"source": "plain", "k": 0, "tokens_per_second": 15.9},
    ]
    why.add_chunk({"provenance": [_token(1, "a", "bonus")], "step": {**_step(0, 4, [], 0), "arms": arms}}, 0.1)
    plain_first = [{"source": "plain", "k": 0, "tokens_per_second": 34.5}]
    why.add_chunk({"provenance": [_token(2, "b", "bonus")], "step": {**_step(1, 0, [], 0), "arms": plain_first}}, 0.2)
    frame = charts.policy_view(why)
    assert list(frame["arm taken"]) == [22.5, 34.5] and list(frame["plain decoding"]) == [15.9, 34.5]


def test_compare_runs() -> None:
    spec, plain = _run(), LiveRun(drafter="off")
    for i, token in enumerate(spec.tokens):
        plain.add_chunk({"provenance": [_token(token.id, token.text, "bonus")]}, 0.5 * (i + 1))
    result = compare(spec, plain)
    assert result.identical and result.first_difference is None
    assert result.speedup == pytest.approx(42.0 / plain.wall_rate)
    plain.tokens[3].id = 99
    assert compare(spec, plain).first_difference == 3


def test_request_body_and_one_line_errors() -> None:
    request = RunRequest.build(
        prompt="hi",
        chat=True,
        drafter="ngram",
        k_policy="fixed",
        k=3,
        k_max=12,
        confidence_threshold=0.0,
        temperature=0.7,
        seed=5,
        max_tokens=16,
    )
    body = request.body("m")
    assert body["messages"] == [{"role": "user", "content": "hi"}] and "prompt" not in body
    assert body["speculative"] == {
        "drafter": "ngram",
        "provenance": True,
        "cache_prompt": False,
        "k_policy": "fixed",
        "k": 3,
        "k_max": 12,
        "confidence_threshold": 0.0,
    }
    assert (body["seed"], body["temperature"], body["max_tokens"], body["stream"]) == (5, 0.7, 16, True)
    assert request.body("m", drafter="off")["speculative"]["drafter"] == "off"
    with pytest.raises(DashboardApiError, match=r"invalid drafting settings: k \(9\) must not exceed k_max \(4\)"):
        RunRequest.build(
            prompt="hi",
            chat=False,
            drafter="model",
            k_policy="heuristic",
            k=9,
            k_max=4,
            confidence_threshold=0.5,
            temperature=0.0,
            seed=None,
            max_tokens=8,
        )
    with pytest.raises(DashboardApiError, match="the prompt is empty"):
        RunRequest.build(
            prompt="  ",
            chat=False,
            drafter="model",
            k_policy="fixed",
            k=2,
            k_max=4,
            confidence_threshold=0.5,
            temperature=0.0,
            seed=None,
            max_tokens=8,
        )


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_unreachable_server_is_one_clear_line() -> None:
    client = ApiClient(f"http://127.0.0.1:{_closed_port()}")
    with pytest.raises(DashboardApiError, match="cannot reach the draftwise API at http://127.0.0.1:.*draftwise serve"):
        client.health()
    with pytest.raises(DashboardApiError, match="cannot reach"):
        list(client.stream({"model": "m", "prompt": "x"}))
    with pytest.raises(DashboardApiError, match="must start with http"):
        ApiClient("localhost:8000").health()


@pytest.fixture(scope="module")
def api(tiny_target, tiny_near_draft):
    with live_api(tiny_target, tiny_near_draft) as url:
        yield url


def test_live_stream_matches_the_engine(api, tiny_target, tiny_near_draft) -> None:
    """The real SSE stream, parsed, gives the engine's own steps: tokens, k, proposals, acceptances."""
    request = RunRequest.build(
        prompt=PROMPT, chat=False, drafter="model", temperature=0.0, seed=None, max_tokens=40, **FIXED
    )
    run = LiveRun(drafter="model")
    for i, chunk in enumerate(ApiClient(api).stream(request.body(MODEL))):
        run.add_chunk(chunk, 0.01 * (i + 1))
    config = GenerationConfig(max_new_tokens=40, sampling=SamplingConfig(temperature=0.0), draft=DraftConfig(**FIXED))
    engine = SpeculativeEngine(LocalTarget(tiny_target), ModelDrafter(tiny_near_draft), tiny_target.tokenizer)
    events = engine.generate(PROMPT, config).events
    assert run.token_ids == [t for e in events for t in e.tokens]
    assert [(s.k, s.proposed, s.accepted) for s in run.steps] == [(e.k, len(e.proposed), e.n_accepted) for e in events]
    corrections = [t for t in run.tokens if t.source == "corrected"]
    assert corrections, "the near draft must be corrected at least once"
    by_step = {e.step: e for e in events}
    for token in corrections:
        event = by_step[token.step]
        assert [d.id for d in token.rejected] == event.proposed[event.n_accepted :]
        assert token.rejected[0].checked and not any(d.checked for d in token.rejected[1:])
        assert token.rejected[0].id != token.id  # greedy: the target put its own argmax instead
    assert run.stats is not None and run.stats["target_passes"] == len(events) == run.passes
    assert run.count("accepted") == run.stats["accepted"] > 0


def test_missing_draft_model_is_reported(tiny_target) -> None:
    with live_api(tiny_target) as url:
        client = ApiClient(url)
        assert client.health()["draft"] is None
        request = RunRequest.build(
            prompt=PROMPT, chat=False, drafter="model", temperature=0.0, seed=None, max_tokens=4, **FIXED
        )
        with pytest.raises(DashboardApiError, match="HTTP 400.*no draft model; use drafter 'ngram' or 'off'"):
            list(client.stream(request.body(MODEL)))


@pytest.fixture(scope="module")
def bench_out(tmp_path_factory, tiny_target, tiny_random_draft) -> Path:
    return tiny_bench(tmp_path_factory.mktemp("bench"), tiny_target, tiny_random_draft)


def test_bench_report_tables(bench_out: Path) -> None:
    results = load_bench(bench_out / "results.jsonl")  # a file inside the folder opens the folder
    assert results.folder == bench_out
    assert results.groups == ["overall", "alpha", "beta"]
    assert results.methods == ["baseline", "model", "ngram"]
    assert [p.name for p in results.plots] == ["speedup.png", "accepted_length.png", "tokens_per_second.png"]
    assert results.report_md.startswith("# draftwise bench")
    summary = json.loads((bench_out / "summary.json").read_text())
    table = method_table(results, "alpha")
    assert list(table.index) == ["baseline", "model", "ngram"]
    assert table.loc["model", "tokens/s"] == summary["groups"]["alpha"]["model"]["tokens_per_second"]
    assert table.loc["baseline", "speedup"] == pytest.approx(1.0)
    assert table.loc["baseline", "identical"] == "(reference)" and table.loc["ngram", "identical"] == "1/1"
    rows = record_table(results, "beta", "ngram")
    assert list(rows["prompt"]) == ["p2"] and list(rows["new tokens"]) == [8]
    assert len(record_table(results, "overall", "model")) == 2


def test_bench_report_without_summary_and_bad_paths(bench_out: Path, tmp_path: Path) -> None:
    partial = tmp_path / "partial"
    partial.mkdir()
    lines = (bench_out / "results.jsonl").read_text().splitlines()
    (partial / "results.jsonl").write_text("\n".join(lines) + '\n{"key": "cut sh')  # an interrupted run
    results = load_bench(partial)
    assert results.summary is None and len(results.records) == len(lines)
    assert "no summary.json" in results.headline()
    table = method_table(results, "overall")
    records = [json.loads(line) for line in lines]
    baseline = [r for r in records if r["method"] == "baseline"]
    rate = sum(r["new_tokens"] for r in baseline) / sum(r["wall_seconds"] for r in baseline)
    assert table.loc["baseline", "tokens/s"] == pytest.approx(rate)
    assert table.loc["baseline", "speedup"] == pytest.approx(1.0)
    for path, message in (
        (tmp_path / "nope", "does not exist"),
        (tmp_path, "holds no results.jsonl"),
        ("", "give the path"),
    ):
        with pytest.raises(ReportError, match=message):
            load_bench(path)


def test_cli_errors_are_one_line() -> None:
    from typer.testing import CliRunner

    from draftwise.cli import build_app

    runner = CliRunner()
    both = runner.invoke(build_app(), ["dashboard", "--api-url", "http://127.0.0.1:1", "--target", "tiny:0"])
    assert both.exit_code == 2 and "with --api-url the server is already running" in both.output
    # A model that cannot be loaded: the local server stops, and the command says why in one line.
    missing = runner.invoke(build_app(), ["dashboard", "--target", "no-such-model", "--startup-timeout", "300"])
    assert missing.exit_code == 1
    assert "error: the local API server stopped: error:" in missing.output and "no-such-model" in missing.output
    assert "Traceback" not in missing.output


def test_prediction_and_recalled_tokens_show_in_their_own_colours():
    run = LiveRun(drafter="ngram")
    for source in ("prediction", "ngram", "suffix"):
        run.add_chunk(
            {
                "choices": [{"text": "ab"}],
                "provenance": [{"id": 1, "text": "a", "source": "accepted"}, {"id": 2, "text": "b", "source": "bonus"}],
                "step": {"index": len(run.steps), "k": 1, "source": source, "proposed": [{"id": 1}], "n_accepted": 1},
            },
            0.1,
        )
    page = tokens_html(run)
    assert page.count('class="dw-tok dw-predicted"') == 1  # the prediction's accepted token
    assert page.count('class="dw-tok dw-accepted"') == 1  # the n-gram's
    assert page.count('class="dw-tok dw-recalled"') == 1  # drafted from an earlier answer
    assert "drafted by prediction" in page and "dw-predicted" in legend_html()
    assert "drafted by suffix" in page and "dw-recalled" in legend_html()


def test_the_plain_side_by_side_run_leaves_the_prediction_out():
    request = RunRequest.build(
        prompt="p", chat=False, drafter="ngram", k_policy="cost", k=5, k_max=12, confidence_threshold=0.6,
        temperature=0.0, seed=None, max_tokens=8, prediction="expected text",
    )  # fmt: skip
    assert request.body("m")["prediction"] == {"type": "content", "content": "expected text"}
    assert "prediction" not in request.body("m", drafter="off")
