"""The OpenAI API through the real ``openai`` client and raw httpx, against a real server."""

from __future__ import annotations

import asyncio
import json
import time

import httpx
import numpy as np
import openai
import pytest

from tests.helpers import RESCORE_NATS
from tests.server.conftest import start_server


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0,
                         timeout=120)


@pytest.fixture(scope="module")
def exact_client(model_path):
    """A server without the prefix cache, for exact reproducibility checks: with the cache a
    repeated prompt is computed in another batch shape and a near tie may flip (docs/llama-cpp-facts.md)."""
    s = start_server(model_path, "--no-prefix-cache", "--max-seqs", "4", "--pool-blocks", "128")
    yield openai.OpenAI(base_url=s.url + "/v1", api_key="unused", max_retries=0, timeout=120)
    assert s.stop() == 0


def metric(server, name: str) -> float:
    return metric_in(httpx.get(server.url + "/metrics", timeout=60).text, name)


def metric_in(text: str, name: str) -> float:
    """``name``'s value in one scrape of /metrics (summed over its labels)."""
    total = 0.0
    found = False
    for line in text.splitlines():
        if line.startswith(name + "{") or line.startswith(name + " "):
            total += float(line.rsplit(" ", 1)[1])
            found = True
    assert found, f"{name} not in /metrics"
    return total


def test_models(client, server):
    models = client.models.list()
    assert [m.id for m in models.data] == [server.model] == ["gemma-3-270m-q4_k_m"]


def test_chat_non_streaming(client, server):
    r = client.chat.completions.create(
        model=server.model, messages=[{"role": "user", "content": "Say hello."}],
        max_tokens=8, temperature=0, extra_body={"ignore_eos": True})
    assert r.object == "chat.completion"
    assert r.choices[0].message.role == "assistant" and r.choices[0].message.content
    assert r.choices[0].finish_reason == "length"
    assert r.usage.completion_tokens == 8 and r.usage.prompt_tokens > 3
    assert r.usage.total_tokens == r.usage.prompt_tokens + 8


@pytest.mark.parametrize("path, body", [("/v1/chat/completions", {"messages": [
    {"role": "user", "content": "Hi"}]}), ("/v1/completions", {"prompt": "Hi"})])
def test_with_include_usage_every_chunk_has_usage_null_but_the_last(server, path, body):
    """OpenAI: "All other chunks will also include a usage field, but with a null value"; it
    was left out. Without include_usage no chunk has one."""
    for include in (True, False):
        r = httpx.post(server.url + path, timeout=60, json={
            **body, "max_tokens": 3, "stream": True, "stream_options": {
                "include_usage": include}})
        chunks = [json.loads(line[6:]) for line in r.text.splitlines()
                  if line.startswith("data: {")]
        if include:
            assert all("usage" in c and c["usage"] is None for c in chunks[:-1]), chunks
            assert chunks[-1]["usage"]["completion_tokens"] == 3
        else:
            assert not any("usage" in c for c in chunks), chunks


def test_chat_streaming_with_usage(client, server):
    stream = client.chat.completions.create(
        model=server.model, messages=[{"role": "user", "content": "Count to five."}],
        max_tokens=10, temperature=0, stream=True, stream_options={"include_usage": True},
        logprobs=True, top_logprobs=5, extra_body={"ignore_eos": True})
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    finish = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert text and finish == ["length"]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 10
    streamed = [t for c in chunks if c.choices and c.choices[0].logprobs
                for t in c.choices[0].logprobs.content]
    assert "".join(t.token for t in streamed) == text
    full = client.chat.completions.create(
        model=server.model, messages=[{"role": "user", "content": "Count to five."}],
        max_tokens=10, temperature=0, logprobs=True, top_logprobs=5,
        extra_body={"ignore_eos": True})
    # greedy: streaming == non-streaming, up to a near tie flipped by batch-shape noise (the
    # second request's prompt comes from the prefix cache, computed in another batch shape)
    ref = full.choices[0].logprobs.content
    for a, b in zip(ref, streamed):
        if a.token != b.token:
            top = {t.token: t.logprob for t in a.top_logprobs}
            assert b.token in top and a.logprob - top[b.token] < 1.0, (a, b)
            break
    else:
        assert full.choices[0].message.content == text


