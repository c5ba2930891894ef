"""Remote verifier overhead: the same speculative run in one process and through a verifier
server on loopback, interleaved so machine noise hits both alike.

    python scripts/remote_verifier.py --target tiny:0 --draft tiny:0 --runs 3

Starts ``draftwise serve-verifier`` as a subprocess (a separate process, as on a real
deployment; ``--server thread`` shares the weights with the local run instead, for models
too big to hold twice), then reports per run tokens/s and, per round trip, the median client time,
server time and network share (client time minus the server's own verify work).
"""

from __future__ import annotations

import argparse
import signal
import socket
import statistics
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager

import httpx


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def wait_healthy(url: str, process: subprocess.Popen, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while True:
        try:
            if httpx.get(f"{url}/health").status_code == 200:
                return
        except httpx.TransportError:
            pass
        if process.poll() is not None or time.monotonic() > deadline:
            raise SystemExit(f"verifier did not start: {process.stderr.read() if process.stderr else ''}")
        time.sleep(0.5)


@contextmanager
def server_process(target: str, threads: int | None) -> Iterator[str]:
    """``draftwise serve-verifier`` in its own process, as on a real deployment."""
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    command = [
        sys.executable,
        "-c",
        "from draftwise.cli import main; main()",
        "serve-verifier",
        "--target",
        target,
        "--port",
        str(port),
    ]
    if threads:
        command += ["--threads", str(threads)]
    server = subprocess.Popen(command, stderr=subprocess.PIPE, text=True)
    try:
        wait_healthy(url, server, timeout=600)
        yield url
    finally:
        server.send_signal(signal.SIGINT)
        server.wait(timeout=30)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--target", default="tiny:0")
    parser.add_argument("--draft", default="tiny:0")
    parser.add_argument("--prompt", default='def fibonacci(n):\n    """Return the n-th Fibonacci number."""\n')
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--k", type=int, default=5, help="fixed draft length, so both runs make the same passes")
    parser.add_argument("--runs", type=int, default=3, help="runs of each kind, interleaved")
    parser.add_argument("--threads", type=int, default=None, help="torch threads, in both processes")
    parser.add_argument(
        "--server",
        choices=("process", "thread"),
        default="process",
        help="verifier in its own process, or in a thread of this one sharing the weights",
    )
    args = parser.parse_args()

    from draftwise.config import DraftConfig, GenerationConfig, ModelOptions
    from draftwise.drafters import ModelDrafter
    from draftwise.engine import SpeculativeEngine
    from draftwise.loading import load_lm
    from draftwise.remote.client import connect
    from draftwise.remote.server import create_app
    from draftwise.remote.settings import VerifierSettings
    from draftwise.target import LocalTarget
    from local_server import serve_in_background  # scripts/, on the path when a script runs

    # Load here first: a GGUF's first load writes its converted weights, which a server
    # process then reads instead of converting the same file at the same time.
    options = ModelOptions(threads=args.threads)
    target = load_lm(args.target, options)
    draft = load_lm(args.draft, options, draft=True)
    with ExitStack() as stack:
        if args.server == "process":
            url = stack.enter_context(server_process(args.target, args.threads))
        else:
            # Same weights as the local run (sessions get their own caches): half the memory.
            settings = VerifierSettings(target=args.target, models=options)
            url = stack.enter_context(serve_in_background(create_app(settings, lm=target)))
        config = GenerationConfig(
            max_new_tokens=args.max_new_tokens, ignore_eos=True, draft=DraftConfig(k_policy="fixed", k=args.k)
        )
        local = SpeculativeEngine(LocalTarget(target), ModelDrafter(draft), tokenizer=draft.tokenizer)
        remote_target = connect(url, tokenizer=draft.tokenizer)
        remote = SpeculativeEngine(remote_target, ModelDrafter(draft), tokenizer=draft.tokenizer)
        local.generate(args.prompt, config.model_copy(update={"max_new_tokens": 8}))  # warm-up
        remote.generate(args.prompt, config.model_copy(update={"max_new_tokens": 8}))
        rates: dict[str, list[float]] = {"local": [], "remote": []}
        round_trips: list[dict] = []
        outputs: dict[str, list[int]] = {}
        for run in range(args.runs):
            for name, engine in (("local", local), ("remote", remote)):
                started = time.perf_counter()
                result = engine.generate(args.prompt, config)
                elapsed = time.perf_counter() - started
                rates[name].append(len(result.tokens) / elapsed)
                outputs[name] = result.tokens
                if name == "remote":
                    round_trips += [e.extra | {"client": e.verify_seconds} for e in result.events]
                print(
                    f"run {run} {name:6s} {len(result.tokens)} tokens in {elapsed:.3f} s: "
                    f"{rates[name][-1]:.2f} tok/s, {result.metrics.target_passes} passes, "
                    f"acceptance {result.metrics.acceptance_rate:.2f}"
                )
        remote_target.close()

    def median_ms(key: str) -> float:
        return 1000 * statistics.median(r[key] for r in round_trips)

    local_rate, remote_rate = statistics.median(rates["local"]), statistics.median(rates["remote"])
    print(
        f"\ntarget {args.target}, draft {args.draft}, k={args.k}, {args.max_new_tokens} tokens, {args.runs} runs each"
    )
    print(
        f"tokens/s median: local {local_rate:.2f}, remote {remote_rate:.2f} "
        f"({100 * (remote_rate / local_rate - 1):+.1f}%); outputs identical: {outputs['local'] == outputs['remote']}"
    )
    print(
        f"per round trip (median of {len(round_trips)}): client {median_ms('client'):.2f} ms, "
        f"server {median_ms('server_seconds'):.2f} ms, network {median_ms('network_seconds'):.2f} ms; "
        f"request {statistics.median(r['request_bytes'] for r in round_trips):.0f} B, "
        f"response {statistics.median(r['response_bytes'] for r in round_trips):.0f} B (bodies)"
    )


if __name__ == "__main__":
    main()
