"""llama-server's own routes on a real server: ``GET /props`` tells what the other routes do
(the context /tokenize reports, the template /apply-template renders, the sampling a bare
request gets), ``/apply-template`` gives the prompt the chat route tokenizes, and the OpenAI
routes answer without ``/v1`` as llama-server's do."""

from __future__ import annotations

import time

import httpx
import msgspec
import openai
import pytest

from justllm.errors import InvalidRequestError
from justllm.server.llama_server import check_apply_template
from justllm.server.schemas import ChatCompletionRequest
from tests.server.test_tokenize import WEATHER, post, tokenize

HELLO = [{"role": "system", "content": "Be brief."},
         {"role": "user", "content": "What is the weather in Paris?"}]


def detokenized(server, tokens: list[int]) -> str:
    """The tokens' text, special tokens written out (``<bos>``)."""
    return post(server, "/detokenize", {"tokens": tokens}).json()["content"]


def test_props_say_what_the_server_does(server):
    r = httpx.get(server.url + "/props", timeout=30)
    assert r.status_code == 200, r.text
    props = r.json()
    settings = props["default_generation_settings"]
    assert settings["n_ctx"] == tokenize(server, prompt="x")["max_model_len"]
    assert props["total_slots"] == 16  # --max-seqs
    assert props["model_alias"] == server.model
    assert props["model_path"].endswith(".gguf")
    assert "<start_of_turn>" in props["chat_template"]  # --chat-template gemma
    assert (props["bos_token"], props["eos_token"]) == ("<bos>", "<eos>")
    assert props["build_info"].startswith("justllm ") and "llama-cpp-python" in props["build_info"]
    assert props["modalities"] == {"vision": False, "video": False, "audio": False}
    assert props["endpoint_props"] is False and props["endpoint_metrics"] is True
    assert props["endpoint_slots"] is True
    # what a /completion request that sets nothing gets (llama-server's meaning): the same
    # tokens as asking for it, and what its generation_settings say
    params = settings["params"]
    assert (params["temperature"], params["top_k"], params["top_p"], params["min_p"],
            params["n_predict"]) == (0.8, 40, 0.95, 0.05, -1)
    bare = {"prompt": "The capital of France is", "n_predict": 6, "seed": 3}
    asked = {**bare, **{k: v for k, v in params.items() if k not in ("n_predict", "seed")}}
    # (the first primes the prefix cache: the two after it are computed alike)
    answers = [post(server, "/completion", body).json() for body in (bare, bare, asked)]
    assert answers[1]["content"] == answers[2]["content"]
    ran = answers[1]["generation_settings"]
    assert all(ran[k] == v for k, v in params.items() if k not in ("n_predict", "seed")), ran
    # changing them (llama-server's POST /props, off there by default) is not offered
    assert httpx.post(server.url + "/props", json={}, timeout=30).status_code == 405


def test_slots_show_the_running_requests(model_path):
    """llama-server's GET /slots: one slot per --max-seqs, a running request's counts and
    sampling in the first, and ?fail_on_no_slot=1 a 503 once none is idle."""
    from tests.server.conftest import start_server

    s = start_server(model_path, "--max-seqs", "1", "--pool-blocks", "128")
    try:
        idle = httpx.get(s.url + "/slots", params={"fail_on_no_slot": 1}, timeout=30)
        assert idle.status_code == 200, idle.text
        assert idle.json() == [{"id": 0, "n_ctx": tokenize(s, prompt="x")["max_model_len"],
                                "speculative": False, "is_processing": False}]
        prompt = "Once upon a time"
        body = {"prompt": prompt, "max_tokens": 400, "temperature": 0.7, "top_p": 0.9,
                "seed": 5, "ignore_eos": True, "stream": True}
        with httpx.stream("POST", s.url + "/v1/completions", json=body, timeout=120) as r:
            lines = r.iter_lines()
            next(line for line in lines if line.startswith("data: {"))  # it is running
            busy = httpx.get(s.url + "/slots", timeout=30).json()
            refused = httpx.get(s.url + "/slots", params={"fail_on_no_slot": 1}, timeout=30)
        # (the client left: the server aborts the request rather than write 400 tokens)
        assert len(busy) == 1 and busy[0]["is_processing"] is True
        assert isinstance(busy[0]["id_task"], int)  # a number, as llama-server's
        slot = busy[0]
        assert slot["n_prompt_tokens"] == len(tokenize(s, prompt=prompt)["tokens"])
        assert slot["n_prompt_tokens_processed"] + slot["n_prompt_tokens_cache"] == slot[
            "n_prompt_tokens"]
        assert slot["params"]["temperature"] == 0.7 and slot["params"]["top_p"] == 0.9
        assert (slot["params"]["seed"], slot["params"]["n_predict"]) == (5, 400)
        step = slot["next_token"][0]
        assert step["n_decoded"] >= 1 and step["n_remain"] == 400 - step["n_decoded"]
        assert "prompt" not in slot and "generated" not in slot  # other clients' text
        assert refused.status_code == 503, refused.text
        assert refused.json()["error"] == {"code": 503, "message": "no slot available",
                                           "type": "unavailable_error", "param": None}
        deadline = time.monotonic() + 60
        while httpx.get(s.url + "/slots", timeout=30).json()[0]["is_processing"]:
            assert time.monotonic() < deadline, "the slot stayed busy after its client left"
            time.sleep(0.05)
    finally:
        assert s.stop() == 0


