"""``X-Request-Id``: every answer names its request, as OpenAI's API does and vLLM's
``--enable-request-id-headers``. A client's own id (up to 128 visible ASCII characters) is
kept; otherwise the server makes one (``req_`` and 32 hex digits). Router mode and the
cluster send it on to the replica that serves the request, so the client, the gateway and the
runner hold one id for it.

The id lives in the request's ASGI scope, so the hook that puts it on the answer and a
handler that forwards the request read the same value.
"""

from __future__ import annotations

import uuid
from typing import Any

HEADER = "x-request-id"
MAX_LENGTH = 128
_SCOPE_KEY = "justllm.request_id"


def _acceptable(value: str) -> bool:
    return 0 < len(value) <= MAX_LENGTH and all("!" <= c <= "~" for c in value)


def request_id(scope: Any) -> str:
    """The request's id: the client's ``X-Request-Id`` if it is one we can send back, else
    one made for it (the same on every call for one request)."""
    known = scope.get(_SCOPE_KEY)
    if known is None:
        sent = next((v.decode("latin-1") for k, v in scope.get("headers", ())
                     if k.lower() == HEADER.encode()), "")
        known = sent if _acceptable(sent) else f"req_{uuid.uuid4().hex}"
        scope[_SCOPE_KEY] = known
    return str(known)


async def add_request_id(message: Any, scope: Any) -> None:
    """A ``before_send`` hook: the id on each HTTP answer that lacks one (an answer relayed
    from a replica already has it)."""
    if message["type"] != "http.response.start" or scope.get("type") != "http":
        return
    headers = list(message.get("headers") or ())
    if not any(bytes(k).lower() == HEADER.encode() for k, _ in headers):
        headers.append((HEADER.encode(), request_id(scope).encode()))
        message["headers"] = headers
