"""Workers that run generations off the event loop, with admission control.

A ``LanguageModel`` holds one KV cache, so it serves one generation at a time. Each worker
therefore gets forks of the loaded models (weights shared, caches separate) and runs
``SpeculativeEngine.stream`` in a thread. Requests beyond the workers
wait in a bounded queue; beyond that ``admit`` refuses them (the server answers 429).

A job's generation checks its cancel flag after every step, so a client that goes away or
a request that runs out of time stops the work within one block.
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
from draftwise.config import NEEDS_DRAFT_MODEL, DrafterName, GenerationConfig
from draftwise.drafters import Drafter, build_drafter, text_bridge
from draftwise.engine import SpeculativeEngine, grammars_of
from draftwise.errors import DraftwiseError
from draftwise.events import StepEvent
from draftwise.grammar import Grammars
from draftwise.lm import LanguageModel, Tokenizer, cached_start
from draftwise.policies import CostProfile
from draftwise.target import LocalTarget


class QueueFull(DraftwiseError):
    """Every worker is busy and the waiting queue is full (the server answers 429)."""

    exit_code = 1
    status = 429


class GenerationTimeout(DraftwiseError):
    """The request ran past its deadline, queueing included (the server answers 504)."""

    exit_code = 1
    status = 504


def make_drafter(name: DrafterName, draft: LanguageModel | None, through: Tokenizer | None) -> Drafter | None:
    """The drafter a request asked for (``through``: see ``text_bridge``); ``None`` is plain
    decoding."""
    if name == "off":
        return None
    if name in NEEDS_DRAFT_MODEL and draft is None:
        raise ValueError("this server has no draft model; use drafter 'ngram' or 'off'")
    return build_drafter(name, draft, through)


@dataclass
class Worker:
    target: LanguageModel
    draft: LanguageModel | None
    # What drafting costs here, learnt by every request this worker runs (see CostProfile).
    profile: CostProfile = field(default_factory=CostProfile)
    # The target's tokenizer where the draft speaks another vocabulary (see text_bridge).
    through: Tokenizer | None = None
    # Compiles requests' grammars for the target's vocabulary (one for every worker).
    grammars: Grammars | None = None

    def rest(self) -> None:
        """The generation ended: a backend that batches sequences stops waiting for this
        one's passes. The target keeps its cache, so the next request that starts the same
        way (a system prompt, the earlier turns of a chat) skips that part of its prefill;
        the draft model starts each request afresh anyway."""
        self.target.rest()
        if self.draft is not None:
            self.draft.reset()

    def engine(self, drafter: DrafterName) -> SpeculativeEngine:
        return SpeculativeEngine(
            LocalTarget(self.target),
            make_drafter(drafter, self.draft, self.through),
            self.target.tokenizer,
            profile=self.profile,
            grammars=self.grammars,
        )


def build_workers(
    target: LanguageModel,
    draft: LanguageModel | None,
    count: int,
    profile: CostProfile | None = None,
    *,
    own: bool = False,
) -> list[Worker]:
    """``count`` workers over the weights of ``target`` and ``draft``: forks, so the given
    models' own caches stay the caller's; with ``own``, the first worker takes the given
    models themselves (a model loaded with N slots then serves N workers, see ``load_pair``).
    Each starts from its own copy of ``profile``."""

    def fork(lm: LanguageModel | None, i: int) -> LanguageModel | None:
        return lm if lm is None or (own and i == 0) else lm.fork()

    through = text_bridge(target.tokenizer, draft)  # forks share their models' tokenizers
    grammars = grammars_of(target)
    return [
        Worker(
            cast(LanguageModel, fork(target, i)),
            fork(draft, i),
            copy.deepcopy(profile) if profile is not None else CostProfile(),
            through,
            grammars,
        )
        for i in range(count)
    ]


class Job:
    """One admitted request: queued, then running on a worker, then done."""

    def __init__(self, pool: WorkerPool, arrived: float) -> None:
        self.pool = pool
        self.arrived = arrived  # perf_counter() at admission
        self.state = "queued"  # queued -> running -> done
        self.cancel_flag = threading.Event()
        self.cancel_reason: str | None = None
        self.cached_tokens = 0  # prompt tokens its worker held already (not prefilled again)

    def cancel(self, reason: str) -> None:
        if self.cancel_reason is None:
            self.cancel_reason = reason
        self.cancel_flag.set()

    def close(self, reason: str = "disconnect") -> None:
        """The client is done with this job, whatever state it is in (idempotent)."""
        self.pool.close_job(self, reason)


_END = object()


class WorkerPool:
    def __init__(self, workers: Sequence[Worker], queue_size: int, timeout: float, metrics: ServerMetrics) -> None:
        self.size = len(workers)
        self.queue_size = queue_size
        self.timeout = timeout
        self.metrics = metrics
        self._idle: asyncio.Queue[Worker] = asyncio.Queue()
        for worker in workers:
            self._idle.put_nowait(worker)
        self._executor = ThreadPoolExecutor(max_workers=self.size, thread_name_prefix="draftwise-gen")
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
            # Admitted jobs beyond one per worker wait; ``waiting`` would count too many while a
            # freed worker is on its way to the next job (``running`` not yet raised).
            waiting = len(self._jobs) - self.size
            raise QueueFull(f"all {self.size} slots are busy and {waiting} requests are waiting")
        job = Job(self, time.perf_counter())
        self._jobs.add(job)
        self._update_gauges()
        return job

    def close_job(self, job: Job, reason: str) -> None:
        if job.state == "queued":  # never reached a worker: just give its place back
            job.state = "done"
            job.cancel(reason)
            self._jobs.discard(job)
            self.metrics.cancelled.labels(reason).inc()
            self.metrics.generations.labels(reason).inc()
            self._update_gauges()
        elif job.state == "running":
            job.cancel(reason)  # the worker stops after its current step and counts it

    def _release(self, job: Job, worker: Worker) -> None:
        job.state = "done"
        self._jobs.discard(job)
        self.running -= 1
        self._idle.put_nowait(worker)
        self._update_gauges()

    async def run(
        self,
        job: Job,
        prompt: Sequence[int],
        config: GenerationConfig,
        drafter: DrafterName,
        cache_prompt: bool = True,
    ) -> AsyncIterator[StepEvent]:
        """Wait for a worker, generate on it in a thread, and yield its step events. With
        ``cache_prompt``, the worker keeps what its target still holds of the prompt's start."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.timeout - (time.perf_counter() - job.arrived)
        try:
            worker = await asyncio.wait_for(self._idle.get(), max(0.0, deadline - loop.time()))
        except asyncio.TimeoutError:
            job.close("timeout")
            raise GenerationTimeout(f"no worker became free within {self.timeout:g} s") from None
        if job.state != "queued":  # closed while it waited
            self._idle.put_nowait(worker)
            return
        job.state = "running"
        self.running += 1
        self.metrics.queue_wait.observe(time.perf_counter() - job.arrived)
        self._update_gauges()

        events: asyncio.Queue[Any] = asyncio.Queue()

        def push(item: Any) -> None:
            try:
                loop.call_soon_threadsafe(events.put_nowait, item)
            except RuntimeError:  # the loop has closed (shutdown): nobody is listening any more
                pass

        if not cache_prompt:
            worker.target.reset()
        job.cached_tokens = cached_start(worker.target, prompt)
        self.metrics.cached_prompt_tokens.inc(job.cached_tokens)
        future = loop.run_in_executor(self._executor, self._produce, job, worker, prompt, config, drafter, push)
        future.add_done_callback(lambda _: self._release(job, worker))
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
            # Reached on normal completion too, where it changes nothing: the worker has
            # already left its loop.
            job.cancel("disconnect")

    def _produce(
        self,
        job: Job,
        worker: Worker,
        prompt: Sequence[int],
        config: GenerationConfig,
        drafter: DrafterName,
        push: Callable[[Any], None],
    ) -> None:
        """Worker thread: run the engine's stream, hand each event to the event loop."""
        metrics = self.metrics
        stream = None
        first = True
        try:
            # The cancel flag reaches into the prefill: a long prompt stops between chunks.
            stream = worker.engine(drafter).stream(prompt, config, job.cancel_flag.is_set)
            for event in stream:
                metrics.observe_step(event, time.perf_counter() - job.arrived if first else None)
                first = False
                push(event)
                if event.finished:
                    metrics.generations.labels(event.finish_reason or "stop").inc()
                    return
                if job.cancel_flag.is_set():
                    break
            # Cancelled between steps, or during the prefill (then the stream had no event).
            reason = job.cancel_reason or "disconnect"
            metrics.cancelled.labels(reason).inc()
            metrics.generations.labels(reason).inc()
        except Exception as exc:  # handed to the consumer, which reports it to the client
            metrics.generations.labels("error").inc()
            push(exc)
        finally:
            if stream is not None:
                stream.close()
            worker.rest()
            push(_END)

    def close(self) -> None:
        """Stop every generation after its current step and wait for the threads."""
        for job in list(self._jobs):
            job.cancel("shutdown")
        self._executor.shutdown(wait=True, cancel_futures=True)
