"""Server settings: one typed object, from which ``draftwise serve`` and ``create_app`` work.

Request defaults (length, drafting) are a ``GenerationConfig``, the same object the engine
takes, so the server never keeps a second copy of those knobs.
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field, SecretStr, model_validator

from draftwise.config import (
    NEEDS_DRAFT_MODEL,
    DrafterName,
    GenerationConfig,
    ModelOptions,
    PacingConfig,
    SuffixConfig,
)
from draftwise.scale import ServeScale


class ServerSettings(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    target: str = Field(..., description="target model source (registry name, folder, .gguf file, tiny:SEED)")
    draft: str | None = Field(None, description="draft model source; needed for the 'model' drafter")
    drafter: DrafterName | None = Field(
        None,
        description="default drafter of requests: model, ngram, hybrid or off; None = hybrid if a draft is loaded, "
        "else ngram",
    )
    model_name: str | None = Field(
        None, description="model id shown in /v1/models and expected in requests; None = target"
    )
    models: ModelOptions = Field(ModelOptions(), description="how the models are loaded and run")
    host: str = Field("127.0.0.1", description="address to bind; loopback unless told otherwise")
    port: int = Field(8000, ge=0, le=65535, description="port to listen on")
    slots: int = Field(
        1,
        ge=1,
        le=64,
        description="generations run at once, each in a slot (a sequence and its KV cache) over the shared weights; "
        "on llama.cpp the slots share one context and their forward passes are batched into one",
    )
    api_key: SecretStr | None = Field(
        None, description="require 'Authorization: Bearer KEY' on /v1/* (what OpenAI clients send as api_key)"
    )
    max_body_bytes: int = Field(8 * 1024 * 1024, ge=1024, description="largest request body accepted")
    queue_size: int = Field(8, ge=0, le=10_000, description="requests that may wait for a slot; more get 429")
    request_timeout: float = Field(300.0, gt=0, description="seconds a request may take, queueing included")
    retry_after: int = Field(1, ge=0, description="seconds suggested to rejected clients in Retry-After")
    max_context: int | None = Field(
        None, ge=2, description="prompt + completion tokens allowed; None = the target's own limit"
    )
    parse_special: bool = Field(
        False,
        description="raw prompts (/v1/completions): read control-token strings such as <|im_end|> in them as "
        "control tokens, as llama-server does; off: every character is text. Chat messages are always text",
    )
    generation: GenerationConfig = Field(
        GenerationConfig(),
        description="request defaults: max_new_tokens is the default max_tokens, draft the default speculation",
    )
    pacing: PacingConfig = Field(
        PacingConfig(), description="how a long prompt goes in pieces beside the streams that are generating"
    )
    suffix: SuffixConfig = Field(
        SuffixConfig(), description="drafting from what the server wrote for earlier requests, and whose"
    )
    ray: ServeScale | None = Field(
        None,
        description="run as a Ray Serve deployment of this many replicas (slots, queue and limits are per "
        "replica; host and port are Serve's proxy); None = one process on uvicorn",
    )

    @model_validator(mode="after")
    def _check_drafter(self) -> ServerSettings:
        if self.drafter in NEEDS_DRAFT_MODEL and self.draft is None:
            raise ValueError(f"drafter '{self.drafter}' needs a draft model (--draft MODEL)")
        return self

    @property
    def default_drafter(self) -> DrafterName:
        if self.drafter is not None:
            return self.drafter
        return "hybrid" if self.draft is not None else "ngram"

    @property
    def served_model(self) -> str:
        return self.model_name or self.target
