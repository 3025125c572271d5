"""Bad input gets a 4xx with an OpenAI error body (llama-server's on its own routes), and never
harms the other requests."""

from __future__ import annotations

import asyncio
import json
import re

import httpx
import pytest

from justllm.server.app import ServerConfig, create_app
from justllm.server.errors import LLAMA_SERVER_PATHS
from tests.server.conftest import start_server


def post(server, path, body, **kw):
    content = body if isinstance(body, (bytes, str)) else json.dumps(body)
    return httpx.post(server.url + path, content=content,
                      headers={"content-type": "application/json", **kw.pop("headers", {})},
                      timeout=60, **kw)


def assert_error(r, status, param=None):
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert err["message"]
    if param is not None:
        assert err["param"] == param, err


def assert_llama_error(r, status, type, param=None):
    """llama-server's shape (its format_error_response: ``code`` the status as an int), with
    ``param`` besides."""
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"code", "message", "type", "param"}, err
    assert (err["code"], err["type"], err["param"]) == (status, type, param), err
    assert err["message"]


def test_bad_requests(server):
    m = server.model
    ok_msgs = [{"role": "user", "content": "hi"}]
    assert_error(post(server, "/v1/chat/completions", b"{not json"), 400)
    # msgspec says "Input data was truncated" for a body cut short and for an unpaired
    # surrogate escape alike: both readings are said
    for body in (b'{"prompt": "hi",', b'{"model": "%s", "prompt": "a\\ud800b"}' % m.encode()):
        r = post(server, "/v1/completions", body)
        assert_error(r, 400)
        assert r.json()["error"]["message"] == (
            "the body is not valid JSON: it is cut short, or a string holds an unpaired UTF-16 "
            "surrogate escape (such as \\ud800), which is no character"), r.text
    r = post(server, "/v1/chat/completions", b"")  # it said "data: 'data'"
    assert_error(r, 400)
    assert r.json()["error"]["message"] == "the request body is empty: send a JSON object"
    assert_error(post(server, "/v1/chat/completions", {"model": m}), 400, "messages")
    assert_error(post(server, "/v1/chat/completions", {"model": 5, "messages": ok_msgs}), 400, "model")
    assert_error(post(server, "/v1/chat/completions", {"model": m, "messages": "hi"}), 400)
    assert_error(post(server, "/v1/chat/completions",
                      {"model": m, "messages": ok_msgs, "max_tokens": "ten"}), 400, "max_tokens")
    assert_error(post(server, "/v1/chat/completions", {"model": "gpt-9", "messages": ok_msgs}),
                 404, "model")
    # the tag Ollama clients add (a router took it; a single server answered 404)
    r = post(server, "/v1/chat/completions", {"model": f"{m}:latest", "messages": ok_msgs,
                                              "max_tokens": 1})
    assert r.status_code == 200 and r.json()["model"] == m, r.text
    assert_error(post(server, "/v1/chat/completions", {"model": f"{m}:v2", "messages": ok_msgs}),
                 404, "model")
    assert_error(post(server, "/v1/chat/completions", {"model": m, "messages": []}), 400,
                 "messages")
    assert_error(post(server, "/v1/chat/completions",
                      {"model": m, "messages": [{"role": "user", "content": "word " * 20000}]}),
                 400, "prompt")
    assert_error(post(server, "/v1/chat/completions", {"model": m, "messages": ok_msgs, "n": 1000}),
                 400, "n")
    assert_error(post(server, "/v1/chat/completions",
                      {"model": m, "messages": ok_msgs, "max_tokens": -3}), 400, "max_tokens")
    assert_error(post(server, "/v1/chat/completions",
                      {"model": m, "messages": ok_msgs, "temperature": -1}), 400, "temperature")
    assert_error(post(server, "/v1/completions", {"model": m, "prompt": ""}), 400, "prompt")
    assert_error(post(server, "/v1/completions", {"model": m, "prompt": [1, "x"]}), 400, "prompt")
    assert_error(post(server, "/v1/completions", {"model": m, "prompt": [10**9]}), 400, "prompt")
    assert_error(post(server, "/v1/embeddings", {"model": m, "input": []}), 400, "input")
    # strings and token arrays mixed in one list: OpenAI's and vLLM's 400 (it was taken)
    assert_error(post(server, "/v1/embeddings", {"model": m, "input": ["a", [2, 3]]}), 400,
                 "input")
    assert_error(post(server, "/v1/completions", {"model": m, "prompt": [[2, 3], "a"]}), 400,
                 "prompt")
    assert_error(httpx.get(server.url + "/v1/nothing", timeout=60), 404)
    assert_error(post(server, "/v1/chat/completions", b"x" * (9 * 1024 * 1024)), 413)


