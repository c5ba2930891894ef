"""The verifier server: the web app over the session service.

The sessions themselves (each a ``LocalTarget`` holding the target's context and KV cache, their
passes batched in one scheduler) are ``draftwise.remote.sessions``; this module puts them behind
HTTP: the routes, every error as JSON, the OpenAPI document, and a lifespan that sweeps idle
sessions away.

Built by ``create_app(settings, lm)`` over a loaded target; all state lives in the app it returns.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable, Mapping
from contextlib import asynccontextmanager, suppress
from typing import Any

import anyio
from fastapi import APIRouter, Depends, FastAPI, Request, Response
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic.json_schema import models_json_schema
from starlette.exceptions import HTTPException as StarletteHTTPException

from draftwise.errors import validation_message
from draftwise.lm import LanguageModel
from draftwise.profile import CostProfile
from draftwise.remote.protocol import (
    GRAMMAR_DEAD_END,
    PROTOCOL_VERSION,
    ErrorDetail,
    Health,
    OpenSession,
    ServerInfo,
    SessionOpened,
)
from draftwise.remote.sessions import VerifierError, VerifierService, parse_open_session
from draftwise.remote.settings import VerifierSettings
from draftwise.web import (
    MAX_JSON_DEPTH,
    BodyLimit,
    bearer_guard,
    drop_framework_422,
    error_responses,
    malformed_json,
)


def _open_from_body(service: VerifierService, body: bytes, content_type: str | None) -> SessionOpened:
    """``POST /v1/sessions`` past the event loop: the body parsed and checked, the session opened."""
    return service.open(parse_open_session(body, service.max_context, content_type))


def _error(
    status: int, message: str, headers: Mapping[str, str] | None = None, code: str | None = None
) -> JSONResponse:
    """An error answer, ``ErrorDetail``'s shape: ``code`` only where there is one."""
    body = {"detail": message} if code is None else {"detail": message, "code": code}
    return JSONResponse(body, status_code=status, headers=headers)


_VERIFY_DOC = (
    "Verify one proposed block. The body is binary (see `draftwise.remote.protocol`): an int32 header "
    "`keep, n_append, k, n_top`, then int32 `append[n_append]`, int32 `tokens[k]`, int32 `q_ids[k*n_top]`, "
    "float32 `q_probs[k*n_top]`. The answer is `int32 n_accepted, int32 next_token, float32 server_seconds, "
    "float32 target_probs[k]`."
)

# The error statuses each route sends, for /openapi.json; every one has an ErrorDetail body.
_AUTH = {
    401: "missing or wrong API key (only when the server has one)",
    500: "a fault in the server, never the request's",
}
_BODY = {411: "chunked request body: send a Content-Length", 413: "request body over max_body_bytes"}
_UNKNOWN = {404: "unknown session (closed, expired or evicted): open a new one"}
_OPEN_ERRORS = {
    **_AUTH,
    **_BODY,
    400: "the body is no JSON object: another Content-Type, empty, not UTF-8, malformed, or nested deeper "
    f"than {MAX_JSON_DEPTH} levels",
    422: "invalid session settings or prompt (the message names the field), a prompt that "
    f"leaves no room under max_context, or (code {GRAMMAR_DEAD_END}) an answer so far, reopened mid-answer, "
    "that its grammar allows no way on from",
}
# The open route reads its body itself (see open_session), so FastAPI does not document it.
_OPEN_BODY = {"$ref": "#/components/schemas/OpenSession"}

_VERIFY_ERRORS = {
    **_AUTH,
    **_BODY,
    **_UNKNOWN,
    409: "keep is past the session's context, or would rewrite the prompt of a session with a grammar",
    422: "a body that breaks the wire format or a limit (max_block, max_context, max_q_entries), "
    f"token ids outside the vocabulary, or (code {GRAMMAR_DEAD_END}) an answer that reached a point "
    "the session's grammar allows no way on from: it cannot be completed",
}


def _install_handlers(app: FastAPI) -> None:
    """Every error as JSON ``{"detail": "..."}``: refusals, invalid input, HTTP errors, and faults."""

    @app.exception_handler(VerifierError)
    async def _verifier_error(request: Request, exc: VerifierError) -> JSONResponse:
        return _error(exc.status, exc.message, exc.headers, exc.code)

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
        broken = malformed_json(exc)  # not JSON at all (400, as for a body that is not UTF-8)
        if broken is not None:
            return _error(400, broken)
        return _error(422, validation_message(list(exc.errors()), every=True))

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        return _error(exc.status_code, str(exc.detail), exc.headers)

    @app.exception_handler(Exception)
    async def _fault(request: Request, exc: Exception) -> JSONResponse:
        # A bug, not the client's doing; still an answer the client can read (uvicorn logs it).
        return _error(500, f"internal error: {type(exc).__name__}: {exc}")


