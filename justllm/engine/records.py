"""The engine's side of ``on_request_finished``: who watches finished requests, and the
``RequestRecord`` built for them when a request leaves the engine (``Engine._drop``)."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

from justllm.core.record import RECORDED_PARAMS, RequestOrigin, RequestRecord
from justllm.core.request import Request
from justllm.core.sampling_params import SamplingParams


@dataclass(frozen=True)
class RequestObserver:
    """``callback`` gets a record per finished request; it is called under the engine's lock,
    so it must only hand the record on (plugins/events.py queues it)."""

    callback: Callable[[RequestRecord], None]
    model: str
    text: bool = False  # records carry the prompt and output text


def recorded_params(params: SamplingParams) -> dict[str, object]:
    """The sampling parameters a record names: those set away from their defaults, and
    ``max_tokens`` and ``temperature`` always."""
    defaults = SamplingParams()
    return {name: params.shown_top_p if name == "top_p" else getattr(params, name)
            for name in RECORDED_PARAMS if name in ("max_tokens", "temperature")
            or getattr(params, name) != getattr(defaults, name)}


def request_record(observer: RequestObserver, req: Request, metrics, *, error: str | None,
                   prompt: str | None, output: str | None,
                   origin: RequestOrigin | None = None) -> RequestRecord:
    """``metrics`` is the request's RequestMetrics (perf_counter times)."""
    origin = origin or RequestOrigin()
    now = time.perf_counter()
    end = metrics.finished_time or now
    first, scheduled = metrics.first_token_time, metrics.scheduled_time
    if first is not None and scheduled is not None and first < scheduled:
        scheduled = first  # resumed from a PD hand-over: its prefill (and first token) was
        # on the prefill replica; here it waited for nothing before that token
    reason = "error" if error else (req.finish_reason.value if req.finish_reason else "abort")
    return RequestRecord(
        request_id=req.request_id, model=origin.model or observer.model, finish_reason=reason,
        prompt_tokens=metrics.num_prompt_tokens,
        completion_tokens=metrics.num_generated_tokens,
        cached_tokens=metrics.num_cached_tokens,
        arrived_at=time.time() - (now - metrics.arrival_time),
        queued_seconds=None if scheduled is None else scheduled - metrics.arrival_time,
        prefill_seconds=None if first is None or scheduled is None else first - scheduled,
        decode_seconds=None if first is None else end - first,
        total_seconds=end - metrics.arrival_time, error=error, lora=metrics.lora,
        params=recorded_params(req.params),
        prompt=prompt if observer.text else None, output=output if observer.text else None,
        api=origin.api, stream=origin.stream, traceparent=origin.traceparent,
        http_request_id=origin.http_request_id, tracestate=origin.tracestate)