def test_bad_requests_do_not_harm_a_running_stream(server):
    body = {"model": server.model, "prompt": "Tell a story.", "max_tokens": 40, "stream": True,
            "ignore_eos": True}

    async def main():
        async with httpx.AsyncClient(timeout=120) as h:
            async def good():
                n = 0
                async with h.stream("POST", server.url + "/v1/completions", json=body) as r:
                    async for line in r.aiter_lines():
                        n += line.startswith("data: {") and '"text":"' in line and '"text":""' not in line
                return n

            async def bad():
                codes = []
                for payload in (b"{", b'{"model": 1}', b'{"model": "x", "messages": []}'):
                    r = await h.post(server.url + "/v1/chat/completions", content=payload,
                                     headers={"content-type": "application/json"})
                    codes.append(r.status_code)
                return codes

            return await asyncio.gather(good(), bad())

    n, codes = asyncio.run(main())
    assert n >= 30 and all(400 <= c < 500 for c in codes)


def test_api_key_and_queue_full(model_path):
    s = start_server(model_path, "--api-key", "sekret", "--max-seqs", "1", "--max-queue", "1",
                     "--pool-blocks", "64")
    try:
        body = {"model": s.model, "prompt": "Hello", "max_tokens": 2}
        assert_error(httpx.post(s.url + "/v1/completions", json=body, timeout=60), 401)
        assert_error(httpx.post(s.url + "/v1/completions", json=body, timeout=60,
                                headers={"Authorization": "Bearer wrong"}), 401)
        assert httpx.get(s.url + "/health", timeout=60).status_code == 200
        auth = {"Authorization": "Bearer sekret"}
        assert httpx.post(s.url + "/v1/completions", json=body, headers=auth,
                          timeout=60).status_code == 200
        for path, other in (("/tokenize", {"prompt": "Hello"}), ("/detokenize", {"tokens": [2]})):
            assert_llama_error(httpx.post(s.url + path, json=other, timeout=60), 401,
                               "authentication_error")
            assert httpx.post(s.url + path, json=other, headers=auth,
                              timeout=60).status_code == 200

        long = {"model": s.model, "prompt": "Hello", "max_tokens": 40, "ignore_eos": True}

        async def flood():
            async with httpx.AsyncClient(timeout=120, headers=auth) as h:
                return await asyncio.gather(*[h.post(s.url + "/v1/completions", json=long)
                                              for _ in range(5)])

        responses = asyncio.run(flood())
        codes = sorted(r.status_code for r in responses)
        # one running + one waiting at most; the rest are refused, none silently dropped
        assert codes.count(200) >= 1 and codes.count(429) >= 3, codes
        assert codes.count(200) + codes.count(429) == 5, codes
        limited = next(r for r in responses if r.status_code == 429)
        assert limited.headers["retry-after"] == "1"
        assert limited.json()["error"]["type"] == "rate_limit_error"
    finally:
        assert s.stop() == 0


def test_priority_needs_priority_scheduling(server):
    body = {"model": server.model, "prompt": "Hello", "max_tokens": 2}
    assert_error(post(server, "/v1/completions", {**body, "priority": 3}), 400, "priority")
    assert_error(post(server, "/v1/completions", {**body, "priority": "high"}), 400, "priority")
    assert post(server, "/v1/completions", {**body, "priority": 0}).status_code == 200


