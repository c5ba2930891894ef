"""From OpenAI requests to the engine's inputs: prompt token ids and a ``GenerationConfig``.

Every value is validated by the engine's own config classes; their complaints come back to
the client as a 400 that names the field.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, TypeGuard, cast

from pydantic import BaseModel, ValidationError

from draftwise.api.errors import APIError, invalid, validation_error
from draftwise.api.schemas import (
    ChatCompletionRequest,
    ChatMessage,
    CompletionRequest,
    GenerationRequest,
    NamedToolChoice,
)
from draftwise.api.settings import ServerSettings
from draftwise.api.tools import TOOL_CLOSE, TOOL_OPEN, tool_call_grammar
from draftwise.chat import PromptError, PromptTooLong, encode_messages, encode_raw
from draftwise.config import (
    NEEDS_DRAFT_MODEL,
    DraftConfig,
    DrafterName,
    GenerationConfig,
    GrammarSpec,
    SamplingConfig,
)
from draftwise.constraint import GrammarDeadEnd, GrammarError
from draftwise.grammar import Grammars
from draftwise.lm import Tokenizer


@dataclass(frozen=True)
class Plan:
    """What the engine will be asked to do for one request."""

    prompt: list[int]
    config: GenerationConfig
    drafter: DrafterName
    provenance: bool
    cache_prompt: bool = True
    tools: bool = False  # the answer may call tools: its text is read for calls


def encode_completion(
    request: CompletionRequest, tokenizer: Tokenizer, vocab_size: int, parse_special: bool, limit: int | None
) -> list[int]:
    """A completion's prompt ids: its text as the server's ``parse_special`` says, or its ids.
    ``PromptTooLong`` when the text cannot fit in ``limit`` tokens, found before tokenizing."""
    if isinstance(request.prompt, str):
        return encode_raw(tokenizer, request.prompt, parse_special, limit)
    ids = cast(list[int], request.prompt)  # the request's validator made a list of one text its text
    if max(ids) >= vocab_size:
        raise invalid(f"token id {max(ids)} is outside the vocabulary (size {vocab_size})", param="prompt")
    return list(ids)


def _fallback_chat(messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None) -> str:
    """A plain transcript for tokenizers without a chat template (base and test models)."""
    listed = "".join(f"tool: {json.dumps(tool['function'])}\n" for tool in tools or [])
    turns = "".join(f"{m['role']}: {m['content']}{_fallback_calls(m)}\n" for m in messages)
    return listed + turns + "assistant:"


def _fallback_calls(message: dict[str, Any]) -> str:
    calls = message.get("tool_calls") or []
    return "".join(f"{TOOL_OPEN}\n{json.dumps(call['function'])}\n{TOOL_CLOSE}" for call in calls)


def _template_message(message: ChatMessage) -> dict[str, Any]:
    """A message as chat templates read it: Hugging Face's convention, where a tool call's
    arguments are an object (OpenAI sends them as JSON text)."""
    # Older templates know no "developer" role; it is OpenAI's new name for "system".
    out: dict[str, Any] = {"role": "system" if message.role == "developer" else message.role, "content": message.text}
    if message.tool_calls:
        out["tool_calls"] = [
            {
                "id": call.id,
                "type": "function",
                "function": {"name": call.function.name, "arguments": json.loads(call.function.arguments)},
            }
            for call in message.tool_calls
        ]
    if message.tool_call_id is not None:
        out["tool_call_id"] = message.tool_call_id
    return out


def _template_tools(request: ChatCompletionRequest) -> list[dict[str, Any]] | None:
    if not request.calls_tools:
        return None
    return [tool.model_dump(exclude_none=True) for tool in request.tools or []]


def encode_chat(request: ChatCompletionRequest, tokenizer: Tokenizer, limit: int | None = None) -> list[int]:
    """A conversation's ids through the model's chat template, with the tools it may call;
    the messages are text (no string in them becomes a control token), only the template
    writes markup. ``PromptTooLong`` when it cannot fit in ``limit`` tokens, found before
    tokenizing."""
    from jinja2 import TemplateError

    messages = [_template_message(m) for m in request.messages]
    tools = _template_tools(request)
    if not getattr(tokenizer, "chat_template", None):
        return list(tokenizer.encode(_fallback_chat(messages, tools), parse_special=False))
    try:
        return encode_messages(tokenizer, messages, limit, tools)
    except PromptTooLong:
        raise
    except (TemplateError, PromptError) as exc:
        raise invalid(f"the model's chat template rejected the messages: {exc}", param="messages") from exc


def context_exceeded(request: GenerationRequest, message: str) -> APIError:
    """The 400 for a request that cannot fit the model's context."""
    param = "messages" if isinstance(request, ChatCompletionRequest) else "prompt"
    return APIError(400, message, param=param, code="context_length_exceeded")


