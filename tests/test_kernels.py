"""Which of ggml's kernels run a repacked matrix (draftwise.backends.llamacpp_kernels), in
closed form: the crossover of two timed curves, when draftwise takes the choice, and the
choice timed once with the switch at each setting, then cached. The kernels themselves, on a
real model, are in tests/test_llamacpp.py."""

from __future__ import annotations

import os
from types import SimpleNamespace

import pytest

from draftwise.backends import llamacpp_kernels as kernels
from draftwise.backends.llamacpp_kernels import STOCK_FROM_ROWS, choose_stock_rows, crossover, keep_layouts


def test_the_stock_kernels_take_over_from_the_fewest_rows_where_they_win_at_every_larger_size():
    # The 2-core AMD EPYC's llama-bench curves (ms): repacked faster up to 16 rows, stock from 32.
    repacked = {1: 37.1, 2: 58.7, 4: 111.2, 8: 240.2, 16: 237.6, 32: 390.6, 64: 705.6}
    stock = {1: 50.9, 2: 81.2, 4: 123.6, 8: 231.3, 16: 267.6, 32: 304.3, 64: 517.2}
    assert crossover(repacked, stock) == 32  # 8 rows won once, but 16 did not: not from 8


def test_no_crossover_where_the_largest_size_is_faster_repacked():
    assert crossover({1: 1.0, 8: 2.0, 64: 5.0}, {1: 0.9, 8: 1.5, 64: 5.5}) == 0
    assert crossover({1: 1.0, 64: 5.0}, {1: 2.0, 64: 5.0}) == 0  # a tie is no win
    assert crossover({1: 2.0, 64: 5.0}, {1: 1.0, 64: 4.0}) == 1  # faster everywhere


@pytest.mark.parametrize(
    ("exact", "gpu", "user", "keeps", "after"),
    [
        (False, False, None, True, "0"),  # kept, and no product on the stock kernels until timed
        (True, False, None, False, ""),  # --exact: no copy
        (True, False, "32", False, ""),  # --exact: no copy, whatever a parent process set
        (False, True, None, False, None),
        (False, False, "48", False, "48"),  # the user's value stands
    ],
)
def test_the_layouts_are_kept_unless_exact_the_gpu_or_the_user_decides(monkeypatch, exact, gpu, user, keeps, after):
    if user is None:
        monkeypatch.delenv(STOCK_FROM_ROWS, raising=False)
    else:
        monkeypatch.setenv(STOCK_FROM_ROWS, user)
    assert keep_layouts(exact, gpu) is keeps
    assert os.environ.get(STOCK_FROM_ROWS) == after


def test_the_choice_is_timed_on_each_kernel_once_then_read_from_the_cache(monkeypatch, tmp_path):
    monkeypatch.setenv("DRAFTWISE_HOME", str(tmp_path))
    monkeypatch.setenv(STOCK_FROM_ROWS, "0")
    curves = {"0": {1: 0.03, 16: 0.20, 32: 0.40, 64: 0.70}, "1": {1: 0.05, 16: 0.25, 32: 0.30, 64: 0.50}}
    timed = []

    def time_curve(lm, sizes):
        timed.append(os.environ[STOCK_FROM_ROWS])  # the switch as the passes saw it
        return curves[os.environ[STOCK_FROM_ROWS]]

    monkeypatch.setattr(kernels, "time_curve", time_curve)
    target = SimpleNamespace(name="target", fingerprint="llamacpp|target", max_context=4096)
    logged = []
    assert choose_stock_rows(target, logged.append) == 32
    assert timed == ["0", "1"] and os.environ[STOCK_FROM_ROWS] == "32" and len(logged) == 1
    os.environ[STOCK_FROM_ROWS] = "0"
    assert choose_stock_rows(target, logged.append) == 32  # cached: no pass timed again
    assert timed == ["0", "1"] and os.environ[STOCK_FROM_ROWS] == "32"


def test_a_choice_timed_on_a_busy_machine_is_not_cached(monkeypatch, tmp_path):
    monkeypatch.setenv("DRAFTWISE_HOME", str(tmp_path))
    busy = {1: 0.03, 64: 9.0}  # 64 rows slower than 64 one-row passes: not this machine's curve
    monkeypatch.setattr(kernels, "time_curve", lambda lm, sizes: busy)
    target = SimpleNamespace(name="target", fingerprint="llamacpp|target", max_context=4096)
    assert choose_stock_rows(target, lambda line: None) == 0
    assert not (tmp_path / "costs.json").exists()


def test_a_context_too_short_to_time_both_kernels_keeps_every_product_repacked(monkeypatch, tmp_path):
    monkeypatch.setenv("DRAFTWISE_HOME", str(tmp_path))
    monkeypatch.setenv(STOCK_FROM_ROWS, "0")
    monkeypatch.setattr(kernels, "time_curve", lambda lm, sizes: pytest.fail("timed in a context too short"))
    target = SimpleNamespace(name="target", fingerprint="llamacpp|target", max_context=256)
    assert choose_stock_rows(target, lambda line: None) == 0
    assert os.environ[STOCK_FROM_ROWS] == "0"
