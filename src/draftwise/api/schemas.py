"""OpenAI-shaped request and response bodies.

Requests reject unknown fields, as OpenAI does, so a misspelt option is a 400 rather than
silently ignored. The draftwise extension ``speculative`` takes the drafting knobs of
``DraftConfig`` (its fields are copied from there, not restated) plus the drafter choice and
the provenance switch.
"""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal, cast

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    Strict,
    ValidationInfo,
    create_model,
    field_validator,
    model_serializer,
    model_validator,
)

from draftwise.chat import encodable
from draftwise.config import DraftConfig, DrafterName

# Numbers as OpenAI takes them: a JSON number, never a string ("8") or a boolean (true), which
# pydantic's lax mode would turn into 8 and 1. A strict float still takes an integer (temperature: 1).
Int = Annotated[int, Strict()]
Float = Annotated[float, Strict()]
# Booleans likewise: true or false, never "yes", "false" or 0, which lax mode would read.
Bool = Annotated[bool, Strict()]


def _strict(annotation: Any) -> Any:
    """``annotation`` with strict numbers and booleans, if it is one (else unchanged)."""
    return {int: Int, float: Float, bool: Bool}.get(annotation, annotation)


class _Request(BaseModel):
    model_config = ConfigDict(extra="forbid")


class _SpeculativeBase(_Request):
    drafter: DrafterName | None = Field(
        None,
        description="model, ngram, hybrid (lookup where the context repeats, "
        "the model elsewhere) or off (plain decoding); None = server default",
    )
    provenance: Bool = Field(
        False, description="add each token's origin (accepted draft, correction, bonus) and probabilities to the output"
    )
    cache_prompt: Bool = Field(
        True,
        description="reuse what the slot still holds of this prompt's start from its last request (a system "
        "prompt, earlier chat turns); false: prefill the whole prompt, e.g. to compare two runs' timings",
    )


# Every DraftConfig knob, optional here: what a request leaves out comes from the server's defaults.
_OPTIONAL_KNOBS: dict[str, Any] = {
    name: (_strict(field.annotation) | None, Field(None, description=field.description))
    for name, field in DraftConfig.model_fields.items()
}
SpeculativeOptions = create_model(
    "SpeculativeOptions",
    __base__=_SpeculativeBase,
    __doc__="Per-request speculation settings (a draftwise extension of the OpenAI API).",
    **_OPTIONAL_KNOBS,
)


class StreamOptions(_Request):
    include_usage: Bool = Field(False, description="send a last chunk with usage and no choices")


class TextPart(_Request):
    type: Literal["text"]
    text: str


class Prediction(_Request):
    """OpenAI's Predicted Outputs: text the answer is expected to follow for long stretches
    (a file sent back with a small edit). draftwise drafts from it; a wrong one costs rows,
    never the output."""

    type: Literal["content"]
    content: str | list[TextPart]

    @field_validator("content")
    @classmethod
    def _check_content(cls, value: str | list[TextPart]) -> str | list[TextPart]:
        encodable(value if isinstance(value, str) else "".join(part.text for part in value))
        return value

    @property
    def text(self) -> str:
        return self.content if isinstance(self.content, str) else "".join(p.text for p in self.content)


class JsonSchemaFormat(_Request):
    """OpenAI's ``response_format.json_schema``: the schema the answer follows."""

    model_config = ConfigDict(extra="forbid", populate_by_name=True)

    name: str = Field(..., min_length=1, max_length=64, description="the schema's name")
    description: str | None = None
    json_schema: dict[str, Any] = Field(
        default_factory=dict, alias="schema", description="a JSON schema; {} = any JSON value"
    )
    strict: Bool | None = Field(None, description="accepted; the answer always follows the schema")


