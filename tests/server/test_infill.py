"""llama-server's ``/infill`` on a real server, and the code-completion fields editor plugins
send with it (llama.vim's body): the FIM layout, ``n_predict`` 0 warming the cache,
``n_indent``, ``t_max_predict_ms``, the ``infill`` sampler. The model is the demo model with
five unused tokens named as its FIM tokens (tests/models/ggufs.py): llama.cpp reads them as a
code model's, so the layout is the real one, though the answers are no better."""

from __future__ import annotations

import json

import httpx
import openai
import pytest

from tests.models.ggufs import with_fim_tokens
from tests.server.conftest import start_server
from tests.server.test_tokenize import post

CODE = {"input_prefix": "def add(a, b):\n    ", "input_suffix": "\n\nprint(add(1, 2))\n",
        "prompt": "return"}


@pytest.fixture(scope="module")
def fim_server(model_path, tmp_path_factory):
    path = with_fim_tokens(model_path, tmp_path_factory.mktemp("fim") / "fim.gguf",
                           ("pre", "suf", "mid", "rep", "sep"))
    s = start_server(str(path), "--max-seqs", "4", "--pool-blocks", "256")
    yield s
    assert s.stop() == 0


def infill(server, **body) -> dict:
    r = post(server, "/infill", {**CODE, **body})
    assert r.status_code == 200, r.text
    return r.json()


def refused(server, param: str, **body) -> str:
    r = post(server, "/infill", {**CODE, **body})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param, r.text
    return r.json()["error"]["message"]


def test_the_prompt_is_llama_servers_fim_layout_and_answers_as_completion_does(fim_server):
    extra = [{"filename": "util.py", "text": "X = 1\n", "time": 12.5}]
    # (ignore_eos: on some CPUs' kernels the model ends the code after two tokens)
    got = infill(fim_server, input_extra=extra, n_predict=6, temperature=0, return_tokens=True,
                 ignore_eos=True)
    # <unused0..4> are PRE, SUF, MID, REP and SEP here; other files first, then BOS
    assert got["prompt"] == ("<unused3>myproject\n<unused4>util.py\nX = 1\n<unused4>filename\n"
                             "<bos><unused0>def add(a, b):\n    return<unused1>\n\n"
                             "print(add(1, 2))\n<unused2>")
    ids = post(fim_server, "/tokenize", {"content": got["prompt"], "add_special": False,
                                         "parse_special": True}).json()["tokens"]
    assert got["tokens_evaluated"] == len(ids)
    same = post(fim_server, "/completion", {"prompt": ids, "n_predict": 6, "temperature": 0,
                                            "return_tokens": True, "ignore_eos": True}).json()
    assert (same["content"], same["tokens"]) == (got["content"], got["tokens"])
    assert got["tokens_predicted"] == 6 and got["stop_type"] == "limit"


def test_spm_infill_puts_the_suffix_first(model_path, tmp_path):
    """llama-server's --spm-infill: SUF suffix PRE prefix prompt MID, on every FIM route."""
    path = with_fim_tokens(model_path, tmp_path / "fim.gguf", ("pre", "suf", "mid"))
    s = start_server(str(path), "--max-seqs", "2", "--pool-blocks", "64", "--spm-infill")
    try:
        got = infill(s, n_predict=3, temperature=0, return_tokens=True)
        assert got["prompt"] == ("<bos><unused1>\n\nprint(add(1, 2))\n"
                                 "<unused0>def add(a, b):\n    return<unused2>")
        ids = post(s, "/tokenize", {"content": got["prompt"], "add_special": False,
                                    "parse_special": True}).json()["tokens"]
        same = post(s, "/completion", {"prompt": ids, "n_predict": 3, "temperature": 0,
                                       "return_tokens": True}).json()
        assert same["tokens"] == got["tokens"]
        # OpenAI's suffix on /v1/completions takes the same layout
        done = post(s, "/v1/completions", {"prompt": CODE["input_prefix"] + CODE["prompt"],
                                           "suffix": CODE["input_suffix"], "max_tokens": 3,
                                           "temperature": 0, "repeat_penalty": 1.0}).json()
        assert done["usage"]["prompt_tokens"] == len(ids)
    finally:
        assert s.stop() == 0


def test_a_model_without_fim_tokens_cannot_infill(server):
    r = post(server, "/infill", CODE)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == "model" and "no FIM prefix, suffix, middle token" in error[
        "message"]