def test_chat_n_seed_stop_logprobs(client, exact_client, server):
    msgs = [{"role": "user", "content": "Write a sentence about cats."}]
    r = client.chat.completions.create(model=server.model, messages=msgs, n=3, max_tokens=12,
                                       temperature=1.0, seed=7)
    assert [c.index for c in r.choices] == [0, 1, 2]
    assert len({c.message.content for c in r.choices}) > 1  # each choice its own seed
    # A seed reproduces a request computed the same way: alone, on a server without the prefix
    # cache. (Under concurrency the batch a request lands in varies with timing, and batch
    # shape moves logits slightly - docs/llama-cpp-facts.md - so a sampled token near a boundary can flip.)
    one = [exact_client.chat.completions.create(model=server.model, messages=msgs, max_tokens=12,
                                                temperature=1.0, seed=7).choices[0].message.content
           for _ in range(2)]
    assert one[0] == one[1]
    lp = client.chat.completions.create(model=server.model, messages=msgs, max_tokens=4,
                                        temperature=0, logprobs=True, top_logprobs=3)
    content = lp.choices[0].logprobs.content
    assert len(content) == lp.usage.completion_tokens
    assert all(len(t.top_logprobs) == 3 and t.logprob <= 0 for t in content)
    assert "".join(t.token for t in content) == lp.choices[0].message.content
    base = client.chat.completions.create(model=server.model, messages=msgs, max_tokens=16,
                                          temperature=0, extra_body={"ignore_eos": True})
    words = base.choices[0].message.content.split()
    stop = words[2]
    cut = client.chat.completions.create(model=server.model, messages=msgs, max_tokens=16,
                                         temperature=0, stop=[stop])
    assert cut.choices[0].finish_reason == "stop"
    assert cut.choices[0].message.content == base.choices[0].message.content.split(stop)[0]


def test_echo_with_logprobs_gives_the_prompts_tokens_first(client, server):
    """OpenAI's legacy echo with logprobs, as lm-eval-harness scores a continuation: the
    prompt's tokens (the first with no logprob) then the answer's, one text, offsets into it;
    streamed, the prompt goes out with its logprobs in the first chunk. A token-id prompt is
    scored as given."""
    prompt = "The capital of France is"
    r = client.completions.create(model=server.model, prompt=prompt, max_tokens=2,
                                  temperature=0, echo=True, logprobs=1)
    c = r.choices[0]
    lp = c.logprobs
    n_prompt = r.usage.prompt_tokens
    assert len(lp.tokens) == n_prompt + 2 and r.usage.completion_tokens == 2
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert all(v is not None and v <= 0 for v in lp.token_logprobs[1:])
    assert all(len(top) in (1, 2) and tok in top
               for tok, top in zip(lp.tokens[1:], lp.top_logprobs[1:]))
    assert "".join(lp.tokens) == c.text and c.text.startswith(prompt)
    assert lp.text_offset == [len("".join(lp.tokens[:i])) for i in range(len(lp.tokens))]
    plain = client.completions.create(model=server.model, prompt=prompt, max_tokens=2,
                                      temperature=0, logprobs=1).choices[0]
    assert lp.tokens[n_prompt:] == plain.logprobs.tokens  # the same answer after the prompt
    # streamed: the same tokens and text, the prompt first
    chunks = list(client.completions.create(model=server.model, prompt=prompt, max_tokens=2,
                                            temperature=0, echo=True, logprobs=1, stream=True))
    streamed = [t for ch in chunks for t in (ch.choices[0].logprobs.tokens if ch.choices and
                                             ch.choices[0].logprobs else [])]
    assert streamed == lp.tokens and "".join(ch.choices[0].text for ch in chunks
                                             if ch.choices) == c.text
    # lm-eval-harness's request: token ids, max_tokens 1, the logprobs of what was sent
    ids = httpx.post(server.url + "/tokenize", json={"prompt": prompt}, timeout=60
                     ).json()["tokens"]
    scored = client.completions.create(model=server.model, prompt=ids, max_tokens=1,
                                       temperature=0, echo=True, logprobs=1).choices[0]
    assert scored.logprobs.token_logprobs[:-1] == pytest.approx(lp.token_logprobs[:n_prompt],
                                                                abs=RESCORE_NATS)
    # OpenAI's older idiom, max_tokens 0: the prompt scored, nothing generated (streamed too)
    for stream in (False, True):
        r = httpx.post(server.url + "/v1/completions", timeout=60, json={
            "model": server.model, "prompt": prompt, "max_tokens": 0, "echo": True,
            "logprobs": 1, "stream": stream, "stream_options": {"include_usage": True}
            if stream else None})
        if stream:
            chunks = [json.loads(line[6:]) for line in r.text.splitlines()
                      if line.startswith("data: {")]
            (only,), usage = [c for ch in chunks for c in ch["choices"]], chunks[-1]["usage"]
        else:
            only, usage = r.json()["choices"][0], r.json()["usage"]
        assert only["text"] == prompt and only["finish_reason"] == "length"
        assert only["logprobs"]["token_logprobs"] == pytest.approx(
            lp.token_logprobs[:n_prompt], abs=RESCORE_NATS)
        assert usage["completion_tokens"] == 0 and usage["prompt_tokens"] == n_prompt
    # control tokens in the prompt are written as the prompt has them: the tokens make up the
    # text, offsets included
    turn = "<start_of_turn>user\nHi<end_of_turn>\n"
    c = client.completions.create(model=server.model, prompt=turn, max_tokens=2,
                                  temperature=0, echo=True, logprobs=1).choices[0]
    assert "".join(c.logprobs.tokens) == c.text and c.text.startswith(turn)
    assert "<start_of_turn>" in c.logprobs.tokens
    assert c.logprobs.text_offset == [len("".join(c.logprobs.tokens[:i]))
                                      for i in range(len(c.logprobs.tokens))]


