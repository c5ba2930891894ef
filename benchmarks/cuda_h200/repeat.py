"""Does plain decoding on CUDA give the same answer twice, and does a row score the same
alone as in a block? The second run on the H200, after ``probe.py`` found bfloat16's plain
output changing between two runs of one engine.

- ``repeat``: plain decoding of one prompt, 3 times from an empty cache and 3 times reusing
  the cached prompt (as a server's slot does); the token where each run first differs from
  the first one (-1: identical);
- ``rows``: after a 512-token context, each of 64 positions scored in one pass of 64 rows
  and alone (one row after the other): the largest score difference, and how many of the 64
  positions keep their top token.

Usage: ``python3 benchmarks/cuda_h200/repeat.py CONFIGS OUT.json`` (CONFIGS as for probe.py).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
from probe import CONTEXT, random_model

from draftwise.config import GenerationConfig
from draftwise.engine import autoregressive


def first_difference(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), -1 if len(a) == len(b) else min(len(a), len(b)))


def repeat(lm, runs: int = 3) -> dict:
    prompt = torch.randint(0, 150_000, (200,), generator=torch.Generator().manual_seed(2)).tolist()
    engine = autoregressive(lm)
    config = GenerationConfig(max_new_tokens=128, ignore_eos=True)
    fresh, reused = [], []
    for _ in range(runs):
        lm.reset()
        fresh.append(engine.generate(prompt, config).tokens)
    for _ in range(runs):
        reused.append(engine.generate(prompt, config).tokens)
    first = fresh[0]
    return {
        "fresh_first_difference": [first_difference(first, t) for t in fresh],
        "reused_first_difference": [first_difference(first, t) for t in reused],
    }


def rows(lm, n: int = 64) -> dict:
    generator = torch.Generator().manual_seed(1)
    lm.reset()
    lm.forward(torch.randint(0, 150_000, (CONTEXT,), generator=generator).tolist(), last=1)
    feed = torch.randint(0, 150_000, (n,), generator=generator).tolist()
    block = lm.forward(feed)  # [n, V]
    lm.rollback(CONTEXT)
    alone = torch.cat([lm.forward([token]) for token in feed])  # [n, V]
    return {
        "max_abs_difference": float((block - alone).abs().max()),
        "same_top_token": int((block.argmax(-1) == alone.argmax(-1)).sum()),
        "positions": n,
    }


def main(configs: Path, out: Path) -> None:
    report = {"deterministic_algorithms": torch.are_deterministic_algorithms_enabled()}
    for dtype in (torch.bfloat16, torch.float32):
        lm = random_model(configs, "qwen1.5b", dtype)
        name = str(dtype).removeprefix("torch.")
        report[f"repeat {name}"] = repeat(lm)
        report[f"rows {name}"] = rows(lm)
        del lm
    out.write_text(json.dumps(report, indent=1))
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    if len(sys.argv) > 3 and sys.argv[3] == "--deterministic":
        torch.use_deterministic_algorithms(True)
    main(Path(sys.argv[1]), Path(sys.argv[2]))
