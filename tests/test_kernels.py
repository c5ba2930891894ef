"""Which of ggml's kernels run a repacked matrix (draftwise.backends.llamacpp_kernels, timed
by draftwise.costs.choose_kernels), in closed form: the crossover of two timed curves, when
draftwise takes the choice, which passes may run the stock kernels, and the choice timed once
with the switch at each setting, then cached by what decides it. The kernels themselves, on a
real model, are in tests/test_llamacpp.py."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from draftwise import costs
from draftwise.backends.llamacpp_batch import Request
from draftwise.backends.llamacpp_kernels import STOCK_FROM_ROWS, KernelChoice, keep_layouts
from draftwise.costs import apart, choose_kernels, crossover


def test_the_stock_kernels_take_over_from_the_fewest_rows_where_they_win_at_every_larger_size():
    # The 2-core AMD EPYC's llama-bench curves (ms): repacked faster up to 16 rows, stock from 32.
    repacked = {1: 37.1, 2: 58.7, 4: 111.2, 8: 240.2, 16: 237.6, 32: 390.6, 64: 705.6}
    stock = {1: 50.9, 2: 81.2, 4: 123.6, 8: 231.3, 16: 267.6, 32: 304.3, 64: 517.2}
    assert crossover(repacked, stock) == 32  # 8 rows won once, but 16 did not: not from 8


def test_pieces_go_apart_from_where_the_stock_kernels_save_more_than_a_pass_of_one_row_costs():
    # The same curves: from 32 rows the stock kernels save 86 ms, more than a one-row pass (37 ms).
    repacked = {1: 37.1, 2: 58.7, 4: 111.2, 8: 240.2, 16: 237.6, 32: 390.6, 64: 705.6}
    stock = {1: 50.9, 2: 81.2, 4: 123.6, 8: 231.3, 16: 267.6, 32: 304.3, 64: 517.2}
    assert apart(repacked, stock) == 32
    # A host where the stock kernels win by less than a pass costs: faster, and never apart.
    nearly = {n: t * 0.97 for n, t in repacked.items()}
    assert crossover(repacked, nearly) == 1 and apart(repacked, nearly) == 0
    # Where they win by more only from 64 rows, pieces go apart from 64, not from the crossover.
    assert apart({1: 35, 32: 327, 64: 600}, {1: 50, 32: 312, 64: 508}) == 64


def test_no_crossover_where_the_largest_size_is_faster_repacked():
    assert crossover({1: 1.0, 8: 2.0, 64: 5.0}, {1: 0.9, 8: 1.5, 64: 5.5}) == 0
    assert crossover({1: 1.0, 64: 5.0}, {1: 2.0, 64: 5.0}) == 0  # a tie is no win
    assert crossover({1: 2.0, 64: 5.0}, {1: 1.0, 64: 4.0}) == 1  # faster everywhere


class Switch:
    """Patch 0006's switches as ggml keeps them: the first decision on the layouts stands."""

    def __init__(self) -> None:
        self.kept: bool | None = None
        self.rows: list[int] = []

    def keep_layouts(self, keep: bool) -> bool:
        if self.kept is None:
            self.kept = keep
        return self.kept

    def stock_from_rows(self, rows: int) -> None:
        self.rows.append(rows)


@pytest.mark.parametrize(
    ("exact", "gpu", "user", "kept", "timed", "rows"),
    [
        (False, False, None, True, True, None),  # kept, and no product on the stock kernels until timed
        (True, False, None, False, False, 0),  # --exact: no copy
        (True, False, "32", False, False, 0),  # --exact: no copy, whatever a parent process set
        (False, True, None, False, False, 0),
        (False, False, "48", None, False, 48),  # the user's value stands: ggml reads it at the load
        (False, False, "", None, False, 0),  # set empty: no copy (ggml reads it), every product repacked
    ],
)
def test_the_layouts_are_kept_unless_exact_the_gpu_or_the_user_decides(
    monkeypatch, exact, gpu, user, kept, timed, rows
):
    if user is None:
        monkeypatch.delenv(STOCK_FROM_ROWS, raising=False)
    else:
        monkeypatch.setenv(STOCK_FROM_ROWS, user)
    switch = Switch()
    choice = keep_layouts(exact, gpu, switch)
    assert (switch.kept, choice.timed, choice.stock_rows) == (kept, timed, rows)
    assert choice.apart_rows == (rows or 0)  # the user's rows stand for pieces apart too; timed later
    assert keep_layouts(exact, gpu, None) == KernelChoice()  # a build without patch 0006: nothing to choose


