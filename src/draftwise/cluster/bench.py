"""``draftwise bench --ray``: the bench's prompts spread over Ray actors.

A unit of work is one prompt with every method run on it, interleaved, on one worker, exactly as
the local bench runs it (``UnitRunner``): every speedup stays a ratio measured on one machine.
Each worker is a Ray actor that loads the models once (and warms them up once). The driver,
this process, is the only writer of ``results.jsonl``: a unit's records are appended when the
unit comes back, each saying which node ran it and that node's CPU.

A worker that dies (killed, its node gone) loses only the unit it was running, which returns to
the queue for another worker, and a new worker takes its place; a record is never appended
twice. A worker that cannot start (a model missing on its node) stops the bench with the
worker's own error. Interrupted, the bench resumes like the local one: finished units are kept.
"""

from __future__ import annotations

import re
import secrets
from collections import deque
from dataclasses import dataclass
from typing import Any

from draftwise.bench.config import BenchConfig
from draftwise.bench.dataset import Prompt
from draftwise.bench.report import node_info
from draftwise.bench.runner import Bench, Recorder, UnitRunner, load_models, unit_keys
from draftwise.bench.store import Record
from draftwise.cluster.runtime import NAMESPACE, ClusterError, ray_session
from draftwise.errors import DraftwiseError
from draftwise.scale import BenchWorkers

WORKER_PREFIX = "draftwise-bench"  # workers are named actors: WORKER_PREFIX-RUN-N, in NAMESPACE
# With no worker running a unit, how long the bench waits for one to start (load its models).
START_TIMEOUT_S = 900.0


class BenchWorker:
    """A Ray actor: the models loaded once, units run on them by a ``UnitRunner``."""

    def __init__(self, config: BenchConfig, name: str, warm: Prompt | None) -> None:
        import ray

        pair = load_models(config)  # prepared as the local bench prepares it
        node = {**node_info(), "ray_node": ray.get_runtime_context().get_node_id(), "worker": name}
        self.runner = UnitRunner(config, pair, node)
        if warm is not None:
            self.runner.warm_up(warm)

    def ready(self) -> dict[str, Any]:
        """Where this worker runs (answered once its models are loaded)."""
        return self.runner.node

    def run_unit(self, index: int, prompt: Prompt, done: dict[str, Record]) -> list[Record]:
        """The records of ``prompt`` missing from ``done`` (its records already stored)."""
        records: list[Record] = []
        self.runner.run(index, prompt, done.get, records.append)
        return records


@dataclass
class _Unit:
    index: int  # position in the run order
    prompt: Prompt
    attempts: int = 0


@dataclass
class _Worker:
    name: str
    handle: Any
    unit: _Unit | None = None


class _Pool:
    """The bench's workers: starting, idle, or running a unit; a dead one is replaced."""

    def __init__(self, ray: Any, bench: Bench, options: BenchWorkers) -> None:
        self.ray = ray
        self.config = bench.config
        self.config_hash = bench.config_hash
        self.options = options
        self.warm = bench.prompts[0] if bench.config.warmup else None
        self.run_id = secrets.token_hex(3)
        self.actor = ray.remote(BenchWorker)
        self.started = 0
        self.starting: dict[Any, _Worker] = {}  # ready() ref -> worker
        self.running: dict[Any, _Worker] = {}  # run_unit() ref -> worker
        self.idle: list[_Worker] = []
        self.retried = 0  # units run again after their worker died
        self.lost_at_start = 0  # workers that died while loading their models
        for _ in range(options.workers):
            self.start()

    def start(self) -> None:
        name = f"{WORKER_PREFIX}-{self.run_id}-{self.started}"
        self.started += 1
        # max_restarts=0: a dead worker stays dead; the pool replaces it and re-queues its unit.
        handle = self.actor.options(
            name=name, namespace=NAMESPACE, num_cpus=self.options.cpus_per_worker, max_restarts=0
        ).remote(self.config, name, self.warm)
        self.starting[handle.ready.remote()] = _Worker(name, handle)

    def assign(self, queue: deque[_Unit], stored: Any) -> None:
        while self.idle and queue:
            worker, unit = self.idle.pop(), queue.popleft()
            unit.attempts += 1
            done = {
                key: r
                for key in unit_keys(unit.prompt, self.config, self.config_hash)
                if (r := stored(key)) is not None
            }
            worker.unit = unit
            self.running[worker.handle.run_unit.remote(unit.index, unit.prompt, done)] = worker

    def next_ready(self) -> Any:
        """The next ref to settle: a unit done, or a worker started (or dead)."""
        refs = [*self.running, *self.starting]
        if not refs:
            raise ClusterError("every bench worker is gone and none could be started")
        timeout = None if self.running else START_TIMEOUT_S
        ready, _ = self.ray.wait(refs, num_returns=1, timeout=timeout)
        if not ready:
            raise ClusterError(
                f"no bench worker started within {START_TIMEOUT_S:g} s: does the cluster have "
                f"{self.options.cpus_per_worker:g} CPU free for one?"
            )
        return ready[0]

    def stop(self) -> None:
        for worker in [*self.starting.values(), *self.running.values(), *self.idle]:
            self.ray.kill(worker.handle)


