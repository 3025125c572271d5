"""Prefill/decode disaggregation with real processes: one prefill and one decode replica of the
demo model behind the gateway. The openai client sees ordinary answers (streamed and not); the
prefill replica exported each prompt, the decode replica imported it and hit it in its prefix
cache; a prefill replica killed mid-request costs the request nothing but speed."""

from __future__ import annotations

import asyncio
import os
import re
import signal
import subprocess
import sys

import httpx
import openai

from tests.gateway.test_gateway import start_gateway, stop, wait_gone
from tests.gateway.test_replicas import (
    FLAGS,
    is_up,
    replicas,
    runner_metric,
    scale_up_under_load,
    wait_for,
)
from tests.lora_files import write_adapter
from tests.server.conftest import free_port

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

        # min_tokens past the one token the prefill replica draws: handed over too (its
        # one-token request refused min_tokens > max_tokens, and every such request fell back)
        held = client.completions.with_raw_response.create(
            model="demo", prompt=STORY * 8, max_tokens=4, temperature=0,
            extra_body={"min_tokens": 3})
        assert held.headers["x-pd"] == "handed-over" and held.parse().usage.completion_tokens >= 3
        # A short prompt (under prefill-min-tokens) is computed where it is decoded.
        short = client.completions.create(model="demo", prompt="The sea was", max_tokens=3,
                                          temperature=0, extra_body={"ignore_eos": True})
        assert short.usage.completion_tokens == 3
        # A LoRA request goes to the decode replica whole (its KV is the adapter's).
        lora = client.completions.create(model="sql", prompt=STORY * 8, max_tokens=3,
                                         temperature=0, extra_body={"ignore_eos": True})
        assert lora.model == "sql" and lora.usage.completion_tokens == 3
        status = gw.status()["demo"]
        assert status["pd"]["transfers"] == 3 and status["pd"]["fallbacks"] == {}, status["pd"]
        assert status["pd"]["short_prompts"] == 1
        assert runner_metric(gw, "justllm_pd_exports_total", "demo", "0") == 3
        assert runner_metric(gw, "justllm_pd_imports_total", "demo", "1") == 3
        # The prefill replica drew each answer's first token, and computed its prompt; the
        # decode replica went on, and counts only what it drew and computed itself (the
        # hand-overs' tokens and prompts were counted on both replicas)
        assert runner_metric(gw, "vllm:generation_tokens_total", "demo", "0") == 3
        drawn = (12 + answer.usage.completion_tokens + held.parse().usage.completion_tokens
                 - 3 + short.usage.completion_tokens + lora.usage.completion_tokens)
        assert runner_metric(gw, "vllm:generation_tokens_total", "demo", "1") == drawn
        assert runner_metric(gw, "vllm:prompt_tokens_total", "demo", "1") == (
            short.usage.prompt_tokens + lora.usage.prompt_tokens)
        # and each replica's TTFT is its own part: the prefill on the prefill replica
        assert runner_metric(gw, "vllm:time_to_first_token_seconds_count", "demo", "0") == 3
        # The decode replica found each imported prompt in its prefix cache.
        assert runner_metric(gw, "justllm_prefix_cache_hits_total", "demo", "1") == 3
        text = httpx.get(gw.url + "/metrics", timeout=30).text
        assert 'justllm_gateway_pd_transfers_total{model_name="demo"} 3' in text
        assert 'replica="0",role="prefill"} 1' in text  # justllm top shows "1P 1D"
        # Each router's decisions: the prompts placed by the model's policy (cache-aware),
        # the generation by load (only the decode router's were counted)
        decided = {(m.group(1), m.group(2)): int(m.group(3)) for m in re.finditer(
            r'justllm_gateway_routing_decisions_total\{model_name="demo",role="(\w+)",'
            r'reason="([\w-]+)"\} (\d+)', text)}
        assert sum(n for (role, _), n in decided.items() if role == "prefill") == 3, decided
        assert decided["decode", "least-load"] == 5, decided
        assert sum(status["decisions"].values()) == 3
        assert status["pd"]["decode_decisions"] == {"least-load": 5}
        # A request the decode half would refuse (max_tokens past the context) is refused by
        # the prefill replica before it computes anything, and answered at once: it was
        # computed and exported, then sent again whole to be refused, a PD "fallback"
        r = httpx.post(gw.url + "/v1/completions", timeout=60, json={
            "model": "demo", "prompt": STORY * 8, "max_tokens": 2000})
        assert r.status_code == 400 and r.json()["error"]["param"] == "max_tokens", r.text
        assert runner_metric(gw, "justllm_pd_exports_total", "demo", "0") == 3
        assert gw.status()["demo"]["pd"]["fallbacks"] == {}
        assert gw.status()["demo"]["pd"]["decode_decisions"] == {"least-load": 5}

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
        assert runner_metric(gw, "justllm_pd_exports_total", "demo", "0") == 3
        assert runner_metric(gw, "justllm_pd_imports_total", "demo", "1") == 3
        # counted once at the gateway too (it was in no series there)
        wait_for("the gateway's count", lambda: gw.status()["demo"]["pd"]["aborted"] == 1)
        assert gw.status()["demo"]["pd"]["transfers"] == 3
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


