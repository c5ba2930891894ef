"""The load benchmark's settings: which servers, which concurrencies, which prompts, how long.

One typed object; ``draftwise load`` derives its flags from these fields. Speculation of
``llama-server-spec`` defaults to the settings of the bench's llama.cpp anchor, which come
from draftwise's own ``DraftConfig`` defaults, so both sides draft alike unless told.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Literal, get_args

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from draftwise.bench.anchor_settings import spec_draft_max
from draftwise.config import DraftConfig, DrafterName, GenerationConfig, ModelOptions
from draftwise.cpu import default_threads
from draftwise.errors import ConfigError, whole_numbers
from draftwise.registry import DEFAULT_TARGET, paired_draft

ServerName = Literal[
    "draftwise",
    "draftwise-noprediction",
    "draftwise-off",
    "draftwise-nosuffix",
    "llama-server",
    "llama-server-spec",
    "llama-server-ngram-simple",
    "llama-server-ngram-mod",
]
SERVERS: tuple[ServerName, ...] = get_args(ServerName)
DEFAULT_SERVERS: tuple[ServerName, ...] = ("draftwise", "llama-server", "llama-server-spec")
# draftwise-off: the same server decoding plainly (--drafter off), the baseline drafting must beat;
# draftwise-nosuffix: the same server drafting from nothing earlier requests wrote (--suffix-scope none).
DRAFTWISE_SERVERS: frozenset[str] = frozenset(
    {"draftwise", "draftwise-noprediction", "draftwise-off", "draftwise-nosuffix"}
)
LLAMA_SERVERS: frozenset[str] = frozenset(
    {"llama-server", "llama-server-spec", "llama-server-ngram-simple", "llama-server-ngram-mod"}
)
# The servers whose requests carry an --edit task's prediction (OpenAI's Predicted Outputs):
# draftwise only; draftwise-noprediction is the same server asked without it, and llama-server
# has no such field.
PREDICTING_SERVERS: frozenset[str] = frozenset({"draftwise"})
NONE = "none"  # --code none / --data none / --edit none: leave that source out
SPEC_BENCH = "spec_bench"
CODE_COMPLETION = "benchmarks/data/code_completion.jsonl"  # the repository's raw code prompts
MAX_CONCURRENCY = 64  # draftwise serve's most slots


class LoadError(ConfigError):
    """A load-benchmark setting or run that cannot work; the message says why."""


def parse_concurrency(text: str) -> tuple[int, ...]:
    """``"1,2,4"`` -> ``(1, 2, 4)``: distinct whole numbers from 1 to MAX_CONCURRENCY, in order."""
    levels = sorted(set(whole_numbers(text, "--concurrency", LoadError)))
    if levels[0] < 1 or levels[-1] > MAX_CONCURRENCY:
        raise LoadError(f"--concurrency: each level must be between 1 and {MAX_CONCURRENCY} (got {text!r})")
    return tuple(levels)


def sends_prediction(server: str) -> bool:
    """Whether requests to ``server`` carry the prediction of an edit task."""
    return server in PREDICTING_SERVERS


def parse_servers(text: str) -> tuple[str, ...]:
    """``"draftwise,llama-server"`` -> its names, each known, each once, in the order given."""
    names = tuple(dict.fromkeys(p.strip() for p in text.split(",") if p.strip()))
    unknown = [n for n in names if n not in SERVERS]
    if unknown or not names:
        got = ", ".join(unknown) if unknown else "nothing"
        raise LoadError(f"--servers: unknown server {got}; choose from {', '.join(SERVERS)}")
    return names


class LoadConfig(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    servers: tuple[ServerName, ...] = Field(
        DEFAULT_SERVERS, description="servers to measure, each at every concurrency"
    )
    concurrency: tuple[int, ...] = Field((1, 2, 4, 8), description="concurrent clients (and server slots) per run")
    target: str = Field(DEFAULT_TARGET, description="target model: registry name or .gguf file (tiny:SEED: draftwise)")
    draft: str | None = Field(
        None, description="draft model (draftwise's drafter, llama-server-spec's -md); default: the registry's pick"
    )
    drafter: DrafterName | None = Field(None, description="draftwise's drafter; default: what draftwise serve picks")
    models: ModelOptions = Field(ModelOptions(), description="how draftwise loads and runs the models")
    context: int = Field(
        4096, ge=16, le=1_048_576, description="positions per slot on every server (llama-server: -c this x C)"
    )
    max_tokens: int = Field(128, ge=1, le=1_000_000, description="max_tokens of every request (greedy, temperature 0)")
    code: str = Field(CODE_COMPLETION, description=f"JSONL of raw completion prompts, or '{NONE}'")
    data: str = Field(SPEC_BENCH, description=f"chat prompts (first turns): 'spec_bench', a JSONL file, or '{NONE}'")
    edit: str = Field(
        NONE,
        description="JSONL of code-edit tasks (scripts/make_code_edit.py): chat prompts whose requests carry the "
        f"file as OpenAI's prediction (to draftwise only), or '{NONE}'",
    )
    structured: str = Field(
        NONE,
        description="JSONL of structured-output tasks (scripts/make_extraction.py): chat prompts whose requests "
        f"carry a response_format (a JSON schema), to every server, or '{NONE}'",
    )
    subtasks: tuple[str, ...] | None = Field(None, description="subtasks to run; None = all in the data")
    limit: int | None = Field(3, ge=1, description="prompts per subtask")
    url: str | None = Field(None, description="measure this running server instead of starting one")
    in_process: bool = Field(
        False,
        description="run draftwise's servers in this process and send them requests through the app without "
        "HTTP (llama-server still runs as a program): what the server does, without sockets and a second process",
    )
    llama_cpp_bin: Path | None = Field(
        None, description="folder holding llama.cpp's llama-server (`make llama-cpp-bin` builds it)"
    )
    spec_draft_n_max: int = Field(
        spec_draft_max(GenerationConfig()), ge=1, le=64, description="llama-server-spec: --spec-draft-n-max"
    )
    spec_draft_n_min: int = Field(0, ge=0, le=64, description="llama-server-spec: --spec-draft-n-min")
    spec_draft_p_min: float = Field(
        DraftConfig().confidence_threshold, ge=0.0, le=1.0, description="llama-server-spec: --spec-draft-p-min"
    )
    repeat: int = Field(
        1,
        ge=1,
        le=20,
        description="runs of each server at each concurrency, the servers' order reversed on every other pass "
        "over them: a host whose speed drifts shows it as spread between runs, not as one server's loss",
    )
    warmup: bool = Field(True, description="send one short request to each server before measuring it")
    audit: bool = Field(
        True, description="load the target here to find the top-2 logit gap at each output that differs from alone"
    )
    out: Path = Field(Path("draftwise-load"), description="folder for results.jsonl, report.md and config.json")
    startup_timeout: float = Field(900.0, gt=0, description="seconds a server may take to answer /health")
    request_timeout: float = Field(900.0, gt=0, description="seconds one request may take")

    @field_validator("concurrency")
    @classmethod
    def _levels(cls, levels: tuple[int, ...]) -> tuple[int, ...]:
        if not levels or min(levels) < 1 or max(levels) > MAX_CONCURRENCY:
            raise ValueError(f"each level must be between 1 and {MAX_CONCURRENCY}")
        return tuple(sorted(set(levels)))

    @field_validator("servers")
    @classmethod
    def _servers(cls, servers: tuple[ServerName, ...]) -> tuple[ServerName, ...]:
        if not servers:
            raise ValueError("name at least one server")
        return tuple(dict.fromkeys(servers))

    @model_validator(mode="after")
    def _consistent(self) -> LoadConfig:
        self.models.timed_here("load")
        if self.url is not None:
            if len(self.servers) != 1:
                raise ValueError("--url measures one running server: name it with --servers (one name)")
            if self.in_process:
                raise ValueError("--url measures a running server; --in-process starts one here: choose one")
        elif LLAMA_SERVERS & set(self.servers) and self.llama_cpp_bin is None:
            raise ValueError("llama-server needs --llama-cpp-bin DIR (llama.cpp's programs; `make llama-cpp-bin`)")
        if "llama-server-spec" in self.servers and self.url is None and self.draft_model is None:
            raise ValueError(f"llama-server-spec needs a draft model: {self.target} has none recommended (--draft)")
        if all(source == NONE for source in (self.code, self.data, self.edit, self.structured)):
            raise ValueError("--code none, --data none, --edit none and --structured none leave no prompts")
        return self

    @property
    def draft_model(self) -> str | None:
        return self.draft if self.draft is not None else paired_draft(self.target)

    @property
    def threads(self) -> int:
        """Threads of every server: the ones asked for, else one per core this process may run
        on (said explicitly to each server, whose own defaults differ)."""
        return self.models.threads or default_threads()

    def results_hash(self) -> str:
        """Hash of every setting that changes a run's answers or its speed; the prompt set is
        in it, since a run's throughput is over all of its prompts together."""
        relevant = self.model_dump(
            mode="json",
            exclude={
                "servers",
                "concurrency",
                "repeat",
                "warmup",
                "audit",
                "out",
                "startup_timeout",
                "request_timeout",
            },
        )
        for added in ("edit", "structured"):  # a run without them hashes as it did before they came
            if relevant[added] == NONE:
                del relevant[added]
        if not relevant["in_process"]:  # so does a run over HTTP
            del relevant["in_process"]
        relevant.update(draft_model=self.draft_model, threads=self.threads)
        blob = json.dumps(relevant, sort_keys=True).encode()
        return hashlib.sha256(blob).hexdigest()[:12]