@pytest.mark.parametrize("extra", [{}, {"tools": WEATHER}])
def test_apply_template_is_the_prompt_the_chat_route_tokenizes(server, extra):
    r = post(server, "/apply-template", {"messages": HELLO, **extra})
    assert r.status_code == 200, r.text
    prompt = r.json()["prompt"]
    # as a text prompt (BOS added, as /v1/completions adds it) it is the chat's tokens
    chat = tokenize(server, messages=HELLO, **extra)["tokens"]
    assert tokenize(server, prompt=prompt)["tokens"] == chat
    assert "<bos>" + prompt == detokenized(server, chat)
    assert prompt.startswith("<start_of_turn>user\n") and prompt.endswith(
        "<start_of_turn>model\n")
    assert ("get_weather" in prompt) == bool(extra)
    # the conversation as it stands (as /tokenize reads add_generation_prompt: false)
    closed = post(server, "/apply-template", {"messages": HELLO, "add_generation_prompt": False,
                                              **extra})
    assert closed.json()["prompt"] == prompt.removesuffix("<start_of_turn>model\n")


def test_a_last_assistant_message_is_continued_as_llama_server_prefills_it(server):
    begun = [*HELLO, {"role": "assistant", "content": "It is"}]
    prompt = post(server, "/apply-template", {"messages": begun}).json()["prompt"]
    assert prompt.endswith("<start_of_turn>model\nIt is"), prompt
    # what asking for it renders; add_generation_prompt: true cannot open a turn after it
    asked = {"messages": begun, "continue_final_message": True, "add_generation_prompt": False}
    assert post(server, "/apply-template", asked).json()["prompt"] == prompt
    opened = post(server, "/apply-template", {"messages": begun, "add_generation_prompt": True})
    assert opened.json()["prompt"] == prompt
    # the chat route keeps vLLM's meaning: a new turn after the assistant's message
    chat = detokenized(server, tokenize(server, messages=begun)["tokens"])
    assert chat.endswith("It is<end_of_turn>\n<start_of_turn>model\n"), chat


@pytest.mark.parametrize("body,param", [
    ({}, "messages"),
    ({"messages": [*HELLO, {"role": "assistant", "content": "It"},
                   {"role": "assistant", "content": "is"}]}, "messages"),
    ({"messages": [*HELLO, {"role": "assistant", "tool_calls": [
        {"id": "call_1", "type": "function",
         "function": {"name": "get_weather", "arguments": "{}"}}]}]}, "messages"),
    ({"messages": []}, "messages"),
    ({"messages": HELLO, "chat_template_kwargs": {"add_generation_prompt": False}},
     "chat_template_kwargs"),
    ({"messages": [{"role": "tool", "content": "sunny", "tool_call_id": "call_1"}]},
     "messages"),
])
def test_bad_apply_template_bodies_are_400s(server, body, param):
    r = post(server, "/apply-template", body)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["type"] == "invalid_request_error" and param in (error["param"] or ""), error


# Bodies the chat route refuses (each was rendered here, the field ignored).
CHAT_REFUSES = [
    ({"temperature": 500}, "temperature"),
    ({"n": 99}, "n"),
    ({"store": True}, "store"),
    ({"metadata": {"a": "b"}}, "metadata"),
    ({"logit_bias": {"abc": 1}}, "logit_bias"),
    ({"max_tokens": 1, "min_tokens": 5}, "min_tokens"),
    ({"grammar": "nonsense"}, "grammar"),
    ({"priority": 5}, "priority"),  # (the session's server has no priority scheduling)
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
     "response_format"),
    ({"reasoning_format": "sideways"}, "reasoning_format"),
]


