"""llama-server's native ``POST /completion`` on a real server: its body (prompt forms,
``n_predict``, llama.cpp's sampler defaults and order, ``samplers``, ``n_probs``,
``logit_bias`` by text or ``false``, ``response_fields``), its answer and its stream."""

from __future__ import annotations

import json
import math

import httpx
import pytest

from tests.server.conftest import start_server
from tests.server.test_tokenize import post, tokenize

PROMPT = "The capital of France is"


@pytest.fixture(scope="module")
def uncached(model_path):
    """A server without its prefix cache, for the tests that compare two requests for the same
    prompt exactly: each computes the prompt whole, in one batch. On the session's server the
    prompt's KV may come from the cache or not, as the other files that server has run left
    it (this prompt is too short for host memory), and on this CPU a prompt computed in another
    batch shape moves the logits a little (tests/helpers.py EXACT): enough to turn a sampled
    token at temperature 1.5. Its pool is small (2,048 tokens), so a prompt that fills the
    context is quick to prefill."""
    s = start_server(model_path, "--max-seqs", "4", "--pool-blocks", "128", "--no-prefix-cache")
    yield s
    assert s.stop() == 0


def complete(server, **body) -> dict | list:
    r = post(server, "/completion", {"prompt": PROMPT, **body})
    assert r.status_code == 200, r.text
    return r.json()


def refused(server, param: str, **body) -> str:
    r = post(server, "/completion", {"prompt": PROMPT, **body})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param, r.text
    return r.json()["error"]["message"]


def test_an_answer_in_llama_servers_shape_with_greedy_tokens(server):
    greedy = post(server, "/v1/completions", {"prompt": PROMPT, "max_tokens": 8,
                                              "temperature": 0}).json()["choices"][0]["text"]
    got = complete(server, n_predict=8, temperature=0, return_tokens=True)
    assert got["content"] == greedy
    assert (got["stop"], got["stop_type"], got["stopping_word"], got["truncated"]) == (
        True, "limit", "", False)
    assert got["tokens_predicted"] == 8 == len(got["tokens"])
    assert got["tokens_evaluated"] == tokenize(server, prompt=PROMPT)["count"]
    assert got["prompt"] == "<bos>" + PROMPT and got["model"] == server.model
    assert got["id_slot"] == -1  # no slots; what a client may send back
    assert post(server, "/detokenize", {"tokens": got["tokens"]}).json()["content"] == greedy
    settings = got["generation_settings"]
    assert (settings["n_predict"], settings["top_k"], settings["top_p"], settings["min_p"]) == (
        8, 40, 0.95, 0.05)
    assert settings["samplers"][-1] == "temperature"  # llama.cpp's order: temperature last
    timings = got["timings"]
    assert timings["predicted_n"] == 8 and timings["prompt_n"] + timings["cache_n"] == got[
        "tokens_evaluated"]
    assert "completion_probabilities" not in got
    # llama-server's other path for it (not OpenAI's /v1/completions)
    again = post(server, "/completions", {"prompt": PROMPT, "n_predict": 8, "temperature": 0})
    assert again.status_code == 200 and again.json()["content"] == greedy, again.text
    # without return_tokens the ids are left out, as llama-server leaves them
    assert complete(server, n_predict=2, temperature=0)["tokens"] == []
    # llama-server's other names: max_completion_tokens, logprobs, n (1), adaptive-p off
    other = complete(server, max_completion_tokens=3, logprobs=2, n=1, adaptive_target=-1,
                     temperature=0)
    assert other["tokens_predicted"] == 3 and len(other["completion_probabilities"]) == 3


