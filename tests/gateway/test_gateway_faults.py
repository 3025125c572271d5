"""Router mode's faults: what a replica that cannot be reached, a client that leaves, an odd
``model`` or ``keep_alive``, and a run-time LoRA unload racing a load do to the gateway. Most
run the gateway's app in this process against fake replicas (an httpx MockTransport: no
process); the abort of a request whose client left needs a real runner."""

from __future__ import annotations

import asyncio
import contextlib
import json
import re
import threading
import time
from collections.abc import Callable, Iterator
from datetime import datetime

import httpx
import pytest
from litestar.testing import TestClient

from justllm.errors import InvalidRequestError
from justllm.gateway.app import GatewaySettings, _keep_alive, create_gateway
from justllm.gateway.config import Flags, load_config
from justllm.gateway.supervisor import Supervisor
from justllm.server.errors import APIError
from justllm.server.request_checks import check_without_model
from tests.gateway.test_gateway import start_gateway, stop

FLAGS = Flags(frozenset({"max-seqs", "enable-lora-runtime"}),
              switches=frozenset({"enable-lora-runtime"}))
URLS = ["http://10.0.0.1:1", "http://10.0.0.2:1"]  # never reached: the transport is fake


def metrics_page(model: str) -> str:
    return (f'vllm:num_requests_running{{model_name="{model}"}} 0\n'
            f'vllm:num_requests_waiting{{model_name="{model}"}} 0\n')


class Replicas:
    """The fake replicas behind the gateway: their /metrics, and every other request recorded
    and answered by ``answer`` (a response, or an exception to raise)."""

    def __init__(self, answer: Callable[[httpx.Request], httpx.Response] | None = None) -> None:
        self.calls: list[tuple[str, str, dict | None]] = []  # (url, path, body)
        self.answer = answer or (lambda request: httpx.Response(200, json={"ok": True}))

    async def __call__(self, request: httpx.Request) -> httpx.Response:
        if request.url.path == "/metrics":
            return httpx.Response(200, text=metrics_page("remote"))
        body = json.loads(request.content) if request.content else None
        self.calls.append((f"{request.url.scheme}://{request.url.netloc.decode()}",
                           request.url.path, body))
        answer = self.answer(request)
        if asyncio.iscoroutine(answer):
            answer = await answer
        return answer


@contextlib.contextmanager
def gateway(tmp_path, replicas: Replicas, models: dict | None = None
            ) -> Iterator[tuple[TestClient, Supervisor]]:
    """The gateway's app with ``models`` (default: "remote", served by two fake replicas
    only) whose every request to a replica goes to ``replicas``."""
    models = models or {"remote": {"source": "x.gguf", "replicas": 0, "urls": URLS,
                                   "enable-lora-runtime": True}}
    config = load_config({"poll-interval": 60, "models": models}, FLAGS)
    app = create_gateway(config, GatewaySettings(), tmp_path)
    with TestClient(app) as client:
        sup: Supervisor = app.state["supervisor"]
        transport = httpx.MockTransport(replicas)
        sup._http = httpx.AsyncClient(transport=transport)
        app.state["http"] = httpx.AsyncClient(transport=transport)
        yield client, sup


def in_flight(client: TestClient, model: str) -> list[int]:
    rows = {m["model"]: m for m in client.get("/models").json()["data"]}
    return [r["in_flight"] for r in rows[model]["replicas"]]


# ---- transport errors -----------------------------------------------------------------------


@pytest.mark.parametrize("error", [
    httpx.ConnectTimeout("timed out"), httpx.WriteError("broken pipe"),
    httpx.WriteTimeout("write timed out"), httpx.LocalProtocolError("bad state"),
    httpx.ConnectError("refused"), httpx.ReadError("reset")], ids=lambda e: type(e).__name__)
def test_a_replica_not_reached_sends_the_request_to_another_and_frees_its_count(tmp_path,
                                                                                 error):
    """ConnectTimeout (a remote host down), WriteError... were a 500 with no retry, and the
    replica's in-flight count stayed one too high for good."""
    failures = [error]

    def answer(request: httpx.Request) -> httpx.Response:
        if failures:
            raise failures.pop()
        return httpx.Response(200, json={"ok": True})

    replicas = Replicas(answer)
    with gateway(tmp_path, replicas) as (client, sup):
        r = client.post("/v1/completions", json={"model": "remote", "prompt": "hi"})
        assert r.status_code == 200 and r.json() == {"ok": True}, r.text
        (first, *_), (second, *_) = replicas.calls
        assert first != second and r.headers["x-replica"] == second  # the other replica
        assert in_flight(client, "remote") == [0, 0]
        state = sup.models["remote"]
        failed = state.replica(first)
        assert failed.status == "unhealthy" and type(error).__name__ in (failed.error or "")

        # Both fail: the 503 the gateway gives for a replica that stopped answering.
        failed.status = "ready"
        failures += [httpx.ConnectTimeout("timed out"), httpx.WriteError("broken pipe")]
        r = client.post("/v1/completions", json={"model": "remote", "prompt": "hi"})
        assert r.status_code == 503 and r.json()["error"]["code"] == "replica_failed", r.text
        assert r.headers["retry-after"] == "2"
        assert in_flight(client, "remote") == [0, 0]


