"""The bench end to end on tiny random models: files, internal consistency, resume, CLI."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from statistics import mean

import pytest

from draftwise.backends.tiny import tiny_tokenizer
from draftwise.bench.analysis import OVERALL, expected_speedup, predicted_speedup, prompt_rate
from draftwise.bench.audit import NEAR_TIE, audit_prompt, first_difference
from draftwise.bench.config import BenchConfig
from draftwise.bench.dataset import DatasetError, load_prompts
from draftwise.bench.runner import RESULTS, PromptBuilder, run_bench
from draftwise.config import GenerationConfig

ROWS = [
    {"id": "p1", "subtask": "alpha", "prompt": "The cat sat on the mat. The cat sat on"},
    {"id": "p2", "subtask": "alpha", "prompt": "1 2 3 4 1 2 3 4 1 2"},
    {"id": "p3", "category": "beta", "turns": ["Say hello.", "Say it again."]},
]
TURNS = 4  # p1, p2 and two turns of p3
DRAFTWISE = ("baseline", "model", "ngram", "hybrid")
# Every method the hf backend runs: draftwise's own and transformers' anchors.
METHODS = (*DRAFTWISE, "hf-assisted", "hf-pld", "hf-baseline")


def _config(tmp_path: Path, **overrides) -> BenchConfig:
    data = tmp_path / "prompts.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    settings = {
        "target": "tiny:0",
        "draft": "tiny:1",
        "data": str(data),
        "out": tmp_path / "out",
        "warmup": False,
        "generation": GenerationConfig(max_new_tokens=12),
        "methods": METHODS,
    }
    return BenchConfig(**{**settings, **overrides})


def _lines(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / RESULTS).read_text().splitlines()]


@pytest.fixture(scope="module")
def finished(tmp_path_factory) -> tuple[BenchConfig, list[dict], dict, str]:
    """One complete bench run with every method, shared by the read-only tests below."""
    config = _config(tmp_path_factory.mktemp("bench"), warmup=True)
    report = run_bench(config, command="draftwise bench (test)")
    summary = json.loads((config.out / "summary.json").read_text())
    return config, _lines(config.out), summary, report.read_text()


def test_report_files_exist_and_parse(finished) -> None:
    config, records, summary, report = finished
    assert len(records) == TURNS * len(METHODS)
    assert {r["method"] for r in records} == set(METHODS)
    assert set(summary["groups"]) == {OVERALL, "alpha", "beta"}
    assert "## Overall" in report and "## Losslessness audit" in report
    for method in METHODS:
        assert f"| {method} | " in report
    for name in ("speedup.png", "accepted_length.png", "tokens_per_second.png"):
        data = (config.out / name).read_bytes()
        assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 2000
        assert f"]({name})" in report


def test_draft_cost_is_drafting_time_per_draft_token_in_plain_passes(finished) -> None:
    _, records, summary, report = finished
    overall = summary["groups"][OVERALL]
    plain = [s for r in records if r["method"] == "baseline" for s in r["steps"]["verify_s"]]
    checked = 0
    for method in DRAFTWISE:
        mine = [r["steps"] for r in records if r["method"] == method]
        proposed = sum(sum(s["proposed"]) for s in mine)
        if method == "baseline" or not proposed:
            continue
        per_token = sum(sum(s["draft_s"]) for s in mine) / proposed
        assert overall[method]["cost_ratio"] == pytest.approx(per_token / (sum(plain) / len(plain)))
        row = next(line for line in report.splitlines() if line.startswith(f"| {method} | "))
        header = next(line for line in report.splitlines() if line.startswith("| method | prompts"))
        column = [c.strip() for c in header.split("|")].index("draft cost")
        assert row.split("|")[column].strip() == f"{overall[method]['cost_ratio']:.2f}"
        checked += 1
    assert checked  # the model drafter proposed tokens


def test_record_numbers_are_consistent(finished) -> None:
    _, records, _, _ = finished
    for r in records:
        assert r["new_tokens"] == len(r["tokens"]) == sum(r["step_tokens"]) > 0
        assert len(r["arrivals"]) == len(r["step_tokens"])
        assert r["arrivals"] == sorted(r["arrivals"]) and r["arrivals"][-1] <= r["wall_seconds"]
        assert r["ttft_seconds"] == r["arrivals"][0]
        assert r["tokens_per_second"] == pytest.approx(r["new_tokens"] / r["wall_seconds"])
        if r["method"] in DRAFTWISE:
            m, steps = r["metrics"], r["steps"]
            assert m["new_tokens"] == r["new_tokens"]
            assert m["target_passes"] == len(r["step_tokens"]) == len(steps["k"])
            assert m["accepted"] == sum(steps["accepted"]) and m["proposed"] == sum(steps["proposed"])
            assert all(a <= p <= k for a, p, k in zip(steps["accepted"], steps["proposed"], steps["k"]))
            # Every step emits its accepted draft tokens plus one from the target (no stop strings here).
            assert r["step_tokens"][:-1] == [a + 1 for a in steps["accepted"][:-1]]
            assert 0 <= r["rollback_seconds"] <= m["draft_seconds"] + m["verify_seconds"]
        else:
            assert r["steps"] is None and r["metrics"] is None
        if r["method"] in ("baseline", "hf-baseline"):
            assert set(r["step_tokens"]) == {1}
        assert r["perplexity"] > 1.0


def test_speedup_is_the_ratio_of_mean_prompt_rates(finished) -> None:
    _, records, summary, _ = finished
    by: dict[tuple[str, str], list[dict]] = {}
    for r in sorted(records, key=lambda r: r["turn"]):
        by.setdefault((r["method"], r["prompt_id"]), []).append(r)
    for group, ids in ((OVERALL, ["p1", "p2", "p3"]), ("alpha", ["p1", "p2"]), ("beta", ["p3"])):
        reference = mean(prompt_rate(by[("baseline", pid)]) for pid in ids)
        for method in METHODS:
            stats = summary["groups"][group][method]
            own = mean(prompt_rate(by[(method, pid)]) for pid in ids)
            assert stats["tokens_per_second"] == pytest.approx(own)
            assert stats["speedup"] == pytest.approx(own / reference)
            tokens = sum(r["new_tokens"] for pid in ids for r in by[(method, pid)])
            passes = sum(len(r["step_tokens"]) for pid in ids for r in by[(method, pid)])
            assert stats["tokens"] == tokens
            assert stats["mean_accepted_length"] == pytest.approx(tokens / passes)
    assert summary["groups"][OVERALL]["baseline"]["speedup"] == pytest.approx(1.0)


def test_greedy_audit(finished) -> None:
    _, _, summary, report = finished
    overall = summary["groups"][OVERALL]
    for method in METHODS[1:]:
        stats = overall[method]
        assert stats["compared"] == 3
        assert len(summary["mismatches"][method]) == stats["compared"] - stats["identical"]
    # draftwise's own speculation is lossless: greedy output equals plain decoding exactly.
    assert overall["model"]["identical"] == overall["ngram"]["identical"] == 3
    assert "`model`: 3/3 (100%)" in report


def test_second_turn_feeds_the_models_own_answer(finished) -> None:
    _, records, _, _ = finished
    builder = PromptBuilder(tiny_tokenizer(), use_chat=True)
    for method in METHODS:
        first, second = (
            next(r for r in records if r["method"] == method and r["prompt_id"] == "p3" and r["turn"] == t)
            for t in (0, 1)
        )
        assert second["prompt_tokens"] == len(builder.ids(ROWS[2]["turns"], [first["text"]]))
        assert second["chat_template"] is False  # the tiny tokenizer has none


def test_resume_after_a_smaller_run_adds_only_what_is_missing(tmp_path: Path) -> None:
    methods = ("baseline", "ngram")
    run_bench(_config(tmp_path, methods=methods, limit=1))
    before = _lines(tmp_path / "out")
    assert sorted({r["prompt_id"] for r in before}) == ["p1", "p3"]
    run_bench(_config(tmp_path, methods=methods))
    after = _lines(tmp_path / "out")
    assert len(after) == len({r["key"] for r in after}) == TURNS * len(methods)
    assert after[: len(before)] == before  # earlier results kept as they were, not rerun


def test_resume_after_an_interruption_loses_and_duplicates_nothing(tmp_path: Path) -> None:
    config = _config(tmp_path, methods=("baseline", "model", "ngram"))
    seen: list[dict] = []

    def interrupt_after_five(record: dict) -> None:
        seen.append(record)
        if len(seen) == 5:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        run_bench(config, on_record=interrupt_after_five)
    kept = _lines(config.out)
    assert [r["key"] for r in kept] == [r["key"] for r in seen]
    # A write cut short by the interruption leaves a partial line: it is dropped and rerun.
    with (config.out / RESULTS).open("a") as f:
        f.write('{"key": "p3/1/ngram/')
    run_bench(config)
    final = _lines(config.out)
    assert len(final) == len({r["key"] for r in final}) == TURNS * 3
    assert final[:5] == kept


def test_config_change_gets_fresh_results(tmp_path: Path) -> None:
    run_bench(_config(tmp_path, methods=("baseline",), limit=1))
    run_bench(_config(tmp_path, methods=("baseline",), limit=1, generation=GenerationConfig(max_new_tokens=6)))
    records = _lines(tmp_path / "out")
    assert len(records) == 2 * 3 and len({r["config_hash"] for r in records}) == 2
    assert max(r["new_tokens"] for r in records if r["key"].endswith(records[-1]["config_hash"])) <= 6


def test_spec_bench_selection_is_deterministic_and_balanced() -> None:
    everything = load_prompts("spec_bench")
    assert len(everything) == 480
    assert {p.subtask for p in everything} == {
        "mt_bench",
        "translation",
        "summarization",
        "qa",
        "math_reasoning",
        "rag",
    }
    mt = load_prompts("spec_bench", ["mt_bench"], limit=8)
    assert len({p.category for p in mt}) == 8 and all(len(p.turns) == 2 for p in mt)
    picked = load_prompts("spec_bench", ["qa", "rag"], limit=3)
    assert [p.subtask for p in picked] == ["qa"] * 3 + ["rag"] * 3
    assert picked == load_prompts("spec_bench", ["qa", "rag"], limit=3)


@pytest.mark.parametrize(
    ("content", "message"),
    [
        ('{"prompt": "ok"}\n{broken\n', "line 2: not valid JSON"),
        ('{"text": "no prompt"}\n', "line 1: needs a 'prompt' string or a 'turns' list"),
        ('{"id": 1, "prompt": "a"}\n{"id": 1, "prompt": "b"}\n', "prompt id '1' appears more than once"),
    ],
)
def test_bad_prompt_files_say_what_is_wrong(tmp_path: Path, content: str, message: str) -> None:
    path = tmp_path / "bad.jsonl"
    path.write_text(content)
    with pytest.raises(DatasetError, match=message):
        load_prompts(str(path))


def test_audit_reports_the_first_difference_and_its_gap() -> None:
    assert first_difference([1, 2, 3], [1, 2, 3]) is None
    assert first_difference([1, 2, 3], [1, 5, 3]) == 1
    assert first_difference([1, 2], [1, 2, 3]) == 2
    ref = [{"prompt_id": "a", "subtask": "s", "turn": 0, "tokens": [4, 5, 6], "top2_logit_gaps": [0.9, 0.01, 0.5]}]
    assert audit_prompt(ref, [{"tokens": [4, 5, 6]}]) is None
    tie = audit_prompt(ref, [{"tokens": [4, 7, 6]}])
    assert (tie["position"], tie["reference_token"], tie["method_token"]) == (1, 5, 7)
    assert tie["top2_gap"] == 0.01 < NEAR_TIE and tie["near_tie"]
    assert not audit_prompt(ref, [{"tokens": [8, 5, 6]}])["near_tie"]


def test_predicted_speedup_follows_leviathan() -> None:
    assert predicted_speedup(0.8, [4] * 10, 0.1) == pytest.approx(expected_speedup(0.8, 4, 0.1))
    assert predicted_speedup(0.8, [0] * 10, 0.1) == 1.0
    # Half the steps plain: (3.36 + 1) tokens for (1.4 + 1) passes' time.
    assert predicted_speedup(0.8, [4, 0], 0.1) == pytest.approx((expected_speedup(0.8, 4, 0.0) + 1) / 2.4)


def _cli(*args: str) -> subprocess.CompletedProcess:
    entry = Path(sys.executable).parent / "draftwise"
    return subprocess.run([str(entry), "bench", *args], capture_output=True, text=True, timeout=300)


def test_cli_runs_the_bench_end_to_end(tmp_path: Path) -> None:
    config = _config(tmp_path)  # writes the prompt file
    done = _cli(
        "--target",
        "tiny:0",
        "--draft",
        "tiny:1",
        "--data",
        config.data,
        "--out",
        str(config.out),
        "--max-new-tokens",
        "6",
        "--limit",
        "1",
        "--no-progress",
    )
    assert done.returncode == 0, done.stderr
    assert (config.out / "report.md").exists() and "report:" in done.stderr
    assert len(_lines(config.out)) == 3 * len(DRAFTWISE)  # p1 and both turns of p3; the default methods
    summary = json.loads((config.out / "summary.json").read_text())
    assert summary["config"]["generation"]["max_new_tokens"] == 6


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (("--subtasks", "nope"), "unknown subtask(s) nope"),
        (("--methods", "baseline,magic"), "error: --methods: Input should be"),
        (("--data", "/no/such/file.jsonl"), "prompt file not found"),
        (("--temperature", "-1"), "temperature"),
    ],
)
def test_cli_errors_are_one_line(tmp_path: Path, args: tuple[str, ...], message: str) -> None:
    from typer.testing import CliRunner

    from draftwise.cli import build_app

    done = CliRunner().invoke(
        build_app(), ["bench", "--target", "tiny:0", "--draft", "tiny:1", "--out", str(tmp_path / "out"), *args]
    )
    assert done.exit_code == 2
    assert "Traceback" not in done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error:") and message in lines[0]


def test_other_drafts_run_each_drafting_method_again(tmp_path: Path) -> None:
    config = _config(tmp_path, methods=("baseline", "model", "ngram"), other_drafts=("tiny:2",), limit=1)
    assert config.runs == ("baseline", "model", "ngram", "model@tiny:2")
    report = run_bench(config).read_text()
    records = _lines(config.out)
    assert {r["method"] for r in records} == set(config.runs)
    by = {(r["prompt_id"], r["turn"], r["method"]): r["tokens"] for r in records}
    for (prompt, turn, method), tokens in by.items():
        assert tokens == by[(prompt, turn, "baseline")], method  # greedy: every method is lossless
    assert "| model@tiny:2 | " in report and "other drafts: `tiny:2`" in report


def test_other_drafts_do_not_name_the_target(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="--other-drafts names the target tiny:0"):
        _config(tmp_path, methods=("baseline", "model"), other_drafts=("tiny:2", "tiny:0"))


def test_other_drafts_need_a_method_that_drafts_with_a_model(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="--other-drafts runs the methods that draft with a model"):
        _config(tmp_path, methods=("baseline", "ngram"), other_drafts=("tiny:2",))


def test_the_draft_is_the_registrys_for_the_target_as_in_generate_and_serve() -> None:
    from draftwise.bench.replay import ReplayConfig
    from draftwise.prepare import choose_drafter

    assert BenchConfig().draft == choose_drafter(BenchConfig().target, None, "model")[0] == "qwen2.5-coder-0.5b"
    assert BenchConfig(target="qwen2.5-coder-1.5b", draft="tiny:1").draft == "tiny:1"  # a named one stands
    assert BenchConfig(target="smollm2-135m", methods=("baseline", "ngram")).draft is None  # n-gram: no draft
    with pytest.raises(ValueError, match="model, hybrid draft with a model, and none is known for smollm2-135m"):
        BenchConfig(target="smollm2-135m")
    assert ReplayConfig().draft == "qwen2.5-coder-0.5b"
    assert ReplayConfig(target="smollm2-135m").draft is None


@pytest.mark.parametrize(
    ("alpha", "k", "c", "expected"),
    [
        (0.8, 4, 0.1, (1 - 0.8**5) / 0.2 / 1.4),  # 2.401
        (0.8, 4, 0.43, (1 - 0.8**5) / 0.2 / 2.72),
        (0.5, 1, 0.0, 1.5),
        (0.0, 3, 0.0, 1.0),
        (0.7, 0, 0.9, 1.0),
        (1.0, 2, 0.0, (1 - 0.999**3) / 0.001),  # alpha is capped below 1
    ],
)
def test_expected_speedup_closed_form(alpha, k, c, expected):
    assert expected_speedup(alpha, k, c) == pytest.approx(expected)
