"""The round scheduler in closed form: streams of passes over a model that records each
batched pass, counted round by round (no clock, no thread but where the thread is the point),
then real engine streams on the tiny model against the same requests run alone."""

from __future__ import annotations

import threading

import pytest
import torch

from draftwise.config import DraftConfig, GenerationConfig, PacingConfig, SamplingConfig
from draftwise.drafters import ModelDrafter, NGramDrafter
from draftwise.engine import SpeculativeEngine
from draftwise.lm import Forward, drive
from draftwise.pacing import Pace, piece_rows
from draftwise.scheduler import Collected, Scheduler, run_together
from draftwise.target import LocalTarget

PACING = PacingConfig()  # the default pacing
PIECE_SECONDS, PIECE_MIN_ROWS = PACING.piece_seconds, PACING.piece_min_rows

V = 5


class RecordingBatch:
    """A batch that feeds at most ``rows`` rows a pass, smallest requests first, and records
    each pass as [(stream name, rows fed)]; a forward's scores are its tokens' count."""

    def __init__(self, rows: int = 8, apart: int = 0) -> None:
        self.rows, self.apart = rows, apart
        self.passes: list[list[tuple[str, int]]] = []

    def apart_from(self) -> int:
        return self.apart

    def step(self, forwards, rows=None) -> None:
        budget, record = self.rows if rows is None else min(rows, self.rows), []
        for forward in sorted(forwards, key=lambda f: len(f.tokens) - (f.state or 0)):
            fed = forward.state or 0
            if forward.lm.refuse:
                forward.error = ValueError(f"{forward.lm.name} refuses")
                continue
            take = min(len(forward.tokens) - fed, budget)
            if take <= 0:
                break
            budget -= take
            forward.state = fed + take
            record.append((forward.lm.name, take))
            if forward.state == len(forward.tokens):
                forward.scores = torch.full((forward.last or len(forward.tokens), V), float(len(forward.tokens)))
        self.passes.append(record)
        return sum(n for _, n in record)


class FakeLM:
    def __init__(self, name: str, batch: RecordingBatch | None, refuse: bool = False) -> None:
        self.name, self.batch, self.refuse = name, batch, refuse
        self.alone: list[int] = []  # sizes of the passes run alone

    def forward(self, tokens, last=None):
        self.alone.append(len(tokens))
        return torch.zeros(last or len(tokens), V)


def stepping(lm, sizes: list[int], finished: list[str] | None = None):
    """A stream that asks for passes of ``sizes`` tokens and yields an event after each."""
    try:
        for size in sizes:
            scores = yield Forward(lm, [1] * size, last=1)
            yield (lm.name, int(scores[0, 0]))
        return len(sizes)
    finally:
        if finished is not None:
            finished.append(lm.name)


def test_each_round_holds_one_pass_with_every_stream_and_prompts_go_in_pieces():
    batch = RecordingBatch(rows=8)
    a, b, c = FakeLM("a", batch), FakeLM("b", batch), FakeLM("c", batch)
    scheduler = Scheduler()
    events = run_together([stepping(a, [1, 1, 1]), stepping(b, [4, 1]), stepping(c, [12, 1])], scheduler)
    assert batch.passes == [
        [("a", 1), ("b", 4), ("c", 3)],  # c's 12-token prompt: what the budget leaves
        [("a", 1), ("b", 1), ("c", 6)],
        [("a", 1), ("c", 3)],  # c's prompt is whole: its scores come back
        [("c", 1)],
    ]
    assert events == [[("a", 1)] * 3, [("b", 4), ("b", 1)], [("c", 12), ("c", 1)]]
    assert scheduler.stats.rounds == 5 and scheduler.stats.passes == 4


def test_the_same_streams_in_the_same_order_make_the_same_passes():
    def passes() -> list:
        batch = RecordingBatch(rows=6)
        lms = [FakeLM(name, batch) for name in "abcd"]
        run_together([stepping(lm, [7 - i, 1, 3, 1]) for i, lm in enumerate(lms)])
        return batch.passes

    assert passes() == passes()


