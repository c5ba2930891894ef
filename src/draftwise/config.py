"""Typed configuration: the one source of truth for every knob.

Every setting is validated when the object is built; unknown keys are rejected, so a
misspelt option fails loudly instead of being silently ignored. The CLI, the servers and
the bench build these objects rather than inventing their own settings.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Literal, get_args

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

KPolicyName = Literal["fixed", "heuristic", "cost"]

# The drafters by name: the one vocabulary of the CLI, the API, the bench and the dashboard.
# DrafterKind: the ones that draft (see draftwise.drafters.build_drafter); DrafterName adds
# "off", plain decoding, wherever a drafter is chosen per request or per run. The ones that
# draft with a model need a draft model loaded.
DrafterKind = Literal["model", "ngram", "hybrid"]
DrafterName = Literal[DrafterKind, "off"]
DRAFTER_KINDS: tuple[DrafterKind, ...] = get_args(DrafterKind)
DRAFTER_NAMES: tuple[DrafterName, ...] = get_args(DrafterName)
NEEDS_DRAFT_MODEL: frozenset[DrafterKind] = frozenset({"model", "hybrid"})

# Quantization of a draft model (hf: weight-only int8/int4 layers, draftwise.backends.quant;
# llamacpp: a Q8_0/Q4_0 copy of the file). The draft's precision cannot change the output,
# only its speed; int4 drafts fastest on CPU.
DraftQuant = Literal["none", "int8", "int4"]
DEFAULT_DRAFT_QUANT: DraftQuant = "int4"

# Where a model runs: llama.cpp's kernels over the GGUF file itself, or transformers in PyTorch.
Backend = Literal["auto", "llamacpp", "hf"]
Dtype = Literal["auto", "float32", "bfloat16"]
Device = Literal["auto", "cpu", "cuda"]


# The smallest positive temperature: SamplingConfig raises any positive temperature below it to
# it. Below about 1e-45 a temperature is 0 in float32 (scores / temperature is then inf or NaN),
# and well before that scores / temperature leaves float32's range. At this floor two tokens
# whose scores differ by 1e-4 already differ in probability by a factor of e^100, so only
# near-ties could tell a smaller temperature apart; 0 is the way to ask for the argmax.
MIN_TEMPERATURE = 1e-6
# The longest block a config may ask for (k, k_max, k_long): a verified block and the token
# before it fill a pass of at most MAX_BLOCK + 1 rows, which the scheduler reads as a step.
MAX_BLOCK = 64
# The environment's way to set ModelOptions.costs, for commands run by others (make run, a test).
COSTS_ENV = "DRAFTWISE_COSTS"


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class ModelOptions(_Strict):
    """How models are loaded and run. The one place these settings live: ``generate``,
    ``serve``, ``serve-verifier``, ``dashboard`` and ``bench`` derive their flags from it."""

    backend: Backend = Field(
        "auto",
        description="llamacpp runs .gguf files (and packaged models) on llama.cpp's kernels; hf runs them "
        "dequantized in PyTorch, and runs model folders and Hugging Face ids; auto = llamacpp for GGUF when "
        "llama-cpp-python is installed, else hf",
    )
    threads: int | None = Field(None, ge=1, le=1024, description="CPU threads; None = one per core")
    context: int | None = Field(
        None,
        ge=16,
        le=1_048_576,
        description="llamacpp: positions one sequence may hold (prompt + generated; sizes the KV cache); "
        "None = the model's training context, at most 8192",
    )
    dtype: Dtype = Field("auto", description="hf: weights dtype; auto = whichever this CPU runs faster")
    draft_quant: DraftQuant = Field(
        DEFAULT_DRAFT_QUANT,
        description="quantization of the draft model (none, int8, int4; llamacpp: a Q8_0 or Q4_0 copy of the "
        "GGUF file, made once); the draft's precision cannot change the output (the target checks every "
        "token), only its speed",
    )
    device: Device = Field(
        "auto",
        description="cpu or cuda (llamacpp: every layer of target and draft on the GPU, with a CUDA build of "
        "llama-cpp-python); auto = cuda where the backend sees a CUDA device (llamacpp: unless --exact)",
    )
    exact: bool = Field(
        False,
        description="llamacpp: every row of a pass computed as in one-token decoding, whatever else the pass "
        "holds, so that speculative and batched output is bit-identical to plain decoding; prompts are "
        "processed more slowly (docs/exactness.md); hf: the target in float32 (bfloat16 is refused)",
    )
    costs: Path | None = Field(
        None,
        description="cost policy: price drafting from this host profile (`draftwise curve --out`) and never "
        f"learn this machine's times, to see what the policy does on the host it describes; ${COSTS_ENV} sets "
        "it too; benchmarks refuse it, since they report this machine's speed; None = time this machine",
    )

    def host_costs(self) -> Path | None:
        """The host profile to price drafting from: ``costs``, else ``$DRAFTWISE_COSTS``."""
        value = self.costs or os.environ.get(COSTS_ENV)
        return Path(value).expanduser() if value else None

    def timed_here(self, command: str) -> None:
        """Refuse a host profile to ``command``, which reports this machine's speed (ValueError)."""
        if self.host_costs() is not None:
            raise ValueError(
                f"{command} reports this machine's speed, so it times this machine: drop --costs and unset ${COSTS_ENV}"
            )


