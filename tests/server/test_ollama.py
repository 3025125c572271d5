"""Ollama's API (``/api/...``) through the real ``ollama`` client and raw httpx, against a real
``justllm serve``: NDJSON streaming, options, formats, the model listings, embeddings, errors
in Ollama's shape, and clients that leave."""

from __future__ import annotations

import hashlib
import json
import os
import socket
import time
from datetime import UTC, datetime
from types import SimpleNamespace

import httpx
import numpy as np
import ollama
import pytest

import justllm
from justllm.bench.soak import metric
from justllm.server.ollama import _check_model
from justllm.server.ollama_chat import ASKED_MODEL_HEADER, LOAD_SECONDS_HEADER, Arrival
from tests.server.conftest import start_server

KEY = "ollama-test-key"


@pytest.fixture(scope="module")
def client(server):
    return ollama.Client(host=server.url, timeout=120)


@pytest.fixture(scope="module")
def exact(model_path):
    """A server without the prefix cache, for exact reproducibility (a cached prompt is computed
    in another batch shape, where a near tie may flip: docs/llama-cpp-facts.md), behind an API
    key, with the client that holds it; --ctx 512 (which caps an embedding input too)."""
    s = start_server(model_path, "--no-prefix-cache", "--max-seqs", "4", "--pool-blocks", "128",
                     "--chat-template", "gemma", "--api-key", KEY, "--ctx", "512")
    yield s, ollama.Client(host=s.url, timeout=120, headers={"Authorization": f"Bearer {KEY}"})
    assert s.stop() == 0


def raw(server, path: str, body: object, timeout: float | httpx.Timeout = 120
        ) -> httpx.Response:
    return httpx.post(server.url + path, content=json.dumps(body), timeout=timeout)


def running(server) -> float:
    return metric(httpx.get(server.url + "/metrics", timeout=30).text,
                  "vllm:num_requests_running")


def finished(server, reason: str | None = None) -> float:
    """Requests that ran to their end (stop or length), or that ended for ``reason``."""
    text = httpx.get(server.url + "/metrics", timeout=30).text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith("vllm:request_success_total{") and (
                   f'finished_reason="{reason}"' in line if reason else
                   'finished_reason="stop"' in line or 'finished_reason="length"' in line))


def wait_running(server, want) -> None:
    deadline = time.monotonic() + 60
    while not want(running(server)):
        assert time.monotonic() < deadline, f"running requests stuck at {running(server)}"
        time.sleep(0.05)


def assert_final(r, num_predict: int | None = None) -> None:
    assert r.done is True and r.done_reason in ("stop", "length")
    assert r.prompt_eval_count > 3 and r.eval_count >= 1
    if num_predict is not None:
        assert r.eval_count <= num_predict
        assert r.done_reason == "stop" or r.eval_count == num_predict
    for name in ("total_duration", "prompt_eval_duration", "eval_duration"):
        assert isinstance(getattr(r, name), int) and getattr(r, name) >= 0
    assert r.load_duration == 0
    datetime.fromisoformat(r.created_at)


# ---- chat and generate ---------------------------------------------------------------------

def test_chat_streaming(client, server):
    # (seeded: Ollama's defaults sample, and the text must not be empty)
    parts = list(client.chat(model=server.model, stream=True,
                             options={"num_predict": 8, "seed": 1},
                             messages=[{"role": "user", "content": "Name three colours."}]))
    assert all(p.done is False for p in parts[:-1]) and parts[-1].done is True
    assert {p.message.role for p in parts} == {"assistant"}
    assert {p.model for p in parts} == {server.model}
    assert "".join(p.message.content for p in parts).strip()
    assert parts[-1].message.content == ""
    assert_final(parts[-1], 8)
    assert len(parts) - 1 <= parts[-1].eval_count  # a chunk per output with text