def test_only_a_pass_of_prompt_pieces_runs_the_stock_kernels():
    # A verified block or a batch of one-token steps scores tokens that a stream emits: on the
    # repacked kernels, as one-token decoding, so the choice cannot flip a near tie.
    switch = Switch()
    choice = KernelChoice(switch, timed=True, stock_rows=32)
    choice.before_pass(prompt_only=True)
    choice.before_pass(prompt_only=False)
    assert switch.rows == [32, 0]
    untimed = KernelChoice(switch, timed=True, stock_rows=None)
    untimed.before_pass(prompt_only=True)
    assert switch.rows[-1] == 0


def test_a_request_is_a_prompt_piece_when_it_feeds_several_tokens_scored_at_the_last_only():
    assert Request(0, [1, 2, 3], 0, want=1).prompt
    assert not Request(0, [1, 2, 3], 0, want=3).prompt  # a verified block
    assert not Request(0, [7], 0, want=1).prompt  # a one-token step


def _timing(monkeypatch, tmp_path, curves):
    """choose_kernels's passes, recorded with the rows the choice held while each curve was
    timed (prompt pieces only)."""
    monkeypatch.setenv("DRAFTWISE_HOME", str(tmp_path))
    choice = KernelChoice(Switch(), timed=True, stock_rows=None)
    timed = []

    def time_curve(lm, sizes, prompt=False):
        assert prompt and 1 in sizes
        timed.append(choice.stock_rows)
        return curves[choice.stock_rows]

    monkeypatch.setattr(costs, "time_curve", time_curve)
    return choice, timed


def _target(choice: KernelChoice, max_context: int = 4096, key: str = "llamacpp|target|2 threads|cpu"):
    """A target whose backend leaves its prompt pieces' kernels to ``choice``'s timing."""
    return SimpleNamespace(
        name="target", max_context=max_context, kernel_timing=choice.to_time(key), fingerprint=f"{key}|positions"
    )


def test_the_choice_is_timed_on_each_kernel_once_then_read_from_the_cache(monkeypatch, tmp_path):
    curves = {0: {1: 0.03, 16: 0.20, 32: 0.40, 64: 0.70}, 1: {1: 0.03, 16: 0.25, 32: 0.30, 64: 0.50}}
    choice, timed = _timing(monkeypatch, tmp_path, curves)
    logged = []
    assert choose_kernels(_target(choice), logged.append) == 32
    assert timed == [0, 1] and choice.stock_rows == 32 and len(logged) == 1
    assert choice.apart_rows == 32  # 64 and 32 rows save more than a one-row pass: 0.20 and 0.10 s
    assert choose_kernels(_target(choice), logged.append) is None  # chosen: nothing left to time
    choice.stock_rows = None
    # Another context length or slot count (another fingerprint), the same file, threads and
    # device: the choice is read from the cache, no pass timed again.
    choice.apart_rows = 0
    assert choose_kernels(_target(choice, max_context=8192), logged.append) == 32
    assert timed == [0, 1] and choice.stock_rows == 32 and choice.apart_rows == 32
    choice.stock_rows = None
    assert choose_kernels(_target(choice, key="llamacpp|target|1 threads|cpu"), logged.append) == 32
    assert timed == [0, 1, 0, 1]  # other threads: timed again


def test_the_stock_curve_is_judged_from_two_rows_its_one_row_step_runs_repacked(monkeypatch, tmp_path):
    # A 2-core AMD EPYC (AVX-512): the stock kernels' 2-row piece costs more than two one-row
    # steps (which run repacked in both curves), yet the curve is the idle machine's own.
    repacked = {1: 0.031, 2: 0.052, 4: 0.085, 8: 0.177, 16: 0.223, 32: 0.397, 64: 0.705}
    stock = {1: 0.031, 2: 0.078, 4: 0.118, 8: 0.223, 16: 0.245, 32: 0.348, 64: 0.540}
    choice, timed = _timing(monkeypatch, tmp_path, {0: repacked, 1: stock})
    assert choose_kernels(_target(choice), lambda line: None) == 32 and choice.apart_rows == 32
    choice.stock_rows, choice.apart_rows = None, 0
    assert choose_kernels(_target(choice), lambda line: None) == 32 and choice.apart_rows == 32
    assert timed == [0, 1]  # cached: the second run timed nothing


def test_a_choice_timed_on_a_busy_machine_is_not_cached(monkeypatch, tmp_path):
    busy = {1: 0.03, 64: 9.0}  # 64 rows slower than 64 one-row passes: not this machine's curve
    choice, _ = _timing(monkeypatch, tmp_path, {0: busy, 1: busy})
    assert choose_kernels(_target(choice), lambda line: None) == 0
    assert not (tmp_path / "costs.json").exists()


def test_a_context_too_short_to_time_both_kernels_keeps_every_product_repacked(monkeypatch, tmp_path):
    choice, timed = _timing(monkeypatch, tmp_path, {})
    assert choose_kernels(_target(choice, max_context=256), lambda line: None) == 0
    assert timed == [] and choice.stock_rows == 0