def test_vllms_prompt_logprobs(server):
    """vLLM's prompt_logprobs: per prompt token (None for the first) the token itself, with
    its rank, and the most likely ones, by id; streamed, in the choice's first chunk."""
    body = {"model": server.model, "prompt": "One, two, three", "max_tokens": 2,
            "temperature": 0, "prompt_logprobs": 2}
    c = httpx.post(server.url + "/v1/completions", json=body, timeout=60).json()["choices"][0]
    ids = httpx.post(server.url + "/tokenize", json={"prompt": "One, two, three"}, timeout=60
                     ).json()["tokens"]
    plp = c["prompt_logprobs"]
    assert len(plp) == len(ids) and plp[0] is None and c["logprobs"] is None
    for token, entry in zip(ids[1:], plp[1:]):
        own = entry[str(token)]
        assert own["logprob"] <= 0 and own["rank"] >= 1 and isinstance(own["decoded_token"], str)
        ranks = sorted(v["rank"] for k, v in entry.items() if k != str(token) or own["rank"] <= 2)
        assert ranks[:2] == [1, 2] and len(entry) in (2, 3)
    stream = httpx.post(server.url + "/v1/completions", json={**body, "stream": True,
                                                              "echo": True}, timeout=60).text
    chunks = [json.loads(line[6:]) for line in stream.splitlines()
              if line.startswith("data: {")]
    first = chunks[0]["choices"][0]  # the echo with the prompt's logprobs, then the answer
    assert first["prompt_logprobs"] == plp and first["text"].startswith("One, two, three")
    assert all("prompt_logprobs" not in ch["choices"][0] for ch in chunks[1:])
    assert "".join(ch["choices"][0]["text"] for ch in chunks) == "One, two, three" + c["text"]
    # echo's logprobs ask for more alternatives: prompt_logprobs still lists its own number
    both = httpx.post(server.url + "/v1/completions", json={
        **body, "prompt_logprobs": 1, "echo": True, "logprobs": 4}, timeout=60).json()
    choice = both["choices"][0]
    assert all(len(entry) <= 2 for entry in choice["prompt_logprobs"][1:])
    assert max(len(top) for top in choice["logprobs"]["top_logprobs"][1:]) >= 4


def test_vllms_prompt_logprobs_of_a_chat(server):
    """The rendered prompt's tokens, as /v1/completions scores them, in the response's own
    prompt_logprobs (vLLM's chat field)."""
    messages = [{"role": "user", "content": "Count: one, two"}]
    r = httpx.post(server.url + "/v1/chat/completions", timeout=60, json={
        "model": server.model, "messages": messages, "max_tokens": 2, "temperature": 0,
        "prompt_logprobs": 1})
    assert r.status_code == 200, r.text
    got = r.json()
    ids = httpx.post(server.url + "/tokenize", json={"messages": messages}, timeout=60
                     ).json()["tokens"]
    plp = got["prompt_logprobs"]
    assert len(plp) == len(ids) == got["usage"]["prompt_tokens"] and plp[0] is None
    assert all(str(t) in entry and len(entry) <= 2 for t, entry in zip(ids[1:], plp[1:]))
    scored = httpx.post(server.url + "/v1/completions", timeout=60, json={
        "model": server.model, "prompt": ids, "max_tokens": 1, "prompt_logprobs": 1}).json()
    for t, mine, theirs in zip(ids[1:], plp[1:], scored["choices"][0]["prompt_logprobs"][1:]):
        assert abs(mine[str(t)]["logprob"] - theirs[str(t)]["logprob"]) < 0.35  # (batch noise)
        assert mine[str(t)]["rank"] >= 1
    plain = httpx.post(server.url + "/v1/chat/completions", timeout=60, json={
        "model": server.model, "messages": messages, "max_tokens": 1}).json()
    assert plain["prompt_logprobs"] is None