def test_chat_non_streaming_with_the_latest_tag(client, server):
    r = client.chat(model=server.model + ":latest", options={"num_predict": 6, "seed": 1},
                    messages=[{"role": "system", "content": "You are terse."},
                              {"role": "user", "content": "Say hello."}])
    assert r.model == server.model + ":latest"  # echoed as the client named it, as Ollama does
    assert r.message.role == "assistant" and r.message.content.strip()
    assert_final(r, 6)


def test_chat_history_and_stop(client, server):
    r = client.chat(model=server.model, options={"num_predict": 30, "stop": ["\n"]}, messages=[
        {"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello!"},
        {"role": "user", "content": "Count to five."}])
    assert "\n" not in r.message.content
    assert_final(r, 30)


def test_a_last_assistant_message_is_continued(server):
    """As Ollama does (it was closed as a turn and answered anew, then refused): the same
    text as a chat completion with vLLM's continue_final_message, and only the new text."""
    history = [{"role": "user", "content": "What is the capital of France?"},
               {"role": "assistant", "content": "The capital of France is"}]
    r = raw(server, "/api/chat", {"model": server.model, "stream": False, "messages": history,
                                  "options": {"temperature": 0, "num_predict": 6,
                                              "repeat_penalty": 1.0}})
    assert r.status_code == 200, r.text
    said = r.json()["message"]["content"]
    assert "Paris" in said and not said.lstrip().startswith("The capital"), said
    chat = raw(server, "/v1/chat/completions", {
        "model": server.model, "messages": history, "temperature": 0, "max_tokens": 6,
        "continue_final_message": True, "add_generation_prompt": False})
    assert chat.json()["choices"][0]["message"]["content"] == said, chat.text
    tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
    r = raw(server, "/api/chat", {"model": server.model, "messages": history, "tools": [tool]})
    assert r.status_code == 400 and "cannot be combined with tools" in r.json()["error"]


def test_generate_streaming_and_not(client, server):
    parts = list(client.generate(model=server.model, prompt="The sky is", stream=True,
                                 options={"num_predict": 5, "seed": 1}))  # (seeded: not empty)
    assert parts[-1].done and all(not p.done for p in parts[:-1])
    assert "".join(p.response for p in parts).strip()
    assert_final(parts[-1], 5)
    r = client.generate(model=server.model, prompt="The sky is", raw=True,
                        options={"num_predict": 5, "seed": 1})
    assert r.response and r.context is None
    assert_final(r, 5)
    # raw: the prompt alone, no chat template around it
    assert r.prompt_eval_count < parts[-1].prompt_eval_count


def test_generate_with_system(client, server):
    plain = client.generate(model=server.model, prompt="Hi", options={"num_predict": 1})
    with_system = client.generate(model=server.model, prompt="Hi", system="Answer in French.",
                                  options={"num_predict": 1})
    assert with_system.prompt_eval_count > plain.prompt_eval_count


def test_a_seed_reproduces_a_generation(exact):
    server, c = exact
    for seed in (42, -5):  # only -1 means random in Ollama: -5 was taken as random too
        opts = {"temperature": 0.9, "seed": seed, "num_predict": 12}
        a = c.generate(model=server.model, prompt="Write a sentence about cats.", options=opts)
        b = c.generate(model=server.model, prompt="Write a sentence about cats.", options=opts)
        assert a.response and a.response == b.response, seed
    greedy = {"temperature": 0, "num_predict": 12}
    a = c.chat(model=server.model, messages=[{"role": "user", "content": "Hi"}], options=greedy)
    b = c.chat(model=server.model, messages=[{"role": "user", "content": "Hi"}], options=greedy)
    assert a.message.content and a.message.content == b.message.content