def prompt_bytes(request: GenerationRequest) -> int:
    """The UTF-8 size of the text a request asks to tokenize (0 for token ids)."""
    if isinstance(request, ChatCompletionRequest):
        return sum(len(m.text.encode("utf-8")) for m in request.messages)
    prompt = getattr(request, "prompt", None)
    return len(prompt.encode("utf-8")) if isinstance(prompt, str) else 0


def check_prediction(
    request: GenerationRequest, tokenizer: Tokenizer, prompt_tokens: int, limit: int | None, token_bytes_max: int
) -> list[int] | None:
    """Refuse a prediction that cannot fit in what the context leaves after the prompt (an
    answer that followed it would run out of room): by its size in bytes first, before
    tokenizing, then by its tokens. Returns its ids where it read them (as
    ``encode_prediction`` does), for the generation, so that it is tokenized once; None where
    it did not (no prediction, or no limit to check it against)."""
    if request.prediction is None or limit is None:
        return None
    text, room = request.prediction.text, limit - prompt_tokens
    size = len(text.encode("utf-8"))
    ids = (
        list(tokenizer.encode(text, add_special_tokens=False, parse_special=False))
        if size <= room * token_bytes_max
        else None
    )
    tokens = None if ids is None else len(ids)
    if tokens is None or tokens > room:
        held = f"{tokens} tokens" if tokens is not None else f"{size} bytes, more than {room} tokens can hold"
        raise APIError(
            400,
            f"the prediction holds {held}; this model's maximum context length is {limit} tokens and the prompt "
            f"takes {prompt_tokens}, leaving {room} for the completion",
            param="prediction",
            code="context_length_exceeded",
        )
    return ids


def offers_tools(request: GenerationRequest) -> TypeGuard[ChatCompletionRequest]:
    """Whether the answer may call tools (a chat request with tools, ``tool_choice`` not none)."""
    return isinstance(request, ChatCompletionRequest) and request.calls_tools


def grammar_spec(request: GenerationRequest) -> GrammarSpec | None:
    """The grammar a request's ``response_format`` or tools ask for; None for free text."""
    if offers_tools(request):
        choice = request.tool_choice
        required = choice == "required" or isinstance(choice, NamedToolChoice)
        return tool_call_grammar(_functions(request), request.parallel_tool_calls, required=required)
    fmt = request.response_format
    if fmt is None or fmt.type == "text":
        return None
    if fmt.type == "json_object":
        return GrammarSpec(kind="json_object")
    assert fmt.json_schema is not None  # the schema's own validator
    return GrammarSpec(kind="json_schema", text=json.dumps(fmt.json_schema.json_schema))


def grammar_param(tools: bool) -> str:
    """The request field its grammar comes from: ``tools`` where the answer may call them
    (``offers_tools``), else ``response_format``."""
    return "tools" if tools else "response_format"


def grammar_failed(exc: GrammarError, param: str) -> APIError:
    """The answer to a grammar that failed, at the check or mid-answer (``GrammarDeadEnd``):
    a 400 naming the request's field, in one line. Mid-answer too, since it is the request's
    own schema that fails (sent again, it fails again), not the server."""
    code = "grammar_dead_end" if isinstance(exc, GrammarDeadEnd) else "invalid_schema"
    return APIError(exc.status, str(exc), param=param, code=code)


