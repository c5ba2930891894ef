"""The tool-call tasks with one tool list for all: every tool of benchmarks/data/tool_calls.jsonl,
in the order first met, given to every task (an agent that sends the same tools with each
request). Writes benchmarks/tools_shared_amd/tool_calls_shared.jsonl.

    python benchmarks/tools_shared_amd/make_shared.py
"""

from __future__ import annotations

import json
from pathlib import Path

HERE = Path(__file__).resolve().parent
SOURCE = HERE.parent / "data" / "tool_calls.jsonl"


def main() -> None:
    rows = [json.loads(line) for line in SOURCE.read_text(encoding="utf-8").splitlines()]
    tools: dict[str, dict] = {}
    for row in rows:
        for tool in row["tools"]:
            tools.setdefault(tool["function"]["name"], tool)
    shared = [{**row, "tools": list(tools.values())} for row in rows]
    out = HERE / "tool_calls_shared.jsonl"
    out.write_text("".join(json.dumps(row) + "\n" for row in shared), encoding="utf-8")
    print(f"{out}: {len(shared)} tasks, {len(tools)} tools each")


if __name__ == "__main__":
    main()