def test_format_json_and_schema(exact):
    server, c = exact
    # alone and uncached, this prompt's greedy JSON closes after a few tokens
    r = c.chat(model=server.model, messages=[{"role": "user", "content": "{}"}], format="json",
               options={"temperature": 0, "num_predict": 200})
    assert r.done_reason == "stop"  # the grammar let the end of turn through once complete
    assert isinstance(json.loads(r.message.content), dict)
    # an integer's bounds are enforced, as Ollama's (llama.cpp's) converter does
    schema = {"type": "object", "properties": {"age": {"type": "integer", "minimum": 200,
                                                       "maximum": 260}},
              "required": ["age"], "additionalProperties": False}
    r = c.generate(model=server.model, prompt="Person: ", format=schema,
                   options={"temperature": 0, "num_predict": 60})
    assert r.done_reason == "stop"
    doc = json.loads(r.response)
    assert set(doc) == {"age"} and isinstance(doc["age"], int) and 200 <= doc["age"] <= 260


def test_logprobs(client, server):
    r = client.generate(model=server.model, prompt="The sky is", logprobs=True, top_logprobs=2,
                        options={"num_predict": 3, "temperature": 0, "repeat_penalty": 1.0})
    assert len(r.logprobs) == r.eval_count
    for lp in r.logprobs:
        assert lp.logprob <= 0 and len(lp.top_logprobs) == 2
        assert lp.token == lp.top_logprobs[0].token  # greedy: the best one
    parts = list(client.chat(model=server.model, stream=True, logprobs=True,
                             messages=[{"role": "user", "content": "Hi"}],
                             options={"num_predict": 3}))
    assert sum(len(p.logprobs or []) for p in parts) == parts[-1].eval_count


def test_options_at_the_servers_own_values_are_accepted(client, server):
    ctx = client.ps().models[0].context_length
    r = client.generate(model=server.model, prompt="Hi", keep_alive=-1, options={
        "num_ctx": ctx, "use_mmap": True, "num_keep": 4, "typical_p": 1.0, "mirostat": 0,
        "seed": -1, "num_predict": 2, "top_k": 10, "top_p": 0.5, "min_p": 0.05,
        "repeat_penalty": 1.2, "repeat_last_n": -1, "presence_penalty": 0.5,
        "frequency_penalty": 0.5})
    assert_final(r, 2)
    for keep_alive in ("5m", "1h30m", 300, "-1s"):
        assert client.generate(model=server.model, prompt="Hi", keep_alive=keep_alive,
                               options={"num_predict": 1}).done


def test_an_empty_request_loads_the_model(client, server):
    r = client.chat(model=server.model)
    assert r.done and r.done_reason == "load" and r.message.content == ""
    r = client.generate(model=server.model)
    assert r.done and r.done_reason == "load" and r.response == ""


# ---- the model -----------------------------------------------------------------------------

def test_tags_ps_show_version(client, server, model_path):
    (m,) = client.list().models
    assert m.model == server.model + ":latest"
    assert m.size == os.path.getsize(model_path)
    with open(model_path, "rb") as f:
        assert m.digest == hashlib.file_digest(f, "sha256").hexdigest()
    d = m.details
    assert (d.format, d.family, d.parameter_size, d.quantization_level) == (
        "gguf", "gemma3", "270M", "Q4_K_M")
    assert m.modified_at.timestamp() == pytest.approx(os.path.getmtime(model_path), abs=1)
    (p,) = client.ps().models
    assert p.model == m.model and p.digest == m.digest and p.details == m.details
    assert p.context_length > 0
    assert p.expires_at.year > datetime.now(UTC).year + 20  # never unloaded
    s = client.show(server.model)
    assert s.details == m.details
    assert s.modelinfo["general.architecture"] == "gemma3"
    assert s.modelinfo["tokenizer.ggml.tokens"] == []  # arrays left out, as Ollama does
    assert "<start_of_turn>" in s.template  # the server's chat template (--chat-template gemma)
    assert '"<end_of_turn>"' in s.parameters and f"num_ctx {p.context_length}" in \
        " ".join(s.parameters.split())
    assert s.modelfile.startswith("# Modelfile") and "FROM " in s.modelfile
    assert set(s.capabilities) == {"completion", "tools", "embedding"}
    assert client.show(server.model + ":latest").details == m.details
    assert httpx.get(server.url + "/api/version").json() == {"version": justllm.__version__}
    # found by an audit: Ollama answers HEAD on both (a 405 here), always lists size_vram (left
    # out), and show's older name beside another model was passed over
    for path in ("/api/tags", "/api/version"):
        assert httpx.head(server.url + path).status_code == 200, path
    assert httpx.get(server.url + "/api/ps").json()["models"][0]["size_vram"] == 0  # a CPU
    r = raw(server, "/api/show", {"model": server.model, "name": "other"})
    assert r.status_code == 400 and r.json()["error"].startswith("name:"), r.text


