"""What a request passes through on its way to a route's handler: the body size limit, the
API key guard, request counting by endpoint and status (``install_middleware``), and the
check that a body is one JSON object (``JsonBodyRoute``, the class of every OpenAI route).
"""

from __future__ import annotations

from collections.abc import Callable, Coroutine, Sequence
from typing import Any

from fastapi import Depends, FastAPI, Request
from fastapi.responses import Response
from fastapi.routing import APIRoute
from starlette.routing import Match

from draftwise.api.errors import APIError, invalid
from draftwise.api.monitoring import ServerMetrics
from draftwise.api.settings import ServerSettings
from draftwise.web import BodyLimit, JsonBodyError, bearer_guard, read_json_body


def install_middleware(app: FastAPI, settings: ServerSettings, metrics: ServerMetrics) -> list[Any]:
    """The body limit and request counting; returns the dependencies of the key-guarded routes."""
    app.add_middleware(
        BodyLimit, limit=settings.max_body_bytes, error=lambda status, message: APIError(status, message).response()
    )
    authorize = bearer_guard(
        settings.api_key,
        lambda message, headers: APIError(
            401, message, type="authentication_error", code="invalid_api_key", headers=headers
        ),
    )
    app.add_middleware(_CountRequests, metrics=metrics, routes=lambda: app.routes)
    # Open without a key: /health and /metrics (probes, scrapers) and the API's description
    # (/docs, /redoc, /openapi.json), which holds nothing the source does not.
    return [Depends(authorize)]


class _CountRequests:
    """ASGI middleware counting requests by endpoint and status (streams included). The
    endpoint is the path template of the route that takes the request (``/v1/models/{model}``
    whatever the id), ``other`` where none does."""

    def __init__(self, app: Any, metrics: ServerMetrics, routes: Callable[[], Sequence[Any]]) -> None:
        self.app = app
        self.metrics = metrics
        self.routes = routes

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        status = 500

        async def send_status(message: dict[str, Any]) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, send_status)
        finally:
            self.metrics.requests.labels(self._endpoint(scope), str(status)).inc()

    def _endpoint(self, scope: Any) -> str:
        # Matched here rather than read from scope["route"]: a request refused before routing
        # (an oversize body) still counts for its route. As the router does: a full match
        # first, else the route that only lacks the method (a 405).
        partial = None
        for route in self.routes():
            match, _ = route.matches(scope)
            if match is Match.FULL:
                return str(route.path_format)
            if match is Match.PARTIAL and partial is None:
                partial = str(route.path_format)
        return partial or "other"


class _JsonRequest(Request):
    """A request whose body is read by ``read_json_body``, once; FastAPI takes it from here."""

    _checked: dict[str, Any] | None = None

    async def json(self) -> Any:
        if self._checked is None:
            self._checked = read_json_body(await self.body(), self.headers.get("content-type"))
        return self._checked


class JsonBodyRoute(APIRoute):
    """A route whose body must be a JSON object. One that is not (another content type, not
    UTF-8, malformed, nested too deep) is a 400 that says which and names the member where
    there is one; FastAPI alone answers "There was an error parsing the body", or takes a
    text/plain body for a missing object."""

    def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
        handle = super().get_route_handler()
        if self.body_field is None:
            return handle

        async def read_then_handle(request: Request) -> Response:
            strict = _JsonRequest(request.scope, request.receive)
            try:
                await strict.json()
            except JsonBodyError as exc:
                raise invalid(str(exc), param=exc.field) from None
            return await handle(strict)

        return read_then_handle