def test_streams_over_two_models_get_a_pass_of_each_model_a_round():
    target, draft = RecordingBatch(), RecordingBatch()
    run_together([stepping(FakeLM("t", target), [1, 1]), stepping(FakeLM("d", draft), [1, 1])])
    assert target.passes == [[("t", 1)]] * 2 and draft.passes == [[("d", 1)]] * 2


def test_a_model_that_does_not_batch_runs_each_pass_alone():
    a, b = FakeLM("a", None), FakeLM("b", None)
    run_together([stepping(a, [3, 1]), stepping(b, [2])])
    assert a.alone == [3, 1] and b.alone == [2]


def _priced(rows: int) -> float:
    """A made-up pass curve: 1/32 s for one row, 1/256 s each row more (no row count lands on
    a bound exactly; the bound buys more rows than ``PIECE_MIN_ROWS``)."""
    return 1 / 32 + (rows - 1) / 256


def _pieces(batch: RecordingBatch, name: str) -> list[tuple[int, int]]:
    """(rows of ``name``'s prompt, rows of the whole pass) of each pass that fed a piece of it."""
    return [(dict(p)[name], sum(n for _, n in p)) for p in batch.passes if dict(p).get(name, 0) > 1]


@pytest.mark.parametrize("bound", [PIECE_SECONDS, 0.3])  # the default, and a server's --piece-seconds
def test_beside_a_decoding_stream_a_prompt_goes_in_pieces_priced_under_the_bound(bound):
    batch = RecordingBatch(rows=256)
    scheduler = Scheduler(pacing=PacingConfig(piece_seconds=bound))
    scheduler.pace(batch, _priced)
    run_together([stepping(FakeLM("a", batch), [1] * 40), stepping(FakeLM("c", batch), [600, 1])], scheduler)
    pieces, price = _pieces(batch, "c"), Pace(batch, _priced).price
    assert sum(rows for rows, _ in pieces) == 600
    for i, (rows, whole) in enumerate(pieces):
        assert whole == rows + 1  # every one rode with the decoding stream's step
        assert price(whole) <= price(1) + bound  # within the bound...
        assert i == len(pieces) - 1 or price(whole + 1) > price(1) + bound  # ...and as large as it allows
    assert all(p[0] == ("a", 1) for p in batch.passes[: len(pieces)])  # the step never waited a round


@pytest.mark.parametrize("bound", [PIECE_SECONDS, 0.6])  # a bound the floor of rows does not reach
def test_pieces_that_run_faster_alone_go_in_a_pass_of_their_own_before_the_step(bound):
    batch = RecordingBatch(rows=256, apart=32)
    scheduler = Scheduler(pacing=PacingConfig(piece_seconds=bound))
    scheduler.pace(batch, _priced)
    run_together([stepping(FakeLM("a", batch), [1] * 40), stepping(FakeLM("c", batch), [600, 1])], scheduler)
    pieces, price = _pieces(batch, "c"), Pace(batch, _priced).price
    assert sum(rows for rows, _ in pieces) == 600 and len(pieces) > 3
    for i, (rows, whole) in enumerate(pieces):
        assert whole == rows  # alone in its pass...
        assert batch.passes[2 * i + 1] == [("a", 1)]  # ...and the step in the next, the same round
        assert price(rows) <= bound  # the piece's whole pass within the bound...
        assert i == len(pieces) - 1 or price(rows + 1) > bound  # ...and as large as it allows
    assert sorted(batch.passes[2 * len(pieces)]) == [("a", 1), ("c", 1)]  # then one pass of both steps


def test_pieces_smaller_than_the_faster_kernels_need_ride_with_the_step():
    # The bound allows a piece of the floor alone (PIECE_MIN_ROWS); the faster kernels need 128.
    batch = RecordingBatch(rows=256, apart=128)
    scheduler = Scheduler(pacing=PacingConfig(piece_seconds=0.3))
    scheduler.pace(batch, _priced)
    run_together([stepping(FakeLM("a", batch), [1] * 40), stepping(FakeLM("c", batch), [600, 1])], scheduler)
    assert all(whole == rows + 1 for rows, whole in _pieces(batch, "c"))


