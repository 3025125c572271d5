"""Fields clients of vLLM and llama-server send besides OpenAI's: chat_template_kwargs reach the
chat template (chat, /tokenize), repetition_penalty penalises the whole sequence, and
skip_special_tokens is taken at the value this server always has, cache_prompt false computes
the prompt whole."""

from __future__ import annotations

import httpx
import pytest

from tests.server.conftest import start_server

TEMPLATE = ("{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
            "{% if shout %}SHOUT\n{% endif %}{% if add_generation_prompt %}assistant:"
            "{% endif %}")
HI = [{"role": "user", "content": "Hello there."}]


@pytest.fixture(scope="module")
def templated(model_path, tmp_path_factory):
    path = tmp_path_factory.mktemp("template") / "shout.jinja"
    path.write_text(TEMPLATE)
    s = start_server(model_path, "--max-seqs", "4", "--pool-blocks", "128",
                     "--chat-template", str(path))
    yield s
    assert s.stop() == 0


def post(server, path: str, body: dict) -> httpx.Response:
    return httpx.post(server.url + path, json=body, timeout=120)


def test_chat_template_kwargs_reach_the_template(templated):
    def prompt(**extra) -> tuple[str, int]:
        got = post(templated, "/tokenize", {"messages": HI, **extra}).json()
        text = post(templated, "/detokenize", {"tokens": got["tokens"]}).json()["content"]
        return text, got["count"]

    plain, n_plain = prompt()
    loud, n_loud = prompt(chat_template_kwargs={"shout": True})
    assert "SHOUT" not in plain and loud.endswith("user: Hello there.\nSHOUT\nassistant:")
    for kwargs, n in (({}, n_plain), ({"shout": True}, n_loud)):
        r = post(templated, "/v1/chat/completions", {"messages": HI, "max_tokens": 1,
                                                     "chat_template_kwargs": kwargs})
        assert r.status_code == 200 and r.json()["usage"]["prompt_tokens"] == n, r.text
    r = post(templated, "/v1/chat/completions", {
        "messages": HI, "chat_template_kwargs": {"add_generation_prompt": False}})
    assert r.status_code == 400 and r.json()["error"]["param"] == "chat_template_kwargs"
    assert "add_generation_prompt: the server's to set" in r.json()["error"]["message"]
    for hidden in ("raise_exception", "range", "self", "loop"):  # the template's own names
        r = post(templated, "/tokenize", {"messages": HI, "chat_template_kwargs": {hidden: 1}})
        assert r.status_code == 400 and hidden in r.json()["error"]["message"], r.text
    # add_generation_prompt: false alone (vLLM's /tokenize): the conversation as it stands
    bare = post(templated, "/tokenize", {"messages": HI, "add_generation_prompt": False}).json()
    text = post(templated, "/detokenize", {"tokens": bare["tokens"]}).json()["content"]
    assert text.endswith("user: Hello there.\n") and bare["count"] < n_plain
    r = post(templated, "/tokenize", {"prompt": "x", "chat_template_kwargs": {}})
    assert r.status_code == 400 and "goes with messages" in r.text


def test_repetition_penalty_is_vllms_whole_sequence_penalty(server):
    # "banana" lies more than 64 tokens back: llama.cpp's repeat_penalty (the last 64 tokens)
    # does not see it, vLLM's repetition_penalty (the whole sequence) does.
    filler = " ".join(f"Line {i} of the inventory lists nothing of note." for i in range(12))
    prompt = f"My favourite fruit is banana.\n{filler}\nAgain, my favourite fruit is"
    body = {"prompt": prompt, "max_tokens": 3, "temperature": 0}
    plain = post(server, "/v1/completions", body).json()["choices"][0]["text"]
    llama = post(server, "/v1/completions", {**body, "repeat_penalty": 3.0}).json()
    vllm = post(server, "/v1/completions", {**body, "repetition_penalty": 3.0}).json()
    assert plain.startswith(" banana") and llama["choices"][0]["text"].startswith(" banana")
    assert "banana" not in vllm["choices"][0]["text"], vllm
    r = post(server, "/v1/completions", {**body, "repetition_penalty": 1.1,
                                         "repeat_penalty": 1.1})
    assert r.status_code == 400 and r.json()["error"]["param"] == "repetition_penalty"
    r = post(server, "/v1/completions", {**body, "repetition_penalty": 0})
    assert r.status_code == 400 and r.json()["error"]["param"] == "repetition_penalty"


