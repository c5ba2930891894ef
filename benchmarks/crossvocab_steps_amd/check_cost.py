"""What the settled check costs a draft token, beside a draft pass (see README.md).

python benchmarks/crossvocab_steps_amd/check_cost.py
"""

from __future__ import annotations

import time

from draftwise.config import GenerationConfig
from draftwise.drafters import CrossVocabDrafter
from draftwise.loading import load_pair
from draftwise.retokenize import settled


def main() -> None:
    target, draft = load_pair("qwen2.5-coder-1.5b", "smollm2-135m")
    assert target.tokenizer is not None and draft is not None and draft.tokenizer is not None
    drafter = CrossVocabDrafter(draft, target.tokenizer)
    context = target.tokenizer.encode(
        "Translate into French: the weather is fine today, and we will walk along the river before dinner."
    )
    drafter.start(context, GenerationConfig(), None)
    drafter.offers(context)  # reads the context as text
    drafted = draft.tokenizer.encode(" Le temps est beau aujourd'hui", add_special_tokens=False)[:3]
    repeats = 300
    started = time.perf_counter()
    for _ in range(repeats):
        ids = drafter._target_ids(context, drafted)
        settled(target.tokenizer, ids, 1)
    check = (time.perf_counter() - started) / repeats
    started = time.perf_counter()
    for _ in range(20):
        draft.forward(drafted[:1], last=1)
        draft.rollback(len(draft.tokens) - 1)
    step = (time.perf_counter() - started) / 20
    print(f"target ids {[target.tokenizer.decode([i]) for i in ids]}")
    print(f"settled check: {1000 * check:.3f} ms; one draft pass: {1000 * step:.3f} ms")


if __name__ == "__main__":
    main()
