"""``POST /tokenize`` and ``POST /detokenize`` on a real server: vLLM's forms give the tokens the
completion and chat routes give the model (their ``usage`` agrees), llama-server's form its
defaults, and every bad body a 400 in llama-server's shape (``code`` the status, and
``param``)."""

from __future__ import annotations

import httpx
import pytest

WEATHER = [{"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                   "required": ["city"]}}}]


def post(server, path: str, body: dict) -> httpx.Response:
    return httpx.post(server.url + path, json=body, timeout=60)


def tokenize(server, **body) -> dict:
    r = post(server, "/tokenize", body)
    assert r.status_code == 200, r.text
    return r.json()


def test_a_prompt_is_tokenized_as_completions_reads_it(server):
    prompt = "The capital of France is"
    got = tokenize(server, model=server.model, prompt=prompt)
    usage = post(server, "/v1/completions", {"prompt": prompt, "max_tokens": 1}).json()["usage"]
    assert got["count"] == len(got["tokens"]) == usage["prompt_tokens"]
    assert got["token_strs"] is None and got["max_model_len"] > got["count"]
    # the tokens as a prompt are the same prompt: the same answer, greedy
    same = [post(server, "/v1/completions", {"prompt": p, "max_tokens": 4, "temperature": 0}
                 ).json()["choices"][0]["text"] for p in (prompt, got["tokens"])]
    assert same[0] == same[1]
    bare = tokenize(server, prompt=prompt, add_special_tokens=False)["tokens"]
    assert got["tokens"] == [got["tokens"][0], *bare]  # BOS, then the text
    back = post(server, "/detokenize", {"tokens": got["tokens"]}).json()
    assert back["prompt"] == back["content"] == "<bos>" + prompt


def test_token_strs_are_the_vocabularys_texts(server):
    got = tokenize(server, prompt="Hello world", return_token_strs=True)
    assert got["token_strs"] == ["<bos>", "Hello", "▁world"]


@pytest.mark.parametrize("extra", [{}, {"tools": WEATHER}])
def test_messages_count_what_a_chat_completion_reports(server, extra):
    messages = [{"role": "system", "content": "Be brief."},
                {"role": "user", "content": "What is the weather in Paris?"}]
    got = tokenize(server, messages=messages, **extra)
    r = post(server, "/v1/chat/completions", {"messages": messages, "max_tokens": 1, **extra})
    assert got["count"] == r.json()["usage"]["prompt_tokens"]
    text = post(server, "/detokenize", {"tokens": got["tokens"]}).json()["prompt"]
    assert text.startswith("<bos><start_of_turn>user\n") and "Paris" in text
    assert ("get_weather" in text) == bool(extra)
    assert text.endswith("<start_of_turn>model\n")  # the generation prompt


def test_a_continued_assistant_message_ends_the_tokens(server):
    messages = [{"role": "user", "content": "Count to three."},
                {"role": "assistant", "content": "One, two,"}]
    got = tokenize(server, messages=messages, continue_final_message=True,
                   add_generation_prompt=False, add_special_tokens=False)
    text = post(server, "/detokenize", {"tokens": got["tokens"]}).json()["content"]
    assert text.endswith("One, two,")


def test_llama_servers_form_and_its_defaults(server):
    got = tokenize(server, content="Hello <start_of_turn>", with_pieces=True)
    ids = [t["id"] for t in got["tokens"]]
    assert ids == tokenize(server, prompt="Hello <start_of_turn>",
                           add_special_tokens=False)["tokens"]  # no BOS by default
    assert "".join(t["piece"] for t in got["tokens"]) == "Hello <start_of_turn>"
    assert got["tokens"][-1]["piece"] == "<start_of_turn>"  # one special token, parsed
    as_text = tokenize(server, content="<start_of_turn>", parse_special=False)["tokens"]
    assert len(as_text) > 1 and ids[-1] not in as_text
    assert tokenize(server, content="Hi", add_special=True)["tokens"][0] == ids_of_bos(server)
    # A null is the default, as llama-server reads each field (its json_value's fallback).
    unset = tokenize(server, content="Hello <start_of_turn>", with_pieces=None,
                     parse_special=None)["tokens"]
    assert unset == ids


def ids_of_bos(server) -> int:
    return tokenize(server, prompt="")["tokens"][0]


@pytest.mark.parametrize("path, body, param, says", [
    ("/tokenize", {}, "prompt", "exactly one of prompt, messages"),
    ("/tokenize", {"prompt": "a", "content": "b"}, "content", "has prompt and content"),
    ("/tokenize", {"prompt": "a", "tools": WEATHER}, "tools", "goes with messages"),
    ("/tokenize", {"content": "a", "continue_final_message": True}, "continue_final_message",
     "goes with messages"),
    ("/tokenize", {"prompt": "a", "add_special_tokens": True, "add_special": False},
     "add_special", "disagree"),
    ("/tokenize", {"messages": [{"role": "user", "content": "hi"}], "add_special_tokens": True},
     "add_special_tokens", "second BOS"),
    ("/tokenize", {"messages": [{"role": "user", "content": "hi"}], "parse_special": False},
     "parse_special", "special tokens"),
    ("/tokenize", {"messages": [{"role": "user", "content": "hi"}], "tool_choice": "required"},
     "tool_choice", "only allowed when tools"),
    ("/tokenize", {"messages": []}, "messages", "must not be empty"),
    ("/tokenize", {"prompt": "a", "with_pieces": 1}, "with_pieces", "Expected `bool | null`"),
    ("/tokenize", {"prompt": "a", "suffix": "b"}, "suffix", "unknown field"),
    ("/detokenize", {"tokens": [2, -1]}, "tokens", "tokens[1]: -1 is not a token id"),
    ("/detokenize", {"tokens": [10 ** 9]}, "tokens", "is not a token id"),
    ("/detokenize", {"tokens": "2 3"}, "tokens", "Expected `array`"),
    ("/detokenize", {}, "tokens", "missing required field `tokens`"),
])
def test_bad_bodies_are_400s(server, path, body, param, says):
    r = post(server, path, body)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["type"] == "invalid_request_error" and error["param"] == param
    assert error["code"] == 400  # llama-server's shape: code is the status
    assert says in error["message"], error["message"]


def test_another_model_is_not_found(server):
    for path, body in (("/tokenize", {"prompt": "a"}), ("/detokenize", {"tokens": [2]})):
        r = post(server, path, {"model": "nope", **body})
        assert r.status_code == 404, r.text
        error = r.json()["error"]
        assert (error["code"], error["type"], error["param"]) == (404, "not_found_error", "model")
