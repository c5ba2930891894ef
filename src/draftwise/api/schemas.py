"""OpenAI-shaped request bodies: completions and chat completions (messages, tools,
response formats, predictions) and draftwise's ``speculative`` options.

Requests reject unknown fields, as OpenAI does, so a misspelt option is a 400 rather than
silently ignored. The draftwise extension ``speculative`` takes the drafting knobs of
``DraftConfig`` (its fields are copied from there, not restated) plus the drafter choice and
the provenance switch. The response bodies are in ``draftwise.api.responses``.
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
