"""Measuring what drafting costs before generating: every block size the policy may use,
the draft's token and catch-up costs, cached per model and machine."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from draftwise.costs import CostCache, calibrate, plausible, time_passes
from draftwise.events import MODEL

HOSTS = Path(__file__).parent / "data" / "hosts"


@pytest.fixture
def cache(tmp_path) -> CostCache:
    return CostCache(tmp_path / "costs.json")


def test_calibration_times_every_block_size_and_the_draft(tiny_target, tiny_random_draft, cache):
    notes: list[str] = []
    profile = calibrate(tiny_target, tiny_random_draft, k_max=6, log=notes.append, cache=cache)
    assert all(profile.pass_times.known(n) for n in range(1, 8)) and not profile.pass_times.known(8)
    assert all(profile.pass_times.at(n) > 0 for n in range(1, 8))
    assert profile.draft_token_seconds[MODEL] > 0 and profile.catchup_token_seconds[MODEL] > 0
    assert len(notes) == 1 and "once on this machine" in notes[0]
    assert tiny_target.tokens == []  # the models are left empty, ready for a generation


def test_a_second_calibration_reads_the_cache(tiny_target, tiny_random_draft, cache, monkeypatch):
    # The first curve is a quiet machine's: a tiny model's passes, timed beside the other tests,
    # may look implausible, and such a curve is rightly never cached.
    quiet = {n: 0.001 + 0.0001 * n for n in range(1, 6)}
    monkeypatch.setattr("draftwise.costs.time_passes", lambda lm, sizes, prompt=False: {n: quiet[n] for n in sizes})
    first = calibrate(tiny_target, tiny_random_draft, k_max=4, cache=cache)
    monkeypatch.setattr("draftwise.costs.time_passes", lambda *a, **k: pytest.fail("measured again"))
    monkeypatch.setattr("draftwise.costs.time_draft", lambda *a, **k: pytest.fail("measured again"))
    again = calibrate(tiny_target, tiny_random_draft, k_max=4, cache=CostCache(cache.path))
    assert [again.pass_times.at(n) for n in range(1, 6)] == [first.pass_times.at(n) for n in range(1, 6)]
    assert again.draft_token_seconds == first.draft_token_seconds
    # Another k_max needs other sizes: measured anew.
    monkeypatch.undo()
    assert calibrate(tiny_target, None, k_max=8, cache=cache).pass_times.known(9)


def test_time_passes_rolls_back_after_each_pass(tiny_target):
    times = time_passes(tiny_target, range(1, 4))
    assert sorted(times) == [1, 2, 3]
    assert tiny_target.tokens == []


def test_time_passes_after_a_given_context_feeds_each_size_the_asked_times(tiny_target, monkeypatch):
    fed: list[tuple[list[int], int | None]] = []
    forward = tiny_target.forward

    def recording(tokens, last=None):
        fed.append((list(tokens), last))
        return forward(tokens, last=last)

    monkeypatch.setattr(tiny_target, "forward", recording)
    times = time_passes(tiny_target, [1, 5], context=[3, 4], repeats=3)
    assert sorted(times) == [1, 5] and all(seconds > 0 for seconds in times.values())
    # The context, one warm-up row, then each size three times: a block longer than the
    # context repeats the context's tokens.
    assert fed == [([3, 4], 1), ([3], 1)] + [([3], 1)] * 3 + [([3, 4, 3, 4, 3], 5)] * 3
    assert tiny_target.tokens == []


def test_an_unwritable_cache_only_costs_measuring_again(tiny_target, tmp_path):
    blocked = tmp_path / "file"
    blocked.write_text("not a folder")
    profile = calibrate(tiny_target, None, k_max=2, cache=CostCache(blocked / "costs.json"))
    assert profile.pass_times.known(3)


def test_a_stalled_size_beside_its_neighbours_is_not_this_machine_s_curve():
    # The Intel host's first `make run` (shared/hosts/intel-xeon-2026-12-06): timed while
    # another process shared the machine, 49 rows took more than twice 48 rows' time, and the
    # curve stayed cached. A quiet curve of the same host, with its dips at multiples of four
    # rows, and the AMD EPYC's, whose 8 rows cost more than two 4-row passes, are plausible.
    first_run = {1: 0.0928, 2: 0.1440, 3: 0.2139, 4: 0.1758, 16: 0.3595, 32: 0.7210, 48: 0.9534, 49: 2.0601}
    assert not plausible(first_run)
    assert plausible({n: s for n, s in first_run.items() if n != 49})
    for name in ("intel-xeon", "amd-epyc"):
        curve = json.loads((HOSTS / f"{name}.json").read_text())["pass_ms"]
        assert plausible({int(n): ms / 1e3 for n, ms in curve.items()})


def test_a_curve_no_machine_could_have_is_timed_again_and_never_cached(tiny_target, cache, monkeypatch):
    # A pass over n rows does at most n one-row passes' work: 6 rows at 21 one-row passes
    # were timed beside something else. Such a cached curve is measured again.
    assert plausible({1: 0.030, 2: 0.051, 4: 0.094}) and not plausible({1: 0.065, 2: 0.156, 6: 1.377})
    assert not plausible({2: 0.05})  # no one-row pass to judge by
    key = CostCache.key(tiny_target, "passes 1,2,3")
    cache.put(key, {"1": 0.065, "2": 0.156, "3": 1.377})
    busy = iter([{1: 0.03, 2: 0.9, 3: 0.08}, {1: 0.05, 2: 0.05, 3: 0.09}])  # then quiet
    monkeypatch.setattr("draftwise.costs.time_passes", lambda lm, sizes, prompt=False: next(busy))
    profile = calibrate(tiny_target, None, k_max=2, cache=cache)
    assert [profile.pass_times.at(n) for n in (1, 2, 3)] == [0.03, 0.05, 0.08]  # each size's fastest
    assert cache.get(key) == {"1": 0.03, "2": 0.05, "3": 0.08}
    always_busy = iter([{1: 0.01, 2: 0.5, 3: 0.5}] * 3)
    monkeypatch.setattr("draftwise.costs.time_passes", lambda lm, sizes, prompt=False: next(always_busy))
    cache.put(key, {"1": 0.065, "2": 0.156, "3": 1.377})
    calibrate(tiny_target, None, k_max=2, cache=cache)  # three attempts, none plausible
    assert cache.get(key) == {"1": 0.065, "2": 0.156, "3": 1.377}  # not cached over