def test_completions(client, server):
    # Both computed whole: a prefix-cache hit (this session's server served other files'
    # prompts first) moves the logits slightly, and a near tie then picked another word.
    whole = {"cache_prompt": False}
    r = client.completions.create(model=server.model, prompt="The capital of France is",
                                  max_tokens=5, temperature=0, echo=True, extra_body=whole)
    c = r.choices[0]
    assert c.text.startswith("The capital of France is") and len(c.text) > 24
    assert r.usage.completion_tokens == 5
    lp = client.completions.create(model=server.model, prompt="The capital of France is",
                                   max_tokens=5, temperature=0, logprobs=2,
                                   extra_body=whole).choices[0]
    assert len(lp.logprobs.tokens) == 5 and len(lp.logprobs.top_logprobs[0]) == 2
    assert "".join(lp.logprobs.tokens) == lp.text == c.text[len("The capital of France is"):]
    # The sampled token is always among top_logprobs, as OpenAI gives it (it was left out
    # when it was not among the most likely): logprobs 0 is the sampled token alone.
    for n_top in (0, 1):
        drawn = client.completions.create(model=server.model, prompt="Once", max_tokens=8,
                                          temperature=1.5, seed=5, logprobs=n_top).choices[0]
        for token, value, top in zip(drawn.logprobs.tokens, drawn.logprobs.token_logprobs,
                                     drawn.logprobs.top_logprobs):
            assert top[token] == value and len(top) <= n_top + 1
        if n_top == 0:
            assert all(len(top) == 1 for top in drawn.logprobs.top_logprobs)
    multi = client.completions.create(model=server.model, prompt=["One,", "Two,"], n=2,
                                      max_tokens=3, temperature=0, extra_body={"ignore_eos": True})
    assert [c.index for c in multi.choices] == [0, 1, 2, 3]
    assert multi.usage.completion_tokens == 12
    assert multi.usage.prompt_tokens == 2 * 3  # BOS + 2 tokens, counted once per prompt
    assert all(c.text and c.finish_reason == "length" for c in multi.choices)
    tokens = client.completions.create(model=server.model, prompt=[2, 818, 5279, 563],
                                       max_tokens=3, temperature=0)
    assert tokens.usage.prompt_tokens == 4
    stream = client.completions.create(model=server.model, prompt="The capital of France is",
                                       max_tokens=5, temperature=0, stream=True,
                                       extra_body=whole)
    assert "".join(ch.choices[0].text for ch in stream) == c.text[len("The capital of France is"):]
    # Text held back while it may begin a stop string: no chunks of "" before the end (there
    # were two here, for " the" and " country"), but each held token's logprobs still go out.
    for logprobs in (None, 1):
        chunks = [ch.choices[0] for ch in client.completions.create(
            model=server.model, prompt="The capital of France is", max_tokens=20,
            temperature=0, stream=True, stop=["of the coun"], logprobs=logprobs,
            extra_body=whole)]
        assert "".join(ch.text for ch in chunks) == " the capital "
        assert chunks[-1].finish_reason == "stop"
        if logprobs is None:
            assert [ch.text for ch in chunks] == [" the", " capital", " ", ""]
        else:
            assert [ch.text for ch in chunks] == [" the", " capital", " ", "", ""]
            assert [len(ch.logprobs.tokens) for ch in chunks] == [1] * 5


def test_embeddings(client, server):
    texts = ["The cat sits on the mat.", "A cat is sitting on a mat.",
             "Quarterly revenue rose by eight percent."]
    prompt0 = metric(server, "vllm:prompt_tokens_total")
    # (no series before the server's first finished request: this test may be its first)
    before = httpx.get(server.url + "/metrics", timeout=60).text
    e2e = "vllm:e2e_request_latency_seconds_count"
    e2e0 = metric_in(before, e2e) if e2e + "{" in before else 0.0
    r = client.embeddings.create(model=server.model, input=texts)
    # counted as vLLM counts a pooling request (it was not counted at all)
    assert metric(server, "vllm:prompt_tokens_total") == prompt0 + r.usage.prompt_tokens
    assert metric(server, e2e) == e2e0 + 1
    vecs = np.array([d.embedding for d in r.data])
    assert vecs.shape == (3, 640)
    assert np.allclose(np.linalg.norm(vecs, axis=1), 1.0, atol=1e-4)
    paraphrase, unrelated = vecs[0] @ vecs[1], vecs[0] @ vecs[2]
    assert paraphrase > unrelated + 0.1
    assert r.usage.prompt_tokens > 10
    one = client.embeddings.create(model=server.model, input="hello")
    assert len(one.data) == 1 and len(one.data[0].embedding) == 640


def test_metrics_move_as_requests_run(client, server):
    # (a labelled series is on the page from its first observation)
    client.completions.create(model=server.model, prompt="Hi", max_tokens=1)
    gen0 = metric(server, "vllm:generation_tokens_total")
    prompt0 = metric(server, "vllm:prompt_tokens_total")
    ttft0 = metric(server, "vllm:time_to_first_token_seconds_count")
    phases = ("queue", "prefill", "decode", "inference")
    page = httpx.get(server.url + "/metrics", timeout=60)
    # Prometheus' text format, its charset said once (it was said twice)
    assert page.headers["content-type"] == "text/plain; version=0.0.4; charset=utf-8"
    text = page.text
    before = {p: metric_in(text, f"vllm:request_{p}_time_seconds_count") for p in phases}
    sizes = {n: (metric_in(text, f"vllm:request_{n}_tokens_count"),
                 metric_in(text, f"vllm:request_{n}_tokens_sum")) for n in ("prompt", "generation")}
    client.completions.create(model=server.model, prompt="Hello", max_tokens=6, temperature=0,
                              extra_body={"ignore_eos": True})
    assert metric(server, "vllm:generation_tokens_total") == gen0 + 6
    assert metric(server, "vllm:prompt_tokens_total") == prompt0 + 2
    assert metric(server, "vllm:time_to_first_token_seconds_count") == ttft0 + 1
    # vLLM's per-request phases and sizes (its Grafana dashboard's panels)
    text = httpx.get(server.url + "/metrics", timeout=60).text
    for p in phases:
        assert metric_in(text, f"vllm:request_{p}_time_seconds_count") == before[p] + 1, p
    for n, tokens in (("prompt", 2), ("generation", 6)):
        count, total = sizes[n]
        assert metric_in(text, f"vllm:request_{n}_tokens_count") == count + 1
        assert metric_in(text, f"vllm:request_{n}_tokens_sum") == total + tokens
    assert 'vllm:request_generation_tokens_bucket{le="5.0"' in text
    for name in ("vllm:num_requests_running", "vllm:num_requests_waiting",
                 "vllm:kv_cache_usage_perc", "vllm:inter_token_latency_seconds_count",
                 "vllm:e2e_request_latency_seconds_count", "vllm:prefix_cache_queries_total",
                 "vllm:prefix_cache_hits_total", "justllm_prefix_cache_hits_total",
                 "justllm_prefix_cache_misses_total", "justllm_prefix_cache_hit_ratio",
                 "justllm_prefix_cache_blocks", "justllm_kv_blocks_used",
                 "justllm_kv_blocks_free", "justllm_kv_blocks_total"):
        metric(server, name)
    assert metric(server, "justllm_kv_blocks_total") == 512