def test_fields_openai_refuses_are_refused_not_ignored(server):
    """Each of these was accepted and then ignored (or, for a negative seed, a 500)."""
    m, hi = server.model, [{"role": "user", "content": "hi"}]
    chat, comp = "/v1/chat/completions", "/v1/completions"
    assert_error(post(server, chat, {"model": m, "messages": hi, "top_logprobs": 3}), 400,
                 "top_logprobs")
    assert_error(post(server, chat, {"model": m, "messages": hi, "max_tokens": 1,
                                     "parallel_tool_calls": False}), 400, "parallel_tool_calls")
    for path, body, options in ((chat, {"messages": hi}, {"include_usage": True}),
                                (comp, {"prompt": "hi"}, {"include_usage": True}),
                                ("/v1/responses", {"input": "hi"}, {})):
        assert_error(post(server, path, {"model": m, **body, "stream_options": options}),
                     400, "stream_options")
    # vLLM's prompt_logprobs: at most 20; on the chat route not with stream (as vLLM)
    for path, body in ((comp, {"prompt": "hi"}), (chat, {"messages": hi})):
        for bad in ({"prompt_logprobs": 21}, {"prompt_logprobs": -1},
                    {"prompt_logprobs": 0, "stream": True} if path == chat else {}):
            if bad:
                assert_error(post(server, path, {"model": m, **body, **bad}), 400,
                             "prompt_logprobs")
    assert_error(post(server, comp, {"model": m, "prompt": "hi", "seed": 2**63}), 400, "seed")
    for seed in (-1, -2**63):
        r = post(server, comp, {"model": m, "prompt": "hi", "max_tokens": 2, "seed": seed,
                                "temperature": 1, "n": 2})
        assert r.status_code == 200 and len(r.json()["choices"]) == 2, r.text


def test_a_strict_schema_asking_what_the_grammar_cannot_enforce_is_refused(server):
    """The grammar passes over a number's minimum (an integer's bounds it enforces): strict:
    true refuses the schema; strict: false follows the rest of it."""
    m, hi = server.model, [{"role": "user", "content": "A number:"}]
    schema = {"type": "object", "properties": {"n": {"type": "number", "minimum": 5}},
              "required": ["n"]}

    def fmt(strict):
        return {"type": "json_schema", "json_schema": {"name": "x", "schema": schema,
                                                       "strict": strict}}
    r = post(server, "/v1/chat/completions", {"model": m, "messages": hi, "max_tokens": 40,
                                               "response_format": fmt(True)})
    assert_error(r, 400, "response_format")
    assert "#/properties/n: minimum" in r.json()["error"]["message"]
    r = post(server, "/v1/chat/completions", {"model": m, "messages": hi, "max_tokens": 100,
                                               "temperature": 0, "response_format": fmt(False)})
    assert r.status_code == 200 and "n" in json.loads(r.json()["choices"][0]["message"]["content"])
    tool = {"type": "function", "function": {"name": "f", "parameters": schema, "strict": True}}
    assert_error(post(server, "/v1/chat/completions", {"model": m, "messages": hi, "tools": [tool]}),
                 400, "tools[0].function.parameters")
    r = post(server, "/v1/responses", {"model": m, "input": "A number:", "text": {"format": {
        "type": "json_schema", "name": "x", "schema": schema, "strict": True}}})
    assert r.status_code == 400 and r.json()["error"]["param"] == "text.format.schema", r.text
    # A schema the grammar converter cannot read names the field it came in (Responses said
    # response_format, a field it does not have).
    bad = {"type": "strnig"}
    r = post(server, "/v1/chat/completions", {"model": m, "messages": hi, "response_format": {
        "type": "json_schema", "json_schema": {"name": "x", "schema": bad}}})
    assert_error(r, 400, "response_format.json_schema.schema")
    assert "not a valid JSON schema: at #/type: 'strnig'" in r.json()["error"]["message"]
    for stream in (False, True):
        r = post(server, "/v1/responses", {"model": m, "input": "A number:", "stream": stream,
                                           "text": {"format": {"type": "json_schema", "name": "x",
                                                               "schema": bad}}})
        assert_error(r, 400, "text.format.schema")