def test_a_model_served_as_latest_answers_to_its_bare_name_too():
    """Ollama's "m" and "m:latest" are one model: a server named "tm:latest" refused "tm"."""
    served = SimpleNamespace(model_id="tm:latest")
    assert _check_model("tm", served) is None and _check_model("tm:latest", served) is None


def test_model_management_is_not_offered(client, server):
    for call in (lambda: client.pull(server.model), lambda: client.delete(server.model),
                 lambda: client.copy(server.model, "other")):
        ollama_error(call, 400, "justllm pull")


def test_root_says_ollama_is_running(server):
    r = httpx.get(server.url + "/")
    assert r.status_code == 200 and r.text == "Ollama is running"
    assert httpx.head(server.url + "/").status_code == 200


# ---- embeddings ------------------------------------------------------------------------------

def test_embed(client, server):
    r = client.embed(model=server.model, input=["Why is the sky blue?", "Grass is green."])
    v1 = httpx.post(server.url + "/v1/embeddings", timeout=60, json={
        "model": server.model, "input": ["Why is the sky blue?", "Grass is green."]}).json()
    assert len(r.embeddings) == 2
    assert [len(e) for e in r.embeddings] == [len(d["embedding"]) for d in v1["data"]]
    np.testing.assert_allclose(r.embeddings, [d["embedding"] for d in v1["data"]], atol=1e-5)
    assert r.prompt_eval_count == v1["usage"]["prompt_tokens"]
    one = client.embed(model=server.model, input="Why is the sky blue?", dimensions=64)
    assert len(one.embeddings) == 1 and len(one.embeddings[0]) == 64
    old = client.embeddings(model=server.model, prompt="Why is the sky blue?")
    assert len(old.embedding) == len(r.embeddings[0])
    # the older route's vector is the pooled one, not normalised, as Ollama's: /api/embed's
    # is it scaled to length 1
    pooled = np.asarray(old.embedding)
    assert abs(float(np.linalg.norm(pooled)) - 1.0) > 1e-3
    np.testing.assert_allclose(pooled / np.linalg.norm(pooled), r.embeddings[0], atol=1e-5)
    assert client.embed(model=server.model, input=[]).embeddings == []


def test_embed_truncates_a_long_input_unless_told_not_to(exact):
    """Ollama's /api/embed cuts the end of an input past the context by default (truncate
    absent or true); truncate: false makes it a 400. The legacy route does not cut. The
    context is --ctx (512 here), as Ollama's num_ctx caps an embedding input."""
    server, client = exact
    auth = {"Authorization": f"Bearer {KEY}"}
    text = "The lighthouse keeper wrote down every ship that passed. " * 60
    ids = httpx.post(server.url + "/tokenize", json={"prompt": text}, headers=auth,
                     timeout=60).json()["tokens"]
    assert len(ids) > 512
    cut = httpx.post(server.url + "/v1/embeddings", headers=auth, timeout=60, json={
        "input": [ids[:512]]}).json()["data"][0]["embedding"]
    for truncate in (None, True):
        r = client.embed(model=server.model, input=text, truncate=truncate)
        assert r.prompt_eval_count == 512
        np.testing.assert_allclose(r.embeddings[0], cut, atol=1e-5)
    ollama_error(lambda: client.embed(model=server.model, input=text, truncate=False), 400,
                 "at most 512")
    ollama_error(lambda: client.embeddings(model=server.model, prompt=text), 400,
                 "at most 512")