def test_alone_a_prompt_goes_in_pieces_of_the_whole_row_budget():
    batch = RecordingBatch(rows=256)
    scheduler = Scheduler()
    scheduler.pace(batch, _priced)
    run_together([stepping(FakeLM("c", batch), [600, 1])], scheduler)
    assert batch.passes == [[("c", 256)], [("c", 256)], [("c", 88)], [("c", 1)]]


def test_alone_beside_streams_that_will_want_a_pass_soon_a_prompt_goes_in_priced_pieces():
    # A verifier's sessions are in the rounds only during a verify: between two, ``others`` says so.
    batch = RecordingBatch(rows=256)
    scheduler = Scheduler()
    scheduler.pace(batch, _priced, others=lambda: True)
    run_together([stepping(FakeLM("c", batch), [600, 1])], scheduler)
    pieces = _pieces(batch, "c")
    assert sum(rows for rows, _ in pieces) == 600
    assert len(pieces) > 3 and all(_priced(whole) <= PIECE_SECONDS for _, whole in pieces)


def test_a_stream_drafting_on_another_model_waits_on_the_round_too():
    target, draft = RecordingBatch(rows=256), RecordingBatch(rows=256)
    scheduler = Scheduler()
    scheduler.pace(target, _priced)
    run_together([stepping(FakeLM("b", draft), [1] * 40), stepping(FakeLM("c", target), [600, 1])], scheduler)
    pieces = _pieces(target, "c")
    assert len(pieces) > 3 and all(_priced(whole) <= PIECE_SECONDS for _, whole in pieces)


def test_pieces_are_priced_at_what_the_last_bounded_passes_took_against_the_curve():
    pace = Pace(RecordingBatch(), _priced)
    assert piece_rows(pace.price, 1, 600, PIECE_SECONDS)[0] == 90  # a one-row step beside a prompt
    pace.measured(26, 2 * _priced(26))  # deep into a long prompt, or on a busy machine
    assert pace.slower == 1.5 and piece_rows(pace.price, 1, 600, PIECE_SECONDS)[0] == 1 + PIECE_MIN_ROWS  # the floor
    pace.measured(26, _priced(26) / 10)  # a pass faster than the curve says: the curve stands
    assert pace.slower == 1.0


def test_past_a_step_s_rows_a_row_costs_no_less_than_in_a_pass_of_32():
    def flat(rows: int) -> float:  # a calibrated curve past its largest sizes: a line of no slope
        return _priced(min(rows, 49)) + max(0, rows - 49) / 10_000

    pace = Pace(RecordingBatch(), flat)
    assert pace.price(32) == _priced(32) and pace.price(200) == 200 * _priced(32) / 32
    rows, added = piece_rows(pace.price, 49, 600, PIECE_SECONDS)  # a block of 49 rows beside a prompt
    assert rows == 49 + 84 and added <= PIECE_SECONDS


def drafting(draft, target, k: int, steps: int):
    """A generating stream (its first token out) that drafts ``k`` tokens a step, a pass of
    ``draft`` each, then checks them in one pass of ``target``; one event a step."""
    yield (target.name, 0)
    for _ in range(steps):
        for _ in range(k):
            yield Forward(draft, [1], last=1)
        yield Forward(target, [1] * (k + 1), last=k + 1)
        yield (target.name, k)


def test_a_step_of_several_rounds_is_paused_by_the_bound_in_all():
    target, draft = RecordingBatch(rows=256), RecordingBatch(rows=256)
    scheduler = Scheduler()
    scheduler.pace(target, _priced)
    b = drafting(FakeLM("bd", draft), FakeLM("b", target), 3, 40)
    run_together([b, stepping(FakeLM("c", target), [600, 1])], scheduler)
    added, steps = 0.0, 0
    for record in target.passes:  # the passes that fed the prompt between two checks of b's drafts
        rows = dict(record)
        own, piece = rows.get("b", 0), rows.get("c", 0)
        own, piece = (own + piece, 0) if piece == 1 else (own, piece)  # c's own step, once its prompt is in
        added += _priced(own + piece) - (_priced(own) if own else 0.0)
        if rows.get("b"):
            assert added <= PIECE_SECONDS
            added, steps = 0.0, steps + 1
    assert steps == 40 and sum(dict(record).get("c", 0) for record in target.passes) == 601