def test_16_concurrent_streams_complete(server):
    async def main():
        aclient = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0,
                                     timeout=120)

        async def one(i):
            stream = await aclient.chat.completions.create(
                model=server.model, messages=[{"role": "user", "content": f"Tell me fact {i}."}],
                max_tokens=12, stream=True, extra_body={"ignore_eos": True})
            n, reason = 0, None
            async for c in stream:
                if c.choices and c.choices[0].delta.content:
                    n += 1
                if c.choices and c.choices[0].finish_reason:
                    reason = c.choices[0].finish_reason
            return n, reason

        try:
            return await asyncio.gather(*[one(i) for i in range(16)])
        finally:
            await aclient.close()

    results = asyncio.run(main())
    assert all(reason == "length" and n >= 6 for n, reason in results), results
    assert metric(server, "vllm:num_requests_running") == 0
    assert request_blocks(server) == 0


def aborted_requests(server) -> float:
    text = httpx.get(server.url + "/metrics", timeout=60).text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith("vllm:request_success_total{")
               and 'finished_reason="abort"' in line)


def request_blocks(server) -> float:
    """KV blocks held by requests (the rest belong to the prefix cache), from one scrape: an
    aborted request's blocks go to the prefix cache, and the next step moves the cache's
    share past --prefix-cache-blocks out to host memory, so two scrapes ~60 ms apart could
    read the pool before that step and the cache after it (CI did: 9 - 8 = 1)."""
    text = httpx.get(server.url + "/metrics", timeout=60).text
    return (metric_in(text, "justllm_kv_blocks_used")
            - metric_in(text, "justllm_prefix_cache_blocks"))


TTFT_COUNT = "vllm:time_to_first_token_seconds_count"


def test_disconnect_mid_stream_frees_kv(server):
    body = {"model": server.model, "messages": [{"role": "user", "content": "Write a long essay."}],
            "max_tokens": 2000, "stream": True, "ignore_eos": True}
    aborted = aborted_requests(server)
    text = httpx.get(server.url + "/metrics", timeout=60).text
    first_tokens = metric_in(text, TTFT_COUNT) if TTFT_COUNT in text else 0
    with httpx.Client(timeout=30) as h:
        with h.stream("POST", server.url + "/v1/chat/completions", json=body) as r:
            assert r.status_code == 200
            lines = r.iter_lines()  # held, not broken out of: that would close the response
            data = 0
            while data < 4:
                data += next(lines).startswith("data:")
            assert metric(server, "vllm:num_requests_running") == 1
            assert request_blocks(server) > 0
            # counted at the first token, as vLLM does (it was at the end: a long answer's
            # slow start stayed out of a gateway's recent TTFT until then)
            assert metric(server, TTFT_COUNT) == first_tokens + 1
    for _ in range(600):  # the engine frees the blocks at its next step
        if metric(server, "vllm:num_requests_running") == 0 and request_blocks(server) == 0:
            break
        time.sleep(0.05)
    assert metric(server, "vllm:num_requests_running") == 0
    assert request_blocks(server) == 0
    # counted as vLLM counts a request its client left (it was not counted at all)
    assert aborted_requests(server) == aborted + 1


def test_openapi_schema_lists_the_routes(server):
    schema = httpx.get(server.url + "/docs/openapi.json", timeout=60).json()
    paths = schema["paths"]
    for p in ("/v1/chat/completions", "/v1/completions", "/v1/embeddings", "/v1/models",
              "/health", "/metrics"):
        assert p in paths, p
    body = paths["/v1/chat/completions"]["post"]["requestBody"]["content"]["application/json"]
    assert body["schema"]


