"""The target's pass time with its float32 weights packed for one row against packed for
eight, in one process, alternating, so that drift of the machine hits both alike:

    python scripts/pack_layouts.py --model qwen2.5-coder-1.5b --repeats 15

Holds the model three times over while it builds the two packed copies (~19 GB for the 1.5B).
"""

from __future__ import annotations

import argparse
import copy
import statistics
import time

import torch


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="qwen2.5-coder-1.5b")
    parser.add_argument("--blocks", default="1,2,4,6,9")
    parser.add_argument("--prefill", type=int, default=300)
    parser.add_argument("--repeats", type=int, default=15)
    args = parser.parse_args()

    from draftwise.backends.hf import HFModel
    from draftwise.backends.hf_loading import load_hf
    from draftwise.backends.quant import pack_linears
    from draftwise.config import ModelOptions
    from draftwise.loading import resolve

    plain = load_hf(args.model, resolve(args.model), ModelOptions(backend="hf", dtype="float32"), pack=False)
    layouts = {}
    for rows in (1, 8):
        model = copy.deepcopy(plain.model) if rows == 1 else plain.model
        pack_linears(model, (rows,))
        layouts[rows] = HFModel(model, plain.tokenizer)
    blocks = [int(b) for b in args.blocks.split(",")]
    times: dict[int, dict[int, list[float]]] = {rows: {n: [] for n in blocks} for rows in layouts}
    for lm in layouts.values():
        lm.forward(list(range(1000, 1000 + args.prefill)), last=1)  # also the warm-up
    for _ in range(args.repeats):
        for rows, lm in layouts.items():
            for n in blocks:
                started = time.perf_counter()
                lm.forward(list(range(2000, 2000 + n)), last=n)
                times[rows][n].append(time.perf_counter() - started)
                lm.rollback(args.prefill)
    print(f"{args.model}, {args.prefill}-token context, {torch.get_num_threads()} threads, median of {args.repeats}:")
    for rows, by_block in times.items():
        cells = "  ".join(f"{n}: {statistics.median(v) * 1e3:5.0f} ms" for n, v in by_block.items())
        print(f"  packed for {rows} row{'s' * (rows > 1)}: {cells}")


if __name__ == "__main__":
    main()
