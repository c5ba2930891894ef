"""Remote verification settings, the one source of truth: the server's (``serve-verifier``'s
flags derive from them) and the client's (``generate --verifier``'s)."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field, SecretStr

from draftwise.config import ModelOptions, PacingConfig
from draftwise.scale import ServeScale

API_KEY_ENV = "DRAFTWISE_VERIFIER_API_KEY"  # read by serve-verifier and by the client


class VerifierSettings(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    target: str = Field(..., description="target model source (a name, a folder, a .gguf file or tiny:SEED)")
    models: ModelOptions = Field(ModelOptions(), description="how the target is loaded and run")
    host: str = Field("127.0.0.1", description="address to bind; loopback unless told otherwise")
    port: int = Field(8765, ge=0, le=65535, description="port to listen on")
    api_key: SecretStr | None = Field(
        None, description="require 'Authorization: Bearer KEY' on every endpoint but /health"
    )
    max_sessions: int = Field(
        8,
        ge=1,
        le=4096,
        description="open sessions; beyond, the least recently used is evicted (sessions not yet verified go last)",
    )
    slots: int = Field(
        4,
        ge=1,
        le=256,
        description="sessions whose verify passes are batched into one (on llama.cpp: sequences of one context, "
        "one a session; a session opened beyond them evicts one that is not verifying)",
    )
    idle_timeout_s: float = Field(
        300.0, gt=0, description="a session unused this long is closed (its client is presumed gone)"
    )
    max_context: int = Field(32768, ge=2, description="tokens a session may hold (prompt + generated + block)")
    max_block: int = Field(64, ge=1, le=4096, description="proposed tokens per verify request")
    max_q_entries: int = Field(4096, ge=1, description="draft-distribution entries per proposed token (sampling mode)")
    max_body_bytes: int = Field(4 * 1024 * 1024, ge=1024, description="largest request body accepted")
    sweep_interval_s: float = Field(5.0, gt=0, description="how often idle sessions are looked for")
    pacing: PacingConfig = Field(
        PacingConfig(), description="how a long prompt goes in pieces beside the sessions that are verifying"
    )
    active_s: float = Field(
        1.0,
        gt=0,
        le=3600,
        description="a session that verified this recently is taken to be drafting its next block, and a long "
        "prompt beside it goes in paced pieces (a draft model drafts a block in well under a second on a CPU)",
    )
    ray: ServeScale | None = Field(
        None,
        description="run as a Ray Serve deployment of this many replicas, sessions routed by their ID "
        "(limits are per replica; host and port are Serve's proxy); None = one process on uvicorn",
    )


class ClientSettings(BaseModel):
    """What a ``RemoteTarget`` does when its verifier misbehaves: the one source of truth;
    ``generate --verifier``'s flags derive from it."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    reconnect_s: float = Field(
        30.0,
        ge=0,
        description="seconds a run keeps retrying (doubling pauses) a verifier that went away (connection "
        "refused or reset, 502/503/504 from a restart), then carries on in a new session; past that it ends "
        "with its text so far; 0 = give up at once",
    )