def test_response_format_fields_are_honoured_or_refused(server):
    """A json_schema beside another type was dropped, and a schema without its name (OpenAI's
    and vLLM's 400) was served."""
    m, hi = server.model, [{"role": "user", "content": "A number:"}]
    schema = {"type": "object", "properties": {"n": {"type": "integer"}}}
    for fmt, param in (
            ({"type": "text", "json_schema": {"name": "x", "schema": schema}},
             "response_format.json_schema"),
            ({"type": "json_object", "json_schema": {"name": "x", "schema": schema}},
             "response_format.json_schema"),
            ({"type": "json_schema", "json_schema": {"schema": schema}},
             "response_format.json_schema.name"),
            ({"type": "json_schema", "json_schema": {"name": "a b", "schema": schema}},
             "response_format.json_schema.name")):
        r = post(server, "/v1/chat/completions", {"model": m, "messages": hi, "max_tokens": 4,
                                                   "response_format": fmt})
        assert_error(r, 400, param)
    r = post(server, "/v1/responses", {"model": m, "input": "A number:", "text": {"format": {
        "type": "json_schema", "name": "a b", "schema": schema}}})
    assert_error(r, 400, "text.format.name")


def test_history_messages_are_checked_as_openai_checks_them(server):
    m = server.model
    for message, param in (
            ({"role": "user"}, "messages[0].content"),
            ({"role": "user", "content": None}, "messages[0].content"),
            ({"role": "assistant"}, "messages[0].content"),
            ({"role": "assistant", "content": "x", "audio": {"id": "a1"}}, "messages[0].audio"),
            ({"role": "assistant", "content": None, "function_call": {"name": "f",
                                                                      "arguments": "{}"}},
             "messages[0].function_call"),
            ({"role": "assistant", "content": "x", "annotations": [{"type": "url_citation"}]},
             "messages[0].annotations"),
            ({"role": "user", "content": "x", "refusal": "no"}, "messages[0].refusal"),
            ({"role": "user", "content": []}, "messages[0].content")):  # OpenAI's 400 too
        r = post(server, "/v1/chat/completions",
                 {"model": m, "messages": [message, {"role": "user", "content": "hi"}]})
        assert_error(r, 400, param)
    # An assistant's refusal (a field or a content part) is what it said.
    for said in ({"content": None, "refusal": "I cannot."},
                 {"content": [{"type": "refusal", "refusal": "I cannot."}]}):
        r = post(server, "/v1/chat/completions", {"model": m, "max_tokens": 2, "messages": [
            {"role": "user", "content": "hi"}, {"role": "assistant", **said},
            {"role": "user", "content": "why"}]})
        assert r.status_code == 200, r.text


def test_a_metadata_fields_error_names_it(server):
    """Litestar strips every 'data.' from a field's path: Anthropic's 'metadata.user_id'
    read 'metauser_id'."""
    r = post(server, "/v1/messages", {"model": server.model, "max_tokens": 2,
                                      "messages": [{"role": "user", "content": "hi"}],
                                      "metadata": {"user_id": 5}})
    assert r.status_code == 400 and r.json()["type"] == "error", r.text
    assert "metadata.user_id: Expected `str | null`, got `int`" in r.json()["error"]["message"]


def test_retrieving_a_model_and_ollama_routes_that_do_not_exist(server):
    assert httpx.head(server.url + "/health", timeout=60).status_code == 200  # it was a 405
    r = httpx.get(f"{server.url}/v1/models/{server.model}", timeout=60)
    assert r.status_code == 200 and r.json()["id"] == server.model
    assert_error(httpx.get(f"{server.url}/v1/models/org/gpt-9", timeout=60), 404, "model")
    # Under /api/ a route that does not exist answers in Ollama's shape, as its routes do.
    for r in (post(server, "/api/nothing", {}), httpx.get(server.url + "/api/chat", timeout=60)):
        assert r.status_code in (404, 405) and set(r.json()) == {"error"}, r.text
    # Under /v1/messages, and for Anthropic's SDK (anthropic-version), in Anthropic's shape.
    for r, status, kind in (
            (httpx.get(server.url + "/v1/messages", timeout=60), 405, "invalid_request_error"),
            (post(server, "/v1/messages/batches", {}), 404, "not_found_error"),
            (httpx.get(server.url + "/v1/models/nope", timeout=60,
                       headers={"anthropic-version": "2023-06-01"}), 404, "not_found_error")):
        assert r.status_code == status and r.json()["type"] == "error", r.text
        assert r.json()["error"]["type"] == kind, r.text


