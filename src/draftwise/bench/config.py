"""The bench's settings: which models, which prompts, which methods, how to generate.

Generation settings are a plain ``GenerationConfig`` (the one source of truth for sampling
and drafting); the bench only adds what is specific to a benchmark run.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Annotated, Any, Literal, get_args

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from draftwise.config import DRAFTER_KINDS, NEEDS_DRAFT_MODEL, DrafterKind, GenerationConfig, ModelOptions
from draftwise.errors import DraftwiseError
from draftwise.registry import paired_draft
from draftwise.scale import BenchWorkers

# draftwise's own methods are plain decoding ("baseline") and one per drafter that drafts
# (draftwise.config.DrafterKind); the anchors are other projects' decoding loops on the same
# model files.
HfAnchor = Literal["hf-assisted", "hf-pld", "hf-baseline"]
LlamacppAnchor = Literal["llamacpp-plain", "llamacpp-pld", "llamacpp-spec"]
MethodName = Literal["baseline", DrafterKind, HfAnchor, LlamacppAnchor]
METHODS: tuple[MethodName, ...] = get_args(MethodName)
REFERENCE: MethodName = "baseline"  # every speedup and every losslessness check is against this one
HF_ANCHORS: tuple[MethodName, ...] = get_args(HfAnchor)
LLAMACPP_ANCHORS: tuple[MethodName, ...] = get_args(LlamacppAnchor)
ANCHORS = HF_ANCHORS + LLAMACPP_ANCHORS
# Methods that draft with the draft model (the bench then loads it): the drafters that need
# one, and the anchors that draft with it.
METHODS_WITH_DRAFT_MODEL: frozenset[str] = NEEDS_DRAFT_MODEL | {"hf-assisted", "llamacpp-spec"}

SPEC_BENCH = "spec_bench"
# A sweep run is a drafter again under the fixed policy at one draft length: METHOD/kK.
SWEEP_MARK = "/k"
SweepK = Annotated[int, Field(ge=1, le=64)]


def sweep_run(method: str, k: int) -> str:
    """The name of ``method`` (a drafter) run again with the fixed policy at ``k``: ``model/k4``."""
    return f"{method}{SWEEP_MARK}{k}"


def parse_sweep_run(run: str) -> tuple[DrafterKind, int] | None:
    """(drafter, k) of a sweep run's name; None for any other run (``model``, ``model@DRAFT``)."""
    method, mark, k = run.rpartition(SWEEP_MARK)
    if not mark or method not in DRAFTER_KINDS or not k.isdigit():
        return None
    return method, int(k)  # narrowed to a DrafterKind by the membership test


class BenchError(DraftwiseError, ValueError):
    """A bench setting that cannot work; the message says why."""


def with_paired_draft(data: Any, config: type[BaseModel]) -> Any:
    """A config's fields (before validation) with ``draft`` taken from the registry's pairing
    for ``target`` where none was given: the rule ``draftwise generate`` and ``serve`` follow
    (``draftwise.prepare.choose_drafter``)."""
    if not isinstance(data, dict) or data.get("draft") is not None:
        return data
    target = data.get("target", config.model_fields["target"].default)
    return {**data, "draft": paired_draft(target)} if isinstance(target, str) else data