def check_grammar(request: GenerationRequest, grammars: Grammars | None) -> None:
    """Refuse a schema that cannot be compiled, or that llguidance could not follow from its
    start (``Grammars.check``), in one line naming what is wrong."""
    spec = grammar_spec(request)
    if spec is None:
        return
    param = grammar_param(offers_tools(request))
    if grammars is None:
        raise APIError(400, "this server's model has no tokenizer for structured output", param=param)
    try:
        for name, function in _tool_schemas(request):
            _check_function(grammars, name, function)
        grammars.check(spec)
    except GrammarError as exc:
        raise grammar_failed(exc, param) from exc


def _check_function(grammars: Grammars, name: str, spec: GrammarSpec) -> None:
    try:
        grammars.check(spec)
    except GrammarError as exc:
        raise GrammarError(f"function {name!r}: {exc}") from exc


def _functions(request: ChatCompletionRequest) -> list[tuple[str, dict[str, Any]]]:
    """(name, parameters schema) of each function the answer may call: the one ``tool_choice``
    names, else every tool."""
    choice = request.tool_choice
    named = choice.function.name if isinstance(choice, NamedToolChoice) else None
    return [(t.function.name, t.function.parameters) for t in request.tools or [] if named in (None, t.function.name)]


def _tool_schemas(request: GenerationRequest) -> list[tuple[str, GrammarSpec]]:
    """Each callable function's parameters as a JSON schema of its own. The check of the whole
    tool-call grammar walks only as far as the text is forced: with several functions, to the
    choice of name. A function's arguments that llguidance cannot follow (too many optional
    properties) would show only once the model picked it; checked alone, each is walked
    from its own start."""
    if not offers_tools(request):
        return []
    return [(name, GrammarSpec(kind="json_schema", text=json.dumps(schema))) for name, schema in _functions(request)]


def _validated(cls: type[BaseModel], data: dict[str, Any], prefix: tuple[str, ...]) -> Any:
    try:
        return cls.model_validate(data)
    except ValidationError as exc:
        errors = [{**e, "loc": prefix + tuple(e.get("loc", ()))} for e in exc.errors()]
        raise validation_error(errors) from exc


def plan(
    request: GenerationRequest, prompt: list[int], settings: ServerSettings, context_limit: int | None, has_draft: bool
) -> Plan:
    """Check the request against the server and build the engine's config."""
    if not prompt:
        raise invalid("the prompt is empty", param="prompt")
    defaults = settings.generation
    max_new = request.max_new_tokens
    if context_limit is not None:
        room = context_limit - len(prompt)
        if room < 1 or (max_new is not None and max_new > room):
            asked = max_new if max_new is not None else 1
            raise context_exceeded(
                request,
                f"this model's maximum context length is {context_limit} tokens, but the request needs "
                f"{len(prompt) + asked} ({len(prompt)} in the prompt, {asked} for the completion)",
            )
        if max_new is None:
            max_new = min(defaults.max_new_tokens, room)
    max_new = max_new or defaults.max_new_tokens

    options = request.speculative
    drafter: DrafterName = (options.drafter if options is not None else None) or settings.default_drafter
    if drafter in NEEDS_DRAFT_MODEL and not has_draft:
        raise invalid("this server has no draft model; use drafter 'ngram' or 'off'", param="speculative.drafter")
    not_knobs = {"drafter", "provenance", "cache_prompt"}
    overrides = {} if options is None else options.model_dump(exclude=not_knobs, exclude_none=True)
    draft = _validated(DraftConfig, {**defaults.draft.model_dump(), **overrides}, ("speculative",))
    sampling = _validated(
        SamplingConfig,
        {
            **defaults.sampling.model_dump(),
            "temperature": request.temperature,
            "top_p": request.top_p,
            "seed": request.seed,
        },
        (),
    )
    config = _validated(
        GenerationConfig,
        {
            **defaults.model_dump(),
            "max_new_tokens": max_new,
            "stop": tuple(request.stop or ()),
            "sampling": sampling,
            "draft": draft,
            "prediction": request.prediction.text or None if request.prediction is not None else None,
            "grammar": grammar_spec(request),
        },
        (),
    )
    return Plan(
        prompt=prompt,
        config=config,
        drafter=drafter,
        provenance=options is not None and options.provenance,
        cache_prompt=options is None or options.cache_prompt,
        tools=offers_tools(request),
    )
