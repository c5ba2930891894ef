"""The bench's settings: which models, which prompts, which methods, how to generate.

Generation settings are a plain ``GenerationConfig`` (the one source of truth for sampling
and drafting); the bench only adds what is specific to a benchmark run.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from draftwise.config import DEFAULT_DRAFT_QUANT, DRAFT_QUANT_HELP, DraftQuant, GenerationConfig

MethodName = Literal["baseline", "draft", "ngram", "hybrid", "hf-assisted", "hf-pld", "hf-baseline"]
METHODS: tuple[MethodName, ...] = ("baseline", "draft", "ngram", "hybrid", "hf-assisted", "hf-pld", "hf-baseline")
REFERENCE: MethodName = "baseline"  # every speedup and every losslessness check is against this one
NEEDS_DRAFT_MODEL: frozenset[str] = frozenset({"draft", "hybrid", "hf-assisted"})

SPEC_BENCH = "spec_bench"


class BenchConfig(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    target: str = Field("qwen2.5-coder-1.5b",
                        description="target model: registry name, .gguf file, folder or tiny:SEED")
    draft: str = Field("qwen2.5-coder-0.5b", description="draft model for the 'draft' and 'hf-assisted' methods")
    methods: tuple[MethodName, ...] = Field(METHODS, description="methods to compare; 'baseline' is always run")
    data: str = Field(SPEC_BENCH, description="'spec_bench' (packaged) or a JSONL file of prompts")
    subtasks: tuple[str, ...] | None = Field(None, description="subtasks to run; None = all in the data")
    limit: int | None = Field(None, ge=1, description="prompts per subtask")
    dtype: str = Field("auto", description="model dtype, passed to the model loader")
    draft_quant: DraftQuant = Field(DEFAULT_DRAFT_QUANT, description=DRAFT_QUANT_HELP)
    threads: int | None = Field(None, ge=1, description="torch threads; None = torch's default")
    chat_template: bool = Field(True, description="wrap prompts in the target's chat template when it has one")
    warmup: bool = Field(True, description="run every method once, untimed, before measuring")
    generation: GenerationConfig = GenerationConfig()
    out: Path = Field(Path("draftwise-bench"), description="folder for results.jsonl, report.md and plots")

    @field_validator("methods")
    @classmethod
    def _with_reference(cls, methods: tuple[MethodName, ...]) -> tuple[MethodName, ...]:
        # The reference runs first in the listing (the run order still rotates per prompt).
        rest = tuple(dict.fromkeys(m for m in methods if m != REFERENCE))
        return (REFERENCE, *rest)

    @property
    def needs_draft_model(self) -> bool:
        return any(m in NEEDS_DRAFT_MODEL for m in self.methods)

    def results_hash(self) -> str:
        """Hash of every setting that changes what a method produces or how fast.

        Which prompts or methods are selected, where results go and warm-up do not change
        a single result, so they are left out: a larger ``--limit`` reuses earlier results.
        """
        relevant = self.model_dump(mode="json", include={"target", "draft", "data", "dtype", "draft_quant", "threads",
                                                          "chat_template", "generation"})
        blob = json.dumps(relevant, sort_keys=True).encode()
        return hashlib.sha256(blob).hexdigest()[:12]
