"""The offline replay of a draft policy (draftwise.bench.replay), on tiny models: a recording
replays a fixed configuration to exactly the steps the engine takes with it, it round-trips
through JSON, and a comparison names the best fixed configuration in hindsight."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from draftwise import GenerationConfig, SpeculativeEngine
from draftwise.bench.replay import FIXED_K, Recording, compare, policy_rate, record, replay, sweep, varied
from draftwise.config import DraftConfig
from draftwise.drafters import HybridDrafter, ModelDrafter
from draftwise.policies import FixedK
from draftwise.profile import CostProfile

from cli_support import run_cli, run_cli_here

PROMPT = "The cat sat on the mat. The cat sat on the"


def host(one_row: float, per_row: float, draft_token: float) -> CostProfile:
    """A host whose pass over n rows takes ``one_row + (n - 1) * per_row`` seconds."""
    profile = CostProfile()
    for rows in (1, 2, 4, 8, 16, 32, 64):
        profile.pass_times.add(rows, one_row + (rows - 1) * per_row)
    profile.draft_token_seconds["model"] = draft_token
    profile.catchup_token_seconds["model"] = draft_token / 10
    return profile


@pytest.fixture(scope="module")
def recording(tiny_target, tiny_near_draft) -> Recording:
    config = GenerationConfig(max_new_tokens=40, ignore_eos=True)
    ids = tiny_target.tokenizer.encode(PROMPT)
    return record(tiny_target, HybridDrafter(ModelDrafter(tiny_near_draft)), ids, config, prompt_id="cat")


@pytest.mark.parametrize("k", [1, 3, 6])
def test_a_fixed_configuration_replays_to_the_engine_s_own_steps(tiny_target, tiny_near_draft, recording, k):
    # Greedy: what each block keeps depends on the text alone, so the replay of "the draft
    # model at k" takes the passes the engine takes, and emits the same tokens.
    config = GenerationConfig(max_new_tokens=40, ignore_eos=True, draft=DraftConfig(k_policy="fixed", k=k))
    engine = SpeculativeEngine.from_models(tiny_target, ModelDrafter(tiny_near_draft))
    result = engine.generate(tiny_target.tokenizer.encode(PROMPT), config)
    assert tuple(result.tokens) == recording.continuation
    replayed = replay(recording, FixedK(k), host(0.05, 0.01, 0.01), sources=("model",))
    assert replayed.tokens == len(result.tokens) and replayed.steps == len(result.events)


def test_a_recording_round_trips_through_json(recording):
    again = Recording.from_json(recording.to_json())
    assert again == recording
    assert {o.source for p in again.positions for o in p.offers} >= {"model"}


def test_the_policy_is_told_the_tokens_left_in_the_budget_not_where_the_answer_ends(recording):
    # The engine tells the policy max_new_tokens less what it emitted; only hindsight knows
    # that an answer ends early, and a replay that told it made probes look cheap to skip.
    told = []

    class Telling(FixedK):
        def choose(self, offers, remaining):
            told.append(remaining)
            return super().choose(offers, remaining)

    ended_early = dataclasses.replace(recording, budget=len(recording.continuation) + 60)
    replay(ended_early, Telling(0), host(0.05, 0.01, 0.01), sources=())
    assert told == [len(recording.continuation) + 60 - i for i in range(len(recording.continuation))]
    assert Recording.from_json(ended_early.to_json()).budget == ended_early.budget
    assert recording.budget == 40  # record keeps the run's max_new_tokens


def test_plain_decoding_replays_at_the_one_row_pass(recording):
    replayed = replay(recording, FixedK(0), host(0.05, 0.01, 0.01), sources=())
    assert replayed.steps == replayed.tokens == len(recording.continuation)
    assert replayed.seconds == pytest.approx(0.05 * replayed.tokens)


def test_the_comparison_names_the_best_fixed_configuration_in_hindsight(recording):
    # Rows nearly free beside a one-row pass, drafts cheap: drafting pays, and the best fixed
    # configuration beats plain decoding; where rows cost a full pass each, nothing does.
    cheap = compare([recording], host(0.05, 0.002, 0.002))
    name, rate = cheap.best_fixed
    assert rate == max(cheap.fixed.values()) > cheap.plain and name in cheap.fixed
    assert len(cheap.fixed) == FIXED_K * 3  # model, ngram, and both (the drafter's first offer)
    assert cheap.policy > cheap.plain
    dear = compare([recording], host(0.05, 0.05, 0.05))
    assert dear.best_fixed == ("plain", dear.plain)
    assert dear.policy <= dear.plain and dear.policy >= 0.9 * dear.plain


def test_a_recording_through_the_cli_is_replayed_on_each_host(tmp_path):
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(
        json.dumps({"prompt": "one two three one two three one two", "subtask": "copy"})
        + "\n"
        + json.dumps({"prompt": "The weather is fine", "subtask": "chat"})
        + "\n"
    )
    profile = tmp_path / "host.json"
    profile.write_text(json.dumps({"pass_ms": {"1": 50, "4": 60, "16": 120}, "draft_token_ms": {"model": 5}}))
    recorded = tmp_path / "recorded.jsonl"
    done = run_cli(
        "replay", "--record", str(recorded), "--target", "tiny:0", "--draft", "tiny:1", "--data", str(prompts),
        "--max-new-tokens", "12", "--hosts", str(profile),
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert [json.loads(line)["subtask"] for line in recorded.read_text().splitlines()] == ["copy", "chat"]
    assert "replayed on host" in done.stdout and "copy" in done.stdout and "all" in done.stdout
    again = run_cli_here("replay", "--recording", str(recorded), "--hosts", str(profile))
    assert again.returncode == 0 and "replayed on host" in again.stdout
    swept = run_cli_here("replay", "--recording", str(recorded), "--hosts", str(profile), "--vary", "opening=0,4")
    assert swept.returncode == 0 and "opening 0" in swept.stdout and "opening 4 (default)" in swept.stdout
    assert "worst" in swept.stdout and "copy" in swept.stdout


def test_a_sweep_replays_the_policy_at_each_value_against_the_same_baselines(recording):
    cheap = host(0.05, 0.002, 0.002)
    base = compare([recording], cheap)
    name, settings = varied("opening=0.5,4")
    rows = sweep({"cat": [recording]}, cheap, name, settings)
    assert [row.value for row in rows] == [0.5, 4.0]
    for row, cost in zip(rows, settings):
        rate = policy_rate([recording], cheap, DraftConfig(cost=cost))
        assert row.over_plain["cat"] == pytest.approx(rate / base.plain)
        assert row.over_best["cat"] == pytest.approx(rate / base.best_fixed[1])
    assert rows[1].over_plain["cat"] == pytest.approx(base.policy / base.plain)  # the default: compare's own


@pytest.mark.parametrize(
    ("args", "says"),
    [
        ((), "--record FILE (decode the prompts now), --recording FILE (replay one) or --answers FILE"),
        (("--recording", "missing.jsonl", "--hosts", "missing.json"), "host profile missing.json: No such file"),
        (("--recording", "r.jsonl", "--vary", "speed=1"), "--vary speed: the cost policy's settings are allowance"),
        (("--recording", "r.jsonl", "--vary", "opening="), "give the values to replay"),
        (("--recording", "r.jsonl", "--vary", "opening=a,b"), "is not a list of numbers"),
        (("--recording", "r.jsonl", "--vary", "allowance=2"), "--vary allowance: Input should be less than"),
    ],
)
def test_replay_s_mistakes_are_one_line(args, says):
    done = run_cli_here("replay", *args)
    assert done.returncode == 2 and "Traceback" not in done.stderr
    assert says in done.stderr.strip().splitlines()[-1]


def test_a_recording_with_a_foreign_budget_is_one_line(recording, tmp_path):
    line = json.loads(recording.to_json())
    line["budget"] = "lots"
    path = tmp_path / "foreign.jsonl"
    path.write_text(json.dumps(line) + "\n")
    amd = Path(__file__).parent / "data" / "hosts" / "amd-epyc.json"
    done = run_cli_here("replay", "--recording", str(path), "--hosts", str(amd))
    assert done.returncode == 2 and "Traceback" not in done.stderr
    assert "not a recording written by draftwise replay --record" in done.stderr.strip().splitlines()[-1]
