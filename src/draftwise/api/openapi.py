"""What ``/openapi.json`` says about the API beyond what FastAPI derives from the routes:
every status each route sends (with OpenAI's error body), the events of a stream, and the
one model served. The fuzz test (tests/test_fuzz.py) holds the server to this document.
"""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI
from pydantic import BaseModel
from pydantic.json_schema import models_json_schema

from draftwise.api.responses import ChatCompletionChunk, CompletionChunk, ErrorResponse
from draftwise.web import drop_framework_422, error_responses

GUARDED = {401: "missing or wrong API key (only when the server has one)"}
UNKNOWN_MODEL = {404: "no such model (`model_not_found`): see GET /v1/models"}
_GENERATION_ERRORS = {
    400: "invalid request: the message says what is wrong, `param` names the field",
    **GUARDED,
    **UNKNOWN_MODEL,
    411: "chunked request body: send a Content-Length",
    413: "request body over the server's max_body_bytes",
    429: "every slot is busy and the queue is full: retry after Retry-After seconds",
    500: "a fault in the server, never the request's",
    504: "the request ran past the server's request_timeout",
}
# Models that only appear inside stream events, which FastAPI does not collect on its own.
_EVENT_MODELS: tuple[type[BaseModel], ...] = (CompletionChunk, ChatCompletionChunk, ErrorResponse)


def _ref(model: type[BaseModel]) -> dict[str, str]:
    return {"$ref": f"#/components/schemas/{model.__name__}"}


def _stream_event(chunk: type[BaseModel]) -> dict[str, Any]:
    """One server-sent event of a stream: a chunk, or an error (a fault or timeout after the
    200 went out), as JSON in ``data``; the last event's ``data`` is ``[DONE]``."""
    payload = {"anyOf": [_ref(chunk), _ref(ErrorResponse)]}
    data = {
        "anyOf": [
            {"const": "[DONE]"},
            {"type": "string", "contentMediaType": "application/json", "contentSchema": payload},
        ]
    }
    return {"type": "object", "required": ["data"], "properties": {"data": data}}


def generation_responses(chunk: type[BaseModel]) -> dict[int | str, dict[str, Any]]:
    """The ``responses`` of a generation route whose stream sends ``chunk`` objects."""
    stream = {
        "description": "the completion; with `stream: true`, server-sent events whose `data` is one "
        "chunk object as JSON, the last one `[DONE]`",
        "content": {"text/event-stream": {"schema": _stream_event(chunk)}},
    }
    return {200: stream, **error_responses(ErrorResponse, _GENERATION_ERRORS)}


def complete(app: FastAPI, served_model: str) -> None:
    """Finish ``app``'s document: the stream events' models, the served model as the only
    ``model`` a request may name, and none of FastAPI's 422 (invalid input is a 400 here)."""
    drop_framework_422(app)
    build = app.openapi

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is not None:
            return app.openapi_schema
        schema = build()  # FastAPI caches it in app.openapi_schema
        schemas = schema["components"]["schemas"]
        _, definitions = models_json_schema(
            [(m, "serialization") for m in _EVENT_MODELS], ref_template="#/components/schemas/{model}"
        )
        for name, definition in definitions["$defs"].items():
            schemas.setdefault(name, definition)
        for request in ("CompletionRequest", "ChatCompletionRequest"):
            schemas[request]["properties"]["model"]["enum"] = [served_model]
        return schema

    app.openapi = openapi  # type: ignore[method-assign]