def _prefill_in_flight(gw) -> bool:
    return any(r["role"] == "prefill" and r["in_flight"] >= 1
               for r in replicas(gw, "demo").values())


def _during_prefill(gw, action) -> httpx.Response:
    """A long prompt's request, and ``action`` once its prefill replica has it."""
    async def run() -> httpx.Response:
        async with httpx.AsyncClient(timeout=300) as http:
            call = asyncio.create_task(http.post(gw.url + "/v1/completions", json={
                "model": "demo", "prompt": STORY * 40, "max_tokens": 6, "ignore_eos": True}))
            while not _prefill_in_flight(gw):
                assert not call.done(), call.result().text
                await asyncio.sleep(0.02)
            action()
            return await call

    return asyncio.run(run())


def test_an_unload_or_a_shutdown_lets_a_request_in_its_prefill_finish(tmp_path, model_path):
    """The README's drain holds for a PD model's requests: one whose prompt was being
    prefilled when the model was unloaded (or the gateway stopped) got a 503 (no decode
    replica left in the rotation), though the decode runner was still draining."""
    gw = start_gateway(tmp_path, {"demo": {
        "source": model_path, "prefill-replicas": 1, "decode-replicas": 1, "preload": True,
        **FLAGS}}, shutdown_timeout=60)
    pids: list[int] = []
    try:
        wait_for("both replicas", lambda: [r["status"] for r in
                                           replicas(gw, "demo").values()] == ["ready"] * 2)
        pids = [r["pid"] for r in replicas(gw, "demo").values()]
        r = _during_prefill(gw, lambda: httpx.post(gw.url + "/models/unload", timeout=300,
                                                   json={"model": "demo"}))
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["completion_tokens"] == 6 and r.headers["x-pd"] == "handed-over"
        assert gw.status()["demo"]["status"] == "unloaded"
        wait_gone(pids)
        # loaded again by a request, then the gateway is stopped under one
        short = httpx.post(gw.url + "/v1/completions", timeout=300, json={
            "model": "demo", "prompt": "Hi", "max_tokens": 1})
        assert short.status_code == 200, short.text
        pids = [r["pid"] for r in replicas(gw, "demo").values()]
        r = _during_prefill(gw, lambda: gw.proc.send_signal(signal.SIGTERM))
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["completion_tokens"] == 6 and r.headers["x-pd"] == "handed-over"
        assert gw.proc.wait(timeout=120) == 0  # (it no longer listens: stop() finds it gone)
    finally:
        rc, out = stop(gw)
    assert rc == 0, out
    wait_gone(pids)


def test_remote_prefill_and_decode_replicas_under_other_names(tmp_path, model_path):
    """A remote server may serve the model under another name (the README): a PD model's
    prefill request and hand-over named the gateway's, a 404 from the decode server for every
    request handed over, and every prefill fell back."""
    servers, urls = [], {}
    try:
        for role in ("prefill", "decode"):
            port = free_port()
            servers.append(subprocess.Popen(
                [sys.executable, "-m", "justllm", "serve", model_path, "--port", str(port),
                 "--role", role, "--served-model-name", f"{role}-side", "--max-seqs", "4",
                 "--pool-blocks", "64", "--threads", "1"],
                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
            urls[role] = f"http://127.0.0.1:{port}"
        for url in urls.values():
            wait_for(url, lambda url=url: is_up(url), 120)
        gw = start_gateway(tmp_path, {"demo": {"prefill-replicas": [urls["prefill"]],
                                               "decode-replicas": [urls["decode"]]}})
        try:
            for stream in (False, True):
                with httpx.stream("POST", gw.url + "/v1/completions", timeout=120, json={
                        "model": "demo", "prompt": STORY * 8, "max_tokens": 4,
                        "ignore_eos": True, "stream": stream}) as r:
                    body = r.read().decode()
                    assert r.status_code == 200, body
                    assert r.headers["x-pd"] == "handed-over"
                assert '"finish_reason":"length"' in body.replace(" ", "")
            assert gw.status()["demo"]["pd"]["transfers"] == 2
            assert gw.status()["demo"]["pd"]["fallbacks"] == {}
        finally:
            rc, out = stop(gw)
        assert rc == 0, out
    finally:
        for server in servers:
            server.terminate()
        for server in servers:
            server.wait(timeout=60)