def test_every_answer_names_its_request_in_x_request_id(server):
    """As OpenAI's API and vLLM do: the client's X-Request-Id comes back, or one is made."""
    m, ok = server.model, {"model": server.model, "prompt": "Hi", "max_tokens": 1}
    made = [post(server, "/v1/completions", ok).headers["x-request-id"] for _ in range(2)]
    assert all(re.fullmatch(r"req_[0-9a-f]{32}", i) for i in made) and made[0] != made[1]
    mine = {"X-Request-Id": "trace-42"}
    answers = [post(server, "/v1/completions", ok, headers=mine),
               post(server, "/v1/chat/completions", {"model": m, "max_tokens": 1, "stream": True,
                                                     "messages": [{"role": "user", "content": "hi"}]},
                    headers=mine),
               post(server, "/v1/completions", {"model": m}, headers=mine),  # a 400
               post(server, "/v1/nothing", {}, headers=mine),  # a 404
               httpx.get(server.url + "/health", headers=mine, timeout=60)]
    assert [r.status_code for r in answers] == [200, 200, 400, 404, 200]
    assert all(r.headers.get_list("x-request-id") == ["trace-42"] for r in answers)
    # One that could not be sent back as it came (too long, or with a space) is replaced.
    for bad in ("x" * 129, "two words"):
        r = post(server, "/v1/completions", ok, headers={"X-Request-Id": bad})
        assert r.status_code == 200 and r.headers["x-request-id"].startswith("req_")


def test_openai_nullable_fields_take_null_as_absent(server):
    """Clients that serialise every field send ``"n": null``, ``"stream": null``: OpenAI reads
    them as absent (they were 400s here)."""
    m = server.model
    r = post(server, "/v1/completions", {"model": m, "prompt": "Hi", "max_tokens": 2, "n": None,
                                         "stream": None, "echo": None,
                                         "seed": 1})  # (seeded: the text must not be empty)
    assert r.status_code == 200, r.text
    assert len(r.json()["choices"]) == 1 and r.json()["choices"][0]["text"]
    r = post(server, "/v1/chat/completions", {"model": m, "messages": [{"role": "user", "content": "hi"}],
                                              "max_tokens": 2, "n": None, "stream": None,
                                              "logprobs": None})
    assert r.status_code == 200, r.text
    assert len(r.json()["choices"]) == 1 and r.json()["choices"][0]["logprobs"] is None
    r = post(server, "/v1/responses", {"model": m, "input": "hi", "max_output_tokens": 2,
                                       "stream": None})
    assert r.status_code == 200, r.text
    assert r.json()["object"] == "response"
    r = post(server, "/v1/completions", {"model": m, "prompt": "Hi", "max_tokens": 2, "n": 2})
    assert len(r.json()["choices"]) == 2  # a number still counts
    assert_error(post(server, "/v1/completions", {"model": m, "prompt": "Hi", "n": 0}), 400, "n")


def test_openai_fields_at_their_off_value_are_accepted_on_chat(server):
    """``verbosity: "medium"``, ``stream_options.include_obfuscation: false`` and
    ``prompt_cache_retention`` were unknown fields on chat while /v1/responses took them."""
    body = {"model": server.model, "messages": [{"role": "user", "content": "hi"}],
            "max_tokens": 2, "verbosity": "medium", "prompt_cache_retention": "in_memory"}
    r = post(server, "/v1/chat/completions", body)
    assert r.status_code == 200, r.text
    with httpx.stream("POST", server.url + "/v1/chat/completions", timeout=60, json={
            **body, "stream": True, "stream_options": {"include_obfuscation": False,
                                                       "include_usage": True}}) as r:
        lines = [line for line in r.iter_lines() if line.startswith("data: ")]
    assert r.status_code == 200 and lines[-1] == "data: [DONE]"
    assert '"usage":{' in lines[-2]


