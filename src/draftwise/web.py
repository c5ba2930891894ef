"""HTTP guards shared by draftwise's two servers, the OpenAI-compatible API and the remote
verifier: a request-body size limit, an optional bearer key, and the OpenAPI entries of the
errors they send. Each server passes in how it shapes an error, so clients keep seeing that
server's own error format.
"""

from __future__ import annotations

import secrets
from collections.abc import Awaitable, Callable
from typing import Any

from fastapi import Depends, FastAPI
from fastapi.exceptions import RequestValidationError
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from pydantic import BaseModel, SecretStr
from starlette.responses import Response

ErrorResponse = Callable[[int, str], Response]

# What a 401 tells the client to send (RFC 9110, section 11.6.1).
CHALLENGE = {"WWW-Authenticate": "Bearer"}

_HEADERS = {
    401: {
        "WWW-Authenticate": {"description": "`Bearer`: the scheme to authenticate with", "schema": {"type": "string"}}
    },
    429: {"Retry-After": {"description": "seconds to wait before retrying", "schema": {"type": "integer"}}},
}


class BodyLimit:
    """ASGI middleware that refuses oversize bodies before they are read: by their
    Content-Length, and bodies without one (chunked) altogether, so a request can never
    stream in unbounded data."""

    def __init__(self, app: Any, limit: int, error: ErrorResponse) -> None:
        self.app = app
        self.limit = limit
        self.error = error

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] == "http":
            headers = dict(scope["headers"])
            length = headers.get(b"content-length")
            response = None
            if length is None and b"transfer-encoding" in headers:
                response = self.error(411, "send a Content-Length header (chunked request bodies are not accepted)")
            elif length is not None and (not length.isdigit() or int(length) > self.limit):
                response = self.error(
                    413,
                    f"request body of {length.decode(errors='replace')} bytes is over "
                    f"this server's max_body_bytes of {self.limit}",
                )
            if response is not None:
                await response(scope, receive, send)
                return
        await self.app(scope, receive, send)


def malformed_json(exc: RequestValidationError) -> str | None:
    """What is wrong with a body that is not JSON, in words; None if the body parsed.

    FastAPI reports it as a validation error located at ``("body", offset)``, which read as a
    field would be ``1: JSON decode error``; the offset becomes a line and column here, as
    ``json`` itself counts them.
    """
    errors = exc.errors()
    if len(errors) != 1 or errors[0].get("type") != "json_invalid":
        return None
    error = errors[0]
    offset = error["loc"][-1] if isinstance(error["loc"][-1], int) else 0
    text = exc.body if isinstance(exc.body, str) else ""
    line = text.count("\n", 0, offset) + 1
    column = offset - text.rfind("\n", 0, offset)
    problem = error.get("ctx", {}).get("error", "cannot be parsed")
    return f"the body is not valid JSON: {problem} at line {line} column {column}"


def bearer_guard(
    api_key: SecretStr | None, fail: Callable[[str, dict[str, str]], Exception]
) -> Callable[..., Awaitable[None]]:
    """A FastAPI dependency that lets a request through only with ``Authorization: Bearer
    KEY`` (anything goes when ``api_key`` is None); ``fail(message, headers)`` is the exception
    raised, whose response must carry ``headers`` (the ``WWW-Authenticate`` challenge)."""
    bearer = HTTPBearer(auto_error=False, description="the server's --api-key, when it has one")
    key = api_key.get_secret_value().encode() if api_key is not None else None

    # async: a plain def dependency would cost every request a hop to the thread pool.
    async def authorize(credentials: HTTPAuthorizationCredentials | None = Depends(bearer)) -> None:
        if key is None:
            return
        if credentials is None or not secrets.compare_digest(credentials.credentials.encode(), key):
            raise fail("missing or wrong API key: send 'Authorization: Bearer KEY'", CHALLENGE)

    return authorize


def error_responses(body: type[BaseModel], statuses: dict[int, str]) -> dict[int | str, dict[str, Any]]:
    """The OpenAPI ``responses`` of a route's error statuses (status -> description), each with
    the server's error ``body`` and the headers it sends (a 401's challenge, a 429's Retry-After)."""
    responses: dict[int | str, dict[str, Any]] = {}
    for status, text in statuses.items():
        responses[status] = {"model": body, "description": text}
        if status in _HEADERS:
            responses[status]["headers"] = _HEADERS[status]
    return responses


def drop_framework_422(app: FastAPI) -> None:
    """Take FastAPI's own 422 out of ``app``'s OpenAPI document.

    FastAPI documents a 422 with its validation body (``detail``: an array) on every route that
    takes input. Neither server sends that body: each answers invalid input in its own error
    shape, and documents those statuses itself (``error_responses``).
    """
    build = app.openapi

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is not None:
            return app.openapi_schema
        schema = build()  # built once, then cached by FastAPI in app.openapi_schema
        for operations in schema["paths"].values():
            for operation in operations.values():
                responses = operation.get("responses", {})
                ref = responses.get("422", {}).get("content", {}).get("application/json", {}).get("schema", {})
                if ref.get("$ref", "").endswith("/HTTPValidationError"):
                    del responses["422"]
        for name in ("HTTPValidationError", "ValidationError"):
            schema.get("components", {}).get("schemas", {}).pop(name, None)
        return schema

    app.openapi = openapi  # type: ignore[method-assign]
