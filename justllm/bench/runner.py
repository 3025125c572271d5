"""Send a workload to an endpoint with a concurrency cap and an optional Poisson arrival rate,
streaming every request and timing it; scrape /metrics before and after."""

from __future__ import annotations

import asyncio
import json
import random
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import httpx

from justllm.bench.workloads import BenchRequest
from justllm.core.http_errors import error_text
from justllm.core.sampling_params import MAX_TEMPERATURE
from justllm.core.sse import sse_data


@dataclass
class RequestResult:
    ok: bool
    prompt_tokens: int | None = None  # None: the server reported no usage
    output_tokens: int = 0
    ttft: float = 0.0
    e2e: float = 0.0
    itl: list[float] = field(default_factory=list)
    error: str = ""


@dataclass
class RunResult:
    url: str
    duration: float
    results: list[RequestResult]
    metrics_before: dict[str, float]
    metrics_after: dict[str, float]


METRICS_TIMEOUT = 30.0  # seconds a /metrics scrape may take (a stalled one held bench 600 s)


def parse_metrics(text: str, model: str | None = None) -> dict[str, float]:
    """Sum each sample name over its labels; with ``model``, only the samples whose
    ``model_name`` is it (a router's other models, or one unloaded mid-run, were counted as
    this run's), and those without the label."""
    from prometheus_client.parser import text_string_to_metric_families

    out: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if model is None or s.labels.get("model_name", model) == model:
                out[s.name] = out.get(s.name, 0.0) + float(s.value)
    return out


async def _metrics(client: httpx.AsyncClient, url: str, model: str | None) -> dict[str, float]:
    try:
        r = await client.get(url + "/metrics", timeout=METRICS_TIMEOUT)
        return parse_metrics(r.text, model) if r.status_code == 200 else {}
    except (httpx.HTTPError, ValueError):
        return {}


def sampling_fields(temperature: float, top_p: float | None, top_k: int | None,
                    min_p: float | None) -> dict[str, float]:
    """The sampling fields every request carries; checked here, so a bad value is one line
    rather than every request failing on the server."""
    if not 0.0 <= temperature <= MAX_TEMPERATURE:  # what the server takes (not OpenAI's 2)
        raise ValueError(f"--temperature must be in [0, {MAX_TEMPERATURE:g}]")
    if top_p is not None and not 0.0 <= top_p <= 1.0:  # (0: the best token alone)
        raise ValueError("--top-p must be in [0, 1]")
    if top_k is not None and top_k < 0:
        raise ValueError("--top-k must be >= 0")
    if min_p is not None and not 0.0 <= min_p <= 1.0:
        raise ValueError("--min-p must be in [0, 1]")
    fields: dict[str, float] = {"temperature": temperature}
    for name, value in (("top_p", top_p), ("top_k", top_k), ("min_p", min_p)):
        if value is not None:
            fields[name] = value
    return fields


def request_body(req: BenchRequest, model: str | None, sampling: dict[str, float]) -> dict:
    """A streaming ``/v1/completions`` body: greedy unless ``sampling`` says otherwise (its
    fields -- temperature, top_p, top_k, min_p -- are sent as given, and only those)."""
    body: dict = {"prompt": req.prompt, "max_tokens": req.max_tokens, "temperature": 0,
                  "stream": True, "stream_options": {"include_usage": True}, "ignore_eos": True}
    body.update(sampling)
    if model:
        body["model"] = model
    return body


def http_error(status: int, reason: str, body: bytes, content_type: str) -> str:
    """A refused request as one line: its status and what the server said (``error_text``),
    else the status's reason."""
    said = error_text(status, body, content_type) or reason
    return f"HTTP {status}: {said}" if said else f"HTTP {status}"


async def _one(client: httpx.AsyncClient, url: str, body: dict) -> RequestResult:
    res = RequestResult(ok=False)
    t0 = time.perf_counter()
    last = None
    chunks = 0
    done = False  # the stream's [DONE]: without it the answer was cut off
    try:
        async with client.stream("POST", url + "/v1/completions", json=body) as r:
            if r.status_code != 200:
                res.error = http_error(r.status_code, r.reason_phrase, await r.aread(),
                                       r.headers.get("content-type", ""))
                return res
            async for line in r.aiter_lines():
                payload = sse_data(line)
                done = done or payload == "[DONE]"
                if not payload or payload == "[DONE]":
                    continue
                data = json.loads(payload)
                if not isinstance(data, dict):
                    raise ValueError(f"a stream event that is no object: {payload[:200]}")
                if "error" in data:
                    error = data["error"]
                    res.error = str(error.get("message", error) if isinstance(error, dict)
                                    else error)
                    return res
                if data.get("usage"):  # (a count left out is unknown, not 0)
                    res.prompt_tokens = data["usage"].get("prompt_tokens")
                    res.output_tokens = data["usage"].get("completion_tokens", 0)
                if any(c.get("text") for c in data.get("choices") or []):
                    now = time.perf_counter()
                    if last is None:
                        res.ttft = now - t0
                    else:
                        res.itl.append(now - last)
                    last = now
                    chunks += 1
    except (httpx.HTTPError, ValueError, AttributeError, TypeError) as e:  # (not a stream)
        res.error = f"{type(e).__name__}: {e}"
        return res
    res.e2e = time.perf_counter() - t0
    res.output_tokens = res.output_tokens or chunks
    res.ok = last is not None and done
    if last is None:
        res.error = "no tokens received"
    elif not done:
        res.error = f"the stream ended without its [DONE], after {chunks} piece(s) of text"
    return res


async def run_workload(url: str, requests: list[BenchRequest], *, concurrency: int,
                       request_rate: float | None, model: str | None, api_key: str | None,
                       seed: int, on_done: Callable[[], None] | None = None,
                       sampling: dict[str, float] | None = None) -> RunResult:
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    limits = httpx.Limits(max_connections=concurrency + 4)
    async with httpx.AsyncClient(timeout=httpx.Timeout(600, connect=10), headers=headers,
                                 limits=limits, trust_env=False) as client:
        before = await _metrics(client, url, model)
        sem = asyncio.Semaphore(concurrency)
        rng = random.Random(seed)

        async def limited(req: BenchRequest) -> RequestResult:
            async with sem:
                result = await _one(client, url, request_body(req, model, sampling or {}))
            if on_done:
                on_done()
            return result

        t0 = time.perf_counter()
        tasks = []
        for k, req in enumerate(requests):
            tasks.append(asyncio.create_task(limited(req)))
            if request_rate and k + 1 < len(requests):  # (none after the last: not timed)
                await asyncio.sleep(rng.expovariate(request_rate))
        results = await asyncio.gather(*tasks)
        duration = time.perf_counter() - t0
        after = await _metrics(client, url, model)
    return RunResult(url, duration, list(results), before, after)
