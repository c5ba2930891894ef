"""Slots that run generations off the event loop, with admission control.

A ``LanguageModel`` holds one KV cache, so it serves one generation at a time. Each slot
(a ``Slot``, with no thread of its own) therefore gets forks of the loaded models (weights
shared, caches separate). A request takes the idle slot whose cache holds the longest start
of its prompt, and its generation (``SpeculativeEngine.steps``) joins the server's one
``Scheduler``, which runs every slot's passes together in rounds. Requests beyond the slots
wait in a bounded queue; beyond that ``admit`` refuses them (the server answers 429).

The scheduler asks a job's cancel flag at every round, so a client that goes away or a
request that runs out of time stops the work within one pass.
"""

from __future__ import annotations

import asyncio
import copy
import threading
import time
from collections.abc import AsyncIterator, Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, cast

from draftwise.api.monitoring import ServerMetrics
from draftwise.config import DrafterName, GenerationConfig, PacingConfig
from draftwise.drafters import Drafter, Sources, build_drafter, text_bridge
from draftwise.engine import PreparedRun, SpeculativeEngine
from draftwise.errors import DraftwiseError
from draftwise.events import StepEvent
from draftwise.grammar import Grammars, grammars_of
from draftwise.lm import LanguageModel, Tokenizer, cached_start
from draftwise.prediction import encode_prediction
from draftwise.profile import CostProfile
from draftwise.scheduler import Scheduler
from draftwise.suffix import SuffixStore
from draftwise.target import LocalTarget


class QueueFull(DraftwiseError):
    """Every slot is busy and the waiting queue is full (the server answers 429)."""

    exit_code = 1
    status = 429


class GenerationTimeout(DraftwiseError):
    """The request ran past its deadline, queueing included (the server answers 504)."""

    exit_code = 1
    status = 504


def make_drafter(name: DrafterName, draft: LanguageModel | None, target_tokenizer: Tokenizer | None) -> Drafter | None:
    """The drafter a request asked for (``target_tokenizer``: see ``text_bridge``); ``None`` is plain
    decoding. A drafter that needs a draft model never comes here without one: ``plan``
    (``draftwise.api.translate``) refuses it first, with a 400."""
    if name == "off":
        return None
    return build_drafter(name, draft, target_tokenizer)


@dataclass
class Slot:
    """One generation's place: the models it runs on (forks with a KV cache of their own)
    and what every slot shares. Its passes run in the scheduler's rounds, on no thread of
    its own."""

    target: LanguageModel
    draft: LanguageModel | None
    # What drafting costs here, learnt by every request of every slot (see CostProfile):
    # one profile for the server's slots, whose passes run together.
    profile: CostProfile = field(default_factory=CostProfile)
    # The target's tokenizer where the draft speaks another vocabulary (see text_bridge).
    target_tokenizer: Tokenizer | None = None
    # Compiles requests' grammars for the target's vocabulary (one for every slot).
    grammars: Grammars | None = None
    # What the server wrote for earlier requests, by scope (one for every slot); None: kept nowhere.
    suffix: SuffixStore | None = None

    def engine(self, drafter: DrafterName, scope: str | None = None) -> SpeculativeEngine:
        """An engine for one request; ``scope``: whose earlier outputs it may draft from
        (``SuffixStore.scope``), None for none. A request decoding plainly drafts from nothing."""
        drafting = make_drafter(drafter, self.draft, self.target_tokenizer)
        if drafting is not None and scope is not None and self.suffix is not None:
            drafting = Sources((drafting, self.suffix.drafter(scope)))
        return SpeculativeEngine(
            LocalTarget(self.target),
            drafting,
            self.target.tokenizer,
            profile=self.profile,
            grammars=self.grammars,
        )

    def prepare(
        self,
        drafter: DrafterName,
        prompt: Sequence[int],
        config: GenerationConfig,
        prediction_ids: Sequence[int] | None = None,
        scope: str | None = None,
    ) -> tuple[SpeculativeEngine, PreparedRun]:
        """A request's engine and its run, prepared (``SpeculativeEngine.prepare``): all that
        takes time in proportion to its text (its prediction encoded, or its ids where its
        check read them already, and read back; the drafters' reading of the prompt; the
        policy's tables; its grammar's constraint) and touches no KV cache. The pool runs it
        on its setup thread, never in the rounds every stream waits on."""
        engine = self.engine(drafter, scope)
        prediction = None
        if config.prediction is not None and self.target.tokenizer is not None:
            prediction = encode_prediction(self.target.tokenizer, config.prediction, prediction_ids)
        return engine, engine.prepare(prompt, config, prediction)