def test_response_format_json_object_and_schema(client, exact_client, server):
    import json

    # alone and uncached, this prompt's greedy JSON closes after a few tokens
    r = exact_client.chat.completions.create(
        model=server.model, messages=[{"role": "user", "content": "{}"}],
        max_tokens=200, temperature=0, response_format={"type": "json_object"})
    assert r.choices[0].finish_reason == "stop"  # the grammar let EOS through once complete
    assert isinstance(json.loads(r.choices[0].message.content), dict)
    # it ends at the closing brace, as OpenAI's does (the grammar let a space or a newline
    # and up to 20 blanks follow, and the demo model took them)
    assert r.choices[0].message.content.endswith("}")
    schema = {"type": "object", "properties": {"name": {"type": "string"},
                                               "age": {"type": "integer"}},
              "required": ["name", "age"], "additionalProperties": False}
    r = client.chat.completions.create(
        model=server.model, messages=[{"role": "user", "content": "A person, as JSON."}],
        max_tokens=60, temperature=0.7, seed=3,
        response_format={"type": "json_schema", "json_schema": {"name": "person", "schema": schema}})
    doc = json.loads(r.choices[0].message.content)
    assert r.choices[0].message.content.endswith("}")
    assert set(doc) == {"name", "age"}
    assert isinstance(doc["name"], str) and isinstance(doc["age"], int)
    # ignore_eos does not run on past a complete answer: the grammar then offers only the
    # end, and took every later step as another empty token until max_tokens
    r = client.chat.completions.create(
        model=server.model, messages=[{"role": "user", "content": "A person, as JSON."}],
        max_tokens=60, temperature=0, extra_body={"ignore_eos": True},
        response_format={"type": "json_schema", "json_schema": {"name": "person", "schema": schema}})
    assert r.choices[0].finish_reason == "stop", r
    assert set(json.loads(r.choices[0].message.content)) == {"name", "age"}
    assert r.usage.completion_tokens < 60
    bad = httpx.post(server.url + "/v1/chat/completions", timeout=60, json={
        "model": server.model, "messages": [{"role": "user", "content": "x"}],
        "response_format": {"type": "json_schema", "json_schema": {"name": "x"}}})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "response_format"


def test_an_integers_bounds_are_enforced_strict_or_not(client, server):
    """llama-cpp-python's converter passed over minimum/maximum: the demo model answered
    1000000000000000 to an integer in [5, 7]. They are grammar rules now (engine/int_range.py),
    so sampled answers stay in range, and strict: true accepts them."""
    import json

    schema = {"type": "object", "properties": {
        "n": {"type": "integer", "minimum": 5, "maximum": 7},
        "m": {"type": "integer", "exclusiveMinimum": -120, "exclusiveMaximum": -99}},
        "required": ["n", "m"], "additionalProperties": False}
    seen = set()
    for strict in (True, False):
        r = client.chat.completions.create(
            model=server.model, messages=[{"role": "user", "content": "Two numbers:"}],
            max_tokens=40, temperature=1.5, n=4, seed=11,
            response_format={"type": "json_schema", "json_schema": {
                "name": "nums", "schema": schema, "strict": strict}})
        for choice in r.choices:
            assert choice.finish_reason == "stop", choice
            doc = json.loads(choice.message.content)
            assert 5 <= doc["n"] <= 7 and -120 < doc["m"] < -99, doc
            seen.add(doc["m"])
    assert len(seen) > 1  # sampled: the range, not one spelling, is what holds
    bad = httpx.post(server.url + "/v1/chat/completions", timeout=60, json={
        "model": server.model, "messages": [{"role": "user", "content": "x"}],
        "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {
            "type": "integer", "minimum": 3, "maximum": 2}}}})
    assert bad.status_code == 400, bad.text
    assert "no integer satisfies the schema's bounds (minimum 3, maximum 2)" in \
        bad.json()["error"]["message"]


def test_continue_final_message_as_vllm(client, server):
    history = [{"role": "user", "content": "What is the capital of France?"},
               {"role": "assistant", "content": "The capital of France is"}]
    r = client.chat.completions.create(
        model=server.model, messages=history, max_tokens=6, temperature=0,
        extra_body={"continue_final_message": True, "add_generation_prompt": False})
    said = r.choices[0].message.content
    assert "Paris" in said and not said.lstrip().startswith("The capital"), said
    anew = client.chat.completions.create(model=server.model, messages=history, max_tokens=6,
                                          temperature=0)  # a closed turn, answered anew
    assert anew.choices[0].message.content != said
    for extra, param, says in [
        ({"continue_final_message": True, "add_generation_prompt": True},
         "add_generation_prompt", "cannot both be true"),
        ({"continue_final_message": True, "messages": history[:1]},
         "continue_final_message", "needs an assistant message last"),
        ({"add_generation_prompt": False}, "add_generation_prompt",
         "only supported with continue_final_message"),
        ({"continue_final_message": True, "tools": [{"type": "function", "function": {
            "name": "f", "parameters": {"type": "object"}}}]}, "continue_final_message",
         "cannot be combined with tools")]:
        bad = httpx.post(server.url + "/v1/chat/completions", timeout=60, json={
            "model": server.model, "messages": history, "max_tokens": 2, **extra})
        assert bad.status_code == 400 and bad.json()["error"]["param"] == param, bad.text
        assert says in bad.json()["error"]["message"]


