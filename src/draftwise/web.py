"""HTTP guards shared by draftwise's two servers, the OpenAI-compatible API and the remote
verifier: a request-body size limit, the reading of a JSON body, an optional bearer key, and
the OpenAPI entries of the errors they send. Each server passes in how it shapes an error, so clients keep seeing that
server's own error format.
"""

from __future__ import annotations

import codecs
import json
import re
import secrets
from collections.abc import Awaitable, Callable
from typing import Any

from fastapi import Depends, FastAPI
from fastapi.exceptions import RequestValidationError
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from pydantic import BaseModel, SecretStr
from starlette.responses import Response

from draftwise.errors import DraftwiseError

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


# ---- JSON request bodies --------------------------------------------------------------------
#
# Read the same way by both servers (the verifier's POST /v1/sessions, the API's generation routes):
# a body that cannot be read as a JSON object is a 400 whose one line says why.

# Levels of arrays and objects a body may nest. Real requests nest a few dozen at most (a JSON
# schema's properties inside properties); far below Python's recursion limit, which a deeper
# body would otherwise hit in the parser or in any code that walks the value later.
MAX_JSON_DEPTH = 128
_SPACE = re.compile(r"[ \t\n\r]*")
# What JSON calls the values Python's parser gives.
_KINDS = {list: "an array", str: "a string", int: "a number", float: "a number", bool: "a boolean", type(None): "null"}


class JsonBodyError(DraftwiseError, ValueError):
    """A request body that is not a JSON object this server reads; ``field``: the top-level
    member where the problem is, when there is one."""

    def __init__(self, problem: str, field: str | None = None) -> None:
        super().__init__(problem if field is None else f"{problem} (in {field!r})")
        self.field = field


class _Constant(ValueError):
    """NaN or Infinity, which Python's parser takes and JSON does not have."""


def _refuse_constant(name: str) -> Any:
    raise _Constant(name)


def check_json_type(content_type: str | None) -> None:
    """Refuse a body not sent as JSON (FastAPI's rule: ``application/json`` or ``application/*+json``).
    A browser page may send ``text/plain`` to any server without asking first; a JSON type it
    may not, so a local server that insists on one cannot be driven by other sites' pages."""
    media = (content_type or "").split(";", 1)[0].strip().lower()
    if media == "application/json" or (media.startswith("application/") and media.endswith("+json")):
        return
    got = repr(media) if media else "none"
    raise JsonBodyError(f"the body must be JSON sent with Content-Type: application/json (got {got})")


def _skip(text: str, at: int) -> int:
    """Where the JSON white space at ``at`` in ``text`` ends."""
    space = _SPACE.match(text, at)
    return at if space is None else space.end()


def _member(text: str, decoder: json.JSONDecoder, position: int | None = None) -> str | None:
    """The top-level key of the object ``text`` whose value ``decoder`` fails on or, given a
    ``position``, whose value holds that character; None where no member does."""
    at = _skip(text, 0)
    if not text.startswith("{", at):
        return None
    while True:
        try:
            key, at = decoder.raw_decode(text, _skip(text, at + 1))  # past the "{" or ","
        except (ValueError, RecursionError):
            return None
        colon = _skip(text, at)
        if not isinstance(key, str) or not text.startswith(":", colon):
            return None
        start = _skip(text, colon + 1)
        try:
            _, at = decoder.raw_decode(text, start)
        except (ValueError, RecursionError):
            return key if position is None else None
        if position is not None and start <= position < at:
            return key
        at = _skip(text, at)
        if not text.startswith(",", at):
            return None


def _nests_deeper(value: Any, limit: int) -> bool:
    """Whether ``value`` nests arrays and objects more than ``limit`` levels deep (breadth
    first: no recursion, whatever the depth)."""
    level = [value] if isinstance(value, (dict, list)) else []
    depth = 0
    while level:
        depth += 1
        if depth > limit:
            return True
        level = [
            child
            for item in level
            for child in (item.values() if isinstance(item, dict) else item)
            if isinstance(child, (dict, list))
        ]
    return False


def _utf8(body: bytes) -> str:
    """The body as text: UTF-8, a leading byte-order mark dropped (as Python's parser does)."""
    data = body.removeprefix(codecs.BOM_UTF8)
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        # Where the bad byte is, and in which member: the text around it decodes as it is.
        text = data.decode("utf-8", "surrogateescape")
        position = len(data[: exc.start].decode("utf-8"))
        offset = exc.start + len(body) - len(data)
        problem = f"the body is not UTF-8 text: byte 0x{data[exc.start]:02x} at offset {offset}"
        raise JsonBodyError(problem, _member(text, json.JSONDecoder(), position)) from None


def read_json_body(body: bytes, content_type: str | None) -> dict[str, Any]:
    """A request body as the JSON object it must be, or ``JsonBodyError`` saying why not:
    another content type, empty, not UTF-8, not JSON (NaN and Infinity included), nested
    more than ``MAX_JSON_DEPTH`` levels, or a JSON value other than an object."""
    check_json_type(content_type)
    if not body.strip():
        raise JsonBodyError("the body is empty: send a JSON object")
    text = _utf8(body)
    decoder = json.JSONDecoder(parse_constant=_refuse_constant)
    too_deep = f"the body nests arrays and objects deeper than {MAX_JSON_DEPTH} levels"
    try:
        value = decoder.decode(text)
    except json.JSONDecodeError as bad:
        raise JsonBodyError(f"the body is not valid JSON: {bad.msg} at line {bad.lineno} column {bad.colno}") from None
    except _Constant as bad:
        raise JsonBodyError(f"the body is not valid JSON: {bad} is not a JSON number", _member(text, decoder)) from None
    except RecursionError:
        raise JsonBodyError(too_deep, _member(text, decoder)) from None
    # Only a body with that many brackets can nest that deep: most (a long prompt) skip the walk.
    if body.count(b"[") + body.count(b"{") > MAX_JSON_DEPTH and _nests_deeper(value, MAX_JSON_DEPTH):
        field = None
        if isinstance(value, dict):
            field = next((key for key, v in value.items() if _nests_deeper(v, MAX_JSON_DEPTH - 1)), None)
        raise JsonBodyError(too_deep, field)
    if not isinstance(value, dict):
        raise JsonBodyError(f"the body must be a JSON object, not {_KINDS.get(type(value), 'another value')}")
    return value
