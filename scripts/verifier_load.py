"""Aggregate verified tokens/s of N drafter clients on one verifier.

Starts ``draftwise serve-verifier`` as a child process on 127.0.0.1 (with the ``python`` given,
so that two checkouts can be compared: ``--python``, ``--pythonpath``), then runs ``--clients``
remote generations at once in this process, each an n-gram drafter over a ``RemoteTarget``
(no draft model, so the clients cost the verifier's CPU nothing), greedy, ``--max-tokens``
each, every client on its own prompt; then the same prompts one client at a time. Prints one
JSON object: tokens, seconds and tokens/s of both phases, and whether every concurrent output
equals the one-at-a-time output of the same prompt.

    python scripts/verifier_load.py --target qwen2.5-coder-1.5b --clients 4 --max-tokens 64
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

from local_server import free_port, wait_for

PROMPTS = [
    "def quicksort(arr):",
    "import os\nimport sys\n\ndef main():",
    "class LinkedList:\n    def __init__(self):",
    "# Compute the nth prime number\ndef nth_prime(n):",
    "def merge_sort(items):",
    "SELECT name, COUNT(*) FROM orders",
    "function debounce(fn, ms) {",
    "The three laws of thermodynamics are",
]


def _generate(url: str, tokenizer, prompt: str, max_tokens: int) -> list[int]:
    from draftwise.config import DraftConfig, GenerationConfig, SamplingConfig
    from draftwise.drafters import NGramDrafter
    from draftwise.engine import SpeculativeEngine
    from draftwise.remote.client import connect

    config = GenerationConfig(
        max_new_tokens=max_tokens,
        ignore_eos=True,
        sampling=SamplingConfig(temperature=0),
        draft=DraftConfig(k_policy="fixed", k=4),
    )
    with connect(url, tokenizer=tokenizer) as target:
        engine = SpeculativeEngine(target, NGramDrafter(), tokenizer)
        return engine.generate(tokenizer.encode(prompt), config).tokens


def _concurrently(url: str, tokenizer, prompts: list[str], max_tokens: int) -> tuple[list[list[int]], float]:
    outputs: list[list[int]] = [[] for _ in prompts]

    def run(i: int) -> None:
        outputs[i] = _generate(url, tokenizer, prompts[i], max_tokens)

    started = time.perf_counter()
    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(prompts))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return outputs, time.perf_counter() - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", default="qwen2.5-coder-1.5b")
    parser.add_argument("--clients", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--python", default=sys.executable, help="the interpreter that runs the verifier")
    parser.add_argument("--pythonpath", default=None, help="PYTHONPATH of the verifier (another checkout's src)")
    parser.add_argument("--extra", default="", help="more serve-verifier flags, space-separated")
    args = parser.parse_args()

    from draftwise.config import ModelOptions
    from draftwise.loading import load_lm

    tokenizer = load_lm(args.target, ModelOptions(backend="llamacpp", threads=1, context=256)).tokenizer
    port = free_port()
    env = {**os.environ, **({"PYTHONPATH": args.pythonpath} if args.pythonpath else {})}
    command = [args.python, "-c", "from draftwise.cli import main; main()", "serve-verifier", "--target", args.target]
    command += ["--port", str(port), "--threads", str(args.threads), *args.extra.split()]
    server = subprocess.Popen(command, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_for(f"{url}/health", server, timeout=300)
        prompts = (PROMPTS * (args.clients // len(PROMPTS) + 1))[: args.clients]
        _generate(url, tokenizer, "warm up", 4)
        together, together_s = _concurrently(url, tokenizer, prompts, args.max_tokens)
        alone_s = 0.0
        alone = []
        for prompt in prompts:
            outputs, seconds = _concurrently(url, tokenizer, [prompt], args.max_tokens)
            alone.append(outputs[0])
            alone_s += seconds
    finally:
        server.terminate()
        try:
            server.wait(timeout=30)
        except subprocess.TimeoutExpired:
            server.kill()
            server.wait()
    tokens = sum(len(o) for o in together)
    print(
        json.dumps(
            {
                "target": args.target,
                "clients": args.clients,
                "verifier": str(Path(args.pythonpath).resolve()) if args.pythonpath else "this checkout",
                "concurrent": {
                    "tokens": tokens,
                    "seconds": round(together_s, 2),
                    "tok_s": round(tokens / together_s, 2),
                },
                "one_at_a_time": {
                    "tokens": sum(len(o) for o in alone),
                    "seconds": round(alone_s, 2),
                    "tok_s": round(sum(len(o) for o in alone) / alone_s, 2),
                },
                "identical": sum(a == b for a, b in zip(together, alone)),
            }
        )
    )


if __name__ == "__main__":
    main()