def test_llama_servers_own_routes_are_the_ones_in_its_error_shape():
    """Every route at the root is llama-server's own (its error shape) but for the OpenAI
    routes it also serves without /v1, and the ones every server has."""
    paths = {r.path for r in create_app(None, ServerConfig()).routes}
    root = {p for p in paths if not p.startswith(("/v1/", "/api/", "/pd/", "/docs"))}
    assert root - {"/chat/completions", "/responses", "/responses/input_tokens", "/health",
                   "/models", "/models/{model_id:path}", "/metrics", "/"} == \
        LLAMA_SERVER_PATHS | {"/slots/{id_slot:str}"}


@pytest.mark.parametrize("method,path,body,status,type,param", [
    ("POST", "/completion", {"prompt": "Hi", "mirostat": 2}, 400, "invalid_request_error",
     "mirostat"),
    ("POST", "/completions", {"prompt": "Hi", "unknown": 1}, 400, "invalid_request_error",
     "unknown"),
    ("POST", "/completion", {"model": "nope", "prompt": "Hi"}, 404, "not_found_error", "model"),
    ("POST", "/completion", b"{not json", 400, "invalid_request_error", None),
    ("POST", "/completion", b"x" * (9 * 1024 * 1024), 413, "invalid_request_error", None),
    ("GET", "/completion", None, 405, "invalid_request_error", None),
    ("POST", "/infill", {"input_prefix": "a", "input_suffix": "b"}, 400,
     "invalid_request_error", "model"),  # (the demo model has no FIM tokens)
    ("POST", "/tokenize", {"prompt": "a", "content": "b"}, 400, "invalid_request_error",
     "content"),
    ("POST", "/detokenize", {"model": "nope", "tokens": [2]}, 404, "not_found_error", "model"),
    ("POST", "/embedding", {"content": "hi", "unknown": 1}, 400, "invalid_request_error",
     "unknown"),
    ("POST", "/embeddings", {"model": "nope", "content": "hi"}, 404, "not_found_error",
     "model"),
    ("POST", "/apply-template", {}, 400, "invalid_request_error", "messages"),
    ("GET", "/props", {"model": "nope"}, 404, "not_found_error", "model"),
    ("POST", "/props", {}, 405, "invalid_request_error", None),
    ("GET", "/slots", {"model": "nope"}, 404, "not_found_error", "model"),
    ("POST", "/slots/0", {}, 400, "invalid_request_error", "action"),  # (not offered)
    ("POST", "/rerank", {"query": "a", "documents": ["b"]}, 400, "invalid_request_error",
     "model"),  # (not a reranker)
    ("POST", "/reranking", {"query": "a", "documents": []}, 400, "invalid_request_error",
     "documents"),
    ("POST", "/lora-adapters", [{"id": 5, "scale": 1}], 400, "invalid_request_error", "[0]"),
])
def test_llama_servers_routes_answer_errors_in_its_shape(server, method, path, body, status,
                                                         type, param):
    if method == "GET":
        r = httpx.get(server.url + path, params=body, timeout=60)
    else:
        r = post(server, path, body)
    assert_llama_error(r, status, type, param)


def test_the_openai_routes_beside_them_keep_openais_shape(server):
    for path, body in (("/v1/rerank", {"query": "a", "documents": ["b"]}),
                       ("/v1/completions", {"prompt": "Hi", "mirostat": 2}),
                       ("/chat/completions", {"messages": [], "model": server.model})):
        r = post(server, path, body)
        assert_error(r, 400)
        assert r.json()["error"]["code"] is None


def test_a_malformed_lora_adapters_body_is_said_to_be_malformed(server):
    """It began with "{" and was said to be an object where an array belongs."""
    for body in (b"{bad", b"[1, 2"):
        r = httpx.post(server.url + "/lora-adapters", content=body, timeout=60,
                       headers={"content-type": "application/json"})
        assert r.status_code == 400, r.text
        assert r.json()["error"]["message"].startswith("the body is not valid JSON"), r.text