def build_slots(
    target: LanguageModel,
    draft: LanguageModel | None,
    count: int,
    profile: CostProfile | None = None,
    suffix: SuffixStore | None = None,
) -> list[Slot]:
    """``count`` slots over the weights of ``target`` and ``draft``: the first takes the
    given models themselves, the others forks of them, so a model loaded with N slots serves
    N slots (``load_pair``; on llama.cpp a fork past the slots is refused). A caller that
    keeps using its models hands over forks. They share one copy of ``profile``, and
    ``suffix``."""

    def fork(lm: LanguageModel | None, i: int) -> LanguageModel | None:
        return lm if lm is None or i == 0 else lm.fork()

    target_tokenizer = text_bridge(target.tokenizer, draft)  # forks share their models' tokenizers
    grammars = grammars_of(target)
    shared = copy.deepcopy(profile) if profile is not None else CostProfile()
    return [
        Slot(cast(LanguageModel, fork(target, i)), fork(draft, i), shared, target_tokenizer, grammars, suffix)
        for i in range(count)
    ]


class Job:
    """One admitted request: queued, then running on a slot, then done."""

    def __init__(self, pool: SlotPool, arrived: float) -> None:
        self.pool = pool
        self.arrived = arrived  # perf_counter() at admission
        self.state = "queued"  # queued -> running -> done
        self.cancel_flag = threading.Event()
        self.cancel_reason: str | None = None
        self.cached_tokens = 0  # prompt tokens its slot held already (not prefilled again)

    def cancel(self, reason: str) -> None:
        if self.cancel_reason is None:
            self.cancel_reason = reason
        self.cancel_flag.set()

    def close(self, reason: str = "disconnect") -> None:
        """The client is done with this job, whatever state it is in (idempotent)."""
        self.pool.close_job(self, reason)


_END = object()


