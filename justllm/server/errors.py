"""Every error the server returns has OpenAI's shape, ``{"error": {message, type, param, code}}``,
but on the routes of another API, which answer in that API's: Ollama's (``/api/``), Anthropic's
(``/v1/messages``) and llama-server's own routes (:data:`LLAMA_SERVER_PATHS`)."""

from __future__ import annotations

import logging
import re
from typing import Any

import msgspec
from litestar import Request, Response
from litestar.exceptions import HTTPException, SerializationException, ValidationException

from justllm.errors import EngineClosedError, InvalidRequestError, JustLLMError, QueueFullError

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


# llama-server's own routes at the root (server/llama_server.py, llama_completion.py,
# infill.py, llama_embedding.py, tokenize.py, rerank.py, lora.py): their errors are in its
# shape. Its OpenAI routes (``/v1/...``, and ``/chat/completions`` or ``/responses`` without
# the prefix) keep OpenAI's.
LLAMA_SERVER_PATHS = frozenset({
    "/completion", "/completions", "/infill", "/tokenize", "/detokenize", "/embedding",
    "/embeddings", "/apply-template", "/props", "/slots", "/rerank", "/reranking",
    "/lora-adapters"})
# The error types of llama-server's statuses (its format_error_response, in
# tools/server/server-common.cpp); a status it never answers keeps the type given here.
_LLAMA_SERVER_TYPES = {400: "invalid_request_error", 401: "authentication_error",
                       403: "permission_error", 404: "not_found_error", 500: "server_error",
                       501: "not_supported_error", 503: "unavailable_error"}


def llama_server_path(path: str) -> bool:
    """Whether ``path`` is one of llama-server's own routes (``/slots/{id}`` too, which it
    offers and justllm does not)."""
    return path in LLAMA_SERVER_PATHS or path.startswith("/slots/")


def llama_server_error(e: APIError) -> dict[str, Any]:
    """``e`` in llama-server's shape, ``{"error": {code, message, type}}``, ``code`` the HTTP
    status; with ``param`` besides (null or the field a 400 is about: llama-server adds its
    own keys to some errors, and clients read these three)."""
    return {"error": {"code": e.status, "message": e.message,
                      "type": _LLAMA_SERVER_TYPES.get(e.status, e.type), "param": e.param}}


def _unmangled(key: str) -> str:
    """A body field's path as Litestar reports it, mended: it strips every ``data.`` from the
    path (litestar/_signature/model.py), so ``metadata.user_id`` came out ``metauser_id``.
    ``metadata`` is the one field of these APIs whose name ends in ``data``."""
    return re.sub(r"(^|\.)meta(?!data)(?=\w)", r"\1metadata.", key)


def to_api_error(exc: Exception) -> APIError:
    if isinstance(exc, APIError):
        return exc
    if isinstance(exc, QueueFullError):
        return APIError(429, str(exc), type="rate_limit_error", code="queue_full",
                        headers={"Retry-After": str(RETRY_AFTER_SECONDS)})
    if isinstance(exc, EngineClosedError):
        return APIError(503, str(exc), type="server_error", code="shutting_down",
                        headers={"Retry-After": str(RETRY_AFTER_SECONDS)})
    if isinstance(exc, InvalidRequestError):
        return APIError(400, str(exc), param=exc.param)
    if isinstance(exc, msgspec.ValidationError):  # the strict decoding of a request body
        return APIError(400, str(exc), param=_msgspec_param(str(exc)))
    if isinstance(exc, (msgspec.DecodeError, UnicodeError)):
        return APIError(400, f"the body is not valid JSON: {_decode_problem(str(exc))}")
    if isinstance(exc, RecursionError):  # msgspec's JSON decoder on deeply nested input
        return APIError(400, "the JSON body is nested too deeply")
    if isinstance(exc, ValidationException):
        detail = [{**d, "key": _unmangled(d["key"])} if isinstance(d.get("key"), str) else d
                  for d in (exc.extra if isinstance(exc.extra, list) else [])
                  if isinstance(d, dict)]
        parts = [f"{d.get('key', '')}: {d.get('message', '')}".strip(": ") for d in detail]
        message = exc.detail if not parts else f"{exc.detail}: " + "; ".join(parts)
        first = detail[0] if detail and isinstance(detail[0], dict) else {}
        if first.get("key") == "data" and first.get("message") == "'data'":
            # Litestar's way of saying there is no body at all (its KeyError on "data")
            return APIError(400, "the request body is empty: send a JSON object")
        param = first.get("key")
        m = re.search(r"field `([^`]+)`", str(first.get("message", "")))
        if m:  # a missing or unknown field, in the object at ``key`` ("data": the body)
            param = m.group(1) if param in (None, "data") else f"{param}.{m.group(1)}"
        return APIError(400, message, param=param)
    if isinstance(exc, HTTPException) and isinstance(exc.__cause__, SerializationException):
        # Litestar's parse of the body: msgspec's message alone ("Input data was truncated")
        # does not say that the JSON is what is wrong
        said = _decode_problem(str(exc.detail))
        return APIError(400, said if "JSON" in said else f"the body is not valid JSON: {said}")
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


def _msgspec_param(message: str) -> str | None:
    """The field a msgspec error names: "... - at `$.messages[0].role`" -> "messages[0].role";
    an unknown field is named after its object's path."""
    at = re.search(r"at `\$\.?([^`]*)`", message)
    path = at.group(1) if at else ""
    unknown = re.search(r"unknown field `([^`]+)`", message)
    if unknown:
        path = f"{path}.{unknown.group(1)}" if path else unknown.group(1)
    return path or None


def handle_exception(request: Request, exc: Exception) -> Response:
    """The app's last resort, in OpenAI's shape; under ``/api/`` (no route matched: a 404 or
    405 the Ollama router never saw) in Ollama's, ``{"error": "message"}``; under
    ``/v1/messages`` or for Anthropic's SDK (it sends ``anthropic-version``), Anthropic's; on
    llama-server's own routes, its shape."""
    path = request.scope["path"]
    if path.startswith("/v1/messages") or "anthropic-version" in request.headers:
        from justllm.server.anthropic import anthropic_error  # it builds on this module

        return anthropic_error(request, exc)
    e = to_api_error(exc)
    if path.startswith("/api/"):
        return ollama_response(e)
    if llama_server_path(path):
        return Response(llama_server_error(e), status_code=e.status, headers=e.headers)
    return _response(e)


def ollama_response(e: APIError) -> Response:
    """Ollama's error shape, ``{"error": "message"}``, with the status the OpenAI side gives."""
    return Response({"error": e.message}, status_code=e.status, headers=e.headers)


def _decode_problem(text: str) -> str:
    """msgspec's message, except the one it gives for an unpaired surrogate escape as well as
    for a body cut short: both readings said (a client's JSON encoder writes such escapes for
    text that went wrong upstream)."""
    if text == "Input data was truncated":
        return ("it is cut short, or a string holds an unpaired UTF-16 surrogate escape (such "
                "as \\ud800), which is no character")
    return text


def json_object(raw: bytes) -> dict:
    """A request body that must be a JSON object (the proxies' one parse before routing)."""
    try:
        body = msgspec.json.decode(raw)
    except msgspec.ValidationError as e:  # (of untyped JSON: a number out of range)
        raise APIError(400, f"the body is not valid JSON: {e}") from None
    except (msgspec.DecodeError, RecursionError) as e:  # what is wrong, as a route says it
        raise to_api_error(e) from None
    if not isinstance(body, dict):
        raise APIError(400, "the body must be a JSON object")
    return body
