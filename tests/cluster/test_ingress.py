"""The ingress's app with fake deployment handles (no Ray cluster, no model): requests
forwarded by model and alias with their routing text, answers and streams relayed, a replica
that dies before its answer costs nothing (one more try), a stream cut mid-way ends with an
error event, errors keep the OpenAI shape, the API key is asked for, /metrics from the board."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import pytest
from litestar.testing import TestClient
from ray.exceptions import ActorDiedError, TaskCancelledError

from justllm.cluster.asgi import Head
from justllm.cluster.ingress import Ingress, create_ingress, disconnect_when_cancelled

JSON = Head(200, [("content-type", "application/json"), ("x-replica", "r1")])
SSE = Head(200, [("content-type", "text/event-stream"), ("x-replica", "r2")])
NDJSON_HEAD = Head(200, [("content-type", "application/x-ndjson")])


class Answer:
    """A streaming call's answer: items, then maybe an error."""

    def __init__(self, *items: Any, error: BaseException | None = None,
                 cancel_raises: bool = False) -> None:
        self.items = list(items)
        self.error = error
        self.cancelled = False
        self.cancel_raises = cancel_raises  # as Ray's does for a call whose replica died

    def __aiter__(self) -> Answer:
        return self

    async def __anext__(self) -> Any:
        if self.items:
            return self.items.pop(0)
        if self.error is not None:
            raise self.error
        raise StopAsyncIteration

    def cancel(self) -> None:
        self.cancelled = True
        if self.cancel_raises and self.error is not None:
            raise self.error


class Handle:
    """``handle.options(stream=True).http.remote(...)``: the next answer, the call recorded."""

    def __init__(self, *answers: Answer) -> None:
        self.answers = list(answers)
        self.calls: list[dict] = []
        self.http = self

    def options(self, **_: Any) -> Handle:
        return self

    def remote(self, method: str, path: str, query: str, headers: list, body: bytes,
               route: Any = None) -> Answer:
        self.calls.append({"method": method, "path": path, "query": query,
                           "headers": dict(headers), "body": json.loads(body) if body else None,
                           "route": route})
        return self.answers.pop(0)


class Board:
    def __init__(self, snapshot: dict) -> None:
        self.snapshot = self
        self.runtime_entries = _Entries()
        self.rows = snapshot

    async def remote(self) -> dict:
        return self.rows


class _Entries:
    async def remote(self) -> list:  # no LoRA adapter loaded at run time
        return []


def client(handle: Handle, api_key: str | None = None, board: Board | None = None
           ) -> TestClient:
    ingress = Ingress({"demo": handle}, {"demo": "demo", "gpt-4o-mini": "demo"},
                      board or Board({}), api_key)
    return TestClient(create_ingress(ingress))


def test_a_request_goes_to_its_models_deployment_with_its_routing_text():
    handle = Handle(Answer(JSON, b'{"ok": ', b"true}"))
    with client(handle) as c:
        r = c.post("/v1/chat/completions?x=1", headers={"X-Session-Id": "s1",
                                                        "Authorization": "Bearer k"},
                   json={"model": "gpt-4o-mini",
                         "messages": [{"role": "user", "content": "hi"}]})
    assert r.status_code == 200 and r.json() == {"ok": True}
    assert r.headers["x-replica"] == "r1" and r.headers["content-type"] == "application/json"
    (call,) = handle.calls
    assert call["path"] == "/v1/chat/completions" and call["query"] == "x=1"
    assert call["body"]["model"] == "demo"  # the alias, as the replicas serve it
    assert call["route"] == ("<user>hi\n", "s1")
    assert "authorization" not in call["headers"]  # the ingress's key stays at the ingress
    # The replica gets the request's id (one the ingress made: without Ray's proxy in front,
    # which puts one in the request); the answer carries none of the ingress's, as Ray's
    # proxy adds it (two made the header "id, id").
    assert call["headers"]["x-request-id"].startswith("req_")
    assert "x-request-id" not in r.headers


