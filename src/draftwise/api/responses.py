"""OpenAI-shaped response bodies: completions and chat completions, their stream chunks
(tool calls piece by piece included), the model list and the error body.

Beside OpenAI's fields they carry draftwise's: ``speculative`` (the generation's
speculation statistics), ``provenance`` (where each token came from) and, in a chunk,
``step`` (the target pass behind it). The request bodies are in ``draftwise.api.schemas``.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, Field, model_serializer


class PromptTokensDetails(BaseModel):
    cached_tokens: int = Field(..., description="prompt tokens the slot held already, not prefilled again")


class CompletionTokensDetails(BaseModel):
    accepted_prediction_tokens: int = Field(
        ..., description="tokens of the prediction that were drafted, accepted and are in the completion"
    )
    rejected_prediction_tokens: int = Field(
        ...,
        description="tokens of the prediction that were drafted and are not in the completion (verified and "
        "thrown away: they cost compute, as OpenAI bills them)",
    )


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails | None = None
    completion_tokens_details: CompletionTokensDetails | None = Field(
        None, description="with a prediction only: how much of it the completion used"
    )


class RejectedDraft(BaseModel):
    id: int
    draft_prob: float
    target_prob: float


class TokenProvenance(BaseModel):
    id: int
    text: str
    source: Literal["accepted", "corrected", "bonus"]
    draft_prob: float | None = Field(None, description="q(token) for an accepted draft token")
    target_prob: float | None = Field(None, description="p(token) for an accepted draft token")
    rejected: RejectedDraft | None = Field(None, description="the draft token a correction replaced")


class DraftedToken(BaseModel):
    id: int
    text: str
    draft_prob: float = Field(..., description="q(token) under the drafter (1 for a deterministic drafter)")
    target_prob: float | None = Field(None, description="p(token) under the target at that position")


class WeighedArm(BaseModel):
    """A way to run a step that the draft policy weighed, with what it expected of it."""

    source: str = Field(..., description="the drafter's source (model, ngram, ...) or plain")
    k: int = Field(..., description="draft length")
    tokens_per_second: float = Field(..., description="expected tokens per second of the rounds the step runs in")


class StepInfo(BaseModel):
    """One target pass, streamed with provenance: what was drafted, what was kept, what it cost."""

    index: int = Field(..., description="0-based target pass")
    k: int = Field(..., description="draft length the k policy asked for")
    source: str | None = Field(None, description="the drafter's source that proposed: model, ngram; null = none")
    proposed: list[DraftedToken] = Field(
        ..., description="every proposed token in order; the first n_accepted were kept"
    )
    n_accepted: int
    prefill_seconds: float
    draft_seconds: float
    verify_seconds: float
    step_seconds: float
    arms: list[WeighedArm] = Field(
        [], description="why this block: the arms the cost policy weighed, the one taken first; [] for other policies"
    )


_STATS_DOC = (
    "speculation statistics of this generation: drafter, acceptance_rate, mean_accepted_length, "
    "target_passes, proposed, accepted, acceptance_by_position, timings"
)


class CompletionChoice(BaseModel):
    index: int = 0
    text: str
    finish_reason: str | None
    logprobs: None = None


class _Envelope(BaseModel):
    """What every completion response and stream chunk carries besides its choices."""

    id: str
    created: int
    model: str
    system_fingerprint: str = Field(
        ...,
        description="the serving configuration: draftwise's version and the loaded models (weights, format, "
        "threads); it changes when they do, as OpenAI's changes with its backend",
    )
    usage: Usage | None = None
    speculative: dict[str, Any] | None = Field(None, description=_STATS_DOC)
    provenance: list[TokenProvenance] | None = None


class _Chunk(_Envelope):
    step: StepInfo | None = Field(None, description="the target pass of this chunk (with provenance)")


class CompletionResponse(_Envelope):
    object: Literal["text_completion"] = "text_completion"
    choices: list[CompletionChoice]


class FunctionCall(BaseModel):
    name: str
    arguments: str = Field(..., description="the arguments, as a JSON object in a string")


class ToolCall(BaseModel):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None
    tool_calls: list[ToolCall] | None = None

    @model_serializer(mode="wrap")
    def _drop_no_calls(self, handler: Any) -> dict[str, Any]:
        # As at OpenAI: an answer without tool calls has no tool_calls key.
        out: dict[str, Any] = handler(self)
        if out.get("tool_calls") is None:
            out.pop("tool_calls", None)
        return out


class ChatChoice(BaseModel):
    index: int = 0
    message: AssistantMessage
    finish_reason: str | None
    logprobs: None = None


class ChatCompletionResponse(_Envelope):
    object: Literal["chat.completion"] = "chat.completion"
    choices: list[ChatChoice]


class FunctionCallDelta(BaseModel):
    name: str | None = Field(None, description="in a call's first chunk")
    arguments: str = Field("", description="the next piece of the arguments' JSON text")


class ToolCallDelta(BaseModel):
    """A piece of a tool call in a stream: ``index`` says which of the answer's calls; its first
    chunk has the call's ``id``, ``type`` and ``function.name``, the next ones more arguments."""

    index: int
    id: str | None = None
    type: Literal["function"] | None = None
    function: FunctionCallDelta

    @model_serializer(mode="wrap")
    def _drop_absent(self, handler: Any) -> dict[str, Any]:
        out: dict[str, Any] = handler(self)
        return {k: v for k, v in out.items() if v is not None}


class ChatDelta(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None
    tool_calls: list[ToolCallDelta] | None = None

    @model_serializer(mode="wrap")
    def _drop_absent(self, handler: Any) -> dict[str, Any]:
        # OpenAI deltas carry only the keys that changed.
        return {k: v for k, v in handler(self).items() if v is not None}


class ChatChunkChoice(BaseModel):
    index: int = 0
    delta: ChatDelta
    finish_reason: str | None = None
    logprobs: None = None


class ChatCompletionChunk(_Chunk):
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    choices: list[ChatChunkChoice]


class CompletionChunk(_Chunk):
    object: Literal["text_completion"] = "text_completion"
    choices: list[CompletionChoice]


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "draftwise"


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class ErrorBody(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    error: ErrorBody
