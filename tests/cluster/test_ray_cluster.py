"""`justllm cluster` on a real local Ray (2 CPUs), started by `justllm cluster deploy` itself
and stopped by `justllm cluster down`: the demo model with 2 replicas, the openai client
streaming through the ingress, a shared prefix kept on one replica, a replica's actor killed
under load (no request lost, Ray brings it back); then the app redeployed in place as a PD
model (one prefill and one decode replica: the KV goes from one to the other through Ray's
object store, the prefill replica killed costs no request); and nothing of Ray left after
`down`.

The deploy and down run as processes of their own, as a user runs them: the app outlives the
command that deployed it. Ray's temp directory and justllm's record of the head are private to
this module, so a Ray someone else runs on the machine is neither used nor touched. About three
minutes on 2 busy cores, most of it Ray starting and stopping (marked ``ray``:
``pytest -m 'not ray'`` skips it).
"""

from __future__ import annotations

import asyncio
import json
import os
import secrets
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import anthropic
import httpx
import openai
import pytest

from justllm.cluster.local_ray import LocalHead, stop_head
from justllm.gateway.runner import free_port
from tests.lora_files import write_adapter

pytestmark = [pytest.mark.ray, pytest.mark.timeout(600)]

PREFIX_A = "The history of the Roman empire is long and full of wars and emperors. " * 40
PREFIX_B = "Photosynthesis converts light into chemical energy inside green plants. " * 40
KILLER = """
import sys, ray
ray.init(address=sys.argv[1], logging_level="ERROR", log_to_driver=False)
actor = ray.get_actor("SERVE_REPLICA::justllm#model-demo#" + sys.argv[2], namespace="serve")
print("ready", flush=True)
sys.stdin.readline()
ray.kill(actor, no_restart=True)
print("killed", flush=True)
ray.shutdown()
"""


INGRESS_KILLER = """
import sys, ray
ray.init(address=sys.argv[1], logging_level="ERROR", log_to_driver=False)
(name,) = [a["name"] for a in ray.util.list_named_actors(all_namespaces=True)
           if a["name"].startswith("SERVE_REPLICA::justllm#ingress#")]
ray.kill(ray.get_actor(name, namespace="serve"), no_restart=True)
ray.shutdown()
"""

STORY = "Once upon a time there was a lighthouse keeper who counted the waves every night. "
PD_KILLER = """
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


@dataclass
class Deployed:
    url: str
    env: dict[str, str]
    head: LocalHead
    ray_tmp: str
    record: Path

    @property
    def driver_env(self) -> dict[str, str]:
        """For a script's ray.init(address=...): Ray sends the auth token only when told."""
        return {**self.env, "RAY_AUTH_MODE": "token"}


def justllm(env: dict[str, str], *args: str, timeout: float = 300
            ) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "justllm", *args], env=env,
                          capture_output=True, text=True, timeout=timeout)


def session(pid: int) -> list[str]:
    """`ps` lines of the processes in ``pid``'s session: the head's Ray processes (but a
    zombie: it has ended, and waits for init to reap it)."""
    out = subprocess.run(["ps", "-eo", "pid=,sid=,stat=,args="], capture_output=True,
                         text=True)
    return [line for line in out.stdout.splitlines()
            if len(line.split()) > 2 and line.split()[1] == str(pid)
            and not line.split()[2].startswith("Z")]


def metric(url: str, name: str) -> dict[str, float]:
    """``name``'s value per replica on the ingress's /metrics."""
    found = {}
    for line in httpx.get(url + "/metrics", timeout=30).text.splitlines():
        if line.startswith(name + "{") and 'replica="' in line:
            replica = line.split('replica="', 1)[1].split('"', 1)[0]
            found[replica] = float(line.rsplit(" ", 1)[1])
    return found


def settled(url: str, name: str) -> dict[str, float] | None:
    """``name`` per replica once both replicas report it and it holds still for two of the
    replicas' report periods: the board's page may be up to a second old, so an earlier test's
    last hits could otherwise land after this read (the test this serves flaked so)."""
    first = metric(url, name)
    time.sleep(2.5)
    return first if len(first) == 2 and metric(url, name) == first else None