def test_prefix_cache_hits_show_in_metrics(client, server):
    system = " ".join(f"Guideline {i}: be concise." for i in range(60))
    hits0 = metric(server, "justllm_prefix_cache_hits_total")
    tokens0 = metric(server, "vllm:prefix_cache_hits_total")
    for q in ("What is 2+2?", "Name a color."):
        client.chat.completions.create(
            model=server.model, max_tokens=2, temperature=0,
            messages=[{"role": "system", "content": system}, {"role": "user", "content": q}])
    assert metric(server, "justllm_prefix_cache_hits_total") >= hits0 + 1
    assert metric(server, "vllm:prefix_cache_hits_total") >= tokens0 + 300  # the system prompt
    assert 0 < metric(server, "justllm_prefix_cache_hit_ratio") <= 1
    assert metric(server, "justllm_prefix_cache_blocks") > 0
    # Idle, the cache's blocks are all idle and KV usage is 0, as vLLM reports it (it read
    # the cache's share, so an idle server drifted to 100%). One scrape: the step after the
    # answer may still move cached blocks out to host memory (request_blocks says more).
    text = httpx.get(server.url + "/metrics", timeout=60).text
    assert metric_in(text, "justllm_prefix_cache_idle_blocks") == metric_in(
        text, "justllm_prefix_cache_blocks")
    assert metric(server, "vllm:kv_cache_usage_perc") == 0


def test_an_sdk_history_and_model_retrieval_and_cached_tokens(client, server):
    """A history built the usual SDK way (``message.model_dump()`` carries refusal, audio,
    function_call and annotations as null) was a 400; ``models.retrieve`` was a 404; usage
    named no cached tokens."""
    assert client.models.retrieve(server.model).id == server.model
    msgs = [{"role": "user", "content": "Name three colours, one two three four five six "
                                        "seven eight nine ten eleven twelve thirteen."}]
    first = client.chat.completions.create(model=server.model, messages=msgs, max_tokens=4,
                                           temperature=0)
    again = client.chat.completions.create(model=server.model, messages=msgs, max_tokens=4,
                                           temperature=0)
    assert again.usage.prompt_tokens_details.cached_tokens >= 16  # at least a block
    assert again.usage.prompt_tokens_details.cached_tokens < again.usage.prompt_tokens
    msgs += [first.choices[0].message.model_dump(), {"role": "user", "content": "More."}]
    assert msgs[1]["refusal"] is None and "annotations" in msgs[1]
    r = client.chat.completions.create(model=server.model, messages=msgs, max_tokens=4)
    assert r.usage.prompt_tokens > first.usage.prompt_tokens


