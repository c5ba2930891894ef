"""C streams through draftwise's engine in one process, on `draftwise load`'s prompts: what
drafting does to aggregate tokens/s when the streams share batched passes, without HTTP.

    python benchmarks/load_engine_amd/engine_load.py C DRAFTER POLICY K

DRAFTER: off, ngram, model or hybrid (draft qwen2.5-coder-0.5b); POLICY: fixed or cost (the
cost policy starts from `draftwise.costs.calibrate`'s curve, as `draftwise serve` does). The
target is qwen2.5-coder-1.5b with C slots of 4096 positions, 2 threads; the 14 prompts are
`draftwise load --limit 2`'s (2 code completions, the first turn of 2 prompts of each
Spec-Bench subtask), 128 new tokens, greedy. C threads take the prompts in turn, each
running the next one as soon as its last has ended. Prints one JSON line: the settings,
wall seconds, tokens, tokens/s, and the generations' summed metrics. Each client keeps one
cost profile over its requests, as each slot of `draftwise serve` does.
"""

from __future__ import annotations

import copy
import json
import queue
import sys
import threading
import time

from draftwise import costs
from draftwise.config import DraftConfig, GenerationConfig, ModelOptions
from draftwise.drafters import build_drafter
from draftwise.engine import SpeculativeEngine
from draftwise.loadbench.audit import prompt_ids
from draftwise.loadbench.config import LoadConfig
from draftwise.loadbench.prompts import load_prompts
from draftwise.loading import load_pair
from draftwise.policies import CostProfile
from draftwise.target import LocalTarget

SUMMED = ("new_tokens", "target_passes", "proposed", "accepted", "prefill_seconds", "draft_seconds", "verify_seconds")


def main() -> None:
    slots, kind, policy, k = int(sys.argv[1]), sys.argv[2], sys.argv[3], int(sys.argv[4])
    draft_name = "qwen2.5-coder-0.5b" if kind in ("model", "hybrid") else None
    target, draft = load_pair("qwen2.5-coder-1.5b", draft_name, ModelOptions(context=4096, threads=2), slots=slots)
    profile = costs.calibrate(target, draft, 12, slots=slots) if policy == "cost" else CostProfile()
    targets = [target, *(target.fork() for _ in range(slots - 1))]
    drafts = [draft, *(draft.fork() for _ in range(slots - 1))] if draft is not None else [None] * slots
    prompts = [prompt_ids(target.tokenizer, p) for p in load_prompts(LoadConfig(limit=2, servers=("draftwise",)))]
    todo: queue.Queue[int] = queue.Queue()
    for i in range(len(prompts)):
        todo.put(i)
    config = GenerationConfig(max_new_tokens=128, draft=DraftConfig(k_policy=policy, k=max(k, 1)))
    metrics: list[dict] = []

    def client(i: int) -> None:
        learnt = copy.deepcopy(profile)  # each client's own, kept over its requests, as a server's slot keeps one
        while True:
            try:
                j = todo.get_nowait()
            except queue.Empty:
                return
            drafter = None if kind == "off" else build_drafter(kind, drafts[i])
            engine = SpeculativeEngine(LocalTarget(targets[i]), drafter, target.tokenizer, learnt)
            metrics.append(engine.generate(prompts[j], config).metrics.to_dict())
            done = {key: round(metrics[-1][key], 2) for key in SUMMED}
            at = round(time.perf_counter() - started, 2)
            line = {"slots": slots, "drafter": kind, "client": i, "prompt": j, "at_s": at, **done}
            print(json.dumps(line), file=sys.stderr)
            targets[i].rest()

    started = time.perf_counter()
    threads = [threading.Thread(target=client, args=(i,)) for i in range(slots)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    wall = time.perf_counter() - started
    tokens = sum(m["new_tokens"] for m in metrics)
    summed = {key: round(sum(m[key] for m in metrics), 2) for key in SUMMED}
    print(json.dumps({"slots": slots, "drafter": kind, "policy": policy, "k": k, "wall_s": round(wall, 2),
                      "tokens": tokens, "tokens_per_s": round(tokens / wall, 2), **summed}))  # fmt: skip


if __name__ == "__main__":
    main()