class BenchConfig(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    target: str = Field(
        "qwen2.5-coder-1.5b", description="target model: registry name, .gguf file, folder or tiny:SEED"
    )
    draft: str | None = Field(
        None,
        description="draft model of the methods that draft with a model (model, hybrid, anchors); "
        "default: the registry's draft for the target",
    )
    methods: tuple[MethodName, ...] = Field(
        ("baseline", "model", "ngram", "hybrid"),
        description="methods to compare; 'baseline' (draftwise's plain decoding) is always run",
    )
    other_drafts: tuple[str, ...] = Field(
        (),
        description="more draft models, compared on the same prompts: each runs the methods that draft with a "
        "model again, named METHOD@DRAFT (hybrid@smollm2-135m)",
    )
    sweep: tuple[SweepK, ...] = Field(
        (),
        description="fixed draft lengths: every drafting method in --methods runs again at each, named METHOD/kK "
        "(model/k4), with the fixed policy",
    )
    data: str = Field(SPEC_BENCH, description="'spec_bench' (packaged) or a JSONL file of prompts")
    subtasks: tuple[str, ...] | None = Field(None, description="subtasks to run; None = all in the data")
    limit: int | None = Field(None, ge=1, description="prompts per subtask")
    models: ModelOptions = Field(ModelOptions(), description="how the models are loaded and run")
    chat_template: bool = Field(True, description="wrap prompts in the target's chat template when it has one")
    warmup: bool = Field(True, description="run every method once, untimed, before measuring")
    generation: GenerationConfig = GenerationConfig()
    out: Path = Field(Path("draftwise-bench"), description="folder for results.jsonl, report.md and plots")
    llama_cpp_bin: Path | None = Field(
        None,
        description="folder holding llama.cpp's own llama-speculative-simple (`make llama-cpp-bin` builds it), "
        "for the llamacpp-spec method",
    )
    ray: BenchWorkers | None = Field(
        None, description="run the prompts on Ray workers (draftwise bench --ray); None = in this process"
    )

    @model_validator(mode="before")
    @classmethod
    def _paired_draft(cls, data: Any) -> Any:
        return with_paired_draft(data, cls)

    @field_validator("methods")
    @classmethod
    def _with_reference(cls, methods: tuple[MethodName, ...]) -> tuple[MethodName, ...]:
        # The reference runs first in the listing (the run order still rotates per prompt).
        rest = tuple(dict.fromkeys(m for m in methods if m != REFERENCE))
        return (REFERENCE, *rest)

    @field_validator("sweep")
    @classmethod
    def _sweep_in_order(cls, sweep: tuple[int, ...]) -> tuple[int, ...]:
        # One run per length, shortest first: the report lists them in this order.
        return tuple(sorted(set(sweep)))

    @model_validator(mode="after")
    def _sweep_needs_a_drafting_method(self) -> BenchConfig:
        if self.sweep and not any(m in DRAFTER_KINDS for m in self.methods):
            raise ValueError(
                f"--sweep runs the drafting methods ({', '.join(DRAFTER_KINDS)}) again at each draft length; "
                "--methods names none"
            )
        return self

    @model_validator(mode="after")
    def _a_draft_where_needed(self) -> BenchConfig:
        if self.draft is None and self.needs_draft_model:
            drafting = ", ".join(m for m in self.methods if m in METHODS_WITH_DRAFT_MODEL)
            raise ValueError(
                f"{drafting} draft with a model, and none is known for {self.target}: name one with --draft"
            )
        return self

    @model_validator(mode="after")
    def _timed_here(self) -> BenchConfig:
        self.models.timed_here("bench")
        return self

    @model_validator(mode="after")
    def _spec_needs_binaries(self) -> BenchConfig:
        if "llamacpp-spec" in self.methods and self.llama_cpp_bin is None:
            raise ValueError(
                "method llamacpp-spec needs --llama-cpp-bin DIR (llama.cpp's binaries; "
                "`make llama-cpp-bin` builds them)"
            )
        return self

    @model_validator(mode="after")
    def _other_drafts_need_a_drafting_method(self) -> BenchConfig:
        if self.other_drafts and not any(m in NEEDS_DRAFT_MODEL for m in self.methods):
            raise ValueError(
                f"--other-drafts runs the methods that draft with a model ({', '.join(sorted(NEEDS_DRAFT_MODEL))}) "
                "with each draft; --methods names none"
            )
        return self

    @model_validator(mode="after")
    def _other_drafts_are_other_models(self) -> BenchConfig:
        # A draft named like the target is a fork of it: a slot of the target's context, which
        # the bench loads for the one draft it pairs with the target (``load_pair``).
        if self.target in self.other_drafts:
            raise ValueError(
                f"--other-drafts names the target {self.target}, which drafts for itself only as --draft {self.target}"
            )
        return self

    @property
    def needs_draft_model(self) -> bool:
        return any(m in METHODS_WITH_DRAFT_MODEL for m in self.methods)

    @property
    def runs(self) -> tuple[str, ...]:
        """Every method run: ``methods``, then each drafting one again with each other draft,
        then each drafter again at each length of the sweep (``sweep_runs``)."""
        drafting = [m for m in self.methods if m in NEEDS_DRAFT_MODEL]
        return (*self.methods, *(f"{m}@{draft}" for draft in self.other_drafts for m in drafting), *self.sweep_runs)

    @property
    def sweep_runs(self) -> tuple[str, ...]:
        """Each drafter of ``methods`` at each length of ``sweep``, fixed policy: ``model/k4``."""
        return tuple(sweep_run(m, k) for m in self.methods if m in DRAFTER_KINDS for k in self.sweep)

    def results_hash(self) -> str:
        """Hash of every setting that changes what a method produces or how fast.

        Which prompts or methods are selected, where results go and warm-up do not change
        a single result, so they are left out: a larger ``--limit`` reuses earlier results.
        """
        relevant = self.model_dump(
            mode="json", include={"target", "draft", "data", "models", "chat_template", "generation"}
        )
        blob = json.dumps(relevant, sort_keys=True).encode()
        return hashlib.sha256(blob).hexdigest()[:12]