def test_stop_words_seeds_and_response_fields(server, uncached):
    worded = complete(server, prompt="1, 2, 3,", n_predict=20, temperature=0, stop=[" 6"],
                      n_probs=1)
    assert (worded["stop_type"], worded["stopping_word"]) == ("word", " 6")
    assert " 6" not in worded["content"] and worded["tokens_predicted"] == 8
    # the stop word's tokens have no probabilities: they are not in the content
    assert "".join(p["token"] for p in worded["completion_probabilities"]) == worded["content"]
    # (sampled answers compared exactly: on the uncached server, as its fixture says why; on
    # the session's server a drawn seed's answer once differed in its 11th token)
    first = complete(uncached, n_predict=12, seed=7)
    assert complete(uncached, n_predict=12, seed=7)["content"] == first["content"]
    drawn = complete(uncached, n_predict=12)  # -1: a seed drawn and reported
    seed = drawn["generation_settings"]["seed"]
    assert seed >= 0 and complete(uncached, n_predict=12, seed=seed)["content"] == drawn[
        "content"]
    # repeat_last_n -1: the whole context, as llama-server reads it
    assert complete(server, n_predict=2, repeat_last_n=-1, repeat_penalty=1.3)["stop"]
    picked = complete(server, n_predict=2, response_fields=[
        "content", "generation_settings/n_predict", "absent"])
    assert set(picked) == {"content", "generation_settings/n_predict"}  # llama-server's keys
    assert picked["generation_settings/n_predict"] == 2
    # llama.cpp's seeds are unsigned 32-bit: -5 is 4294967291, and repeats
    odd = complete(uncached, n_predict=6, seed=-5)
    assert odd["generation_settings"]["seed"] == 2**32 - 5
    assert complete(uncached, n_predict=6, seed=2**32 - 5)["content"] == odd["content"]


def test_prompt_forms(server):
    ids = tokenize(server, prompt=PROMPT)["tokens"]
    text = complete(server, n_predict=4, temperature=0)["content"]
    # token ids, and ids mixed with text (the text after an id gets no BOS of its own)
    for prompt in (ids, [ids[0], PROMPT]):
        got = complete(server, prompt=prompt, n_predict=4, temperature=0)
        assert (got["content"], got["tokens_evaluated"]) == (text, len(ids)), prompt
    # several prompts: an array of answers, in order
    many = complete(server, prompt=[PROMPT, "Once upon a time", ids], n_predict=4,
                    temperature=0)
    assert isinstance(many, list) and [a["index"] for a in many] == [0, 1, 2]
    assert many[0]["content"] == many[2]["content"] == text
    # llama-server's object form (its multimodal one), alone or in an array
    for prompt in ({"prompt_string": PROMPT}, {"prompt_string": [ids[0], PROMPT]}):
        got = complete(server, prompt=prompt, n_predict=4, temperature=0)
        assert (got["content"], got["tokens_evaluated"]) == (text, len(ids)), prompt
    pair = complete(server, prompt=[{"prompt_string": PROMPT}, PROMPT], n_predict=4,
                    temperature=0)
    assert [a["content"] for a in pair] == [text, text]
    assert "multimodal" in refused(server, "prompt.multimodal_data", prompt={
        "prompt_string": PROMPT, "multimodal_data": ["aGk="]})
    assert refused(server, "prompt.x", prompt=[{"x": 1}])
    assert refused(server, "prompt", prompt={})
    assert refused(server, "prompt.prompt_string", prompt={"prompt_string": {"prompt_string": "a"}})
    assert refused(server, "prompt", prompt=[{"prompt_string": True}])
    # an empty string is BOS alone, as llama-server reads it: the model starts a document
    empty = complete(server, prompt="", n_predict=4, temperature=0)
    assert (empty["tokens_evaluated"], empty["prompt"]) == (1, "<bos>")
    assert empty["content"] == complete(server, prompt=[ids[0]], n_predict=4,
                                        temperature=0)["content"] != ""


def test_a_stream_is_llama_servers_events(uncached):
    server = uncached  # (the whole and the streamed answer are compared exactly)
    whole = complete(server, n_predict=10, temperature=0, n_probs=2)
    with httpx.stream("POST", server.url + "/completion", timeout=60, json={
            "prompt": PROMPT, "n_predict": 10, "temperature": 0, "stream": True,
            "n_probs": 2}) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        lines = [line for line in r.iter_lines() if line]
    assert all(line.startswith("data: {") for line in lines), lines  # no [DONE]
    events = [json.loads(line[6:]) for line in lines]
    assert [e["stop"] for e in events] == [False] * (len(events) - 1) + [True]
    assert "".join(e["content"] for e in events) == whole["content"]
    assert [t for e in events for t in e["tokens"]] == [p["id"] for p in whole[
        "completion_probabilities"]]
    assert events[-1]["stop_type"] == "limit" and events[-1]["tokens_predicted"] == 10
    probs = [p for e in events[:-1] for p in e["completion_probabilities"]]
    assert probs == whole["completion_probabilities"]
    assert len(probs[0]["top_logprobs"]) == 2 and probs[0]["id"] == probs[0]["top_logprobs"][0][
        "id"]  # greedy: the best is the token drawn


