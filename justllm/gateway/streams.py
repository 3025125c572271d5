"""A replica's stream as its client gets it, and its end when the replica dies mid-way, as each
API's clients expect it: shared by router mode's gateway and the cluster's ingress, which
relay the replicas' streams byte for byte and add this last frame themselves."""

from __future__ import annotations

import re
from collections.abc import AsyncIterator

import msgspec

from justllm.server.anthropic import error_body as anthropic_error_body
from justllm.server.errors import APIError, error_body, llama_server_error, llama_server_path


class SequenceNumbers:
    """The Responses API numbers a stream's events; the gateway's own last event (a runner
    that died) must take the number after the runner's last. Chunks are raw bytes, so a number
    may be split between two: a short tail of the previous chunk is searched again."""

    _FIELD = re.compile(rb'"sequence_number":(\d+)')

    def __init__(self) -> None:
        self.next = 0
        self._tail = b""

    def feed(self, chunk: bytes) -> None:
        text = self._tail + chunk
        found = self._FIELD.findall(text)
        if found:
            self.next = max(self.next, max(map(int, found)) + 1)
        self._tail = text[-40:]


async def relayed(first: bytes, rest: AsyncIterator[bytes], path: str,
                  gone: type[BaseException] | tuple[type[BaseException], ...],
                  model: str) -> AsyncIterator[bytes]:
    """``first`` (already read, to retry a stream whose replica died before it), then the
    rest of the replica's stream (``path``'s API); if it raises ``gone`` (the replica died),
    :func:`stream_failure`'s last frame, numbered after the replica's last event."""
    numbered = SequenceNumbers() if path.startswith("/v1/responses") else None
    try:
        if first:
            if numbered is not None:
                numbered.feed(first)
            yield first
        async for chunk in rest:
            if numbered is not None:
                numbered.feed(chunk)
            yield chunk
    except gone:
        yield stream_failure(path, f"model '{model}' stopped while streaming",
                             numbered.next if numbered is not None else 0)


def stream_failure(path: str, message: str, sequence_number: int = 0) -> bytes:
    """The last frame of a stream whose replica (a runner, or a Ray replica) died, as each
    API's clients expect it: Ollama's ``{"error": ...}`` line, Anthropic's and the Responses
    API's ``error`` event (numbered ``sequence_number``, the one after the replica's last),
    llama-server's error event on its own routes (no ``[DONE]``: it sends none), else an
    OpenAI error chunk and ``[DONE]``."""
    if path.startswith("/api/"):
        return msgspec.json.encode({"error": message}) + b"\n"
    if llama_server_path(path):
        return b"data: " + msgspec.json.encode(llama_server_error(APIError(
            500, message, type="server_error"))) + b"\n\n"
    if path.startswith("/v1/messages"):
        return b"event: error\ndata: " + msgspec.json.encode(
            anthropic_error_body(500, message)) + b"\n\n"
    if path.startswith("/v1/responses"):
        return b"event: error\ndata: " + msgspec.json.encode(
            {"type": "error", "code": "replica_failed", "message": message, "param": None,
             "sequence_number": sequence_number}) + b"\n\n"
    return (b"data: " + msgspec.json.encode(error_body(
        message, "server_error", code="replica_failed")) + b"\n\ndata: [DONE]\n\n")
