"""What weight-only quantization of the draft buys: draft cost per token, then a speculative
run against the plain target (greedy, 64 tokens, chat prompt), on the default Qwen pair.

    python scripts/draft_quant.py 8     # int8 draft weights
    python scripts/draft_quant.py 4     # int4 draft weights

The draft's precision cannot change the output; the script checks that it did not.
"""

from __future__ import annotations

import statistics
import sys
import time

from draftwise import GenerationConfig, SpeculativeEngine, autoregressive
from draftwise.backends.hf import HFModel
from draftwise.backends.hf_loading import load_hf
from draftwise.backends.quant import quantize_weights
from draftwise.config import ModelOptions
from draftwise.loading import resolve

PROMPT = "Write a Python function that checks whether a number is prime."


def draft_ms_per_token(lm: HFModel, context: int = 200, repeats: int = 6) -> float:
    lm.prefill(list(range(1000, 1000 + context)))
    times = []
    for i in range(repeats):
        started = time.perf_counter()
        lm.forward([3000 + i], last=1)
        times.append(time.perf_counter() - started)
    return statistics.median(times) * 1e3


def main() -> None:
    bits = int(sys.argv[1]) if len(sys.argv) > 1 else 8
    f32 = ModelOptions(backend="hf", dtype="float32")
    target = load_hf("qwen2.5-coder-1.5b", resolve("qwen2.5-coder-1.5b"), f32)
    draft = load_hf("qwen2.5-coder-0.5b", resolve("qwen2.5-coder-0.5b"), f32)
    print(f"draft full precision: {draft_ms_per_token(draft):.1f} ms/token", flush=True)
    replaced = quantize_weights(draft.model, bits=bits)
    print(f"draft int{bits} ({replaced} layers): {draft_ms_per_token(draft):.1f} ms/token", flush=True)
    ids = target.tokenizer.apply_chat_template([{"role": "user", "content": PROMPT}], add_generation_prompt=True)
    ids = ids["input_ids"] if hasattr(ids, "keys") else ids
    config = GenerationConfig(max_new_tokens=64)
    plain = autoregressive(target).generate(ids, config)
    spec = SpeculativeEngine.from_models(target, draft).generate(ids, config)
    m, p = spec.metrics, plain.metrics
    print(
        f"plain {p.tokens_per_second:.2f} tok/s; speculative {m.tokens_per_second:.2f} tok/s; "
        f"speedup {m.tokens_per_second / p.tokens_per_second:.2f}x; identical {spec.tokens == plain.tokens}; "
        f"passes {m.target_passes}; acceptance {m.acceptance_rate:.3f}"
    )


if __name__ == "__main__":
    main()