@pytest.mark.parametrize("body, param", [
    ({"input_prefix": None}, "input_prefix"),
    ({"prompt": ["x"]}, "prompt"),
    ({"input_extra": [{"filename": "a.py"}]}, "input_extra[0]"),
    ({"input_extra": [{"text": "x", "lang": "py"}]}, "input_extra[0].lang"),
    ({"input_extra": [{"text": "x", "filename": 3}]}, "input_extra[0].filename"),
    ({"samplers": ["top_p", "infill"]}, "samplers"),
    ({"n_indent": -1}, "n_indent"),
])
def test_bad_infill_bodies_are_400s(fim_server, body, param):
    assert refused(fim_server, param, **body)


def test_llama_vims_requests(fim_server):
    """Its warm-up (n_predict 0: the other files computed into the cache, nothing drawn),
    then a suggestion with its fields: the prefix cache holds the warm-up's tokens."""
    extra = [{"filename": "lib.py", "text": "def helper():\n    return 42\n" * 8, "time": 1}]
    warm = infill(fim_server, input_prefix="", input_suffix="", prompt="", input_extra=extra,
                  n_predict=0, temperature=0.0, samplers=["temperature"], cache_prompt=True,
                  t_max_prompt_ms=1, t_max_predict_ms=1)
    assert (warm["content"], warm["tokens_predicted"], warm["stop_type"]) == ("", 0, "limit")
    got = infill(fim_server, id_slot=0, input_extra=extra, n_predict=16, n_indent=4,
                 top_k=40, top_p=0.9, samplers=["top_k", "top_p", "infill"], stream=False,
                 cache_prompt=True, t_max_prompt_ms=500, t_max_predict_ms=1000, seed=1,
                 response_fields=["content", "timings/prompt_n", "timings/cache_n",
                                  "generation_settings/samplers", "tokens_cached"])
    assert got["generation_settings/samplers"] == ["top_k", "top_p", "infill"]
    assert got["timings/cache_n"] >= warm["tokens_evaluated"] - 16  # (the last block's)
    assert got["timings/prompt_n"] + got["timings/cache_n"] > warm["tokens_evaluated"]


def greedy(server, prompt: str, n: int = 40, **body) -> dict:
    r = post(server, "/completion", {"prompt": prompt, "n_predict": n, "temperature": 0,
                                     "return_tokens": True, **body})
    assert r.status_code == 200, r.text
    return r.json()


LIST = "Shopping list:\n- apples\n- pears\n-"


def test_n_indent_ends_the_answer_at_the_first_line_under_it(fim_server):
    whole = greedy(fim_server, LIST)
    whole = greedy(fim_server, LIST)  # (a cache hit, as the ones below)
    text = whole["content"]
    line = text.index("\n") + 1  # the answer's second line is not indented (a list item)
    assert text[line] not in " \t\n", text
    cut = greedy(fim_server, LIST, n_indent=2)
    assert (cut["content"], cut["stop_type"], cut["truncated"]) == (text[:line], "limit", False)
    assert cut["tokens_predicted"] < whole["tokens_predicted"]
    # streamed: the same text, then the last event says where it ended
    with httpx.stream("POST", fim_server.url + "/completion", timeout=60, json={
            "prompt": LIST, "n_predict": 40, "temperature": 0, "n_indent": 2,
            "stream": True}) as r:
        events = [json.loads(line[6:]) for line in r.iter_lines() if line]
    assert "".join(e["content"] for e in events) == text[:line]
    assert events[-1]["stop"] and events[-1]["stop_type"] == "limit"
    # the engine ended the request (no slot held): the server answers the next at once
    assert greedy(fim_server, LIST)["content"] == text


def test_past_t_max_predict_ms_the_next_newline_ends_the_answer(fim_server):
    whole = greedy(fim_server, LIST)
    got = greedy(fim_server, LIST, t_max_predict_ms=1)
    pieces = [post(fim_server, "/detokenize", {"tokens": [t]}).json()["content"]
              for t in got["tokens"]]
    # the first token with a newline came after 1 ms: the answer ends with it
    assert "\n" in pieces[-1] and not any("\n" in p for p in pieces[:-1]), pieces
    assert whole["content"].startswith(got["content"]) and got["stop_type"] == "limit"


