"""Forward-pass cost of a model for 1 new token vs a block of tokens, and of the matrix
products behind it: the numbers that decide whether speculation can pay on this machine.

    python scripts/forward_cost.py --model qwen2.5-coder-1.5b                     # llama.cpp (GGUF default)
    python scripts/forward_cost.py --model qwen2.5-coder-1.5b --backend hf --dtype float32   # packed
    python scripts/forward_cost.py --model qwen2.5-coder-1.5b --backend hf --dtype float32 --pack-rows 1
    python scripts/forward_cost.py --matmul-only                                   # torch's CPU products

Speculation pays when scoring k+1 tokens in one target pass costs about what one token costs.
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import get_args

import torch

from draftwise.config import Backend, Dtype


def _median_ms(fn, repeats: int) -> float:
    fn()  # warm-up
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        fn()
        times.append(time.perf_counter() - started)
    return statistics.median(times) * 1e3


def model_cost(
    source: str, options, blocks: list[int], repeats: int, prefill: int, pack: bool, pack_rows: tuple[int, ...]
) -> None:
    from draftwise.loading import choose_backend, load_lm, resolve

    if choose_backend(resolve(source), options.backend, print) == "hf":
        from draftwise.backends.hf_loading import load_hf

        lm = load_hf(source, resolve(source), options, pack=pack, pack_rows=pack_rows)
    else:
        lm = load_lm(source, options)
    lm.reset()
    started = time.perf_counter()
    lm.forward(list(range(1000, 1000 + prefill)), last=1)
    packed = f"packed for {'+'.join(map(str, pack_rows))} rows, " if pack and lm.dtype == "float32" else ""
    print(
        f"{source} ({lm.backend}, {packed}{lm.dtype}, threads {options.threads or 'all'}): "
        f"{prefill}-token prefill {time.perf_counter() - started:.1f} s; after it:"
    )
    for n in blocks:

        def step(n: int = n) -> None:
            lm.rollback(prefill)
            lm.forward(list(range(2000, 2000 + n)), last=n)

        print(f"  {n:3d} tokens: {_median_ms(step, repeats):8.1f} ms")


def matmul_cost(repeats: int) -> None:
    from draftwise.backends.quant import PackedLinear, can_pack

    k, n = 1536, 8960  # Qwen2.5-1.5B's MLP up-projection
    weight = torch.randn(n, k) * 0.05
    scales = weight.abs().amax(1) / 127
    weight_int8 = (weight / scales[:, None]).round().to(torch.int8)
    dense = torch.nn.Linear(k, n, bias=False)
    dense.weight.data = weight
    # The same weight packed for oneDNN, in the layout made for one row and for eight.
    packed = {rows: PackedLinear(dense, (rows,)) for rows in (1, 8)} if can_pack() else {}
    print(f"x[m, {k}] @ W[{n}, {k}]^T:")
    with torch.inference_mode():
        for m in (1, 2, 3, 4, 6, 9, 13):
            x = torch.randn(m, k)
            f32 = _median_ms(lambda: torch.nn.functional.linear(x, weight), repeats)
            bf16 = _median_ms(lambda: torch.nn.functional.linear(x.bfloat16(), weight.bfloat16()), repeats)
            int8 = _median_ms(
                lambda: torch.ops.aten._weight_int8pack_mm(x.bfloat16(), weight_int8, scales.bfloat16()), repeats
            )
            layouts = "  ".join(
                f"packed for {rows} row{'s' * (rows > 1)} {_median_ms(lambda: layer(x), repeats):6.2f} ms"
                for rows, layer in packed.items()
            )
            print(f"  m={m:2d}: float32 {f32:6.2f} ms  bfloat16 {bf16:6.2f} ms  int8 weights {int8:6.2f} ms  {layouts}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="qwen2.5-coder-0.5b")
    parser.add_argument("--backend", default="auto", choices=get_args(Backend))
    parser.add_argument("--dtype", default="auto", choices=get_args(Dtype), help="hf backend")
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--blocks", default="1,2,5,9")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--prefill", type=int, default=200)
    parser.add_argument(
        "--pack",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="hf backend: pre-pack float32 weights for oneDNN, as draftwise does by default",
    )
    parser.add_argument(
        "--pack-rows", default="1,8", help="row counts to keep a packed layout for (draftwise's target default: 1,8)"
    )
    parser.add_argument("--matmul-only", action="store_true")
    args = parser.parse_args()
    from draftwise.config import ModelOptions

    if args.matmul_only:
        matmul_cost(args.repeats)
        return
    options = ModelOptions(backend=args.backend, dtype=args.dtype, threads=args.threads)
    model_cost(
        args.model,
        options,
        [int(b) for b in args.blocks.split(",")],
        args.repeats,
        args.prefill,
        args.pack,
        tuple(int(r) for r in args.pack_rows.split(",")),
    )


if __name__ == "__main__":
    main()
