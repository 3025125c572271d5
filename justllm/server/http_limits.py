"""The limits of one HTTP connection, before a request reaches the app: ``justllm serve``'s and
router mode's uvicorn protocol.

uvicorn's httptools protocol keeps a request's head (its request line and headers) in memory
however long it grows -- 286 MB of headers took a server's RSS up by 281 MB, from a client
with no API key, as the key is checked only once the head is whole -- and it waits forever for
a connection's first request, for a head that trickles in a byte at a time, and for a body
that stops coming (each such connection holds a file descriptor, and a body up to 8 MiB).
Here a head is at most :data:`HEAD_MAX_BYTES` (431), whole within :data:`HEAD_TIMEOUT` seconds
of its first byte (or of the connection), and a body never pauses for more than
:data:`BODY_IDLE_TIMEOUT` seconds (the connection is closed): nginx's
``large_client_header_buffers``, ``client_header_timeout`` and ``client_body_timeout``.
What is no HTTP request at all (uvicorn's own 400: an unknown method, a URL httptools cannot
parse) is answered in OpenAI's shape too, not uvicorn's plain text.
Once a request is whole the connection is the app's: a client waiting minutes for an answer
is never timed out, and uvicorn's keep-alive timeout closes an idle connection after it.
"""

from __future__ import annotations

import asyncio
import time
from typing import Literal

import msgspec
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from justllm.server.errors import error_body

HEAD_MAX_BYTES = 64 * 1024
HEAD_TIMEOUT = 60.0
BODY_IDLE_TIMEOUT = 60.0
LINGER_SECONDS = 2.0  # a refused head's rest is read and dropped this long before the close


class LimitedHttpProtocol(HttpToolsProtocol):
    """uvicorn's httptools protocol with the limits above (class attributes: a test sets its
    own in a subclass). ``_reading``: what the connection waits for from its client, a
    request's ``head`` or its ``body``; a head is timed only once it begins (or on a new
    connection), so a connection whose request the app is answering has no timer."""

    head_max_bytes = HEAD_MAX_BYTES
    head_timeout = HEAD_TIMEOUT
    body_idle_timeout = BODY_IDLE_TIMEOUT

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._reading: Literal["head", "body"] = "head"
        self._head_bytes = 0
        self._last_byte = time.monotonic()
        self._timer: asyncio.TimerHandle | None = None
        self._refused = False
        self._arm(self.head_timeout)  # (a connection that never sends a byte)

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        if self._refused:
            return  # (read and dropped until the close, so that the client reads the 431)
        self._last_byte = time.monotonic()
        if self._reading == "head":
            self._head_bytes += len(data)  # (set back to 0 if the head ends in this chunk)
            if self._timer is None:  # a head's first byte
                self._arm(self.head_timeout)
        super().data_received(data)
        if (self._reading == "head" and self._head_bytes > self.head_max_bytes
                and not self.transport.is_closing()):
            self._refuse_head()

    def on_headers_complete(self) -> None:
        super().on_headers_complete()
        self._reading, self._head_bytes = "body", 0
        self._arm(self.body_idle_timeout)

    def on_message_complete(self) -> None:
        super().on_message_complete()
        self._reading, self._head_bytes = "head", 0  # (the next one: timed from its first byte)
        self._disarm()

    def handle_websocket_upgrade(self) -> None:
        self._disarm()  # (the connection is the WebSocket protocol's now)
        super().handle_websocket_upgrade()

    def _arm(self, seconds: float) -> None:
        self._disarm()
        self._timer = self.loop.call_later(seconds, self._expired, seconds)

    def _disarm(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _expired(self, seconds: float) -> None:
        self._timer = None
        if self.transport.is_closing():
            return
        if self.pipeline or (self._reading == "head" and self.cycle is not None
                              and not self.cycle.response_complete):
            # The next request began while an earlier one is answered (uvicorn reads a
            # pipelined request's body only after that): the answer first.
            self._arm(seconds)
            return
        if self._reading == "body":
            quiet = time.monotonic() - self._last_byte
            if quiet < self.body_idle_timeout:  # it came on: timed from its last byte
                self._arm(self.body_idle_timeout - quiet)
                return
        # The app, if it waits for this body, hears the client disconnect.
        self.transport.close()

    def send_400_response(self, msg: str) -> None:
        """uvicorn's answer to what is no HTTP request (an unknown method, a URL httptools
        cannot parse, a bad Content-Length), in OpenAI's shape rather than plain text."""
        self._write_error(b"400 Bad Request", msg, "invalid_http")
        self.transport.close()

    def _write_error(self, status: bytes, message: str, code: str) -> None:
        body = msgspec.json.encode(error_body(message, "invalid_request_error", code=code))
        self.transport.write(b"".join([
            b"HTTP/1.1 " + status + b"\r\n",
            *(name + b": " + value + b"\r\n" for name, value in self.server_state.default_headers),
            b"content-type: application/json\r\n",
            b"content-length: %d\r\n" % len(body),
            b"connection: close\r\n\r\n", body]))

    def _refuse_head(self) -> None:
        self._write_error(b"431 Request Header Fields Too Large",
                          f"the request's headers are too large (at most "
                          f"{self.head_max_bytes} bytes)", "headers_too_large")
        # A close with the rest of the head unread would reset the connection, and the client
        # would never read why: its sending side is drained for a while first (as nginx's
        # lingering close does).
        self._refused = True
        self.transport.write_eof()
        self._disarm()
        self._timer = self.loop.call_later(LINGER_SECONDS, self.transport.close)
