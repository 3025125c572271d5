"""The replica's half of prefill/decode disaggregation, over HTTP on one ``justllm serve``
(role ``both`` does either half): ``/pd/prefill`` draws each choice's first token with the
request's own sampling and hands it over with the prompt's KV; ``/pd/decode`` goes on from it
(its answer starts with that token, sent at once); hand-overs that do not fit are counted and
the request served whole. The gateway's side, with real replicas: tests/gateway/test_pd.py."""

from __future__ import annotations

import json
import struct

import httpx
import pytest

from justllm.kv.transfer import unpack
from justllm.server.pd import read_handover

PROMPT = "Lighthouses stood along the rocky coast, each with its own keeper and its own light. "


def prefill(server, path: str, body: dict) -> bytes:
    r = httpx.post(f"{server.url}/pd/prefill", params={"path": path}, json=body, timeout=120)
    assert r.status_code == 200, r.text
    return r.content


def decode(server, path: str, body: dict, handover: bytes, **kw) -> httpx.Response:
    request = json.dumps(body).encode()
    return httpx.post(f"{server.url}/pd/decode", params={"path": path}, timeout=120,
                      content=struct.pack("<I", len(request)) + request + handover, **kw)


def failures(server, reason: str) -> float:
    for line in httpx.get(server.url + "/metrics", timeout=30).text.splitlines():
        if line.startswith("justllm_pd_import_failures_total{") and f'reason="{reason}"' in line:
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def test_the_decode_half_goes_on_from_the_prefill_halfs_first_tokens(server):
    body = {"model": server.model, "prompt": PROMPT * 4, "max_tokens": 6, "n": 2,
            "temperature": 1.0, "seed": 11, "logprobs": 2, "ignore_eos": True}
    handover = prefill(server, "/v1/completions", body)
    choices, kv = read_handover(memoryview(handover))
    assert choices is not None and [len(c.token_ids) for c in choices] == [1, 1]
    assert all(c.logprobs and c.logprobs[0].token_id == c.token_ids[0] for c in choices)
    header, _ = unpack(kv)  # the prompt's KV follows
    assert len(header.tokens) > 60

    r = decode(server, "/v1/completions", body, handover)
    assert r.status_code == 200 and r.headers["x-pd"] == "handed-over", r.text
    answer = r.json()
    for c, choice in zip(choices, answer["choices"]):
        first = choice["logprobs"]["token_logprobs"][0]
        assert first == pytest.approx(c.logprobs[0].logprob)  # the prefill half's draw
        assert choice["finish_reason"] == "length"
    assert answer["usage"]["completion_tokens"] == 12

    # Streamed: the first token sent is the prefill half's.
    stream = {**body, "n": 1, "stream": True, "logprobs": 1, "seed": 12}
    handover = prefill(server, "/v1/completions", stream)
    (only,), _ = read_handover(memoryview(handover))
    r = decode(server, "/v1/completions", stream, handover)
    assert r.headers["x-pd"] == "handed-over"
    chunks = [json.loads(line[6:])["choices"][0]
              for line in r.text.splitlines() if line.startswith("data: {")]
    sent = [lp for c in chunks if c["logprobs"] for lp in c["logprobs"]["token_logprobs"]]
    assert len(sent) == 6 and sent[0] == pytest.approx(only.logprobs[0].logprob)


def test_chat_hands_over_its_rendered_prompt_and_first_token(server):
    body = {"model": server.model, "max_tokens": 5, "temperature": 0, "logprobs": True,
            "messages": [{"role": "user", "content": PROMPT * 3 + "Who kept them?"}]}
    handover = prefill(server, "/v1/chat/completions", body)
    (choice,), _ = read_handover(memoryview(handover))
    r = decode(server, "/v1/chat/completions", body, handover)
    assert r.status_code == 200, r.text
    content = r.json()["choices"][0]["logprobs"]["content"]
    assert content[0]["logprob"] == pytest.approx(choice.logprobs[0].logprob)


def test_hand_overs_that_do_not_fit_are_counted_and_the_request_served_whole(server):
    body = {"model": server.model, "prompt": PROMPT * 4, "max_tokens": 4, "temperature": 0,
            "ignore_eos": True}
    handover = prefill(server, "/v1/completions", body)
    two = prefill(server, "/v1/completions", {**body, "n": 2})
    garbage = struct.pack("<I", 9) + b"not json!" + handover[4 + struct.unpack(
        "<I", handover[:4])[0]:]
    before = {k: failures(server, k) for k in ("handover", "refused", "truncated")}
    cases = [
        (two, {"handover"}, "handover-refused"),  # two choices' first tokens for one
        (garbage, {"handover"}, "handover-refused"),  # not a head: the KV is still imported
        (handover[:2], {"handover", "truncated"}, "handover-refused"),  # cut inside the head
        (handover[:-1000], {"truncated"}, "kv-refused"),  # the token came; the KV cut short
    ]
    for sent, reasons, how in cases:
        r = decode(server, "/v1/completions", body, sent)
        assert r.status_code == 200 and r.headers["x-pd"] == how, (how, r.text)
        assert r.json()["usage"]["completion_tokens"] == 4
        for reason in before:
            counted = before[reason] + (reason in reasons)
            assert failures(server, reason) == counted, (reasons, reason)
            before[reason] = counted


@pytest.mark.parametrize("path, body", [
    ("/v1/completions", {"prompt": PROMPT, "prompt_logprobs": 1}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": PROMPT}],
                              "prompt_logprobs": 1}),
    # vLLM's truncate_prompt_tokens: the prompt the halves compute must be one
    ("/v1/completions", {"prompt": PROMPT, "truncate_prompt_tokens": 4}),
    # llama-server's cache_prompt false: the decode half would compute the KV again
    ("/v1/completions", {"prompt": PROMPT, "cache_prompt": False}),
])
def test_requests_for_prompt_logprobs_are_not_disaggregated(server, path, body):
    """Every prompt row's logprobs are the prefill's and do not travel with the KV: the
    prefill half refuses them with the code the gateway serves a request whole on."""
    r = httpx.post(f"{server.url}/pd/prefill", params={"path": path}, timeout=120,
                   json={"model": server.model, "max_tokens": 2, **body})
    assert r.status_code == 409 and r.json()["error"]["code"] == "not_disaggregated", r.text


def test_a_handed_over_request_has_no_prefill_on_the_decode_half(server):
    """Its first token came with the hand-over, before the engine first scheduled it: its
    prefill was the prefill half's, none here (it was observed as first token minus first
    scheduled, a negative time that lowered vllm:request_prefill_time_seconds_sum)."""
    from tests.server.test_openai_api import metric_in

    def prefills() -> tuple[float, float]:
        text = httpx.get(server.url + "/metrics", timeout=30).text
        return (metric_in(text, "vllm:request_prefill_time_seconds_count"),
                metric_in(text, "vllm:request_prefill_time_seconds_sum"))

    body = {"model": server.model, "prompt": PROMPT * 2, "max_tokens": 4, "temperature": 0,
            "ignore_eos": True}
    httpx.post(server.url + "/v1/completions", json=body, timeout=120)  # (series on the page)
    handover = prefill(server, "/v1/completions", body)
    count, total = prefills()
    r = decode(server, "/v1/completions", body, handover)
    assert r.status_code == 200 and r.headers["x-pd"] == "handed-over", r.text
    assert prefills() == (count + 1, total)