# ---- ADAPTER:latest -------------------------------------------------------------------------


def test_an_adapters_latest_tag_is_a_404_off_ollamas_api_not_the_base_model(tmp_path):
    """``sql:latest`` on /v1 ran on the base model, without the adapter; a single server
    answers 404 there. Ollama's routes take the tag (to the adapter)."""
    replicas = Replicas()
    with gateway(tmp_path, replicas) as (client, sup):
        sup.models["remote"].runtime_lora["sql"] = json.dumps(
            {"lora_name": "sql", "lora_path": "/x.gguf", "load_inplace": False}).encode()
        r = client.post("/v1/completions", json={"model": "sql:latest", "prompt": "hi"})
        assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found", r.text
        r = client.post("/v1/messages", json={"model": "sql:latest", "max_tokens": 4,
                                              "messages": [{"role": "user", "content": "hi"}]})
        assert r.status_code == 404 and r.json()["type"] == "error", r.text  # Anthropic's
        r = client.post("/completion", json={"model": "sql:latest", "prompt": "hi"})
        assert r.status_code == 404 and r.json()["error"]["code"] == 404, r.text  # llama's
        assert replicas.calls == []  # none of them reached a replica

        for path, name in (("/v1/completions", "sql"), ("/api/generate", "sql:latest"),
                           ("/v1/completions", "remote:latest")):
            r = client.post(path, json={"model": name, "prompt": "hi", "stream": False})
            assert r.status_code == 200, (path, name, r.text)
        # (an Ollama route's runner takes the tag itself; an alias is the model's name)
        assert [body["model"] for _, _, body in replicas.calls] == [
            "sql", "sql:latest", "remote"]


# ---- keep_alive -----------------------------------------------------------------------------


@pytest.mark.parametrize("value", ["100000000h", 1e12, "1e400", "inf", 1e308])
def test_a_keep_alive_past_gos_durations_is_a_400_in_ollamas_shape(tmp_path, value):
    """They were taken, and then GET /api/ps failed with a 500 for every client until the
    model unloaded (which it then never did)."""
    replicas = Replicas()
    with gateway(tmp_path, replicas) as (client, _):
        r = client.post("/api/generate", json={"model": "remote", "prompt": "hi",
                                               "keep_alive": value})
        assert r.status_code == 400, r.text
        assert set(r.json()) == {"error"} and "keep_alive" in r.json()["error"], r.text
        assert replicas.calls == []
        # Off Ollama's routes it is not the gateway's field: it goes on as it came, and a
        # justllm runner refuses it as a single server does (tests/gateway/test_gateway.py).
        r = client.post("/v1/completions", json={"model": "remote", "prompt": "hi",
                                                 "keep_alive": value})
        assert [(path, body["keep_alive"]) for _, path, body in replicas.calls] == [
            ("/v1/completions", value)]


def test_api_ps_answers_for_a_model_whose_ttl_is_past_a_dates_years(tmp_path):
    models = {"local": {"source": "x.gguf", "ttl": 1e12}}
    with gateway(tmp_path, Replicas(), models) as (client, sup):
        state = sup.models["local"]
        state.status = "loaded"  # (no runner: /api/ps reads the bookkeeping only)
        try:
            for keep_alive in (None, 1e15, float("inf")):
                state.keep_alive = keep_alive
                r = client.get("/api/ps")
                assert r.status_code == 200, r.text
                (model,) = r.json()["models"]
                expires = datetime.strptime(model["expires_at"], "%Y-%m-%dT%H:%M:%S.%fZ")
                assert expires.year > 2300  # centuries ahead, as for a model never unloaded
        finally:
            state.status = "unloaded"