def wait_for(what: str, check, timeout: float = 60.0):
    deadline = time.monotonic() + timeout
    while not (value := check()):
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.5)
    return value


@pytest.fixture(scope="module")
def deployed(tmp_path_factory, model_path) -> Iterator[Deployed]:
    ray_tmp = tempfile.mkdtemp(prefix="jlray-", dir="/tmp")  # short: Ray's socket paths
    cache = tmp_path_factory.mktemp("cluster-cache")
    # Ray's token auth, on as `ray start --head` turns it on wherever a token is (any plain
    # ray.init() writes ~/.ray/auth_token): justllm reached its own head without the token.
    token = cache / "ray-auth-token"
    token.write_text(secrets.token_hex(32))
    env = {**os.environ, "RAY_TMPDIR": ray_tmp, "JUSTLLM_CACHE_DIR": str(cache),
           "RAY_AUTH_TOKEN_PATH": str(token)}
    for unset in ("RAY_ADDRESS", "RAY_AUTH_MODE", "RAY_AUTH_TOKEN"):
        env.pop(unset, None)
    cfg = tmp_path_factory.mktemp("cluster") / "cluster.yaml"
    cfg.write_text(f"models:\n  demo:\n    source: {model_path}\n    replicas: 2\n"
                   "    threads: 1\n    max-seqs: 8\n    pool-blocks: 256\n"
                   "    aliases: [gpt-4o-mini]\n    enable-lora-runtime: true\n")
    port = free_port()
    record = cache / "cluster" / "local-ray.json"
    head: LocalHead | None = None
    try:
        r = justllm(env, "cluster", "deploy", str(cfg), "--port", str(port))
        if record.exists():
            head = LocalHead(**json.loads(record.read_text()))
        assert r.returncode == 0, r.stderr[-3000:]
        assert head is not None and "runs on the Ray cluster" in r.stderr
        yield Deployed(f"http://127.0.0.1:{port}", env, head, ray_tmp, record)
    finally:
        if record.exists():
            justllm(env, "cluster", "down", timeout=180)
        if head is not None and session(head.pid):
            stop_head(head, grace=10)  # what down did not stop: by pid, then its session
        shutil.rmtree(ray_tmp, ignore_errors=True)


def test_the_openai_client_streams_through_the_ingress(deployed):
    client = openai.OpenAI(base_url=deployed.url + "/v1", api_key="unused", max_retries=0)
    assert [m.id for m in client.models.list()] == ["demo"]
    stream = client.chat.completions.create(  # (greedy: a sampled reply may end at once)
        model="demo", messages=[{"role": "user", "content": "Tell me about the sea."}],
        max_tokens=8, stream=True, temperature=0)
    chunks = list(stream)
    assert len(chunks) >= 4 and chunks[-1].choices[0].finish_reason in ("length", "stop")
    assert "".join(c.choices[0].delta.content or "" for c in chunks).strip()
    plain = client.completions.create(model="gpt-4o-mini", prompt="Once upon a time",
                                      max_tokens=4,  # an alias; sampled, so it may end early:
                                      extra_body={"ignore_eos": True})  # the test counts 4
    assert plain.model == "demo" and plain.usage is not None
    assert plain.usage.completion_tokens == 4
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="nope", prompt="x", max_tokens=1)
    assert httpx.get(deployed.url + "/health", timeout=30).status_code == 200
    # One X-Request-Id on the answer, the client's (Ray's proxy and the ingress each added
    # one: "trace-9, trace-9"), and one made for a request without it.
    for sent in ({"X-Request-Id": "trace-9"}, {}):
        r = httpx.post(deployed.url + "/v1/completions", headers=sent, timeout=60,
                       json={"model": "demo", "prompt": "x", "max_tokens": 1})
        ids = r.headers.get_list("x-request-id")
        assert r.status_code == 200 and len(ids) == 1, ids
        assert ids[0] == sent.get("X-Request-Id", ids[0]) and "," not in ids[0]