def test_a_generating_stream_s_long_pass_is_a_step_of_it_and_the_prompt_still_waits_its_turn():
    # After its first event, a's passes are steps of its output whatever their size (a draft
    # model's catch-up): taken whole, and the prompt beside adds no more than the bound.
    batch = RecordingBatch(rows=256)
    scheduler = Scheduler()
    scheduler.pace(batch, _priced)
    run_together([stepping(FakeLM("a", batch), [1, 100] * 10), stepping(FakeLM("c", batch), [600, 1])], scheduler)
    for record in batch.passes[:10]:
        rows = dict(record)
        own = rows["a"]
        assert own in (1, 100) and _priced(own + rows.get("c", 0)) <= _priced(own) + PIECE_SECONDS


def test_a_stream_that_makes_no_events_is_paused_by_the_bound_at_each_pass():
    # A verifier's requests: passes and no events (each pass is its step).
    def passes(lm, n: int):
        for _ in range(n):
            yield Forward(lm, [1], last=1)

    batch = RecordingBatch(rows=256)
    scheduler = Scheduler()
    scheduler.pace(batch, _priced)
    run_together([passes(FakeLM("v", batch), 10), stepping(FakeLM("c", batch), [600, 1])], scheduler)
    assert [rows for rows, _ in _pieces(batch, "c")][:6] == [89] * 6


def test_on_a_model_slower_than_the_bound_a_prompt_still_moves_a_floor_of_rows_a_step():
    batch = RecordingBatch(rows=256)
    scheduler = Scheduler()
    scheduler.pace(batch, lambda rows: float(rows))  # a second a row: one row is over the bound
    run_together([stepping(FakeLM("a", batch), [1] * 10), stepping(FakeLM("c", batch), [300, 1])], scheduler)
    assert [rows for rows, _ in _pieces(batch, "c")] == [PIECE_MIN_ROWS] * 4 + [300 - 4 * PIECE_MIN_ROWS]


def test_without_a_price_known_a_prompt_goes_in_pieces_of_the_budget():
    batch = RecordingBatch(rows=256)
    scheduler = Scheduler()
    scheduler.pace(batch, lambda rows: None)
    run_together([stepping(FakeLM("a", batch), [1] * 4), stepping(FakeLM("c", batch), [600, 1])], scheduler)
    assert [rows for rows, _ in _pieces(batch, "c")] == [255, 255, 90]


def test_a_cancelled_stream_ends_at_the_next_round_and_the_others_go_on():
    batch = RecordingBatch(rows=4)
    finished: list[str] = []
    cancelled = threading.Event()
    scheduler = Scheduler()
    long, other = Collected(), Collected()
    scheduler.submit(stepping(FakeLM("long", batch), [20, 1], finished), long, cancelled.is_set)
    scheduler.submit(stepping(FakeLM("other", batch), [1, 1, 1], finished), other)
    scheduler.round()
    cancelled.set()  # the client goes away while the prompt is being fed
    scheduler.round()
    assert long.ended and long.error is None and long.result is None and long.events == []
    assert finished == ["long"]  # its finally ran (a target frees what the run held there)
    while not other.ended:
        scheduler.round()
    assert batch.passes == [[("other", 1), ("long", 3)], [("other", 1)], [("other", 1)]]
    assert other.result == 3


def test_a_failed_pass_fails_its_stream_and_no_other():
    batch = RecordingBatch()
    scheduler = Scheduler()
    bad, good = Collected(), Collected()
    scheduler.submit(stepping(FakeLM("bad", batch, refuse=True), [1]), bad)
    scheduler.submit(stepping(FakeLM("good", batch), [1, 1]), good)
    while not (bad.ended and good.ended):
        scheduler.round()
    assert isinstance(bad.error, ValueError) and "bad refuses" in str(bad.error)
    assert good.error is None and good.result == 2