class SamplingConfig(_Strict):
    """How the next token is chosen. ``temperature == 0`` means greedy decoding.

    Temperature, top-k and top-p shape the target distribution ``p`` and the draft
    distribution ``q`` alike, so what speculation preserves is the distribution the user
    configured.
    """

    temperature: float = Field(
        0.0,
        ge=0.0,
        le=100.0,
        description=f"0 = greedy; a positive temperature below {MIN_TEMPERATURE:g} counts as {MIN_TEMPERATURE:g}",
    )
    top_k: int = Field(0, ge=0, description="keep the k most likely tokens; 0 = off")
    top_p: float = Field(
        1.0,
        gt=0.0,
        le=1.0,
        description="nucleus mass to keep; 1 = off; the most likely token is always kept, however small top_p",
    )
    seed: int | None = Field(None, ge=0, le=2**63 - 2, description="seed of the sampling generator")

    @field_validator("temperature")
    @classmethod
    def _floor_temperature(cls, value: float) -> float:
        # Clamped here, the one place every entry point (library, API, verifier) goes through,
        # so the temperature a config reports is the one the distribution is computed with.
        return MIN_TEMPERATURE if 0.0 < value < MIN_TEMPERATURE else value

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


class CostPolicyConfig(_Strict):
    """The cost policy's own numbers (``draftwise.policies.CostAwareK``; ``pass_weight`` and
    ``outlier`` are its ``CostProfile``'s, fixed when a pair is prepared). Each default was
    chosen by ``draftwise replay --vary`` over the recorded Spec-Bench and code prompts on both
    host profiles (``docs/speed.md``, "The policy's settings"), not on one prompt or one host."""

    allowance: float = Field(
        0.03,
        ge=0.0,
        le=1.0,
        description="what exploration and mistakes may cost a run, as a share of its decoding time: the slack "
        "of the promise never to be slower than plain decoding",
    )
    opening: float = Field(
        4.0,
        ge=0.0,
        le=1000.0,
        description="each source's first exploration budget and account, in plain tokens' time: enough for "
        "one probe of a short block at the start",
    )
    growth: float = Field(
        2.0,
        ge=1.0,
        le=64.0,
        description="how fast blocks grow with what a source keeps: a grounded source's longest block, in "
        "multiples of its run of tokens kept; a probe's loss, in multiples of its cheapest promising block's "
        "per position its blocks have reached",
    )
    catchup_horizon: float = Field(
        16.0, ge=1.0, le=10_000.0, description="steps within which a draft model's catch-up is priced as repaid"
    )
    optimism_cap: float = Field(
        0.95, gt=0.0, lt=1.0, description="the highest acceptance exploration assumes a source could have"
    )
    acceptance_memory: float = Field(
        0.7,
        ge=0.0,
        le=1.0,
        description="share of a source's acceptance counts that each new block keeps: 0.7 remembers about "
        "three blocks, 1 / (1 - 0.7); 1 never forgets",
    )
    shrink: float = Field(
        2.0, ge=0.0, le=100.0, description="tries' worth of a source's pooled rate in each block position's rate"
    )
    pass_weight: float = Field(
        0.3, gt=0.0, le=1.0, description="weight of the newest pass time in its size's running mean"
    )
    outlier: float = Field(
        2.0,
        gt=1.0,
        le=100.0,
        description="a time more than this many times its running mean counts as this many times it (a stall "
        "says more about the machine than the block), and a calibrated curve off its own line by more is timed "
        "again",
    )


