"""One wrapper over Hugging Face causal LMs, used by the target, the draft model and the
baseline alike: feed tokens, get scores, roll the cache back.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from draftwise.cache import KVCache


class CausalLM:
    """A causal LM plus its KV cache, for a single sequence (batch size 1).

    ``tokens`` mirrors what the cache holds, so callers can tell what still has to be fed.
    """

    def __init__(self, model: Any, tokenizer: Any = None, name: str | None = None) -> None:
        self.model = model.eval()
        self.tokenizer = tokenizer
        self.name = name or getattr(model.config, "_name_or_path", None) or model.config.model_type
        self.cache = KVCache(model.config)
        self.tokens: list[int] = []

    @property
    def config(self) -> Any:
        return self.model.config

    @property
    def vocab_size(self) -> int:
        return int(self.model.get_output_embeddings().weight.shape[0])

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        """EOS ids from the generation config, the model config and the tokenizer, merged."""
        ids: set[int] = set()
        sources = [getattr(self.model, "generation_config", None), self.config, self.tokenizer]
        for source in sources:
            value = getattr(source, "eos_token_id", None) if source is not None else None
            if isinstance(value, int):
                ids.add(value)
            elif isinstance(value, (list, tuple)):
                ids.update(int(v) for v in value)
        return tuple(sorted(ids))

    def reset(self) -> None:
        self.cache.reset()
        self.tokens = []

    def prefill(self, prompt: Sequence[int]) -> None:
        """Start a new sequence: cache everything but the prompt's last token, which is fed
        with the first block (its scores are what the first step needs)."""
        self.reset()
        if len(prompt) > 1:
            self.forward(prompt[:-1], last=1)

    @torch.inference_mode()
    def forward(self, tokens: Sequence[int], last: int | None = None) -> torch.Tensor:
        """Append ``tokens`` to the cache and return float32 scores ``[n, V]``.

        ``last`` limits the scores to the final ``last`` positions: the output layer over a
        large vocabulary is costly, and a prefill only needs the final row.
        """
        if not tokens:
            raise ValueError("forward needs at least one token")
        input_ids = torch.tensor([list(tokens)], dtype=torch.long)
        out = self.model(
            input_ids=input_ids,
            cache=self.cache.hf,
            use_cache=True,
            logits_to_keep=last or 0,
        )
        self.tokens.extend(tokens)
        return out.logits[0].float()

    def rollback(self, length: int) -> None:
        """Forget every position from ``length`` on."""
        self.cache.rollback(length)
        del self.tokens[length:]

    def sync(self, context: Sequence[int]) -> list[int]:
        """Roll back to the longest cached prefix of ``context`` that leaves its last token
        out, and return the tokens still to feed (never empty: the scores after the last
        token are what every caller wants next).
        """
        keep = min(len(self.tokens), len(context) - 1)
        if self.tokens[:keep] != list(context[:keep]):
            keep = next(i for i, (a, b) in enumerate(zip(self.tokens, context)) if a != b)
        if keep < len(self.tokens):
            self.rollback(keep)
        return list(context[keep:])