def test_slot_actions_say_they_are_not_offered():
    handle = Handle()
    with client(handle) as c:
        r = c.post("/slots/0?action=save", json={"filename": "slot0.bin"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "action", r.text
    assert r.json()["error"]["code"] == 400 and not handle.calls  # llama-server's shape


def test_a_clients_request_id_goes_to_the_replica_and_comes_back():
    handle = Handle(Answer(Head(200, [("content-type", "application/json"),
                                      ("x-request-id", "trace-7")]), b"{}"))
    with client(handle) as c:
        r = c.post("/v1/completions", headers={"X-Request-Id": "trace-7"},
                   json={"model": "demo", "prompt": "x"})
        missing = c.post("/v1/completions", headers={"X-Request-Id": "trace-8"},
                         json={"model": "nope", "prompt": "x"})
    assert r.status_code == 200 and "x-request-id" not in r.headers  # (Ray's proxy adds it)
    assert handle.calls[0]["headers"]["x-request-id"] == "trace-7"
    assert missing.status_code == 404 and "x-request-id" not in missing.headers


def test_model_cards_say_the_tokens_a_request_holds_as_the_replicas_report_it():
    """vLLM's max_model_len was on a single server's and a router's cards, not a cluster's
    (justllm chat --url fits its answers to it): the least its replicas report, an adapter
    its base model's; absent while no replica has reported."""
    rows = {"demo": {"0": {"stats": {"max_model_len": 4096}, "page": ""},
                     "1": {"stats": {"max_model_len": 2048}, "page": ""}}}
    for board, want in ((Board(rows), 2048), (Board({}), None)):
        ingress = Ingress({"demo": Handle()}, {"demo": "demo", "sql": "demo"}, board,
                          adapters=frozenset({"sql"}))
        with TestClient(create_ingress(ingress)) as c:
            cards = c.get("/v1/models").json()["data"]
            one = c.get("/v1/models/sql").json()
        assert [(m["id"], m.get("max_model_len")) for m in cards] == [("demo", want),
                                                                       ("sql", want)]
        assert one.get("max_model_len") == want

    class Gone:  # a board Ray is restarting
        async def remote(self) -> dict:
            raise RuntimeError("the actor died")

    board = Board({})
    board.snapshot = Gone()
    ingress = Ingress({"demo": Handle()}, {"demo": "demo"}, board)
    with TestClient(create_ingress(ingress)) as c:
        r = c.get("/v1/models")
    assert r.status_code == 200 and [m["id"] for m in r.json()["data"]] == ["demo"]


def test_a_lora_adapters_name_reaches_the_replica_and_skips_the_prefill():
    """An adapter (models.yaml's lora) is asked for by name: its base model's deployment gets
    the name unchanged (the replica applies the adapter; the base model's name would serve the
    base model), and a PD model serves it whole (its KV is the adapter's)."""
    handle, prefill = Handle(Answer(JSON, b"{}"), Answer(JSON, b"{}")), Handle()
    ingress = Ingress({"demo": handle}, {"demo": "demo", "sql": "demo"}, Board({}),
                      prefill={"demo": (prefill, 0)}, adapters=frozenset({"sql"}))
    with TestClient(create_ingress(ingress)) as c:
        assert c.post("/v1/completions", json={"model": "sql", "prompt": "x"}).status_code == 200
        assert c.post("/v1/completions", json={"model": "demo", "prompt": "x",
                                               "lora": [{"name": "sql"}]}).status_code == 200
        # an Ollama client's NAME:latest names the adapter too (it became the base model)
        handle.answers.append(Answer(NDJSON_HEAD, b'{"done": true}\n'))
        assert c.post("/api/generate", json={"model": "sql:latest", "prompt": "x",
                                             "stream": False}).status_code == 200
    assert [call["body"]["model"] for call in handle.calls] == ["sql", "demo", "sql"]
    assert prefill.calls == [] and [call["path"] for call in handle.calls] == [
        "/v1/completions", "/v1/completions", "/api/generate"]
    with TestClient(create_ingress(ingress)) as c:  # listed as a model whose parent is the base
        cards = c.get("/v1/models").json()["data"]
        assert c.get("/v1/models/sql").json() == cards[1]
        assert c.get("/v1/models/nope").json()["error"]["code"] == "model_not_found"
    assert [(m["id"], m.get("parent"), m.get("aliases")) for m in cards] == [
        ("demo", None, []), ("sql", "demo", None)]
    with TestClient(create_ingress(ingress)) as c:
        tags = c.get("/api/tags").json()["models"]
    assert [(m["name"], m["details"].get("parent_model")) for m in tags] == [
        ("demo:latest", None), ("sql:latest", "demo:latest")]


def test_a_stream_is_relayed_chunk_by_chunk():
    handle = Handle(Answer(SSE, b"data: 1\n\n", b"data: 2\n\n", b"data: [DONE]\n\n"))
    with client(handle) as c:
        r = c.post("/v1/completions", json={"model": "demo", "prompt": "x", "stream": True})
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
    assert r.text == "data: 1\n\ndata: 2\n\ndata: [DONE]\n\n"


def test_a_replica_that_dies_before_answering_costs_one_more_try():
    dead = Answer(JSON, b'{"half', error=ActorDiedError())
    handle = Handle(dead, Answer(JSON, b'{"ok": true}'))
    with client(handle) as c:
        r = c.post("/v1/completions", json={"model": "demo", "prompt": "x"})
    assert r.status_code == 200 and r.json() == {"ok": True} and dead.cancelled
    assert len(handle.calls) == 2
    handle = Handle(Answer(error=ActorDiedError()), Answer(error=ActorDiedError()))
    with client(handle) as c:
        r = c.post("/v1/completions", json={"model": "demo", "prompt": "x"})
    assert r.status_code == 503 and r.json()["error"]["code"] == "replica_failed"


def test_a_stream_whose_replica_dies_before_its_first_chunk_goes_once_more():
    """A stream queued on a replica that died had its headers sent and ended in an error
    event; one that has sent nothing yet is tried again, as a plain request is."""
    dead = Answer(SSE, error=ActorDiedError(), cancel_raises=True)
    handle = Handle(dead, Answer(SSE, b"data: 1\n\n", b"data: [DONE]\n\n"))
    with client(handle) as c:
        r = c.post("/v1/completions", json={"model": "demo", "prompt": "x", "stream": True})
    assert r.status_code == 200 and r.text == "data: 1\n\ndata: [DONE]\n\n"
    assert len(handle.calls) == 2 and dead.cancelled


class _Calls:
    """``handle.prefill`` / ``handle.pd_decode``: ``remote(...)`` gives the next answer."""

    def __init__(self, *answers: Any) -> None:
        self.answers = list(answers)

    def remote(self, *args: Any, **kwargs: Any) -> Any:
        return self.answers.pop(0)


def test_a_pd_decode_whose_prefill_replica_died_is_served_whole():
    """Ray's cancel of the dead call raised the death again, which escaped the fallback: a
    500, where router mode served the request whole."""
    kv = Answer(error=ActorDiedError(), cancel_raises=True)
    prefill = Handle()
    prefill.prefill = _Calls(kv)  # type: ignore[attr-defined]
    handle = Handle(Answer(JSON, b'{"ok": true}'))
    handle.pd_decode = _Calls(Answer(error=ActorDiedError(), cancel_raises=True))  # type: ignore[attr-defined]
    ingress = Ingress({"demo": handle}, {"demo": "demo"}, Board({}),
                      prefill={"demo": (prefill, 0)})
    with TestClient(create_ingress(ingress)) as c:
        r = c.post("/v1/completions", json={"model": "demo", "prompt": "a long prompt"})
    assert r.status_code == 200 and r.json() == {"ok": True}, r.text
    assert ingress.pd["demo", "prefill_failed"] == 1 and kv.cancelled


def test_a_stream_cut_mid_way_ends_with_an_error_event():
    handle = Handle(Answer(SSE, b"data: 1\n\n", error=ActorDiedError()))
    with client(handle) as c:
        r = c.post("/v1/completions", json={"model": "demo", "prompt": "x", "stream": True})
    events = [e for e in r.text.split("\n\n") if e]
    assert events[0] == "data: 1" and events[-1] == "data: [DONE]"
    assert json.loads(events[1].removeprefix("data: "))["error"]["code"] == "replica_failed"


def test_rays_cancelled_receive_reaches_the_app_as_a_disconnect():
    """Ray Serve's receive raises TaskCancelledError once its proxy stops relaying the
    request's messages (the client left); the app, listening for the disconnect while it
    streamed, let it escape after the response had started."""
    heard: list[Any] = []

    async def app(scope: Any, receive: Any, send: Any) -> None:
        heard.append(await receive())

    async def cancelled() -> Any:
        raise TaskCancelledError()

    asyncio.run(disconnect_when_cancelled(app)({"type": "http"}, cancelled, None))
    assert heard == [{"type": "http.disconnect"}]
    with pytest.raises(TaskCancelledError):  # only HTTP requests have a disconnect message
        asyncio.run(disconnect_when_cancelled(app)({"type": "lifespan"}, cancelled, None))


def test_a_lora_id_replicas_may_not_agree_on_is_refused():
    """Ids past models.yaml's adapters are each replica's own (runtime loads, in its order)."""
    handle = Handle(Answer(JSON, b"{}"))
    ingress = Ingress({"demo": handle}, {"demo": "demo"}, Board({}), fixed_lora={"demo": 1})
    with TestClient(create_ingress(ingress)) as c:
        ok = c.post("/v1/completions", json={"model": "demo", "prompt": "x", "lora": [{"id": 0}]})
        assert ok.status_code == 200
        r = c.post("/v1/completions", json={"model": "demo", "prompt": "x", "lora": [{"id": 1}]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "lora"
    assert "choose it by name" in r.json()["error"]["message"]
    assert len(handle.calls) == 1


def test_anthropic_and_responses_requests_go_to_the_models_deployment():
    """Router mode forwards /v1/messages, count_tokens, /v1/responses and its input_tokens;
    the cluster answered them 404. The client's x-api-key (Anthropic's SDK) stays at the
    ingress."""
    handle = Handle(*[Answer(JSON, b"{}") for _ in range(4)])
    with client(handle, api_key="sekrit") as c:
        for path, body in (("/v1/messages", {"model": "gpt-4o-mini", "max_tokens": 4,
                                             "messages": [{"role": "user", "content": "hi"}]}),
                           ("/v1/messages/count_tokens", {"model": "demo", "messages": []}),
                           ("/v1/responses", {"model": "demo", "input": "hi"}),
                           ("/v1/responses/input_tokens", {"model": "demo", "input": "hi"})):
            r = c.post(path, json=body, headers={"x-api-key": "sekrit"})
            assert r.status_code == 200, (path, r.text)
    assert [call["path"] for call in handle.calls] == [
        "/v1/messages", "/v1/messages/count_tokens", "/v1/responses",
        "/v1/responses/input_tokens"]
    assert handle.calls[0]["body"]["model"] == "demo"
    assert handle.calls[0]["route"][0] == "<user>hi\n"
    assert handle.calls[2]["route"][0] == "hi"
    # responses are not stored in the cluster: store goes as false, and what would need a
    # store is refused before any replica is asked
    assert handle.calls[2]["body"]["store"] is False
    assert "store" not in handle.calls[3]["body"]  # input_tokens has no store field
    assert all("x-api-key" not in call["headers"] for call in handle.calls)
    with client(Handle()) as c:
        for path, extra, param in [
                ("/v1/responses", {"store": True}, "store"),
                ("/responses", {"previous_response_id": "resp_1"}, "previous_response_id"),
                ("/v1/responses/input_tokens", {"previous_response_id": "r"},
                 "previous_response_id")]:
            r = c.post(path, json={"model": "demo", "input": "hi", **extra})
            assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text
            assert "not stored in the cluster" in r.json()["error"]["message"]


def test_token_routes_go_to_the_models_deployment():
    """/tokenize and /detokenize sit at the root, as on a runner, behind the API key."""
    handle = Handle(*[Answer(JSON, b"{}") for _ in range(2)])
    with client(handle, api_key="sekrit") as c:
        assert c.post("/tokenize", json={"model": "demo", "prompt": "hi"}).status_code == 401
        for path, body in (("/tokenize", {"model": "gpt-4o-mini", "prompt": "hi"}),
                           ("/detokenize", {"model": "demo", "tokens": [2]})):
            r = c.post(path, json=body, headers={"Authorization": "Bearer sekrit"})
            assert r.status_code == 200, (path, r.text)
        r = c.post("/tokenize", json={"model": "nope", "prompt": "hi"},
                   headers={"Authorization": "Bearer sekrit"})
        assert r.status_code == 404, r.text
    assert [call["path"] for call in handle.calls] == ["/tokenize", "/detokenize"]
    assert handle.calls[0]["body"]["model"] == "demo"  # an alias is the model's name


def test_llama_server_routes_go_to_the_models_deployment():
    """/apply-template, /completion(s), /infill, /embedding(s) and the OpenAI routes without
    /v1 by the body's
    model, /props by ?model= (a GET without a body), /props without one the cluster's own;
    behind the API key but /v1/health, as llama-server's."""
    handle = Handle(*[Answer(JSON, b"{}") for _ in range(14)])
    auth = {"Authorization": "Bearer sekrit"}
    with client(handle, api_key="sekrit") as c:
        assert c.get("/props").status_code == 401
        own = c.get("/props", headers=auth).json()
        assert own["role"] == "router" and own["build_info"].startswith("justllm ")
        for path in ("/apply-template", "/completion", "/completions", "/infill", "/embedding",
                     "/embeddings", "/chat/completions", "/responses",
                     "/responses/input_tokens", "/rerank", "/reranking", "/v1/rerank",
                     "/v1/reranking"):
            r = c.post(path, json={"model": "gpt-4o-mini", "messages": []}, headers=auth)
            assert r.status_code == 200, (path, r.text)
        r = c.get("/props", params={"model": "gpt-4o-mini"}, headers=auth)
        assert r.status_code == 200, r.text
        assert c.get("/props", params={"model": "nope"}, headers=auth).status_code == 404
        assert c.get("/v1/health").json() == {"status": "ok"}
    assert [(call["method"], call["path"]) for call in handle.calls] == [
        ("POST", "/apply-template"), ("POST", "/completion"), ("POST", "/completions"),
        ("POST", "/infill"), ("POST", "/embedding"), ("POST", "/embeddings"), ("POST", "/chat/completions"),
        ("POST", "/responses"), ("POST", "/responses/input_tokens"), ("POST", "/rerank"),
        ("POST", "/reranking"), ("POST", "/v1/rerank"), ("POST", "/v1/reranking"),
        ("GET", "/props")]
    assert handle.calls[0]["body"]["model"] == "demo"  # an alias is the model's name
    # by query too: the replica knows the model by its name (an alias was a 404 there)
    assert handle.calls[13]["body"] is None and handle.calls[13]["query"] == "model=demo"


def test_anthropic_errors_keep_anthropics_shape():
    with client(Handle(), api_key="sekrit") as c:
        r = c.post("/v1/messages", json={"model": "demo", "max_tokens": 4, "messages": []})
        assert r.status_code == 401 and r.json()["type"] == "error"
        assert r.json()["error"]["type"] == "authentication_error"
        r = c.post("/v1/messages", headers={"x-api-key": "sekrit"}, json={
            "model": "nope", "max_tokens": 4, "messages": []})
        assert r.status_code == 404 and r.json()["error"]["type"] == "not_found_error"


@pytest.mark.parametrize("path, body, last", [
    ("/v1/messages", {"max_tokens": 9, "messages": []}, "anthropic"),
    ("/v1/responses", {"input": "x"}, "responses"),
])
def test_a_stream_cut_mid_way_ends_in_its_apis_own_shape(path, body, last):
    first = (b'event: response.created\ndata: {"type":"response.created",'
             b'"sequence_number":0}\n\n' if last == "responses"
             else b'event: message_start\ndata: {"type":"message_start"}\n\n')
    handle = Handle(Answer(SSE, first, error=ActorDiedError()))
    with client(handle) as c:
        r = c.post(path, json={"model": "demo", "stream": True, **body})
    event, data = [e for e in r.text.split("\n\n") if e][-1].split("\n")
    assert event == "event: error"
    error = json.loads(data.removeprefix("data: "))
    if last == "responses":  # numbered after the replica's last event, as router mode does
        assert error["type"] == "error" and error["sequence_number"] == 1
        assert error["code"] == "replica_failed"
    else:
        assert error["type"] == "error" and error["error"]["type"] == "api_error"
    assert "[DONE]" not in r.text


@pytest.mark.parametrize("body, status, param", [
    ({"model": "nope", "prompt": "x"}, 404, "model"),
    ({"model": 5, "prompt": "x"}, 400, "model"),
])
def test_errors_keep_the_openai_shape(body, status, param):
    with client(Handle()) as c:
        r = c.post("/v1/completions", json=body)
        assert r.status_code == status and r.json()["error"]["param"] == param
        r = c.post("/v1/completions", content=b"{not json")
        assert r.status_code == 400 and "not valid JSON" in r.json()["error"]["message"]
        r = c.post("/api/generate", json={"model": "nope", "prompt": "x"})
        assert r.status_code == 404 and "not found" in r.json()["error"]  # Ollama's shape


def test_one_model_is_the_default_and_ollama_names_resolve():
    handle = Handle(Answer(JSON, b"{}"), Answer(JSON, b"{}"))
    with client(handle) as c:
        assert c.post("/v1/completions", json={"prompt": "x"}).status_code == 200
        assert c.post("/api/show", json={"name": "demo:latest"}).status_code == 200
    assert handle.calls[0]["body"]["model"] == "demo"
    assert handle.calls[1]["body"] == {"name": "demo"}


def test_the_api_key_is_asked_for_on_v1_and_api_but_not_health_or_metrics():
    with client(Handle(Answer(JSON, b"{}")), api_key="sekrit") as c:
        assert c.post("/v1/completions", json={"prompt": "x"}).status_code == 401
        assert c.get("/v1/models").status_code == 401
        assert c.get("/api/tags").status_code == 401
        ok = c.get("/v1/models", headers={"Authorization": "Bearer sekrit"})
        assert ok.status_code == 200 and ok.json()["data"][0]["id"] == "demo"
        assert ok.json()["data"][0]["aliases"] == ["gpt-4o-mini"]
        assert c.get("/health").status_code == 200
        assert c.get("/metrics").status_code == 200


def test_metrics_come_from_the_board():
    page = ('# TYPE vllm:num_requests_running gauge\n'
            'vllm:num_requests_running{model_name="demo"} 3.0\n')
    board = Board({"demo": {"r1": {"stats": {"healthy": True, "running": 3, "waiting": 0,
                                             "node_ip": "10.0.0.7"},
                                   "page": page, "age": 0.5}}})
    with client(Handle(), board=board) as c:
        page = c.get("/metrics")
    text = page.text
    assert page.headers["content-type"] == "text/plain; version=0.0.4; charset=utf-8"
    assert 'vllm:num_requests_running{model_name="demo",replica="r1"} 3.0' in text
    assert 'justllm_gateway_replica_up{model_name="demo",replica="r1",node="10.0.0.7"} 1' in text


class _LoraHandle(Handle):
    """A handle whose calls may name an adapter loaded at run time (``lora``)."""

    def __init__(self, *answers: Answer) -> None:
        super().__init__(*answers)
        self.loras: list[Any] = []

    def remote(self, *args: Any, lora: Any = None, **kwargs: Any) -> Answer:
        self.loras.append(lora)
        return super().remote(*args, **kwargs)


def test_an_adapters_latest_tag_is_a_404_off_ollamas_api_and_the_adapter_on_it():
    """``sql:latest`` on /v1 ran on the base model, without the adapter (a single server
    answers 404); on Ollama's routes a run-time adapter's tag was a 404."""
    from justllm.cluster.lora import RuntimeAdapter, RuntimeAdapters

    handle = _LoraHandle(*[Answer(JSON, b"{}") for _ in range(4)])
    runtime = RuntimeAdapters(frozenset({"demo"}))
    runtime.loaded["rt"] = RuntimeAdapter("rt", "demo", "/rt.gguf", "rt@1")
    ingress = Ingress({"demo": handle}, {"demo": "demo", "sql": "demo"}, Board({}),
                      adapters=frozenset({"sql"}), runtime=runtime)
    with TestClient(create_ingress(ingress)) as c:
        for name in ("sql:latest", "rt:latest"):
            r = c.post("/v1/completions", json={"model": name, "prompt": "x"})
            assert r.status_code == 404, r.text
            assert r.json()["error"]["code"] == "model_not_found", r.text
        r = c.post("/v1/messages", json={"model": "sql:latest", "max_tokens": 4,
                                         "messages": [{"role": "user", "content": "hi"}]})
        assert r.status_code == 404 and r.json()["type"] == "error", r.text
        assert handle.calls == []
        for path, name in (("/api/generate", "rt:latest"), ("/api/generate", "sql:latest"),
                           ("/v1/completions", "rt"), ("/v1/completions", "demo:latest")):
            r = c.post(path, json={"model": name, "prompt": "x", "stream": False})
            assert r.status_code == 200, (path, name, r.text)
    assert [call["body"]["model"] for call in handle.calls] == ["rt", "sql", "rt", "demo"]
    assert handle.loras == [("rt", "/rt.gguf"), None, ("rt", "/rt.gguf"), None]


@pytest.mark.parametrize(("path", "headers", "shape"), [
    ("/api/chat", [], lambda b: set(b) == {"error"} and isinstance(b["error"], str)),
    ("/v1/messages", [], lambda b: b["type"] == "error"
     and b["error"]["type"] == "invalid_request_error"),
    ("/v1/chat/completions", [("anthropic-version", "2023-06-01")],
     lambda b: b["type"] == "error"),
    ("/completion", [], lambda b: b["error"]["code"] == 400 and b["error"]["param"] == "model"),
    ("/v1/chat/completions", [], lambda b: b["error"]["type"] == "invalid_request_error"
     and b["error"]["param"] == "model" and "code" in b["error"]),
])
def test_a_replicas_adapter_failure_answers_in_the_apis_shape(path, headers, shape):
    """It was OpenAI's shape on every API."""
    from justllm.cluster.deployments import ModelReplica

    class Bare(ModelReplica):  # never started: nothing for Ray's async __del__ to stop
        def __del__(self) -> None:  # type: ignore[override]  # (not a coroutine dropped)
            pass

    replica = object.__new__(Bare)

    async def fails(name: str, file: str) -> None:
        raise RuntimeError("the file is gone")
    replica._runtime_adapter = fails  # type: ignore[method-assign]

    async def answer() -> list[Any]:
        return [item async for item in replica.http("POST", path, "", headers, b"{}",
                                                    lora=("rt", "/rt.gguf"))]

    head, body = asyncio.run(answer())
    assert isinstance(head, Head) and head.status == 400
    decoded = json.loads(body)
    assert shape(decoded), decoded
    assert "the LoRA adapter 'rt' could not be loaded: the file is gone" in json.dumps(decoded)


def test_a_deployment_that_failed_to_deploy_is_a_503_in_each_apis_shape():
    """Ray's DeploymentUnavailableError was re-raised: a bare 500 "internal server error"."""
    from ray.serve._private.common import DeploymentID
    from ray.serve.exceptions import DeploymentUnavailableError

    def failed() -> Answer:
        return Answer(error=DeploymentUnavailableError(DeploymentID("model-demo", "justllm")))

    handle = Handle(failed(), failed())
    with client(handle) as c:
        r = c.post("/v1/completions", json={"model": "demo", "prompt": "x"})
        ollama = c.post("/api/generate", json={"model": "demo", "prompt": "x"})
    assert r.status_code == 503 and r.json()["error"]["code"] == "model_failed", r.text
    assert "failed to deploy" in r.json()["error"]["message"]
    assert ollama.status_code == 503 and "failed to deploy" in ollama.json()["error"]
    assert len(handle.calls) == 2  # not tried again: it cannot answer


class _Never(Answer):
    """An answer that never comes (Ray's handle waiting for a replica that will not start)."""

    async def __anext__(self) -> Any:
        await asyncio.Event().wait()


def test_a_request_waiting_on_a_deployment_that_failed_is_a_503_not_a_hang(monkeypatch):
    """Ray raises DeploymentUnavailableError only sometimes: else its handle waits for a
    replica for ever, and every request to a model whose deployment failed hung."""
    import justllm.cluster.ingress as ingress_module

    monkeypatch.setattr(ingress_module, "STATUS_POLL", 0.05)
    looked: list[Any] = []
    handle = Handle(_Never(), _Never(), _Never())
    failing = [False, False, True]  # it fails on the third look

    def failed(h: Any) -> bool:
        looked.append(h)
        return failing.pop(0) if failing else True

    ingress = Ingress({"demo": handle}, {"demo": "demo"}, Board({}), None, failed=failed)
    with TestClient(create_ingress(ingress)) as c:
        r = c.post("/v1/completions", json={"model": "demo", "prompt": "x"}, timeout=30)
        ollama = c.post("/api/generate", json={"model": "demo", "prompt": "x"}, timeout=30)
    assert r.status_code == 503 and r.json()["error"]["code"] == "model_failed", r.text
    assert ollama.status_code == 503 and "failed to deploy" in ollama.json()["error"]
    assert len(looked) >= 3 and all(h is handle for h in looked)
    assert len(handle.calls) == 2  # not tried again


def test_ollamas_root_version_and_ps_answer_as_in_router_mode():
    """GET /, HEAD /, /api/version and /api/ps were 404s: Ollama clients that check on
    connect (ollama.Client.ps()) failed."""
    from justllm import __version__

    board = Board({"demo": {"r1": {"stats": {}, "page": "", "age": 0.1}}})
    with client(Handle(), board=board) as c:
        root, head = c.get("/"), c.head("/")
        version, ps = c.get("/api/version"), c.get("/api/ps")
    assert (root.status_code, root.text) == (200, "Ollama is running")
    assert head.status_code == 200
    assert version.json() == {"version": __version__}
    (model,) = ps.json()["models"]
    assert model["name"] == "demo:latest" and model["expires_at"] > "2100"
    with client(Handle(), board=Board({})) as c:  # scaled to zero: nothing up
        assert c.get("/api/ps").json() == {"models": []}


def test_a_page_it_serves_gets_cors_headers_once():
    """A loopback web app may read a cluster's answers as a single server's (its preflight
    answered without the key); a replica's own CORS headers, relayed, are not doubled
    (a browser refuses two ``Access-Control-Allow-Origin`` values)."""
    origin = "http://localhost:3000"
    handle = Handle(Answer(Head(200, [("content-type", "application/json"),
                                      ("access-control-allow-origin", origin)]), b"{}"))
    with client(handle, api_key="k") as c:
        pre = c.options("/v1/chat/completions", headers={
            "Origin": origin, "Access-Control-Request-Method": "POST",
            "Access-Control-Request-Headers": "authorization, content-type"})
        r = c.post("/v1/chat/completions", headers={"Origin": origin, "Authorization": "Bearer k"},
                   json={"model": "demo", "messages": [{"role": "user", "content": "hi"}]})
        other = c.post("/v1/chat/completions", headers={"Origin": "http://evil.example"},
                       json={"model": "demo", "messages": [{"role": "user", "content": "hi"}]})
    assert pre.status_code == 204 and pre.headers["access-control-allow-origin"] == origin
    assert "authorization" in pre.headers["access-control-allow-headers"]
    assert r.status_code == 200
    assert r.headers.get_list("access-control-allow-origin") == [origin]
    assert other.status_code == 403 and "access-control-allow-origin" not in other.headers
    assert len(handle.calls) == 1