class SlotPool:
    """The server's slots, the queue of requests waiting for one, and the scheduler that
    runs the generations of the slots taken."""

    def __init__(
        self,
        slots: Sequence[Slot],
        queue_size: int,
        timeout: float,
        metrics: ServerMetrics,
        pacing: PacingConfig = PacingConfig(),
    ) -> None:
        self.size = len(slots)
        # What the slots keep of earlier outputs to draft from (one store for all of them).
        self.suffix = slots[0].suffix if slots and isinstance(slots[0], Slot) else None
        self.queue_size = queue_size
        self.timeout = timeout
        self.metrics = metrics
        # The idle slots, and a count of them to wait on: a request takes the one whose cache
        # holds the longest start of its prompt (``_take``), not the one idle longest.
        self._idle: list[Slot] = list(slots)
        self._free = asyncio.Semaphore(len(slots))
        # What a request needs before its first pass and costs time in proportion to its text
        # (``Slot.prepare``: its prediction encoded and read back, the drafters' reading of the
        # prompt) runs here: not on the event loop, not in the rounds every stream waits on.
        self._setup = ThreadPoolExecutor(max_workers=1, thread_name_prefix="draftwise-setup")
        self.scheduler = _paced(Scheduler(pacing=pacing), slots).start()
        self._jobs: set[Job] = set()  # admitted and not done
        self.running = 0

    @property
    def waiting(self) -> int:
        return len(self._jobs) - self.running

    def _update_gauges(self) -> None:
        self.metrics.queue_depth.set(self.waiting)
        self.metrics.active.set(self.running)

    def admit(self) -> Job:
        """Take a place for a new request, or raise ``QueueFull``."""
        if len(self._jobs) >= self.size + self.queue_size:
            self.metrics.rejected.inc()
            # Admitted jobs beyond one per slot wait; ``waiting`` would count too many while a
            # freed slot is on its way to the next job (``running`` not yet raised).
            waiting = len(self._jobs) - self.size
            raise QueueFull(f"all {self.size} slots are busy and {waiting} requests are waiting")
        job = Job(self, time.perf_counter())
        self._jobs.add(job)
        self._update_gauges()
        return job

    def close_job(self, job: Job, reason: str) -> None:
        if job.state == "queued":  # never reached a slot: just give its place back
            job.state = "done"
            job.cancel(reason)
            self._jobs.discard(job)
            self.metrics.cancelled.labels(reason).inc()
            self.metrics.generations.labels(reason).inc()
            self._update_gauges()
        elif job.state == "running":
            job.cancel(reason)  # the scheduler ends it at its next round and counts it

    def _release(self, job: Job, slot: Slot) -> None:
        job.state = "done"
        self._jobs.discard(job)
        self.running -= 1
        self._idle.append(slot)
        self._free.release()
        self._update_gauges()

    def _take(self, prompt: Sequence[int]) -> Slot:
        """The idle slot whose target holds the longest start of ``prompt`` (a shared system
        prompt, a chat's earlier turns); among equals, the one idle longest. Call only after
        acquiring ``_free``.

        Example: idle slots holding ``[5 8 2]`` and ``[5 8 3 1]``, prompt ``[5 8 3 9]``: the
        second (3 tokens kept against 2).
        """
        best = max(range(len(self._idle)), key=lambda i: (cached_start(self._idle[i].target, prompt), -i))
        return self._idle.pop(best)

    async def run(
        self,
        job: Job,
        prompt: Sequence[int],
        config: GenerationConfig,
        drafter: DrafterName,
        cache_prompt: bool = True,
        prediction_ids: Sequence[int] | None = None,
        scope: str | None = None,
    ) -> AsyncIterator[StepEvent]:
        """Wait for a slot, generate on it in the scheduler's rounds, and yield its step
        events. With ``cache_prompt``, the slot keeps what its target still holds of the
        prompt's start. ``prediction_ids``: the config's prediction's ids where the request's
        check read them already (``check_prediction``). ``scope``: whose earlier outputs it
        drafts from, and where its own goes once it has finished (``SuffixStore``)."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.timeout - (time.perf_counter() - job.arrived)
        try:
            await asyncio.wait_for(self._free.acquire(), max(0.0, deadline - loop.time()))
        except asyncio.TimeoutError:
            job.close("timeout")
            raise GenerationTimeout(f"no slot became free within {self.timeout:g} s") from None
        if job.state != "queued":  # closed while it waited
            self._free.release()
            return
        slot = self._take(prompt if cache_prompt else ())
        job.state = "running"
        self.running += 1
        self.metrics.queue_wait.observe(time.perf_counter() - job.arrived)
        self._update_gauges()
        if not cache_prompt:
            slot.target.reset()
        job.cached_tokens = cached_start(slot.target, prompt)
        self.metrics.cached_prompt_tokens.inc(job.cached_tokens)
        events: asyncio.Queue[Any] = asyncio.Queue()
        sink = _JobSink(job, self.metrics, loop, events.put_nowait, lambda: self._release(job, slot))
        if scope is not None and slot.suffix is not None:
            sink.finished_output = self._keeper(slot.suffix, scope, prompt)
        try:
            engine, prepared = await loop.run_in_executor(
                self._setup, slot.prepare, drafter, prompt, config, prediction_ids, scope
            )
        except Exception as exc:  # ends as a failure of its run would: counted, handed to the reader
            sink.end(None, exc)
        except BaseException:  # cancelled while it was prepared: the slot goes back
            self._release(job, slot)
            raise
        else:
            try:
                self.scheduler.submit(engine.steps(prepared), sink, job.cancel_flag.is_set)
            except BaseException:
                self._release(job, slot)
                raise
        try:
            while True:
                try:
                    item = await asyncio.wait_for(events.get(), max(0.0, deadline - loop.time()))
                except asyncio.TimeoutError:
                    job.cancel("timeout")
                    raise GenerationTimeout(f"the request took longer than {self.timeout:g} s") from None
                if item is _END:
                    return
                if isinstance(item, Exception):
                    raise item
                yield item
        finally:
            # Reached on normal completion too, where it changes nothing: the stream has
            # already ended.
            job.cancel("disconnect")

    def _keeper(self, store: SuffixStore, scope: str, prompt: Sequence[int]) -> Callable[[list[int]], None]:
        """What keeps a finished output in ``store``: on the setup thread, off the rounds."""

        def keep(output: list[int]) -> None:
            try:
                self._setup.submit(store.add, scope, prompt, output)
            except RuntimeError:  # shut down: the server is closing
                pass

        return keep

    def close(self) -> None:
        """Stop every generation after the round under way."""
        for job in list(self._jobs):
            job.cancel("shutdown")
        self.scheduler.close()
        self._setup.shutdown(wait=False)


def _paced(scheduler: Scheduler, slots: Sequence[Slot]) -> Scheduler:
    """``scheduler``, pricing the target's batched passes by the shared cost profile's pass
    curve (calibrated, then learnt), so that a long prompt goes in pieces sized in time
    beside the streams that are generating (``Scheduler.pace``). Prompts are the target's:
    a draft model only ever serves generating streams."""
    first = slots[0] if slots else None
    if isinstance(first, Slot) and first.target.batch is not None:
        profile = first.profile
        scheduler.pace(first.target.batch, lambda rows: profile.pass_times.at(rows, rising=True))
    return scheduler


class _JobSink:
    """A job's stream as the scheduler runs it: each event to the metrics and the event loop;
    at the end, the count of how it ended and the slot back (on the event loop)."""

    def __init__(
        self,
        job: Job,
        metrics: ServerMetrics,
        loop: asyncio.AbstractEventLoop,
        put: Callable[[Any], None],
        release: Callable[[], None],
    ) -> None:
        self.job, self.metrics, self.loop, self.put, self.release = job, metrics, loop, put, release
        self.first = True
        self.finished = False
        # Handed the whole output of a run that finished (not cancelled, not failed).
        self.finished_output: Callable[[list[int]], None] | None = None
        self._output: list[int] = []

    def _soon(self, fn: Callable[..., None], *args: Any) -> None:
        """``fn(*args)`` on the event loop."""
        try:
            self.loop.call_soon_threadsafe(fn, *args)
        except RuntimeError:  # the loop has closed (shutdown): nobody is listening any more
            pass

    def event(self, item: Any) -> None:
        event: StepEvent = item
        self.metrics.observe_step(event, time.perf_counter() - self.job.arrived if self.first else None)
        self.first = False
        self.finished = event.finished
        if self.finished_output is not None:
            self._output.extend(event.tokens)
            if event.finish_reason == "error":  # the target went away mid-answer: not an output to keep
                self.finished_output = None
        if event.finished:
            self.metrics.generations.labels(event.finish_reason or "stop").inc()
        self._soon(self.put, event)

    def end(self, result: Any, error: BaseException | None) -> None:
        if error is not None:  # handed to the consumer, which reports it to the client
            self.metrics.generations.labels("error").inc()
            self._soon(self.put, error)
        elif not self.finished:  # cancelled between steps, or during the prefill
            reason = self.job.cancel_reason or "disconnect"
            self.metrics.cancelled.labels(reason).inc()
            self.metrics.generations.labels(reason).inc()
        elif self.finished_output is not None:
            self.finished_output(self._output)
        self._soon(self.put, _END)
        self._soon(self.release)
