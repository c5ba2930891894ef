"""Host profiles as files: ``draftwise curve --out`` writes one, ``--costs`` (or
``$DRAFTWISE_COSTS``) makes the cost policy price drafting from it as it stands, the
benchmarks refuse it, and a broken file is one line."""

from __future__ import annotations

import json

import pytest

from draftwise import prepare
from draftwise.config import COSTS_ENV, DraftConfig, GenerationConfig, ModelOptions
from draftwise.drafters import build_drafter
from draftwise.engine import SpeculativeEngine
from draftwise.errors import ConfigError
from draftwise.offers import Choice, Outcome
from draftwise.profile import read_host
from draftwise.target import LocalTarget

from cli_support import run_cli, run_cli_here

COST = DraftConfig(k_policy="cost", k=2, k_max=6)


@pytest.fixture(autouse=True)
def own_home(tmp_path, monkeypatch):
    monkeypatch.setenv("DRAFTWISE_HOME", str(tmp_path))
    monkeypatch.delenv(COSTS_ENV, raising=False)


def _profile(tmp_path, name: str, pass_ms: dict[int, float], draft_ms: float) -> str:
    path = tmp_path / f"{name}.json"
    path.write_text(
        json.dumps({"pass_ms": {str(n): ms for n, ms in pass_ms.items()}, "draft_token_ms": {"model": draft_ms}})
    )
    return str(path)


def test_curve_writes_a_profile_that_the_cost_policy_reads(tmp_path):
    out = tmp_path / "host.json"
    done = run_cli(
        "curve", "--target", "tiny:0", "--draft", "tiny:1", "--rows", "2,8", "--context", "16", "--repeats", "1",
        "--out", str(out),
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    record = json.loads(out.read_text())
    assert sorted(map(int, record["pass_ms"])) == [1, 2, 8]  # the one-row pass, the unit, is written too
    assert record["draft_token_ms"]["model"] > 0 and record["catchup_token_ms"]["model"] > 0
    assert record["threads"] >= 1 and record["cpu"] in record["host"] and "tiny" in record["fingerprint"]
    profile = read_host(out)
    assert profile.fixed and profile.pass_times.at(8) == pytest.approx(record["pass_ms"]["8"] / 1e3)
    assert profile.draft_token_seconds["model"] == pytest.approx(record["draft_token_ms"]["model"] / 1e3)


def test_a_host_profile_s_prices_stand_while_acceptance_is_learnt(tmp_path, monkeypatch):
    path = _profile(tmp_path, "host", {1: 50.0, 4: 80.0}, 10.0)
    monkeypatch.setenv(COSTS_ENV, path)  # as `make run` or a test would set it
    pair = prepare.prepare_pair("tiny:0", "tiny:1", None, COST)
    assert pair.profile is not None and pair.profile.fixed
    assert pair.profile.pass_times.at(4) == pytest.approx(0.080)
    # A block this machine took far longer over than the profile's host would:
    pair.profile.learn(Outcome(Choice("model", 3), n_proposed=3, n_accepted=2, draft_seconds=9.0, verify_seconds=9.0))
    assert pair.profile.pass_times.at(4) == pytest.approx(0.080)
    assert pair.profile.draft_token_seconds["model"] == pytest.approx(0.010)


@pytest.mark.parametrize("free", [True, False])
def test_the_policy_drafts_as_the_profile_s_host_allows(tmp_path, free):
    # A draft that is always right (the target's own fork). On a host where a block of 7 rows
    # costs what one row does and drafting is free, the policy drafts nearly every token; where
    # a row costs a whole step and a drafted token half of one, no block can pay and the policy,
    # once its probes are spent, decodes plainly.
    rows = {n: 50.0 if free else 50.0 * n for n in range(1, 8)}
    path = _profile(tmp_path, "host", rows, 0.0 if free else 25.0)
    pair = prepare.prepare_pair("tiny:0", "tiny:0", ModelOptions(costs=path), COST)
    drafter = build_drafter("model", pair.draft)  # the same vocabulary: token ids, no text bridge
    engine = SpeculativeEngine(LocalTarget(pair.target), drafter, pair.target.tokenizer, pair.profile)
    # The tiny model is never sure of a token: no confidence cut, so blocks run to their length.
    config = GenerationConfig(
        max_new_tokens=96, ignore_eos=True, draft=COST.model_copy(update={"confidence_threshold": 0})
    )
    metrics = engine.generate(pair.target.tokenizer.encode("one two three"), config).metrics
    share = metrics.accepted / metrics.new_tokens
    assert share > 0.6 if free else share < 0.25, (share, metrics.proposed)


def test_a_broken_profile_is_one_line_before_anything_loads(tmp_path):
    (tmp_path / "broken.json").write_text("{not json")
    (tmp_path / "no-unit.json").write_text(json.dumps({"pass_ms": {"4": 80.0}}))
    for name, says in (("broken.json", "not a profile"), ("no-unit.json", "no one-row pass"), ("gone.json", "No such")):
        done = run_cli_here("generate", "--target", "tiny:0", "--costs", str(tmp_path / name), "hello")
        assert done.returncode != 0 and "Traceback" not in done.stderr, done.stderr
        last = done.stderr.strip().splitlines()[-1]
        assert last.startswith("error: ") and says in last, done.stderr
    with pytest.raises(ConfigError, match="no one-row pass"):
        read_host(tmp_path / "no-unit.json")


BENCH_ON_TINY = ["bench", "--target", "tiny:0", "--draft", "tiny:1"]


@pytest.mark.parametrize("command", [BENCH_ON_TINY, ["load", "--target", "tiny:0"]])
def test_the_benchmarks_time_this_machine(tmp_path, command):
    path = _profile(tmp_path, "host", {1: 50.0}, 10.0)
    done = run_cli_here(*command, "--costs", path)
    assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr
    assert "drop --costs" in done.stderr.strip().splitlines()[-1]
