"""HTTP guards shared by draftwise's two servers, the OpenAI-compatible API and the remote
verifier: a request-body size limit and an optional bearer key. Each server passes in how it
shapes an error, so clients keep seeing that server's own error format.
"""

from __future__ import annotations

import secrets
from collections.abc import Awaitable, Callable
from typing import Any

from fastapi import Depends
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from pydantic import SecretStr
from starlette.responses import Response

ErrorResponse = Callable[[int, str], Response]


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
                response = self.error(413, f"request body of {length.decode(errors='replace')} bytes is over "
                                           f"this server's max_body_bytes of {self.limit}")
            if response is not None:
                await response(scope, receive, send)
                return
        await self.app(scope, receive, send)


def bearer_guard(api_key: SecretStr | None, fail: Callable[[str], Exception]
                 ) -> Callable[..., Awaitable[None]]:
    """A FastAPI dependency that lets a request through only with ``Authorization: Bearer
    KEY`` (anything goes when ``api_key`` is None); ``fail(message)`` is the exception raised."""
    bearer = HTTPBearer(auto_error=False, description="the server's --api-key, when it has one")
    key = api_key.get_secret_value().encode() if api_key is not None else None

    # async: a plain def dependency would cost every request a hop to the thread pool.
    async def authorize(credentials: HTTPAuthorizationCredentials | None = Depends(bearer)) -> None:
        if key is None:
            return
        if credentials is None or not secrets.compare_digest(credentials.credentials.encode(), key):
            raise fail("missing or wrong API key: send 'Authorization: Bearer KEY'")

    return authorize
