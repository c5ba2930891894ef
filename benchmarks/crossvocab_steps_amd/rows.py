"""Median milliseconds of a target pass over 1 to 4 new tokens after 256, asking llama.cpp for
the last row's logits only (as llama-bench's prompt passes do) or for every row's (as
verification does). Output: rows.txt.

    python benchmarks/crossvocab_steps_amd/rows.py
"""

from __future__ import annotations

import statistics
import time

from draftwise.loading import load_lm

SHAPES = [(1, 1), (2, 1), (2, 2), (3, 1), (3, 3), (4, 1), (4, 4)]  # (rows, rows with logits)


def main() -> None:
    lm = load_lm("qwen2.5-coder-1.5b")
    assert lm.tokenizer is not None
    context = lm.tokenizer.encode("The quick brown fox jumps over the lazy dog. " * 30)[:256]
    lm.reset()
    lm.forward(context, last=1)

    def median_ms(rows: int, last: int, repeats: int = 15) -> float:
        times = []
        for _ in range(repeats):
            started = time.perf_counter()
            lm.forward(context[:rows], last=last)
            times.append(time.perf_counter() - started)
            lm.rollback(len(context))
        return 1000 * statistics.median(times)

    median_ms(1, 1)  # the first pass pages the weights in
    for _ in range(2):
        print({f"{rows} rows, {last} out": round(median_ms(rows, last), 1) for rows, last in SHAPES}, flush=True)


if __name__ == "__main__":
    main()