def test_keep_alive_goes_to_a_remote_only_model_s_servers(tmp_path):
    """It was dropped: neither honoured (nothing is loaded here) nor sent on, and keep_alive 0
    answered as a load."""
    replicas = Replicas()
    with gateway(tmp_path, replicas) as (client, _):
        for value in (0, "5m", -1):
            r = client.post("/api/generate", json={"model": "remote", "prompt": "",
                                                   "keep_alive": value})
            assert r.status_code == 200, r.text
        assert [body["keep_alive"] for _, _, body in replicas.calls] == [0, "5m", -1]


def test_keep_alive_on_a_model_never_unloaded(tmp_path):
    """min-replicas >= 1: 0 (unload) is refused, as a single server refuses it; a duration
    is kept (the model stays loaded longer), so the model's rule holds."""
    config = load_config({"models": {"pinned": {"source": "x.gguf", "min-replicas": 1,
                                                "max-replicas": 2},
                                     "plain": {"source": "x.gguf"}}}, FLAGS)
    sup = Supervisor(config, tmp_path)
    pinned, plain = sup.models["pinned"], sup.models["plain"]
    with pytest.raises(APIError) as e:
        _keep_alive(pinned, 0)
    assert e.value.status == 400 and e.value.param == "keep_alive"
    assert "never unloaded" in e.value.message
    assert _keep_alive(pinned, "5m") is None and _keep_alive(pinned, -1) is None
    assert _keep_alive(plain, 0) == 0 and _keep_alive(plain, "5m") == 300


# ---- rerank bodies before a load ------------------------------------------------------------


@pytest.mark.parametrize("path", ["/v1/rerank", "/v1/reranking", "/rerank", "/reranking"])
def test_a_bad_rerank_body_is_refused_before_its_model_loads(tmp_path, path):
    """It started the runner (evicting an idle model under max-loaded) only to be refused."""
    for bad in ({"query": 5, "documents": ["a"]}, {"query": "q"},
                {"query": "q", "documents": []}, {"query": "q", "texts": ["a"], "bogus": 1},
                {"query": "q", "documents": ["a"], "top_n": 0}):
        with pytest.raises(ValueError):  # msgspec's errors and InvalidRequestError
            check_without_model(path, json.dumps({"model": "r", **bad}).encode())
    check_without_model(path, json.dumps({"model": "r", "query": "q",
                                          "documents": ["a", {"text": "b"}]}).encode())
    models = {"local": {"source": "x.gguf"}}
    with gateway(tmp_path, Replicas(), models) as (client, sup):
        r = client.post(path, json={"model": "local", "query": 5, "documents": ["a"]})
        assert r.status_code == 400, r.text
        assert sup.models["local"].status == "unloaded" and sup.models["local"].loads == 0


@pytest.mark.parametrize(("path", "body", "param"), [
    ("/v1/chat/completions", {"temperature": 500}, "temperature"),
    ("/v1/chat/completions", {"top_p": 5}, "top_p"),
    ("/v1/chat/completions", {"presence_penalty": 9}, "presence_penalty"),
    ("/v1/chat/completions", {"logit_bias": {"1": 500}}, "logit_bias"),
    ("/v1/chat/completions", {"stop": [str(i) for i in range(17)]}, "stop"),
    ("/v1/chat/completions", {"messages": []}, "messages"),
    ("/v1/completions", {"prompt": ""}, "prompt"),
    ("/v1/completions", {"prompt": "Hi", "frequency_penalty": -3}, "frequency_penalty"),
    ("/v1/responses", {"input": "Hi", "temperature": 500}, "temperature"),
    ("/v1/responses", {"input": "Hi", "top_p": 3}, "top_p"),
    ("/api/chat", {"options": {"temperature": -5}}, "options.temperature"),
    ("/api/generate", {"prompt": "Hi", "options": {"top_p": 2}}, "options.top_p"),
    ("/api/generate", {"prompt": "Hi", "options": {"repeat_last_n": -3}},
     "options.repeat_last_n"),
])
def test_bad_sampling_values_are_refused_before_a_model_loads(path, body, param):
    """Each started the runner (and under max-loaded evicted a busy model) only to be refused
    by it: the value checks that need no model come before a load."""
    chat = [{"role": "user", "content": "Hi"}]
    body = {"model": "m", **({"messages": chat} if path in ("/v1/chat/completions",
                                                            "/api/chat") else {}), **body}
    with pytest.raises(InvalidRequestError) as e:
        check_without_model(path, json.dumps(body).encode())
    assert e.value.param == param, e.value
    good = {k: v for k, v in body.items() if k not in ("temperature", "top_p", "presence_penalty",
                                                       "logit_bias", "stop", "options",
                                                       "frequency_penalty")}
    good |= {"messages": chat} if "messages" in good else {}
    good |= {"prompt": "Hi"} if path == "/v1/completions" else {}
    check_without_model(path, json.dumps(good).encode())  # the rest of the body is fine


