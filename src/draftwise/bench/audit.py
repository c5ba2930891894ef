"""Losslessness audit: is each method's greedy output the target's own greedy output?

Speculation is exact in exact arithmetic, but a target pass over a block of k + 1 tokens
uses different matmul shapes (and, on llama.cpp, different kernels) than a pass over one
token, so float rounding can flip an argmax where the target's top two tokens are nearly
tied. A mismatch at such a near-tie is expected; a mismatch where the target clearly prefers
one token is a bug. The audit therefore reports, for each mismatch, the gap between the
target's top two logits at the first differing position, computed by a fresh target pass
over the baseline's own prefix.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from draftwise.lm import LanguageModel

# A top-2 logit gap below this is a near-tie: rounding differences between kernels move
# logits by about 0.01-0.1 (the median gap is 5-10), so two candidates this close can swap
# places with the matmul shape alone.
NEAR_TIE = 0.25


@torch.inference_mode()
def score_output(
    lm: LanguageModel, prompt_ids: Sequence[int], tokens: Sequence[int]
) -> tuple[float | None, list[float]]:
    """Perplexity of ``tokens`` under ``lm`` after ``prompt_ids``, and the gap between the
    target's top two logits at each output position (before that position's token)."""
    if not tokens:
        return None, []
    lm.reset()
    try:
        logits = lm.forward(list(prompt_ids) + list(tokens), last=len(tokens) + 1)[:-1]  # [n, V]
    finally:
        lm.reset()
    logprobs = torch.log_softmax(logits, dim=-1)
    chosen = torch.tensor(list(tokens), dtype=torch.long)[:, None]  # [n, 1]
    nll = -logprobs.gather(1, chosen).squeeze(1)  # [n]
    top2 = logits.topk(2, dim=-1).values  # [n, 2]
    return float(torch.exp(nll.mean())), (top2[:, 0] - top2[:, 1]).tolist()


def first_difference(a: Sequence[int], b: Sequence[int]) -> int | None:
    """First position where ``a`` and ``b`` differ (a length difference counts); None if equal."""
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def audit_prompt(reference: Sequence[dict[str, Any]], candidate: Sequence[dict[str, Any]]) -> dict[str, Any] | None:
    """Compare one prompt's turns (records ordered by turn); None when every turn is identical.

    Later turns are only compared while the earlier ones matched: after a mismatch the
    model's own earlier answer differs, so the later prompts differ too.
    """
    for ref, cand in zip(reference, candidate):
        position = first_difference(ref["tokens"], cand["tokens"])
        if position is None:
            continue
        gaps = ref.get("top2_logit_gaps") or []
        gap = gaps[position] if position < len(gaps) else None
        return {
            "prompt_id": ref["prompt_id"],
            "subtask": ref["subtask"],
            "turn": ref["turn"],
            "position": position,
            "reference_token": ref["tokens"][position] if position < len(ref["tokens"]) else None,
            "method_token": cand["tokens"][position] if position < len(cand["tokens"]) else None,
            "top2_gap": gap,
            "near_tie": gap is not None and gap < NEAR_TIE,
        }
    return None
