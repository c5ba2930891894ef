"""Checks shared by the tests that compare outputs on llama.cpp, where kernels that differ with
the batch's size may round a near tie either way."""

from __future__ import annotations

import threading
from collections.abc import Callable

from draftwise.bench.audit import NEAR_TIE, first_difference


def near_tie_or_equal(lm, prompt_ids: list[int], plain: list[int], other: list[int]) -> None:
    """``other`` equals ``plain``, or first differs where the target's top two logits are
    nearly tied (one-token decoding of ``plain``'s own prefix)."""
    position = first_difference(plain, other)
    if position is None:
        return
    lm.reset()
    top = lm.forward(prompt_ids + plain[:position], last=1)[0].topk(2).values
    gap = float(top[0] - top[1])
    assert gap < NEAR_TIE, f"outputs part at token {position} where the top-2 logit gap is {gap:.3f}"


def run_at_once(work: Callable[[int], list[int]], count: int, timeout: float = 600) -> dict[int, list[int]]:
    """``work(i)`` for i in 0..count-1, each in a thread of its own, all at once; their
    results, or the first exception any of them raised."""
    results: dict[int, list[int]] = {}
    errors: list[BaseException] = []

    def run(i: int) -> None:
        try:
            results[i] = work(i)
        except BaseException as exc:  # handed to the calling thread
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(count)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=timeout)
    if errors:
        raise errors[0]
    return results
