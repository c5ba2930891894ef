"""Passes and verification time of structured answers, asked of a running ``draftwise serve``.

Sends the first N tasks of a file (``benchmarks/data/extraction.jsonl`` or
``benchmarks/data/tool_calls.jsonl``) once each, greedy and not streamed, and prints per task
the answer's ``speculative`` statistics: new tokens, target passes, tokens proposed and kept
per source, verification, drafting and total seconds; then the sums.

    python benchmarks/grammar_mixed_amd/passes.py URL MODEL FILE N
"""

from __future__ import annotations

import json
import sys

import httpx

FIELDS = ("response_format", "tools", "tool_choice", "parallel_tool_calls")
SUMMED = ("new_tokens", "target_passes", "verify_seconds", "draft_seconds", "total_seconds", "prefill_seconds")


def main() -> None:
    url, model, path, count = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
    totals = dict.fromkeys(SUMMED, 0.0)
    with open(path, encoding="utf-8") as rows:
        for row in [json.loads(line) for line in rows if line.strip()][:count]:
            body = {"model": model, "messages": [{"role": "user", "content": row["turns"][0]}], "temperature": 0}
            body |= {"max_tokens": 256} | {k: row[k] for k in FIELDS if k in row}
            stats = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=900).json()["speculative"]
            print(
                row["id"],
                stats["new_tokens"],
                stats["target_passes"],
                stats["proposed_by_source"],
                stats["kept_by_source"],
                *(round(stats[k], 2) for k in ("verify_seconds", "draft_seconds", "total_seconds")),
                flush=True,
            )
            for key in SUMMED:
                totals[key] += stats[key]
    print({key: round(value, 2) for key, value in totals.items()})


if __name__ == "__main__":
    main()
