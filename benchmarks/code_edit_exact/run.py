"""--exact on the code-edit tasks: each task's answer with its prediction against plain decoding.

For each of the first N tasks of benchmarks/data/code_edit.jsonl, one run of

    draftwise generate --target qwen2.5-coder-1.5b --drafter ngram --exact --chat --file PROMPT \
        --prediction PREDICTION --compare --json --max-new-tokens 1024 --temperature 0

(speculative decoding with the prediction, then plain decoding of the same prompt in the same
process), and one line per task in results.jsonl: identical or not, both rates, and the
prediction's accepted and rejected tokens.

Usage: python benchmarks/code_edit_exact/run.py [N]   (from the repository root, after make setup)
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).parent
TASKS = HERE.parent / "data" / "code_edit.jsonl"


def run(task: dict, folder: Path) -> dict:
    prompt, prediction = folder / "prompt.txt", folder / "prediction.txt"
    prompt.write_text(task["turns"][0])
    prediction.write_text(task["prediction"])
    beside = Path(sys.executable).with_name("draftwise")  # the virtual environment's command, if run from it
    command = [
        str(beside) if beside.exists() else "draftwise", "generate", "--target", "qwen2.5-coder-1.5b", "--drafter", "ngram", "--exact", "--chat",
        "--file", str(prompt), "--prediction", str(prediction), "--compare", "--json",
        "--max-new-tokens", "1024", "--temperature", "0",
    ]  # fmt: skip
    out = json.loads(subprocess.run(command, check=True, capture_output=True, text=True).stdout)
    metrics, plain = out["metrics"], out["compare"]["metrics"]
    kept = metrics["kept_by_source"].get("prediction", 0)
    return {
        "id": task["id"],
        "identical": out["compare"]["identical"],
        "tokens": metrics["new_tokens"],
        "tok_s": round(metrics["tokens_per_second"], 2),
        "plain_tok_s": round(plain["tokens_per_second"], 2),
        "accepted_prediction_tokens": kept,
        "rejected_prediction_tokens": metrics["proposed_by_source"].get("prediction", 0) - kept,
    }


def main() -> None:
    limit = int(sys.argv[1]) if len(sys.argv) > 1 else 5
    tasks = [json.loads(line) for line in TASKS.read_text().splitlines()][:limit]
    with tempfile.TemporaryDirectory() as scratch, (HERE / "results.jsonl").open("w") as results:
        for task in tasks:
            row = run(task, Path(scratch))
            results.write(json.dumps(row) + "\n")
            results.flush()
            print(row, flush=True)
    rows = [json.loads(line) for line in (HERE / "results.jsonl").read_text().splitlines()]
    print(f"identical to plain decoding: {sum(r['identical'] for r in rows)}/{len(rows)}")


if __name__ == "__main__":
    main()
