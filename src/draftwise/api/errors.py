"""Errors in OpenAI's JSON shape: ``{"error": {"message", "type", "param", "code"}}``.

Every failure the server reports goes through ``APIError`` or one of the handlers here, so
clients written for OpenAI read draftwise's errors unchanged. User mistakes are 4xx.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from draftwise.api.responses import ErrorBody, ErrorResponse
from draftwise.errors import DraftwiseError, field_path, validation_message
from draftwise.web import malformed_json


class APIError(DraftwiseError):
    """An error for the client, with its HTTP status (``status``, this instance's own) and
    OpenAI error fields."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.body = ErrorBody(message=message, type=type, param=param, code=code)
        self.headers = headers

    def payload(self) -> dict[str, Any]:
        return ErrorResponse(error=self.body).model_dump()

    def response(self) -> JSONResponse:
        return JSONResponse(self.payload(), status_code=self.status, headers=self.headers)


def invalid(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, param=param, code=code)


def validation_error(errors: Sequence[Mapping[str, Any]]) -> APIError:
    """One readable 400 from pydantic's error list: 'field: problem; other.field: problem'."""
    first = ".".join(field_path(errors[0].get("loc", ()))) if errors else None
    return invalid(validation_message(errors, every=True), param=first or None, code="invalid_value")


def install_handlers(app: FastAPI) -> None:
    async def on_api_error(request: Request, exc: APIError) -> JSONResponse:
        return exc.response()

    async def on_validation(request: Request, exc: RequestValidationError) -> JSONResponse:
        # FastAPI answers 422 by default; OpenAI answers 400 for a malformed request.
        broken = malformed_json(exc)  # not JSON at all: no field to name
        return (invalid(broken) if broken is not None else validation_error(list(exc.errors()))).response()

    async def on_http(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        return APIError(exc.status_code, str(exc.detail), type=kind, headers=getattr(exc, "headers", None)).response()

    async def on_unexpected(request: Request, exc: Exception) -> JSONResponse:
        return APIError(500, f"internal error: {type(exc).__name__}: {exc}", type="server_error").response()

    app.exception_handler(APIError)(on_api_error)
    app.exception_handler(RequestValidationError)(on_validation)
    app.exception_handler(StarletteHTTPException)(on_http)
    app.exception_handler(Exception)(on_unexpected)
