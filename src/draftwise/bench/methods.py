"""The decoding methods the bench compares, each timed the same way.

draftwise methods consume ``SpeculativeEngine.stream`` (the one streaming core) and build
``GenerationMetrics`` from its events; anchors (other projects' own loops on the same model
files: transformers' ``generate``, llama-cpp-python's and llama.cpp's) are in
``draftwise.bench.anchors_hf`` and ``draftwise.bench.anchors_llamacpp``. Either way a run
yields a ``Trace`` (``draftwise.bench.trace``): the tokens, when each batch of them arrived,
and per-step detail where the method exposes it.
"""

from __future__ import annotations

import copy
import time
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, cast

from draftwise.bench.config import ANCHORS, HF_ANCHORS, REFERENCE, BenchConfig, BenchError, sweep_run
from draftwise.bench.trace import Method, Trace
from draftwise.config import DRAFTER_KINDS, NEEDS_DRAFT_MODEL, DrafterKind, GenerationConfig
from draftwise.drafters import build_drafter, text_bridge
from draftwise.engine import SpeculativeEngine, autoregressive
from draftwise.lm import LanguageModel
from draftwise.metrics import GenerationMetrics
from draftwise.prepare import Pair
from draftwise.profile import CostProfile

if TYPE_CHECKING:
    from draftwise.backends.hf import HFModel
    from draftwise.backends.llamacpp import LlamaCppModel


class RollbackTimer:
    """Accumulates the time one model spends in ``rollback``.

    The engine folds rollback into the draft and verify times; the bench splits it out so
    its report can say what cache rollback costs. It wraps the bound method of this one
    model instance only (no class is patched) until ``close``.
    """

    def __init__(self, lm: LanguageModel) -> None:
        self.seconds = 0.0
        self._lm = lm
        inner = lm.rollback

        def timed_rollback(length: int) -> None:
            started = time.perf_counter()
            inner(length)
            self.seconds += time.perf_counter() - started

        lm.rollback = timed_rollback  # type: ignore[method-assign]

    def close(self) -> None:
        """Restore the model's own rollback."""
        del self._lm.rollback


class DraftwiseMethod:
    """A ``SpeculativeEngine`` (with or without a drafter) over ``target``, consumed through
    ``stream``. With ``fixed_k`` (a sweep run, ``model/k4``) every request drafts under the
    fixed policy at that length, its other drafting settings the request's own."""

    def __init__(
        self,
        name: str,
        engine: SpeculativeEngine,
        target: LanguageModel,
        timers: Sequence[RollbackTimer],
        fixed_k: int | None = None,
    ) -> None:
        self.name = name
        self.engine = engine
        self.target = target
        self.timers = list(timers)
        self.fixed_k = fixed_k

    def generation(self, config: GenerationConfig) -> GenerationConfig:
        """The settings this method runs a request with: ``config``, at ``fixed_k`` if set."""
        if self.fixed_k is None:
            return config
        # The fixed policy is valid at any k <= 64 (k_max bounds the adaptive ones only).
        draft = config.draft.model_copy(update={"k_policy": "fixed", "k": self.fixed_k})
        return config.model_copy(update={"draft": draft})

    def run(self, prompt_ids: Sequence[int], config: GenerationConfig) -> Trace:
        config = self.generation(config)
        # Every run prefills its whole prompt, as a request alone does: the methods share the
        # target, whose cache would otherwise hand the next method the prompt for free.
        self.target.reset()
        for timer in self.timers:
            timer.seconds = 0.0
        metrics = GenerationMetrics()
        steps: dict[str, list[float]] = {
            name: [] for name in ("k", "proposed", "accepted", "draft_s", "verify_s", "step_s")
        }
        tokens: list[int] = []
        arrivals: list[float] = []
        step_tokens: list[int] = []
        started = time.perf_counter()
        for event in self.engine.stream(list(prompt_ids), config):
            arrivals.append(time.perf_counter() - started)
            step_tokens.append(len(event.tokens))
            tokens.extend(event.tokens)
            metrics.add(event)
            for name, value in (
                ("k", event.k),
                ("proposed", len(event.proposed)),
                ("accepted", event.n_accepted),
                ("draft_s", event.draft_seconds),
                ("verify_s", event.verify_seconds),
                ("step_s", event.step_seconds),
            ):
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


