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
   pieces of the batch's row budget over several rounds, beside everybody's steps.

Nothing waits on a clock: a round starts as soon as the last one ended, with what every
stream has asked for by then, as llama-server's loop does. Streams advance in the order
they came, so the same requests in the same order make the same passes.

Example: streams A (plain decoding), B (drafting 3 tokens with a draft model) and C (a new
request whose prompt has 150 tokens, 149 of them prefilled), a row budget of 64, the
smallest requests first. Round 1: a target pass with A's step and 63 of C's prompt tokens,
and a draft pass with B's first position. Round 2: the same, with C's next 63 and B's second
position. Round 3: A's step and C's last 23; B's third position. Round 4: one target pass
holds A's step, B's block (4 rows: its last token and the 3 drafted) and C's first step.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Generator
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any, Protocol, TypeVar

import torch

from draftwise.lm import Batch, Forward, Passes

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


def _never() -> bool:
    return False


@dataclass(eq=False)
class _Task:
    stream: Stream
    sink: Sink
    cancelled: Callable[[], bool]
    waiting: Forward | None = None  # the pass it asked for and has not been sent yet


@dataclass
class RoundStats:
    """What the rounds have done so far."""

    rounds: int = 0
    passes: int = 0  # batched passes (and passes run alone), over every model


@dataclass(eq=False)
class Scheduler:
    """Runs submitted streams in rounds on a thread of its own (``start``), or, in tests,
    round by round (``round``)."""

    name: str = "draftwise-rounds"
    stats: RoundStats = field(default_factory=RoundStats)

    def __post_init__(self) -> None:
        self._cond = threading.Condition()
        self._inbox: list[_Task] = []
        self._tasks: list[_Task] = []
        self._closed = False
        self._thread: threading.Thread | None = None

    def submit(self, stream: Stream, sink: Sink, cancelled: Callable[[], bool] = _never) -> None:
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

    @property
    def active(self) -> int:
        """Streams admitted and not ended."""
        return len(self._tasks)

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

    def _admit(self) -> None:
        """Step 1: take the streams submitted since the last round."""
        with self._cond:
            self._tasks.extend(self._inbox)
            self._inbox.clear()

    def round(self) -> None:
        """One round: admit, advance every stream to its next pass, run the passes."""
        self._admit()
        self._tasks = [task for task in self._tasks if _advance(task)]  # step 2
        groups: dict[int, tuple[Batch | None, list[Forward]]] = {}
        for task in self._tasks:
            assert task.waiting is not None
            batch = task.waiting.lm.batch
            groups.setdefault(id(batch) if batch is not None else id(task), (batch, []))[1].append(task.waiting)
        for batch, forwards in groups.values():  # step 3
            _step(batch, forwards)
            self.stats.passes += 1
        self.stats.rounds += 1


def _step(batch: Batch | None, forwards: list[Forward]) -> None:
    """One pass over ``forwards`` (one alone where the model does not batch)."""
    try:
        if batch is not None:
            batch.step(forwards)
        else:
            for forward in forwards:
                forward.scores = forward.run()
    except Exception as exc:  # the pass failed: its streams learn why, the others go on
        for forward in forwards:
            if not forward.done:
                forward.error = exc


def _advance(task: _Task) -> bool:
    """Step 2 for one stream: False once it has ended (its sink told)."""
    if task.cancelled():
        _close(task)
        return False
    waited = task.waiting
    if waited is not None and not waited.done:
        return True  # its pass is still being fed (a long prompt)
    try:
        if waited is None:
            item = next(task.stream)
        elif waited.error is not None:
            item = task.stream.throw(waited.error)
        else:
            item = task.stream.send(waited.scores)  # type: ignore[arg-type]
        while not isinstance(item, Forward):
            task.sink.event(item)
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
