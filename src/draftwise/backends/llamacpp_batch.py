"""Many sequences, one pass: a llama.cpp context that holds several sequences.

Every sequence (``draftwise.backends.llamacpp.LlamaCppModel``) of a context asks for its
passes as ``Forward`` values (``draftwise.lm``); the ``Batcher`` of the context runs the
pending ones of every sequence as one ``llama_decode``: each row carries its sequence's
``seq_id``, its position and whether its scores are wanted, and each sequence gets back its
own score rows. On this kind of CPU a pass over several rows costs little more than one (the
quantized matrix kernels work on rows in groups), so four streams that each add a token cost
about one pass, not four. Who gathers the forwards is the caller's business: a server's
scheduler hands the batcher every stream's pending pass once a round
(``draftwise.scheduler``), a stream alone its own.

In each pass (``Batcher.step``):

1. Take rows up to the row budget (``rows``, or fewer where the scheduler says so: beside
   other streams, a piece's rows are priced in time, see ``draftwise.scheduler``): the
   smallest requests first, so that a long prompt never holds up the others' one-token
   steps; a prompt longer than what is left is fed in pieces over several passes, mixed
   with everybody's steps.
2. One ``llama_decode``; copy each finished request's score rows out of llama.cpp's buffer
   (the next pass overwrites it).

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
from draftwise.lm import Forward

# Most rows per pass of a context of several slots: a long prompt goes in pieces, between the
# other streams' steps. It holds about four streams' longest blocks (``config.MAX_BLOCK`` drafted
# tokens each), and a pass of a few hundred rows costs least per row on these CPUs (llama-bench
# -t 2 on the 1.5B default target: 64 and 256 rows at the same rate, 512 slower). While other
# streams wait on the pass, the scheduler asks for fewer (``Batcher.step``'s ``rows``).
ROWS = 256


class Decoder:
    """The one thread that runs every ``llama_decode`` of the process. ggml's CPU kernels run
    on an OpenMP team per calling thread; two threads taking turns (a target's passes and its
    draft's) keep two teams that compete for the cores, and passes ran up to twice as slow
    so. One caller keeps one team. A server's passes all come from its round thread now, but
    calibration, warm-up and ``generate`` call from others, and the hop itself costs nothing
    measurable: one- and five-row passes through it and called directly, alternated, took the
    same time within the noise. So it stays."""

    def __init__(self) -> None:
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="draftwise-ggml")

    def run(self, fn: Callable[..., int], *args: Any) -> int:
        return self._pool.submit(fn, *args).result()


@dataclass(eq=False)
class Request:
    """One sequence's forward: ``tokens`` from position ``start``; scores of the last ``want``."""

    seq: int
    tokens: Sequence[int]
    start: int
    want: int
    fed: int = 0  # tokens already decoded (a long request goes in pieces)
    rows: list[torch.Tensor] = field(default_factory=list)
    pass_rows: int = 0  # of the last pass that fed this request, over every sequence in it
    pass_seconds: float = 0.0
    pass_sequences: int = 1
    after: int = 0  # tokens its sequence feeds next, once this is done (``Forward.after``)

    @property
    def left(self) -> int:
        return len(self.tokens) - self.fed

    @property
    def prompt(self) -> bool:
        """A prompt (or a draft's catch-up): several tokens scored at the last one only. A
        one-token step and a verified block score every token they emit."""
        return self.want == 1 and len(self.tokens) > 1

    def result(self) -> torch.Tensor:  # [want, V]
        return self.rows[0] if len(self.rows) == 1 else torch.cat(self.rows)


@dataclass
class PassStats:
    """What a context's passes have held so far."""

    passes: int = 0
    rows: int = 0  # tokens fed, over all passes
    sequences: int = 0  # sequences served, summed over passes


class _Context:
    """The llama.cpp context and its batch (freed with the batcher that holds them)."""

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

    def run(self, pending: list[Request], rows: int | None = None) -> set[int]:
        """One pass (steps 1 and 2) of at most ``rows`` rows (None: the budget); returns the
        sequences it served."""
        plan = _plan(pending, self.rows if rows is None else max(1, min(rows, self.rows)))
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
        self.weights.kernels.before_pass(all(request.prompt for request, _ in plan))
        started = time.perf_counter()
        status = self.decoder.run(self.api.llama_decode, self.ctx, self.batch)
        if status != 0:
            raise RuntimeError(f"llama_decode failed ({status}) on {self.weights.name}: {self.weights.reason()}")
        seconds = time.perf_counter() - started
        for request, _ in plan:
            request.pass_rows, request.pass_seconds, request.pass_sequences = n, seconds, len(plan)
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
    """(request, tokens it feeds now) for one pass: the least work first, up to ``budget``
    rows. A prompt fed in pieces counts what it feeds after this piece too (``after``): two
    long prompts that arrive together are then fed one after the other, so the first one's
    answer starts when its own prompt is in, not when both are.

    Example: budget 64, pending a 1-token step, a 5-token block and a 600-token prompt: the
    step and the block go whole, and the prompt feeds 58 tokens now, the rest in later passes.
    """
    plan = []
    for request in sorted(pending, key=lambda r: r.left + r.after):
        take = min(request.left, budget)
        if take <= 0:
            break
        plan.append((request, take))
        budget -= take
    return plan


class Batcher:
    """A llama.cpp context of ``slots`` sequences of ``n_ctx`` positions each, over shared
    weights. Sequences ``claim`` a slot and ``release`` it; ``step`` runs one pass over their
    pending forwards (one caller at a time: a lock keeps the batch buffer whole)."""

    def __init__(self, weights: Any, n_ctx: int, slots: int, threads: int, rows: int = ROWS) -> None:
        context = _Context(weights, n_ctx, slots, threads, rows)
        self._context = context
        self.weights = weights
        self.slots = slots
        self.threads = threads
        self.n_ctx = context.n_ctx
        self._free = list(range(slots - 1, -1, -1))
        # Two locks: a sequence dropped during a pass (its finalizer) gives its slot back.
        self._slots = threading.Lock()
        self._pass = threading.Lock()
        self.stats = PassStats()
        # The context is freed with the batcher (at exit, before the weights it uses: finalizers
        # run newest first).
        weakref.finalize(self, context.free)

    def claim(self) -> int | None:
        """A free sequence id, or None when every slot is taken."""
        with self._slots:
            return self._free.pop() if self._free else None

    def release(self, seq: int) -> None:
        with self._slots:
            self._free.append(seq)

    def apart_from(self) -> int:
        """Prompt pieces in a pass of their own run the stock kernels; beside a step, every
        product stays repacked. The rows from which that pays, as timed for this CPU
        (``KernelChoice.apart_rows``, ``draftwise.costs.apart``)."""
        kernels = self.weights.kernels
        return kernels.apart_rows if kernels.stock_rows_for(prompt_only=True) else 0

    def step(self, forwards: Sequence[Forward], rows: int | None = None) -> int:
        """One pass over ``forwards`` of this context's sequences (``LlamaCppModel``), of at
        most ``rows`` rows (None: the row budget): each one fed whole gets its ``scores``; one
        its sequence refused (a full context), or in a pass that failed, gets its ``error``.
        Returns the rows it fed."""
        with self._pass:
            live: list[tuple[Forward, Request]] = []
            for forward in forwards:
                try:
                    if forward.state is None:
                        forward.state = forward.lm.begin(forward)  # type: ignore[attr-defined]
                    live.append((forward, forward.state))
                except Exception as exc:  # this sequence's fault: the others' pass goes on
                    forward.error = exc
            if not live:
                return 0
            pending = [request for _, request in live]
            before = sum(r.fed for r in pending)
            try:
                served = self._context.run(pending, rows)
            except Exception as exc:  # a failed pass fails the requests in it
                for forward, _ in live:
                    forward.error = exc
                return 0
            fed = sum(r.fed for r in pending) - before
            self.stats.passes += 1
            self.stats.rows += fed
            self.stats.sequences += len(served)
            for forward, request in live:
                if request.left == 0:
                    forward.scores = forward.lm.end(request)  # type: ignore[attr-defined]
            return fed