def _session_routes(service: VerifierService, authorize: Callable[..., Any]) -> APIRouter:
    """The key-guarded routes: server info and the session lifecycle."""
    router = APIRouter(dependencies=[Depends(authorize)])

    @router.get("/info", response_model=ServerInfo, tags=["status"], responses=error_responses(ErrorDetail, _AUTH))
    def info() -> ServerInfo:
        """The model, its tokenizer fingerprint and vocabulary size, and the server's limits."""
        return service.info()

    @router.post(
        "/v1/sessions",
        response_model=SessionOpened,
        status_code=201,
        tags=["sessions"],
        responses=error_responses(ErrorDetail, _OPEN_ERRORS),
        openapi_extra={"requestBody": {"required": True, "content": {"application/json": {"schema": _OPEN_BODY}}}},
    )
    async def open_session(request: Request) -> SessionOpened:
        """Open a session: prefill the prompt (all but its last token) into a fresh KV cache."""
        # The body is read here, parsed and checked in the worker thread with the prefill: on the
        # event loop, a large one would hold up every other request (/health included).
        body, content_type = await request.body(), request.headers.get("content-type")
        return await anyio.to_thread.run_sync(_open_from_body, service, body, content_type)

    @router.delete(
        "/v1/sessions/{session_id}",
        status_code=204,
        tags=["sessions"],
        responses=error_responses(ErrorDetail, {**_AUTH, **_UNKNOWN}),
    )
    def close_session(session_id: str) -> Response:
        """Close a session and free its cache."""
        service.close(session_id)
        return Response(status_code=204)

    @router.post(
        "/v1/sessions/{session_id}/verify",
        tags=["sessions"],
        description=_VERIFY_DOC,
        response_class=Response,
        responses={200: {"content": {"application/octet-stream": {}}}, **error_responses(ErrorDetail, _VERIFY_ERRORS)},
        openapi_extra={
            "requestBody": {
                "required": True,
                "content": {"application/octet-stream": {"schema": {"type": "string", "format": "binary"}}},
            }
        },
    )
    async def verify(session_id: str, request: Request) -> Response:
        body = await request.body()
        answer = await anyio.to_thread.run_sync(service.verify, session_id, body)
        return Response(answer, media_type="application/octet-stream")

    return router


def create_app(
    settings: VerifierSettings,
    lm: LanguageModel | None = None,
    *,
    service: VerifierService | None = None,
    profile: CostProfile | None = None,
) -> FastAPI:
    """Build the verifier's web parts over a loaded target ``lm`` (``draftwise.prepare``: loaded
    with ``settings.slots`` slots, see ``serve-verifier``; the sessions take them), or over a ``service`` on
    its own model (a fleet replica's, see ``draftwise.cluster.verifier``); nothing is loaded here.
    ``profile``: the target's timed passes (``prepare_pair(pace=True)``), which size the pieces
    of a long prompt beside other sessions' verifies.

    Open without a key: ``/health`` (for probes) and the API's description (``/docs``,
    ``/redoc``, ``/openapi.json``); every other route needs the key when there is one.
    """
    if service is None:
        if lm is None:
            raise ValueError("create_app needs the loaded target (lm) or a service over it")
        service = VerifierService(settings, lm, profile)

    app = FastAPI(
        title="draftwise verifier",
        description="Remote target for speculative decoding: one round trip per drafted block.",
        version=str(PROTOCOL_VERSION),
        lifespan=_sweeping(service, settings.sweep_interval_s),
    )
    app.state.service = service
    app.add_middleware(BodyLimit, limit=settings.max_body_bytes, error=_error)
    _install_handlers(app)
    app.include_router(_status_routes(service))
    authorize = bearer_guard(settings.api_key, lambda message, headers: VerifierError(401, message, headers))
    app.include_router(_session_routes(service, authorize))
    drop_framework_422(app)
    _document_open_body(app)
    return app


def _document_open_body(app: FastAPI) -> None:
    """Put ``OpenSession`` (and the models it uses) in the OpenAPI document's schemas, for the
    open route's ``_OPEN_BODY`` to point at."""
    build = app.openapi

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is not None:
            return app.openapi_schema
        schema = build()  # built once, then cached by FastAPI in app.openapi_schema
        _, definitions = models_json_schema([(OpenSession, "validation")], ref_template="#/components/schemas/{model}")
        schemas = schema.setdefault("components", {}).setdefault("schemas", {})
        for name, definition in definitions.get("$defs", {}).items():
            schemas.setdefault(name, definition)
        return schema

    app.openapi = openapi  # type: ignore[method-assign]


def _sweeping(service: VerifierService, interval: float) -> Callable[[FastAPI], Any]:
    """The app's lifespan: expire idle sessions every ``interval`` seconds; close all at the end."""

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        async def sweep() -> None:
            # Without this, the sessions of clients that vanished would only expire on the
            # next request; here they go even when no one calls again.
            while True:
                await asyncio.sleep(interval)
                await anyio.to_thread.run_sync(service.expire)

        sweeper = asyncio.create_task(sweep())
        try:
            yield
        finally:
            sweeper.cancel()
            with suppress(asyncio.CancelledError):
                await sweeper
            service.close_all()

    return lifespan


def _status_routes(service: VerifierService) -> APIRouter:
    """Open without a key, so load balancers can probe it."""
    router = APIRouter()

    @router.get("/health", response_model=Health, tags=["status"])
    async def health() -> Health:
        """Liveness, open sessions and session affinity; open without a key so load balancers can probe it."""
        return service.health()

    return router
