"""``prepare_pair``, the one way every entry point prepares a pair, and the entry points that use it."""

from __future__ import annotations

from typing import Any

import pytest

from draftwise import prepare
from draftwise.config import DraftConfig, GenerationConfig
from draftwise.errors import ConfigError
from draftwise.profile import CostProfile

COST = DraftConfig(k_policy="cost", k=2, k_max=3)


@pytest.fixture(autouse=True)
def own_home(tmp_path, monkeypatch):
    # A fresh cost cache: calibration measures here instead of reading another run's times.
    monkeypatch.setenv("DRAFTWISE_HOME", str(tmp_path))


def _calibrated(profile: CostProfile | None, k_max: int) -> bool:
    return profile is not None and all(profile.pass_times.known(n) for n in range(1, k_max + 2))


def test_prepare_pair_loads_checks_and_calibrates_for_the_cost_policy():
    pair = prepare.prepare_pair("tiny:0", "tiny:1", None, COST)
    assert pair.draft is not None and _calibrated(pair.profile, COST.k_max)
    assert pair.profile is not None and pair.profile.draft_token_seconds  # the draft's costs too


def test_prepare_pair_measures_nothing_without_the_cost_policy_or_drafting():
    assert prepare.prepare_pair("tiny:0", None, None, DraftConfig(k_policy="fixed")).profile is None
    assert prepare.prepare_pair("tiny:0", None, None, None).profile is None  # a verifier's target


def test_a_verifier_s_target_is_timed_where_its_sessions_share_passes(tiny_target):
    class Shared:  # the tiny target, its sequences batched as llama.cpp's slots are
        batch = object()

        def __getattr__(self, name: str) -> Any:
            return getattr(tiny_target, name)

    paced = prepare.prepare(Shared(), None, None, slots=4, pace=True).profile  # type: ignore[arg-type]
    assert paced is not None and _calibrated(paced, DraftConfig().k_max) and paced.pass_times.known(48)
    assert prepare.prepare(Shared(), None, None, slots=1, pace=True).profile is None  # each pass alone  # type: ignore[arg-type]
    assert prepare.prepare(tiny_target, None, None, slots=4, pace=True).profile is None  # hf: no shared passes


def _spy_on_prepare(monkeypatch) -> list[dict[str, Any]]:
    calls: list[dict[str, Any]] = []
    real = prepare.prepare_pair

    def spy(*args: Any, **kwargs: Any) -> prepare.Pair:
        calls.append({"args": args, **kwargs})
        return real(*args, **kwargs)

    monkeypatch.setattr(prepare, "prepare_pair", spy)
    return calls


# Serve awaits a replica's async __del__ when it stops one; outside Serve nothing does, and
# this replica never started the reporter that __del__ would close.
@pytest.mark.filterwarnings("ignore:coroutine 'FleetReplica.__del__' was never awaited")
def test_serve_on_ray_replicas_are_prepared_and_calibrated(monkeypatch):
    """A ``serve --ray`` replica prepares its pair as a plain ``serve`` does, and its app's
    slots run the cost policy on the measured profile (they once started uncalibrated)."""
    pytest.importorskip("fastapi")
    from draftwise.api import app as api_app
    from draftwise.api.settings import ServerSettings
    from draftwise.cluster import fleet, serve_app

    monkeypatch.setattr(fleet, "keep_replica_grpc_on_loopback", lambda: None)  # a Serve replica's set-up
    calls = _spy_on_prepare(monkeypatch)
    profiles: list[CostProfile | None] = []
    real_build_slots = api_app.build_slots

    def build_slots(*args: Any, **kwargs: Any) -> Any:
        profiles.append(args[3])
        return real_build_slots(*args, **kwargs)

    monkeypatch.setattr(api_app, "build_slots", build_slots)
    settings = ServerSettings(target="tiny:0", draft="tiny:1", slots=2, generation=GenerationConfig(draft=COST))
    replica = serve_app.ApiReplica(settings)
    app = replica.build()
    (call,) = calls
    assert call["slots"] == 2
    # Two slots, neither kept idle: the first runs on the replica's models.
    targets = [slot.target for slot in app.state.pool._idle]
    assert len(targets) == 2 and replica.pair.target in targets
    assert _calibrated(replica.pair.profile, COST.k_max)
    assert profiles == [replica.pair.profile]


def test_the_bench_prepares_a_calibrated_pair(tmp_path):
    from draftwise.bench.config import BenchConfig
    from draftwise.bench.runner import load_models

    config = BenchConfig(target="tiny:0", draft="tiny:1", out=tmp_path, generation=GenerationConfig(draft=COST))
    pair = load_models(config)
    assert pair.draft is not None and _calibrated(pair.profile, COST.k_max)


@pytest.mark.parametrize(
    ("draft", "drafter", "chosen"),
    [
        (None, None, ("qwen2.5-coder-0.5b", "hybrid")),  # the registry's advice
        (None, "model", ("qwen2.5-coder-0.5b", "model")),  # a model drafter takes the registry's draft
        (None, "ngram", (None, "ngram")),  # lookup loads no draft
        (None, "off", (None, "off")),
        ("smollm2-135m", None, ("smollm2-135m", "hybrid")),  # a named draft is taken
        ("smollm2-135m", "ngram", ("smollm2-135m", "ngram")),
    ],
)
def test_generate_and_serve_choose_the_draft_and_the_drafter_by_one_rule(draft, drafter, chosen):
    assert prepare.choose_drafter("qwen2.5-coder-1.5b", draft, drafter) == chosen


def test_a_model_drafter_with_no_draft_known_is_one_line():
    with pytest.raises(ConfigError, match="--drafter model needs --draft: no draft model is known for 'x.gguf'"):
        prepare.choose_drafter("x.gguf", None, "model")
    assert prepare.choose_drafter("x.gguf", None, None) == (None, "ngram")