class PacingConfig(_Strict):
    """How a long prompt goes in pieces beside streams that are generating
    (``draftwise.pacing``): what its pieces may add to their steps, and how a pass is priced."""

    piece_seconds: float = Field(
        0.4,
        gt=0.0,
        le=60.0,
        description="most seconds a long prompt's pieces may add to a step of a stream generating beside it: "
        "the pause it sees in its streamed text (under half a second with a one-token step)",
    )
    piece_min_rows: int = Field(
        64,
        ge=1,
        le=4096,
        description="fewest rows of a step's first prompt piece beside others, whatever the curve says: deep "
        "into a long prompt on 2-core hosts a 64-row pass costs within 1% a row of a 256-row one and a 27-row "
        "pass 45% more, and pieces that small made the prompt's first token come 1.75 times later",
    )
    pace_weight: float = Field(
        0.5, gt=0.0, le=1.0, description="weight of the newest pass in how much slower than the curve passes run"
    )
    reference_rows: int = Field(
        32,
        ge=1,
        le=4096,
        description="past a step's sizes a row is priced at no less than the rate per row of a pass this large, "
        "where the CPU kernels run near their best",
    )


SuffixScope = Literal["none", "key", "global"]


class SuffixConfig(_Strict):
    """Drafting from what the server wrote for earlier requests (``draftwise.suffix``): whose
    outputs a request may draft from, how much is kept, and how a match is looked up."""

    scope: SuffixScope = Field(
        "key",
        description="whose earlier outputs a request drafts from: none (only its own prompt and prediction); key "
        "(requests sending the same API key, and every request without one, share); global (every request)",
    )
    cap_tokens: int = Field(
        131_072,
        ge=0,
        le=16_777_216,
        description="most tokens the server keeps of earlier outputs, across scopes; the oldest output goes "
        "first; 0 = none kept",
    )
    cache: Path | None = Field(
        None, description="file keeping the earlier outputs across restarts (written at shutdown, read at start)"
    )
    prompts: bool = Field(False, description="keep requests' prompts too, not only their outputs")
    lead_tokens: int = Field(
        16,
        ge=0,
        le=MAX_BLOCK,
        description="prompt tokens kept before each output, so that an answer's opening is found from the end "
        "of a prompt like its own (a chat template's assistant header, an instruction's last words)",
    )
    min_match: int = Field(
        2, ge=1, le=MAX_BLOCK, description="shortest suffix of the context looked up among earlier outputs"
    )
    max_match: int = Field(
        32,
        ge=1,
        le=MAX_BLOCK,
        description="longest suffix looked up: lengths from min_match doubling up to this one are indexed",
    )
    occurrences: int = Field(
        32,
        ge=1,
        le=1024,
        description="latest occurrences kept of each suffix: the continuation drafted is the one most of them share",
    )

    @model_validator(mode="after")
    def _check_match(self) -> SuffixConfig:
        if self.min_match > self.max_match:
            raise ValueError(f"min_match ({self.min_match}) must not exceed max_match ({self.max_match})")
        return self

    @property
    def orders(self) -> tuple[int, ...]:
        """The suffix lengths indexed, shortest first: min_match doubling, and max_match."""
        found = [self.min_match]
        while found[-1] * 2 < self.max_match:
            found.append(found[-1] * 2)
        return tuple(sorted({*found, self.max_match}))


