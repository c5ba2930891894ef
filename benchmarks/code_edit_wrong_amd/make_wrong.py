"""Code-edit tasks with a wrong prediction: each task of benchmarks/data/code_edit.jsonl gets
the file of the task five places on (another standard-library file) as its prediction.

    python benchmarks/code_edit_wrong_amd/make_wrong.py > benchmarks/code_edit_wrong_amd/wrong_prediction.jsonl
"""

import json
import sys
from pathlib import Path

TASKS = Path(__file__).resolve().parents[1] / "data" / "code_edit.jsonl"

rows = [json.loads(line) for line in TASKS.read_text().splitlines() if line.strip()]
for i, row in enumerate(rows):
    wrong = {**row, "id": f"{row['id']}-wrong", "prediction": rows[(i + 5) % len(rows)]["file"]}
    sys.stdout.write(json.dumps(wrong) + "\n")
