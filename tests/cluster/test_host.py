"""What a model replica runs, without Ray, on the real demo model: the server's whole app behind
one call per request (streaming too), the replica's stats from its own /metrics page, and the
health check (a closed engine, and an engine thread that does not come round)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from functools import partial

import pytest

from justllm.cli.options import engine_config
from justllm.cluster.asgi import Head
from justllm.cluster.host import EngineHost, EngineUnhealthy, Identity


@pytest.fixture(scope="module")
def host(model_path):
    h = EngineHost.load(Identity("demo", "r1", "node", "10.0.0.7"),
                        partial(engine_config, model_path,
                                {"max_seqs": 4, "pool_blocks": 64, "threads": 1}))
    yield h
    h.close()


def ask(host: EngineHost, path: str, body: dict) -> list[Head | bytes]:
    async def go() -> list[Head | bytes]:
        return [item async for item in host.http(
            "POST", path, "", [("content-type", "application/json")], json.dumps(body).encode())]

    return asyncio.run(go())


def test_a_request_goes_through_the_servers_app_and_says_which_replica_served_it(host):
    head, *body = ask(host, "/v1/completions",
                      {"model": "demo", "prompt": "The capital of France is", "max_tokens": 4,
                       "ignore_eos": True})  # sampled: it may end early, and the test counts 4
    assert isinstance(head, Head) and head.status == 200, body
    assert head.header("x-replica") == "r1"
    answer = json.loads(b"".join(body))  # type: ignore[arg-type]
    assert answer["model"] == "demo" and answer["usage"]["completion_tokens"] == 4


def test_a_stream_comes_as_one_item_per_event(host):
    head, *events = ask(host, "/v1/completions", {
        "model": "demo", "prompt": "Count to five:", "max_tokens": 6, "ignore_eos": True,
        "stream": True})
    assert isinstance(head, Head) and head.header("content-type").startswith("text/event-stream")
    text = b"".join(events).decode()  # type: ignore[arg-type]
    assert len(events) >= 6 and text.rstrip().endswith("data: [DONE]")


def test_errors_keep_the_openai_shape(host):
    head, *body = ask(host, "/v1/completions", {"model": "other", "prompt": "x"})
    assert isinstance(head, Head) and head.status == 404
    assert json.loads(b"".join(body))["error"]["param"] == "model"  # type: ignore[arg-type]


@pytest.mark.parametrize("stream", [False, True])
def test_a_caller_that_leaves_aborts_its_request(host, stream):
    """Ray cancels the replica's call when the client leaves: the app hears a disconnect."""
    body = json.dumps({"model": "demo", "prompt": "Once upon a time", "max_tokens": 900,
                       "ignore_eos": True, "stream": stream}).encode()

    async def go() -> None:
        answer = host.http("POST", "/v1/completions", "",
                           [("content-type", "application/json")], body)
        first = asyncio.ensure_future(answer.__anext__())
        for _ in range(100):
            await asyncio.sleep(0.05)
            if host.aengine.stats().num_running == 1:
                break
        else:
            raise AssertionError("the request never ran")
        first.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await first
        await answer.aclose()
        for _ in range(100):
            stats = host.aengine.stats()
            if stats.num_running == stats.num_waiting == 0:
                return
            await asyncio.sleep(0.05)
        raise AssertionError("the request kept running after its caller left")

    asyncio.run(go())


def test_stats_come_from_the_replicas_own_metrics_page(host):
    ask(host, "/v1/completions", {"model": "demo", "prompt": "Hello there", "max_tokens": 2})
    stats, page = host.observe()
    assert 'model_name="demo"' in page
    assert stats["model"] == "demo" and stats["replica"] == "r1" and stats["healthy"]
    assert stats["node_ip"] == "10.0.0.7"
    assert (stats["running"], stats["waiting"]) == (0, 0)
    assert 0.0 <= stats["kv_usage"] <= 1.0 and stats["hit_ratio"] is not None
    # (what the ingress's cards say as max_model_len)
    assert stats["max_model_len"] == host.aengine.max_request_tokens > 0


def test_health_fails_when_the_engine_thread_does_not_come_round(host):
    asyncio.run(host.check_health())

    async def stuck() -> None:
        busy = host.aengine.call_on_engine_thread(lambda: time.sleep(1.5))
        host.health_timeout = 0.3
        try:
            check = asyncio.ensure_future(host.check_health())
            await asyncio.sleep(0.1)
            # waiting on a busy step is no failure yet (replica_up flickered to 0 under load)
            assert not check.done() and host.observe()[0]["healthy"]
            with pytest.raises(EngineUnhealthy, match="has not come round"):
                await check
            assert not host.observe()[0]["healthy"]  # what the board and /metrics show
        finally:
            host.health_timeout = 20.0
            await busy

    asyncio.run(stuck())
    asyncio.run(host.check_health())
    assert host.observe()[0]["healthy"]


def test_health_fails_once_the_engine_is_closed(model_path):
    h = EngineHost.load(Identity("demo", "r2"), partial(engine_config, model_path,
                                                         {"max_seqs": 2, "pool_blocks": 32,
                                                          "threads": 1}))
    asyncio.run(h.check_health())
    h.close()
    with pytest.raises(EngineUnhealthy, match="closed"):
        asyncio.run(h.check_health())
