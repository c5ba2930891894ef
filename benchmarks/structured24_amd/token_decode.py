"""Decode speed from the first generated token on, as a running server streams it, one request at
a time: per answer, the tokens after the first (the server's ``usage`` count, less one) over the
time from the chunk that carries the first token to the chunk that carries the last, summed over
the answers.

`draftwise load`'s decode columns start the clock at the first chunk with text. A tool call
streams its opening and its name as no text, so there the clock starts late. Here draftwise is
asked with ``speculative.provenance``, which gives every target pass a chunk listing its tokens,
text or not; llama-server streams a chunk a token (its first chunk with content or a tool call
carries its first token).

    python token_decode.py URL MODEL TASKS.jsonl [--provenance] > out.json
"""

from __future__ import annotations

import json
import sys
import time

import httpx

FIELDS = ("response_format", "tools", "tool_choice", "parallel_tool_calls")


def carries_tokens(chunk: dict) -> bool:
    if chunk.get("provenance"):
        return True
    for choice in chunk.get("choices") or []:
        delta = choice.get("delta") or {}
        if delta.get("content") or delta.get("tool_calls"):
            return True
    return False


def ask(url: str, model: str, row: dict, provenance: bool, max_tokens: int) -> dict:
    body = {"model": model, "messages": [{"role": "user", "content": row["turns"][0]}], "temperature": 0}
    body |= {"max_tokens": max_tokens, "stream": True, "stream_options": {"include_usage": True}}
    body |= {k: row[k] for k in FIELDS if k in row}
    if provenance:
        body["speculative"] = {"provenance": True}
    started, first, last, tokens = time.perf_counter(), None, None, None
    # A connection a request: llama-server closes one after a streamed answer.
    with (
        httpx.Client(timeout=900, trust_env=False) as client,
        client.stream("POST", f"{url}/v1/chat/completions", json=body) as response,
    ):
        response.raise_for_status()
        for line in response.iter_lines():
            if not line.startswith("data:") or line[5:].strip() == "[DONE]":
                continue
            chunk, now = json.loads(line[5:]), time.perf_counter() - started
            if carries_tokens(chunk):
                first = now if first is None else first
                last = now
            if chunk.get("usage"):
                tokens = chunk["usage"]["completion_tokens"]
    return {"id": row["id"], "tokens": tokens, "first_s": first, "last_s": last, "end_s": time.perf_counter() - started}


def main() -> None:
    url, model, path, *flags = sys.argv[1:]
    rows = [json.loads(line) for line in open(path, encoding="utf-8") if line.strip()]
    ask(url, model, rows[0], "--provenance" in flags, 8)  # warm-up, as `draftwise load` does
    answers = [ask(url, model, row, "--provenance" in flags, 128) for row in rows]
    after = sum(a["tokens"] - 1 for a in answers)
    seconds = sum(a["last_s"] - a["first_s"] for a in answers)
    print(json.dumps({"answers": answers, "tokens_after_first": after, "seconds": seconds, "tok_s": after / seconds}))


if __name__ == "__main__":
    main()
