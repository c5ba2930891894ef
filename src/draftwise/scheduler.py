"""Many streams, one loop over rounds: how a server runs its generations.

Each stream is a generator that yields the passes it needs (``draftwise.lm.Forward``) and
the events it makes, as ``SpeculativeEngine.steps`` does; a remote verifier's request is a
stream of one pass. The scheduler runs them all on one thread, in rounds:

1. **Admit** the streams submitted since the last round.
2. **Advance** every stream that is not waiting for a pass: send it the scores of the pass
   it waited for (or throw in why that pass failed), and run it to the next pass it asks
   for, handing its events to its sink on the way. A stream whose request was cancelled is
   closed here, at the first round after: a dropped prefill frees its slot within a pass.
3. **Pass**: the pending passes over one model's sequences (one ``Batch``) go into one
   batched pass: every stream's step or block of the target in one, every drafting
   stream's next draft position of the draft model in another. A long prompt is fed in
   pieces over several rounds, beside everybody's steps. Alone, a piece is as large as the
   batch's row budget (the first token comes soonest so); beside streams that wait on the
   round, a piece is sized in time, by the model's measured pass curve (``pace``) and how
   much slower than it the last passes ran: the pieces add at most ``piece_seconds`` to
   each of their steps (a step of several rounds, a draft and its check, included), so no
   prompt stalls the others' text. Where pieces of the size the bound allows run on faster
   kernels in a pass of their own (``Batch.apart_from``: llama.cpp's stock kernels on CPUs
   where they beat the repacked ones), the pieces go in a pass of their own, then the steps
   in another; the steps' tokens come from the same kernels either way.

Nothing waits on a clock: a round starts as soon as the last one ended, with what every
stream has asked for by then, as llama-server's loop does. Streams advance in the order
they came. Where prompt pieces are sized in rows (a stream alone, or no pass curve known),
the same requests in the same order make the same passes; sized in time beside others,
the pieces follow how long the last passes took, so the passes can differ from run to run
(with ``--exact`` the tokens cannot: every row rounds as it would alone).

Example: streams A (plain decoding), B (drafting 3 tokens with a draft model) and C (a new
request whose prompt has 150 tokens, 149 of them prefilled), a row budget of 64 and no pass
curve, the smallest requests first. Round 1: a target pass with A's step and 63 of C's
prompt tokens, and a draft pass with B's first position. Round 2: the same, with C's next 63
and B's second position. Round 3: A's step and C's last 23; B's third position. Round 4: one
target pass holds A's step, B's block (4 rows: its last token and the 3 drafted) and C's
first step. With a curve that prices 100 rows at ``piece_seconds`` more than one, C's prompt
would go in pieces of 99 rows beside A's step (never fewer than ``piece_min_rows``).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Generator
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any, Protocol, TypeVar

import torch

from draftwise.config import MAX_BLOCK, PacingConfig
from draftwise.lm import Batch, Forward, Passes
from draftwise.pacing import Curve, Pace, never, piece_rows

# A stream that has made no event yet and asks for more rows than this before its first is
# feeding a prompt, which goes in pieces; with fewer it waits on the round as a generating
# stream does (a remote verifier's block, a short prompt): a block holds at most the longest
# draft a config allows and the token before it.
STEP_ROWS = MAX_BLOCK + 1

T = TypeVar("T")
# A stream: the passes it asks for (sent their scores) and its events; what it returns ends it.
Stream = Generator[Any, torch.Tensor, Any]


class Sink(Protocol):
    """Where a stream's events go (called on the scheduler's thread: keep it short)."""

    def event(self, item: Any) -> None:
        """An event the stream made."""

    def end(self, result: Any, error: BaseException | None) -> None:
        """The stream ended: returned ``result``, failed with ``error``, or was cancelled
        (``result`` None, ``error`` None); called once."""


@dataclass(eq=False)
class _Task:
    stream: Stream
    sink: Sink
    cancelled: Callable[[], bool]
    waiting: Forward | None = None  # the pass it asked for and has not been sent yet
    decoding: bool = False  # it made an event: every pass it asks for is a step of its output
    # Seconds prompt pieces added to the rounds since its last event (before its first: its
    # last pass), as priced (``pace``).
    paused: float = 0.0


@dataclass
class RoundStats:
    """What the rounds have done so far, and where the round thread's time went: in passes,
    or between them (step 2: the streams' own work, and the setup of those just admitted,
    which every other stream waits for)."""

    rounds: int = 0
    passes: int = 0  # batched passes (and passes run alone), over every model
    advancing: float = 0.0  # seconds in step 2, over every round
    passing: float = 0.0  # seconds in step 3's passes, over every round
    slowest_advance: float = 0.0  # the longest step 2 of a round that admitted no stream
    slowest_admission: float = 0.0  # the longest step 2 of a round that admitted one or more

    def advanced(self, seconds: float, admitted: bool) -> None:
        self.advancing += seconds
        if admitted:
            self.slowest_admission = max(self.slowest_admission, seconds)
        else:
            self.slowest_advance = max(self.slowest_advance, seconds)


@dataclass(eq=False)
class Scheduler:
    """Runs submitted streams in rounds on a thread of its own (``start``), or, in tests,
    round by round (``round``)."""

    name: str = "draftwise-rounds"
    stats: RoundStats = field(default_factory=RoundStats)
    pacing: PacingConfig = PacingConfig()  # how long prompts go in pieces beside generating streams

    def __post_init__(self) -> None:
        self._cond = threading.Condition()
        self._inbox: list[_Task] = []
        self._tasks: list[_Task] = []
        self._closed = False
        self._thread: threading.Thread | None = None
        self._paces: list[Pace] = []

    def pace(self, batch: Batch, curve: Curve, others: Callable[[], bool] = never) -> None:
        """Price ``batch``'s passes by ``curve`` (its model's pass times): beside streams that
        wait on the round, its long prompts go in pieces that add at most ``piece_seconds`` to
        each of their steps. ``others``: whether streams that are not in the rounds now will
        want a pass soon (a verifier's sessions, between one verify and the next); while it
        says so, pieces are priced as if one waited. A batch with no curve feeds pieces of its
        own row budget. Call before ``start``."""
        self._paces.append(Pace(batch, curve, others, self.pacing))

    def submit(self, stream: Stream, sink: Sink, cancelled: Callable[[], bool] = never) -> None:
        """Run ``stream`` from the next round on."""
        with self._cond:
            if self._closed:
                raise RuntimeError("the scheduler is closed")
            self._inbox.append(_Task(stream, sink, cancelled))
            self._cond.notify()

    def run(self, passes: Passes[T]) -> T:
        """Run ``passes`` in the rounds and wait for its result (from another thread)."""
        future: Future[T] = Future()
        self.submit(passes, _FutureSink(future))
        return future.result()

    def start(self) -> Scheduler:
        self._thread = threading.Thread(target=self._loop, name=self.name, daemon=True)
        self._thread.start()
        return self

    def close(self, timeout: float | None = None) -> None:
        """Stop after the round under way; every stream left is closed as cancelled."""
        with self._cond:
            self._closed = True
            self._cond.notify()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout)

    def _loop(self) -> None:
        try:
            while self._wait():
                self.round()
        finally:
            for task in self._tasks + self._inbox:
                _close(task)
            self._tasks, self._inbox = [], []

    def _wait(self) -> bool:
        """Sleep while there is nothing to run; False once closed."""
        with self._cond:
            while not self._closed and not self._tasks and not self._inbox:
                self._cond.wait()
            return not self._closed

    def _admit(self) -> int:
        """Step 1: take the streams submitted since the last round; how many."""
        with self._cond:
            self._tasks.extend(self._inbox)
            admitted = len(self._inbox)
            self._inbox.clear()
        return admitted

    def round(self) -> None:
        """One round: admit, advance every stream to its next pass, run the passes."""
        admitted = self._admit()
        started = time.perf_counter()
        self._tasks = [task for task in self._tasks if _advance(task)]  # step 2
        self.stats.advanced(time.perf_counter() - started, admitted > 0)
        groups: dict[int, tuple[Batch | None, list[Forward]]] = {}
        for task in self._tasks:
            assert task.waiting is not None
            batch = task.waiting.lm.batch
            groups.setdefault(id(batch) if batch is not None else id(task), (batch, []))[1].append(task.waiting)
        self._passes(list(groups.values()))  # step 3
        self.stats.rounds += 1

    def _passes(self, groups: list[tuple[Batch | None, list[Forward]]]) -> None:
        """Step 3: a pass of each batch. Beside streams that wait on the round, a batch with a
        curve takes only the prompt pieces that fit what is left of their budget: a step of
        several rounds (a draft, then its check) is paused at most ``piece_seconds`` in all."""
        feeds = {id(task.waiting) for task in self._tasks if _feeding(task)}
        waiting = [task for task in self._tasks if id(task.waiting) not in feeds]
        budget = self.pacing.piece_seconds - max((task.paused for task in waiting), default=0.0)
        for batch, forwards in groups:
            pace = self._pace(batch)
            if pace is not None and not waiting and not pace.others():
                pace = None
            for part, rows, added in _parts(forwards, feeds, pace, budget, self.pacing):
                if rows == 0:
                    continue  # only pieces here, and no time left for them before the others' next events
                started = time.perf_counter()
                fed = _step(batch, part, rows)
                seconds = time.perf_counter() - started
                if pace is not None and rows is not None:  # the pass that fed the pieces
                    pace.measured(fed, seconds)
                self.stats.passes += 1
                self.stats.passing += seconds
                budget -= added
                for task in waiting:
                    task.paused += added

    def _pace(self, batch: Batch | None) -> Pace | None:
        return next((pace for pace in self._paces if pace.batch is batch), None)


def _parts(
    forwards: list[Forward], feeds: set[int], pace: Pace | None, budget: float, pacing: PacingConfig
) -> list[tuple[list[Forward], int | None, float]]:
    """The passes of one batch in a round: (forwards, most rows, seconds its prompt pieces add
    to the steps of the streams that wait on it). One pass of them all, the pieces priced
    beside the steps; or, where the pieces the bound allows in a pass of their own are large
    enough to run on faster kernels there (``Batch.apart_from``), a pass of the pieces (it
    adds all its time) and then one of the steps. ``feeds``: ids of the forwards that feed
    prompt pieces; ``pace`` None: one pass, no bound.

    Example: a one-row step beside a 600-token prompt, a curve of 0.004 s a row, a budget of
    0.4 s. Pieces from 32 rows running apart: a pass of 100 of the prompt's rows, then one of
    the step. From 128 rows: one pass of the step and 100 of the prompt's rows.
    """
    if pace is None:
        return [(forwards, None, 0.0)]
    pieces = [forward for forward in forwards if id(forward) in feeds]
    steps = [forward for forward in forwards if id(forward) not in feeds]
    feeding = sum(len(forward.tokens) for forward in pieces)
    apart = pace.batch.apart_from()
    if pieces and steps and apart:
        rows, added = piece_rows(pace.price, 0, feeding, budget, pacing)
        if rows is not None and rows >= apart:
            return [(pieces, rows, added), (steps, None, 0.0)]
    rows, added = piece_rows(pace.price, sum(len(forward.tokens) for forward in steps), feeding, budget, pacing)
    return [(forwards, rows, added)]


def _feeding(task: _Task) -> bool:
    """Whether ``task`` asks for a piece of a long prompt: it has made no event yet, and its
    pass feeds more than a step's rows before its first (``Forward.after`` counts the rest).
    A stream that has made one is generating: its every pass is a step of its output, a draft
    model's catch-up included, and it waits on the round."""
    forward = task.waiting
    return forward is not None and not task.decoding and len(forward.tokens) + forward.after > STEP_ROWS


def _step(batch: Batch | None, forwards: list[Forward], rows: int | None = None) -> int:
    """One pass over ``forwards`` (one alone where the model does not batch), of at most
    ``rows`` rows (None: as many as the batch takes); the rows it fed (0: none, or unknown)."""
    try:
        if batch is not None:
            return batch.step(forwards, rows)
        for forward in forwards:
            forward.scores = forward.run()
    except Exception as exc:  # the pass failed: its streams learn why, the others go on
        for forward in forwards:
            if not forward.done:
                forward.error = exc
    return 0


def _advance(task: _Task) -> bool:
    """Step 2 for one stream: False once it has ended (its sink told)."""
    if task.cancelled():
        _close(task)
        return False
    waited = task.waiting
    if waited is not None and not waited.done:
        return True  # its pass is still being fed (a long prompt)
    if not task.decoding:  # a stream that makes no events (a verifier's request): a pass is its step
        task.paused = 0.0
    try:
        if waited is None:
            item = next(task.stream)
        elif waited.error is not None:
            item = task.stream.throw(waited.error)
        else:
            item = task.stream.send(waited.scores)  # type: ignore[arg-type]
        while not isinstance(item, Forward):
            task.sink.event(item)
            task.decoding, task.paused = True, 0.0
            if task.cancelled():
                _close(task)
                return False
            item = next(task.stream)
    except StopIteration as stop:
        task.sink.end(stop.value, None)
        return False
    except Exception as exc:  # the stream's own failure ends it, and no other
        task.sink.end(None, exc)
        return False
    task.waiting = item
    return True


def _close(task: _Task) -> None:
    """End a cancelled stream (its ``finally`` clauses run) and tell its sink."""
    error: BaseException | None = None
    try:
        task.stream.close()
    except Exception as exc:  # a cleanup that failed: still the stream's end
        error = exc
    task.sink.end(None, error)


class _FutureSink:
    """A stream of one result (``Scheduler.run``): no events."""

    def __init__(self, future: Future[Any]) -> None:
        self.future = future

    def event(self, item: Any) -> None:
        raise TypeError(f"a stream run for its result made an event: {item!r}")

    def end(self, result: Any, error: BaseException | None) -> None:
        if error is not None:
            self.future.set_exception(error)
        else:
            self.future.set_result(result)


class Collected:
    """A sink that keeps a stream's events, and how it ended."""

    def __init__(self) -> None:
        self.events: list[Any] = []
        self.ended = False
        self.result: Any = None
        self.error: BaseException | None = None

    def event(self, item: Any) -> None:
        self.events.append(item)

    def end(self, result: Any, error: BaseException | None) -> None:
        self.ended, self.result, self.error = True, result, error


def run_together(streams: list[Stream], scheduler: Scheduler | None = None) -> list[list[Any]]:
    """Run ``streams`` together in rounds on this thread, to their ends (``scheduler``: one
    not started, to read its stats after); each one's events, or the first one's error."""
    scheduler = scheduler if scheduler is not None else Scheduler()
    sinks = [Collected() for _ in streams]
    for stream, sink in zip(streams, sinks):
        scheduler.submit(stream, sink)
    while not all(sink.ended for sink in sinks):
        scheduler.round()
    for sink in sinks:
        if sink.error is not None:
            raise sink.error
    return [sink.events for sink in sinks]
