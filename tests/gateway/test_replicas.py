"""Replicas behind the gateway, with real runner processes on the demo model: cache-aware
routing keeps each prefix on one replica, a replica killed under load loses no request and
comes back, remote replicas (a real `justllm serve`, an address nobody answers, and an
overloaded one that answers 503) are used, skipped and left, the autoscaler goes from one
replica to two under load and back when idle, a replica it retires while it starts is no
failed restart, and a busy one it retires while its polls go unanswered finishes its stream."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import httpx
import pytest

from tests.gateway.test_gateway import (
    RUNNER_FLAGS,
    Gateway,
    alive,
    start_gateway,
    stop,
    wait_gone,
)
from tests.server.conftest import free_port

FLAGS = {**RUNNER_FLAGS, "threads": 1}  # two replicas share the machine's two cores
PREFIX_A = "The history of the Roman empire is long and full of wars and emperors. " * 40
PREFIX_B = "Photosynthesis converts light into chemical energy inside green plants. " * 40


def replicas(gw: Gateway, model: str) -> dict[str, dict]:
    return {r["replica"]: r for r in gw.status()[model]["replicas"]}


def runner_metric(gw: Gateway, name: str, model: str, replica: str) -> float:
    """A runner's own series, as the gateway's /metrics relays it under ``replica``."""
    want = f'{name}{{model_name="{model}",replica="{replica}"}}'
    for line in httpx.get(gw.url + "/metrics", timeout=30).text.splitlines():
        if line.startswith(want):
            return float(line.split()[-1])
    raise AssertionError(f"{want} not on the gateway's /metrics")


def wait_for(what, check, timeout: float = 60.0):
    deadline = time.monotonic() + timeout
    while True:
        value = check()
        if value:
            return value
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.1)


async def completions(gw: Gateway, bodies: list[dict]) -> list[httpx.Response]:
    async with httpx.AsyncClient(timeout=300) as http:
        return await asyncio.gather(*(http.post(gw.url + "/v1/completions", json=b)
                                      for b in bodies))


def test_prefixes_stay_on_their_replica_and_a_killed_replica_loses_no_request(
        tmp_path, model_path):
    gw = start_gateway(tmp_path, {"demo": {"source": model_path, "replicas": 2,
                                           "preload": True, **FLAGS}})
    try:
        wait_for("two ready replicas", lambda: [r["status"] for r in
                                                replicas(gw, "demo").values()] ==
                 ["ready", "ready"])
        # Two long prefixes, three questions each, asked in pairs: each prefix's questions go
        # to one replica, a different one per prefix, and hit that replica's prefix cache.
        served: dict[str, set[str]] = {"A": set(), "B": set()}
        for i in range(3):
            answers = asyncio.run(completions(gw, [
                {"model": "demo", "prompt": PREFIX_A + f"Question {i}:", "max_tokens": 2},
                {"model": "demo", "prompt": PREFIX_B + f"Question {i}:", "max_tokens": 2}]))
            assert [r.status_code for r in answers] == [200, 200], [r.text for r in answers]
            served["A"].add(answers[0].headers["x-replica"])
            served["B"].add(answers[1].headers["x-replica"])
        assert len(served["A"]) == 1 and len(served["B"]) == 1, served
        assert served["A"] != served["B"], served
        decisions = gw.status()["demo"]["decisions"]
        assert decisions.get("prefix", 0) == 4, decisions  # all but each prefix's first
        for replica in ("0", "1"):
            assert runner_metric(gw, "justllm_prefix_cache_hits_total", "demo", replica) == 2
        text = httpx.get(gw.url + "/metrics", timeout=30).text
        assert 'justllm_gateway_routing_decisions_total{model_name="demo",reason="prefix"} 4' \
            in text
        # A session (X-Session-Id, the OpenAI user field, or its prompt_cache_key) stays on its
        # replica whatever its prompts: a conversation's KV is there.
        for headers, fields in (({"X-Session-Id": "s1"}, {}), ({}, {"user": "u1"}),
                                ({}, {"prompt_cache_key": "k1"})):
            homes = set()
            for word in ("Zebra", "Quartz", "Violin"):
                r = httpx.post(gw.url + "/v1/completions", timeout=120, headers=headers, json={
                    "model": "demo", "prompt": f"{word} facts:", "max_tokens": 1, **fields})
                assert r.status_code == 200, r.text
                homes.add(r.headers["x-replica"])
            assert len(homes) == 1, (headers, fields, homes)
        assert gw.status()["demo"]["decisions"]["session"] == 6
        assert 'justllm_gateway_replica_up{model_name="demo",replica="1",role="both"} 1' in text

        # kill -9 one replica under load: every request still succeeds with all its tokens.
        # (Prompts with nothing in common, so the load spreads over both replicas.)
        words = ["Apple", "Bridge", "Cloud", "Dragon", "Engine", "Forest", "Garden", "Harbor",
                 "Island", "Jungle", "Kettle", "Lantern"]

        async def under_load():
            async with httpx.AsyncClient(timeout=300) as http:
                calls = [asyncio.create_task(http.post(gw.url + "/v1/completions", json={
                    "model": "demo", "prompt": f"{word} story:", "max_tokens": 24,
                    "ignore_eos": True})) for word in words]
                deadline = time.monotonic() + 60
                while not (busy := [r for r in replicas(gw, "demo").values()
                                    if r["in_flight"] >= 2]):
                    assert time.monotonic() < deadline, "the load never reached a replica"
                    await asyncio.sleep(0.05)
                os.kill(busy[0]["pid"], signal.SIGKILL)
                return busy[0], await asyncio.gather(*calls)

        killed, answers = asyncio.run(under_load())
        victim = killed["pid"]
        assert [r.status_code for r in answers] == [200] * 12, [r.text for r in answers]
        assert all(r.json()["usage"]["completion_tokens"] == 24 for r in answers)
        assert {r.headers["x-replica"] for r in answers} <= {"0", "1"}
        back = wait_for("the replica back", lambda: (
            r := replicas(gw, "demo")[killed["replica"]])["status"] == "ready" and r)
        assert back["pid"] != victim and back["restarts"] == 1 and not alive(victim)
        # Back in the rotation: its prefixes were forgotten, new ones reach it again.
        answers = asyncio.run(completions(gw, [
            {"model": "demo", "prompt": f"Fresh prompt {i} " * 20, "max_tokens": 2}
            for i in range(4)]))
        assert {r.headers["x-replica"] for r in answers} == {"0", "1"}

        env = {**os.environ, "JUSTLLM_CACHE_DIR": str(gw.logs.parent)}
        ps = subprocess.run([sys.executable, "-m", "justllm", "ps", "--url", gw.url],
                            capture_output=True, text=True, env=env, timeout=60)
        assert ps.returncode == 0, ps.stderr
        rows = [line.split() for line in ps.stdout.splitlines()[1:] if line.startswith("demo")]
        assert [row[1:3] for row in rows] == [["0", "ready"], ["1", "ready"]], ps.stdout
        log1 = subprocess.run([sys.executable, "-m", "justllm", "logs", "demo", "--replica",
                               "1"], capture_output=True, text=True, env=env, timeout=60)
        assert log1.returncode == 0 and "starting:" in log1.stdout, log1.stderr
        pids = [r["pid"] for r in replicas(gw, "demo").values()]
    finally:
        rc, out = stop(gw)
    assert rc == 0, out
    wait_gone(pids)


class _Overloaded(BaseHTTPRequestHandler):
    """A remote replica that is up (its /metrics answers) but refuses every request with 503,
    as a draining or overloaded `justllm serve` does."""

    posts = 0

    def do_GET(self):  # noqa: N802
        body = b"vllm:num_requests_running 0\nvllm:num_requests_waiting 0\n"
        self.send_response(200)
        self.send_header("content-type", "text/plain")
        self.send_header("content-length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_POST(self):  # noqa: N802
        type(self).posts += 1
        self.rfile.read(int(self.headers["content-length"]))
        body = json.dumps({"error": {"message": "overloaded", "type": "server_error",
                                     "param": None, "code": "overloaded"}}).encode()
        self.send_response(503)
        self.send_header("content-type", "application/json")
        self.send_header("retry-after", "7")
        self.send_header("content-length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass


@pytest.fixture
def overloaded():
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Overloaded)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


def test_remote_replicas_are_used_skipped_when_they_refuse_and_left_when_dead(
        tmp_path, model_path, overloaded):
    port = free_port()
    remote = subprocess.Popen(
        [sys.executable, "-m", "justllm", "serve", model_path, "--port", str(port),
         # another name than the gateway's: the gateway asks it by its own (this was a 404)
         "--served-model-name", "elsewhere", "--max-seqs", "4", "--pool-blocks", "64",
         "--threads", "1", "--api-key", "remote-key"],  # the model's api-key (a 401 without)
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    remote_url = f"http://127.0.0.1:{port}"
    dead_url = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    gw = None
    try:
        wait_for("the remote server", lambda: remote.poll() is None and is_up(remote_url))
        gw = start_gateway(tmp_path, {
            "demo": {"source": model_path, "replicas": 1, "preload": True,
                     "urls": [remote_url, overloaded, dead_url], "routing": "round-robin",
                     "api-key": "remote-key", **FLAGS},
            "busy": {"urls": [overloaded]}, "gone": {"urls": [dead_url]},
            # the same server under another name, with no api-key
            "locked": {"urls": [f"http://localhost:{port}"]}})
        wait_for("the local replica",  # (listed once the preload starts it)
                 lambda: replicas(gw, "demo").get("0", {}).get("status") == "ready")
        served = []
        for i in range(8):
            r = httpx.post(gw.url + "/v1/completions", timeout=120, json={
                "model": "demo", "prompt": f"Count to {i}:", "max_tokens": 3,
                "ignore_eos": True})
            assert r.status_code == 200, r.text
            assert r.json()["usage"]["completion_tokens"] == 3
            served.append(r.headers["x-replica"])
        # Round-robin over four: the local replica and the real remote serve; the one that
        # refused was skipped for another (each time its turn came), the dead one left.
        assert set(served) == {"0", remote_url}, served
        assert _Overloaded.posts >= 2
        status = replicas(gw, "demo")
        assert status[dead_url]["status"] == "unhealthy", status[dead_url]
        assert status[overloaded]["status"] == "ready"
        assert status[remote_url]["status"] == "ready" and status[remote_url]["pid"] is None

        # A model whose only replica refuses: its refusal reaches the client as it was.
        r = httpx.post(gw.url + "/v1/completions", timeout=60, json={
            "model": "busy", "prompt": "Hi", "max_tokens": 2})
        assert r.status_code == 503 and r.headers["retry-after"] == "7", r.text
        assert r.json()["error"]["code"] == "overloaded"
        # A remote replica that asks for a key the model does not give: the gateway's error,
        # not the replica's 401 (the client read that as a wrong key of its own).
        r = httpx.post(gw.url + "/v1/completions", timeout=60, json={
            "model": "locked", "prompt": "Hi", "max_tokens": 2})
        assert r.status_code == 502 and r.json()["error"]["code"] == "replica_unauthorized"
        assert "api-key" in r.json()["error"]["message"]
        # A model whose only replica is down: a 503 at once (it waited load-timeout, 120 s).
        wait_for("the dead replica", lambda: replicas(gw, "gone")[dead_url]["status"]
                 == "unhealthy")
        r = httpx.post(gw.url + "/v1/completions", timeout=60, json={
            "model": "gone", "prompt": "Hi", "max_tokens": 2})
        assert r.status_code == 503 and r.json()["error"]["code"] == "no_healthy_replica"
        assert "did not answer" in r.json()["error"]["message"]  # the reason, given at once
        rc, out = stop(gw)
        gw = None
        assert rc == 0, out
        assert remote.poll() is None  # the gateway never stops a replica it did not start
    finally:
        if gw is not None:
            stop(gw)
        remote.terminate()
        remote.wait(timeout=30)


def is_up(url: str) -> bool:
    try:
        return httpx.get(url + "/health", timeout=2).status_code == 200
    except httpx.TransportError:
        return False


def scale_up_under_load(gw: Gateway, model: str, what: str, wanted: list[tuple[str, str]]
                        ) -> tuple[dict[str, dict], list[int], list[httpx.Response]]:
    """Four long streamed completions, kept running until the replicas' (role, status) are
    ``wanted`` (the autoscaler grew the model), then four short ones; the long ones are closed
    once the short ones are answered (what they would still generate proves nothing more).
    The replicas at that moment, the long ones' statuses and the short ones' answers."""
    async def load() -> tuple[dict[str, dict], list[int], list[httpx.Response]]:
        async with httpx.AsyncClient(timeout=300) as http:
            done = asyncio.Event()

            async def long(i: int) -> int:
                async with http.stream("POST", gw.url + "/v1/completions", json={
                        "model": model, "prompt": f"Story {i}:", "max_tokens": 400,
                        "ignore_eos": True, "stream": True}) as r:
                    async for _ in r.aiter_lines():
                        if done.is_set():
                            break
                    return r.status_code

            calls = [asyncio.create_task(long(i)) for i in range(4)]
            grown = await asyncio.to_thread(wait_for, what, lambda: (
                r := replicas(gw, model)) and [(x["role"], x["status"]) for x in
                                               r.values()] == wanted and r, 120)
            assert not any(c.done() for c in calls)  # the load was still there
            short = await asyncio.gather(*(http.post(gw.url + "/v1/completions", json={
                "model": model, "prompt": f"Tale {i}:", "max_tokens": 8,
                "ignore_eos": True}) for i in range(4)))
            done.set()
            return grown, list(await asyncio.gather(*calls)), list(short)

    return asyncio.run(load())


def test_the_autoscaler_adds_a_replica_under_load_and_removes_it_when_idle(
        tmp_path, model_path):
    gw = start_gateway(tmp_path, {"demo": {
        "source": model_path, "min-replicas": 1, "max-replicas": 2, "target-ongoing": 1,
        "upscale-delay": 0.5, "downscale-delay": 2, **FLAGS}})
    try:
        wait_for("the first replica", lambda: [r["status"] for r in
                                               replicas(gw, "demo").values()] == ["ready"])

        grown, statuses, answers = scale_up_under_load(gw, "demo", "a second replica",
                                                       [("both", "ready")] * 2)
        second = grown["1"]["pid"]
        assert statuses == [200] * 4
        assert [r.status_code for r in answers] == [200] * 4, [r.text for r in answers]
        assert "1" in {r.headers["x-replica"] for r in answers}
        # Idle: back to one replica after the downscale delay; the retired process is gone.
        wait_for("one replica", lambda: list(replicas(gw, "demo")) == ["0"], 60)
        wait_gone([second])
        scale = gw.status()["demo"]["autoscale"]
        assert (scale["up"], scale["down"]) == (1, 1), scale
        text = httpx.get(gw.url + "/metrics", timeout=30).text
        assert 'justllm_autoscaler_decisions_total{model_name="demo",direction="up"} 1' in text
        assert 'justllm_autoscaler_replicas{model_name="demo"} 1' in text
        ps = subprocess.run([sys.executable, "-m", "justllm", "ps", "--url", gw.url],
                            capture_output=True, text=True, timeout=60)
        assert ps.returncode == 0 and ("autoscaler: demo 1-2 replicas, target 1 ongoing each; "
                                       "1 up, 1 down so far") in ps.stdout, ps.stdout
        pids = [r["pid"] for r in replicas(gw, "demo").values()]
    finally:
        rc, out = stop(gw)
    assert rc == 0, out
    assert "autoscaler: model demo up to 2 replicas" in out, out
    wait_gone(pids)


def test_a_replica_retired_while_it_starts_is_stopped_and_counts_no_restart(
        tmp_path, model_path, monkeypatch, caplog):
    """A burst shorter than the runner's start: the autoscaler adds a replica, then retires
    it while it starts (out of the rotation: first to go). Its runner, stopped, was read as a
    failed start: counted in the model's restarts and logged "restart 1 failed: runner killed
    by signal 15; restarting", though nothing had died or was restarted. (The supervisor
    alone, with a real runner process that the test keeps from being ready.)"""
    from justllm.gateway.config import Flags, load_config
    from justllm.gateway.runner import RunnerProcess
    from justllm.gateway.supervisor import Supervisor

    async def never_ready(self: RunnerProcess, http: httpx.AsyncClient, timeout: float) -> None:
        while self.alive():
            await asyncio.sleep(0.05)
        raise RuntimeError(self.killed_by() or self.last_error())

    monkeypatch.setattr(RunnerProcess, "wait_ready", never_ready)

    async def main() -> list[int]:
        config = load_config({"models": {"a": {"source": model_path, "min-replicas": 1,
                                               "max-replicas": 2, **FLAGS}}},
                             Flags(frozenset(FLAGS)))
        sup = Supervisor(config, tmp_path / "logs", drain=1)
        a = sup.models["a"]
        a.status = "loaded"
        replica = sup._new_replica(a, "both")  # what a scale up does
        sup._restart(a, replica)
        while replica.runner is None or not replica.runner.alive():
            await asyncio.sleep(0.05)
        pid = replica.runner.pid
        sup._retire(a, replica)  # a scale down
        while not all(t.done() for t in sup._tasks):
            await asyncio.sleep(0.05)
        assert replica not in a.replicas
        assert (a.restarts, replica.restarts, dict(a.replica_restarts)) == (0, 0, {})
        await sup.close()
        return [pid]

    with caplog.at_level("WARNING", logger="justllm.gateway.supervisor"):
        pids = asyncio.run(main())
    wait_gone(pids)
    assert "restart" not in caplog.text, caplog.text


def test_a_busy_replica_retired_while_its_polls_go_unanswered_finishes_its_stream(
        tmp_path, model_path):
    """A runner that answers no poll for a moment (SIGSTOP here; a busy one may) is unhealthy,
    and a scale down retires such a replica first: it was stopped at once and its stream cut
    ("the server is shutting down"), the idle replica kept. Now its stream runs to the end.
    Each step waits for the state the previous one leads to."""
    gw = start_gateway(tmp_path, {"demo": {
        "source": model_path, "min-replicas": 1, "max-replicas": 2, "target-ongoing": 2,
        "upscale-delay": 0.5, "downscale-delay": 0.5, "routing": "least-load", **FLAGS}},
        **{"health-timeout": 300})
    pids: list[int] = []

    async def scenario() -> tuple[list[str], str]:
        async with httpx.AsyncClient(timeout=300) as http:
            leave = asyncio.Event()

            async def stream(prompt: str, tokens: int) -> tuple[list[str], str]:
                body = {"model": "demo", "prompt": prompt, "max_tokens": tokens,
                        "ignore_eos": True, "stream": True, "logprobs": 1}
                async with http.stream("POST", gw.url + "/v1/completions", json=body) as r:
                    lines = []
                    async for line in r.aiter_lines():
                        if line.startswith("data: "):
                            lines.append(line)
                        if leave.is_set() and tokens > 300:
                            break
                    return lines, r.headers["x-replica"]

            busy = [asyncio.create_task(stream(f"Story {i}:", 400)) for i in range(3)]
            await asyncio.to_thread(wait_for, "a second replica", lambda: [
                r["status"] for r in replicas(gw, "demo").values()] == ["ready", "ready"], 120)
            alone = asyncio.create_task(stream("Zebra crossing lights", 200))
            await asyncio.to_thread(wait_for, "the stream on replica 1", lambda: replicas(
                gw, "demo")["1"]["in_flight"] == 1)
            pid = replicas(gw, "demo")["1"]["pid"]
            pids.extend(r["pid"] for r in replicas(gw, "demo").values())
            os.kill(pid, signal.SIGSTOP)
            try:
                await asyncio.to_thread(wait_for, "replica 1 unhealthy", lambda: replicas(
                    gw, "demo")["1"]["status"] == "unhealthy")
                leave.set()  # the load falls to the one stream: one replica is enough
                await asyncio.gather(*busy)
                await asyncio.to_thread(wait_for, "replica 1 retired", lambda: replicas(
                    gw, "demo").get("1", {}).get("status") != "unhealthy")
            finally:
                os.kill(pid, signal.SIGCONT)
            return await alone

    try:
        wait_for("the first replica", lambda: [r["status"] for r in
                                               replicas(gw, "demo").values()] == ["ready"])
        lines, served_by = asyncio.run(scenario())
        assert served_by == "1"
        assert lines[-1] == "data: [DONE]" and "error" not in lines[-2], lines[-3:]
        assert json.loads(lines[-2][6:])["choices"][0]["finish_reason"] == "length"
        # every token reached the client (counted by the tokens each chunk carries: a chunk
        # may carry two, as after the runner's SIGCONT; counting chunks as tokens was flaky)
        assert sum(len(json.loads(line[6:])["choices"][0]["logprobs"]["tokens"])
                   for line in lines[:-1]) == 200
        wait_for("replica 0 alone", lambda: list(replicas(gw, "demo")) == ["0"])
    finally:
        rc, out = stop(gw)
    assert rc == 0, out
    wait_gone(pids)