def test_clients_leaving_mid_stream_leave_no_error_in_the_ingress_log(deployed):
    """Ray Serve's receive raised TaskCancelledError for a client that left, which escaped the
    ingress's app after the response had started: an ERROR traceback in its log for some
    ordinary disconnects (2 in 18 here)."""
    async def leave(i: int) -> None:
        async with httpx.AsyncClient(timeout=60) as http:
            async with http.stream("POST", deployed.url + "/v1/completions", json={
                    "model": "demo", "prompt": f"Count to a hundred, {i}:", "max_tokens": 200,
                    "ignore_eos": True, "stream": True}) as r:
                seen = 0
                async for line in r.aiter_lines():
                    seen += line.startswith("data: ")
                    if seen > i % 5:
                        break  # the client goes away after a few events

    async def leaving() -> None:
        for wave in range(3):
            await asyncio.gather(*(leave(wave * 6 + i) for i in range(6)))
    asyncio.run(leaving())
    time.sleep(2)
    logs = [f for f in Path(deployed.ray_tmp).glob("ray/session_*/logs/**/*")
            if f.is_file() and f.suffix in (".err", ".log")]
    assert any(f.name.startswith("worker-") for f in logs)  # (where the ingress's stderr goes)
    found = [f.read_text(errors="replace")[-3000:] for f in logs
             if b"Exception caught after response started" in f.read_bytes()]
    assert found == [], found[0]


def test_anthropic_and_responses_clients_work_through_the_ingress(deployed):
    """The cluster answered /v1/messages and /v1/responses with a 404."""
    claude = anthropic.Anthropic(base_url=deployed.url, api_key="unused", max_retries=0)
    with claude.messages.stream(model="demo", max_tokens=5, messages=[
            {"role": "user", "content": "Tell me about the sea."}]) as stream:
        message = stream.get_final_message()
    assert message.usage.output_tokens <= 5 and message.stop_reason in ("max_tokens",
                                                                        "end_turn")
    with pytest.raises(anthropic.NotFoundError):
        claude.messages.create(model="nope", max_tokens=1,
                               messages=[{"role": "user", "content": "x"}])
    client = openai.OpenAI(base_url=deployed.url + "/v1", api_key="unused", max_retries=0)
    answer = client.responses.create(model="gpt-4o-mini", input="Once upon a time",
                                     max_output_tokens=4)
    assert answer.status in ("completed", "incomplete") and answer.usage.output_tokens <= 4


def test_requests_sharing_a_prefix_go_to_the_same_replica(deployed):
    url = deployed.url
    hits = "justllm_prefix_cache_hits_total"
    before = wait_for("both replicas' hits on /metrics, settled", lambda: settled(url, hits))

    async def pairs() -> dict[str, set[str]]:
        served: dict[str, set[str]] = {"A": set(), "B": set()}
        async with httpx.AsyncClient(timeout=120) as http:
            for i in range(3):
                a, b = await asyncio.gather(*(http.post(url + "/v1/completions", json={
                    "model": "demo", "prompt": prefix + f"Question {i}:", "max_tokens": 2})
                    for prefix in (PREFIX_A, PREFIX_B)))
                assert (a.status_code, b.status_code) == (200, 200), (a.text, b.text)
                served["A"].add(a.headers["x-replica"])
                served["B"].add(b.headers["x-replica"])
        return served

    served = asyncio.run(pairs())
    assert len(served["A"]) == 1 and len(served["B"]) == 1 and served["A"] != served["B"]
    # Each replica's prefix cache was hit by its prefix's 2nd and 3rd questions (the stats
    # board holds each replica's page of at most a second ago).
    wait_for("the hits on /metrics", lambda: {
        r: n - before[r] for r, n in metric(url, hits).items()} == {
        next(iter(served["A"])): 2, next(iter(served["B"])): 2}, timeout=15)
    r = justllm(deployed.env, "cluster", "status", "--json", timeout=120)
    assert r.returncode == 0, r.stderr
    (model,) = json.loads(r.stdout)["models"]
    assert model["model"] == "demo" and model["status"] == "HEALTHY"
    assert {x["replica"] for x in model["replicas"]} == served["A"] | served["B"]
    assert all(x["healthy"] and x["node_id"] and x["hit_ratio"] for x in model["replicas"])