# ---- run-time LoRA --------------------------------------------------------------------------


def test_an_unload_during_a_load_that_fails_is_no_500(tmp_path):
    """The unload took the adapter out of the gateway's set while the load waited for its
    replicas; the load then failed and its undo raised KeyError (a 500)."""
    release = threading.Event()
    seen = threading.Event()

    async def answer(request: httpx.Request) -> httpx.Response:
        if request.url.path == "/v1/load_lora_adapter":
            seen.set()
            while not release.is_set():
                await asyncio.sleep(0.01)
            return httpx.Response(400, json={"error": {"message": "not an adapter",
                                                       "type": "invalid_request_error",
                                                       "param": "lora_path", "code": None}})
        return httpx.Response(200, json={})

    models = {"remote": {"source": "x.gguf", "replicas": 0, "urls": URLS[:1],
                         "enable-lora-runtime": True}}
    replicas = Replicas(answer)
    with gateway(tmp_path, replicas, models) as (client, sup):
        out: dict[str, httpx.Response] = {}

        def call(name: str, path: str, body: dict) -> None:
            out[name] = client.post(path, json=body)

        load = threading.Thread(target=call, args=(
            "load", "/v1/load_lora_adapter", {"lora_name": "sql", "lora_path": "/x.gguf"}))
        load.start()
        try:
            assert seen.wait(10)
            unload = threading.Thread(target=call, args=(
                "unload", "/v1/unload_lora_adapter", {"lora_name": "sql"}))
            unload.start()
            time.sleep(0.3)
        finally:
            release.set()
            load.join(10)
        unload.join(10)
        assert out["load"].status_code == 400, out["load"].text  # the replica's refusal
        assert out["unload"].status_code == 404, out["unload"].text  # it never loaded
        assert client.get("/v1/lora_adapters").json() == []
        assert sup.models["remote"].runtime_lora == {}


def test_a_replica_unhealthy_during_runtime_lora_changes_catches_up_when_it_comes_back(
        tmp_path):
    """Loads and unloads skip a replica out of the rotation; it came back into it without
    the adapter loaded meanwhile (the runner's 404 for requests naming it there), or with
    the one unloaded."""
    down: set[str] = set()

    async def answer(request: httpx.Request) -> httpx.Response:
        return httpx.Response(200, json={})

    replicas = Replicas(answer)
    original = replicas.__call__

    async def transport(request: httpx.Request) -> httpx.Response:
        origin = f"{request.url.scheme}://{request.url.netloc.decode()}"
        if request.url.path == "/metrics" and origin in down:
            return httpx.Response(503, text="busy")
        return await original(request)

    config = load_config({"poll-interval": 0.05, "models": {"remote": {
        "source": "x.gguf", "replicas": 0, "urls": URLS, "enable-lora-runtime": True}}}, FLAGS)
    app = create_gateway(config, GatewaySettings(), tmp_path)
    with TestClient(app) as client:
        sup: Supervisor = app.state["supervisor"]
        sup._http = httpx.AsyncClient(transport=httpx.MockTransport(transport))
        app.state["http"] = httpx.AsyncClient(transport=httpx.MockTransport(transport))
        state = sup.models["remote"]
        a, b = state.replicas

        def wait(status: str) -> None:
            deadline = time.monotonic() + 10
            while b.status != status:
                assert time.monotonic() < deadline, b.status
                time.sleep(0.02)

        for change, path, body in (
                ("load", "/v1/load_lora_adapter", {"lora_name": "sql",
                                                   "lora_path": "/sql.gguf"}),
                ("unload", "/v1/unload_lora_adapter", {"lora_name": "sql"})):
            down.add(b.id)
            wait("unhealthy")
            replicas.calls.clear()
            r = client.post(path, json=body)
            assert r.status_code == 200, r.text
            assert [(url, p) for url, p, _ in replicas.calls] == [
                (a.id, f"/v1/{change}_lora_adapter")]  # the one in the rotation
            down.clear()
            wait("ready")
            caught_up = [(p, body) for url, p, body in replicas.calls if url == b.id]
            if change == "load":
                assert caught_up == [("/v1/load_lora_adapter", {
                    "lora_name": "sql", "lora_path": "/sql.gguf", "load_inplace": True})]
            else:
                assert caught_up == [("/v1/unload_lora_adapter", {"lora_name": "sql"})]
        assert state.lora_missed == {}


# ---- a client that leaves (a real runner) ---------------------------------------------------


