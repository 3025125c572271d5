"""One HTTP request through an ASGI app in this process, its answer as an async iterator: the
way a Ray Serve replica runs justllm's whole Litestar app (OpenAI and Ollama routes, errors,
streaming) behind a deployment method, with no HTTP server and no second copy of a route.

The answer is ``Head`` (status and headers) and then the body's chunks as the app sends them,
so a Ray streaming call relays SSE events one by one. Closing the iterator early (the client
left, so Ray cancels the call) tells the app the client disconnected and cancels it, which
aborts the request and frees its KV, as a closed connection does under uvicorn.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

ASGIApp = Callable[..., Awaitable[None]]  # app(scope, receive, send)
LEAVE_GRACE = 5.0  # seconds an app may take to stop once its client left
# Not relayed: they describe one connection, and the relaying side frames its own.
HOP_BY_HOP = frozenset({"connection", "keep-alive", "transfer-encoding", "content-length",
                        "host", "upgrade", "te", "trailer", "proxy-authorization",
                        "proxy-connection"})


@dataclass(frozen=True)
class Head:
    """The start of an answer. Headers in order, names lower case."""

    status: int
    headers: list[tuple[str, str]] = field(default_factory=list)

    def header(self, name: str, default: str = "") -> str:
        return next((v for k, v in self.headers if k == name), default)


def forwardable(headers: list[tuple[str, str]], *, drop: frozenset[str] = frozenset()
                ) -> list[tuple[str, str]]:
    """``headers`` without the hop-by-hop ones and ``drop``, names lower case."""
    return [(k.lower(), v) for k, v in headers
            if k.lower() not in HOP_BY_HOP and k.lower() not in drop]


async def call_asgi(app: ASGIApp, method: str, path: str, *, query: str = "",
                    headers: list[tuple[str, str]] | None = None, body: bytes = b"",
                    client: tuple[str, int] = ("127.0.0.1", 0)) -> AsyncIterator[Head | bytes]:
    """``app``'s answer to one request: a :class:`Head`, then each non-empty body chunk.
    Raises RuntimeError if the app ends without answering."""
    sent: asyncio.Queue[dict | None] = asyncio.Queue()
    gone = asyncio.Event()
    delivered = False

    async def receive() -> dict:
        nonlocal delivered
        if not delivered:
            delivered = True
            return {"type": "http.request", "body": body, "more_body": False}
        await gone.wait()
        return {"type": "http.disconnect"}

    async def send(message: dict) -> None:
        await sent.put(message)

    sent_headers = [(k.encode("latin-1"), v.encode("latin-1"))
                    for k, v in forwardable(headers or [])]
    sent_headers.append((b"content-length", str(len(body)).encode()))
    scope: dict[str, Any] = {
        "type": "http", "asgi": {"version": "3.0", "spec_version": "2.3"},
        "http_version": "1.1", "method": method.upper(), "scheme": "http", "path": path,
        "raw_path": path.encode(), "query_string": query.encode(), "root_path": "",
        "headers": sent_headers, "client": client, "server": ("127.0.0.1", 80),
        "state": {}, "extensions": {}}
    task = asyncio.ensure_future(app(scope, receive, send))
    task.add_done_callback(lambda _: sent.put_nowait(None))
    started = finished = False
    try:
        while True:
            message = await sent.get()
            if message is None:  # the app returned (or failed) without finishing the body
                error = task.exception() if not task.cancelled() else None
                if not started:
                    raise RuntimeError(f"the app answered nothing to {method} {path}"
                                       + (f": {error!r}" if error else ""))
                return
            kind = message.get("type")
            if kind == "http.response.start":
                started = True
                yield Head(int(message["status"]),
                           [(k.decode("latin-1").lower(), v.decode("latin-1"))
                            for k, v in message.get("headers", [])])
            elif kind == "http.response.body":
                chunk = message.get("body", b"")
                if chunk:
                    yield bytes(chunk)
                if not message.get("more_body", False):
                    finished = True
                    return
    finally:
        gone.set()  # after the last chunk too: a response watching for a disconnect stops
        if not finished and not task.done():
            # The caller left: the app hears the client disconnect, as under uvicorn, and
            # stops its work (a stream ends, a request being answered is aborted); an app
            # that does not stop within ``LEAVE_GRACE`` is cancelled. Cancelling at once
            # would leave work that a handler runs in a task of its own running.
            with contextlib.suppress(BaseException):
                await asyncio.wait_for(asyncio.shield(task), LEAVE_GRACE)
            task.cancel()
        with contextlib.suppress(BaseException):
            await task
