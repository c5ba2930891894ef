"""How often the 0.5B draft model is right on the structured answers, and what its drafting
costs: the target with `ModelDrafter(qwen2.5-coder-0.5b)` under each task's grammar, the
policy fixed at k tokens (so every step the grammar forces nothing drafts k from the model),
greedy. Sums each source's proposed and accepted tokens, steps and drafting seconds (the draft
model's catch-up on the prompt included), and how often the first drafted token was kept.

    python benchmarks/ceiling_amd/draft_model.py benchmarks/data/tool_calls.jsonl 4
"""

from __future__ import annotations

import collections
import json
import sys

from ceiling import read_tasks, request_of

from draftwise.config import ModelOptions
from draftwise.drafters import ModelDrafter
from draftwise.engine import SpeculativeEngine
from draftwise.loading import load_lm


def main() -> None:
    path, k = sys.argv[1], int(sys.argv[2])
    rows = read_tasks(path, 24)
    lm = load_lm("qwen2.5-coder-1.5b", ModelOptions(threads=2, context=4096))
    draft = load_lm("qwen2.5-coder-0.5b", ModelOptions(threads=2, context=4096), draft=True)
    engine = SpeculativeEngine.from_models(lm, ModelDrafter(draft))
    sums: collections.defaultdict[str, float] = collections.defaultdict(float)
    for row in rows:
        prompt, config = request_of(row, lm)
        fixed = config.draft.model_copy(update={"k_policy": "fixed", "k": k})
        for event in engine.stream(prompt, config.model_copy(update={"draft": fixed})):
            source = event.source or "plain"
            sums[f"{source} proposed"] += len(event.proposed)
            sums[f"{source} accepted"] += event.n_accepted
            sums[f"{source} steps"] += 1
            sums[f"{source} draft seconds"] += event.draft_seconds
            if source == "model" and len(event.proposed):
                sums["model first token kept" if event.n_accepted else "model first token rejected"] += 1
    print(json.dumps({"tasks": path, "k": k} | {key: round(value, 3) for key, value in sums.items()}))


if __name__ == "__main__":
    main()