@pytest.mark.parametrize("extra,param", CHAT_REFUSES)
def test_a_body_the_chat_route_refuses_is_the_same_400(server, extra, param):
    body = {"messages": HELLO, **extra}
    chat = post(server, "/v1/chat/completions", body)
    applied = post(server, "/apply-template", body)
    assert chat.status_code == applied.status_code == 400, (chat.text, applied.text)
    said, here = chat.json()["error"], applied.json()["error"]
    assert said["param"] == here["param"] == param, (said, here)
    assert (said["message"], said["type"]) == (here["message"], here["type"])
    assert here["code"] == 400  # in llama-server's shape (the chat route's is OpenAI's)


@pytest.mark.parametrize("extra,param", [({"stream": True}, "stream"),
                                         ({"truncate_prompt_tokens": 4},
                                          "truncate_prompt_tokens")])
def test_what_the_prompt_cannot_honour_is_a_400(server, extra, param):
    """The chat route streams and cuts the prompt; /apply-template answers the whole prompt in
    one object (it ignored them)."""
    r = post(server, "/apply-template", {"messages": HELLO, **extra})
    assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text
    assert post(server, "/apply-template", {"messages": HELLO, "stream": False}).status_code == 200


@pytest.mark.parametrize("extra,param", [
    ({"store": True}, "store"),
    ({"metadata": {"a": "b"}}, "metadata"),
    ({"max_tokens": 1, "min_tokens": 5}, "min_tokens"),
    ({"repeat_penalty": 1.1, "repetition_penalty": 1.1}, "repetition_penalty"),
    ({"stream": True}, "stream"),
])
def test_router_mode_refuses_them_before_a_load(extra, param):
    """check_apply_template: what router mode checks before it loads a model for the body."""
    chat = msgspec.json.decode(msgspec.json.encode({"messages": HELLO, **extra}),
                               type=ChatCompletionRequest)
    with pytest.raises(InvalidRequestError) as e:
        check_apply_template(chat)
    assert e.value.param == param


def test_another_model_is_not_found(server):
    r = post(server, "/apply-template", {"model": "other", "messages": HELLO})
    assert r.status_code == 404, r.text
    assert r.json()["error"]["code"] == 404 and r.json()["error"]["type"] == "not_found_error"
    assert r.json()["error"]["param"] == "model"


@pytest.mark.parametrize("path", ["/props", "/slots"])
def test_props_and_slots_of_another_model_are_not_found(server, path):
    """?model= (router mode's) was ignored: the served model's answer for any name."""
    r = httpx.get(server.url + path, params={"model": "nope"}, timeout=30)
    assert r.status_code == 404, r.text
    error = r.json()["error"]
    assert (error["code"], error["type"], error["param"]) == (404, "not_found_error", "model")
    assert "'nope' does not exist" in error["message"]
    r = httpx.get(server.url + path, params={"model": server.model}, timeout=30)
    assert r.status_code == 200, r.text


def slot_action_refused(url: str) -> None:
    """llama-server's slot save/restore/erase: a 400 in llama-server's shape that says they
    are not offered (a bare 404 "Not Found" before)."""
    for action in ("save", "restore", "erase"):
        r = httpx.post(f"{url}/slots/0", params={"action": action}, timeout=30,
                       json={"filename": "slot0.bin"})
        assert r.status_code == 400, r.text
        error = r.json()["error"]
        assert (error["code"], error["type"], error["param"]) == (
            400, "invalid_request_error", "action"), error
        assert error["message"].startswith(f"slot actions ({action}) are not offered: justllm "
                                           "keeps no fixed slots"), error


def test_slot_actions_say_they_are_not_offered(server):
    slot_action_refused(server.url)


def test_openai_routes_answer_without_v1_as_llama_servers_do(server):
    # an OpenAI SDK given the server's address without /v1 posts to /chat/completions
    client = openai.OpenAI(base_url=server.url, api_key="unused", max_retries=0, timeout=120)
    body = {"model": server.model, "messages": HELLO, "max_tokens": 6, "temperature": 0}
    alias = client.chat.completions.create(**body)
    v1 = post(server, "/v1/chat/completions", body).json()
    assert alias.choices[0].message.content == v1["choices"][0]["message"]["content"]
    assert alias.usage.prompt_tokens == v1["usage"]["prompt_tokens"]
    r = client.responses.create(model=server.model, input="Say hello.", max_output_tokens=4)
    assert r.usage.output_tokens <= 4
    health = httpx.get(server.url + "/v1/health", timeout=30)
    assert health.status_code == 200 and health.json()["status"] == "ok"
    # llama-server's un-prefixed /completions and /embeddings are its own formats, not OpenAI's
    native = post(server, "/completions", {"prompt": "x", "n_predict": 1}).json()
    assert "content" in native and "choices" not in native
    assert "data" not in post(server, "/embeddings", {"input": "x"}).json()
