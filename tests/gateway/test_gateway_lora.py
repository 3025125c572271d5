"""LoRA adapters loaded at run time through the router-mode gateway (gateway/lora.py), with
real runners: the load reaches every replica of the base model, the adapter is a model of the
gateway, a replica that restarts gets it back before it serves, a file that is not an adapter
for the model is the runner's 400 and loads nowhere, and the unload takes it away again."""

from __future__ import annotations

import os
import shutil
import signal

import httpx
import pytest

from tests.gateway.test_gateway import runner_key, start_gateway, stop, wait_gone
from tests.gateway.test_replicas import FLAGS, replicas, wait_for
from tests.lora_files import write_adapter

PROMPT = "The capital of France is"


def adapters_on(replica: dict) -> list[str]:
    key = runner_key(replica["pid"])  # a runner asks for the gateway's key
    return [a["name"] for a in httpx.get(replica["url"] + "/v1/lora_adapters", timeout=30,
                                         headers={"Authorization": f"Bearer {key}"}).json()]


def complete(gw, model: str) -> httpx.Response:
    return httpx.post(gw.url + "/v1/completions", timeout=120, json={
        "model": model, "prompt": PROMPT, "max_tokens": 6, "temperature": 0,
        "ignore_eos": True})


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    d = tmp_path_factory.mktemp("gateway-lora")
    return {"a": write_adapter(d / "a.gguf", seed=1),
            "wrong": write_adapter(d / "wrong.gguf", seed=4, n_embd=512)}


