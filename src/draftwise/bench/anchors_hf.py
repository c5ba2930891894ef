"""Anchors on the ``hf`` backend: transformers' own ``generate`` with the same loaded models,
plain (``hf-baseline``), assisted by the draft model (``hf-assisted``) or with prompt lookup
(``hf-pld``), timed like draftwise's methods (see ``draftwise.bench.methods``).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

import torch

from draftwise.backends.hf import HFModel
from draftwise.bench.anchor_settings import HF_SCHEDULE, pld_tokens
from draftwise.bench.trace import Trace
from draftwise.config import GenerationConfig


class _ArrivalStreamer:
    """A transformers streamer that timestamps each delivery of generated tokens."""

    def __init__(self, started: float) -> None:
        self.started = started
        self.arrivals: list[float] = []
        self.step_tokens: list[int] = []
        self._prompt_seen = False

    def put(self, value: torch.Tensor) -> None:  # [1, n] or [n] token ids
        if not self._prompt_seen:  # generate() first hands over the prompt itself
            self._prompt_seen = True
            return
        self.arrivals.append(time.perf_counter() - self.started)
        self.step_tokens.append(int(value.numel()))

    def end(self) -> None:
        pass


class HFMethod:
    """transformers' own ``generate``: plain, assisted by the draft model, or prompt lookup."""

    def __init__(self, name: str, target: HFModel, draft: HFModel | None = None) -> None:
        from transformers.utils import logging as hf_logging

        # transformers warns on every assisted call about how generation options were passed;
        # the bench passes them deliberately, so only errors are worth showing.
        hf_logging.set_verbosity_error()
        self.name = name
        self.target = target
        self.draft = draft
        self.eos_ids = list(target.eos_token_ids)
        pad = getattr(target.tokenizer, "pad_token_id", None)
        self.pad_id = pad if pad is not None else (self.eos_ids[0] if self.eos_ids else 0)

    def _generation_config(self, config: GenerationConfig) -> Any:
        from transformers import GenerationConfig as HFGenerationConfig

        s = config.sampling
        options: dict[str, Any] = {
            "max_new_tokens": config.max_new_tokens,
            "eos_token_id": list(config.eos_token_ids) if config.eos_token_ids is not None else self.eos_ids,
            "pad_token_id": self.pad_id,
            "do_sample": not s.greedy,
        }
        if not s.greedy:
            options.update(temperature=s.temperature, top_k=s.top_k, top_p=s.top_p)
        if self.name == "hf-pld":
            options.update(prompt_lookup_num_tokens=pld_tokens(config), max_matching_ngram_size=config.draft.ngram_max)
        return HFGenerationConfig(**options)

    def _assistant(self) -> HFModel:
        if self.draft is None:
            raise ValueError("hf-assisted needs a draft model")
        return self.draft

    def _configure_assistant(self, config: GenerationConfig) -> None:
        # transformers keeps the draft length and threshold on the assistant's own
        # generation_config and may change them during a call: set them afresh every run.
        assistant = self._assistant().model.generation_config
        assistant.num_assistant_tokens = max(1, config.draft.k)
        assistant.num_assistant_tokens_schedule = HF_SCHEDULE[config.draft.k_policy]
        assistant.assistant_confidence_threshold = config.draft.confidence_threshold

    @torch.inference_mode()
    def run(self, prompt_ids: Sequence[int], config: GenerationConfig) -> Trace:
        extra: dict[str, Any] = {}
        if self.name == "hf-assisted":
            self._configure_assistant(config)
            extra["assistant_model"] = self._assistant().model
        if not config.sampling.greedy and config.sampling.seed is not None:
            torch.manual_seed(config.sampling.seed)  # transformers samples from torch's global generator
        input_ids = torch.tensor([list(prompt_ids)], dtype=torch.long)  # [1, T]
        generation_config = self._generation_config(config)
        started = time.perf_counter()
        streamer = _ArrivalStreamer(started)
        out = self.target.model.generate(
            input_ids,
            attention_mask=torch.ones_like(input_ids),
            generation_config=generation_config,
            streamer=streamer,
            **extra,
        )
        wall = time.perf_counter() - started
        tokens = out[0, input_ids.shape[1] :].tolist()
        eos = set(generation_config.eos_token_id or [])
        reason = "eos" if tokens and tokens[-1] in eos else "length"
        return Trace(
            tokens=tokens,
            arrivals=streamer.arrivals,
            step_tokens=streamer.step_tokens,
            wall_seconds=wall,
            finish_reason=reason,
        )