class DraftConfig(_Strict):
    """How much to draft per step and when the drafter stops early."""

    k_policy: KPolicyName = Field(
        "cost",
        description="fixed: always k; heuristic: transformers' +2/-1 rule; "
        "cost: the source and k with the most expected tokens/s from this host's measured pass times and each "
        "source's measured acceptance by position, within a loss bound (draftwise.policies.CostAwareK)",
    )
    k: int = Field(5, ge=0, le=MAX_BLOCK, description="draft length (fixed) or starting length (heuristic)")
    k_max: int = Field(12, ge=1, le=MAX_BLOCK, description="largest draft length the adaptive policies may use")
    k_long: int = Field(
        48,
        ge=1,
        le=MAX_BLOCK,
        description="cost policy: largest block of a grounded source (a prediction, an n-gram copy in progress), "
        "reached only after the source was right as many tokens in a row as half the block; below k_max, k_max",
    )
    confidence_threshold: float = Field(
        0.6,
        ge=0.0,
        le=1.0,
        description="a draft model stops proposing once its top-1 probability falls below this; 0 = off",
    )
    ngram_max: int = Field(4, ge=1, le=16, description="longest context suffix the n-gram drafter matches")
    ngram_min: int = Field(1, ge=1, le=16, description="shortest context suffix the n-gram drafter matches")
    cost: CostPolicyConfig = Field(CostPolicyConfig(), description="the cost policy's own numbers")
    proposal_top: int = Field(
        0,
        ge=0,
        description="sampling: a draft model samples from its N most likely tokens only (renormalised), so "
        "its q has at most N entries per position (what a remote verifier receives); still lossless; 0 = off",
    )

    @model_validator(mode="after")
    def _check_ranges(self) -> DraftConfig:
        if self.ngram_min > self.ngram_max:
            raise ValueError(f"ngram_min ({self.ngram_min}) must not exceed ngram_max ({self.ngram_max})")
        if self.k > self.k_max and self.k_policy != "fixed":
            raise ValueError(f"k ({self.k}) must not exceed k_max ({self.k_max})")
        return self


GrammarKind = Literal["json_schema", "json_object", "lark", "gbnf", "regex"]


class GrammarSpec(_Strict):
    """A grammar the output must follow (``draftwise.grammar``): a JSON schema (as JSON
    text), any JSON object, a Lark or GBNF grammar, or a regular expression."""

    kind: GrammarKind
    text: str = Field("", description="the schema, grammar or expression; unused for json_object")
    trigger: str | None = Field(
        None,
        description="the grammar applies from where the output first holds this text (a tool call's opening "
        "tag), which the grammar's own text starts with; free text before it; None = from the start",
    )
    name: str | None = Field(None, description="what messages call it; None = its kind's name")


class GenerationConfig(_Strict):
    """One generation request: length, stops, sampling and drafting."""

    max_new_tokens: int = Field(128, ge=1, le=1_000_000)
    stop: tuple[str, ...] = Field((), description="stop strings; the output ends before the first one")
    eos_token_ids: tuple[int, ...] | None = Field(
        None, description="tokens that end generation; None = the target model's own"
    )
    ignore_eos: bool = Field(False, description="keep generating through EOS tokens")
    sampling: SamplingConfig = SamplingConfig()
    draft: DraftConfig = DraftConfig()
    prediction: str | None = Field(
        None,
        description="the expected output, or most of it (OpenAI's Predicted Outputs: a file sent back with an "
        "edit); drafted from wherever the output follows it, verified like any draft",
    )
    grammar: GrammarSpec | None = Field(
        None,
        description="a grammar the output follows (structured output): every verified row is masked to what it "
        "allows, and the text it forces is drafted for free",
    )

    @model_validator(mode="after")
    def _check_stops(self) -> GenerationConfig:
        if any(s == "" for s in self.stop):
            raise ValueError("stop strings must not be empty")
        return self
