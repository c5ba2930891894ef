"""draftwise's engine on a CUDA device, through the hf backend: one short run.

No real weights reach the GPU machine this was written for (what travels there is capped far
below a GGUF file), so the models are Qwen2.5-Coder's shapes (their config.json, written from
the packaged GGUF files) with random weights, and Qwen's real tokenizer. A pass's cost does
not depend on the weights' values, so the cost curve is the real one; what random weights
cannot give is a real acceptance rate, so the engine is measured where acceptance is set by
construction:

- ``curve``: the target's pass of 1 to 64 rows after a 512-token context (scores of every row
  to the host, as the model seam returns them, and of the last row only);
- ``engine``: plain decoding, then the plain output sent back as a prediction (every draft
  right), the same with 30 tokens cut from its middle (an edit: the output leaves the
  prediction and must find it again), and the 0.5B-shaped random model as drafter (drafts
  that are never right: the cost policy should fall back to plain passes).

The random weights' embeddings are scaled up (as ``draftwise.backends.tiny`` does) so the
next-token scores are peaked and greedy ties are rare. Usage: first, where the packaged GGUF
files are (``draftwise pull qwen2.5-coder-1.5b qwen2.5-coder-0.5b``), write CONFIGS (their
config.json and the tokenizer, 11 MB); then, on the CUDA machine::

    python3 benchmarks/cuda_h200/probe.py --configs CONFIGS
    python3 benchmarks/cuda_h200/probe.py CONFIGS OUT.json
    CUBLAS_WORKSPACE_CONFIG=:4096:8 python3 benchmarks/cuda_h200/probe.py CONFIGS OUT.json --deterministic
"""

from __future__ import annotations

import json
import statistics
import sys
import time
from pathlib import Path

import torch

from draftwise.backends.hf import HFModel
from draftwise.config import GenerationConfig
from draftwise.drafters import Proposal
from draftwise.engine import SpeculativeEngine, autoregressive
from draftwise.lm import ready
from draftwise.policies import Offer

ROWS = (1, 2, 4, 8, 16, 32, 64)
CONTEXT = 512
NEW_TOKENS = 256
EMBEDDING_SCALE = 10.0  # logits' spread x10: the top two tokens seldom tie in bfloat16
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"  # cpu: a smoke run of the script itself


def random_model(configs: Path, name: str, dtype: torch.dtype) -> HFModel:
    from transformers import AutoConfig, AutoModelForCausalLM, PreTrainedTokenizerFast

    config = AutoConfig.from_pretrained(configs / name)
    torch.manual_seed(0)
    with torch.device(DEVICE):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    with torch.no_grad():
        model.get_input_embeddings().weight.mul_(EMBEDDING_SCALE)
        model.get_output_embeddings().weight.mul_(EMBEDDING_SCALE)
    return HFModel(model, PreTrainedTokenizerFast.from_pretrained(configs / "qwen_tokenizer"), name=f"random {name}")


class KnownOutput:
    """A drafter that knows the output token by token (the plain run's), offered as a
    grounded source like a prediction the output follows: every block is right. The
    prediction drafter itself re-encodes its text, and random weights write token sequences
    that text encodes otherwise, so it is right only in part here (reported apart)."""

    def __init__(self, tokens: list[int]) -> None:
        self.tokens = tokens
        self.prompt_len = 0

    def start(self, prompt, config, generator) -> None:
        self.prompt_len = len(prompt)

    def offers(self, context) -> tuple[Offer, ...]:
        left = len(self.tokens) - (len(context) - self.prompt_len)
        return (Offer("known", limit=left, key="known", cost_hint=0.0, grounded=True),) if left > 0 else ()

    def propose(self, context, k, source=None):
        done = len(context) - self.prompt_len
        return ready(Proposal(tokens=torch.tensor(self.tokens[done : done + k], dtype=torch.long), source="known"))

    def observe(self, context, verdict) -> None:
        pass


def timed(fn, reps: int) -> float:
    """Median milliseconds of ``fn`` over ``reps`` calls after two warm-ups (each call ends
    with its scores on the host, which waits for the device)."""
    for _ in range(2):
        fn()
    times = []
    for _ in range(reps):
        started = time.perf_counter()
        fn()
        times.append(1000 * (time.perf_counter() - started))
    return statistics.median(times)


