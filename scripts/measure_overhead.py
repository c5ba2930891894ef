"""Measure the decode loop's own per-step overhead on tiny models.

The overhead of a step is its wall time minus the time spent inside the two models'
forward passes (``LanguageModel.forward``, timed here by wrapping it). Two figures per step:

* ``loop``: wall time between two consecutive events of ``SpeculativeEngine.stream`` minus
  forward time: everything the loop does besides running models (drafting and verification
  bookkeeping, cache sync/rollback, stop checks, detokenization, event building, observe).
* ``other``: the engine's own ``StepEvent.other_seconds`` (step time outside the draft and
  verify phases), as the metrics report it.
* ``cpu``: like ``loop`` but in CPU time of this thread (``time.thread_time``), which a
  busy machine does not inflate the way it inflates wall time (run with one torch thread).

Usage: OMP_NUM_THREADS=1 python scripts/measure_overhead.py [--tokens 256] [--runs 3]
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch

from draftwise import DraftConfig, GenerationConfig, NGramDrafter, SamplingConfig, SpeculativeEngine
from draftwise.backends.tiny import tiny_lm
from draftwise.lm import LanguageModel

PROMPT = "def fib(n):\n    if n < 2:\n        return n\n    return fib(n - 1) + fib(n - 2)\n\nprint(fib(10))\n"


class ForwardClock:
    """Accumulates the time spent in ``forward`` of the wrapped models."""

    def __init__(self) -> None:
        self.seconds = 0.0
        self.cpu_seconds = 0.0
        self.calls: list[tuple[int, float]] = []  # (tokens fed, seconds) per call

    def wrap(self, lm: LanguageModel) -> None:
        inner: Callable = lm.forward

        def timed(tokens, last=None):
            started, cpu_started = time.perf_counter(), time.thread_time()
            out = inner(tokens, last=last)
            spent = time.perf_counter() - started
            self.seconds += spent
            self.cpu_seconds += time.thread_time() - cpu_started
            self.calls.append((len(tokens), spent))
            return out

        lm.forward = timed  # instance attribute shadows the method for this object only


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def measure(engine: SpeculativeEngine, clock: ForwardClock, config: GenerationConfig, runs: int) -> dict:
    loop_us: list[float] = []
    cpu_us: list[float] = []
    other_us: list[float] = []
    step_ms: list[float] = []
    tokens = steps = 0
    for run in range(runs):
        cfg = config.model_copy(update={"sampling": config.sampling.model_copy(update={"seed": run})})
        stream = engine.stream(PROMPT, cfg)
        # The first step includes the prefill: start timing after it.
        first = next(stream)
        tokens += len(first.tokens)
        mark, fwd_mark = time.perf_counter(), clock.seconds
        cpu_mark, fwd_cpu_mark = time.thread_time(), clock.cpu_seconds
        for event in stream:
            now, cpu_now = time.perf_counter(), time.thread_time()
            loop_us.append(1e6 * ((now - mark) - (clock.seconds - fwd_mark)))
            cpu_us.append(1e6 * ((cpu_now - cpu_mark) - (clock.cpu_seconds - fwd_cpu_mark)))
            step_ms.append(1e3 * (now - mark))
            other_us.append(1e6 * event.other_seconds)
            tokens += len(event.tokens)
            steps += 1
            mark, fwd_mark = time.perf_counter(), clock.seconds
            cpu_mark, fwd_cpu_mark = time.thread_time(), clock.cpu_seconds
        steps += 1
    return {
        "tokens/step": tokens / steps,
        "step ms": statistics.median(step_ms),
        "loop med": statistics.median(loop_us),
        "loop p90": pct(loop_us, 0.9),
        "other med": statistics.median(other_us),
        "other p90": pct(other_us, 0.9),
        "cpu med": statistics.median(cpu_us),
        "cpu p90": pct(cpu_us, 0.9),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=256, help="new tokens per run")
    parser.add_argument("--runs", type=int, default=3, help="runs per configuration")
    parser.add_argument("--k", type=int, default=4, help="fixed draft length")
    parser.add_argument("--threads", type=int, default=1, help="torch threads")
    parser.add_argument("--drafters", default="none,model,same,ngram", help="which rows to run (comma list)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    target, draft = tiny_lm(0), tiny_lm(1)
    clock = ForwardClock()
    clock.wrap(target)
    clock.wrap(draft)
    same = tiny_lm(0)
    clock.wrap(same)
    rows = {
        "none": ("none (baseline)", None),
        "model": ("model (tiny:1)", draft),
        "same": ("model (tiny:0, =target)", same),
        "ngram": ("n-gram", NGramDrafter()),
    }
    drafters = dict(rows[key] for key in args.drafters.split(","))
    samplings = {"greedy": SamplingConfig(), "sampling": SamplingConfig(temperature=0.8, top_k=40, top_p=0.95)}

    # Warm up (first calls allocate and compile kernels).
    SpeculativeEngine.from_models(target, draft).generate(PROMPT, GenerationConfig(max_new_tokens=16))

    header = (
        f"{'drafter':26} {'decoding':9} {'tok/step':>8} {'step ms':>8} {'loop med':>9} {'loop p90':>9} "
        f"{'other med':>9} {'other p90':>9} {'cpu med':>8} {'cpu p90':>8}"
    )
    print(f"threads={args.threads} tokens={args.tokens} runs={args.runs} k={args.k} (fixed, confidence stop off)")
    print("overhead in microseconds per step (loop = step wall time minus model forward time)")
    print(header)
    for name, drafter in drafters.items():
        engine = SpeculativeEngine.from_models(target, drafter)
        for mode, sampling in samplings.items():
            config = GenerationConfig(
                max_new_tokens=args.tokens,
                ignore_eos=True,
                sampling=sampling,
                draft=DraftConfig(k_policy="fixed", k=args.k, confidence_threshold=0.0),
            )
            r = measure(engine, clock, config, args.runs)
            print(
                f"{name:26} {mode:9} {r['tokens/step']:8.2f} {r['step ms']:8.2f} {r['loop med']:9.0f} "
                f"{r['loop p90']:9.0f} {r['other med']:9.0f} {r['other p90']:9.0f} {r['cpu med']:8.0f} "
                f"{r['cpu p90']:8.0f}"
            )

    single = [s for n, s in clock.calls if n == 1]
    block = [s for n, s in clock.calls if n == args.k + 1]
    print(
        f"model forward (tiny, 2 layers, hidden 64, vocab 257): 1 token {1e3 * statistics.median(single):.2f} ms"
        + (f", {args.k + 1} tokens {1e3 * statistics.median(block):.2f} ms" if block else "")
        + " (medians)"
    )


if __name__ == "__main__":
    main()