def test_a_killed_replica_loses_no_request_and_ray_brings_it_back(deployed):
    url = deployed.url
    replicas = wait_for("two replicas up", lambda: (
        m := metric(url, "justllm_gateway_replica_up")) and sum(m.values()) == 2 and m)
    victim = sorted(replicas)[0]
    killer = subprocess.Popen([sys.executable, "-c", KILLER, deployed.head.address, victim],
                              env=deployed.driver_env, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                              text=True)
    try:
        assert killer.stdout is not None and killer.stdin is not None
        assert killer.stdout.readline().strip() == "ready"
        words = ["Apple", "Bridge", "Cloud", "Dragon", "Engine", "Forest", "Garden", "Harbor",
                 "Island", "Jungle"]

        async def under_load() -> list[httpx.Response]:
            async with httpx.AsyncClient(timeout=300) as http:
                calls = [asyncio.create_task(http.post(url + "/v1/completions", json={
                    "model": "demo", "prompt": f"A story about the {word}:", "max_tokens": 48,
                    "ignore_eos": True})) for word in words]
                await asyncio.sleep(1.0)
                killer.stdin.write("kill\n")  # type: ignore[union-attr]
                killer.stdin.flush()  # type: ignore[union-attr]
                await asyncio.to_thread(killer.stdout.readline)  # type: ignore[union-attr]
                return await asyncio.gather(*calls)

        answers = asyncio.run(under_load())
    finally:
        killer.kill()
        killer.wait(timeout=30)
    assert [a.status_code for a in answers] == [200] * len(answers), \
        [a.text for a in answers if a.status_code != 200]
    assert all(a.json()["usage"]["completion_tokens"] == 48 for a in answers)
    assert victim not in {a.headers["x-replica"] for a in answers}
    back = wait_for("Ray to replace the killed replica", lambda: (
        m := metric(url, "justllm_gateway_replica_up")) and sum(m.values()) == 2 and
        victim not in m and m, timeout=120)
    assert len(back) == 2
    r = httpx.post(url + "/v1/completions", json={"model": "demo", "prompt": "After:",
                                                  "max_tokens": 2}, timeout=120)
    assert r.status_code == 200


def held_adapters(env: dict[str, str]) -> dict[str, list[str]]:
    """replica -> the LoRA adapters it holds, from `justllm cluster status --json`."""
    r = justllm(env, "cluster", "status", "--json", timeout=120)
    assert r.returncode == 0, r.stderr
    (model,) = json.loads(r.stdout)["models"]
    return {x["replica"]: x["adapters"] for x in model["replicas"]}