def curve(lm: HFModel, reps: int = 10) -> list[dict]:
    generator = torch.Generator().manual_seed(1)
    lm.reset()
    lm.forward(torch.randint(0, 150_000, (CONTEXT,), generator=generator).tolist(), last=1)
    rows_out = []
    for rows in ROWS:
        feed = torch.randint(0, 150_000, (rows,), generator=generator).tolist()

        def every_row(feed=feed):
            lm.forward(feed)
            lm.rollback(CONTEXT)

        def last_row(feed=feed):
            lm.forward(feed, last=1)
            lm.rollback(CONTEXT)

        rows_out.append({"rows": rows, "ms_all_scores": timed(every_row, reps), "ms_last_score": timed(last_row, reps)})
    return rows_out


def run(engine: SpeculativeEngine, prompt: list[int], prediction: str | None = None) -> dict:
    config = GenerationConfig(max_new_tokens=NEW_TOKENS, ignore_eos=True, prediction=prediction)
    started = time.perf_counter()
    result = engine.generate(prompt, config)
    seconds = time.perf_counter() - started
    metrics = result.metrics
    return {
        "tokens": result.tokens,
        "seconds": seconds,
        "tok_s": len(result.tokens) / seconds,
        "passes": metrics.target_passes,
        "drafted": metrics.proposed,
        "accepted": metrics.accepted,
        "longest_block": len(metrics.proposed_at),
    }


def engine_runs(target: HFModel, draft: HFModel) -> dict:
    prompt = torch.randint(0, 150_000, (200,), generator=torch.Generator().manual_seed(2)).tolist()
    plain_engine = autoregressive(target)
    prediction_engine = SpeculativeEngine.from_models(target, None)
    model_engine = SpeculativeEngine.from_models(target, draft)
    run(plain_engine, prompt)  # warm-up: the first passes pick kernels
    plain = run(plain_engine, prompt)
    tokens = plain["tokens"]
    decode = target.tokenizer.decode
    edited = decode(tokens[:100]) + decode(tokens[130:])
    known_engine = SpeculativeEngine(prediction_engine.target, KnownOutput(tokens), tokenizer=target.tokenizer)
    runs = {"plain": plain, "known_output": run(known_engine, prompt)}
    runs["prediction"] = run(prediction_engine, prompt, decode(tokens))
    runs["prediction_edited"] = run(prediction_engine, prompt, edited)
    runs["plain_again"] = run(plain_engine, prompt)
    runs["model_drafter"] = run(model_engine, prompt)
    runs["known_output_again"] = run(known_engine, prompt)
    for result in runs.values():
        result["identical_to_plain"] = result["tokens"] == tokens
        result["speedup_vs_plain"] = result["tok_s"] / plain["tok_s"]
    return {name: {k: v for k, v in r.items() if k != "tokens"} for name, r in runs.items()}


def write_configs(configs: Path) -> None:
    from transformers import AutoConfig, AutoTokenizer

    from draftwise.registry import lookup, model_path

    for name, packaged in (("qwen1.5b", "qwen2.5-coder-1.5b"), ("qwen0.5b", "qwen2.5-coder-0.5b")):
        gguf = model_path(lookup(packaged))
        AutoConfig.from_pretrained(gguf.parent, gguf_file=gguf.name).save_pretrained(configs / name)
        if name == "qwen1.5b":
            tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
            tokenizer.save_pretrained(configs / "qwen_tokenizer")


def main(configs: Path, out: Path, deterministic: bool = False) -> None:
    """Every measurement; with ``deterministic`` (torch's deterministic algorithms, which
    cuBLAS needs ``CUBLAS_WORKSPACE_CONFIG=:4096:8`` for), the 1.5B bfloat16 ones again."""
    torch.use_deterministic_algorithms(deterministic)
    report: dict = {
        "device": torch.cuda.get_device_name() if DEVICE == "cuda" else "cpu",
        "torch": torch.__version__,
        "deterministic_algorithms": deterministic,
        "new_tokens": NEW_TOKENS,
        "context_for_curve": CONTEXT,
    }
    curves = (("qwen1.5b", torch.bfloat16), ("qwen0.5b", torch.bfloat16), ("qwen1.5b", torch.float32))
    for name, dtype in curves[:1] if deterministic else curves:
        lm = random_model(configs, name, dtype)
        report[f"curve {name} {str(dtype).removeprefix('torch.')}"] = curve(lm)
        del lm
    for dtype in (torch.bfloat16,) if deterministic else (torch.bfloat16, torch.float32):
        target, draft = random_model(configs, "qwen1.5b", dtype), random_model(configs, "qwen0.5b", dtype)
        report[f"engine {str(dtype).removeprefix('torch.')}"] = engine_runs(target, draft)
        del target, draft
    out.write_text(json.dumps(report, indent=1))
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    if sys.argv[1] == "--configs":
        write_configs(Path(sys.argv[2]))
    else:
        main(Path(sys.argv[1]), Path(sys.argv[2]), deterministic="--deterministic" in sys.argv[3:])