def test_a_stream_that_handles_its_failed_pass_goes_on():
    batch = RecordingBatch()
    lm = FakeLM("x", batch, refuse=True)

    def handling():
        try:
            yield Forward(lm, [1])
        except ValueError as exc:
            yield f"refused: {exc}"
        return "done"

    sink = Collected()
    scheduler = Scheduler()
    scheduler.submit(handling(), sink)
    while not sink.ended:
        scheduler.round()
    assert sink.events == ["refused: x refuses"] and sink.result == "done"


def test_run_waits_on_the_thread_of_the_rounds_for_a_result():
    batch = RecordingBatch()
    scheduler = Scheduler().start()
    try:
        results = [None, None]

        def ask(i: int) -> None:
            lm = FakeLM(f"s{i}", batch)
            results[i] = scheduler.run(_result_of(lm, 3 + i))

        threads = [threading.Thread(target=ask, args=(i,)) for i in range(2)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(timeout=60)
        assert results == [3.0, 4.0]
    finally:
        scheduler.close(timeout=60)
    with pytest.raises(RuntimeError, match="closed"):
        scheduler.submit(_result_of(FakeLM("late", batch), 1), Collected())


def _result_of(lm, size: int):
    scores = yield Forward(lm, [1] * size)
    return float(scores[0, 0])


def test_close_ends_every_stream_left_as_cancelled():
    batch = RecordingBatch()
    finished: list[str] = []
    scheduler = Scheduler().start()
    gate = threading.Event()
    sink = Collected()

    def waiting():
        try:
            yield Forward(FakeLM("w", batch), [1])
            gate.wait(60)  # holds the round until the test closes the scheduler
            yield Forward(FakeLM("w", batch), [1])
        finally:
            finished.append("w")

    scheduler.submit(waiting(), sink)
    while not batch.passes:
        threading.Event().wait(0.01)
    scheduler.close(timeout=0.01)  # the round under way is held: it ends after the gate opens
    gate.set()
    scheduler.close(timeout=60)
    assert sink.ended and finished == ["w"]


# --- real streams on the tiny model ---------------------------------------------------------

GREEDY = GenerationConfig(max_new_tokens=12, ignore_eos=True, sampling=SamplingConfig(temperature=0))
PROMPTS = [[1, 2, 3, 4, 1, 2, 3], [7, 8, 9, 7, 8], [5, 6, 5, 6, 5, 6, 5], [11, 12, 13]]


@pytest.mark.parametrize("drafter", ["off", "ngram", "model"])
def test_engine_streams_in_rounds_give_what_each_gives_alone(tiny_target, tiny_same_draft, drafter):
    def engine(i: int) -> SpeculativeEngine:
        draft = {"off": None, "ngram": NGramDrafter(), "model": ModelDrafter(tiny_same_draft.fork())}[drafter]
        return SpeculativeEngine(LocalTarget(tiny_target.fork()), draft, tiny_target.tokenizer)

    config = GREEDY.model_copy(update={"draft": DraftConfig(k_policy="fixed", k=3)})
    alone = [engine(i).generate(p, config).tokens for i, p in enumerate(PROMPTS)]
    together = run_together([engine(i).steps(p, config) for i, p in enumerate(PROMPTS)])
    assert [[t for e in events for t in e.tokens] for events in together] == alone


def test_drive_runs_a_computation_of_passes_alone():
    lm = FakeLM("x", None)
    assert drive(_result_of(lm, 2)) == 0.0 and lm.alone == [2]


def test_the_round_thread_time_is_split_between_passes_and_the_work_between_them():
    """A stream whose setup (the code before its first pass) takes a while is seen in the
    round that admitted it, apart from the rounds that only advanced streams."""
    import time

    def slow_start(lm, seconds: float):
        time.sleep(seconds)  # what a request's setup on the round thread would cost
        yield from stepping(lm, [1, 1])

    batch = RecordingBatch(rows=8)
    scheduler = Scheduler()
    scheduler.submit(stepping(FakeLM("a", batch), [1, 1, 1, 1]), Collected())
    scheduler.round()  # a joins
    scheduler.submit(slow_start(FakeLM("b", batch), 0.05), Collected())
    for _ in range(4):
        scheduler.round()
    stats = scheduler.stats
    assert stats.slowest_admission >= 0.05 and stats.advancing >= stats.slowest_admission
    assert stats.rounds == 5 and stats.passing >= 0