class ResponseFormat(_Request):
    """Structured output: plain text, any JSON object, or JSON that follows a schema."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    @model_validator(mode="after")
    def _check_schema(self) -> ResponseFormat:
        if (self.type == "json_schema") != (self.json_schema is not None):
            raise ValueError("json_schema is required with type json_schema, and only then")
        return self


class GenerationRequest(_Request):
    model: str = Field(..., description="the served model id (see GET /v1/models)")
    max_tokens: Int | None = Field(None, ge=1, description="tokens to generate at most; None = server default")
    temperature: Float = Field(1.0, ge=0.0, le=2.0, description="0 = greedy")
    top_p: Float = Field(1.0, gt=0.0, le=1.0, description="nucleus mass to keep")
    stop: str | list[str] | None = Field(None, description="up to 4 strings; the output ends before the first one")
    # torch generators take 64-bit seeds, and the engine also seeds the drafter with seed + 1.
    seed: Int | None = Field(None, ge=0, le=2**63 - 2, description="seed for reproducible sampling")
    n: Literal[1] = Field(1, description="only one choice per request is supported")
    stream: Bool = False
    stream_options: StreamOptions | None = None
    presence_penalty: Float = Field(0.0, description="only 0 is supported")
    frequency_penalty: Float = Field(0.0, description="only 0 is supported")
    user: str | None = Field(None, description="ignored")
    logprobs: bool | int | None = Field(None, description="not supported: leave out, null, false or 0")
    speculative: SpeculativeOptions | None = None
    prediction: Prediction | None = Field(
        None, description="the expected output (OpenAI's Predicted Outputs), drafted from where the answer follows it"
    )
    response_format: ResponseFormat | None = Field(
        None, description="structured output: the answer follows a JSON schema, or is a JSON object"
    )

    @field_validator("stop")
    @classmethod
    def _check_stop(cls, value: str | list[str] | None) -> list[str]:
        stops = [value] if isinstance(value, str) else list(value or [])
        if len(stops) > 4:
            raise ValueError("at most 4 stop sequences are allowed")
        if any(s == "" for s in stops):
            raise ValueError("stop sequences must not be empty")
        for stop in stops:
            encodable(stop)
        return stops

    @field_validator("n", mode="before")
    @classmethod
    def _check_n(cls, value: Any) -> Any:
        # A Literal takes anything equal to 1 (true, 1.0); n is an integer.
        if isinstance(value, bool) or not isinstance(value, int):
            raise ValueError("Input should be 1")
        return value

    @field_validator("logprobs")
    @classmethod
    def _check_logprobs(cls, value: bool | int | None) -> None:
        if value:
            raise ValueError("logprobs are not supported; per-token probabilities come with speculative.provenance")
        return None

    @field_validator("presence_penalty", "frequency_penalty")
    @classmethod
    def _check_penalty(cls, value: float) -> float:
        if value != 0.0:
            raise ValueError("penalties are not supported (they would change the target distribution); use 0")
        return value

    @property
    def max_new_tokens(self) -> int | None:
        return self.max_tokens


class CompletionRequest(GenerationRequest):
    prompt: str | list[Int] | list[str] = Field(
        ..., description="the prompt text, or its token ids (a list of one text is accepted too)"
    )

    @field_validator("prompt", mode="before")
    @classmethod
    def _check_prompt_list(cls, value: Any) -> Any:
        # Said once here: the union would complain about every element against every member.
        if isinstance(value, list):
            ids = all(isinstance(v, int) and not isinstance(v, bool) for v in value)
            if not ids and not all(isinstance(v, str) for v in value):
                raise ValueError("a list prompt holds token ids (integers, not booleans) or one text")
        return value

    @field_validator("prompt")
    @classmethod
    def _check_prompt(cls, value: str | list[int] | list[str]) -> str | list[int]:
        if isinstance(value, list) and value and all(isinstance(v, str) for v in value):
            if len(value) != 1:
                raise ValueError("batched prompts are not supported: send one prompt per request")
            value = str(value[0])
        if len(value) == 0:
            raise ValueError("the prompt is empty")
        if isinstance(value, str):
            return encodable(value)
        ids = cast(list[int], value)  # a list of texts is one text by now
        if min(ids) < 0:
            raise ValueError("token ids must not be negative")
        return ids


FUNCTION_NAME = r"^[A-Za-z0-9_-]{1,64}$"


class FunctionDef(_Request):
    name: str = Field(..., pattern=FUNCTION_NAME, description="the function's name")
    description: str | None = None
    parameters: dict[str, Any] = Field(
        default_factory=lambda: {"type": "object", "properties": {}},
        description="a JSON schema of the arguments object",
    )
    strict: Bool | None = Field(None, description="accepted; the arguments always follow the schema")


class Tool(_Request):
    type: Literal["function"]
    function: FunctionDef


class NamedFunction(_Request):
    name: str


class NamedToolChoice(_Request):
    type: Literal["function"]
    function: NamedFunction


class CalledFunction(_Request):
    name: str
    arguments: str = Field(..., description="the arguments, as a JSON object in a string")

    @field_validator("arguments")
    @classmethod
    def _check_arguments(cls, value: str) -> str:
        try:
            parsed = json.loads(value)
        except ValueError:
            raise ValueError("arguments must be a JSON object in a string") from None
        if not isinstance(parsed, dict):
            raise ValueError("arguments must be a JSON object in a string")
        return value


class MessageToolCall(_Request):
    """A tool call of an earlier assistant turn, sent back as part of the conversation."""

    id: str
    type: Literal["function"]
    function: CalledFunction


class ChatMessage(_Request):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    name: str | None = None
    tool_calls: list[MessageToolCall] | None = Field(None, description="an assistant turn's tool calls")
    tool_call_id: str | None = Field(None, validate_default=True, description="a tool message: the call it answers")
    # After the fields its check reads; checked when left out too (only a call may leave it out).
    content: str | list[TextPart] | None = Field(None, validate_default=True)

    @field_validator("tool_calls")
    @classmethod
    def _check_calls(cls, calls: list[MessageToolCall] | None, info: ValidationInfo) -> list[MessageToolCall] | None:
        if calls and info.data.get("role") != "assistant":
            raise ValueError("only an assistant turn has tool_calls")
        return calls

    @field_validator("tool_call_id")
    @classmethod
    def _check_call_id(cls, call_id: str | None, info: ValidationInfo) -> str | None:
        if (info.data.get("role") == "tool") != (call_id is not None):
            raise ValueError("tool_call_id goes with role tool, and role tool needs it")
        return call_id

    @field_validator("content")
    @classmethod
    def _check_content(cls, value: str | list[TextPart] | None, info: ValidationInfo) -> str | list[TextPart] | None:
        if value is None and not (info.data.get("role") == "assistant" and info.data.get("tool_calls")):
            raise ValueError("Field required (only an assistant turn with tool_calls may leave content out)")
        for text in [value] if isinstance(value, str) else [part.text for part in value or []]:
            encodable(text)  # what reaches the tokenizer must be valid Unicode
        return value

    @property
    def text(self) -> str:
        if self.content is None:
            return ""
        return self.content if isinstance(self.content, str) else "".join(p.text for p in self.content)


# Most messages a request may hold. Each message runs checks of its own while the body is
# validated, on the event loop every stream's chunks go through: a body under the size limit
# could hold a few hundred thousand one-character messages and pause them all. A list this
# long is refused before its items are read, and no real conversation comes near it.
MAX_MESSAGES = 2048


class ChatCompletionRequest(GenerationRequest):
    messages: list[ChatMessage] = Field(
        ..., min_length=1, max_length=MAX_MESSAGES, description="the conversation so far"
    )
    max_completion_tokens: Int | None = Field(None, ge=1, description="newer name of max_tokens; wins over it")
    tools: list[Tool] | None = Field(None, max_length=128, description="functions the model may call")
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = Field(
        None, description="none, auto (the default with tools), required, or one function by name"
    )
    parallel_tool_calls: Bool = Field(
        False,
        description="whether an answer may hold several tool calls; by default one, after which the answer ends "
        "(as llama-server does: a small model asked for one action otherwise goes on inventing calls)",
    )

    @field_validator("tools")
    @classmethod
    def _check_tools(cls, tools: list[Tool] | None, info: ValidationInfo) -> list[Tool] | None:
        names = [tool.function.name for tool in tools or []]
        if len(set(names)) != len(names):
            raise ValueError("two functions have the same name")
        fmt = info.data.get("response_format")
        if names and fmt is not None and fmt.type != "text":
            raise ValueError("tools and a JSON response_format together are not supported: use one of them")
        return tools

    @field_validator("tool_choice")
    @classmethod
    def _check_choice(cls, choice: Any, info: ValidationInfo) -> Any:
        names = [tool.function.name for tool in info.data.get("tools") or []]
        if isinstance(choice, NamedToolChoice) and choice.function.name not in names:
            raise ValueError(f"no tool is named {choice.function.name!r}")
        if choice == "required" and not names:
            raise ValueError("required needs tools")
        return choice

    @property
    def calls_tools(self) -> bool:
        """Whether the model is offered tools (tool_choice none takes them away)."""
        return bool(self.tools) and self.tool_choice != "none"

    @property
    def max_new_tokens(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens


# ---- responses ------------------------------------------------------------------------------


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