# ---- errors ----------------------------------------------------------------------------------

def ollama_error(call, status: int, says: str | None = None) -> None:
    with pytest.raises(ollama.ResponseError) as e:
        r = call()
        if not hasattr(r, "model_dump"):  # a stream fails on its first read
            list(r)
    assert e.value.status_code == status, e.value
    if says is not None:
        assert says in e.value.error, e.value.error


def test_unknown_model_is_a_404(client, server):
    msgs = [{"role": "user", "content": "hi"}]
    for call in (lambda: client.chat(model="nope", messages=msgs),
                 lambda: client.chat(model="nope", messages=msgs, stream=True),
                 lambda: client.generate(model="nope:7b", prompt="hi"),
                 lambda: client.embed(model="nope", input="hi"),
                 lambda: client.show("nope")):
        ollama_error(call, 404, 'model "nope')
    r = raw(server, "/api/chat", {"model": "nope", "messages": msgs})
    assert r.json() == {"error": 'model "nope" not found, try pulling it first'}


def test_unsupported_options_are_a_400_naming_them(client, server):
    for options, says in [({"num_ctx": 7}, "options.num_ctx"),
                          ({"num_thread": 2}, "options.num_thread"),
                          ({"num_gpu": 99}, "options.num_gpu"),
                          ({"use_mlock": True}, "options.use_mlock"),
                          ({"mirostat": 2}, "options.mirostat"),
                          ({"tfs_z": 0.5}, "options.tfs_z"),
                          ({"num_predict": 0}, "options.num_predict"),
                          ({"temperature": -1}, "options.temperature"),
                          # (the message read "options.a stop string has ...")
                          ({"stop": ["x" * 1001]}, "options.stop: a stop string has at most"),
                          ({"frobnicate": 1}, "frobnicate")]:
        ollama_error(lambda o=options: client.generate(model=server.model, prompt="hi", options=o),
                     400, says)


def test_keep_alive_zero_is_refused(client, server):
    for value in (0, "0", "0s", "0m"):
        ollama_error(lambda v=value: client.generate(model=server.model, prompt="hi", keep_alive=v),
                     400, "--models")
    ollama_error(lambda: client.chat(model=server.model, keep_alive=0), 400, "--models")
    ollama_error(lambda: client.generate(model=server.model, prompt="hi", keep_alive="soon"),
                 400, "keep_alive")
    for value in ("100000000h", "1e400", "inf", 1e12):  # past Go's durations (~292 years)
        ollama_error(lambda v=value: client.generate(model=server.model, prompt="hi",
                                                     keep_alive=v), 400, "292 years")


def test_unsupported_fields_are_a_400(client, server):
    msgs = [{"role": "user", "content": "hi"}]
    for call, says in [
            (lambda: client.chat(model=server.model, messages=msgs, think=True), "thinking"),
            (lambda: client.chat(model=server.model, messages=[
                {"role": "user", "content": "what is this?", "images": [b"\x89PNG"]}]),
             "messages[0].images"),
            (lambda: client.generate(model=server.model, prompt="hi", template="{{ .Prompt }}"),
             "template"),
            (lambda: client.generate(model=server.model, prompt="hi", context=[1, 2]), "context"),
            (lambda: client.generate(model=server.model, prompt="def f(", suffix="return 1"),
             "suffix"),
            (lambda: client.generate(model=server.model, prompt="hi", raw=True, system="x"),
             "system"),
            (lambda: client.embed(model=server.model, input="hi",
                                  options={"temperature": 1}), "options.temperature")]:
        ollama_error(call, 400, says)
    for path, body, says in [
            ("/api/chat", {"model": server.model, "messages": msgs, "frobnicate": 1},
             "frobnicate"),
            ("/api/generate", {"model": server.model, "prompt": "hi", "colour": "red"},
             "colour"),
            ("/api/chat", {"model": server.model, "messages": [
                {"role": "user", "content": "hi", "colour": "red"}]}, "colour"),
            ("/api/embed", {"model": server.model, "input": "hi", "x": 1}, "x"),
            ("/api/generate", {"prompt": "hi"}, "model"),
            ("/api/generate", {"model": "", "prompt": "hi"}, "model is required"),
            ("/api/generate", {"model": server.model, "prompt": "hi", "format": "yaml"},
             "format"),
            ("/api/chat", {"model": server.model, "messages": msgs, "stream": "yes"}, "stream"),
            ("/api/generate", b"{not json", None)]:
        r = httpx.post(server.url + path, timeout=60,
                       content=body if isinstance(body, bytes) else json.dumps(body))
        assert r.status_code == 400, (path, body, r.text)
        assert set(r.json()) == {"error"} and isinstance(r.json()["error"], str)
        if says is not None:
            assert says in r.json()["error"], r.json()


