"""Measure what drafting costs with a loaded pair on this machine, once, before generating.

The cost policy weighs every draft length by what a target pass over that many tokens
costs. The curve is far from smooth on CPUs (llama.cpp runs a block's rows in groups of
four, so 4 tokens can cost less than 3), and a policy that only learns the sizes it happens
to try can miss the efficient ones. ``calibrate`` times a target pass for every block size
the policy may use, one draft token and the draft's prefill rate, and stores them in a
``CostProfile``; the policy refines them as it runs. Results are cached per model file,
settings and CPU in ``$DRAFTWISE_HOME/costs.json``, so only the first run pays (seconds).
"""

from __future__ import annotations

import functools
import json
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from draftwise.config import CostPolicyConfig
from draftwise.cpu import cpu_name, cpuinfo_text, kernel_flags
from draftwise.events import MODEL
from draftwise.lm import LanguageModel
from draftwise.profile import DEFAULTS, CostProfile
from draftwise.registry import home

CONTEXT = 256  # context the passes are timed after: a typical prompt's length
REPEATS = 2  # each timing is the fastest of this many: noise on a shared machine only slows


def _cpu() -> str:
    text = cpuinfo_text()
    return f"{cpu_name(text)} [{' '.join(kernel_flags(text))}]"


def plain_context(lm: LanguageModel, length: int = CONTEXT) -> list[int]:
    """``length`` token ids to time passes after: plain text, so the model sees ordinary input."""
    text = "The quick brown fox jumps over the lazy dog. " * 64
    ids = lm.tokenizer.encode(text) if lm.tokenizer is not None else list(range(1, CONTEXT + 1))
    return (ids * (length // max(1, len(ids)) + 1))[:length]


def _fastest(run: Callable[[], None], repeats: int = REPEATS) -> float:
    best = float("inf")
    for _ in range(repeats):
        started = time.perf_counter()
        run()
        best = min(best, time.perf_counter() - started)
    return best


def time_passes(
    lm: LanguageModel,
    sizes: Sequence[int],
    context: Sequence[int] | None = None,
    repeats: int = REPEATS,
    prompt: bool = False,
) -> dict[int, float]:
    """Seconds of a pass scoring all of its ``n`` new tokens (a verified block), or with
    ``prompt`` only its last (a prompt's piece), for each ``n``, after ``context`` (``CONTEXT``
    tokens of plain text by default): the fastest of ``repeats``. The new tokens are the
    context's own, repeated as far as the largest size needs."""
    context = list(context) if context is not None else plain_context(lm)
    block = (context * (max(sizes) // len(context) + 1))[: max(sizes)]
    lm.reset()
    lm.forward(context, last=1)

    def one(n: int) -> None:
        lm.forward(block[:n], last=1 if prompt else n)
        lm.rollback(len(context))

    one(1)  # the first call pages weights in and picks kernels
    times = {n: _fastest(functools.partial(one, n), repeats) for n in sizes}
    lm.reset()
    return times


# Calibrations a busy machine may take before one is plausible: each attempt keeps every size's
# fastest pass so far, since contention only ever slows a pass.
ATTEMPTS = 3


def plausible(times: dict[int, float], outlier: float = DEFAULTS.outlier, fewest: int = 1) -> bool:
    """Whether a timed curve can be this machine's own, judged from its pass over ``fewest``
    rows (one, unless that pass runs other kernels than the rest). A pass over ``n`` rows does
    at most ``n / m`` times the work of one over ``m`` rows: it never takes longer than
    ``n / fewest`` passes over ``fewest``, and where it took more than ``outlier`` times
    ``n / m`` of a smaller size's time, it stalled (kernels that change with the size, 8 rows
    costing more than two 4-row passes on an AMD EPYC, stay well within it). A curve timed
    while something else took the cores breaks these (one timed beside a compiler read 1 / 2 /
    6 rows as 65 / 156 / 1377 ms, where the idle machine takes about 30 / 50 / 90; the Intel
    host's first `make run` cached 48 / 49 rows as 0.95 / 2.06 s), and would misprice blocks on
    this machine for good.

    >>> plausible({1: 0.030, 2: 0.051, 8: 0.182}), plausible({1: 0.065, 2: 0.156, 6: 1.377})
    (True, False)
    >>> plausible({1: 0.093, 4: 0.176, 48: 0.953, 49: 2.060})
    False
    >>> plausible({1: 0.031, 2: 0.078, 64: 0.540}), plausible({1: 0.031, 2: 0.078, 64: 0.540}, fewest=2)
    (False, True)
    """
    base = times.get(fewest)
    sizes = sorted(n for n in times if n >= fewest)
    if base is None or any(times[n] > n / fewest * base for n in sizes):
        return False
    return all(times[n] <= outlier * n / m * times[m] for i, m in enumerate(sizes) for n in sizes[i + 1 :])


def time_curve(
    lm: LanguageModel, sizes: Sequence[int], prompt: bool = False, outlier: float = DEFAULTS.outlier
) -> dict[int, float]:
    """``time_passes`` over ``sizes`` (1 among them), again while the curve is not
    ``plausible``, at most ``ATTEMPTS`` times; each size's fastest pass."""
    times = time_passes(lm, sizes, prompt=prompt)
    for _ in range(ATTEMPTS - 1):
        if plausible(times, outlier):
            break
        again = time_passes(lm, sizes, prompt=prompt)
        times = {n: min(seconds, again[n]) for n, seconds in times.items()}
    return times


def time_draft(lm: LanguageModel) -> tuple[float, float]:
    """(seconds per drafted token, seconds per token of a catch-up prefill) of a draft model."""
    context = plain_context(lm)
    lm.reset()
    started = time.perf_counter()
    lm.forward(context, last=1)
    catchup = (time.perf_counter() - started) / len(context)
    token = time_passes(lm, range(1, 2))[1]
    return token, catchup


# Prompt pieces timed on each kernel layout (``choose_kernels``), from a prompt's short tail to
# the pieces of a long one (one row, a one-token step, runs repacked both times: the repacked
# curve is ``plausible`` from it, the stock one from two rows).
KERNEL_SIZES = (1, 2, 4, 8, 16, 32, 64)


def crossover(repacked: Mapping[int, float], stock: Mapping[int, float], extra: float = 0.0) -> int:
    """The fewest rows from which the stock kernels were faster at that size and at every
    larger one timed, by more than ``extra`` seconds; 0 where the largest size was not.

    >>> crossover({1: 0.037, 16: 0.238, 32: 0.391, 64: 0.706}, {1: 0.051, 16: 0.268, 32: 0.304, 64: 0.517})
    32
    >>> crossover({1: 0.030, 64: 0.500}, {1: 0.040, 64: 0.520})
    0
    """
    rows = 0
    for n in sorted(repacked, reverse=True):
        if n not in stock or stock[n] + extra >= repacked[n]:
            break
        rows = n
    return rows


def apart(repacked: Mapping[int, float], stock: Mapping[int, float]) -> int:
    """The fewest rows from which a pass of prompt pieces alone on the stock kernels, with a
    one-row pass beside it, cost less than the same pieces repacked: at that size and at every
    larger one timed; 0 where the largest size did not. A round whose pieces go in a pass of
    their own runs the other streams' steps in one more pass; their rows cost about what they
    would beside the pieces, and the pass itself what a pass of one row costs beyond nothing.

    >>> apart({1: 0.035, 32: 0.327, 64: 0.600}, {1: 0.050, 32: 0.312, 64: 0.508})
    64
    >>> apart({1: 0.030, 32: 0.300, 64: 0.500}, {1: 0.040, 32: 0.290, 64: 0.480})
    0
    """
    return crossover(repacked, stock, extra=repacked[min(repacked)])


def choose_kernels(target: LanguageModel, log: Callable[[str], None], cache: CostCache | None = None) -> int | None:
    """Where ``target``'s backend leaves its kernels for prompt pieces to timing
    (``LanguageModel.kernel_timing``): time its prompt pieces of ``KERNEL_SIZES`` rows on the
    repacked kernels and on the stock ones, or read the choice from the cache (keyed by what
    decides it: the file, the threads, the device and the CPU, not the context or the slots),
    set the ``crossover`` and return it (0 for a context too short to time them in, which keeps
    every product repacked), and the rows from which pieces beside other streams' steps go in
    a pass of their own (``apart``); None where there is nothing to choose. Call before any
    pass is under way."""
    timing = target.kernel_timing
    if timing is None:
        return None
    rows = apart_rows = 0
    if (target.max_context or 0) >= CONTEXT + max(KERNEL_SIZES):
        cache = cache or CostCache()
        key = f"kernels for prompts {','.join(map(str, KERNEL_SIZES))}|{timing.key}|{_cpu()}"
        chosen = cache.get(key)
        if chosen is None:
            log(f"timing {target.name}'s prompt pieces on ggml's two kernel layouts (once on this machine; cached)")
            timing.set_stock_rows(0)
            repacked = time_curve(target, KERNEL_SIZES, prompt=True)
            timing.set_stock_rows(1)
            stock = time_curve(target, KERNEL_SIZES, prompt=True)
            chosen = [crossover(repacked, stock), apart(repacked, stock)]
            # One row is a step, repacked in both curves: the stock kernels are judged by their own.
            if plausible(repacked) and plausible(stock, fewest=min(n for n in stock if n > 1)):
                cache.put(key, chosen)
        rows, apart_rows = map(int, chosen)
    timing.set_stock_rows(rows)
    timing.set_apart_rows(apart_rows)
    return rows


class CostCache:
    """Measured costs per model and machine, in a JSON file (a read-only or broken file only
    costs measuring again)."""

    def __init__(self, path: Path | None = None) -> None:
        self.path = path or home() / "costs.json"
        try:
            self.entries: dict[str, Any] = json.loads(self.path.read_text())
        except (OSError, ValueError):
            self.entries = {}

    @staticmethod
    def key(lm: LanguageModel, what: str) -> str:
        return f"{what}|{lm.fingerprint}|{_cpu()}"

    def get(self, key: str) -> Any:
        return self.entries.get(key)

    def put(self, key: str, value: Any) -> None:
        self.entries[key] = value
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            scratch = self.path.with_suffix(".tmp")
            scratch.write_text(json.dumps(self.entries, indent=1))
            scratch.replace(self.path)
        except OSError:
            pass


# Pass sizes timed beyond a stream's own blocks when streams share passes (slots > 1): the
# curve between them is read off the line, and past the last it goes on as a line.
BATCHED_SIZES = (16, 20, 24, 32, 48, 64)


def pass_sizes(k_max: int, slots: int, k_long: int = 0) -> list[int]:
    """Rows to time a target pass at: every block size up to ``k_max``, a few sizes up to a
    grounded source's longest block (``k_long``), and with ``slots`` streams batched, up to
    what they fill together (64 at most)."""
    longest = max(k_max, k_long) + 1
    rows = max(longest, min(64, slots * (k_max + 1)) if slots > 1 else 0)
    return sorted({*range(1, k_max + 2), *(n for n in BATCHED_SIZES if n <= rows), longest})


def calibrate(
    target: LanguageModel,
    draft: LanguageModel | None,
    k_max: int,
    log: Callable[[str], None] | None = None,
    cache: CostCache | None = None,
    slots: int = 1,
    k_long: int = 0,
    settings: CostPolicyConfig = DEFAULTS,
) -> CostProfile:
    """A ``CostProfile`` holding the target's pass times for blocks of 1 to ``k_max + 1``
    tokens, of a few sizes up to ``k_long + 1`` (and larger passes where ``slots`` streams
    share them, see ``pass_sizes``) and, with a draft model, its per-token and catch-up
    costs; measured here, or read from the cache when this model ran on this CPU before. A
    curve that is not ``plausible`` (timed on a busy machine) is timed again and never cached."""
    log = log or (lambda message: None)
    cache = cache or CostCache()
    profile = CostProfile.under(settings)
    sizes = pass_sizes(k_max, slots, k_long)
    key = cache.key(target, f"passes {','.join(map(str, sizes))}")
    cached = cache.get(key)
    passes = {int(n): float(seconds) for n, seconds in cached.items()} if cached else None
    if passes is None or not plausible(passes, settings.outlier):  # never measured, or measured on a busy machine
        log(f"timing {target.name}'s passes over 1 to {sizes[-1]} tokens (once on this machine; cached)")
        passes = time_curve(target, sizes, outlier=settings.outlier)
        if plausible(passes, settings.outlier):
            cache.put(key, {str(n): s for n, s in passes.items()})
    for n, seconds in passes.items():
        profile.pass_times.add(n, seconds)
    if draft is not None and draft is not target:
        draft_key = cache.key(draft, "draft")
        costs = cache.get(draft_key)
        if costs is None:
            costs = time_draft(draft)
            cache.put(draft_key, list(costs))
        profile.draft_token_seconds[MODEL], profile.catchup_token_seconds[MODEL] = map(float, costs)
    return profile
