"""The bench's sweep (``--sweep``): each drafter again at fixed draft lengths, and the regret
of the default policy against the best of them in hindsight.

The regret's numbers are checked in closed form on hand-made records; the sweep runs
themselves run on the tiny random models, as in test_bench.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

from bench_support import bench_record
from draftwise.bench.analysis import OVERALL, complete_prompts, summarize, worst_prompt
from draftwise.bench.config import BenchConfig, parse_sweep_run, sweep_run
from draftwise.bench.dataset import Prompt
from draftwise.bench.methods import DraftwiseMethod
from draftwise.bench.report import render
from draftwise.bench.runner import RESULTS, run_bench
from draftwise.config import DraftConfig, GenerationConfig

PROMPTS = [Prompt("p1", "s1", "s1", ("x",)), Prompt("p2", "s1", "s1", ("x",)), Prompt("p3", "s2", "s2", ("x",))]
TOKENS = {"p1": 20, "p2": 40, "p3": 64}  # p1's baseline is below the worst-prompt floor (32 tokens)
# Wall seconds per method and prompt; tokens/s = TOKENS / wall.
WALL = {
    "baseline": {"p1": 2.0, "p2": 4.0, "p3": 8.0},  # 10, 10, 8 tokens/s
    "model": {"p1": 4.0, "p2": 2.0, "p3": 6.4},  # 5, 20, 10
    "model/k1": {"p1": 2.0, "p2": 2.5, "p3": 4.0},  # 10, 16, 16
    "model/k4": {"p1": 1.0, "p2": 1.6, "p3": 8.0},  # 20, 25, 8
    "ngram": {"p1": 2.0, "p2": 5.0, "p3": 10.0},  # 10, 8, 6.4
    "ngram/k1": {"p1": 4.0, "p2": 8.0, "p3": 16.0},  # 5, 5, 4: slower than the baseline everywhere
    "llamacpp-plain": {"p1": 2.5, "p2": 4.0, "p3": 6.4},  # 8, 10, 10
}  # ngram/k4 has no records: a run that did not finish counts as unknown


def _config(tmp_path: Path, **overrides: Any) -> BenchConfig:
    settings: dict[str, Any] = {
        "target": "tiny:0",
        "draft": "tiny:1",
        "methods": ("baseline", "model", "ngram", "llamacpp-plain"),
        "sweep": (4, 1),
        "out": tmp_path / "out",
    }
    return BenchConfig(**{**settings, **overrides})


RECORDS = [bench_record(m, p, TOKENS[p.id], WALL[m][p.id], WALL[m][p.id] / 4) for m in WALL for p in PROMPTS]


def test_runs_add_each_drafter_at_each_length_after_the_others(tmp_path: Path) -> None:
    config = _config(tmp_path, sweep=(4, 1, 4), other_drafts=("tiny:2",))
    assert config.sweep == (1, 4)
    assert config.runs == (
        *("baseline", "model", "ngram", "llamacpp-plain", "model@tiny:2"),
        *("model/k1", "model/k4", "ngram/k1", "ngram/k4"),
    )
    assert _config(tmp_path, sweep=()).runs == ("baseline", "model", "ngram", "llamacpp-plain")
    assert parse_sweep_run(sweep_run("hybrid", 12)) == ("hybrid", 12)
    for other in ("model", "model@tiny:2", "baseline/k4", "llamacpp-spec/k4", "model/kx", "model/k"):
        assert parse_sweep_run(other) is None, other


def test_a_sweep_needs_a_drafting_method(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="--sweep runs the drafting methods"):
        _config(tmp_path, methods=("baseline", "llamacpp-plain"), sweep=(2,))


def test_a_sweep_run_drafts_at_its_length_under_the_fixed_policy() -> None:
    default = GenerationConfig(max_new_tokens=7, draft=DraftConfig(k=3, k_max=6, confidence_threshold=0.3))
    method = DraftwiseMethod("model/k20", None, None, [], fixed_k=20)  # type: ignore[arg-type]  # not run here
    draft = method.generation(default).draft
    # Past k_max, which bounds the adaptive policies only; every other setting is the request's.
    assert (draft.k_policy, draft.k, draft.k_max, draft.confidence_threshold) == ("fixed", 20, 6, 0.3)
    assert method.generation(default).max_new_tokens == 7
    plain = DraftwiseMethod("model", None, None, [])  # type: ignore[arg-type]
    assert plain.generation(default) is default


def test_sweep_runs_on_tiny_models_use_their_fixed_length(tmp_path: Path) -> None:
    data = tmp_path / "prompts.jsonl"
    rows = [{"id": "p1", "subtask": "a", "prompt": "1 2 3 4 1 2 3 4 1 2"}, {"id": "p2", "subtask": "b", "prompt": "hi"}]
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    config = _config(
        tmp_path,
        methods=("baseline", "model", "ngram"),
        sweep=(2, 5),
        data=str(data),
        warmup=False,
        generation=GenerationConfig(max_new_tokens=12),
    )
    report = run_bench(config).read_text()
    records = [json.loads(line) for line in (config.out / RESULTS).read_text().splitlines()]
    assert sorted({r["method"] for r in records}) == sorted(config.runs)
    plain = {r["prompt_id"]: r["tokens"] for r in records if r["method"] == "baseline"}
    for r in records:
        assert r["tokens"] == plain[r["prompt_id"]], r["method"]  # greedy: a fixed length is lossless too
        sweep = parse_sweep_run(r["method"])
        if sweep is None:
            continue
        steps, k = r["steps"], sweep[1]
        assert all(p <= length <= k for p, length in zip(steps["proposed"], steps["k"])), r["method"]
        if sweep[0] == "model":  # the draft model always offers: every step asks for k (less only near the end)
            assert steps["k"][0] == k
    summary = json.loads((config.out / "summary.json").read_text())
    assert set(summary["regret"]) == {OVERALL, "a", "b"}
    assert set(summary["regret"][OVERALL]["methods"]) == {"model", "ngram"}
    assert "## Regret: the default against the best fixed configuration" in report
    assert "- sweep: `METHOD/kK` is METHOD with the fixed policy at k = K, for K in 2, 5" in report


@pytest.fixture(scope="module")
def summary(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    config = _config(tmp_path_factory.mktemp("sweep"))
    return summarize(RECORDS, PROMPTS, config.runs, greedy=False)


def test_regret_in_closed_form(summary: dict[str, Any]) -> None:
    regret = summary["regret"]
    s1, s2, overall = (regret[g]["methods"]["model"] for g in ("s1", "s2", OVERALL))
    # s1 (p1, p2): baseline 10, model 12.5, model/k1 13, model/k4 22.5 tokens/s; llamacpp-plain 9.
    assert regret["s1"]["baseline_tokens_per_second"] == pytest.approx(10.0)
    assert (s1["speedup"], s1["oracle"], s1["oracle_speedup"]) == (pytest.approx(1.25), "model/k4", pytest.approx(2.25))
    assert s1["over_oracle"] == pytest.approx(12.5 / 22.5)
    assert s1["over_anchors"] == {"llamacpp-plain": pytest.approx(12.5 / 9)}
    # p1's ratio (0.5) is the lowest, but its baseline produced 20 tokens: under the floor of 32.
    assert s1["worst_prompt"] == {"prompt_id": "p2", "speedup": pytest.approx(2.0)}
    # s2 (p3): baseline 8, model 10, model/k1 16, model/k4 8.
    assert (s2["oracle"], s2["oracle_speedup"]) == ("model/k1", pytest.approx(2.0))
    assert s2["over_oracle"] == pytest.approx(10 / 16)
    # overall: baseline 28/3, model 35/3, model/k1 14, model/k4 53/3: the oracle is the maximum.
    assert (overall["oracle"], overall["oracle_speedup"]) == ("model/k4", pytest.approx(53 / 28))
    assert overall["speedup"] == pytest.approx(35 / 28)
    assert overall["over_oracle"] == pytest.approx(overall["speedup"] / overall["oracle_speedup"])
    assert overall["worst_prompt"] == {"prompt_id": "p3", "speedup": pytest.approx(1.25)}
    assert (
        overall["over_anchors"]["llamacpp-plain"]
        == summary["groups"][OVERALL]["model"]["speedup_over"]["llamacpp-plain"]["speedup"]
    )


def test_the_oracle_is_the_best_of_every_drafters_fixed_runs(summary: dict[str, Any]) -> None:
    ngram = summary["regret"]["s1"]["methods"]["ngram"]
    assert (ngram["oracle"], ngram["oracle_speedup"]) == ("model/k4", pytest.approx(2.25))
    assert ngram["over_oracle"] == pytest.approx(9 / 22.5)


def test_the_oracle_may_be_the_baseline(tmp_path: Path) -> None:
    # Without the model's runs: ngram/k1 is slower than the baseline everywhere and ngram/k4
    # never finished.
    config = _config(tmp_path, methods=("baseline", "ngram", "llamacpp-plain"))
    summary = summarize([r for r in RECORDS if not r["method"].startswith("model")], PROMPTS, config.runs, False)
    for group in ("s1", "s2", OVERALL):
        ngram = summary["regret"][group]["methods"]["ngram"]
        assert (ngram["oracle"], ngram["oracle_speedup"]) == ("baseline", pytest.approx(1.0))
        assert ngram["over_oracle"] == pytest.approx(ngram["speedup"])
    assert summary["regret"]["s1"]["methods"]["ngram"]["speedup"] == pytest.approx(0.9)


def test_worst_prompt_honours_the_token_floor() -> None:
    complete = complete_prompts(RECORDS, PROMPTS)
    assert worst_prompt("model", ["p1"], complete) is None
    assert worst_prompt("model", ["p1", "p2"], complete) == {"prompt_id": "p2", "speedup": pytest.approx(2.0)}


def test_report_section_only_with_a_sweep(summary: dict[str, Any], tmp_path: Path) -> None:
    machine = {k: "?" for k in ("cpu", "cores", "torch_threads", "platform", "torch", "transformers", "draftwise")}
    full = {**summary, "date": "today", "config_hash": "abc"}
    text = render(full, _config(tmp_path), PROMPTS, [], machine, None, [])
    section = text.split("## Regret: the default against the best fixed configuration")[1].split("\n## ")[0]
    assert "| default / oracle | worst prompt | default / llamacpp-plain |" in section
    assert "| overall | 9.3 | model | 1.25x | `model/k4` | 1.89x | 0.66x | p3: 1.25x | 1.25x |" in section
    assert "| s1 | 10.0 | ngram | 0.90x | `model/k4` | 2.25x | 0.40x | p2: 0.80x | 1.00x |" in section
    plain = {k: v for k, v in full.items() if k != "regret"}
    unswept = _config(tmp_path, sweep=())
    assert "## Regret" not in render(plain, unswept, PROMPTS, [], machine, None, [])


def _invoke(*args: str) -> Any:
    from draftwise.cli import build_app

    return CliRunner().invoke(build_app(), ["bench", "--target", "tiny:0", "--draft", "tiny:1", *args])


def test_cli_sweep_flag(monkeypatch: pytest.MonkeyPatch) -> None:
    seen: list[BenchConfig] = []
    monkeypatch.setattr("draftwise.cli.bench._run", lambda config, progress: seen.append(config))
    done = _invoke("--methods", "baseline,hybrid,ngram", "--sweep", "1,2,3,4,6,8")
    assert done.exit_code == 0, done.output
    assert seen[0].sweep == (1, 2, 3, 4, 6, 8)
    assert seen[0].runs[3:] == tuple(f"{m}/k{k}" for m in ("hybrid", "ngram") for k in (1, 2, 3, 4, 6, 8))


@pytest.mark.parametrize(
    ("value", "message"),
    [
        ("0", "error: --sweep: Input should be greater than or equal to 1 (got '0')"),
        ("4,65", "error: --sweep: Input should be less than or equal to 64 (got '65')"),
        ("x", "error: --sweep: Input should be a valid integer"),
    ],
)
def test_cli_bad_sweep_is_one_line(tmp_path: Path, value: str, message: str) -> None:
    done = _invoke("--out", str(tmp_path / "out"), "--sweep", value)
    assert done.exit_code == 2
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(message), lines


def test_cli_sweep_without_a_drafting_method_is_one_line(tmp_path: Path) -> None:
    done = _invoke("--out", str(tmp_path / "out"), "--methods", "baseline,llamacpp-plain", "--sweep", "2")
    assert done.exit_code == 2
    says = "error: --sweep runs the drafting methods (model, ngram, hybrid) again at each draft length; "
    assert done.stderr.strip() == says + "--methods names none"
