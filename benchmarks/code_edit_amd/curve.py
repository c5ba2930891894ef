"""The target's pass time by rows, after 256 and after 1024 tokens of context (every row's
scores computed, as verification needs): what a verified row costs at an edit's context.

Usage: python benchmarks/code_edit_amd/curve.py   (after make setup and draftwise pull default)
"""

import textwrap
import time

from draftwise.loading import load_pair

target, _ = load_pair("qwen2.5-coder-1.5b", None, None)
ids = target.tokenizer.encode(open(textwrap.__file__).read())
for ctx in (256, 1024):
    target.reset()
    target.forward(ids[:ctx], last=1)
    for n in (1, 16, 49):
        best = 9.0
        for _ in range(3):
            t = time.perf_counter()
            target.forward(ids[ctx : ctx + n], last=n)
            best = min(best, time.perf_counter() - t)
            target.rollback(ctx)
        print(ctx, n, round(best * 1000, 1), round(best * 1000 / n, 1), flush=True)  # context, rows, ms, ms a row
