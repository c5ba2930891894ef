"""Draft work per accepted token of a draft that speaks another vocabulary, at fixed k.

Greedy output is deterministic, so the counts (draft model passes, proposed and accepted
tokens, target passes) are too: they compare two ways of drafting without the host's timing
noise. Times are reported beside them, from the same run.

    python benchmarks/crossvocab_steps_amd/count.py --draft smollm2-135m --ks 1,2,3 --limit 2 > out.jsonl
"""

from __future__ import annotations

import argparse
import json
import sys
import time

from draftwise.bench.dataset import load_prompts
from draftwise.chat import encode_prompt
from draftwise.config import DraftConfig, GenerationConfig
from draftwise.drafters import model_drafter, text_bridge
from draftwise.engine import SpeculativeEngine
from draftwise.loading import load_pair
from draftwise.target import LocalTarget


class Counted:
    """Counts the forward calls of a language model (everything else passes through)."""

    def __init__(self, lm):
        self._lm, self.calls, self.seconds = lm, 0, 0.0

    def forward(self, tokens, last=None):
        started = time.perf_counter()
        try:
            return self._lm.forward(tokens, last=last)
        finally:
            self.calls += 1
            self.seconds += time.perf_counter() - started

    def __getattr__(self, name):
        return getattr(self._lm, name)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--target", default="qwen2.5-coder-1.5b")
    parser.add_argument("--draft", default="smollm2-135m")
    parser.add_argument("--ks", default="1,2,3")
    parser.add_argument("--limit", type=int, default=2)
    parser.add_argument("--subtasks", default="mt_bench,translation,qa,math_reasoning")
    parser.add_argument("--max-new-tokens", type=int, default=128)
    args = parser.parse_args()
    target, draft = load_pair(args.target, args.draft, log=lambda m: print(m, file=sys.stderr))
    assert target.tokenizer is not None and draft is not None
    counted = Counted(draft)
    drafter = model_drafter(counted, text_bridge(target.tokenizer, draft))  # type: ignore[arg-type]
    engine = SpeculativeEngine(LocalTarget(target), drafter, tokenizer=target.tokenizer)
    for prompt in load_prompts("spec_bench", args.subtasks.split(","), args.limit):
        ids = encode_prompt(target.tokenizer, prompt.turns[0], chat=True)
        for k in [int(k) for k in args.ks.split(",")]:
            config = GenerationConfig(
                max_new_tokens=args.max_new_tokens, ignore_eos=True, draft=DraftConfig(k_policy="fixed", k=k)
            )
            target.reset()
            counted.calls, counted.seconds = 0, 0.0
            started = time.perf_counter()
            steps = list(engine.stream(ids, config))
            wall = time.perf_counter() - started
            row = {
                "prompt": prompt.id,
                "subtask": prompt.subtask,
                "k": k,
                "draft_calls": counted.calls,
                "draft_seconds": round(counted.seconds, 4),
                "target_passes": len(steps),
                "proposed": sum(len(e.proposed) for e in steps),
                "accepted": sum(e.n_accepted for e in steps),
                "new_tokens": sum(len(e.tokens) for e in steps),
                "verify_seconds": round(sum(e.verify_seconds for e in steps), 4),
                "wall_seconds": round(wall, 4),
                "tokens": [t for e in steps for t in e.tokens],
            }
            print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
