"""LoRA adapters loaded at run time on a Ray cluster (justllm/cluster/lora.py), with fake
deployment handles and board (no Ray, no model): the registry's keys, the ingress's load (one
replica checks the file under the adapter's multiplexed model id), requests routed to the base
model's deployment with that id, replacement, unload, and every refusal in the OpenAI shape.
The real thing, on a real Ray cluster: tests/cluster/test_ray_cluster.py."""

from __future__ import annotations

import asyncio
import json
from typing import Any

from litestar.testing import TestClient

from justllm.cluster.asgi import Head
from justllm.cluster.ingress import Ingress, create_ingress
from justllm.cluster.lora import RuntimeAdapters, stale_adapters

JSON = Head(200, [("content-type", "application/json"), ("x-replica", "r1")])


class Answer:
    def __init__(self, *items: Any) -> None:
        self.items = list(items)

    def __aiter__(self) -> Answer:
        return self

    async def __anext__(self) -> Any:
        if self.items:
            return self.items.pop(0)
        raise StopAsyncIteration

    def cancel(self) -> None:
        pass


class Handle:
    """A model deployment's handle: ``options(...)`` recorded with each call; ``load_adapter``
    refuses the paths in ``refuse`` (with llama.cpp's reason) and ``fail`` raises."""

    def __init__(self, refuse: dict[str, str] | None = None, fail: bool = False) -> None:
        self.refuse = refuse or {}
        self.fail = fail
        self.opts: dict[str, Any] = {}
        self.calls: list[dict] = []
        self.loads: list[tuple[str, str, str]] = []
        self.http = _Method(self._http)
        self.load_adapter = _Method(self._load)

    def options(self, **opts: Any) -> Handle:
        self.opts = opts
        return self

    def _http(self, method: str, path: str, query: str, headers: list, body: bytes,
              route: Any = None, lora: Any = None) -> Answer:
        self.calls.append({"body": json.loads(body), "lora": lora,
                           "model_id": self.opts.get("multiplexed_model_id")})
        return Answer(JSON, b"{}")

    async def _load(self, name: str, path: str) -> str:
        await asyncio.sleep(0.05)  # a replica's load takes a while: another request can come
        if self.fail:
            raise RuntimeError("the replica died")
        self.loads.append((name, path, self.opts["multiplexed_model_id"]))
        return self.refuse.get(path, "")


class _Method:
    def __init__(self, fn: Any) -> None:
        self.remote = fn


class Board:
    def __init__(self, entries: list[dict] | None = None) -> None:
        self.runtime: list[dict] = []
        self.entries = entries or []
        self.set_runtime = _Method(self._set)
        self.runtime_entries = _Method(self._entries)

    async def _set(self, current: dict, entries: list[dict] | None = None) -> None:
        self.runtime.append(current)
        self.entries = entries or []

    async def _entries(self) -> list[dict]:
        return self.entries


def cluster(handle: Handle, runtime: frozenset[str] = frozenset({"demo"}),
            board: Board | None = None) -> tuple[TestClient, Ingress, Board]:
    board = board or Board()
    ingress = Ingress({"demo": handle, "other": Handle()},
                      {"demo": "demo", "other": "other", "sql": "demo"}, board,
                      adapters=frozenset({"sql"}), runtime=RuntimeAdapters(runtime))
    return TestClient(create_ingress(ingress)), ingress, board


def test_the_registry_gives_each_load_its_own_key_and_the_board_the_current_ones():
    reg = RuntimeAdapters(frozenset({"demo", "other"}))
    a = reg.propose("chat", "demo", "/a.gguf")
    assert reg.current() == {"demo": [a.key], "other": []}  # pending: current already
    assert reg.commit(a) is None and reg.loaded == {"chat": a}
    b = reg.propose("chat", "demo", "/b.gguf")
    assert b.key != a.key and reg.commit(b) == a and reg.current() == {"demo": [b.key],
                                                                      "other": []}
    c = reg.propose("x", "other", "/c.gguf")
    reg.drop(c)
    assert reg.current()["other"] == [] and reg.unload("chat") == b and reg.unload("chat") is None
    held = {"chat": a.key, "x": "x@9"}
    assert stale_adapters(held, [a.key]) == ["x"]
    assert stale_adapters(held, []) == ["chat", "x"]
    assert stale_adapters(held, None) == []  # the board does not know: keep everything


