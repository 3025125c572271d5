"""One finished request (a ``RequestRecord``) as spans: what the trace of a request looks like.

The spans are made after the fact, on the plugin's delivery thread, so every start and end time
is given explicitly, rebuilt from the record: ``arrived_at`` is Unix time and the phases follow
it back to back (queue, then prefill, then decode). Attribute names follow the OpenTelemetry
GenAI semantic conventions (inference span, ``gen_ai.*``, status Development); what they have
no name for is under ``justllm.``. Names are plain strings: the Python constants for
``gen_ai.*`` in opentelemetry-semantic-conventions are deprecated since the conventions moved
to their own repository (open-telemetry/semantic-conventions-genai).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from opentelemetry import trace
from opentelemetry.context import Context
from opentelemetry.trace import SpanKind, Status, StatusCode
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

if TYPE_CHECKING:
    from justllm.plugins import RequestRecord
    from opentelemetry.util.types import AttributeValue

# gen_ai.operation.name by the API a request came through (record.api): the conventions'
# "chat" for the chat APIs, "text_completion" for the plain completion ones.
OPERATIONS = {"openai.chat": "chat", "anthropic.messages": "chat", "openai.responses": "chat",
              "ollama.chat": "chat", "openai.completions": "text_completion",
              "ollama.generate": "text_completion", "llama.completion": "text_completion",
              "llama.infill": "text_completion"}  # (llama-server's /completion, /infill)
# Without one (a request from ``justllm run``, or an API added later): the conventions'
# well-known value for a model generating content without naming an API shape.
OPERATION = "generate_content"
# gen_ai.provider.name (which replaced gen_ai.system): the conventions' list has no value for a
# self-hosted server, and a custom value is allowed; it tells backends these are justllm's spans.
PROVIDER = "justllm"
# error.type when record.error is set: the engine reports a message, not a class, so this one
# low-cardinality value is the only one this plugin reports (the message is in justllm.error).
ENGINE_ERROR = "engine_error"

PHASES = ("queue", "prefill", "decode")  # the child spans' names, in time order

# record.params name -> (GenAI attribute, its type in the conventions: top_k is a double).
GEN_AI_PARAMS: dict[str, tuple[str, type]] = {
    "temperature": ("gen_ai.request.temperature", float),
    "top_p": ("gen_ai.request.top_p", float),
    "top_k": ("gen_ai.request.top_k", float),
    "max_tokens": ("gen_ai.request.max_tokens", int),
    "seed": ("gen_ai.request.seed", int),
    "presence_penalty": ("gen_ai.request.presence_penalty", float),
    "frequency_penalty": ("gen_ai.request.frequency_penalty", float),
}


def record_spans(tracer: trace.Tracer, record: RequestRecord, *, content: bool = False) -> None:
    """Emit the request span and its phase spans. ``content``: add the prompt and output text
    the record carries (``gen_ai.input.messages`` / ``gen_ai.output.messages``)."""
    start = round(record.arrived_at * 1e9)
    end = start + _ns(record.total_seconds)
    # A child of the client's span when the request carried a W3C traceparent (an invalid one
    # is ignored: a root span then). SERVER kind: this process served the request (the
    # conventions' CLIENT kind is the caller's side).
    root = tracer.start_span(f"{operation(record)} {record.model}", context=client_context(record),
                             kind=SpanKind.SERVER, attributes=request_attributes(record, content),
                             start_time=start)
    if record.error:
        root.set_status(Status(StatusCode.ERROR, record.error))
    parent = trace.set_span_in_context(root)
    for name, begin, finish in phase_offsets(record):
        # min(): rounding each phase to ns must not push a child past its parent's end
        child = tracer.start_span(name, context=parent, kind=SpanKind.INTERNAL,
                                  start_time=min(start + _ns(begin), end))
        child.end(end_time=min(start + _ns(finish), end))
    root.end(end_time=end)


def operation(record: RequestRecord) -> str:
    return OPERATIONS.get(record.api or "", OPERATION)


def client_context(record: RequestRecord) -> Context:
    """The client's trace context from the request's traceparent (and tracestate) headers,
    else a fresh one."""
    if not record.traceparent:
        return Context()
    carrier = {"traceparent": record.traceparent}
    state = getattr(record, "tracestate", None)  # (records of a justllm before it had it)
    if state:
        carrier["tracestate"] = state
    return TraceContextTextMapPropagator().extract(carrier, context=Context())


def phase_offsets(record: RequestRecord) -> Iterator[tuple[str, float, float]]:
    """(name, start, end) in seconds after arrival for each phase that happened: one that never
    did (None: aborted while queued has no prefill, no token has no decode) gets no span."""
    at = 0.0
    for name, seconds in zip(PHASES, (record.queued_seconds, record.prefill_seconds,
                                      record.decode_seconds)):
        if seconds is None:
            continue
        yield name, at, at + seconds
        at += seconds


def request_attributes(record: RequestRecord, content: bool = False) -> dict[str, AttributeValue]:
    """The request span's attributes; those with no value in the record are left out."""
    attrs: dict[str, AttributeValue] = {
        "gen_ai.operation.name": operation(record),
        "gen_ai.provider.name": PROVIDER,
        "gen_ai.request.model": record.model,
        "gen_ai.response.model": record.model,
        "gen_ai.response.id": record.request_id,
        "gen_ai.response.finish_reasons": (record.finish_reason,),
        "gen_ai.usage.input_tokens": record.prompt_tokens,
        "gen_ai.usage.output_tokens": record.completion_tokens,
        # the conventions' name for prompt tokens a cache served (included in input_tokens, as
        # the prefix cache's are in prompt_tokens)
        "gen_ai.usage.cache_read.input_tokens": record.cached_tokens,
    }
    for name, value in record.params.items():
        if value is None:  # max_tokens None: no limit asked for
            continue
        key, kind = GEN_AI_PARAMS.get(name, (f"justllm.request.{name}", type(value)))
        if kind is int and not isinstance(value, bool):
            attrs[key] = _int64(int(value))
        elif kind is float and not isinstance(value, bool):
            attrs[key] = float(value)
        elif isinstance(value, str | bool | int | float):
            attrs[key] = value
    if record.lora:
        attrs["justllm.lora"] = record.lora
    if record.api:
        attrs["justllm.api"] = record.api
    if record.stream is not None:
        attrs["justllm.stream"] = record.stream
    if record.http_request_id:  # the conventions' header attribute: a list of its values
        attrs["http.request.header.x-request-id"] = (record.http_request_id,)
    if record.ttft_seconds is not None:
        # Not gen_ai.response.time_to_first_chunk: that one is the client's, measured to the
        # first streamed chunk; this is the server's, arrival to the first generated token.
        attrs["justllm.time_to_first_token"] = record.ttft_seconds
    if record.error:
        attrs["error.type"] = ENGINE_ERROR
        attrs["justllm.error"] = record.error
    if content:
        attrs.update(content_attributes(record))
    return attrs


