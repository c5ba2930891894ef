"""How much of each structured answer the grammar forced, asked of a running ``draftwise serve``.

Sends every task of the given files (``benchmarks/data/extraction.jsonl``,
``benchmarks/data/tool_calls.jsonl``) once, greedy and not streamed, and reads the answer's
``speculative`` statistics: the tokens the ``grammar`` source proposed and kept, over the
completion tokens. Also checks each answer: an extraction parses as JSON; a tool call names the
task's ``expected`` function and its arguments parse as JSON.

    python benchmarks/structured_amd/forced.py URL MODEL FILE... > forced.json
"""

from __future__ import annotations

import json
import sys

import httpx

FIELDS = ("response_format", "tools", "tool_choice", "parallel_tool_calls")


def ask(url: str, model: str, row: dict) -> dict:
    body = {"model": model, "messages": [{"role": "user", "content": row["turns"][0]}], "temperature": 0}
    body |= {"max_tokens": 256} | {k: row[k] for k in FIELDS if k in row}
    answer = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=900).json()
    stats, message = answer["speculative"], answer["choices"][0]["message"]
    calls = message.get("tool_calls") or []
    if "expected" in row:
        valid = len(calls) == 1 and calls[0]["function"]["name"] == row["expected"]
        valid = valid and isinstance(json.loads(calls[0]["function"]["arguments"]), dict)
    else:
        try:
            valid = isinstance(json.loads(message["content"]), dict)
        except ValueError:
            valid = False
    return {
        "id": row["id"],
        "tokens": stats["new_tokens"],
        "grammar_kept": stats["kept_by_source"].get("grammar", 0),
        "grammar_proposed": stats["proposed_by_source"].get("grammar", 0),
        "finish_reason": answer["choices"][0]["finish_reason"],
        "valid": valid,
    }


def main() -> None:
    url, model, *files = sys.argv[1:]
    results = []
    for path in files:
        for line in open(path, encoding="utf-8"):
            if line.strip():
                results.append(ask(url, model, json.loads(line)))
                print(json.dumps(results[-1]), file=sys.stderr)
    json.dump(results, sys.stdout, indent=1)


if __name__ == "__main__":
    main()