def test_api_key_guards_the_api(exact):
    server, c = exact
    assert c.generate(model=server.model, prompt="Hi", options={"num_predict": 1}).done
    ollama_error(lambda: ollama.Client(host=server.url).list(), 401)
    r = httpx.get(server.url + "/api/tags")
    assert r.status_code == 401 and set(r.json()) == {"error"}
    assert httpx.get(server.url + "/").text == "Ollama is running"  # open, as /health is


# ---- framing and clients that leave ----------------------------------------------------------

def test_ndjson_framing(server):
    with httpx.stream("POST", server.url + "/api/chat", timeout=60, content=json.dumps({
            # seeded: an answer line, then the last (sampled, it could end at once)
            "model": server.model, "options": {"num_predict": 6, "seed": 1},
            "messages": [{"role": "user", "content": "Hello"}]})) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("application/x-ndjson")
        body = r.read().decode()
    assert body.endswith("\n")
    lines = body.splitlines()
    docs = [json.loads(line) for line in lines]  # each line one JSON object
    assert all(isinstance(d, dict) for d in docs) and len(docs) >= 2
    assert [d["done"] for d in docs] == [False] * (len(docs) - 1) + [True]
    assert docs[-1]["done_reason"] in ("stop", "length") and docs[-1]["eval_count"] <= 6
    r = raw(server, "/api/generate", {"model": server.model, "prompt": "Hi", "stream": False,
                                      "options": {"num_predict": 2}})
    assert r.headers["content-type"].startswith("application/json")
    assert r.json()["done"] is True and "\n" not in r.text.strip()


def test_a_client_that_leaves_mid_stream_aborts_its_request(server):
    wait_running(server, lambda n: n == 0)
    done, aborted = finished(server), finished(server, "abort")
    with httpx.stream("POST", server.url + "/api/generate", timeout=60, content=json.dumps({
            # greedy, this raw prompt runs on for hundreds of tokens
            "model": server.model, "prompt": "Once upon a time", "raw": True,
            "options": {"num_predict": -1, "temperature": 0}})) as r:
        lines = r.iter_lines()
        for _ in range(3):
            assert json.loads(next(lines))["done"] is False
        assert running(server) == 1
    wait_running(server, lambda n: n == 0)
    assert finished(server) == done  # aborted, not run to its end
    assert finished(server, "abort") == aborted + 1  # and counted so, as vLLM does


def test_a_client_that_leaves_a_non_streaming_request_aborts_it(server):
    wait_running(server, lambda n: n == 0)
    done, aborted = finished(server), finished(server, "abort")
    body = json.dumps({  # greedy, this chat runs on for hundreds of tokens
        "model": server.model, "stream": False, "options": {"num_predict": -1, "temperature": 0},
        "messages": [{"role": "user", "content": "Tell me a long story."}]}).encode()
    host, port = server.url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=60) as sock:
        sock.sendall(b"POST /api/chat HTTP/1.1\r\nHost: %s\r\nContent-Type: application/json\r\n"
                     b"Content-Length: %d\r\n\r\n%s" % (host.encode(), len(body), body))
        wait_running(server, lambda n: n == 1)
    # the client left while its answer was being generated
    wait_running(server, lambda n: n == 0)
    assert finished(server) == done  # aborted, not run to its end
    assert finished(server, "abort") == aborted + 1  # and counted so, as vLLM does


