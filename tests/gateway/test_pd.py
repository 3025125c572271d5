"""Prefill/decode disaggregation with real processes: one prefill and one decode replica of the
demo model behind the gateway. The openai client sees ordinary answers (streamed and not); the
prefill replica exported each prompt, the decode replica imported it and hit it in its prefix
cache; a prefill replica killed mid-request costs the request nothing but speed."""

from __future__ import annotations

import asyncio
import os
import signal

import httpx
import openai

from tests.gateway.test_gateway import start_gateway, stop, wait_gone
from tests.gateway.test_replicas import (
    FLAGS,
    replicas,
    runner_metric,
    scale_up_under_load,
    wait_for,
)
from tests.lora_files import write_adapter

STORY = "Once upon a time there was a lighthouse keeper who counted the waves every night. "


def test_prefill_and_decode_replicas_hand_over_the_kv_and_survive_a_dead_prefill(
        tmp_path, model_path):
    adapter = write_adapter(tmp_path / "sql.gguf", seed=1)
    gw = start_gateway(tmp_path, {"demo": {
        "source": model_path, "prefill-replicas": 1, "decode-replicas": 1, "preload": True,
        "chat-template": "gemma", "lora": {"sql": str(adapter)}, **FLAGS}})
    try:
        wait_for("both replicas", lambda: [(r["role"], r["status"]) for r in
                                           replicas(gw, "demo").values()] ==
                 [("prefill", "ready"), ("decode", "ready")])
        client = openai.OpenAI(base_url=gw.url + "/v1", api_key="none", max_retries=0)
        stream = client.completions.create(model="demo", prompt=STORY * 8, max_tokens=12,
                                           temperature=0, stream=True,
                                           stream_options={"include_usage": True},
                                           extra_body={"ignore_eos": True})
        chunks = list(stream)
        text = "".join(c.choices[0].text for c in chunks if c.choices)
        assert chunks[-1].usage.completion_tokens == 12 and text, chunks[-1]
        chat = client.chat.completions.with_raw_response.create(
            model="demo", max_tokens=8, temperature=0,
            messages=[{"role": "user", "content": STORY * 6 + "What did he count?"}])
        assert chat.headers["x-replica"] == "1"  # the decode replica answered
        assert chat.headers["x-pd"] == "handed-over"
        answer = chat.parse()
        assert answer.choices[0].message.content and answer.usage.completion_tokens <= 8

        # A short prompt (under prefill-min-tokens) is computed where it is decoded.
        short = client.completions.create(model="demo", prompt="The sea was", max_tokens=3,
                                          temperature=0, extra_body={"ignore_eos": True})
        assert short.usage.completion_tokens == 3
        # A LoRA request goes to the decode replica whole (its KV is the adapter's).
        lora = client.completions.create(model="sql", prompt=STORY * 8, max_tokens=3,
                                         temperature=0, extra_body={"ignore_eos": True})
        assert lora.model == "sql" and lora.usage.completion_tokens == 3
        status = gw.status()["demo"]
        assert status["pd"]["transfers"] == 2 and status["pd"]["fallbacks"] == {}, status["pd"]
        assert status["pd"]["short_prompts"] == 1
        assert runner_metric(gw, "justllm_pd_exports_total", "demo", "0") == 2
        assert runner_metric(gw, "justllm_pd_imports_total", "demo", "1") == 2
        # The prefill replica drew each answer's first token; the decode replica went on.
        assert runner_metric(gw, "vllm:generation_tokens_total", "demo", "0") == 2
        # The decode replica found each imported prompt in its prefix cache.
        assert runner_metric(gw, "justllm_prefix_cache_hits_total", "demo", "1") == 2
        text = httpx.get(gw.url + "/metrics", timeout=30).text
        assert 'justllm_gateway_pd_transfers_total{model_name="demo"} 2' in text
        assert 'replica="0",role="prefill"} 1' in text  # justllm top shows "1P 1D"

        # A client that leaves while its prompt is being prefilled: the prefill replica
        # aborts it, and nothing reaches the decode replica.
        async def left_during_prefill():
            async with httpx.AsyncClient(timeout=300) as http:
                call = asyncio.create_task(http.post(gw.url + "/v1/completions", json={
                    "model": "demo", "prompt": STORY * 60, "max_tokens": 6}))
                while not runner_metric(gw, "vllm:num_requests_running", "demo", "0"):
                    await asyncio.sleep(0.05)
                call.cancel()

        asyncio.run(left_during_prefill())
        wait_for("the prefill aborted", lambda: 'justllm_pd_prefills_aborted_total{'
                 'model_name="demo",replica="0"} 1.0' in httpx.get(gw.url + "/metrics").text)
        wait_for("the prefill replica idle", lambda: runner_metric(
            gw, "vllm:num_requests_running", "demo", "0") == 0)
        assert runner_metric(gw, "justllm_pd_exports_total", "demo", "0") == 2
        assert runner_metric(gw, "justllm_pd_imports_total", "demo", "1") == 2
        # counted once at the gateway too (it was in no series there)
        wait_for("the gateway's count", lambda: gw.status()["demo"]["pd"]["aborted"] == 1)
        assert gw.status()["demo"]["pd"]["transfers"] == 2
        assert 'justllm_gateway_pd_aborted_total{model_name="demo"} 1' in httpx.get(
            gw.url + "/metrics", timeout=30).text

        # kill -9 the prefill replica while it computes a long prompt: the request is served
        # whole by the decode replica instead, with every token.
        victim = replicas(gw, "demo")["0"]["pid"]

        async def killed_prefill():
            async with httpx.AsyncClient(timeout=300) as http:
                call = asyncio.create_task(http.post(gw.url + "/v1/completions", json={
                    "model": "demo", "prompt": STORY * 60, "max_tokens": 6,
                    "ignore_eos": True}))
                while replicas(gw, "demo")["0"]["in_flight"] < 1:
                    await asyncio.sleep(0.02)
                os.kill(victim, signal.SIGKILL)
                return await call

        r = asyncio.run(killed_prefill())
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["completion_tokens"] == 6
        assert gw.status()["demo"]["pd"]["fallbacks"] == {"prefill_failed": 1}
        back = wait_for("the prefill replica back", lambda: (
            p := replicas(gw, "demo")["0"])["status"] == "ready" and p)
        assert back["pid"] != victim and back["restarts"] == 1
        pids = [p["pid"] for p in replicas(gw, "demo").values()]
    finally:
        rc, out = stop(gw)
    assert rc == 0, out
    wait_gone(pids)


