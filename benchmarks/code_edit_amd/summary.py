"""Per-server figures of a `draftwise load --edit` run, beside plain decoding's answers.

Reads results.jsonl of the run folder given (default: this folder) and prints, per server and
concurrency: decode-phase and end-to-end tok/s, TTFT p50, the prediction's accepted and
rejected tokens, and how many answers are identical to llama-server's plain answer and to
draftwise's own answer without a prediction (the same prompt at the same concurrency).

Usage: python benchmarks/code_edit_amd/summary.py [RUN_FOLDER]
"""

from __future__ import annotations

import json
import statistics
import sys
from collections import defaultdict
from pathlib import Path


def main() -> None:
    folder = Path(sys.argv[1]) if len(sys.argv) > 1 else Path(__file__).parent
    rows = [json.loads(line) for line in (folder / "results.jsonl").read_text().splitlines()]
    runs: dict[tuple[str, int], list[dict]] = defaultdict(list)
    for row in rows:
        if row["kind"] == "request" and row["ok"]:
            runs[(row["server"], row["concurrency"])].append(row)
    print("| server | C | decode tok/s | end-to-end tok/s | TTFT p50 s | prediction accepted / rejected "
          "| = llama-server plain | = draftwise-noprediction |")
    print("|---|---|---|---|---|---|---|---|")
    for (server, level), answers in runs.items():
        decode = sum(r["completion_tokens"] - 1 for r in answers) / sum(r["latency_s"] - r["ttft_s"] for r in answers)
        e2e = sum(r["completion_tokens"] for r in answers) / sum(r["latency_s"] for r in answers)
        ttft = statistics.median(r["ttft_s"] for r in answers)
        accepted = sum(r.get("accepted_prediction_tokens") or 0 for r in answers)
        rejected = sum(r.get("rejected_prediction_tokens") or 0 for r in answers)
        same = [_same(answers, runs.get((other, level), [])) for other in ("llama-server", "draftwise-noprediction")]
        print(f"| {server} | {level} | {decode:.1f} | {e2e:.1f} | {ttft:.2f} | {accepted} / {rejected} | "
              f"{same[0]} | {same[1]} |")


def _same(answers: list[dict], reference: list[dict]) -> str:
    texts = {r["prompt_id"]: r["text"] for r in reference}
    pairs = [(r["text"], texts[r["prompt_id"]]) for r in answers if r["prompt_id"] in texts]
    return f"{sum(a == b for a, b in pairs)}/{len(pairs)}" if pairs else "-"


if __name__ == "__main__":
    main()