def test_runtime_adapters_reach_every_replica_and_come_back_after_a_restart(
        tmp_path, model_path, files):
    gw = start_gateway(tmp_path, {
        "demo": {"source": model_path, "replicas": 2, "preload": True,
                 "enable-lora-runtime": True, **FLAGS},
        "plain": {"source": model_path, "lora": [f"fixed={files['a']}"], **FLAGS}})
    pids: list[int] = []
    try:
        wait_for("both replicas", lambda: [r["status"] for r in replicas(gw, "demo").values()]
                 == ["ready", "ready"], 120)
        load = {"lora_name": "sql", "lora_path": str(files["a"]), "model": "demo"}
        # Two models: which base model is needed; one without runtime loading says so.
        r = httpx.post(gw.url + "/v1/load_lora_adapter", json={**load, "model": None})
        assert r.status_code == 400 and "model is required" in r.text, r.text
        r = httpx.post(gw.url + "/v1/load_lora_adapter", json={**load, "model": "plain"})
        assert r.status_code == 404 and "enable-lora-runtime" in r.text, r.text
        r = httpx.post(gw.url + "/v1/load_lora_adapter", json={**load, "lora_name": "plain"})
        assert r.status_code == 400 and "already a model" in r.text, r.text
        for inplace in (False, True):  # models.yaml's adapters are changed there
            r = httpx.post(gw.url + "/v1/load_lora_adapter", json={
                **load, "lora_name": "fixed", "load_inplace": inplace})
            assert r.status_code == 400, r.text
            assert "'fixed' comes from models.yaml (model 'plain')" in r.json()["error"]["message"]
        # Not an adapter for this model: the runner's 400, and no replica keeps it.
        r = httpx.post(gw.url + "/v1/load_lora_adapter", timeout=120,
                       json={**load, "lora_path": str(files["wrong"])})
        assert r.status_code == 400 and r.json()["error"]["param"] == "lora_path", r.text
        assert all(adapters_on(p) == [] for p in replicas(gw, "demo").values())

        base = complete(gw, "demo").json()["choices"][0]["text"]
        r = httpx.post(gw.url + "/v1/load_lora_adapter", json=load, timeout=120)
        assert r.status_code == 200 and "sql" in r.text, r.text
        assert all(adapters_on(p) == ["sql"] for p in replicas(gw, "demo").values())
        models = {m["id"]: m for m in httpx.get(gw.url + "/v1/models").json()["data"]}
        assert models["sql"]["parent"] == "demo"
        r = complete(gw, "zz")  # a 404 names what there is, run-time adapters too
        assert r.status_code == 404 and r.json()["error"]["message"].endswith(
            "this server has: demo, plain, fixed, sql"), r.text
        # no id: each replica numbers run-time adapters in its own order (refused below)
        fixed = {"id": 0, "name": "fixed", "path": str(files["a"]), "scale": 1.0,
                 "model": "plain"}
        assert httpx.get(gw.url + "/v1/lora_adapters").json() == [
            {"id": None, "name": "sql", "path": str(files["a"]), "scale": 1.0, "model": "demo"},
            fixed]
        answer = complete(gw, "sql").json()
        assert answer["model"] == "sql" and answer["choices"][0]["text"] != base
        r = httpx.post(gw.url + "/v1/load_lora_adapter", json=load)
        assert r.status_code == 400 and "load_inplace" in r.text, r.text
        # In place with a file the runners refuse: every replica keeps the adapter it had.
        r = httpx.post(gw.url + "/v1/load_lora_adapter", timeout=120, json={
            **load, "load_inplace": True, "lora_path": str(files["wrong"])})
        assert r.status_code == 400, r.text
        assert all(adapters_on(p) == ["sql"] for p in replicas(gw, "demo").values())
        assert complete(gw, "sql").json()["choices"] == answer["choices"]

        # A replica killed: the one started in its place loads the adapter before it serves.
        victim = replicas(gw, "demo")["1"]
        os.kill(victim["pid"], signal.SIGKILL)
        back = wait_for("replica 1 back", lambda: (p := replicas(gw, "demo")["1"])["status"]
                        == "ready" and p["pid"] != victim["pid"] and p, 120)
        assert adapters_on(back) == ["sql"]
        for _ in range(4):  # whichever replica answers
            assert complete(gw, "sql").json()["choices"][0]["text"] == \
                answer["choices"][0]["text"]
        # An adapter whose file is gone when a replica restarts: requests for it skip that
        # replica (it answered them 404 while the gateway listed the adapter), and once no
        # replica holds it the gateway forgets it.
        copy = tmp_path / "gone.gguf"
        shutil.copy(files["a"], copy)
        r = httpx.post(gw.url + "/v1/load_lora_adapter", timeout=120, json={
            **load, "lora_name": "gone", "lora_path": str(copy)})
        assert r.status_code == 200, r.text
        copy.unlink()
        for rid in ("1", "0"):
            victim = replicas(gw, "demo")[rid]
            os.kill(victim["pid"], signal.SIGKILL)
            back = wait_for(f"replica {rid} back", lambda rid=rid, victim=victim: (
                p := replicas(gw, "demo")[rid])["status"] == "ready"
                and p["pid"] != victim["pid"] and p, 120)
            assert adapters_on(back) == ["sql"]
            if rid == "1":
                for _ in range(4):  # only replica 0 holds it: every one served there
                    r = complete(gw, "gone")
                    assert r.status_code == 200 and r.headers["x-replica"] == "0", r.text
        listed = {m["id"] for m in httpx.get(gw.url + "/v1/models").json()["data"]}
        assert "gone" not in listed and "sql" in listed
        assert complete(gw, "gone").status_code == 404
        # By name the field is the same adapter on every replica; by id it was whatever each
        # replica loaded under that id (a restart reorders them): refused.
        r = httpx.post(gw.url + "/v1/completions", timeout=120, json={
            "model": "demo", "prompt": PROMPT, "max_tokens": 6, "temperature": 0,
            "ignore_eos": True, "lora": [{"name": "sql"}]})
        assert r.json()["choices"][0]["text"] == answer["choices"][0]["text"], r.text
        r = httpx.post(gw.url + "/v1/completions", timeout=120, json={
            "model": "demo", "prompt": PROMPT, "max_tokens": 6, "lora": [{"id": 0}]})
        assert r.status_code == 400 and r.json()["error"]["param"] == "lora", r.text
        assert "choose it by name" in r.json()["error"]["message"]

        r = httpx.post(gw.url + "/v1/unload_lora_adapter", json={"lora_name": "sql"},
                       timeout=120)
        assert r.status_code == 200, r.text
        assert all(adapters_on(p) == [] for p in replicas(gw, "demo").values())
        assert "sql" not in {m["id"] for m in httpx.get(gw.url + "/v1/models").json()["data"]}
        assert httpx.get(gw.url + "/v1/lora_adapters").json() == [fixed]
        assert complete(gw, "sql").status_code == 404
        r = httpx.post(gw.url + "/v1/unload_lora_adapter", json={"lora_name": "sql"})
        assert r.status_code == 404, r.text
        pids = [p["pid"] for p in replicas(gw, "demo").values()]
    finally:
        rc, out = stop(gw)
    assert rc == 0, out
    wait_gone(pids)
