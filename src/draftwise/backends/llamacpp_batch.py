"""Many sequences, one pass: a llama.cpp context that holds several sequences, and the thread
that runs its passes.

Every sequence (``draftwise.backends.llamacpp.LlamaCppModel``) hands its forward pass to the
``Batcher`` of its context and waits. The batcher's thread gathers what all of them have
pending into one ``llama_decode``: each row carries its sequence's ``seq_id``, its position
and whether its scores are wanted, and each sequence gets back its own score rows. On this
kind of CPU a pass over several rows costs little more than one (the quantized matrix
kernels work on rows in groups), so four streams that each add a token cost about one pass,
not four.

Scheduling, in each round:

1. Wait for a pending forward. Then wait a little (``GATHER_S``, or ``GATHER_SHARE`` of the
   last pass if longer) for the sequences of the last two passes to come back with their
   next one: a stream spends a few milliseconds between two passes checking its block, and a
   pass without it would cost it a whole pass. (Two passes, not one: streams that once missed
   a pass would otherwise settle into taking turns, each pass half full.) A sequence that was
   reset has ended its generation and is not waited for. While another context's pass keeps
   the decode thread at work (a draft model's passes, drafting the missing streams' blocks),
   wait longer, up to ``ALIGN_PASSES`` of this context's last pass: the wait costs the cores
   nothing, and the streams stay in step, so that every pass holds all of them.
2. Take rows up to the row budget (``rows``): the smallest requests first, so that a long
   prompt never holds up the others' one-token steps; a prompt longer than what is left is
   fed in pieces over several rounds, mixed with everybody's steps.
3. One ``llama_decode``; copy each finished request's score rows out of llama.cpp's buffer
   (the next pass overwrites it), and wake its sequence.

Rollback is bookkeeping: a request starts at its sequence's current length, and before it is
fed the cache of that sequence is cut there (``llama_memory_seq_rm`` on its ``seq_id``),
which touches no other sequence.
"""

from __future__ import annotations

import threading
import time
import weakref
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from draftwise.errors import ModelLoadError

ROWS = 64  # most rows per pass: a long prompt goes in pieces, between the other streams' steps
GATHER_S = 0.008  # wait for the recent passes' sequences to come back with their next pass...
GATHER_SHARE = 0.25  # ... or this share of the last pass's time, if longer
GATHER_MAX_S = 0.05
ALIGN_PASSES = 2.0  # ... and while the decode thread runs another context's passes, this many of ours
POLL_S = 0.002  # how often a gather looks whether the decode thread is still at work
STOP_S = 60.0  # at most this long to wait for a closed context's last pass and its free


class Decoder:
    """The one thread that runs every ``llama_decode`` of the process, and whether it is at
    work. ggml's CPU kernels run on an OpenMP team per calling thread; two threads taking
    turns (a target's passes and its draft's) keep two teams that compete for the cores, and
    passes ran up to twice as slow so. One caller keeps one team."""

    def __init__(self) -> None:
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="draftwise-ggml")
        self._lock = threading.Lock()
        self._queued = 0  # calls submitted and not yet returned

    def busy(self) -> bool:
        return self._queued > 0

    def run(self, fn: Callable[..., int], *args: Any) -> int:
        with self._lock:
            self._queued += 1
        try:
            return self._pool.submit(fn, *args).result()
        finally:
            with self._lock:
                self._queued -= 1


@dataclass(eq=False)
class Request:
    """One sequence's forward: ``tokens`` from position ``start``; scores of the last ``want``."""

    seq: int
    tokens: Sequence[int]
    start: int
    want: int
    fed: int = 0  # tokens already decoded (a long request goes in pieces)
    rows: list[torch.Tensor] = field(default_factory=list)
    error: BaseException | None = None
    pass_rows: int = 0  # of the last pass that fed this request, over every sequence in it
    pass_seconds: float = 0.0
    done: threading.Event = field(default_factory=threading.Event)

    @property
    def left(self) -> int:
        return len(self.tokens) - self.fed

    def result(self) -> torch.Tensor:  # [want, V]
        self.done.wait()
        if self.error is not None:
            raise self.error
        return self.rows[0] if len(self.rows) == 1 else torch.cat(self.rows)


@dataclass
class PassStats:
    """What a context's passes have held so far (updated by its pass thread)."""

    passes: int = 0
    rows: int = 0  # tokens fed, over all passes
    sequences: int = 0  # sequences served, summed over passes