def _anchor(name: str, config: BenchConfig, target: LanguageModel, draft: LanguageModel | None) -> Method:
    """Another project's loop on the same model files; only where the target's backend runs it."""
    if name in HF_ANCHORS:
        if target.backend != "hf":
            raise BenchError(
                f"method {name} runs transformers' generate: it needs --backend hf "
                f"(the target runs on {target.backend})"
            )
        from draftwise.bench.anchors_hf import HFMethod

        # backend "hf": the models are HFModels
        hf_draft = cast("HFModel | None", draft) if name == "hf-assisted" else None
        return HFMethod(name, cast("HFModel", target), hf_draft)
    if target.backend != "llamacpp":
        raise BenchError(
            f"method {name} runs llama.cpp on the GGUF files: it needs the llamacpp backend "
            f"(the target runs on {target.backend})"
        )
    from draftwise.bench.anchors_llamacpp import build_llamacpp_anchor

    # backend "llamacpp": the models are LlamaCppModels
    return build_llamacpp_anchor(name, config, cast("LlamaCppModel", target), cast("LlamaCppModel | None", draft))


def build_methods(
    config: BenchConfig,
    target: LanguageModel,
    draft: LanguageModel | None,
    profile: CostProfile | None = None,
    others: Mapping[str, Pair] | None = None,
) -> tuple[dict[str, Method], list[RollbackTimer]]:
    """One ``Method`` per name of ``config.runs``, in that order, sharing the loaded models;
    close the timers when done. ``others``: the prepared pair of each of ``config.other_drafts``
    (its draft and costs). Each draftwise method starts from its own copy of its measured costs."""
    others = others or {}
    drafts = [lm for lm in (target, draft, *(pair.draft for pair in others.values())) if lm is not None]
    timers = {id(lm): RollbackTimer(lm) for lm in drafts}
    methods: dict[str, Method] = {}
    for name in config.methods:
        if name in ANCHORS:
            methods[name] = _anchor(name, config, target, draft)
        else:  # draftwise's own: the baseline or a drafter
            methods[name] = _draftwise(name, name, target, draft, profile, timers)
    for other, pair in others.items():
        for name in config.methods:
            if name in NEEDS_DRAFT_MODEL:
                methods[f"{name}@{other}"] = _draftwise(
                    f"{name}@{other}", name, target, pair.draft, pair.profile, timers
                )
    for name in config.methods:  # the sweep: each drafter again at each fixed length (config.sweep_runs)
        for k in config.sweep if name in DRAFTER_KINDS else ():
            methods[sweep_run(name, k)] = _draftwise(sweep_run(name, k), name, target, draft, profile, timers, k)
    return methods, list(timers.values())


def _draftwise(
    label: str,
    name: str,
    target: LanguageModel,
    draft: LanguageModel | None,
    profile: CostProfile | None,
    timers: Mapping[int, RollbackTimer],
    fixed_k: int | None = None,
) -> DraftwiseMethod:
    """draftwise's method ``name`` (the baseline or a drafter) with ``draft``, as ``label``;
    ``fixed_k``: at that draft length under the fixed policy (a sweep run)."""
    if name == REFERENCE:
        return DraftwiseMethod(label, autoregressive(target), target, [timers[id(target)]])
    uses_draft = name in NEEDS_DRAFT_MODEL and draft is not None
    timed = [timers[id(target)], *([timers[id(draft)]] if uses_draft else [])]
    drafter = build_drafter(cast(DrafterKind, name), draft, text_bridge(target.tokenizer, draft))
    engine = SpeculativeEngine.from_models(target, drafter, copy.deepcopy(profile))
    return DraftwiseMethod(label, engine, target, timed, fixed_k)
