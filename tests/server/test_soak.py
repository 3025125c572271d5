"""Issue #21's workload, bounded: concurrent clients with shared-prefix prompts and disconnects
against a real server with a small pool. The server checks its KV after every step (the
test suite's JUSTLLM_CHECK_KV=1 reaches it), so an inconsistency is a failed request here."""

from __future__ import annotations

import asyncio

import httpx

from justllm.bench.soak import SoakConfig, idle_leak, soak
from tests.server.conftest import start_server


def test_shared_prefix_traffic_with_disconnects_fails_nothing_and_leaks_nothing(model_path):
    s = start_server(model_path, "--max-seqs", "6", "--pool-blocks", "80", "--block-size", "16")
    try:
        # The 20 requests end it; the deadline only bounds a hang (120 s left little margin
        # on a loaded machine, where a late request was a failure of the count below).
        cfg = SoakConfig(clients=4, seconds=400, requests_per_client=5, disconnect=0.3,
                         lengths=(30, 200, 520), max_tokens=(4, 16), seed=3)
        counts = asyncio.run(soak(s.url, cfg))
        assert counts["requests"] == 20
        assert counts["5xx"] == 0 and counts["transport_error"] == 0, counts
        assert counts["ok"] >= 10 and counts["disconnected"] >= 2, counts
        used, cached = asyncio.run(idle_leak(s.url))
        assert used == cached, (used, cached)  # idle: only the prefix cache holds blocks
        text = httpx.get(s.url + "/metrics", timeout=10).text
        assert "justllm_prefix_cache_hits_total" in text
    finally:
        assert s.stop() == 0