def test_a_lora_adapter_loaded_at_run_time_is_multiplexed_onto_the_replicas(deployed, tmp_path):
    """vLLM's load/unload routes on the ingress: one replica checks the file, requests naming
    the adapter are served under it by whichever replica holds it, a load in place
    changes the answers, an unload ends the name and the replicas drop it; a bad file is a 400
    and harms nothing."""
    url, env = deployed.url, deployed.env
    client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)

    def answer(model: str) -> float:
        """The logprob of the first token (the same token under the base model and both
        adapters here): an adapter moves it by 0.1 to 0.4, while a prompt computed whole or
        taken from the prefix cache differs by 0.03 at most under these random adapters."""
        r = client.completions.create(model=model, prompt=STORY, max_tokens=1, temperature=0,
                                      logprobs=1, extra_body={"ignore_eos": True})
        return r.choices[0].logprobs.token_logprobs[0]

    def load(name: str, path: Path, **extra) -> httpx.Response:
        return httpx.post(url + "/v1/load_lora_adapter", timeout=120,
                          json={"lora_name": name, "lora_path": str(path), **extra})

    base = answer("demo")
    assert load("keeper", write_adapter(tmp_path / "a.gguf", seed=11)).status_code == 200
    tuned = [answer("keeper") for _ in range(4)]  # the same from any replica that holds it
    assert all(abs(t - base) > 0.08 for t in tuned), (base, tuned)
    assert max(tuned) - min(tuned) < 0.05, tuned
    by_field = client.completions.create(  # llama-server's lora field names it too
        model="demo", prompt=STORY, max_tokens=1, temperature=0, logprobs=1,
        extra_body={"ignore_eos": True, "lora": [{"name": "keeper"}]})
    assert abs(by_field.choices[0].logprobs.token_logprobs[0] - tuned[0]) < 0.05
    cards = {m["id"]: m.get("parent") for m in client.models.list().model_dump()["data"]}
    assert cards["keeper"] == "demo"
    wait_for("the adapter on the status", lambda: "keeper" in sum(
        held_adapters(env).values(), []), 30)

    bad = tmp_path / "bad.gguf"
    write_adapter(bad, seed=3, n_embd=512)  # not for this model
    r = load("broken", bad)
    assert r.status_code == 400 and r.json()["error"]["param"] == "lora_path"
    assert httpx.post(url + "/v1/completions", json={"model": "broken", "prompt": "x"},
                      timeout=60).status_code == 404

    again = load("keeper", write_adapter(tmp_path / "b.gguf", seed=12), load_inplace=True)
    assert again.status_code == 200
    replaced = answer("keeper")
    # (> 0.08 as above: the noise is 0.03 at most; how far an adapter moves it depends on the
    # CPU's kernels, 0.14 on one machine where 0.2 had been asked)
    assert abs(replaced - tuned[0]) > 0.08 and abs(replaced - base) > 0.08, (base, tuned,
                                                                             replaced)
    assert answer("demo") == base  # the base model is untouched by any of it
    # The ingress dies and Serve starts another: it takes the registry back from the board
    # (a restarted ingress forgot every adapter, while the replicas kept them)
    done = subprocess.run([sys.executable, "-c", INGRESS_KILLER, deployed.head.address],
                          env=deployed.driver_env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]

    def keeper_listed() -> bool:
        try:
            models = httpx.get(url + "/v1/models", timeout=5).json()["data"]
        except (httpx.HTTPError, ValueError, KeyError):
            return False
        return "keeper" in {m["id"] for m in models}

    wait_for("the new ingress to list the adapter", keeper_listed, 90)
    assert abs(answer("keeper") - replaced) < 0.05

    r = httpx.post(url + "/v1/unload_lora_adapter", json={"lora_name": "keeper"}, timeout=60)
    assert r.status_code == 200
    gone = httpx.post(url + "/v1/completions", json={"model": "keeper", "prompt": "x",
                                                     "max_tokens": 1}, timeout=60)
    assert gone.status_code == 404 and gone.json()["error"]["code"] == "model_not_found"
    wait_for("the replicas to drop the adapter", lambda: not any(
        held_adapters(env).values()), 60)