@pytest.mark.parametrize("field, ok, says", [
    ("skip_special_tokens", True, "control tokens are always left out"),
])
def test_fields_taken_at_this_servers_value(server, field, ok, says):
    for path, body in (("/v1/completions", {"prompt": "Hi"}),
                       ("/v1/chat/completions", {"messages": HI})):
        good = post(server, path, {**body, "max_tokens": 2, field: ok})
        assert good.status_code == 200, good.text
        bad = post(server, path, {**body, "max_tokens": 2, field: not ok})
        assert bad.status_code == 400 and bad.json()["error"]["param"] == field
        assert says in bad.json()["error"]["message"]


@pytest.mark.parametrize("path, body", [
    ("/v1/completions", {"prompt": "A prompt that the prefix cache keeps. " * 4}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Keep me. " * 8}]})])
def test_cache_prompt_false_takes_nothing_from_the_prefix_cache(server, path, body):
    """llama-server's cache_prompt on the OpenAI routes (only true was taken)."""
    def cached(**extra) -> int:
        r = post(server, path, {**body, "max_tokens": 1, **extra})
        assert r.status_code == 200, r.text
        return r.json()["usage"]["prompt_tokens_details"]["cached_tokens"]

    cached()
    assert cached(cache_prompt=False) == 0
    assert cached() > 0 and cached(cache_prompt=True) > 0
    bad = post(server, path, {**body, "max_tokens": 1, "cache_prompt": "yes"})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "cache_prompt", bad.text


def test_min_tokens_holds_the_end_back(server):
    """vLLM's min_tokens: end-of-generation tokens, stop tokens and stop strings wait for that
    many tokens."""
    [eos] = post(server, "/tokenize", {"content": "<eos>"}).json()["tokens"]
    body = {"prompt": "One, two, three, four, five, six, seven,", "max_tokens": 20,
            "temperature": 0}
    forced = {**body, "logit_bias": {str(eos): 100}}  # the end at once
    now = post(server, "/v1/completions", forced).json()
    assert now["choices"][0]["finish_reason"] == "stop" and now["choices"][0]["text"] == ""
    held = post(server, "/v1/completions", {**forced, "min_tokens": 5}).json()
    assert held["choices"][0]["finish_reason"] == "stop", held
    assert held["usage"]["completion_tokens"] in (5, 6) and held["choices"][0]["text"], held
    free = post(server, "/v1/completions", {**body, "logprobs": 0}).json()["choices"][0]
    second = post(server, "/tokenize", {"prompt": free["text"], "add_special_tokens": False}
                  ).json()["tokens"][1]
    stopped = post(server, "/v1/completions", {**body, "stop_token_ids": [second]}).json()
    assert stopped["usage"]["completion_tokens"] == 2
    later = post(server, "/v1/completions", {**body, "stop_token_ids": [second],
                                             "min_tokens": 6}).json()
    assert later["usage"]["completion_tokens"] >= 6
    early = post(server, "/v1/completions", {**body, "stop": [","]}).json()
    assert early["usage"]["completion_tokens"] <= 2, early
    late = post(server, "/v1/completions", {**body, "stop": [","], "min_tokens": 6}).json()
    assert late["usage"]["completion_tokens"] >= 6 and "," in late["choices"][0]["text"]
    for bad, says in (({"min_tokens": 30, "max_tokens": 20}, "must be at most max_tokens"),
                      ({"min_tokens": -1}, "Expected `int` >= 0"),
                      ({"min_tokens": 2, "grammar": 'root ::= "a"'}, "cannot be combined")):
        r = post(server, "/v1/completions", {**body, **bad})
        assert r.status_code == 400 and r.json()["error"]["param"] == "min_tokens", r.text
        assert says in r.json()["error"]["message"]


def test_a_stop_string_past_1000_characters_is_refused(server):
    """Each token looked back over the whole stop string for one beginning, O(L^2): 23 ms a
    token for 20,000 characters, hours for the 16 x 500,000 a body could carry."""
    for path, body in (("/v1/completions", {"prompt": "Hi"}),
                       ("/v1/chat/completions", {"messages": HI})):
        r = post(server, path, {**body, "max_tokens": 2, "stop": ["x" * 1001]})
        assert r.status_code == 400 and r.json()["error"]["param"] == "stop", r.text
        assert "at most 1000 characters" in r.json()["error"]["message"]
        assert post(server, path, {**body, "max_tokens": 2, "stop": ["x" * 1000]}
                    ).status_code == 200