def test_llama_cpps_order_cuts_before_it_tempers(uncached):
    """min_p 0.5 then temperature 100 (llama.cpp's order): the cut keeps the tokens within
    ln 2 of the best, which the temperature then evens out; tempering first (OpenAI's order)
    would keep nearly the whole vocabulary. Every drawn token lies within the cut."""
    server = uncached  # (requests for one prompt are compared exactly)
    got = complete(server, n_predict=24, temperature=100, top_k=0, top_p=1.0, min_p=0.5,
                   n_probs=1, seed=3)
    for p in got["completion_probabilities"]:
        assert p["logprob"] >= p["top_logprobs"][0]["logprob"] + math.log(0.5) - 1e-3, p
    # top_k 1 anywhere in the chain: greedy at any temperature
    greedy = complete(server, n_predict=8, temperature=0)["content"]
    assert complete(server, n_predict=8, temperature=5, top_k=1, seed=4,
                    samplers=["temperature", "top_k"])["content"] == greedy
    # llama.cpp's top_p: 0 and below keeps the best token alone, 1 and above is off
    for top_p in (0, -1):
        assert complete(server, n_predict=8, temperature=5, top_k=0, top_p=top_p, seed=4)[
            "content"] == greedy
    wide = {"n_predict": 8, "temperature": 1.5, "top_k": 0, "min_p": 0, "seed": 5}
    assert complete(server, **wide, top_p=1.5)["content"] == complete(server, **wide, top_p=1)[
        "content"] != greedy
    # llama.cpp's other spellings of the names
    assert complete(server, n_predict=2, samplers=["Top-K", "topp", "nucleus", "temp"])[
        "generation_settings"]["samplers"] == ["top_k", "top_p", "top_p", "temperature"]
    # a chain without the temperature step samples at the model's own temperature
    assert complete(server, n_predict=4, temperature=0, samplers="k")[
        "generation_settings"]["samplers"] == ["top_k"]


def test_presence_and_frequency_count_the_prompt_as_llama_cpp_does(server):
    """llama-server counts them over the last repeat_last_n tokens, the prompt's included (0:
    none); they counted the answer alone, as OpenAI's do. Here the greedy first token is a
    colour the prompt names (" green" just ahead of " blue"), and " red" is not one of its
    tokens ("Red," is)."""
    prompt = "Red, green, blue. My favourite colour is"
    named = set(post(server, "/tokenize", {"content": prompt}).json()["tokens"])

    def first(path="/completion", **body):
        if path == "/completion":
            return complete(server, prompt=prompt, n_predict=1, temperature=0,
                            return_tokens=True, **body)["tokens"][0]
        r = post(server, path, {"prompt": prompt, "max_tokens": 1, "temperature": 0,
                                "logprobs": 1, **body}).json()["choices"][0]
        return r["logprobs"]["tokens"][0]

    assert first() in named
    for penalty in ({"presence_penalty": 2}, {"frequency_penalty": 2}):
        assert first(**penalty) not in named, penalty
        assert first(**penalty, repeat_last_n=0) in named, penalty
    openai = first("/v1/completions", presence_penalty=2)  # (the answer alone: none yet)
    assert openai == first("/v1/completions")


def test_logit_bias_by_id_text_or_false(server):
    first = complete(server, n_predict=1, temperature=0, return_tokens=True)["tokens"][0]
    for bias in ([[first, False]], {str(first): -100},
                 [[post(server, "/detokenize", {"tokens": [first]}).json()["content"], False]]):
        got = complete(server, n_predict=1, temperature=0, return_tokens=True, logit_bias=bias)
        assert got["tokens"][0] != first, bias


def test_ignore_eos_bans_the_end_tokens_and_n_predict_past_the_context_fills_it(uncached):
    """llama-server's ignore_eos gives the end tokens no chance (here they would win: biased
    up by 30); an n_predict the context has no room for runs until the context is full."""
    server = uncached  # (its 2,048-token context: the session server's 8,192 took over 60 s
    # to prefill in a fresh clone's run, on the one core an xdist worker has)
    eos = tokenize(server, content="<eos>", parse_special=True)["tokens"][0]
    pushed = {"n_predict": 4, "temperature": 0, "return_tokens": True,
              "logit_bias": [[eos, 30]]}
    assert complete(server, **pushed)["stop_type"] == "eos"  # the bias makes it end at once
    got = complete(server, **pushed, ignore_eos=True)
    assert got["tokens_predicted"] == 4 and eos not in got["tokens"], got
    limit = tokenize(server, prompt="x")["max_model_len"]
    ids = tokenize(server, prompt=PROMPT)["tokens"]
    long = ids + [ids[-1]] * (limit - len(ids) - 3)
    full = complete(server, prompt=long, n_predict=100, temperature=0, ignore_eos=True)
    assert (full["tokens_predicted"], full["truncated"], full["stop_type"]) == (3, True, "limit")


