"""ServerMetrics fed by a real engine's outputs: what a finished request counts as."""

from __future__ import annotations

import asyncio
import time

from prometheus_client.parser import text_string_to_metric_families

from justllm.config import EngineConfig
from justllm.core.sampling_params import SamplingParams
from justllm.engine.async_engine import AsyncEngine
from justllm.engine.engine import Engine
from justllm.server.metrics import ServerMetrics, failed


def samples(metrics: ServerMetrics) -> dict[tuple[str, tuple], float]:
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for f in text_string_to_metric_families(metrics.render().decode())
            for s in f.samples}


def test_a_shutdowns_abort_counts_as_abort_with_its_own_latency(model_path):
    """A request a shutdown ends (503 shutting_down) is vLLM's ``abort``, as its record says,
    not an ``error``; its latency runs from its own arrival (it was taken from 0: the
    machine's uptime)."""
    aengine = AsyncEngine(Engine(EngineConfig(model=model_path, max_seqs=2, pool_blocks=64)))
    metrics = ServerMetrics(aengine.stats, "m")
    try:
        async def main():
            started = time.perf_counter()
            stream = aengine.submit("Once upon a time", SamplingParams(max_tokens=200,
                                                                       ignore_eos=True))
            async for out in stream:
                if not out.finished:
                    aengine.abort_all()
                else:
                    metrics.observe_finished(out.metrics, out.finish_reason, failed(out))
            return out, time.perf_counter() - started

        last, within = asyncio.run(main())
    finally:
        aengine.close()
    assert last.error and last.error_code == "shutting_down"
    got = samples(metrics)
    reasons = {dict(k[1])["finished_reason"]: v for k, v in got.items()
               if k[0] == "vllm:request_success_total"}
    assert reasons == {"abort": 1.0}
    e2e = got["vllm:e2e_request_latency_seconds_sum", (("model_name", "m"),)]
    assert 0 < e2e <= within


def test_a_stream_its_client_left_still_gives_its_inter_token_gaps(server):
    """vLLM observes inter_token_latency as tokens come; here it was observed when a request
    ended, so a stream its client left (an abort) took its gaps out of the histogram."""
    import httpx

    def itl_count() -> float:
        text = httpx.get(server.url + "/metrics", timeout=60).text
        return sum(s.value for f in text_string_to_metric_families(text) for s in f.samples
                   if s.name == "vllm:inter_token_latency_seconds_count")

    before = itl_count()
    body = {"model": server.model, "prompt": "Once upon a time", "max_tokens": 400,
            "ignore_eos": True, "stream": True, "temperature": 0}
    with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=120) as r:
        chunks = 0
        for line in r.iter_lines():
            chunks += line.startswith("data: ")
            if chunks == 12:
                break  # (the client leaves)
    deadline = time.monotonic() + 60
    while itl_count() == before and time.monotonic() < deadline:
        time.sleep(0.1)
    assert itl_count() - before >= 10
