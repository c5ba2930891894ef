"""Load test of the OpenAI-compatible server: tokens/s for 1 and for N concurrent streaming clients.

Starts a server in-process (``--target``/``--draft``/``--drafter``, like ``draftwise serve``)
or measures a running one (``--url``). Each client streams its requests one after another
with the official ``openai`` client; tokens are counted from the server's ``usage`` chunk.

    python scripts/api_load.py --target tiny:0 --drafter ngram --workers 4
    python scripts/api_load.py --target qwen2.5-coder-1.5b --draft qwen2.5-coder-0.5b --workers 2
    python scripts/api_load.py --url http://127.0.0.1:8000 --model qwen2.5-coder-1.5b
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import statistics
import sys
import time
from collections.abc import Iterator
from typing import Any

from local_server import serve_in_background  # scripts/, on the path when a script runs

PROMPTS = [
    "Write a Python function that checks whether a number is prime.",
    "Write a Python function that returns the n-th Fibonacci number iteratively.",
    "Write a Python class for a stack with push, pop and peek.",
    "Write a Python function that reverses the words of a sentence.",
    "Write a Python function that merges two sorted lists into one sorted list.",
    "Write a Python function that counts the vowels in a string.",
    "Write a Python function that flattens a nested list.",
    "Write a Python function that checks whether a string is a palindrome.",
]


async def one_request(client: Any, args: argparse.Namespace, prompt: str) -> dict[str, Any]:
    body: dict[str, Any] = {
        "model": args.model,
        "max_tokens": args.max_tokens,
        "temperature": args.temperature,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    extra = {"speculative": {"drafter": args.request_drafter}} if args.request_drafter else None
    started = time.perf_counter()
    first = None
    if args.endpoint == "chat":
        stream = await client.chat.completions.create(
            messages=[{"role": "user", "content": prompt}], **body, extra_body=extra
        )
    else:
        stream = await client.completions.create(prompt=prompt, **body, extra_body=extra)
    usage, stats = None, {}
    async for chunk in stream:
        if first is None and chunk.choices:
            first = time.perf_counter() - started
        if chunk.usage is not None:
            usage = chunk.usage
        if getattr(chunk, "speculative", None):
            stats = chunk.speculative
    return {
        "tokens": usage.completion_tokens if usage else 0,
        "seconds": time.perf_counter() - started,
        "ttft": first or 0.0,
        "acceptance_rate": stats.get("acceptance_rate"),
        "mean_accepted_length": stats.get("mean_accepted_length"),
    }


async def run_level(url: str, args: argparse.Namespace, clients: int, advance: Any) -> dict[str, Any]:
    import openai

    client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=3600)

    async def worker(index: int) -> list[dict[str, Any]]:
        results = []
        for r in range(args.requests):
            results.append(await one_request(client, args, PROMPTS[(index * args.requests + r) % len(PROMPTS)]))
            advance()
        return results

    started = time.perf_counter()
    results = [x for per_client in await asyncio.gather(*(worker(i) for i in range(clients))) for x in per_client]
    wall = time.perf_counter() - started
    tokens = sum(r["tokens"] for r in results)
    rates = [r["acceptance_rate"] for r in results if r["acceptance_rate"] is not None]
    return {
        "clients": clients,
        "requests": len(results),
        "tokens": tokens,
        "wall_s": round(wall, 2),
        "tok/s": round(tokens / wall, 2),
        "tok/s_per_request": round(statistics.mean(r["tokens"] / r["seconds"] for r in results), 2),
        "ttft_s": round(statistics.mean(r["ttft"] for r in results), 3),
        "acceptance": round(statistics.mean(rates), 3) if rates else None,
    }


@contextlib.contextmanager
def server(args: argparse.Namespace) -> Iterator[str]:
    if args.url:
        yield args.url.rstrip("/")
        return
    from draftwise.api.app import create_app
    from draftwise.api.settings import ServerSettings
    from draftwise.config import ModelOptions
    from draftwise.prepare import prepare_pair

    settings = ServerSettings(
        target=args.target,
        draft=args.draft,
        drafter=args.drafter,
        slots=args.workers,
        queue_size=max(args.concurrency),
        models=ModelOptions(threads=args.threads),
        request_timeout=3600,
    )
    args.model = settings.served_model
    pair = prepare_pair(
        settings.target,
        settings.draft,
        settings.models,
        settings.generation.draft,
        slots=settings.slots,
        log=lambda note: print(note, file=sys.stderr),
    )
    app = create_app(settings, pair)
    with serve_in_background(app) as url:
        yield url


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--url", help="a running server; otherwise one is started in-process")
    parser.add_argument("--model", help="model id of a running server (--url)")
    parser.add_argument("--target", default="tiny:0")
    parser.add_argument("--draft")
    parser.add_argument("--drafter", choices=["model", "ngram", "off"])
    parser.add_argument("--workers", type=int, default=4, help="server workers (in-process server)")
    parser.add_argument("--threads", type=int, help="torch threads (in-process server)")
    parser.add_argument("--request-drafter", choices=["model", "ngram", "off"], help="per-request drafter")
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 4])
    parser.add_argument("--requests", type=int, default=2, help="requests per client, one after another")
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--endpoint", choices=["chat", "completions"], default="chat")
    parser.add_argument("--json", help="also write the results to this file")
    args = parser.parse_args()
    if args.url and not args.model:
        parser.error("--url needs --model")

    from rich.console import Console
    from rich.progress import Progress
    from rich.table import Table

    levels = []
    with server(args) as url, Progress(transient=True) as progress:
        asyncio.run(
            run_level(url, argparse.Namespace(**{**vars(args), "requests": 1, "max_tokens": 8}), 1, lambda: None)
        )  # warm-up
        for clients in args.concurrency:
            task = progress.add_task(f"{clients} client(s)", total=clients * args.requests)
            levels.append(asyncio.run(run_level(url, args, clients, lambda t=task: progress.advance(t))))
    table = Table(title=f"{args.model} via {args.endpoint}, max_tokens={args.max_tokens}")
    for column in levels[0]:
        table.add_column(column)
    for level in levels:
        table.add_row(*(str(v) for v in level.values()))
    Console().print(table)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": {k: v for k, v in vars(args).items()}, "levels": levels}, f, indent=2)


if __name__ == "__main__":
    main()
