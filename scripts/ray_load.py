"""What Ray Serve costs and gives on this machine, with tiny models, on 127.0.0.1 only.

Every server is the real CLI in a child process (``scripts/soak.py``'s ``cli_server``): a plain
``draftwise serve`` on uvicorn, ``draftwise serve --ray`` (each with its own local Ray bound to
127.0.0.1) and ``draftwise serve-verifier --ray``. All servers run with ``--threads 1``, and a
replica holds one CPU, so "one worker" means one core everywhere.

1. Latency Ray Serve adds per request: ``--requests`` sequential requests to a plain server and
   to one Ray replica, of two kinds: ``GET /v1/models`` (no model work: the serving path alone)
   and a one-token completion. p50 and p99 of each, and Ray's minus plain.
2. Throughput: ``--clients`` concurrent clients, ``--per-client`` completions of
   ``--max-tokens`` tokens each, against a plain server with 1 and 2 workers and Ray with 1 and
   2 replicas (one worker each): generated tokens per second of wall time.
3. Verifier affinity: ``--sessions`` generations, each its own session, by ``--clients``
   threads through ``serve-verifier --ray`` with 2 replicas: the fleet's hits and misses (from
   ``/health``), the sessions that missed at least once, the clients' re-opens, and whether
   every output equals the local run's.

Bounded: fixed counts, a timeout on every request, servers stopped at the end.

    python scripts/ray_load.py --out benchmarks/ray/result.json
    python scripts/ray_load.py --requests 50 --per-client 2 --sessions 16      # a quick look
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from soak import _percentile, cli_server, machine

PAIR = ["--target", "tiny:0", "--draft", "tiny:1", "--threads", "1"]
RAY = ["--ray", "--cpus-per-replica", "1"]
ONE_TOKEN = {
    "model": "tiny:0",
    "prompt": "Once upon a time",
    "max_tokens": 1,
    "temperature": 0,
    "speculative": {"drafter": "off"},
}
PROMPTS = [
    "def fibonacci(n):",
    "The quick brown fox",
    "1, 2, 3, 5, 8,",
    "Once upon a time, once upon a",
    "SELECT * FROM users WHERE",
    "class Stack:\n    def __init__(self):",
]
TIMEOUT_S = 120.0


def _stats(seconds: list[float]) -> dict[str, float]:
    ordered = sorted(seconds)
    return {
        "n": len(ordered),
        "p50_ms": 1000 * statistics.median(ordered),
        "p99_ms": 1000 * (_percentile(ordered, 99) or 0.0),
        "mean_ms": 1000 * statistics.fmean(ordered),
    }


def latencies(url: str, requests: int) -> dict[str, Any]:
    """Sequential requests of both kinds (after a short warm-up): their latency statistics."""
    out = {}
    with httpx.Client(base_url=url, timeout=TIMEOUT_S, trust_env=False) as http:
        for kind, call in (
            ("models", lambda: http.get("/v1/models")),
            ("one_token", lambda: http.post("/v1/completions", json=ONE_TOKEN)),
        ):
            for _ in range(10):
                call().raise_for_status()
            seconds = []
            for _ in range(requests):
                started = time.perf_counter()
                call().raise_for_status()
                seconds.append(time.perf_counter() - started)
            out[kind] = _stats(seconds)
    return out


async def _throughput(url: str, clients: int, per_client: int, max_tokens: int) -> dict[str, Any]:
    async def client(index: int, http: httpx.AsyncClient) -> int:
        tokens = 0
        for i in range(per_client):
            body = {
                "model": "tiny:0",
                "prompt": PROMPTS[(index + i) % len(PROMPTS)],
                "max_tokens": max_tokens,
                "temperature": 0,
                "speculative": {"drafter": "ngram"},
            }
            response = await http.post("/v1/completions", json=body)
            response.raise_for_status()
            tokens += response.json()["usage"]["completion_tokens"]
        return tokens

    limits = httpx.Limits(max_connections=clients)
    async with httpx.AsyncClient(base_url=url, timeout=TIMEOUT_S, limits=limits, trust_env=False) as http:
        await client(0, http)  # warm-up
        started = time.perf_counter()
        tokens = sum(await asyncio.gather(*(client(i, http) for i in range(clients))))
        wall = time.perf_counter() - started
    return {
        "clients": clients,
        "requests": clients * per_client,
        "tokens": tokens,
        "seconds": wall,
        "tokens_per_second": tokens / wall,
    }


def throughput(url: str, args: argparse.Namespace) -> dict[str, Any]:
    return asyncio.run(_throughput(url, args.clients, args.per_client, args.max_tokens))


def _fleet_health(url: str) -> dict[str, Any]:
    time.sleep(2.5)  # every replica has reported (draftwise.cluster.fleet.REPORT_EVERY_S)
    return httpx.get(url + "/health", timeout=TIMEOUT_S, trust_env=False).json()


def affinity(url: str, args: argparse.Namespace) -> dict[str, Any]:
    """``args.sessions`` remote generations through the fleet, ``args.clients`` at a time."""
    from draftwise.backends.tiny import tiny_lm
    from draftwise.config import DraftConfig, GenerationConfig
    from draftwise.drafters import ModelDrafter
    from draftwise.engine import SpeculativeEngine
    from draftwise.remote.client import connect

    config = GenerationConfig(max_new_tokens=32, ignore_eos=True, draft=DraftConfig(k_policy="fixed", k=4))
    target = tiny_lm(0)
    expected = {p: SpeculativeEngine.from_models(target, tiny_lm(1)).generate(p, config).tokens for p in PROMPTS}
    before = _fleet_health(url)["affinity"]
    sessions: list[dict[str, Any]] = []
    lock = threading.Lock()

    def client(index: int) -> None:
        draft = tiny_lm(1)  # a model per thread: each holds its own cache
        for i in range(index, args.sessions, args.clients):
            prompt = PROMPTS[i % len(PROMPTS)]
            with connect(url, tokenizer=draft.tokenizer) as remote:
                result = SpeculativeEngine(remote, ModelDrafter(draft), tokenizer=draft.tokenizer).generate(
                    prompt, config
                )
            with lock:
                sessions.append(
                    {
                        "identical": result.tokens == expected[prompt],
                        "retries": remote.routing_retries,
                        "reopens": remote.reopens,
                    }
                )

    threads = [threading.Thread(target=client, args=(i,)) for i in range(args.clients)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=600)
    after = _fleet_health(url)
    hits, misses = (after["affinity"][k] - before[k] for k in ("hits", "misses"))
    return {
        "sessions": len(sessions),
        "clients": args.clients,
        "replicas": len(after.get("replicas") or {}),
        "verify_hits": hits,
        "verify_misses": misses,
        "hit_rate": hits / max(1, hits + misses),
        "sessions_with_a_miss": sum(s["retries"] > 0 for s in sessions),
        "session_hit_rate": sum(s["retries"] == 0 for s in sessions) / max(1, len(sessions)),
        "client_reopens": sum(s["reopens"] for s in sessions),
        "all_identical_to_local": all(s["identical"] for s in sessions) and len(sessions) == args.sessions,
    }


def run(args: argparse.Namespace, workdir: Path) -> dict[str, Any]:
    result: dict[str, Any] = {}
    phases = [
        ("plain_1_worker", ["serve", *PAIR, "--workers", "1"], "/health", ("latency", "throughput")),
        ("plain_2_workers", ["serve", *PAIR, "--workers", "2"], "/health", ("throughput",)),
        ("ray_1_replica", ["serve", *PAIR, *RAY, "--replicas", "1"], "/health", ("latency", "throughput")),
        ("ray_2_replicas", ["serve", *PAIR, *RAY, "--replicas", "2"], "/health", ("throughput",)),
        (
            "verifier_ray_2_replicas",
            ["serve-verifier", "--target", "tiny:0", "--threads", "1", *RAY, "--replicas", "2", "--max-sessions", "64"],
            "/health",
            ("affinity",),
        ),
    ]
    for name, command, health, measures in phases:
        print(f"{name}: starting ...", file=sys.stderr, flush=True)
        with cli_server(command, health, workdir / f"{name}.log") as (url, _):
            phase: dict[str, Any] = {}
            if "latency" in measures:
                phase["latency"] = latencies(url, args.requests)
            if "throughput" in measures:
                phase["throughput"] = throughput(url, args)
            if "affinity" in measures:
                phase["affinity"] = affinity(url, args)
            result[name] = phase
        print(f"{name}: {json.dumps(phase)}", file=sys.stderr, flush=True)
    return result


def added_latency(result: dict[str, Any]) -> dict[str, Any]:
    plain, ray = result["plain_1_worker"]["latency"], result["ray_1_replica"]["latency"]
    return {kind: {q: ray[kind][q] - plain[kind][q] for q in ("p50_ms", "p99_ms")} for kind in plain}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=300, help="sequential requests per latency kind")
    parser.add_argument("--clients", type=int, default=4, help="concurrent clients (throughput, affinity)")
    parser.add_argument("--per-client", type=int, default=10, help="completions per client (throughput)")
    parser.add_argument("--max-tokens", type=int, default=64, help="tokens per completion (throughput)")
    parser.add_argument("--sessions", type=int, default=64, help="verifier sessions (affinity)")
    parser.add_argument("--out", type=Path, default=None, help="write the result here as JSON")
    args = parser.parse_args()
    result: dict[str, Any] = {
        "command": " ".join(["python", *sys.argv]),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "machine": machine(),
    }
    with tempfile.TemporaryDirectory(prefix="draftwise-ray-") as workdir:
        result["runs"] = run(args, Path(workdir))
    result["ray_added_latency_ms"] = added_latency(result["runs"])
    text = json.dumps(result, indent=2)
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text + "\n")
    print(text)


if __name__ == "__main__":
    main()