class _Queue:
    """Pending requests, shared by the sequences (producers) and the pass thread."""

    def __init__(self) -> None:
        self.cond = threading.Condition()
        self.pending: list[Request] = []
        self.closed = False
        self.resting: set[int] = set()  # sequences reset since their last request: not waited for

    def put(self, request: Request) -> None:
        with self.cond:
            if self.closed:
                raise RuntimeError("this llama.cpp context is closed")
            self.pending.append(request)
            self.resting.discard(request.seq)
            self.cond.notify_all()

    def rest(self, seq: int) -> None:
        with self.cond:
            self.resting.add(seq)
            self.cond.notify_all()

    def close(self) -> None:
        with self.cond:
            self.closed = True
            self.cond.notify_all()

    def gather(
        self, members: set[int], gather_s: float, align_s: float, busy: Callable[[], bool]
    ) -> list[Request] | None:
        """The pending requests once the round may start (step 1); None once closed."""
        with self.cond:
            while not self.pending and not self.closed:
                self.cond.wait()
            started = time.monotonic()
            while not self.closed and not members - self.resting <= {r.seq for r in self.pending}:
                waited = time.monotonic() - started
                if waited >= align_s or (waited >= gather_s and not busy()):
                    break
                self.cond.wait(min(POLL_S, align_s - waited) if waited >= gather_s else gather_s - waited)
            return None if self.closed else list(self.pending)

    def finish(self, requests: list[Request]) -> None:
        with self.cond:
            done = {id(r) for r in requests}
            self.pending = [r for r in self.pending if id(r) not in done]


class _Context:
    """The llama.cpp context and its batch, owned by the pass thread (freed when it ends)."""

    def __init__(self, weights: Any, n_ctx: int, slots: int, threads: int, rows: int) -> None:
        api = weights.api
        params = api.llama_context_default_params()
        params.n_ctx = n_ctx * slots
        params.n_batch = params.n_ubatch = rows
        params.n_seq_max = slots
        # One KV cache for every sequence. With a cache per sequence, llama.cpp splits a pass
        # into micro-batches that hold the same number of tokens of each sequence, in
        # increasing seq_id order: a verify block beside one-token steps becomes several
        # weight passes. Unified, a pass is one micro-batch whatever its mix; each sequence
        # still gets its n_ctx positions, as LlamaCppModel refuses to grow one past them.
        params.kv_unified = True
        params.n_outputs_max = rows
        params.n_threads = params.n_threads_batch = threads
        params.no_perf = True
        params.swa_full = True  # sliding-window layers keep every position, so any rollback works
        ctx = api.llama_init_from_model(weights.ptr, params)
        if not ctx:
            raise ModelLoadError(
                f"llama.cpp cannot make a context of {slots} x {n_ctx} positions for {weights.path.name}: "
                f"{weights.reason()}"
            )
        self.api = api
        self.weights = weights
        self.decoder = weights.decoder  # the process's one thread for llama_decode (see _Library)
        self.ctx = ctx
        self.n_ctx = int(api.llama_n_ctx(ctx)) // slots
        self.memory = api.llama_get_memory(ctx)
        self.rows = rows
        batch = api.llama_batch_init(rows, 0, 1)
        self.batch = batch
        for i in range(rows):
            batch.n_seq_id[i] = 1
        self.tokens = np.ctypeslib.as_array(batch.token, shape=(rows,))
        self.pos = np.ctypeslib.as_array(batch.pos, shape=(rows,))
        self.out = np.ctypeslib.as_array(batch.logits, shape=(rows,))

    def free(self) -> None:
        self.api.llama_batch_free(self.batch)
        self.api.llama_free(self.ctx)

    def run(self, pending: list[Request]) -> set[int]:
        """One round's pass (steps 2 and 3); returns the sequences it served."""
        plan = _plan(pending, self.rows)
        n = 0
        outputs: list[tuple[Request, int]] = []  # (request, score rows it gets from this pass)
        for request, take in plan:
            if request.fed == 0:  # forget what the sequence held from here on (a rollback)
                self.api.llama_memory_seq_rm(self.memory, request.seq, request.start, -1)
            first = request.fed
            out_from = max(first, len(request.tokens) - request.want)  # first of its positions with scores
            for j in range(first, first + take):
                self.tokens[n] = request.tokens[j]
                self.pos[n] = request.start + j
                self.batch.seq_id[n][0] = request.seq
                self.out[n] = j >= out_from
                n += 1
            outputs.append((request, max(0, first + take - out_from)))
        self.batch.n_tokens = n
        started = time.perf_counter()
        status = self.decoder.run(self.api.llama_decode, self.ctx, self.batch)
        if status != 0:
            raise RuntimeError(f"llama_decode failed ({status}) on {self.weights.name}: {self.weights.reason()}")
        seconds = time.perf_counter() - started
        for request, _ in plan:
            request.pass_rows, request.pass_seconds = n, seconds
        self._hand_out(outputs, sum(k for _, k in outputs), plan)
        return {request.seq for request, _ in plan}

    def _hand_out(self, outputs: list[tuple[Request, int]], n_out: int, plan: list[tuple[Request, int]]) -> None:
        """Copy each request's rows out of llama.cpp's buffer (the next pass reuses it)."""
        if n_out:
            scores = np.ctypeslib.as_array(self.api.llama_get_logits(self.ctx), shape=(n_out, self.weights.n_vocab))
        row = 0
        for (request, k), (_, take) in zip(outputs, plan):
            if k:
                request.rows.append(torch.from_numpy(scores[row : row + k].copy()))
                row += k
            request.fed += take