def test_a_base_model_does_not_answer_for_the_tool(exact_client):
    """On the transcript template the demo model wrote a call, then an invented "Tool: sunny"
    line and an "Assistant:" answer of its own, which came back as content beside the call."""
    weather = [{"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]
    history = []
    for city in ("Paris", "Rome", "Berlin"):
        call = {"id": f"call_{city}", "type": "function",
                "function": {"name": "get_weather", "arguments": json.dumps({"city": city})}}
        history += [{"role": "user", "content": f"weather in {city}?"},
                    {"role": "assistant", "content": None, "tool_calls": [call]},
                    {"role": "tool", "tool_call_id": f"call_{city}", "content": "sunny"},
                    {"role": "assistant", "content": "It is sunny."}]
    history.append({"role": "user", "content": "weather in Madrid?"})
    client = exact_client  # the transcript template, as a base model gets by default
    kw = dict(model=client.models.list().data[0].id, messages=history, tools=weather,
              max_tokens=60, temperature=0)
    message = client.chat.completions.create(**kw).choices[0].message
    assert message.tool_calls and json.loads(message.tool_calls[0].function.arguments) == {
        "city": "Madrid"}
    assert not message.content or "Tool:" not in message.content, message.content
    raw = client.chat.completions.create(**{**kw, "tool_choice": "none"}).choices[0]
    assert "\nTool:" not in raw.message.content and raw.finish_reason == "stop"


def test_what_no_retry_or_no_value_can_satisfy_is_a_400(server):
    """Each of these was a 429 to retry forever, a field silently losing to its other name, a
    free-form value passed on, or a schema whose grammar llama.cpp could not parse (blamed on
    ``response_format`` whatever the field)."""
    m, hi = server.model, [{"role": "user", "content": "hi"}]
    chat, comp = server.url + "/v1/chat/completions", server.url + "/v1/completions"

    def refused(url: str, body: dict, param: str, says: str) -> None:
        r = httpx.post(url, json={"model": m, **body}, timeout=60)
        assert r.status_code == 400, r.text
        err = r.json()["error"]
        assert err["param"] == param and says in err["message"], err

    refused(comp, {"prompt": ["Hi"] * 257, "max_tokens": 1}, "n",
            "asks for 257 choices (its prompts times n); the server queues at most 256")
    refused(comp, {"prompt": ["Hi"] * 100, "n": 3, "max_tokens": 1}, "n", "300 choices")
    refused(chat, {"messages": hi, "max_tokens": 3, "max_completion_tokens": 4},
            "max_tokens", "max_completion_tokens and max_tokens disagree")
    refused(chat, {"messages": hi, "thinking_budget_tokens": 3, "reasoning_budget_tokens": 4},
            "thinking_budget_tokens", "reasoning_budget_tokens and thinking_budget_tokens "
                                      "disagree")
    refused(chat, {"messages": hi, "reasoning_effort": "banana"}, "reasoning_effort", "")
    for url, body in ((chat, {"messages": hi}), (comp, {"prompt": "hi"})):
        refused(url, {**body, "prompt_cache_retention": "forever"}, "prompt_cache_retention", "")
        for ok in ("in-memory", "in_memory", "24h"):
            r = httpx.post(url, json={"model": m, **body, "max_tokens": 1,
                                      "prompt_cache_retention": ok}, timeout=60)
            assert r.status_code == 200, r.text
    r = httpx.post(chat, json={"model": m, "messages": hi, "max_tokens": 2,
                               "max_completion_tokens": 2}, timeout=60)
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] <= 2, r.text
    for schema, says in (({"enum": []}, "schema.enum is empty, so no value matches"),
                         ({"anyOf": []}, "not a valid JSON schema: at #/anyOf: [] should be "
                                         "non-empty"),
                         ({"type": "array", "minItems": 5, "maxItems": 2},
                          "minItems 5 is more than maxItems 2, so no value matches"),
                         ({"type": "object", "properties": {"a": {
                             "type": "string", "minLength": 3, "maxLength": 1}}},
                          "schema.properties.a: minLength 3 is more than maxLength 1")):
        refused(chat, {"messages": hi, "response_format": {"type": "json_schema", "json_schema": {
            "name": "x", "schema": schema}}}, "response_format.json_schema.schema", says)
        refused(comp, {"prompt": "hi", "guided_json": schema}, "guided_json", says)


def test_a_continued_answer_keeps_the_space_the_model_writes_first(exact_client):
    """On the transcript template the model writes the space after "Assistant:" itself, which
    the answer drops; in a continued (prefilled) message that space is the answer's own, and
    it was dropped too: "Hello," + "I am..." on every API's prefill."""
    from justllm.engine.chat_template import ChatTemplate

    url = str(exact_client.base_url).rstrip("/").removesuffix("/v1")
    model = exact_client.models.list().data[0].id
    history = [{"role": "user", "content": "What is the capital of France?"},
               {"role": "assistant", "content": "The capital of France is"}]
    transcript = ChatTemplate.named("transcript")
    prompt = transcript.render(history, continue_final=True)
    assert prompt.endswith("Assistant: The capital of France is")
    raw = httpx.post(url + "/v1/completions", timeout=60, json={
        "prompt": prompt, "max_tokens": 6, "temperature": 0, "stop": list(transcript.stop)}
    ).json()["choices"][0]["text"]
    assert raw.startswith(" "), raw
    chat = httpx.post(url + "/v1/chat/completions", timeout=60, json={
        "messages": history, "max_tokens": 6, "temperature": 0,
        "continue_final_message": True, "add_generation_prompt": False}).json()
    assert chat["choices"][0]["message"]["content"] == raw, chat
    ollama = httpx.post(url + "/api/chat", timeout=60, json={
        "model": model, "messages": history, "stream": False,
        "options": {"num_predict": 6, "temperature": 0, "repeat_penalty": 1.0}}).json()
    assert ollama["message"]["content"] == raw, ollama
    anthropic = httpx.post(url + "/v1/messages", timeout=60, json={
        "model": model, "messages": history, "max_tokens": 6, "temperature": 0}).json()
    assert anthropic["content"][0]["text"] == raw, anthropic
    # a turn of its own still starts without the space
    anew = httpx.post(url + "/v1/chat/completions", timeout=60, json={
        "messages": history[:1], "max_tokens": 6, "temperature": 0}).json()
    assert not anew["choices"][0]["message"]["content"].startswith(" "), anew


def test_an_sdk_given_the_bare_host_lists_the_models(server):
    """llama-server serves /models beside /v1/models, as its other OpenAI routes, for an SDK
    given http://host:port as its base URL (it was a 404 here)."""
    bare = openai.OpenAI(base_url=server.url, api_key="unused", max_retries=0)
    assert [m.id for m in bare.models.list().data] == [server.model]
    assert bare.models.retrieve(server.model).id == server.model


def test_a_request_the_engine_ends_with_an_error_counts_as_error(client, server):
    """finished_reason "error", as the README and vLLM have it, with its latency: a grammar
    with no way forward (a 400 once it ran) was counted as an "abort", and its latency not at
    all (the engine sets no finish time on a failed request)."""
    def counts() -> dict[str, float]:
        text = httpx.get(server.url + "/metrics", timeout=60).text
        by = {r: sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                     if line.startswith("vllm:request_success_total{")
                     and f'finished_reason="{r}"' in line) for r in ("error", "abort")}
        return by | {"e2e": metric_in(text, "vllm:e2e_request_latency_seconds_count")}

    client.completions.create(model=server.model, prompt="Hi", max_tokens=1)  # (the series)
    before = counts()
    r = httpx.post(server.url + "/v1/completions", timeout=120, json={
        "model": server.model, "prompt": "Hello", "max_tokens": 4, "grammar": 'root ::= "\\x00"'})
    assert r.status_code == 400 and r.json()["error"]["code"] == "grammar_dead_end", r.text
    after = counts()
    assert {k: after[k] - before[k] for k in after} == {"error": 1, "abort": 0, "e2e": 1}
