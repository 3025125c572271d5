"""Every error the server returns has OpenAI's shape: ``{"error": {message, type, param, code}}``."""

from __future__ import annotations

import logging
import re

from litestar import Request, Response
from litestar.exceptions import HTTPException, ValidationException

from justllm.errors import InvalidRequestError, JustLLMError, QueueFullError

log = logging.getLogger(__name__)

RETRY_AFTER_SECONDS = 1


class APIError(Exception):
    """An error with its HTTP status and OpenAI error type, raised by route handlers."""

    def __init__(self, status: int, message: str, *, type: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None,
                 headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code
        self.headers = headers or {}


def error_body(message: str, type: str, param: str | None = None, code: str | None = None
               ) -> dict:
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


def _response(e: APIError) -> Response:
    return Response(error_body(e.message, e.type, e.param, e.code), status_code=e.status,
                    headers=e.headers)


def to_api_error(exc: Exception) -> APIError:
    if isinstance(exc, APIError):
        return exc
    if isinstance(exc, QueueFullError):
        return APIError(429, str(exc), type="rate_limit_error", code="queue_full",
                        headers={"Retry-After": str(RETRY_AFTER_SECONDS)})
    if isinstance(exc, InvalidRequestError):
        return APIError(400, str(exc), param=exc.param)
    if isinstance(exc, ValidationException):
        detail = exc.extra if isinstance(exc.extra, list) else []
        parts = [f"{d.get('key', '')}: {d.get('message', '')}".strip(": ") for d in detail
                 if isinstance(d, dict)]
        message = exc.detail if not parts else f"{exc.detail}: " + "; ".join(parts)
        param = detail[0].get("key") if detail and isinstance(detail[0], dict) else None
        if param == "data":  # a missing field: msgspec names it in backticks
            m = re.search(r"field `([^`]+)`", message)
            param = m.group(1) if m else None
        return APIError(400, message, param=param)
    if isinstance(exc, HTTPException):
        kind = {401: "authentication_error", 404: "not_found_error",
                413: "invalid_request_error", 429: "rate_limit_error"}.get(
                    exc.status_code, "invalid_request_error" if exc.status_code < 500 else "server_error")
        return APIError(exc.status_code, exc.detail, type=kind,
                        headers=dict(exc.headers or {}))
    if isinstance(exc, JustLLMError):
        return APIError(500, str(exc), type="server_error")
    log.exception("unhandled error", exc_info=exc)
    return APIError(500, "internal server error", type="server_error")


def handle_exception(_: Request, exc: Exception) -> Response:
    return _response(to_api_error(exc))