def _plan(pending: list[Request], budget: int) -> list[tuple[Request, int]]:
    """(request, tokens it feeds now) for one pass: the smallest first, up to ``budget`` rows.

    Example: budget 64, pending a 1-token step, a 5-token block and a 600-token prompt: the
    step and the block go whole, and the prompt feeds 58 tokens now, the rest in later passes.
    """
    plan = []
    for request in sorted(pending, key=lambda r: r.left):
        take = min(request.left, budget)
        if take <= 0:
            break
        plan.append((request, take))
        budget -= take
    return plan


def _serve(queue: _Queue, context: _Context, stats: PassStats) -> None:
    """The pass thread: rounds until the batcher is gone, then free the context."""
    recent: list[set[int]] = [set(), set()]  # the sequences of the last two passes
    wait_s, align_s = GATHER_S, GATHER_S
    try:
        while (pending := queue.gather(recent[0] | recent[1], wait_s, align_s, context.decoder.busy)) is not None:
            fed = sum(r.fed for r in pending)
            started = time.perf_counter()
            try:
                recent = [recent[1], context.run(pending)]
            except Exception as exc:  # a failed pass fails the requests in it, not the thread
                for request in pending:
                    request.error = exc
                recent = [set(), set()]
            seconds = time.perf_counter() - started
            wait_s = min(GATHER_MAX_S, max(GATHER_S, GATHER_SHARE * seconds))
            align_s = max(wait_s, ALIGN_PASSES * seconds)
            stats.passes += 1
            stats.rows += sum(r.fed for r in pending) - fed
            stats.sequences += len(recent[1])
            done = [r for r in pending if r.error is not None or r.left == 0]
            queue.finish(done)
            for request in done:
                request.done.set()
    finally:
        context.free()


def _stop(queue: _Queue, thread: threading.Thread) -> None:
    """Close the queue, and wait until the pass thread has freed the context. At exit this runs
    before the weights' own finalizer frees the model the context uses, and before the
    interpreter finalizes: llama_free logs through draftwise's Python callback, and a daemon
    thread that calls back into a finalizing interpreter is ended inside llama.cpp's
    destructor, which aborts the whole process."""
    queue.close()
    if thread is not threading.current_thread():
        thread.join(timeout=STOP_S)


class Batcher:
    """A llama.cpp context of ``slots`` sequences of ``n_ctx`` positions each, over shared
    weights, with its pass thread. Sequences ``claim`` a slot and ``release`` it."""

    def __init__(self, weights: Any, n_ctx: int, slots: int, threads: int, rows: int = ROWS) -> None:
        context = _Context(weights, n_ctx, slots, threads, rows)
        self.weights = weights
        self.slots = slots
        self.threads = threads
        self.n_ctx = context.n_ctx
        self._free = list(range(slots - 1, -1, -1))
        self._lock = threading.Lock()
        self._queue = _Queue()
        self.stats = PassStats()
        thread = threading.Thread(
            target=_serve, args=(self._queue, context, self.stats), name="draftwise-llamacpp", daemon=True
        )
        thread.start()
        # The thread holds the context and the queue, never this object: once no sequence
        # holds the batcher (or the process exits), the queue closes and the thread frees the
        # context.
        weakref.finalize(self, _stop, self._queue, thread)

    def claim(self) -> int | None:
        """A free sequence id, or None when every slot is taken."""
        with self._lock:
            return self._free.pop() if self._free else None

    def release(self, seq: int) -> None:
        self._queue.rest(seq)
        with self._lock:
            self._free.append(seq)

    def rest(self, seq: int) -> None:
        """Sequence ``seq`` ended its generation: passes no longer wait for it."""
        self._queue.rest(seq)

    def forward(self, seq: int, tokens: Sequence[int], start: int, want: int) -> Request:
        """Feed ``tokens`` to sequence ``seq`` from position ``start`` (its cache is cut there
        first); the finished request: ``result()`` holds scores ``[want, V]`` of the last
        ``want`` positions."""
        request = Request(seq, tokens, start, want)
        self._queue.put(request)
        request.done.wait()
        return request