def test_a_loaded_adapter_is_a_model_served_by_its_base_models_replicas():
    handle = Handle()
    c, ingress, board = cluster(handle)
    with c:
        r = c.post("/v1/load_lora_adapter", json={"lora_name": "pirate",
                                                  "lora_path": "/ad/p.gguf"})
        assert r.status_code == 400 and r.json()["error"]["param"] == "model"  # two models
        r = c.post("/v1/load_lora_adapter", json={"lora_name": "pirate", "model": "demo",
                                                  "lora_path": "/ad/p.gguf"})
        assert r.status_code == 200 and "pirate" in r.text
        key = ingress.runtime.loaded["pirate"].key
        assert handle.loads == [("pirate", "/ad/p.gguf", key)]  # checked on one replica
        assert board.runtime[-1] == {"demo": [key]}
        r = c.post("/v1/completions", json={"model": "nope", "prompt": "x"})  # (as router
        assert r.json()["error"]["message"].endswith(  # mode's, with run-time adapters)
            "this cluster has: demo, other, sql, pirate"), r.text
        r = c.post("/v1/completions", json={"model": "pirate", "prompt": "x"})
        assert r.status_code == 200
        assert c.post("/v1/completions", json={"model": "demo", "prompt": "x"}).status_code == 200
        cards = {m["id"]: m.get("parent") for m in c.get("/v1/models").json()["data"]}
    assert cards["pirate"] == "demo"
    named, base = handle.calls
    assert named["body"]["model"] == "pirate" and named["model_id"] == key
    assert named["lora"] == ("pirate", "/ad/p.gguf")
    assert base["body"]["model"] == "demo" and base["lora"] is None and base["model_id"] is None


def test_a_load_in_place_is_a_new_key_and_an_unload_ends_the_name():
    handle = Handle()
    c, ingress, board = cluster(handle)
    with c:
        load = {"lora_name": "pirate", "lora_path": "/ad/p.gguf", "model": "demo"}
        assert c.post("/v1/load_lora_adapter", json=load).status_code == 200
        first = ingress.runtime.loaded["pirate"].key
        again = c.post("/v1/load_lora_adapter", json=load)
        assert again.status_code == 400 and "load_inplace" in again.json()["error"]["message"]
        r = c.post("/v1/load_lora_adapter", json={**load, "lora_path": "/ad/q.gguf",
                                                  "load_inplace": True})
        assert r.status_code == 200
        second = ingress.runtime.loaded["pirate"]
        assert second.key != first and second.path == "/ad/q.gguf"
        assert board.runtime[-1] == {"demo": [second.key]}  # replicas drop the first
        c.post("/v1/completions", json={"model": "pirate", "prompt": "x"})
        assert handle.calls[-1]["model_id"] == second.key
        assert c.post("/v1/unload_lora_adapter", json={"lora_name": "pirate"}).status_code == 200
        assert board.runtime[-1] == {"demo": []}
        gone = c.post("/v1/completions", json={"model": "pirate", "prompt": "x"})
        assert gone.status_code == 404 and gone.json()["error"]["code"] == "model_not_found"
        r = c.post("/v1/unload_lora_adapter", json={"lora_name": "pirate"})
        assert r.status_code == 404 and r.json()["error"]["type"] == "not_found_error"
        r = c.post("/v1/unload_lora_adapter", json={"lora_name": "sql"})  # from cluster.yaml
        assert r.status_code == 400 and "cluster.yaml" in r.json()["error"]["message"]


def test_refusals_are_the_clients_errors_and_register_nothing():
    handle = Handle(refuse={"/bad.gguf": "not a LoRA adapter for this model"})
    c, ingress, board = cluster(handle)
    with c:
        r = c.post("/v1/load_lora_adapter", json={"lora_name": "b", "lora_path": "/bad.gguf",
                                                  "model": "demo"})
        assert r.status_code == 400 and r.json()["error"]["param"] == "lora_path"
        assert "not a LoRA adapter" in r.json()["error"]["message"]
        assert ingress.runtime.loaded == {} and board.runtime[-1] == {"demo": []}
        for name in ("sql", "other", "demo"):  # an adapter of cluster.yaml, models
            r = c.post("/v1/load_lora_adapter", json={"lora_name": name, "lora_path": "/a",
                                                      "model": "demo"})
            assert r.status_code == 400 and r.json()["error"]["param"] == "lora_name"
        r = c.post("/v1/load_lora_adapter", json={"lora_name": "a b", "lora_path": "/a",
                                                  "model": "demo"})
        assert r.status_code == 400
        r = c.post("/v1/load_lora_adapter", json={"lora_name": "a", "lora_path": "/a",
                                                  "model": "other"})
        assert r.status_code == 404 and "enable-lora-runtime" in r.json()["error"]["message"]
        r = c.post("/v1/load_lora_adapter", json={"lora_name": "a", "lora_path": "/a",
                                                  "model": "nope"})
        assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"
        r = c.post("/v1/load_lora_adapter", json={"lora_name": "a", "lora_path": "/a",
                                                  "model": "demo", "scale": 2})
        assert r.status_code == 400  # unknown fields are refused, not ignored
    assert handle.loads == [("b", "/bad.gguf", handle.loads[0][2])]
    dead = Handle(fail=True)
    c, ingress, board = cluster(dead)
    with c:
        r = c.post("/v1/load_lora_adapter", json={"lora_name": "b", "lora_path": "/a.gguf",
                                                  "model": "demo"})
    assert r.status_code == 503 and r.json()["error"]["code"] == "replica_failed"
    assert ingress.runtime.loaded == {} and board.runtime[-1] == {"demo": []}


