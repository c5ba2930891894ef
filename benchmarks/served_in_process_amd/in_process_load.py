"""`draftwise load`'s prompts through a draftwise server's own request path, in this process,
without HTTP: the app that `draftwise serve` builds (create_app over prepare_pair with the same
slots), each request parsed, tokenized and planned as its route does, then run by the app's
worker pool (the scheduler in rounds), C clients at a time as `draftwise load` sends them.
What it leaves out is uvicorn, the HTTP client, and the SSE chunks (JSON, detokenizing).

    python benchmarks/served_in_process_amd/in_process_load.py C [--drafter off] [--limit 2]

Prints one JSON line: tokens, wall seconds, tok/s, decode tok/s (tokens after each request's
first step over the time after it).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time
from typing import Any

from draftwise.api import schemas as s
from draftwise.api.app import create_app
from draftwise.api.settings import ServerSettings
from draftwise.api.translate import encode_chat, encode_completion, plan
from draftwise.cli.options import built
from draftwise.config import ModelOptions
from draftwise.loadbench.config import LoadConfig
from draftwise.loadbench.prompts import LoadPrompt, load_prompts
from draftwise.prepare import prepare_pair


async def one(app: Any, prompt: LoadPrompt, max_tokens: int) -> tuple[int, float, float]:
    """(tokens, seconds to the first step with tokens, seconds to the end) of one request."""
    settings, pool = app.state.settings, app.state.pool
    tokenizer = app.state.pool_tokenizer
    started = time.perf_counter()
    body = prompt.body(settings.served_model, max_tokens)
    if prompt.chat:
        request: Any = s.ChatCompletionRequest.model_validate(body)
        ids = encode_chat(request, tokenizer, None)
    else:
        request = s.CompletionRequest.model_validate(body)
        ids = encode_completion(request, tokenizer, app.state.vocab_size, settings.parse_special, None)
    request_plan = plan(request, ids, settings, app.state.context_limit, settings.draft is not None)
    job = pool.admit()
    tokens, first = 0, None
    async for event in pool.run(job, request_plan.prompt, request_plan.config, request_plan.drafter):
        tokens += len(event.tokens)
        if first is None and event.tokens:
            first = time.perf_counter() - started
    return tokens, first or 0.0, time.perf_counter() - started


async def level(app: Any, prompts: list[LoadPrompt], clients: int, max_tokens: int) -> dict[str, Any]:
    await one(app, prompts[0], 8)  # the warm-up `draftwise load` sends
    queue = iter(prompts)
    done: list[tuple[int, float, float]] = []

    async def client() -> None:
        for prompt in queue:
            done.append(await one(app, prompt, max_tokens))

    t0 = time.perf_counter()
    await asyncio.gather(*(client() for _ in range(clients)))
    wall = time.perf_counter() - t0
    tokens = sum(n for n, _, _ in done)
    decode = sum(n - 1 for n, _, _ in done) / sum(end - first for _, first, end in done)
    return {"clients": clients, "tokens": tokens, "wall_s": round(wall, 2), "tok_s": round(tokens / wall, 2)} | {
        "decode_tok_s": round(decode, 2)
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("clients", type=int)
    parser.add_argument("--drafter", default=None)
    parser.add_argument("--limit", type=int, default=2)
    parser.add_argument("--max-tokens", type=int, default=128)
    args = parser.parse_args()
    target, draft = "qwen2.5-coder-1.5b", "qwen2.5-coder-0.5b"
    load = built(LoadConfig, servers=("draftwise",), target=target, limit=args.limit)
    prompts = load_prompts(load)
    models = ModelOptions(threads=2, context=load.context)
    settings = ServerSettings(
        target=target, draft=draft, drafter=args.drafter, slots=args.clients, queue_size=args.clients, models=models
    )
    pair = prepare_pair(target, draft, models, settings.generation.draft, slots=args.clients)
    app = create_app(settings, pair, own=True)
    app.state.pool_tokenizer = pair.target.tokenizer
    app.state.vocab_size = pair.target.vocab_size
    app.state.context_limit = pair.target.max_context
    try:
        print(json.dumps({"prompts": len(prompts)} | asyncio.run(level(app, prompts, args.clients, args.max_tokens))))
    finally:
        app.state.pool.close()


if __name__ == "__main__":
    main()
