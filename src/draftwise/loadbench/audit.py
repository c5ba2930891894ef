"""Where a loaded answer parts from the answer alone, and how close the target's call was there.

A server's streams batched together run other matrix shapes (and kernels) than one stream
alone, so float rounding may flip the argmax where the target's top two tokens nearly tie
(``draftwise.bench.audit``). For each answer that differs from its answer alone, both texts
are tokenized with the target's tokenizer (neither server returns token ids on its OpenAI
endpoints), and the target, loaded here, scores the prompt plus the alone answer's prefix
up to the first differing token: the gap between its top two logits there says whether the
difference is a near tie or a real disagreement.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from draftwise.bench.audit import NEAR_TIE, first_difference
from draftwise.chat import encode_messages, encode_raw
from draftwise.loadbench.prompts import LoadPrompt
from draftwise.loadbench.stats import Mismatch

if TYPE_CHECKING:
    from draftwise.lm import Tokenizer


def prompt_ids(tokenizer: Tokenizer, prompt: LoadPrompt) -> list[int]:
    """The prompt's ids as draftwise serve makes them (a chat turn through the template)."""
    if prompt.chat:
        return encode_messages(tokenizer, [{"role": "user", "content": prompt.text}])
    return encode_raw(tokenizer, prompt.text, parse_special=False)


def top2_gap(lm: Any, ids: Sequence[int]) -> float:
    """The target's top-1 minus top-2 logit for the token after ``ids``."""
    import torch

    lm.reset()
    try:
        with torch.inference_mode():
            top = lm.forward(list(ids), last=1)[0].topk(2).values
        return float(top[0] - top[1])
    finally:
        lm.reset()


def audit_mismatch(lm: Any, prompt: LoadPrompt, mismatch: Mismatch) -> dict[str, Any]:
    """The first differing token of one mismatch, the two tokens, and the gap before it."""
    tokenizer = lm.tokenizer
    alone = tokenizer.encode(mismatch.alone, add_special_tokens=False)
    loaded = tokenizer.encode(mismatch.loaded, add_special_tokens=False)
    position = first_difference(alone, loaded)
    found: dict[str, Any] = {
        "server": mismatch.server,
        "concurrency": mismatch.concurrency,
        "prompt_id": mismatch.prompt_id,
        "position": position,
        "alone_token": None,
        "loaded_token": None,
        "top2_gap": None,
        "near_tie": False,
    }
    if position is None:  # the texts differ where their tokens do not (a stray byte)
        return found
    found["alone_token"] = tokenizer.decode(alone[position : position + 1]) if position < len(alone) else None
    found["loaded_token"] = tokenizer.decode(loaded[position : position + 1]) if position < len(loaded) else None
    gap = top2_gap(lm, prompt_ids(tokenizer, prompt) + alone[:position])
    found.update(top2_gap=gap, near_tie=gap < NEAR_TIE)
    return found


def audit(lm: Any, prompts: Sequence[LoadPrompt], found: Sequence[Mismatch]) -> list[dict[str, Any]]:
    by_id = {p.id: p for p in prompts}
    return [audit_mismatch(lm, by_id[m.prompt_id], m) for m in found if m.prompt_id in by_id]