def gateway_metric(url: str, name: str, model: str, label: str = "") -> float:
    text = httpx.get(url + "/metrics", timeout=30).text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith(name + "{") and f'model_name="{model}"' in line
               and label in line)


def test_a_client_that_leaves_a_request_that_is_not_a_stream_aborts_it(tmp_path, model_path):
    """The gateway waited for the runner's head, sent only once the whole answer was made:
    the runner generated to the end, holding a slot and its KV, while retries piled up."""
    gw = start_gateway(tmp_path, {"alpha": {"source": model_path, "preload": True,
                                            "max-seqs": 4, "pool-blocks": 128,
                                            "threads": 2}})
    try:
        gw.wait_status("alpha", "loaded", timeout=120)
        aborted = 'finished_reason="abort"'
        before = gateway_metric(gw.url, "vllm:request_success_total", "alpha", aborted)
        for path, body in (
                ("/v1/completions", {"prompt": "Count to a thousand:"}),
                ("/completion", {"prompt": "Count to a thousand:"})):  # (llama-server's)
            try:  # the client gives up after 1 s
                r = httpx.post(gw.url + path, timeout=httpx.Timeout(1.0, connect=10), json={
                    "model": "alpha", "max_tokens": 2000, "ignore_eos": True, **body})
            except httpx.ReadTimeout:
                pass
            else:
                pytest.fail(f"{path} answered within 1 s: {r.status_code} {r.text[:500]}")
            deadline = time.monotonic() + 5
            while (gateway_metric(gw.url, "vllm:num_requests_running", "alpha")
                   + gateway_metric(gw.url, "vllm:num_requests_waiting", "alpha") > 0
                   and time.monotonic() < deadline):
                time.sleep(0.1)
            assert gateway_metric(gw.url, "vllm:num_requests_running", "alpha") == 0, path
            assert gw.status()["alpha"]["replicas"][0]["in_flight"] == 0
            assert gw.status()["alpha"]["active"] == 0
        after = gateway_metric(gw.url, "vllm:request_success_total", "alpha", aborted)
        assert after == before + 2  # aborted, not finished
        r = httpx.post(gw.url + "/v1/completions", timeout=60, json={
            "model": "alpha", "prompt": "Hi", "max_tokens": 2})
        assert r.status_code == 200, r.text
    finally:
        rc, out = stop(gw)
    assert rc == 0, out
    assert "Traceback" not in out, out


def test_a_client_that_leaves_while_its_model_loads_stops_counting_as_waiting(tmp_path,
                                                                               model_path):
    """It kept its place under max-waiting until the load ended: with max-waiting 1, the
    next client got 503 too_many_waiting though nobody was waiting any more."""
    gw = start_gateway(tmp_path, {"alpha": {"source": model_path, "max-seqs": 2,
                                            "pool-blocks": 64, "threads": 2}},
                       **{"max-waiting": 1, "load-timeout": 120})
    try:
        body = {"model": "alpha", "prompt": "Hi", "max_tokens": 2}
        with pytest.raises(httpx.ReadTimeout):  # gone long before a runner can be up
            httpx.post(gw.url + "/v1/completions", json=body,
                       timeout=httpx.Timeout(0.3, connect=10))
        def waiting() -> float:
            text = httpx.get(gw.url + "/metrics", timeout=30).text
            return float(re.search(r"^justllm_gateway_requests_waiting_for_load (\S+)$", text,
                                   re.M)[1])  # type: ignore[index]

        deadline = time.monotonic() + 10
        while waiting() > 0 and time.monotonic() < deadline:
            time.sleep(0.02)
        assert gw.status()["alpha"]["status"] == "loading"  # (the load goes on, for the next)
        assert waiting() == 0
        r = httpx.post(gw.url + "/v1/completions", json=body, timeout=120)
        assert r.status_code == 200, r.text
    finally:
        rc, out = stop(gw)
    assert rc == 0, out


def test_a_preload_that_fails_is_said_in_the_gateways_log(tmp_path):
    """A model that cannot preload (not a GGUF here) was said nowhere but in a request's
    answer: the gateway started, the model "unloaded"."""
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"not a model at all" * 100)
    gw = start_gateway(tmp_path, {"bad": {"source": str(bad), "preload": True}})
    try:
        gw.wait_status("bad", "failed")
        deadline = time.monotonic() + 30
        while "model bad: preload failed" not in gw.output() and time.monotonic() < deadline:
            time.sleep(0.1)
        assert "model bad: preload failed" in gw.output(), gw.output()
    finally:
        stop(gw)