def test_structured_output(server):
    got = complete(server, n_predict=8, grammar='root ::= "yes" | "no"', seed=1)
    assert got["content"] in ("yes", "no") and got["stop_type"] == "eos"
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    got = complete(server, n_predict=40, json_schema=schema, temperature=0)
    assert isinstance(json.loads(got["content"])["a"], int)


def test_cache_prompt_false_computes_the_prompt_whole(server):
    """llama-server's cache_prompt (a 400 here before): false takes nothing from the prefix
    cache, true (the default) takes what it holds."""
    prompt = PROMPT + " The cache keeps this prompt."
    first = complete(server, prompt=prompt, n_predict=1, temperature=0)
    whole = complete(server, prompt=prompt, n_predict=1, temperature=0, cache_prompt=False)
    assert whole["tokens_cached"] == 0
    assert whole["timings"]["prompt_n"] == whole["tokens_evaluated"] == first["tokens_evaluated"]
    again = complete(server, prompt=prompt, n_predict=1, temperature=0)
    assert again["tokens_cached"] == again["tokens_evaluated"] - 1, again
    assert again["timings"]["prompt_n"] == 1


@pytest.mark.parametrize(("param", "body"), [
    ("mirostat", {"mirostat": 2}),
    ("dry_multiplier", {"dry_multiplier": 0.8}),
    ("typical_p", {"typical_p": 0.5}),
    ("n_cmpl", {"n_cmpl": 2}),
    ("id_slot", {"id_slot": -2}),
    ("cache_prompt", {"cache_prompt": "no"}),
    ("samplers", {"samplers": ["top_k", "adaptive_p"]}),
    ("samplers", {"samplers": "kq"}),
    ("samplers", {"samplers": ["top_k", "penalties"], "repeat_penalty": 1.2}),
    # (presence and frequency are subtracted: after the temperature they weigh otherwise;
    # it was taken, the penalties applied first)
    ("samplers", {"samplers": ["temperature", "penalties"], "presence_penalty": 2.0}),
    ("n_predict", {"n_predict": -2}),
    ("t_max_predict_ms", {"t_max_predict_ms": -2}),
    ("n_probs", {"n_probs": 21}),
    ("json_schema", {"grammar": 'root ::= "a"', "json_schema": {}}),
    ("grammar", {"grammar": "root ::= nowhere"}),
    ("temperature", {"temperature": 1000}),
    ("repeat_last_n", {"repeat_last_n": -2}),
    ("logit_bias", {"logit_bias": [[1, "a"]]}),
    # found by an audit: a negative id key was tokenized as text, an empty text biased nothing
    ("logit_bias", {"logit_bias": {"-5": 1}}),
    ("logit_bias", {"logit_bias": {"": 1}}),
    ("prompt", {"prompt": ["x"] * 300, "n_predict": 0}),  # (a 429 to retry, forever)
    ("stop", {"stop": ["x"] * 17}),
    ("unknown", {"unknown": 1}),
    ("n", {"n": 2}),
    ("adaptive_target", {"adaptive_target": 0.5}),
    ("n_probs", {"logprobs": 99}),
])
def test_what_is_not_offered_is_a_400_naming_it(server, param, body):
    refused(server, param, **body)


def test_a_negative_temperature_is_greedy_and_too_high_a_one_says_so(server):
    """llama.cpp reads a temperature <= 0 as the best token alone; one past 100 said it
    "must be a number in [0, 100]", which the negative ones it takes contradicted."""
    greedy = complete(server, n_predict=6, temperature=0, return_tokens=True)["tokens"]
    assert complete(server, n_predict=6, temperature=-1, return_tokens=True)["tokens"] == greedy
    assert refused(server, "temperature", temperature=1e308) == (
        "temperature must be at most 100 (0 or less: the best token alone, as llama.cpp reads "
        "it)")