def test_the_load_time_router_mode_reports_becomes_load_duration():
    loaded = Arrival.now({LOAD_SECONDS_HEADER: "2.5"})
    assert loaded.load_seconds == 2.5
    durations = loaded.durations()
    assert durations["load_duration"] == 2_500_000_000
    assert durations["total_duration"] >= durations["load_duration"]
    for nonsense in ("nan", "inf", "-1", "soon", "1e9"):
        assert Arrival.now({LOAD_SECONDS_HEADER: nonsense}).load_seconds == 0.0
    assert Arrival.now({}).durations()["load_duration"] == 0


def test_a_server_of_its_own_takes_no_clients_word_for_the_gateways_headers(client, server):
    """What router mode's gateway tells its runners in headers (the load a request waited
    for, the name its client asked for) is read only by a runner, which the gateway alone
    can reach (its key): any client of a server of its own could set load_duration to hours
    and the answer's model name to anything."""
    r = httpx.post(server.url + "/api/chat", timeout=120, headers={
        LOAD_SECONDS_HEADER: "5000", ASKED_MODEL_HEADER: "gpt-4o%0Aevil"}, json={
            "model": server.model, "stream": False, "options": {"num_predict": 2},
            "messages": [{"role": "user", "content": "hi"}]})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["model"] == server.model and body["load_duration"] == 0
    assert body["total_duration"] < 600e9


def test_num_predict_past_the_context_answers_until_the_context_is_full(exact):
    """Ollama's num_predict is a most: past what the context holds (--ctx 512 here) the
    answer ends where the context does, done_reason "length", as Ollama's does without
    context shift (it was a 400, which broke clients that send a large num_predict); the
    OpenAI routes still refuse such a max_tokens, as OpenAI's and vLLM's do."""
    server, client = exact
    story = "Count on: " + "one two three " * 160  # (485 tokens: 27 left to answer in)
    out = client.generate(model=server.model, prompt=story, raw=True,
                          options={"num_predict": 100000, "temperature": 0})
    assert out.prompt_eval_count == 485 and out.done_reason in ("length", "stop")
    assert out.prompt_eval_count + out.eval_count <= 512
    if out.done_reason == "length":
        assert out.prompt_eval_count + out.eval_count == 512
    tools = [{"type": "function", "function": {"name": "f", "description": "d",
                                               "parameters": {"type": "object"}}}]
    said = client.chat(model=server.model, messages=[{"role": "user", "content": story[:1700]}],
                       tools=tools, options={"num_predict": 100000, "temperature": 0})
    assert said.done and said.prompt_eval_count + said.eval_count <= 512
    r = httpx.post(server.url + "/v1/completions", timeout=60,
                   headers={"Authorization": f"Bearer {KEY}"},
                   json={"prompt": story, "max_tokens": 100000})
    assert r.status_code == 400 and r.json()["error"]["param"] == "max_tokens", r.text


def test_a_whole_number_is_taken_for_an_integer_option(client, server):
    """Ollama reads every option from JSON numbers (``num_predict: 2.0`` from a JavaScript
    client's slider is 2); a whole one is taken, any other is a 400 naming the option."""
    out = client.generate(model=server.model, prompt="Count: one two", raw=True,
                          options={"num_predict": 2.0, "top_k": 40.0, "seed": 7.0,
                                   "temperature": 0.5})
    assert out.eval_count == 2 and out.done_reason == "length"
    ollama_error(lambda: client.generate(model=server.model, prompt="hi",
                                         options={"num_predict": 2.5}),
                 400, "options.num_predict must be an integer (got 2.5)")