def _failed(exc: Exception) -> Exception:
    """The error a unit's failure becomes: a user-facing one as it is, anything else wrapped."""
    cause = getattr(exc, "cause", None)
    if isinstance(cause, DraftwiseError):
        return cause
    # Ray's message ends with the worker's own error, "module.SomeError: what went wrong".
    last = re.sub(r"^[\w.]+: ", "", str(exc).strip().splitlines()[-1])
    return ClusterError(f"a bench worker failed: {last}")


def _settle_start(pool: _Pool, ref: Any) -> None:
    worker = pool.starting.pop(ref)
    try:
        pool.ray.get(ref)
    except pool.ray.exceptions.RayActorError as exc:
        if exc.actor_init_failed:  # its models did not load: a setting, not bad luck; stop here
            raise _failed(exc) from None
        pool.lost_at_start += 1  # it died while starting (killed, its node gone): start another
        if pool.lost_at_start > pool.options.max_attempts * pool.options.workers:
            raise ClusterError(
                f"{pool.lost_at_start} bench workers died while loading their models (out of "
                "memory? see the Ray logs of the workers)"
            ) from None
        pool.start()
        return
    pool.idle.append(worker)


def _settle_unit(pool: _Pool, ref: Any, queue: deque[_Unit], recorder: Recorder) -> None:
    worker = pool.running.pop(ref)
    unit, worker.unit = worker.unit, None
    if unit is None:
        raise RuntimeError(f"bench worker {worker.name} answered without a unit")
    try:
        records = pool.ray.get(ref)
    except pool.ray.exceptions.RayActorError:
        # The worker died mid-unit: nothing of the unit was stored. Run it again elsewhere.
        if unit.attempts >= pool.options.max_attempts:
            raise ClusterError(
                f"prompt {unit.prompt.id} was tried {unit.attempts} times and its worker died "
                "each time (see the Ray logs of the workers)"
            ) from None
        queue.appendleft(unit)
        pool.retried += 1
        pool.start()
        return
    except pool.ray.exceptions.RayTaskError as exc:
        raise _failed(exc) from None
    for record in records:
        recorder.add(record)
    pool.idle.append(worker)


def measure_on_ray(bench: Bench, recorder: Recorder) -> int:
    """Run ``bench``'s pending units on Ray workers (``bench.config.ray``), appending each unit's
    records to its results as the unit comes back; return how many units ran again after their
    worker died. ``draftwise bench --ray`` passes this to ``run_bench`` as its ``measure``."""
    options = bench.config.ray
    if options is None:
        raise ValueError("measure_on_ray needs config.ray")
    queue = deque(_Unit(index, prompt) for index, prompt in bench.pending_units())
    with ray_session(options) as ray:
        pool = _Pool(ray, bench, options)
        try:
            while queue or pool.running:
                pool.assign(queue, bench.store.get)
                recorder.describe(f"{len(pool.running)} of {pool.started} workers busy, {len(queue)} prompts queued")
                ref = pool.next_ready()
                if ref in pool.starting:
                    _settle_start(pool, ref)
                else:
                    _settle_unit(pool, ref, queue, recorder)
        finally:
            pool.stop()
    return pool.retried
