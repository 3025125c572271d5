"""Anthropic's Messages API and OpenAI's Responses API through router mode, with the real
clients and a real runner: requests reach their model's runner (streams relayed), and the
gateway's own errors (an unknown model) have each API's shape."""

from __future__ import annotations

import anthropic
import httpx
import numpy as np
import openai
import pytest

from tests.gateway.test_gateway import RUNNER_FLAGS, start_gateway, stop, wait_gone
from tests.lora_files import write_adapter
from tests.server.test_llama_server import slot_action_refused

HELLO = [{"role": "user", "content": "Say hello."}]


def test_anthropic_and_responses_clients_work_against_the_gateway(tmp_path, model_path):
    adapter = write_adapter(tmp_path / "a.gguf", seed=1)
    gw = start_gateway(tmp_path, {
        "alpha": {"source": model_path, "chat-template": "gemma", "lora": [f"sql={adapter}"],
                  **RUNNER_FLAGS}})
    try:
        # A LoRA adapter is a model name of its own: listed with its parent, routed to it.
        listed = {m["id"]: m for m in httpx.get(gw.url + "/v1/models", timeout=30).json()["data"]}
        assert listed["sql"]["parent"] == "alpha"
        # with the id the lora field takes for it, as a runner lists them
        assert httpx.get(gw.url + "/v1/lora_adapters", timeout=30).json() == [
            {"id": 0, "name": "sql", "path": str(adapter), "scale": 1.0, "model": "alpha"}]
        texts = [httpx.post(gw.url + "/v1/completions", timeout=120, json={
            "model": name, "prompt": "The capital of France is", "max_tokens": 8,
            "temperature": 0}).json()["choices"][0]["text"] for name in ("alpha", "sql")]
        assert texts[0] != texts[1]  # the runner applied the adapter
        # on Ollama's routes too, as a model made with ADAPTER
        tags = {m["name"]: m for m in
                httpx.get(gw.url + "/api/tags", timeout=30).json()["models"]}
        assert tags["sql:latest"]["details"]["parent_model"] == "alpha:latest"
        # a model's details read off its GGUF, as a single server gives them (they were
        # {"format": "gguf"} alone, and the digest blank)
        assert tags["alpha:latest"]["details"] == {
            "parent_model": "", "format": "gguf", "family": "gemma3", "families": ["gemma3"],
            "parameter_size": tags["alpha:latest"]["details"]["parameter_size"],
            "quantization_level": "Q4_K_M"}
        assert tags["alpha:latest"]["details"]["parameter_size"].endswith("M")
        # Ollama's health checks: HEAD answers as GET does (it was a 405 here)
        for path in ("/api/tags", "/api/version", "/health"):
            assert httpx.head(gw.url + path, timeout=30).status_code == 200, path
        r = httpx.post(gw.url + "/api/generate", timeout=120, json={
            "model": "sql:latest", "prompt": "The capital of France is", "raw": True,
            "stream": False, "options": {"temperature": 0, "num_predict": 8,
                                         "repeat_penalty": 1.0}})
        assert r.status_code == 200 and r.json()["model"] == "sql:latest", r.text
        assert r.json()["response"] and texts[1].startswith(r.json()["response"])

        claude = anthropic.Anthropic(base_url=gw.url, api_key="unused", max_retries=0,
                                     timeout=120)
        # greedy: the text below must not be empty, as a sampled answer that ends at once is
        m = claude.messages.create(model="alpha", max_tokens=4, messages=HELLO,
                                   extra_body={"temperature": 0})
        assert m.type == "message" and m.content[0].text and m.usage.output_tokens <= 4
        with claude.messages.stream(model="alpha", max_tokens=4, messages=HELLO) as stream:
            text = "".join(stream.text_stream)
            final = stream.get_final_message()
        assert final.content[0].text == text and final.stop_reason in ("end_turn", "max_tokens")
        count = claude.messages.count_tokens(model="alpha", messages=HELLO)
        assert count.input_tokens == m.usage.input_tokens
        # vLLM's and llama-server's token routes, by model (an adapter's name too)
        chat = httpx.post(gw.url + "/v1/chat/completions", timeout=120, json={
            "model": "alpha", "messages": HELLO, "max_tokens": 1}).json()["usage"]
        tokens = httpx.post(gw.url + "/tokenize", timeout=60,
                            json={"model": "sql", "messages": HELLO}).json()
        assert tokens["count"] == chat["prompt_tokens"], tokens
        # the cards say how many tokens a request holds, as the runner's do (vLLM's field;
        # justllm chat --url fits its answers to it)
        cards = {m["id"]: m for m in httpx.get(gw.url + "/v1/models", timeout=30).json()["data"]}
        assert cards["alpha"]["max_model_len"] == cards["sql"]["max_model_len"] == tokens[
            "max_model_len"]
        back = httpx.post(gw.url + "/detokenize", timeout=60,
                          json={"model": "alpha", "tokens": tokens["tokens"]})
        assert back.status_code == 200 and "Say hello." in back.json()["content"], back.text
        r = httpx.post(gw.url + "/detokenize", timeout=60, json={"model": "gamma", "tokens": []})
        assert r.status_code == 404 and r.json()["error"]["code"] == 404  # llama-server's shape
        assert r.json()["error"]["type"] == "not_found_error"
        # llama-server's routes: /props of a model by ?model= (the router's own without one),
        # /apply-template by model, and the OpenAI routes without /v1
        router = httpx.get(gw.url + "/props", timeout=30).json()
        assert router["role"] == "router" and router["build_info"].startswith("justllm ")
        props = httpx.get(gw.url + "/props", params={"model": "alpha"}, timeout=60)
        assert props.status_code == 200 and props.json()["model_alias"] == "alpha", props.text
        assert props.json()["default_generation_settings"]["n_ctx"] == tokens["max_model_len"]
        r = httpx.get(gw.url + "/props", params={"model": "gamma"}, timeout=30)
        assert r.status_code == 404 and r.json()["error"]["type"] == "not_found_error"
        adapter_props = httpx.get(gw.url + "/props", params={"model": "sql"}, timeout=60)
        assert adapter_props.status_code == 200, adapter_props.text
        # /slots: a model's, from its runner; the router has none of its own
        slots = httpx.get(gw.url + "/slots", params={"model": "alpha"}, timeout=60)
        assert slots.status_code == 200 and slots.json()[0]["id"] == 0, slots.text
        r = httpx.get(gw.url + "/slots", timeout=30)
        assert r.status_code == 400 and r.json()["error"]["param"] == "model", r.text
        slot_action_refused(gw.url)
        applied = httpx.post(gw.url + "/apply-template", timeout=60,
                             json={"model": "alpha", "messages": HELLO}).json()["prompt"]
        assert "<bos>" + applied == back.json()["content"]
        # llama-server's /completion, an adapter named as the model included
        native = httpx.post(gw.url + "/completion", timeout=120, json={
            "model": "sql", "prompt": "The capital of France is", "n_predict": 8,
            "temperature": 0})
        assert native.status_code == 200, native.text
        assert (native.json()["content"], native.json()["model"]) == (texts[1], "sql")
        r = httpx.post(gw.url + "/completion", timeout=30, json={
            "model": "alpha", "prompt": "x", "mirostat": 2})
        assert r.status_code == 400 and r.json()["error"]["param"] == "mirostat", r.text
        r = httpx.post(gw.url + "/completions", timeout=30, json={
            "model": "alpha", "prompt": "x", "mirostat": 2})
        assert r.status_code == 400 and r.json()["error"]["param"] == "mirostat", r.text
        # /infill by model: the runner's answer (the demo model has no FIM tokens), and a body
        # no model could take, refused before a load
        r = httpx.post(gw.url + "/infill", timeout=60, json={
            "model": "alpha", "input_prefix": "a", "input_suffix": "b"})
        assert r.status_code == 400 and r.json()["error"]["param"] == "model", r.text
        assert "cannot infill" in r.json()["error"]["message"]
        r = httpx.post(gw.url + "/infill", timeout=30, json={
            "model": "alpha", "input_prefix": "a", "input_suffix": "b", "input_extra": [{}]})
        assert r.status_code == 400 and r.json()["error"]["param"] == "input_extra[0]", r.text
        # llama-server's native embeddings by model: the runner's vectors, its shape; a body no
        # model could take refused before a load
        for path in ("/embedding", "/embeddings"):
            r = httpx.post(gw.url + path, timeout=60, json={"model": "alpha", "content": "hi",
                                                            "embd_normalize": -1})
            assert r.status_code == 200, r.text
            assert [len(e["embedding"]) for e in r.json()] == [1]
        oai = httpx.post(gw.url + "/v1/embeddings", timeout=60, json={
            "model": "alpha", "input": "hi"}).json()["data"][0]["embedding"]
        raw = np.array(r.json()[0]["embedding"][0])
        assert np.allclose(raw / np.linalg.norm(raw), oai, atol=1e-6)
        r = httpx.post(gw.url + "/embedding", timeout=30, json={
            "model": "alpha", "input": "a", "content": "b"})
        assert r.status_code == 400 and r.json()["error"]["param"] == "content", r.text
        # reranking by model: the runner's answer (the demo model is no reranker)
        for path in ("/v1/rerank", "/rerank"):
            r = httpx.post(gw.url + path, timeout=30, json={
                "model": "alpha", "query": "q", "documents": ["a"]})
            assert r.status_code == 400 and "not a reranker" in r.json()["error"]["message"]
        # responses are not stored behind the gateway (replicas keep their own stores)
        r = httpx.post(gw.url + "/v1/responses", timeout=120, json={
            "model": "alpha", "input": "hi", "max_output_tokens": 1})
        assert r.status_code == 200 and r.json()["store"] is False, r.text
        assert httpx.get(f"{gw.url}/v1/responses/{r.json()['id']}", timeout=30
                         ).status_code == 404
        for path, extra, param in [
                ("/v1/responses", {"store": True}, "store"),
                ("/responses", {"previous_response_id": "resp_1"}, "previous_response_id"),
                ("/v1/responses/input_tokens", {"previous_response_id": "r"},
                 "previous_response_id")]:
            r = httpx.post(gw.url + path, timeout=30, json={"model": "alpha", "input": "hi",
                                                            **extra})
            assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text
            assert "not stored in router mode" in r.json()["error"]["message"]
        # OpenAI's input token count by model, with and without /v1; a field it does not take
        # refused before a load
        counts = [httpx.post(gw.url + path, timeout=60, json={"model": "alpha", "input": "hi"})
                  for path in ("/v1/responses/input_tokens", "/responses/input_tokens")]
        assert [r.json() for r in counts] == [counts[0].json()] * 2, counts[1].text
        assert counts[0].json()["input_tokens"] > 1
        r = httpx.post(gw.url + "/v1/responses/input_tokens", timeout=30, json={
            "model": "alpha", "input": "hi", "temperature": 0})
        assert r.status_code == 400 and r.json()["error"]["param"] == "temperature", r.text
        alias = httpx.post(gw.url + "/chat/completions", timeout=120, json={
            "model": "alpha", "messages": HELLO, "max_tokens": 1}).json()["usage"]
        assert alias["prompt_tokens"] == chat["prompt_tokens"]
        assert httpx.get(gw.url + "/v1/health", timeout=30).json() == {"status": "ok"}
        with pytest.raises(anthropic.NotFoundError) as e:
            claude.messages.create(model="gamma", max_tokens=4, messages=HELLO)
        assert e.value.body["error"]["type"] == "not_found_error"
        assert "gamma" in e.value.body["error"]["message"]
        missing = httpx.post(gw.url + "/v1/messages", timeout=30,  # the runner's answer
                             json={"model": "alpha", "messages": HELLO})
        assert missing.status_code == 400
        assert missing.json()["error"]["type"] == "invalid_request_error"

        gpt = openai.OpenAI(base_url=gw.url + "/v1", api_key="unused", max_retries=0,
                            timeout=120)
        r = gpt.responses.create(model="alpha", input="Say hello.", max_output_tokens=4,
                                 temperature=0)  # greedy: output_text must not be empty
        assert r.output_text and r.usage.output_tokens <= 4
        events = list(gpt.responses.create(model="alpha", input="Say hello.", stream=True,
                                           max_output_tokens=4))
        assert events[0].type == "response.created"
        assert events[-1].type in ("response.completed", "response.incomplete")
        with pytest.raises(openai.NotFoundError) as e2:
            gpt.responses.create(model="gamma", input="Hi")
        assert e2.value.body["code"] == "model_not_found"
        pids = gw.runner_pids()
    finally:
        rc, out = stop(gw)
    assert rc == 0, out
    wait_gone(pids)
