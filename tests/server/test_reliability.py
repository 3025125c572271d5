"""Careless and hostile clients (issue #11): bad input per route, fields that must be honoured
or refused, clients that leave, more requests than the queue holds, SIGTERM under load.

After every group the server must be back to its idle baseline: nothing running or waiting,
and no KV block held beyond what the prefix cache keeps.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import random
import re
import subprocess
import time

import httpx
import pytest

from justllm.bench.soak import metric
from tests.helpers import children
from tests.server.conftest import start_server

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
EMBEDDINGS = "/v1/embeddings"
CTX = 1024


@pytest.fixture(scope="module")
def srv(model_path):
    s = start_server(model_path, "--max-seqs", "8", "--pool-blocks", "160", "--ctx", str(CTX),
                     "--max-queue", "8")
    yield s
    assert s.stop() == 0


def post(server, path, body, timeout=60, **kw):
    content = body if isinstance(body, (bytes, str)) else json.dumps(body)
    return httpx.post(server.url + path, content=content, timeout=timeout,
                      headers={"content-type": "application/json", **kw.pop("headers", {})},
                      **kw)


def metrics(server) -> str:
    return httpx.get(server.url + "/metrics", timeout=30).text


def assert_idle(server) -> None:
    """Back to baseline: nothing running or waiting, KV held only by the prefix cache."""
    deadline = time.monotonic() + 30
    while True:
        text = metrics(server)
        busy = metric(text, "vllm:num_requests_running") + metric(text, "vllm:num_requests_waiting")
        if busy == 0:
            time.sleep(0.3)  # one more step applies the last releases
            text = metrics(server)
            used, cached = (metric(text, "justllm_kv_blocks_used"),
                            metric(text, "justllm_prefix_cache_blocks"))
            if used == cached:
                return
        assert time.monotonic() < deadline, f"not idle: {busy} requests, KV {text[:0]}" + \
            f"{metric(text, 'justllm_kv_blocks_used')} used vs " + \
            f"{metric(text, 'justllm_prefix_cache_blocks')} cached"
        time.sleep(0.2)


def assert_error(r, status: int, param: str | None = None, says: str | None = None) -> None:
    assert r.status_code == status, (r.status_code, r.text)
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"], err
    if param is not None:
        assert err["param"] == param, err
    if says is not None:
        assert says in err["message"], err


MSGS = [{"role": "user", "content": "hi"}]
# (route, body, param the 400 must name) for each group of bad input.
BAD = {
    "wrong types": [
        (CHAT, {"messages": MSGS, "max_tokens": "5"}, "max_tokens"),
        (CHAT, {"messages": MSGS, "max_tokens": 1e10}, "max_tokens"),
        (CHAT, {"messages": MSGS, "max_tokens": 3.0}, "max_tokens"),
        (CHAT, {"messages": MSGS, "temperature": "hot"}, "temperature"),
        (CHAT, {"messages": MSGS, "stream": "yes"}, "stream"),
        (CHAT, {"messages": [{"role": "user", "content": 5}]}, None),
        (CHAT, {"messages": {"role": "user"}}, "messages"),
        (COMPLETIONS, {"prompt": 5}, "prompt"),
        (COMPLETIONS, {"prompt": "hi", "n": 1.5}, "n"),
        (COMPLETIONS, {"prompt": "hi", "logit_bias": [1, 2]}, "logit_bias"),
        (EMBEDDINGS, {"input": {"a": 1}}, "input"),
        (EMBEDDINGS, {"input": "hi", "dimensions": "4"}, "dimensions"),
    ],
    "out of range": [
        (CHAT, {"messages": MSGS, "max_tokens": 10**12}, "max_tokens"),
        (CHAT, {"messages": MSGS, "max_completion_tokens": CTX}, "max_tokens"),
        (COMPLETIONS, {"prompt": "hi", "max_tokens": 0}, "max_tokens"),
        (COMPLETIONS, {"prompt": "hi", "max_tokens": 10**30}, "max_tokens"),
        (COMPLETIONS, {"prompt": "hi", "top_p": 1.5}, "top_p"),
        (COMPLETIONS, {"prompt": "hi", "top_k": -1}, "top_k"),
        (COMPLETIONS, {"prompt": "hi", "logprobs": 9}, "logprobs"),
        (CHAT, {"messages": MSGS, "logprobs": True, "top_logprobs": 99}, "top_logprobs"),
        (COMPLETIONS, {"prompt": "hi", "n": 0}, "n"),
        (COMPLETIONS, {"prompt": "hi", "stop": ["x"] * 17}, "stop"),
        (COMPLETIONS, {"prompt": "hi", "logit_bias": {"5": 100.5}}, "logit_bias"),
        (COMPLETIONS, {"prompt": "hi", "logit_bias": {"5": -101}}, "logit_bias"),
        (EMBEDDINGS, {"input": "hi", "dimensions": 0}, "dimensions"),
    ],
    "token ids outside the vocabulary": [
        (COMPLETIONS, {"prompt": [262144]}, "prompt"),
        (COMPLETIONS, {"prompt": [[1, 2], [-1]]}, "prompt"),
        (COMPLETIONS, {"prompt": "hi", "logit_bias": {"262144": 1}}, "logit_bias"),
        (COMPLETIONS, {"prompt": "hi", "logit_bias": {"abc": 1}}, "logit_bias"),
        (COMPLETIONS, {"prompt": "hi", "logit_bias": {"-3": 1}}, "logit_bias"),
        # (int() refuses 4,301 digits; a float() of 10**400 overflows: each was a 500)
        (COMPLETIONS, {"prompt": "hi", "logit_bias": {"9" * 5000: 1}}, "logit_bias"),
        ("/completion", {"prompt": "hi", "logit_bias": {"9" * 5000: 1}}, "logit_bias"),
        ("/completion", {"prompt": "hi", "logit_bias": {"5": 10**400}}, "logit_bias"),
        (EMBEDDINGS, {"input": [[262144]]}, "input"),
    ],
    "unknown and unsupported fields": [
        (CHAT, {"messages": MSGS, "frobnicate": 1}, "frobnicate"),
        (CHAT, {"messages": [{"role": "user", "content": "hi", "colour": "red"}]},
         "messages[0].colour"),
        (CHAT, {"messages": MSGS, "stream_options": {"include_usage": True, "x": 1}},
         "stream_options.x"),
        (CHAT, {"messages": MSGS, "tools": [{"type": "custom", "custom": {"name": "f"}}]},
         "tools[0].type"),
        (CHAT, {"messages": MSGS, "tool_choice": "auto"}, "tool_choice"),
        (CHAT, {"messages": MSGS, "modalities": ["text", "audio"]}, "modalities"),
        (CHAT, {"messages": MSGS, "store": True}, "store"),
        (CHAT, {"messages": MSGS, "reasoning_effort": "high"}, "reasoning_effort"),
        (CHAT, {"messages": MSGS, "verbosity": "low"}, "verbosity"),
        (CHAT, {"messages": MSGS, "stream": True, "stream_options": {"include_obfuscation": True}},
         "stream_options.include_obfuscation"),
        (COMPLETIONS, {"prompt": "hi", "suffix": "end"}, "suffix"),
        (COMPLETIONS, {"prompt": "hi", "best_of": 3}, "best_of"),
        (COMPLETIONS, {"prompt": "hi", "repetition_penalty": 1.1, "repeat_penalty": 1.1},
         "repetition_penalty"),  # (vLLM's name, taken now; not beside llama.cpp's)
        (COMPLETIONS, {"prompt": "hi", "truncate_prompt_tokens": 0}, "truncate_prompt_tokens"),
        (EMBEDDINGS, {"input": "hi", "truncate": True}, "truncate"),
    ],
    "unsupported content": [
        (CHAT, {"messages": [{"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": "http://127.0.0.1/cat.png"}}]}]},
         "messages[0].content[0]"),
        (CHAT, {"messages": [{"role": "user", "content": [
            {"type": "text", "text": "what is this?"},
            {"type": "input_audio", "input_audio": {"data": "AAAA", "format": "wav"}}]}]},
         "messages[0].content[1]"),
        (CHAT, {"messages": [{"role": "user", "content": [{"type": "video"}]}]},
         "messages[0].content[0]"),
        (CHAT, {"messages": [{"role": "user", "content": [{"type": "text"}]}]},
         "messages[0].content[0]"),
        (CHAT, {"messages": [{"role": "wizard", "content": "hi"}]}, None),
    ],
    "empty and malformed bodies": [
        (CHAT, b"", None),
        (CHAT, b"{}", "messages"),
        (COMPLETIONS, b"[]", None),
        (COMPLETIONS, b"null", None),
        (CHAT, b'{"messages": [{"role": "user", "content": "\xff\xfe"}]}', None),
        (CHAT, b'{"messages": [{"role": "user", "content": "\\ud800"}]}', None),
        (CHAT, b'{"messages": ' + b"[" * 100_000 + b"]" * 100_000 + b"}", None),
        (EMBEDDINGS, b'{"input": ' + b"{\"a\":" * 50_000 + b"1" + b"}" * 50_000 + b"}", None),
        (COMPLETIONS, b'{"prompt": "hi",}', None),
    ],
}


@pytest.mark.parametrize("group", list(BAD))
def test_bad_input_gets_a_4xx_and_leaves_nothing_behind(srv, group):
    for path, body, param in BAD[group]:
        r = post(srv, path, body)
        assert r.status_code == 400, (path, body if len(str(body)) < 300 else "...", r.text)
        assert_error(r, 400, param)
    assert_error(post(srv, CHAT, b"x" * (9 * 1024 * 1024)), 413)
    assert httpx.get(srv.url + "/health", timeout=30).status_code == 200
    assert_idle(srv)


def test_max_tokens_beyond_the_context_is_refused_with_the_numbers(srv):
    r = post(srv, COMPLETIONS, {"prompt": [2, 651, 6037], "max_tokens": 10**12})
    assert_error(r, 400, "max_tokens", says=f"maximum context length is {CTX} tokens")
    message = r.json()["error"]["message"]
    assert f"3 in the prompt, {10**12} in max_tokens" in message
    # Exactly filling the context is allowed; one more is not.
    ok = post(srv, COMPLETIONS, {"prompt": [2, 651, 6037], "max_tokens": CTX - 3,
                                 "temperature": 0, "ignore_eos": True, "stop": ["\n", "."]})
    assert ok.status_code == 200, ok.text
    assert_error(post(srv, COMPLETIONS, {"prompt": [2, 651, 6037], "max_tokens": CTX - 2}),
                 400, "max_tokens")


def test_a_chat_without_max_tokens_is_bounded_by_the_context(model_path, tmp_path):
    plain = tmp_path / "plain.jinja"  # no turn markers, so no stop strings
    plain.write_text("{% for m in messages %}{{ m['content'] }}\n{% endfor %}")
    s = start_server(model_path, "--max-seqs", "2", "--pool-blocks", "32", "--ctx", "40",
                     "--chat-template", str(plain))
    try:
        r = post(s, CHAT, {"messages": MSGS, "temperature": 0, "ignore_eos": True})
        assert r.status_code == 200, r.text
        u = r.json()["usage"]
        assert r.json()["choices"][0]["finish_reason"] == "length"
        assert u["prompt_tokens"] + u["completion_tokens"] == 40
        r = post(s, COMPLETIONS, {"prompt": "Hello", "temperature": 0, "ignore_eos": True})
        assert r.json()["usage"]["completion_tokens"] == 16  # OpenAI's default for completions
    finally:
        assert s.stop() == 0


def test_a_first_chat_with_the_base_demo_model_makes_sense(srv):
    """No chat template in the GGUF: a plain transcript, stopped at the next "User:"."""
    body = {"messages": [{"role": "user", "content": "What is the capital of France?"}],
            "temperature": 0, "max_tokens": 40}
    r = post(srv, CHAT, body)
    choice = r.json()["choices"][0]
    assert choice["message"]["content"] == "The capital of France is Paris."
    assert choice["finish_reason"] == "stop"
    r = httpx.post(srv.url + CHAT, json={**body, "stream": True}, timeout=60)
    assert r.headers["content-type"].startswith("text/event-stream")
    chunks = [json.loads(line[6:]) for line in r.text.splitlines()
              if line.startswith("data: {")]
    assert "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks) == \
        "The capital of France is Paris."


def first_token(server, path, extra: dict) -> tuple[str, list]:
    """The greedy first token (text) and its top-5 alternatives."""
    if path == CHAT:
        body = {"messages": [{"role": "user", "content": "The capital of France is"}],
                "logprobs": True, "top_logprobs": 5}
    else:
        body = {"prompt": "The capital of France is", "logprobs": 5}
    r = post(server, path, {**body, "max_tokens": 1, "temperature": 0, **extra})
    assert r.status_code == 200, r.text
    lp = r.json()["choices"][0]["logprobs"]
    if path == CHAT:
        entry = lp["content"][0]
        return entry["token"], [t["token"] for t in entry["top_logprobs"]]
    return lp["tokens"][0], list(lp["top_logprobs"][0])


@pytest.mark.parametrize("path", [COMPLETIONS, CHAT])
def test_logit_bias_bans_and_forces_tokens(srv, engine, path):
    best, top = first_token(srv, path, {})
    assert best == top[0]
    (best_id,) = engine.backend.tokenize(best, add_special=False)
    banned, _ = first_token(srv, path, {"logit_bias": {str(best_id): -100}})
    assert banned != best and banned == top[1]
    forced_ids = engine.backend.tokenize(" banana", add_special=False)
    assert len(forced_ids) == 1
    for temperature in (0, 0.9):
        body = {"max_tokens": 3, "temperature": temperature, "seed": 1,
                "logit_bias": {str(forced_ids[0]): 100}}
        if path == CHAT:
            r = post(srv, CHAT, {**body, "messages": MSGS})
            text = r.json()["choices"][0]["message"]["content"]
        else:
            r = post(srv, COMPLETIONS, {**body, "prompt": "Hello"})
            text = r.json()["choices"][0]["text"]
        assert text.strip() == "banana banana banana", (temperature, text)


def test_a_non_streaming_client_that_leaves_has_its_request_aborted(srv):
    before = metric(metrics(srv), "vllm:generation_tokens_total")

    async def leave_once_generating() -> None:
        async with httpx.AsyncClient(timeout=300, trust_env=False) as http:
            call = asyncio.create_task(http.post(srv.url + COMPLETIONS, json={
                "prompt": "Tell me a long story.", "max_tokens": 900, "ignore_eos": True}))
            while metric((await http.get(srv.url + "/metrics")).text,
                         "vllm:generation_tokens_total") - before < 5:
                assert not call.done(), call.result().text
                await asyncio.sleep(0.05)
            call.cancel()  # the client goes away mid-generation

    asyncio.run(leave_once_generating())
    assert_idle(srv)
    generated = metric(metrics(srv), "vllm:generation_tokens_total") - before
    assert 5 <= generated < 900, generated  # aborted, not run to its max_tokens


def test_a_storm_of_disconnects_leaves_no_request_and_no_kv(srv):
    rng = random.Random(11)

    async def one(http: httpx.AsyncClient, i: int) -> str:
        stream = rng.random() < 0.5
        body = {"prompt": f"Client {i} asks: " + "tell me more " * rng.randint(1, 120),
                "max_tokens": rng.choice([8, 64, 300]), "temperature": rng.choice([0, 0.8]),
                "stream": stream, "ignore_eos": True}
        path = CHAT if i % 3 == 0 else COMPLETIONS
        if path == CHAT:
            body["messages"] = [{"role": "user", "content": body.pop("prompt")}]
        try:
            if stream:
                leave_after = rng.randint(0, 8)
                async with http.stream("POST", srv.url + path, json=body) as r:
                    if r.status_code != 200:
                        return f"http_{r.status_code}"
                    n = 0
                    async for line in r.aiter_lines():
                        n += line.startswith("data: {")
                        if n >= leave_after:
                            return "left"
                return "done"
            r = await asyncio.wait_for(http.post(srv.url + path, json=body),
                                       rng.uniform(0.01, 1.5))
            return f"http_{r.status_code}"
        except TimeoutError:
            return "left"

    async def main() -> list[str]:
        outcomes: list[str] = []
        async with httpx.AsyncClient(timeout=120, trust_env=False) as http:
            for wave in range(6):  # waves of 8: all fit in the waiting queue (--max-queue 8)
                outcomes += await asyncio.gather(*(one(http, wave * 8 + i) for i in range(8)))
        return outcomes

    outcomes = asyncio.run(main())
    assert not [o for o in outcomes if o.startswith("http_5")], outcomes
    assert outcomes.count("left") >= 20 and "http_429" not in outcomes, outcomes
    assert_idle(srv)
    assert post(srv, COMPLETIONS, {"prompt": "Hello", "max_tokens": 2}).status_code == 200


def test_overload_gets_only_200_or_429_and_every_accepted_request_completes(srv):
    async def main():
        async with httpx.AsyncClient(timeout=300, trust_env=False) as http:
            return await asyncio.gather(*(
                http.post(srv.url + COMPLETIONS, json={"prompt": f"Count to {i}:",
                                                       "max_tokens": 6, "ignore_eos": True})
                for i in range(60)))

    responses = asyncio.run(main())
    codes = [r.status_code for r in responses]
    assert set(codes) <= {200, 429}, codes
    assert codes.count(429) >= 20 and codes.count(200) >= 8, codes
    for r in responses:
        if r.status_code == 429:
            assert r.headers["retry-after"] == "1"
            assert r.json()["error"]["type"] == "rate_limit_error"
        else:
            assert r.json()["usage"]["completion_tokens"] == 6
            assert r.json()["choices"][0]["finish_reason"] == "length"
    assert_idle(srv)


def test_a_second_ctrl_c_ends_the_drain_now_with_the_final_event_and_exit_130(model_path):
    """uvicorn's forced exit cut streams mid-token (no shutting_down event, no [DONE]),
    printed tracebacks and exited 0."""
    import signal

    s = start_server(model_path, "--max-seqs", "2", "--pool-blocks", "128",
                     "--shutdown-timeout", "60")
    try:
        events: list[str] = []
        with httpx.stream("POST", s.url + COMPLETIONS, timeout=120, json={
                "prompt": "Tell me a long story.", "max_tokens": 1500, "ignore_eos": True,
                "stream": True}) as r:
            t0 = None
            for line in r.iter_lines():
                if line.startswith("data: "):
                    events.append(line[6:])
                if len(events) == 3 and t0 is None:  # streaming: Ctrl-C, then again
                    s.proc.send_signal(signal.SIGINT)
                    time.sleep(1.0)
                    t0 = time.monotonic()
                    s.proc.send_signal(signal.SIGINT)
        rc = s.proc.wait(timeout=30)
        assert t0 is not None and time.monotonic() - t0 < 20  # not the 60 s drain
        log = s.output()
        assert rc == 130 and "Traceback" not in log, (rc, log)
        assert events[-1] == "[DONE]"
        assert json.loads(events[-2])["error"]["code"] == "shutting_down"
    finally:
        if s.proc.poll() is None:
            s.proc.kill()


def test_sigterm_under_load_drains_then_aborts_and_exits_cleanly(model_path):
    grace = 4.0
    s = start_server(model_path, "--max-seqs", "8", "--pool-blocks", "160",
                     "--shutdown-timeout", str(grace))
    try:
        long = {"prompt": "Tell me a long story.", "max_tokens": 1500, "ignore_eos": True}

        async def stream(http):
            events = []
            async with http.stream("POST", s.url + COMPLETIONS, json={**long, "stream": True}) as r:
                assert r.status_code == 200
                async for line in r.aiter_lines():
                    if line.startswith("data: "):
                        events.append(line[6:])
            return events

        async def main():
            async with httpx.AsyncClient(timeout=120, trust_env=False) as http:
                tasks = [asyncio.create_task(stream(http)) for _ in range(3)]
                tasks += [asyncio.create_task(http.post(s.url + COMPLETIONS, json=long))
                          for _ in range(3)]
                short = asyncio.create_task(http.post(s.url + COMPLETIONS, json={
                    "prompt": "Hi", "max_tokens": 10, "ignore_eos": True}))
                while metric((await http.get(s.url + "/metrics")).text,
                             "vllm:num_requests_running") < 7:
                    await asyncio.sleep(0.1)
                kids = children(s.proc.pid)
                t0 = time.monotonic()
                s.proc.terminate()
                results = await asyncio.gather(*tasks, short, return_exceptions=True)
                return results, kids, t0

        results, kids, t0 = asyncio.run(main())
        rc = s.proc.wait(timeout=grace + 30)
        took = time.monotonic() - t0
        assert rc == 0
        log = s.output()
        assert "Traceback" not in log and "timeout graceful shutdown exceeded" not in log, log
        assert log.count("this model has no chat template") == 1, log  # said once, at load
        assert took < grace + 10, took  # the backstop (grace + 5) was not needed
        for events in results[:3]:
            assert events[-1] == "[DONE]"
            err = json.loads(events[-2])["error"]
            assert err["code"] == "shutting_down", err
        for r in results[3:6]:
            assert r.status_code == 503 and r.json()["error"]["code"] == "shutting_down"
        assert results[6].status_code == 200  # finished within the grace period
        assert all(subprocess.run(["kill", "-0", str(k)], capture_output=True).returncode
                   for k in kids)
    finally:
        if s.proc.poll() is None:
            s.proc.kill()


def test_sigterm_with_an_embedding_under_way_gets_a_503_and_exits(model_path):
    """An embedding is aborted with the requests at the end of the grace period: a 503 in
    the API's shape, and the server exits then (it answered a bare 500 and ran the
    embedding to its end, a minute and more, before exiting)."""
    grace = 1.0
    s = start_server(model_path, "--max-seqs", "2", "--pool-blocks", "64",
                     "--shutdown-timeout", str(grace))
    try:
        words = "The lighthouse keeper wrote down every ship that passed. " * 80
        body = {"input": [f"{i} {words}" for i in range(64)]}  # (~56k tokens: a minute here)

        async def main():
            async with httpx.AsyncClient(timeout=120, trust_env=False) as http:
                call = asyncio.create_task(http.post(s.url + EMBEDDINGS, json=body))
                await asyncio.sleep(2.0)  # (tokenized, and a few chunks in)
                assert not call.done(), call.result().text
                t0 = time.monotonic()
                s.proc.terminate()
                return await call, t0

        r, t0 = asyncio.run(main())
        rc = s.proc.wait(timeout=60)
        took = time.monotonic() - t0
        assert r.status_code == 503 and r.json()["error"]["code"] == "shutting_down", r.text
        assert rc == 0 and took < 30, took  # (the 64 inputs would take minutes)
        assert "Traceback" not in s.output(), s.output()
    finally:
        if s.proc.poll() is None:
            s.proc.kill()


def test_an_embedding_whose_client_leaves_is_stopped(srv):
    """A client that leaves an embedding ends its work (it ran to its end), so the request
    after it is answered at once, not behind it."""
    words = "The lighthouse keeper wrote down every ship that passed. " * 80
    body = {"input": [f"{i} {words}" for i in range(64)]}

    async def leave() -> None:
        async with httpx.AsyncClient(timeout=120, trust_env=False) as http:
            call = asyncio.create_task(http.post(srv.url + EMBEDDINGS, json=body))
            await asyncio.sleep(1.5)
            assert not call.done(), call.result().text
            call.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await call

    def aborted() -> float:  # (vLLM's abort count; the embedding was counted nowhere)
        m = re.search(r'^vllm:request_success_total\{[^}]*finished_reason="abort"[^}]*\} (\S+)$',
                      metrics(srv), re.M)
        return float(m.group(1)) if m else 0.0

    before = aborted()
    asyncio.run(leave())
    r = post(srv, EMBEDDINGS, {"input": "a short one"}, timeout=20)  # (minutes behind it)
    assert r.status_code == 200 and len(r.json()["data"]) == 1
    assert aborted() == before + 1


@pytest.mark.parametrize(("path", "body"), [
    (COMPLETIONS, lambda text: {"prompt": text, "max_tokens": 1}),
    (CHAT, lambda text: {"messages": [{"role": "user", "content": text}], "max_tokens": 1,
                         "stream": True}),
    ("/v1/messages/count_tokens", lambda text: {"model": "m", "messages": [
        {"role": "user", "content": text}]}),
    (EMBEDDINGS, lambda text: {"input": text}),
])
def test_a_prompt_of_megabytes_is_tokenized_while_the_server_answers_others(srv, path, body):
    """Tokenizing 4 MB of text takes seconds; it happens on a worker thread, and the event
    loop answers everyone else meanwhile (it held /health for 2.3 s before)."""
    async def main() -> tuple[int, int, str]:
        async with httpx.AsyncClient(timeout=120, trust_env=False) as http:
            payload = body("word " * 800_000)
            if path == "/v1/messages/count_tokens":
                payload["model"] = srv.model
            big = asyncio.create_task(http.post(srv.url + path, json=payload))
            answered = 0
            while not big.done():
                r = await http.get(srv.url + "/health")
                answered += r.status_code == 200 and not big.done()
                await asyncio.sleep(0.01)
            r = big.result()
            return answered, r.status_code, r.text

    answered, status, text = asyncio.run(main())
    # the context holds 1,024 tokens: the prompt is refused once counted (count_tokens counts)
    assert status == (200 if "count_tokens" in path else 400), text
    assert "800002" in text or "800036" in text or "input_tokens" in text, text
    assert answered >= 10, answered
    assert_idle(srv)


def test_a_small_request_does_not_queue_behind_clients_sending_megabytes(srv):
    """Five clients send 3 MB prompts at once (seconds of tokenizing each, then a 400 for
    their length); a small request sent after them is answered before any of them: large
    requests are prepared on a pool of their own (it took 10 s, behind them, on a shared
    one)."""
    async def main() -> tuple[list[int], int, list[str]]:
        async with httpx.AsyncClient(timeout=300, trust_env=False) as http:
            order: list[str] = []

            async def send(name: str, body: dict) -> int:
                r = await http.post(srv.url + COMPLETIONS, json=body)
                order.append(name)
                return r.status_code

            big = "word " * 600_000
            large = [asyncio.create_task(send(f"large{i}", {"prompt": big, "max_tokens": 1}))
                     for i in range(5)]
            await asyncio.sleep(1.0)  # all five are being read and prepared
            assert not any(t.done() for t in large)
            small = await send("small", {"prompt": "Hello", "max_tokens": 2})
            return list(await asyncio.gather(*large)), small, order

    large, small, order = asyncio.run(main())
    assert large == [400] * 5 and small == 200
    assert order[0] == "small", order
    assert_idle(srv)
