"""Ollama's API through router mode, with the real ollama client and real runners: chat and
generate reach their model's runner (streamed as NDJSON), keep_alive 0 unloads the model as
Ollama does, the listings name every model, and errors have Ollama's shape."""

from __future__ import annotations

import httpx
import ollama
import pytest

from tests.gateway.test_gateway import RUNNER_FLAGS, start_gateway, stop, wait_gone


def test_ollama_clients_work_against_the_gateway(tmp_path, model_path):
    gw = start_gateway(tmp_path, {
        "alpha": {"source": model_path, "chat-template": "gemma", "aliases": ["ä/b"],
                  **RUNNER_FLAGS},
        "beta": {"source": model_path, **RUNNER_FLAGS}})
    try:
        client = ollama.Client(host=gw.url)
        assert httpx.get(gw.url + "/", timeout=10).text == "Ollama is running"
        tags = {m.model for m in client.list().models}
        assert tags == {"alpha:latest", "beta:latest"}
        assert client.ps().models == []

        parts = list(client.chat(model="alpha:latest", stream=True,
                                 messages=[{"role": "user", "content": "Say hello."}],
                                 options={"num_predict": 6, "temperature": 0}))
        assert parts[-1].done and parts[-1].eval_count <= 6
        # Each answer names the model as the request did, as Ollama's and a single server's
        # do (the runner's own name came back: "alpha")
        assert {p.model for p in parts} == {"alpha:latest"}
        # It waited for alpha to load: load_duration says how long (it was 0 through the
        # gateway), and total_duration counts it.
        assert 1e8 < parts[-1].load_duration < parts[-1].total_duration < 120e9
        assert "".join(p.message.content for p in parts)
        assert [m.model for m in client.ps().models] == ["alpha:latest"]

        # keep_alive 0: the model is unloaded once the request is done (Ollama's meaning).
        answer = client.generate(model="beta", prompt="The sky is", keep_alive=0,
                                 options={"num_predict": 4, "temperature": 0})
        assert answer.done and answer.response and answer.load_duration > 1e8
        gw.wait_status("beta", "unloaded", timeout=30)
        assert gw.status()["alpha"]["status"] == "loaded"
        # keep_alive 0 with nothing to generate: Ollama's "unload" (answered "load", and an
        # unloaded model was loaded first to be unloaded).
        loads = gw.status()["beta"]["loads"]
        for path, body in (("/api/generate", {"model": "beta"}),
                           ("/api/chat", {"model": "beta", "messages": []})):
            r = httpx.post(gw.url + path, json={**body, "keep_alive": 0}, timeout=60).json()
            assert r["done"] and r["done_reason"] == "unload", r
        assert gw.status()["beta"]["loads"] == loads and gw.status()["beta"]["status"] == "unloaded"

        said = client.chat(model="ä/b", messages=[{"role": "user", "content": "Hi"}],
                           options={"num_predict": 2, "temperature": 0})
        assert said.model == "ä/b" and said.message.content
        embedded = client.embed(model="ä/b", input=["one", "two"])
        assert embedded.model == "ä/b"
        vectors = embedded.embeddings
        assert len(vectors) == 2 and len(vectors[0]) > 100
        assert embedded.load_duration == 0  # alpha was loaded already
        assert client.show("alpha").details.format == "gguf"

        with pytest.raises(ollama.ResponseError) as e:
            client.chat(model="gamma", messages=[{"role": "user", "content": "Hi"}])
        assert e.value.status_code == 404 and 'model "gamma" not found' in e.value.error
        bad = httpx.post(gw.url + "/api/generate", timeout=30, json={
            "model": "alpha", "prompt": "Hi", "keep_alive": "soon"})
        assert bad.status_code == 400 and "keep_alive" in bad.json()["error"]
        # An int past a float's range (a 500) is refused as any keep_alive past Go's longest;
        # null is absent, as a single server and Ollama read it (it was a 400).
        bad = httpx.post(gw.url + "/api/generate", timeout=30, json={
            "model": "alpha", "prompt": "Hi", "keep_alive": 10**400})
        assert bad.status_code == 400 and "longest duration" in bad.json()["error"], bad.text
        r = httpx.post(gw.url + "/api/generate", timeout=60, json={
            "model": "alpha", "prompt": "Hi", "stream": False, "keep_alive": None,
            "options": {"num_predict": 1}})
        assert r.status_code == 200 and r.json()["done"], r.text
        pids = gw.runner_pids()
        r = httpx.post(gw.url + "/api/generate", json={"model": "alpha", "keep_alive": 0},
                       timeout=60).json()
        assert r["done_reason"] == "unload" and r["response"] == ""
        gw.wait_status("alpha", "unloaded", timeout=30)
    finally:
        rc, out = stop(gw)
    assert rc == 0, out
    wait_gone(pids)


def test_api_show_of_an_unloaded_model_it_answered_before_loads_nothing(tmp_path, model_path):
    """/api/show loaded its model (and under max-loaded evicted another); Ollama's never loads
    one, and editor plugins ask it of every listed model. Once a runner has answered, the same
    question is answered from that answer while the model is unloaded."""
    gw = start_gateway(tmp_path, {"alpha": {"source": model_path, **RUNNER_FLAGS},
                                  "beta": {"source": model_path, **RUNNER_FLAGS}},
                       **{"max-loaded": 1})
    try:
        first = httpx.post(gw.url + "/api/show", json={"model": "beta"}, timeout=120)
        assert first.status_code == 200 and gw.status()["beta"]["status"] == "loaded"
        assert httpx.post(gw.url + "/api/generate", timeout=120, json={
            "model": "alpha", "prompt": "Hi", "stream": False,
            "options": {"num_predict": 1}}).status_code == 200
        gw.wait_status("beta", "unloaded")
        again = httpx.post(gw.url + "/api/show", json={"model": "beta"}, timeout=120)
        assert again.status_code == 200 and again.json() == first.json()
        status = gw.status()
        assert (status["alpha"]["status"], status["beta"]["status"]) == ("loaded", "unloaded")
        assert status["beta"]["loads"] == 1
        # another question (its older field name) is the runner's to answer: loaded for it
        other = httpx.post(gw.url + "/api/show", json={"name": "beta"}, timeout=120)
        assert other.status_code == 200 and gw.status()["beta"]["loads"] == 2
    finally:
        stop(gw)
