"""The same tool list in every request: does the prompt cache make the second request's
prefill nearly free? Asked of a running OpenAI-compatible server (draftwise serve, or
llama-server --jinja).

Takes the task of ``FILE`` (``benchmarks/data/tool_calls.jsonl``) with the longest tool list
and sends ``N`` requests one after another, each with those tools and the request text of
another task (so only the tool list and the template around it repeat), streamed, greedy,
``tool_choice`` as the task says. Prints, per request, the time to the first streamed piece
(content or tool call), the latency, the prompt tokens and the prompt tokens the server says
it took from its cache (``usage.prompt_tokens_details.cached_tokens``; llama-server:
``timings.cache_n``), as JSON lines.

    python benchmarks/tools_cache_amd/repeat_tools.py URL MODEL FILE [N]
"""

from __future__ import annotations

import json
import sys
import time

import httpx


def ask(url: str, model: str, tools_row: dict, text: str) -> dict:
    body = {
        "model": model,
        "messages": [{"role": "user", "content": text}],
        "tools": tools_row["tools"],
        "tool_choice": tools_row["tool_choice"],
        "parallel_tool_calls": False,
        "temperature": 0,
        "max_tokens": 64,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    sent, first, usage, timings = time.perf_counter(), None, {}, {}
    with httpx.stream("POST", f"{url}/v1/chat/completions", json=body, timeout=900) as response:
        for line in response.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            delta = chunk["choices"][0]["delta"] if chunk.get("choices") else {}
            if first is None and (delta.get("content") or delta.get("tool_calls")):
                first = time.perf_counter() - sent
            usage = chunk.get("usage") or usage
            timings = chunk.get("timings") or timings
    cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens", timings.get("cache_n"))
    return {
        "ttft_s": round(first or -1.0, 2),
        "latency_s": round(time.perf_counter() - sent, 2),
        "prompt_tokens": usage.get("prompt_tokens"),
        "cached_tokens": cached,
    }


def main() -> None:
    url, model, path = sys.argv[1:4]
    count = int(sys.argv[4]) if len(sys.argv) > 4 else 4
    with open(path, encoding="utf-8") as lines:
        rows = [json.loads(line) for line in lines if line.strip()]
    tools_row = max(rows, key=lambda row: len(json.dumps(row["tools"])))
    for row in rows[:count]:
        print(json.dumps({"task": row["id"]} | ask(url, model, tools_row, row["turns"][0])), flush=True)


if __name__ == "__main__":
    main()
