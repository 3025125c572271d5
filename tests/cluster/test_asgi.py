"""One request through an ASGI app in-process (how a model replica runs justllm's app), and the
ingress's /metrics page (pure: no Ray, no model)."""

from __future__ import annotations

import asyncio

import pytest

from justllm.cluster.asgi import Head, call_asgi, forwardable
from justllm.cluster.metrics import render
from justllm.tui.metrics import parse


class StreamingApp:
    """Echoes the request, then streams ``n`` chunks; stops when told the client left (as a
    Litestar stream does), or, if ``stubborn``, only when cancelled."""

    def __init__(self, n: int, stubborn: bool = False) -> None:
        self.n = n
        self.stubborn = stubborn
        self.scope: dict = {}
        self.body = b""
        self.ended = ""

    async def __call__(self, scope, receive, send) -> None:
        self.scope = scope
        self.body = (await receive())["body"]
        await send({"type": "http.response.start", "status": 201,
                    "headers": [(b"Content-Type", b"text/event-stream")]})
        watch = asyncio.ensure_future(receive())
        try:
            for i in range(self.n):
                if watch.done() and not self.stubborn:
                    self.ended = watch.result()["type"]
                    return
                await send({"type": "http.response.body", "body": f"chunk{i}".encode(),
                            "more_body": True})
                await asyncio.sleep(0.01)
            await send({"type": "http.response.body", "body": b"", "more_body": False})
        except asyncio.CancelledError:
            self.ended = "cancelled"
            raise
        finally:
            watch.cancel()


async def collect(app, **kwargs) -> list:
    return [item async for item in call_asgi(app, "POST", "/v1/completions", **kwargs)]


def test_the_answer_is_a_head_then_the_body_chunks_and_the_request_reaches_the_app():
    app = StreamingApp(3)
    items = asyncio.run(collect(app, query="a=1", body=b'{"x": 1}',
                                headers=[("Content-Type", "application/json"),
                                         ("Host", "elsewhere"), ("Content-Length", "99")]))
    assert items == [Head(201, [("content-type", "text/event-stream")]),
                     b"chunk0", b"chunk1", b"chunk2"]
    assert app.body == b'{"x": 1}' and app.scope["query_string"] == b"a=1"
    assert app.scope["method"] == "POST" and app.scope["path"] == "/v1/completions"
    assert app.scope["headers"] == [(b"content-type", b"application/json"),
                                    (b"content-length", b"8")]  # hop-by-hop ones replaced
    assert items[0].header("content-type") == "text/event-stream"


def first_two(app) -> list:
    async def go() -> list:
        answer = call_asgi(app, "POST", "/x")
        got = [await answer.__anext__(), await answer.__anext__()]
        await answer.aclose()
        return got

    return asyncio.run(go())


def test_leaving_early_tells_the_app_the_client_disconnected():
    app = StreamingApp(10_000)
    head, chunk = first_two(app)
    assert head.status == 201 and chunk == b"chunk0" and app.ended == "http.disconnect"


def test_an_app_that_does_not_stop_when_its_client_left_is_cancelled(monkeypatch):
    monkeypatch.setattr("justllm.cluster.asgi.LEAVE_GRACE", 0.2)
    app = StreamingApp(10_000, stubborn=True)
    first_two(app)
    assert app.ended == "cancelled"


def test_an_app_that_answers_nothing_is_an_error():
    async def silent(scope, receive, send) -> None:
        raise ValueError("boom")

    with pytest.raises(RuntimeError, match="answered nothing.*boom"):
        asyncio.run(collect(silent))


def test_forwardable_drops_hop_by_hop_and_chosen_headers():
    assert forwardable([("Authorization", "x"), ("Connection", "close"), ("X-Session-Id", "s")],
                       drop=frozenset({"authorization"})) == [("x-session-id", "s")]


PAGE = """# HELP vllm:num_requests_running Requests in the running batch.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{model_name="demo"} 2.0
# HELP justllm_prefix_cache_hits_total Requests that reused a cached prefix.
# TYPE justllm_prefix_cache_hits_total counter
justllm_prefix_cache_hits_total{model_name="demo"} 5.0
"""


def test_metrics_label_every_replicas_series_and_add_the_clusters_own():
    reports = {"demo": {"r1": {"healthy": True, "running": 2, "waiting": 1, "kv_usage": 0.25,
                               "hit_ratio": 0.5, "ttft_p50": None, "node_ip": "10.0.0.7"},
                        "r2": {"healthy": False, "running": 0, "waiting": 0, "kv_usage": 0.0,
                               "hit_ratio": None, "node_ip": "10.0.0.8"}}}
    pages = {"demo": {"r1": PAGE, "r2": PAGE}}
    text = render(reports, pages, ["demo", "idle"]).decode()
    assert 'justllm_prefix_cache_hits_total{model_name="demo",replica="r1"} 5.0' in text
    assert 'justllm_prefix_cache_hits_total{model_name="demo",replica="r2"} 5.0' in text
    assert text.count("# TYPE justllm_prefix_cache_hits_total counter") == 1
    assert 'justllm_gateway_replica_up{model_name="demo",replica="r1",node="10.0.0.7"} 1' in text
    assert 'justllm_gateway_replica_up{model_name="demo",replica="r2",node="10.0.0.8"} 0' in text
    assert 'justllm_gateway_replica_load{model_name="demo",replica="r1",node="10.0.0.7"} 3' \
        in text
    assert 'justllm_gateway_model_loaded{model_name="idle"} 0' in text
    snap = parse(text)  # what `justllm top --url` on the ingress reads
    assert snap.gateway and snap.running == 4.0 and snap.hits == 10.0
    assert snap.per_model["demo"].loaded and not snap.per_model["idle"].loaded
    assert snap.per_model["demo"].replicas_up == (("both", 1),)