@pytest.mark.parametrize("body,first,second", [
    ({"n_predict": 2, "max_tokens": 3}, "n_predict", "max_tokens"),
    ({"n_predict": 2, "max_completion_tokens": 5}, "n_predict", "max_completion_tokens"),
    ({"max_completion_tokens": 2, "max_tokens": 3}, "max_completion_tokens", "max_tokens"),
    ({"n_predict": 2, "max_tokens": 2, "max_completion_tokens": 5}, "n_predict",
     "max_completion_tokens"),
    ({"n_predict": 1, "n_probs": 1, "logprobs": 3}, "n_probs", "logprobs"),
])
def test_two_names_of_one_setting_at_odds_are_a_400_naming_both(server, body, first, second):
    """n_predict won (and n_probs): the other value was ignored."""
    said = refused(server, second, **body)
    assert f"{first} and {second} disagree" in said, said


def test_two_names_of_one_setting_agreeing_are_one(server):
    got = complete(server, n_predict=3, max_tokens=3, max_completion_tokens=3, n_probs=2,
                   logprobs=2, temperature=0)
    assert got["tokens_predicted"] == 3 and got["generation_settings"]["n_predict"] == 3
    assert [len(p["top_logprobs"]) for p in got["completion_probabilities"]] == [2, 2, 2]


def test_errors_are_in_llama_servers_shape_streamed_too(server):
    """{"error": {code: the status, message, type}} as llama-server answers (its
    format_error_response), and param; it was OpenAI's, code null or a string."""
    r = post(server, "/completion", {"prompt": PROMPT, "mirostat": 2})
    assert r.status_code == 400
    assert r.json() == {"error": {"code": 400, "message": "mirostat: mirostat is not offered (0: "
                                  "off)", "type": "invalid_request_error", "param": "mirostat"}}
    # llama.cpp has no token starting with NUL: the grammar ends the request with an error
    dead = {"prompt": PROMPT, "n_predict": 4, "grammar": 'root ::= "a" [\\x00]'}
    r = post(server, "/completion", dead)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert (error["code"], error["type"]) == (400, "invalid_request_error"), error
    with httpx.stream("POST", server.url + "/completion", timeout=60,
                      json={**dead, "stream": True}) as streamed:
        events = [json.loads(line[6:]) for line in streamed.iter_lines()
                  if line.startswith("data: {")]
    assert streamed.status_code == 200 and events[-1] == {"error": error}, events


def test_a_null_field_is_its_default_as_llama_server_reads_it(server):
    """llama-server reads a null as the field's default (json_value); 43 fields were a 400
    for it here, which broke clients that send unset options as null."""
    nulls = {name: None for name in (
        "temperature", "top_k", "top_p", "min_p", "repeat_penalty", "repeat_last_n",
        "presence_penalty", "frequency_penalty", "seed", "stream", "cache_prompt",
        "ignore_eos", "return_tokens", "id_slot", "n", "n_cmpl", "n_indent",
        "t_max_predict_ms", "t_max_prompt_ms", "typical_p", "mirostat", "dry_multiplier")}
    answer = complete(server, n_predict=2, **nulls)
    settings = answer["generation_settings"]
    assert (settings["temperature"], settings["top_k"], settings["top_p"]) == (0.8, 40, 0.95)
    assert answer["tokens_predicted"] == 2


def test_an_answer_its_line_limits_end_counts_its_latency_and_phases(server):
    """It counts as ``length`` (llama-server's ``limit``) and, as every finished request,
    in the latency and phase histograms: those missed it, as the engine never ended it (the
    server aborted it), so e2e's count fell behind request_success's."""
    from tests.server.test_openai_api import metric_in

    names = ["vllm:e2e_request_latency_seconds_count", 'finished_reason="length"'] + [
        f"vllm:request_{p}_time_seconds_count" for p in ("queue", "prefill", "decode",
                                                       "inference")]

    def counts() -> dict[str, float]:
        text = httpx.get(server.url + "/metrics", timeout=60).text
        length = sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                     if line.startswith("vllm:request_success_total{") and names[1] in line)
        return {n: length if n == names[1] else metric_in(text, n) for n in names}

    complete(server, prompt="Hi", n_predict=2)  # (every series on the page)
    before = counts()
    j = complete(server, prompt="1\n2\n3\n4\n", n_predict=40, t_max_predict_ms=1,
                 temperature=0, ignore_eos=True)
    assert j["stop_type"] == "limit" and j["tokens_predicted"] < 40, j
    after = counts()
    assert {n: after[n] - before[n] for n in names} == dict.fromkeys(names, 1.0)
