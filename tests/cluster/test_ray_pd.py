"""Prefill/decode disaggregation on a real local Ray (2 CPUs): a PD model is two deployments,
one prefill and one decode replica of the demo model. A long prompt is computed on the prefill
replica and its KV reaches the decode replica through Ray's object store (the ingress passes
the reference on); the decode replica imports it and hits it in its prefix cache; a short
prompt stays on the decode replica; with the prefill replica killed, requests still complete;
`justllm cluster status` shows both deployments by role; nothing of Ray is left after `down`.
About a minute and a half (marked ``ray``)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator

import httpx
import openai
import pytest

from justllm.cluster.local_ray import LocalHead, stop_head
from justllm.gateway.runner import free_port
from tests.cluster.test_ray_cluster import justllm, metric, session, wait_for

pytestmark = [pytest.mark.ray, pytest.mark.timeout(600)]

STORY = "Once upon a time there was a lighthouse keeper who counted the waves every night. "
KILL = """
import sys, ray
ray.init(address=sys.argv[1], logging_level="ERROR", log_to_driver=False)
ray.kill(ray.get_actor("SERVE_REPLICA::justllm#model-demo-prefill#" + sys.argv[2],
                       namespace="serve"), no_restart=True)
ray.shutdown()
"""


def roles(url: str) -> dict[str, str]:
    """replica -> role, from the replica_up series of the ingress's /metrics."""
    found = {}
    for line in httpx.get(url + "/metrics", timeout=30).text.splitlines():
        if line.startswith("justllm_gateway_replica_up{") and line.endswith(" 1"):
            replica = line.split('replica="', 1)[1].split('"', 1)[0]
            found[replica] = line.split('role="', 1)[1].split('"', 1)[0]
    return found


def counter(url: str, series: str) -> float:
    for line in httpx.get(url + "/metrics", timeout=30).text.splitlines():
        if line.startswith(series + " "):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"{series} is not on /metrics")


@pytest.fixture(scope="module")
def deployed(tmp_path_factory, model_path) -> Iterator[tuple[str, dict[str, str], LocalHead]]:
    ray_tmp = tempfile.mkdtemp(prefix="jlpd-", dir="/tmp")  # short: Ray's socket paths
    cache = tmp_path_factory.mktemp("pd-cache")
    env = {**os.environ, "RAY_TMPDIR": ray_tmp, "JUSTLLM_CACHE_DIR": str(cache)}
    env.pop("RAY_ADDRESS", None)
    cfg = tmp_path_factory.mktemp("pd") / "cluster.yaml"
    cfg.write_text(f"models:\n  demo:\n    source: {model_path}\n    prefill-replicas: 1\n"
                   "    decode-replicas: 1\n    threads: 1\n    max-seqs: 4\n"
                   "    pool-blocks: 256\n")
    port = free_port()
    record = cache / "cluster" / "local-ray.json"
    head: LocalHead | None = None
    try:
        r = justllm(env, "cluster", "deploy", str(cfg), "--port", str(port))
        if record.exists():
            head = LocalHead(**json.loads(record.read_text()))
        assert r.returncode == 0, r.stderr[-3000:]
        assert head is not None
        yield f"http://127.0.0.1:{port}", env, head
    finally:
        if record.exists():
            justllm(env, "cluster", "down", timeout=180)
        if head is not None and session(head.pid):
            stop_head(head, grace=10)
        shutil.rmtree(ray_tmp, ignore_errors=True)


def test_the_kv_goes_from_the_prefill_replica_to_the_decode_replica_through_ray(deployed):
    url, env, head = deployed
    found = wait_for("a prefill and a decode replica", lambda: (
        r := roles(url)) and sorted(r.values()) == ["decode", "prefill"] and r, 120)
    prefill = next(r for r, role in found.items() if role == "prefill")
    decode = next(r for r, role in found.items() if role == "decode")
    client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)
    stream = client.completions.create(model="demo", prompt=STORY * 8, max_tokens=12,
                                       temperature=0, stream=True,
                                       stream_options={"include_usage": True},
                                       extra_body={"ignore_eos": True})
    chunks = list(stream)
    assert chunks[-1].usage.completion_tokens == 12
    assert "".join(c.choices[0].text for c in chunks if c.choices)
    whole = client.completions.with_raw_response.create(
        model="demo", prompt=STORY * 8 + "The keeper", max_tokens=6, temperature=0,
        extra_body={"ignore_eos": True})
    assert whole.headers["x-replica"] == decode and whole.headers["x-pd"] == "handed-over"
    assert whole.parse().usage.completion_tokens == 6
    short = client.completions.create(model="demo", prompt="The sea was", max_tokens=3,
                                      extra_body={"ignore_eos": True})
    assert short.usage.completion_tokens == 3
    assert counter(url, 'justllm_gateway_pd_transfers_total{model_name="demo"}') == 2
    assert counter(url, 'justllm_gateway_pd_short_prompts_total{model_name="demo"}') == 1
    # The replicas' own pages (on the board within a second or two): two exports on the
    # prefill replica, two imports on the decode replica, each a prefix-cache hit there.
    wait_for("the hand-overs on the replicas' pages", lambda: (
        metric(url, "justllm_pd_exports_total").get(prefill) == 2
        and metric(url, "justllm_pd_imports_total").get(decode) == 2
        and metric(url, "justllm_prefix_cache_hits_total").get(decode, 0) >= 2), 20)
    r = justllm(env, "cluster", "status", "--json", timeout=120)
    assert r.returncode == 0, r.stderr
    deployments = {m["deployment"]: m for m in json.loads(r.stdout)["models"]}
    assert deployments["model-demo-prefill"]["role"] == "prefill"
    assert deployments["model-demo"]["role"] == "decode"
    assert [x["replica"] for x in deployments["model-demo-prefill"]["replicas"]] == [prefill]
    r = justllm(env, "cluster", "status", timeout=120)
    assert r.returncode == 0 and "demo (prefill)" in r.stdout and "demo (decode)" in r.stdout

    # The prefill replica killed: long prompts still complete (whole on the decode replica,
    # or handed over by the replica Ray starts in its place).
    subprocess.run([sys.executable, "-c", KILL, head.address, prefill], env=env, check=True,
                   timeout=120, capture_output=True)
    for i in range(2):
        again = client.completions.create(model="demo", prompt=STORY * 8 + f"Day {i}:",
                                          max_tokens=4, extra_body={"ignore_eos": True})
        assert again.usage.completion_tokens == 4
    total = (counter(url, 'justllm_gateway_pd_transfers_total{model_name="demo"}')
             + counter(url, 'justllm_gateway_pd_fallbacks_total{model_name="demo",'
                            'reason="prefill_failed"}')
             + counter(url, 'justllm_gateway_pd_fallbacks_total{model_name="demo",'
                            'reason="prefill_refused"}'))
    assert total == 4


def test_down_leaves_no_ray_process(deployed):
    url, env, head = deployed
    r = justllm(env, "cluster", "down", timeout=180)
    assert r.returncode == 0, r.stderr
    assert session(head.pid) == []