def test_a_long_prefix_keeps_its_last_three_quarters_of_a_batch(fim_server):
    prefix = "".join(f"x{i} = {i}\n" for i in range(400))  # ~2,800 tokens
    got = infill(fim_server, input_prefix=prefix, input_suffix="", prompt="", n_predict=1,
                 temperature=0)
    ids = post(fim_server, "/tokenize", {"content": prefix, "add_special": False,
                                         "parse_special": False}).json()["tokens"]
    tail = post(fim_server, "/detokenize", {"tokens": ids[-384:]}).json()["content"]  # 3/4 x 512
    assert got["prompt"].endswith("<unused0>" + tail + "<unused1><unused2>"), got["prompt"][:80]
    assert not got["prompt"].endswith("<unused0>" + prefix + "<unused1><unused2>")


def test_ollamas_suffix_is_the_same_fill_in_the_middle_prompt(fim_server, server):
    """Ollama's /api/generate with suffix (Continue's autocomplete on Ollama): the prompt is
    the code before the gap and suffix the code after, laid out as /infill lays them out."""
    prefix, suffix = CODE["input_prefix"] + CODE["prompt"], CODE["input_suffix"]
    # two greedy tokens: the same prompt, later computed on the first's cached prefix, can
    # flip a near tie further on (README: seed)
    want = infill(fim_server, prompt="", input_prefix=prefix, n_predict=2, temperature=0,
                  repeat_penalty=1.0)
    body = {"model": fim_server.model, "prompt": prefix, "suffix": suffix, "stream": False,
            "options": {"temperature": 0, "num_predict": 2, "repeat_penalty": 1.0}}
    got = post(fim_server, "/api/generate", body).json()
    assert got["response"] == want["content"], got
    assert got["prompt_eval_count"] == want["tokens_evaluated"]
    streamed = httpx.post(fim_server.url + "/api/generate", json={**body, "stream": True},
                          timeout=60)
    parts = [json.loads(line) for line in streamed.text.splitlines()]
    assert "".join(p["response"] for p in parts) == want["content"] and parts[-1]["done"]
    show = post(fim_server, "/api/show", {"model": fim_server.model}).json()
    assert "insert" in show["capabilities"]
    # what Continue looks for to send the suffix: {{ .Suffix }} in the template, here in a
    # Jinja comment after the chat template, which still renders as before
    assert ".Suffix" in show["template"]
    import jinja2
    jinja2.Environment().parse(show["template"])
    # at the start of a file (no prompt) the suffix is still completed, not a load
    start = post(fim_server, "/api/generate", {**body, "prompt": ""}).json()
    assert start["done_reason"] != "load" and start["eval_count"] >= 1
    for extra, param in [({"raw": True}, "suffix"), ({"system": "Be brief."}, "system")]:
        r = post(fim_server, "/api/generate", {**body, **extra})
        assert r.status_code == 400 and r.json()["error"].startswith(param), r.text
    # a model without FIM tokens: Ollama's "does not support insert"
    r = post(server, "/api/generate", {**body, "model": server.model})
    assert r.status_code == 400 and "does not support insert" in r.json()["error"], r.text
    show = post(server, "/api/show", {"model": server.model}).json()
    assert "insert" not in show["capabilities"] and ".Suffix" not in show["template"]


def test_openais_suffix_on_completions_is_the_same_prompt(fim_server, server):
    """OpenAI's suffix on /v1/completions (its insert; llama-cpp-python and DeepSeek's FIM
    take it): each text prompt is the code before the gap, laid out as /infill lays it out."""
    prefix, suffix = CODE["input_prefix"] + CODE["prompt"], CODE["input_suffix"]
    want = infill(fim_server, prompt="", input_prefix=prefix, n_predict=2, temperature=0)
    client = openai.OpenAI(base_url=fim_server.url + "/v1", api_key="unused", max_retries=0,
                           timeout=60)
    got = client.completions.create(model=fim_server.model, prompt=[prefix, prefix],
                                    suffix=suffix, max_tokens=2, temperature=0)
    assert [c.text for c in got.choices] == [want["content"]] * 2
    assert got.usage.prompt_tokens == 2 * want["tokens_evaluated"]
    for extra, param in [({"echo": True}, "echo"), ({"prompt": [5, 6, 7]}, "prompt")]:
        r = post(fim_server, "/v1/completions", {"prompt": prefix, "suffix": suffix,
                                                 "max_tokens": 2, **extra})
        assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text
    r = post(server, "/v1/completions", {"prompt": prefix, "suffix": suffix, "max_tokens": 2})
    assert r.status_code == 400 and r.json()["error"]["param"] == "suffix", r.text
    assert "no FIM" in r.json()["error"]["message"]
