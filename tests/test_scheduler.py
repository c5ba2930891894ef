"""The round scheduler in closed form: streams of passes over a model that records each
batched pass, counted round by round (no clock, no thread but where the thread is the point),
then real engine streams on the tiny model against the same requests run alone."""

from __future__ import annotations

import threading

import pytest
import torch

from draftwise.config import DraftConfig, GenerationConfig, SamplingConfig
from draftwise.drafters import ModelDrafter, NGramDrafter
from draftwise.engine import SpeculativeEngine
from draftwise.lm import Forward, drive
from draftwise.scheduler import Collected, Scheduler, run_together
from draftwise.target import LocalTarget

V = 5


class RecordingBatch:
    """A batch that feeds at most ``rows`` rows a pass, smallest requests first, and records
    each pass as [(stream name, rows fed)]; a forward's scores are its tokens' count."""

    def __init__(self, rows: int = 8) -> None:
        self.rows = rows
        self.passes: list[list[tuple[str, int]]] = []

    def step(self, forwards) -> None:
        budget, record = self.rows, []
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