def test_a_pd_model_hands_the_kv_from_prefill_to_decode_through_ray(deployed, tmp_path,
                                                                     model_path):
    """The app redeployed in place as a PD model: one prefill and one decode replica."""
    url, env, head = deployed.url, deployed.env, deployed.head
    cfg = tmp_path / "pd.yaml"
    cfg.write_text(f"models:\n  demo:\n    source: {model_path}\n    prefill-replicas: 1\n"
                   "    decode-replicas: 1\n    threads: 1\n    max-seqs: 4\n"
                   "    pool-blocks: 256\n")
    r = justllm(env, "cluster", "deploy", str(cfg), "--port", url.rsplit(":", 1)[1])
    assert r.returncode == 0, r.stderr[-3000:]
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
    # prefill replica, two imports on the decode replica, each a prefix-cache hit there; the
    # prefill replica drew each answer's first token.
    wait_for("the hand-overs on the replicas' pages", lambda: (
        metric(url, "justllm_pd_exports_total").get(prefill) == 2
        and metric(url, "vllm:generation_tokens_total").get(prefill) == 2
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
    subprocess.run([sys.executable, "-c", PD_KILLER, head.address, prefill],
                   env=deployed.driver_env, check=True,
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


def test_the_app_redeployed_under_a_route_prefix_answers_there_alone(deployed, tmp_path,
                                                                      model_path):
    """--route-prefix: the app's routes begin there on Ray Serve's proxies (each app of a
    shared cluster under its own prefix); the ingress reads the path below it."""
    url, env = deployed.url, deployed.env
    cfg = tmp_path / "one.yaml"
    cfg.write_text(f"models:\n  demo:\n    source: {model_path}\n    threads: 1\n"
                   "    max-seqs: 4\n    pool-blocks: 64\n")
    r = justllm(env, "cluster", "deploy", str(cfg), "--port", url.rsplit(":", 1)[1],
                "--route-prefix", "/team/a")
    assert r.returncode == 0, r.stderr[-3000:]
    assert f"OpenAI API at {url}/team/a/v1" in r.stderr, r.stderr
    client = openai.OpenAI(base_url=url + "/team/a/v1", api_key="unused", max_retries=0)
    answer = client.completions.create(model="demo", prompt="The sea was", max_tokens=3,
                                       extra_body={"ignore_eos": True})
    assert answer.usage.completion_tokens == 3
    assert [m.id for m in client.models.list()] == ["demo"]
    assert httpx.get(url + "/team/a/health", timeout=30).status_code == 200
    assert "vllm:num_requests_running" in httpx.get(url + "/team/a/metrics", timeout=30).text
    assert httpx.get(url + "/v1/models", timeout=30).status_code == 404  # not under "/" now
    r = justllm(env, "cluster", "status", "--json", timeout=120)
    assert r.returncode == 0 and json.loads(r.stdout)["url"] == url + "/team/a", r.stdout
    r = justllm(env, "cluster", "deploy", str(cfg), "--route-prefix", "team")
    assert r.returncode == 1 and "--route-prefix must be" in r.stderr, r.stderr
    assert len(r.stderr.strip().splitlines()) == 1


OTHER_APP = """
import ray
from ray import serve

@serve.deployment(num_replicas=1, ray_actor_options={"num_cpus": 0})
class Hello:
    async def __call__(self, request):
        return "hello"

ray.init(address="%s", logging_level="ERROR", log_to_driver=False)
serve.run(Hello.bind(), name="other", route_prefix="/other")
"""


def test_status_of_an_app_that_is_not_justllms_is_one_line(deployed):
    """`cluster status --name other` on another Serve app was a KeyError traceback."""
    env = deployed.env
    done = subprocess.run([sys.executable, "-c", OTHER_APP % deployed.head.address],
                          env=deployed.driver_env,
                          capture_output=True, text=True, timeout=180)
    assert done.returncode == 0, done.stderr[-2000:]
    try:
        r = justllm(env, "cluster", "status", "--name", "other", timeout=120)
        assert r.returncode == 1 and "Traceback" not in r.stderr, r.stderr
        assert r.stderr.strip() == (f"error: 'other' on the Ray cluster at "
                                    f"{deployed.head.address} is not an app justllm deployed "
                                    "(it has no stats board)"), r.stderr
    finally:
        subprocess.run([sys.executable, "-c",
                        f"import ray; from ray import serve; ray.init(address="
                        f"'{deployed.head.address}', logging_level='ERROR'); "
                        "serve.delete('other')"], env=deployed.driver_env,
                   capture_output=True, timeout=180)


def test_down_deletes_the_app_and_leaves_no_ray_process(deployed):
    assert session(deployed.head.pid), "the head should run until down"
    r = justllm(deployed.env, "cluster", "down", timeout=180)
    assert r.returncode == 0, r.stderr
    assert "deleted the app 'justllm'" in r.stderr and "stopped the local Ray head" in r.stderr
    assert not deployed.record.exists()
    assert session(deployed.head.pid) == []
    ps = subprocess.run(["ps", "-eo", "args="], capture_output=True, text=True).stdout
    assert deployed.ray_tmp not in ps and deployed.head.address.split(":")[1] not in ps
    r = justllm(deployed.env, "cluster", "status", timeout=120)
    assert r.returncode == 1 and "nothing deployed" in r.stderr