def test_the_lora_field_may_name_one_runtime_adapter():
    """llama-server's ``lora`` field naming an adapter loaded at run time routes the request
    as naming it as ``model`` does (the base model's name then goes to the replica, an alias
    as the model's name); two such adapters are the client's 400, since Ray routes a request
    by one multiplexed model id."""
    handle = Handle()
    c, ingress, _ = cluster(handle)
    with c:
        for name, path in (("pirate", "/p.gguf"), ("poet", "/q.gguf")):
            assert c.post("/v1/load_lora_adapter", json={
                "lora_name": name, "lora_path": path, "model": "demo"}).status_code == 200
        r = c.post("/v1/completions", json={"model": "demo", "prompt": "x",
                                            "lora": [{"name": "poet", "scale": 0.5}]})
        assert r.status_code == 200
        r = c.post("/v1/completions", json={"model": "pirate", "prompt": "x",
                                            "lora": [{"name": "pirate"}]})
        assert r.status_code == 200
        for two in ({"model": "pirate", "lora": [{"name": "poet"}]},
                    {"model": "demo", "lora": [{"name": "poet"}, {"name": "pirate"}]}):
            r = c.post("/v1/completions", json={"prompt": "x", **two})
            assert r.status_code == 400 and r.json()["error"]["param"] == "lora"
            assert "at most one LoRA adapter loaded at run time" in r.json()["error"]["message"]
    poet, pirate = ingress.runtime.loaded["poet"], ingress.runtime.loaded["pirate"]
    by_field, by_both = handle.calls
    assert by_field["model_id"] == poet.key and by_field["lora"] == ("poet", "/q.gguf")
    assert by_field["body"]["model"] == "demo" and by_field["body"]["lora"] == [
        {"name": "poet", "scale": 0.5}]
    assert by_both["model_id"] == pirate.key and by_both["body"]["model"] == "pirate"


def test_loads_and_unloads_at_once_take_turns():
    """Two loads of one name both said "added" (one file won, by chance); an unload beside a
    load was a 404 and the name was loaded after it."""
    import httpx

    from justllm.cluster.ingress import create_ingress

    async def main() -> None:
        board = Board()
        ingress = Ingress({"demo": Handle()}, {"demo": "demo"}, board,
                          runtime=RuntimeAdapters(frozenset({"demo"})))
        # (httpx's ASGI transport runs requests at once; Litestar's test client one by one)
        transport = httpx.ASGITransport(app=create_ingress(ingress))
        async with httpx.AsyncClient(transport=transport, base_url="http://ingress") as c:
            def load(path: str):
                return c.post("/v1/load_lora_adapter", json={
                    "lora_name": "x", "lora_path": path, "model": "demo"})

            a, b = await asyncio.gather(load("/a.gguf"), load("/b.gguf"))
            assert sorted([a.status_code, b.status_code]) == [200, 400], (a.text, b.text)
            winner = "/a.gguf" if a.status_code == 200 else "/b.gguf"
            assert ingress.runtime.loaded["x"].path == winner
            on, off = await asyncio.gather(
                c.post("/v1/load_lora_adapter", json={
                    "lora_name": "y", "lora_path": "/y.gguf", "model": "demo"}),
                c.post("/v1/unload_lora_adapter", json={"lora_name": "y"}))
            assert on.status_code == 200 and off.status_code == 200, (on.text, off.text)
            assert "y" not in ingress.runtime.loaded

    asyncio.run(main())


def test_a_restarted_ingress_takes_the_registry_back_from_the_board():
    """Ray restarts a crashed ingress: it forgot every adapter loaded at run time (a 404 for
    each) while the replicas kept them."""
    first = Board()
    c, ingress, _ = cluster(Handle(), board=first)
    with c:
        r = c.post("/v1/load_lora_adapter", json={"lora_name": "pirate",
                                                  "lora_path": "/ad/p.gguf", "model": "demo"})
        assert r.status_code == 200, r.text
    key = ingress.runtime.loaded["pirate"].key
    # the new ingress, on the same board (the board is its own deployment: it lives on)
    handle = Handle()
    c, again, board = cluster(handle, board=first)
    with c:
        r = c.post("/v1/completions", json={"model": "pirate", "prompt": "x"})
        assert r.status_code == 200, r.text
        assert handle.calls[-1]["model_id"] == key
        r = c.post("/v1/load_lora_adapter", json={"lora_name": "sailor",
                                                  "lora_path": "/ad/s.gguf", "model": "demo"})
    assert again.runtime.loaded["sailor"].key != key  # keys go on: none is reused
    assert sorted(e["name"] for e in board.entries) == ["pirate", "sailor"]
    # a model that no longer takes run-time loads (redeployed without): not restored
    c, other, _ = cluster(Handle(), runtime=frozenset(), board=Board(list(board.entries)))
    with c:
        pass
    assert other.runtime.loaded == {}
