"""Time to first token of long prompts sent together, against a running ``draftwise serve``
(or any OpenAI-compatible server).

Sends ``N`` chat requests at once, each asking to summarise a different stretch of a text
file (about ``WORDS`` words each), streamed, greedy, 16 tokens; prints each request's time to
its first content and its prompt tokens, as JSON lines, in order of arrival of the first token.

    python benchmarks/prefill_order_amd/ttft_pair.py URL MODEL FILE [N] [WORDS]
"""

from __future__ import annotations

import json
import sys
import threading
import time

import httpx


def ask(url: str, model: str, text: str, sent: float, out: list[dict]) -> None:
    body = {
        "model": model,
        "messages": [{"role": "user", "content": f"Summarise this text in one sentence.\n\n{text}"}],
        "temperature": 0,
        "max_tokens": 16,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    first, prompt = None, None
    with httpx.stream("POST", f"{url}/v1/chat/completions", json=body, timeout=900) as response:
        for line in response.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if first is None and chunk.get("choices") and chunk["choices"][0]["delta"].get("content"):
                first = time.perf_counter() - sent
            if chunk.get("usage"):
                prompt = chunk["usage"]["prompt_tokens"]
    out.append(
        {"ttft_s": round(first or -1.0, 2), "prompt_tokens": prompt, "done_s": round(time.perf_counter() - sent, 2)}
    )


def main() -> None:
    url, model, path = sys.argv[1:4]
    count = int(sys.argv[4]) if len(sys.argv) > 4 else 2
    words = int(sys.argv[5]) if len(sys.argv) > 5 else 900
    source = open(path, encoding="utf-8").read().split()
    texts = [" ".join(source[i * words : (i + 1) * words]) for i in range(count)]
    out: list[dict] = []
    sent = time.perf_counter()
    threads = [threading.Thread(target=ask, args=(url, model, text, sent, out)) for text in texts]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    for row in sorted(out, key=lambda row: row["ttft_s"]):
        print(json.dumps(row))


if __name__ == "__main__":
    main()