def content_attributes(record: RequestRecord) -> dict[str, AttributeValue]:
    """The text as the conventions' opt-in message attributes, JSON strings (the Python SDK has
    no structured attribute values; the conventions allow JSON then). The prompt is what the
    model saw, a chat request's rendered template included, so it is one user message."""
    attrs: dict[str, AttributeValue] = {}
    if record.prompt is not None:
        attrs["gen_ai.input.messages"] = _json([
            {"role": "user", "parts": [{"type": "text", "content": record.prompt}]}])
    if record.output is not None:
        attrs["gen_ai.output.messages"] = _json([
            {"role": "assistant", "parts": [{"type": "text", "content": record.output}],
             "finish_reason": record.finish_reason}])
    return attrs


def _json(value: Any) -> str:
    return json.dumps(value, ensure_ascii=False)


def _int64(value: int) -> int | str:
    """An integer OTLP can carry (int64): a seed is kept modulo 2**64, so the ``-1`` a client
    sent is 2**64 - 1, which the exporter would refuse (a traceback in the log per span, the
    attribute lost); as int64 it is ``-1`` again. Anything further out: its digits."""
    if -2**63 <= value < 2**63:
        return value
    return value - 2**64 if 2**63 <= value < 2**64 else str(value)


def _ns(seconds: float) -> int:
    return round(seconds * 1e9)
