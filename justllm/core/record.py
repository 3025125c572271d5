"""What a plugin learns about one finished request (the ``on_request_finished`` hook).

Built by the engine when a request leaves it -- finished, aborted by its client or ended by an
error -- and handed to plugins off the engine thread (``justllm/plugins/events.py``).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

# The sampling parameters a record carries, by their SamplingParams names.
RECORDED_PARAMS = ("max_tokens", "temperature", "top_k", "top_p", "min_p", "repeat_penalty",
                   "presence_penalty", "frequency_penalty", "seed")


@dataclass(frozen=True)
class RequestOrigin:
    """What the server knew of a request when it reached the engine, for its record: the API
    it came through (``openai.chat``, ``openai.completions``, ``anthropic.messages``,
    ``openai.responses``, ``ollama.chat``, ``ollama.generate``), whether the answer streamed,
    and the client's W3C ``traceparent`` and ``tracestate`` headers as sent (a tracing plugin
    continues its trace)."""

    api: str | None = None
    stream: bool | None = None
    traceparent: str | None = None
    http_request_id: str | None = None  # the answer's X-Request-Id (the client's, or made)
    tracestate: str | None = None
    # The model the answer names, when the request named a LoRA adapter as its model (as
    # vLLM answers): the record's ``model`` then. None: the served model.
    model: str | None = None


@dataclass(frozen=True)
class RequestRecord:
    """One finished request. Times are seconds; ``None`` where the request never got there
    (aborted while queued: no prefill; no token: no decode)."""

    # The API's response id (``chatcmpl-...``, ``cmpl-...``, ``msg_...``, ``resp_...``), with
    # ``-0``, ``-1``... per choice when a request asked for several; ``ollama-...`` for
    # Ollama's API, ``run-<hex>`` for ``justllm run``, ``chat-<hex>-N`` for a chat's N-th
    # answer; the engine's ``req-N`` for a request added with no id.
    request_id: str
    # The id clients use (``justllm serve --model-name``, or the GGUF file's stem; an
    # adapter's name for a request that named the adapter as its model, as its answer does)
    model: str
    finish_reason: str  # "stop", "length", "abort" (the client left) or "error"
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int  # prompt tokens taken from the prefix cache
    arrived_at: float  # Unix time the request arrived
    queued_seconds: float | None  # arrival -> first scheduled
    prefill_seconds: float | None  # first scheduled -> first token
    decode_seconds: float | None  # first token -> finished
    total_seconds: float  # arrival -> finished
    error: str | None = None
    lora: str = ""  # the adapters it ran under ("a+b"); "" for the base model
    params: Mapping[str, Any] = field(default_factory=dict)  # RECORDED_PARAMS that were given
    # Only when the server records text (``justllm serve --record-text``): the prompt as the
    # model saw it (a chat request's rendered template; None for a token-id prompt) and the
    # output text as the client got it.
    prompt: str | None = None
    output: str | None = None
    # Where it came from (RequestOrigin); None for requests without a server (``justllm run``).
    api: str | None = None
    stream: bool | None = None
    traceparent: str | None = None
    # The HTTP request's X-Request-Id, as the answer carried it (the client's own, else one
    # the server made): what a client or a proxy log knows the request by.
    http_request_id: str | None = None
    # The client's W3C tracestate header beside its traceparent (vendors' trace data).
    tracestate: str | None = None

    @property
    def ttft_seconds(self) -> float | None:
        """Arrival to first token (queueing and prefill)."""
        if self.queued_seconds is None or self.prefill_seconds is None:
            return None
        return self.queued_seconds + self.prefill_seconds