def test_a_pd_models_decode_replicas_scale_with_their_own_load(tmp_path, model_path):
    """decode-replicas as the autoscaler's mapping: under load a second decode replica starts
    and takes requests, the prefill replica stays alone; idle, the extra one is retired."""
    gw = start_gateway(tmp_path, {"demo": {
        "source": model_path, "prefill-replicas": 1, "preload": True,
        "decode-replicas": {"min-replicas": 1, "max-replicas": 2, "target-ongoing": 1,
                            "upscale-delay": 0.5, "downscale-delay": 2}, **FLAGS}})
    try:
        wait_for("both replicas", lambda: [(r["role"], r["status"]) for r in
                                           replicas(gw, "demo").values()] ==
                 [("prefill", "ready"), ("decode", "ready")])

        grown, statuses, answers = scale_up_under_load(
            gw, "demo", "a second decode replica",
            [("prefill", "ready"), ("decode", "ready"), ("decode", "ready")])
        added = grown["2"]["pid"]
        assert statuses == [200] * 4
        assert [r.status_code for r in answers] == [200] * 4, [r.text for r in answers]
        assert "2" in {r.headers["x-replica"] for r in answers}
        scale = gw.status()["demo"]["autoscale"]
        assert list(scale) == ["decode"] and scale["decode"]["up"] == 1, scale
        text = httpx.get(gw.url + "/metrics", timeout=30).text
        assert ('justllm_autoscaler_decisions_total{model_name="demo",role="decode",'
                'direction="up"} 1') in text
        # Idle: back to one decode replica; the prefill replica was never touched.
        wait_for("one decode replica", lambda: list(replicas(gw, "demo")) == ["0", "1"], 60)
        wait_gone([added])
        assert gw.status()["demo"]["autoscale"]["decode"]["down"] == 1
        pids = [r["pid"] for r in replicas(gw, "demo").values()]
    finally:
        rc, out = stop(gw)
    assert rc == 0, out
    assert "autoscaler: model demo (decode) up to 2 replicas" in out, out
    wait_gone(pids)
