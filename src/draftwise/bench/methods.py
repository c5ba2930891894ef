"""The decoding methods the bench compares, each timed the same way.

draftwise methods consume ``SpeculativeEngine.stream`` (the one streaming core) and build
``GenerationMetrics`` from its events; transformers methods call the model's own
``generate`` with a streamer that timestamps each delivery of tokens. Either way a run
yields a ``Trace``: the tokens, when each batch of them arrived, and per-step detail where
the method exposes it.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from draftwise.bench.config import BenchConfig
from draftwise.config import NEEDS_DRAFT_MODEL, DrafterKind, GenerationConfig
from draftwise.drafters import build_drafter
from draftwise.engine import SpeculativeEngine, autoregressive
from draftwise.metrics import GenerationMetrics
from draftwise.model import CausalLM

# transformers has no cost-based draft length; its adaptive schedule is the closest match.
# "heuristic_transient" restarts from k on every call, as draftwise's policies do.
HF_SCHEDULE = {"fixed": "constant", "heuristic": "heuristic_transient", "cost": "heuristic_transient"}


@dataclass
class Trace:
    """What one method did on one prompt."""

    tokens: list[int]
    arrivals: list[float]  # seconds from the call's start to each delivery of tokens
    step_tokens: list[int]  # tokens in each delivery (one delivery per target pass)
    wall_seconds: float
    finish_reason: str | None
    steps: dict[str, list[float]] | None = None  # draftwise only: per target pass, see DraftwiseMethod
    metrics: dict[str, Any] | None = None  # draftwise only: GenerationMetrics.to_dict()
    rollback_seconds: float | None = None  # draftwise only: time spent in KV-cache rollbacks


class Method(Protocol):
    name: str

    def run(self, prompt_ids: Sequence[int], config: GenerationConfig) -> Trace:
        """Generate after ``prompt_ids`` and report what happened and when."""


class RollbackTimer:
    """Accumulates the time one model spends in ``KVCache.rollback``.

    The engine folds rollback into the draft and verify times; the bench splits it out so
    its report can say what cache rollback costs. It wraps the bound method of this one
    cache instance only (no class is patched) until ``close``.
    """

    def __init__(self, lm: CausalLM) -> None:
        self.seconds = 0.0
        self._cache = lm.cache
        inner = lm.cache.rollback

        def timed_rollback(length: int) -> None:
            started = time.perf_counter()
            inner(length)
            self.seconds += time.perf_counter() - started

        lm.cache.rollback = timed_rollback  # type: ignore[method-assign]

    def close(self) -> None:
        """Restore the cache's own rollback."""
        del self._cache.rollback


class DraftwiseMethod:
    """A ``SpeculativeEngine`` (with or without a drafter), consumed through ``stream``."""

    def __init__(self, name: str, engine: SpeculativeEngine, timers: Sequence[RollbackTimer]) -> None:
        self.name = name
        self.engine = engine
        self.timers = list(timers)

    def run(self, prompt_ids: Sequence[int], config: GenerationConfig) -> Trace:
        for timer in self.timers:
            timer.seconds = 0.0
        metrics = GenerationMetrics()
        steps: dict[str, list[float]] = {name: [] for name in ("k", "proposed", "accepted", "draft_s", "verify_s",
                                                                "step_s")}
        tokens: list[int] = []
        arrivals: list[float] = []
        step_tokens: list[int] = []
        started = time.perf_counter()
        for event in self.engine.stream(list(prompt_ids), config):
            arrivals.append(time.perf_counter() - started)
            step_tokens.append(len(event.tokens))
            tokens.extend(event.tokens)
            metrics.add(event)
            for name, value in (("k", event.k), ("proposed", len(event.proposed)), ("accepted", event.n_accepted),
                                ("draft_s", event.draft_seconds), ("verify_s", event.verify_seconds),
                                ("step_s", event.step_seconds)):
                steps[name].append(value)
        wall = time.perf_counter() - started
        return Trace(
            tokens=tokens,
            arrivals=arrivals,
            step_tokens=step_tokens,
            wall_seconds=wall,
            finish_reason=metrics.finish_reason,
            steps=steps,
            metrics=metrics.to_dict(),
            rollback_seconds=sum(t.seconds for t in self.timers),
        )


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

    def __init__(self, name: str, target: CausalLM, draft: CausalLM | None = None) -> None:
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
            options.update(prompt_lookup_num_tokens=max(1, config.draft.k),
                           max_matching_ngram_size=config.draft.ngram_max)
        return HFGenerationConfig(**options)

    def _configure_assistant(self, config: GenerationConfig) -> None:
        # transformers keeps the draft length and threshold on the assistant's own
        # generation_config and may change them during a call: set them afresh every run.
        assistant = self.draft.model.generation_config
        assistant.num_assistant_tokens = max(1, config.draft.k)
        assistant.num_assistant_tokens_schedule = HF_SCHEDULE[config.draft.k_policy]
        assistant.assistant_confidence_threshold = config.draft.confidence_threshold

    @torch.inference_mode()
    def run(self, prompt_ids: Sequence[int], config: GenerationConfig) -> Trace:
        extra: dict[str, Any] = {}
        if self.name == "hf-assisted":
            self._configure_assistant(config)
            extra["assistant_model"] = self.draft.model
        if not config.sampling.greedy and config.sampling.seed is not None:
            torch.manual_seed(config.sampling.seed)  # transformers samples from torch's global generator
        input_ids = torch.tensor([list(prompt_ids)], dtype=torch.long)  # [1, T]
        generation_config = self._generation_config(config)
        started = time.perf_counter()
        streamer = _ArrivalStreamer(started)
        out = self.target.model.generate(
            input_ids, attention_mask=torch.ones_like(input_ids), generation_config=generation_config,
            streamer=streamer, **extra,
        )
        wall = time.perf_counter() - started
        tokens = out[0, input_ids.shape[1]:].tolist()
        eos = set(generation_config.eos_token_id or [])
        reason = "eos" if tokens and tokens[-1] in eos else "length"
        return Trace(tokens=tokens, arrivals=streamer.arrivals, step_tokens=streamer.step_tokens,
                     wall_seconds=wall, finish_reason=reason)


# The bench's draftwise methods and the drafter each runs ("draft" predates the drafter names).
DRAFTER_KINDS: dict[str, DrafterKind] = {"draft": "model", "ngram": "ngram", "hybrid": "hybrid"}


def build_methods(config: BenchConfig, target: CausalLM, draft: CausalLM | None
                  ) -> tuple[dict[str, Method], list[RollbackTimer]]:
    """One ``Method`` per configured name, sharing the loaded models; close the timers when done."""
    timers = {id(lm): RollbackTimer(lm) for lm in (target, draft) if lm is not None}
    target_timer = [timers[id(target)]]
    methods: dict[str, Method] = {}
    for name in config.methods:
        if name == "baseline":
            methods[name] = DraftwiseMethod(name, autoregressive(target), target_timer)
        elif name in DRAFTER_KINDS:
            kind = DRAFTER_KINDS[name]
            timed = [*target_timer, timers[id(draft)]] if kind in NEEDS_DRAFT_MODEL else target_timer
            methods[name] = DraftwiseMethod(name, SpeculativeEngine.from_models(target, build_drafter(kind, draft)),
                                            timed)
        else:
            methods[name] = HFMethod(name, target, draft if name == "hf-assisted" else None)
    return methods, list(timers.values())
