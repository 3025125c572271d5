"""Router mode with real runner processes on the demo model (two names for one GGUF, plus a
corrupt file): loading on demand, aliases, swaps under max-loaded, keep_alive, ttl, a runner
killed mid-request, a model that cannot load, and no process left behind however the gateway
ends."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO

import httpx
import pytest

from tests.helpers import logged_text, start_logged
from tests.server.conftest import free_port

RUNNER_FLAGS = {"max-seqs": 4, "pool-blocks": 64, "threads": 2}


@dataclass
class Gateway:
    proc: subprocess.Popen
    url: str
    logs: Path
    log: IO[bytes] = field(repr=False)

    def output(self) -> str:
        """What the gateway process itself has printed, stdout and stderr."""
        return logged_text(self.log)

    def status(self) -> dict[str, dict]:
        return {m["model"]: m for m in httpx.get(self.url + "/models", timeout=30).json()["data"]}

    def runner_pids(self) -> list[int]:
        return [m["pid"] for m in self.status().values() if m["pid"]]

    def wait_status(self, model: str, status: str, timeout: float = 60) -> dict:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            m = self.status()[model]
            if m["status"] == status:
                return m
            time.sleep(0.1)
        raise AssertionError(f"{model} never became {status}: {self.status()[model]}")


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A zombie (exited, not yet reaped by its parent) counts as gone.
    try:
        return Path(f"/proc/{pid}/status").read_text().find("State:\tZ") < 0
    except OSError:
        return False


def wait_gone(pids: list[int], timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    while any(alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not [p for p in pids if alive(p)], "runner processes left behind"


def live_children(pid: int) -> list[int]:
    """The processes ``pid`` started that are still running (its runners)."""
    found: list[int] = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        with contextlib.suppress(OSError):
            found += [int(p) for p in (task / "children").read_text().split()]
    return [p for p in found if alive(p)]


def kill_left(gw: Gateway, pids: list[int]) -> None:
    """A test that stops the gateway itself cleans up after a failure: runners, gateway."""
    for pid in pids:
        if alive(pid):
            os.kill(pid, signal.SIGKILL)
    if gw.proc.poll() is None:
        gw.proc.kill()


def runner_key(pid: int) -> str:
    """The key a runner asks its clients for (the gateway's, in the runner's environment)."""
    environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    return next(e.split(b"=", 1)[1].decode() for e in environ
                if e.startswith(b"JUSTLLM_API_KEY="))


def start_gateway(tmp_path: Path, models: dict, env: dict | None = None,
                  shutdown_timeout: float = 2, **top) -> Gateway:
    config = tmp_path / "models.yaml"
    config.write_text(json.dumps({**top, "models": models}))  # JSON is YAML
    port = free_port()
    cache = tmp_path / "cache"
    proc, log = start_logged(
        [sys.executable, "-m", "justllm", "serve", "--models", str(config), "--port", str(port),
         "--shutdown-timeout", str(shutdown_timeout)],
        {**os.environ, "JUSTLLM_CACHE_DIR": str(cache), **(env or {})})
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        assert proc.poll() is None, logged_text(log)
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return Gateway(proc, url, cache / "logs", log)
        except httpx.TransportError:
            pass
        time.sleep(0.05)
    proc.kill()
    raise RuntimeError("the gateway did not start")


def stop(gw: Gateway, sig: int = signal.SIGTERM) -> tuple[int, str]:
    pids = gw.runner_pids() if gw.proc.poll() is None else []
    if gw.proc.poll() is None:
        gw.proc.send_signal(sig)
    try:
        rc = gw.proc.wait(timeout=60)
    except subprocess.TimeoutExpired:
        gw.proc.kill()
        rc = -9
    wait_gone(pids)
    out = gw.output()
    # pytest shows a test's captured output only when it fails: then the gateway's own log and
    # the end of each runner's say what it was doing.
    print(f"--- gateway (exit {rc}):\n{out}")
    for path in sorted(gw.logs.glob("*.log")) if gw.logs.is_dir() else []:
        tail = path.read_text(errors="replace").splitlines()[-15:]
        print(f"--- {path.name} (last lines):", *tail, sep="\n")
    return rc, out


def complete(gw: Gateway, model: str, **extra) -> httpx.Response:
    return httpx.post(gw.url + "/v1/completions", json={
        "model": model, "prompt": "The capital of France is", "max_tokens": 4,
        "temperature": 0, **extra}, timeout=120)


@pytest.fixture
def models(model_path, tmp_path):
    corrupt = tmp_path / "corrupt.gguf"
    corrupt.write_bytes(Path(model_path).read_bytes()[:1_000_000])  # truncated
    return {
        "alpha": {"source": model_path, "aliases": ["gpt-4o-mini"], **RUNNER_FLAGS},
        "beta": {"source": model_path, "ttl": 2, **RUNNER_FLAGS},
        "broken": {"source": str(corrupt), **RUNNER_FLAGS},
    }


def test_one_model_at_a_time_swaps_keep_alive_ttl_and_a_broken_model(tmp_path, models):
    gw = start_gateway(tmp_path, models, **{"max-loaded": 1})
    try:
        listed = httpx.get(gw.url + "/v1/models", timeout=30).json()["data"]
        assert {m["id"]: m["status"] for m in listed} == {
            "alpha": "unloaded", "beta": "unloaded", "broken": "unloaded"}
        one = httpx.get(gw.url + "/v1/models/beta", timeout=30)  # the SDK's models.retrieve
        assert one.status_code == 200 and one.json()["id"] == "beta"
        assert httpx.get(gw.url + "/v1/models/gamma", timeout=30).status_code == 404
        assert gw.runner_pids() == []

        # Requests for both models at once, with room for one: every one succeeds, the
        # models taking turns (LRU swap), streaming included.
        async def burst():
            async with httpx.AsyncClient(timeout=300) as http:
                async def one(model, stream):
                    r = await http.post(gw.url + "/v1/completions", json={
                        "model": model, "prompt": f"Count for {model}:", "max_tokens": 6,
                        "ignore_eos": True, "stream": stream})
                    return r.status_code, r.text
                return await asyncio.gather(*(one(m, i % 2 == 0) for i, m in
                                              enumerate(["alpha", "beta"] * 3)))

        results = asyncio.run(burst())
        assert all(code == 200 for code, _ in results), results
        streamed = [text for code, text in results[::2]]
        assert all(t.rstrip().endswith("data: [DONE]") for t in streamed), streamed
        status = gw.status()
        assert status["alpha"]["loads"] >= 1 and status["beta"]["loads"] >= 1
        assert sum(m["status"] == "loaded" for m in status.values()) <= 1

        # An alias reaches its model, whose name the answer carries.
        r = complete(gw, "gpt-4o-mini")
        assert r.status_code == 200 and r.json()["model"] == "alpha"
        for route in ("/props", "/slots"):  # by query: the runner is asked by its own name
            r = httpx.get(gw.url + route, params={"model": "gpt-4o-mini"}, timeout=60)
            assert r.status_code == 200, (route, r.text)
        assert gw.status()["alpha"]["status"] == "loaded"

        # An unloaded model's place is free once its runner has exited: a request for beta
        # made while alpha's runner drains a stream waits for it (it used to start beside).
        counts: list[int] = []
        watched = threading.Event()

        def watch() -> None:
            while not watched.is_set():
                counts.append(len(live_children(gw.proc.pid)))
                time.sleep(0.02)
        watcher = threading.Thread(target=watch)
        watcher.start()
        try:
            with httpx.stream("POST", gw.url + "/v1/completions", timeout=120, json={
                    "model": "alpha", "prompt": "Count:", "max_tokens": 400,
                    "ignore_eos": True, "stream": True}) as stream:
                lines = stream.iter_lines()
                next(line for line in lines if line.startswith("data: "))
                unload = threading.Thread(target=httpx.post, args=(gw.url + "/models/unload",),
                                          kwargs={"json": {"model": "alpha"}, "timeout": 60})
                unload.start()
                gw.wait_status("alpha", "unloaded", timeout=10)  # at once; its runner drains
                r = complete(gw, "beta")
                for _ in lines:
                    pass
            unload.join()
        finally:
            watched.set()
            watcher.join()
        assert r.status_code == 200, r.text
        assert max(counts) == 1, f"two runners alive at once under max-loaded 1: {counts}"

        # keep_alive 0 (Ollama's): unloaded as soon as the request is done. (alpha is not
        # loaded here: the gateway's own field used to fail the checks made before a load.)
        def generate(**extra) -> httpx.Response:
            return httpx.post(gw.url + "/api/generate", timeout=120, json={
                "model": "alpha", "prompt": "The capital of France is", "stream": False,
                "options": {"num_predict": 4, "temperature": 0}, **extra})

        r = generate(keep_alive=0)
        assert r.status_code == 200, r.text
        gw.wait_status("alpha", "unloaded", timeout=30)
        r = generate(keep_alive="soon")
        assert r.status_code == 400 and "keep_alive" in r.json()["error"], r.text
        # Ollama's field only on Ollama's routes: on /v1 it is refused as a single server
        # refuses it (the gateway took it there too, and keep_alive 0 unloaded the model)
        r = complete(gw, "alpha", keep_alive=0)
        assert r.status_code == 400 and "keep_alive" in r.json()["error"]["message"], r.text
        assert gw.status()["alpha"]["status"] == "unloaded"

        # beta's ttl is 2 s: idle, it unloads by itself.
        assert complete(gw, "beta").status_code == 200
        gw.wait_status("beta", "unloaded", timeout=30)

        # A model that cannot load: a clear 503 naming the problem; the others keep serving.
        # Its file is read before anything is evicted for it: alpha, loaded, stays (under
        # max-loaded 1 a broken model unloaded it, at every request and retry).
        assert complete(gw, "alpha").status_code == 200
        alpha_pid = gw.status()["alpha"]["pid"]
        r = complete(gw, "broken")
        assert r.status_code == 503, r.text
        err = r.json()["error"]
        assert err["code"] == "model_failed" and "broken" in err["message"], err
        assert "retry-after" not in r.headers  # it stays failed until POST /models/load
        assert "error:" in err["message"] or "gguf" in err["message"].lower(), err
        assert gw.status()["broken"]["status"] == "failed"
        assert gw.status()["alpha"]["pid"] == alpha_pid
        r = httpx.post(gw.url + "/models/load", json={"model": "broken"}, timeout=60)
        assert r.status_code == 503 and r.json()["error"]["code"] == "model_failed", r.text
        assert gw.status()["alpha"]["pid"] == alpha_pid
        assert complete(gw, "alpha").status_code == 200

        # A body no model could serve is refused before any load, in its API's shape: beta
        # stays unloaded and alpha, the one model max-loaded allows, keeps its runner.
        alpha_pid, beta_loads = gw.status()["alpha"]["pid"], gw.status()["beta"]["loads"]
        r = complete(gw, "beta", temperature="hot")
        assert r.status_code == 400 and r.json()["error"]["param"] == "temperature", r.text
        r = httpx.post(gw.url + "/v1/chat/completions", timeout=60, json={
            "model": "beta", "messages": [{"role": "tool", "content": "4", "tool_call_id": "c"}]})
        assert r.status_code == 400, r.text
        assert r.json()["error"]["param"] == "messages[0].tool_call_id", r.text
        r = httpx.post(gw.url + "/v1/messages", timeout=60, json={
            "model": "beta", "messages": [{"role": "user", "content": "Hi"}]})  # no max_tokens
        assert r.status_code == 400 and r.json()["type"] == "error", r.text
        assert "max_tokens" in r.json()["error"]["message"], r.text
        r = httpx.post(gw.url + "/api/generate", timeout=60,
                       json={"model": "beta", "prompt": "Hi", "options": ["fast"]})
        assert r.status_code == 400 and "options" in r.json()["error"], r.text
        r = httpx.post(gw.url + "/tokenize", timeout=60,
                       json={"model": "beta", "prompt": "Hi", "content": "Hi"})
        assert r.status_code == 400 and r.json()["error"]["param"] == "content", r.text
        for extra, param in (({"guided_regex": "(a)\\1"}, "guided_regex"),
                             ({"repetition_penalty": -1}, "repetition_penalty"),
                             ({"min_tokens": 9, "max_tokens": 2}, "min_tokens"),
                             ({"grammar": "root ::= " + "(" * 2000 + '"a"' + ")" * 2000},
                              "grammar")):
            r = complete(gw, "beta", **extra)  # the extensions' checks come before a load too
            assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text
        r = httpx.post(gw.url + "/detokenize", timeout=60, json={"model": "beta", "tokens": [-1]})
        assert r.status_code == 400 and r.json()["error"]["param"] == "tokens", r.text
        r = httpx.post(gw.url + "/completion", timeout=60,
                       json={"model": "beta", "prompt": "Hi", "samplers": ["mirostat"]})
        assert r.status_code == 400 and r.json()["error"]["param"] == "samplers", r.text
        after = gw.status()
        assert after["beta"]["status"] == "unloaded" and after["beta"]["loads"] == beta_loads
        assert after["alpha"]["pid"] == alpha_pid and after["alpha"]["status"] == "loaded"

        r = complete(gw, "nope")
        assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"
        page = httpx.get(gw.url + "/metrics", timeout=30)
        assert page.headers["content-type"] == "text/plain; version=0.0.4; charset=utf-8"
        text = page.text
        assert 'justllm_gateway_model_loads_total{model_name="alpha"}' in text
        # each model's unloads (swaps and beta's ttl; one count for all models before; the
        # broken model never ran)
        unloads = {m.group(1): int(m.group(2)) for m in re.finditer(
            r'justllm_gateway_model_unloads_total\{model_name="(\w+)"\} (\d+)', text)}
        assert unloads["alpha"] >= 1 and unloads["beta"] >= 1 and unloads["broken"] == 0, \
            unloads
        assert 'vllm:num_requests_running{model_name="alpha",replica="0"}' in text  # its own
        assert text.count("# TYPE vllm:num_requests_running") == 1
        assert (gw.logs / "alpha.log").is_file()

        env = {**os.environ, "JUSTLLM_CACHE_DIR": str(gw.logs.parent)}
        ps = subprocess.run([sys.executable, "-m", "justllm", "ps", "--url", gw.url],
                            capture_output=True, text=True, env=env, timeout=60)
        assert ps.returncode == 0, ps.stderr
        rows = {line.split()[0]: line for line in ps.stdout.splitlines()[1:] if line.strip()}
        assert "ready" in rows["alpha"] and "failed" in rows["broken"], ps.stdout
        logs = subprocess.run([sys.executable, "-m", "justllm", "logs", "alpha", "-n", "200"],
                              capture_output=True, text=True, env=env, timeout=60)
        assert logs.returncode == 0 and "starting:" in logs.stdout, logs.stdout + logs.stderr
        # (broken's file was refused before a runner started: its error is in /models)
        assert "gguf" in gw.status()["broken"]["error"].lower()
        nolog = subprocess.run([sys.executable, "-m", "justllm", "logs", "gamma"],
                               capture_output=True, text=True, env=env, timeout=60)
        assert nolog.returncode == 1 and "no log for model 'gamma'" in nolog.stderr
        nolog = subprocess.run([sys.executable, "-m", "justllm", "logs", "alpha", "-r", "3"],
                               capture_output=True, text=True, env=env, timeout=60)
        assert nolog.returncode == 1 and "no log for model 'alpha' replica 3" in nolog.stderr
    finally:
        rc, out = stop(gw)
    assert rc == 0, out
    assert "Traceback" not in out, out


def justllm(*args: str, env: dict) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "justllm", *args], capture_output=True,
                          text=True, env={**os.environ, **env}, timeout=120)


def test_models_side_by_side_a_killed_runner_and_a_killed_gateway(tmp_path, models,
                                                                  model_path):
    del models["broken"]
    # alpha comes from the registry by name:tag; its runner holds a lease on that version.
    store = tmp_path / "models"
    store.mkdir()
    os.link(model_path, store / "demo.gguf")
    env = {"JUSTLLM_MODELS_DIR": str(store)}
    models["alpha"]["source"] = "demo:latest"
    gw = start_gateway(tmp_path, models, env=env)
    try:
        for name in ("alpha", "beta"):
            r = httpx.post(gw.url + "/models/load", json={"model": name}, timeout=120)
            assert r.status_code == 200 and r.json()["status"] == "loaded"

        async def together():
            async with httpx.AsyncClient(timeout=300) as http:
                async def stream(model):
                    r = await http.post(gw.url + "/v1/completions", json={
                        "model": model, "prompt": "Once upon a time", "max_tokens": 12, "ignore_eos": True, "stream": True,
                        "stream_options": {"include_usage": True}})
                    events = [json.loads(line[6:]) for line in r.text.splitlines()
                              if line.startswith("data: {")]
                    return events[-1]["usage"]["completion_tokens"], events[0]["model"]
                return await asyncio.gather(stream("alpha"), stream("beta"))

        assert sorted(asyncio.run(together())) == [(12, "alpha"), (12, "beta")]

        # kill -9 the runner during a non-streaming request: the request goes to the new
        # runner (nothing had reached the client yet), and the model stays available.
        victim = gw.status()["alpha"]["pid"]

        async def killed_mid_request():
            async with httpx.AsyncClient(timeout=300) as http:
                call = asyncio.create_task(http.post(gw.url + "/v1/completions", json={
                    "model": "alpha", "prompt": "Tell a story.", "max_tokens": 60,
                    "ignore_eos": True}))
                while (await http.get(gw.url + "/models")).json()["data"][0]["active"] < 1:
                    await asyncio.sleep(0.05)
                await asyncio.sleep(0.3)
                assert not call.done()
                os.kill(victim, signal.SIGKILL)
                return await call

        r = asyncio.run(killed_mid_request())
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["completion_tokens"] == 60
        after = gw.wait_status("alpha", "loaded")
        assert after["pid"] != victim and after["restarts"] >= 1

        # A stream that had started when its runner died ends with an error event and [DONE].
        victim = after["pid"]
        with httpx.stream("POST", gw.url + "/v1/completions", timeout=300, json={
                "model": "alpha", "prompt": "Tell a story.", "max_tokens": 300,
                "ignore_eos": True, "stream": True}) as r:
            lines = []
            for line in r.iter_lines():
                if line:
                    lines.append(line)
                if len(lines) == 3:
                    os.kill(victim, signal.SIGKILL)
        assert lines[-1] == "data: [DONE]"
        assert json.loads(lines[-2][6:])["error"]["code"] == "replica_failed"
        gw.wait_status("alpha", "loaded")
        assert complete(gw, "alpha").status_code == 200
        # A client that leaves a stream through the gateway aborts the runner's request.
        with httpx.stream("POST", gw.url + "/v1/completions", timeout=300, json={
                "model": "beta", "prompt": "Tell a story.", "max_tokens": 1000,
                "ignore_eos": True, "stream": True}) as r:  # ~30 s and more if not aborted
            assert r.status_code == 200
            lines = 0
            for line in r.iter_lines():
                lines += line.startswith("data: {")
                if lines == 3:
                    break
        assert lines == 3
        deadline = time.monotonic() + 10
        while True:
            text = httpx.get(gw.url + "/metrics", timeout=30).text
            running = [line for line in text.splitlines()
                       if line.startswith('vllm:num_requests_running{model_name="beta",')]
            if gw.status()["beta"]["active"] == 0 and running and running[0].endswith(" 0.0"):
                break
            assert time.monotonic() < deadline, (running, gw.status()["beta"])
            time.sleep(0.1)
        assert httpx.post(gw.url + "/models/unload", json={"model": "beta"},
                          timeout=60).json()["status"] == "unloaded"
        assert gw.status()["beta"]["pid"] is None
        assert complete(gw, "beta").status_code == 200  # loads again on demand
        pids = gw.runner_pids()
        assert len(pids) == 2
        refused = justllm("rm", "demo:latest", env=env)
        assert refused.returncode == 1 and "in use" in refused.stderr, refused.stderr
        assert (store / "demo.gguf").exists()
    finally:
        rc, _ = stop(gw, signal.SIGKILL)  # runners notice their parent is gone and exit
    assert rc == -signal.SIGKILL
    wait_gone(pids)
    removed = justllm("rm", "demo:latest", env=env)  # no runner holds it any more
    assert removed.returncode == 0, removed.stderr
    assert not (store / "demo.gguf").exists()


def test_a_model_larger_than_max_memory_is_refused_without_starting(tmp_path, model_path):
    gw = start_gateway(tmp_path, {"alpha": {"source": model_path, **RUNNER_FLAGS}},
                       **{"max-memory": "300MB"})
    try:
        r = complete(gw, "alpha")
        assert r.status_code == 503, r.text
        err = r.json()["error"]
        assert err["code"] == "model_too_large" and "max-memory" in err["message"], err
        assert "retry-after" not in r.headers  # it can never fit: a retrying client loops
        assert gw.status()["alpha"]["pid"] is None and gw.runner_pids() == []
        assert gw.status()["alpha"]["estimate_mib"] > 300
    finally:
        rc, out = stop(gw)
    assert rc == 0, out
    # one line into a pipe or a log, whatever its length (it was cut at 80 columns)
    first = out.splitlines()[0]
    assert first.startswith("justllm: router mode on http://127.0.0.1:") and \
        first.endswith(f"(runner logs in {tmp_path / 'cache' / 'logs'})"), out


def test_a_body_that_is_not_json_is_said_why_without_starting(tmp_path, model_path):
    """As a single server says it (the gateway said "the body is not valid JSON" of valid
    JSON nested too deeply, and of every other fault alike)."""
    gw = start_gateway(tmp_path, {"alpha": {"source": model_path, **RUNNER_FLAGS}})
    try:
        for body, says in [(b'{"model": "alpha", "x": ' + b"[" * 100_000 + b"]" * 100_000
                            + b"}", "nested too deeply"),
                           (b'{"model": "alpha", "prompt": "\xff"}', "UTF-8"),
                           (b'{"model": "alpha", "max_tokens": 1e999}', "not valid JSON: ")]:
            r = httpx.post(gw.url + "/v1/completions", content=body, timeout=30)
            assert r.status_code == 400 and says in r.json()["error"]["message"], r.text
        assert gw.runner_pids() == []
    finally:
        assert stop(gw)[0] == 0


def test_a_runner_that_ignores_sigterm_is_killed_when_the_gateway_stops(tmp_path, model_path):
    """A stopped (SIGSTOP) runner outlived the gateway: the signal handler's close took the
    runners off their models, and the server's own close then found nothing left to stop."""
    gw = start_gateway(tmp_path, {"alpha": {"source": model_path, "preload": True,
                                            **RUNNER_FLAGS}})
    pids: list[int] = []
    try:
        gw.wait_status("alpha", "loaded", 120)
        pids = gw.runner_pids()
        assert pids
        for pid in pids:
            os.kill(pid, signal.SIGSTOP)
        gw.proc.send_signal(signal.SIGTERM)
        assert gw.proc.wait(timeout=60) == 0
        wait_gone(pids, timeout=10)
    finally:
        kill_left(gw, pids)


def test_a_hung_runner_is_restarted_and_the_request_waiting_for_it_is_served(tmp_path,
                                                                             model_path):
    """A runner that answers nothing (SIGSTOP) was marked unhealthy and kept for ever: a
    request for its model waited until the client gave up."""
    gw = start_gateway(tmp_path, {"alpha": {"source": model_path, "preload": True,
                                            **RUNNER_FLAGS}}, **{"health-timeout": 2})
    hung: list[int] = []
    try:
        gw.wait_status("alpha", "loaded", 120)
        hung = gw.runner_pids()
        os.kill(hung[0], signal.SIGSTOP)
        r = complete(gw, "alpha")  # waits while the replica is unhealthy, then restarted
        assert r.status_code == 200, r.text
        wait_gone(hung, timeout=10)
        assert gw.status()["alpha"]["restarts"] >= 1 and gw.runner_pids() != hung
    finally:
        for pid in hung:
            if alive(pid):
                os.kill(pid, signal.SIGKILL)
        rc, out = stop(gw)
    assert rc == 0, out


def test_a_second_ctrl_c_stops_the_gateway_and_its_runners_now(tmp_path, model_path):
    """It cancelled streams mid-token without a final event, printed tracebacks, exited 0."""
    gw = start_gateway(tmp_path, {"alpha": {"source": model_path, "preload": True,
                                            **RUNNER_FLAGS}})
    pids: list[int] = []
    try:
        gw.wait_status("alpha", "loaded", 120)
        pids = gw.runner_pids()
        events: list[str] = []
        with httpx.stream("POST", gw.url + "/v1/completions", timeout=120, json={
                "model": "alpha", "prompt": "Tell me a long story.", "max_tokens": 900,
                "ignore_eos": True, "stream": True}) as r:
            for line in r.iter_lines():
                if not line.startswith("data: "):
                    continue
                events.append(line[6:])
                if len(events) == 3:  # streaming: Ctrl-C, then again (twice in all)
                    gw.proc.send_signal(signal.SIGINT)
                    time.sleep(0.5)
                    gw.proc.send_signal(signal.SIGINT)
        assert gw.proc.wait(timeout=30) == 130
        out = gw.output()
        assert "Traceback" not in out, out
        assert events[-1] == "[DONE]" and "error" in json.loads(events[-2]), events[-3:]
        wait_gone(pids, timeout=10)
    finally:
        kill_left(gw, pids)


def test_several_models_on_the_command_line_are_router_mode(tmp_path, model_path):
    port = free_port()
    proc, log = start_logged([sys.executable, "-m", "justllm", "serve", model_path, "llama3:8b",
                              "--port", str(port), "--max-seqs", "4"],
                             {**os.environ, "JUSTLLM_CACHE_DIR": str(tmp_path)})
    gw = Gateway(proc, f"http://127.0.0.1:{port}", tmp_path / "logs", log)
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                models = httpx.get(gw.url + "/v1/models", timeout=2).json()["data"]
                break
            except httpx.TransportError:
                assert time.monotonic() < deadline and proc.poll() is None
                time.sleep(0.1)
        assert [m["id"] for m in models] == [Path(model_path).stem, "llama3:8b"]
        r = complete(gw, "llama3:8b")  # not in the registry: its runner says so, once
        assert r.status_code == 503 and "llama3:8b" in r.json()["error"]["message"]
    finally:
        rc, out = stop(gw)
    assert rc == 0, out
    both = justllm("serve", model_path, model_path, "--models", "x.yaml", env={})
    assert both.returncode == 1 and "one of them" in both.stderr
    named = justllm("serve", model_path, "x.gguf", "--served-model-name", "m", env={})
    assert named.returncode == 1 and "--served-model-name" in named.stderr


def test_a_load_outlasting_load_timeout_goes_on(tmp_path, model_path):
    """A waiter's load-timeout cancelled the load itself, so a model slower to load than the
    timeout never loaded (each request started it again). A name with a '/' had no log."""
    gw = start_gateway(tmp_path, {"org/slow": {"source": model_path, **RUNNER_FLAGS}},
                       **{"load-timeout": 0.3})
    try:
        r = complete(gw, "org/slow")
        assert r.status_code == 503 and r.json()["error"]["code"] == "model_loading", r.text
        m = gw.wait_status("org/slow", "loaded")
        assert m["loads"] == 1
        assert complete(gw, "org/slow").status_code == 200
        log = gw.logs / "org%2Fslow.log"
        assert log.read_text().count(" starting: ") == 1  # started once, not once a request
        assert Path(m["log"]) == log
    finally:
        rc, out = stop(gw)
    assert rc == 0, out


def test_an_unload_while_a_request_waits_for_the_load_is_a_503(tmp_path, model_path):
    """It was a 500 (a ValueError in the supervisor), and the load was retried as a failure."""
    gw = start_gateway(tmp_path, {"alpha": {"source": model_path, **RUNNER_FLAGS}})
    try:
        async def race() -> httpx.Response:
            async with httpx.AsyncClient(timeout=60) as h:
                waiting = asyncio.ensure_future(h.post(gw.url + "/v1/completions", json={
                    "model": "alpha", "prompt": "Hi", "max_tokens": 2}))
                while gw.status()["alpha"]["status"] != "loading":
                    await asyncio.sleep(0.02)
                await h.post(gw.url + "/models/unload", json={"model": "alpha"})
                return await waiting

        r = asyncio.run(race())
        assert r.status_code == 503, r.text
        assert r.json()["error"]["code"] == "model_unloaded", r.text
        m = gw.wait_status("alpha", "unloaded")
        assert m["error"] is None and m["pid"] is None and m["loads"] == 0
        assert complete(gw, "alpha").status_code == 200  # and it loads again on request
        assert gw.status()["alpha"]["loads"] == 1

        # Ollama's "unload" (keep_alive 0, nothing to generate) while a request waits for the
        # load: the request is served, then the model unloads. The load forgot it.
        httpx.post(gw.url + "/models/unload", json={"model": "alpha"}, timeout=60)
        gw.wait_status("alpha", "unloaded")

        async def unload_while_loading() -> tuple[httpx.Response, httpx.Response]:
            async with httpx.AsyncClient(timeout=60) as h:
                waiting = asyncio.ensure_future(h.post(gw.url + "/v1/completions", json={
                    "model": "alpha", "prompt": "Hi", "max_tokens": 2}))
                while gw.status()["alpha"]["status"] != "loading":
                    await asyncio.sleep(0.02)
                unload = await h.post(gw.url + "/api/generate", json={"model": "alpha",
                                                                      "keep_alive": 0})
                return await waiting, unload

        r, unload = asyncio.run(unload_while_loading())
        assert r.status_code == 200 and unload.json()["done_reason"] == "unload", r.text
        gw.wait_status("alpha", "unloaded", timeout=30)
    finally:
        rc, out = stop(gw)
    assert rc == 0, out
    assert "Traceback" not in out, out


def test_runners_ask_for_the_gateways_key(tmp_path, model_path):
    """A gateway given its key in JUSTLLM_API_KEY answered every request 401: its runners
    inherited the variable and asked the gateway for it. With --api-key instead, the runners
    were open to anyone on the machine, the gateway's key bypassed on their ports."""
    gw = start_gateway(tmp_path, {"alpha": {"source": model_path, **RUNNER_FLAGS,
                                            "verbose": True}},
                       env={"JUSTLLM_API_KEY": "sekret"})
    try:
        key = {"Authorization": "Bearer sekret"}
        r = httpx.post(gw.url + "/v1/completions", headers={**key, "X-Request-Id": "trace-9"},
                       timeout=120, json={"model": "alpha", "prompt": "Hi", "max_tokens": 2})
        assert r.status_code == 200, r.text
        # The request's id comes back, and went to the runner, which logs it (--verbose).
        assert r.headers["x-request-id"] == "trace-9"
        # Who a request is for is logged too: embeddings' user (it was not), and a chat's
        # user beside its safety_identifier (the second was left out).
        r = httpx.post(gw.url + "/v1/embeddings", headers=key, timeout=120, json={
            "model": "alpha", "input": "Hi", "user": "embedder-3"})
        assert r.status_code == 200, r.text
        r = httpx.post(gw.url + "/v1/chat/completions", headers=key, timeout=120, json={
            "model": "alpha", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 1,
            "user": "u-1", "safety_identifier": "s-2"})
        assert r.status_code == 200, r.text
        deadline = time.monotonic() + 30
        for said in ("x-request-id=trace-9", "embeddings: user=embedder-3",
                     "user=u-1 (safety_identifier s-2)"):
            while said not in (gw.logs / "alpha.log").read_text():
                assert time.monotonic() < deadline, f"the runner did not log {said!r}"
                time.sleep(0.2)
        assert httpx.post(gw.url + "/v1/completions", timeout=60, json={
            "model": "alpha", "prompt": "Hi", "max_tokens": 2}).status_code == 401
        models = httpx.get(gw.url + "/models", headers=key, timeout=30).json()["data"]
        runner = models[0]["url"]
        for headers in ({}, key):  # neither no key nor the gateway's own opens a runner
            r = httpx.post(runner + "/v1/completions", headers=headers, timeout=60, json={
                "prompt": "Hi", "max_tokens": 2})
            assert r.status_code == 401, r.text
        inner = {"Authorization": f"Bearer {runner_key(models[0]['pid'])}"}
        assert inner != key
        assert httpx.post(runner + "/v1/completions", headers=inner, timeout=60, json={
            "prompt": "Hi", "max_tokens": 2}).status_code == 200
    finally:
        pids = [m["pid"] for m in httpx.get(gw.url + "/models", timeout=30, headers={
            "Authorization": "Bearer sekret"}).json()["data"] if m["pid"]]
        gw.proc.send_signal(signal.SIGTERM)
        rc = gw.proc.wait(timeout=60)
        wait_gone(pids)
    assert rc == 0



def test_a_stream_queued_on_a_runner_that_dies_goes_to_its_successor(tmp_path, model_path):
    """A stream waiting on a runner for its turn has had headers and nothing else; when the
    runner died it ended in an error event, where a request that is not a stream goes to the
    new runner. Now it goes too."""
    gw = start_gateway(tmp_path, {"solo": {"source": model_path, **RUNNER_FLAGS,
                                           "max-seqs": 1}})
    try:
        assert complete(gw, "solo").status_code == 200
        victim = gw.status()["solo"]["pid"]

        def stream(max_tokens: int, lines: list[str], started: threading.Event) -> None:
            with httpx.stream("POST", gw.url + "/v1/completions", timeout=300, json={
                    "model": "solo", "prompt": "Tell a story.", "max_tokens": max_tokens,
                    "ignore_eos": True, "stream": True}) as r:
                lines.append(str(r.status_code))
                for line in r.iter_lines():
                    if line:
                        lines.append(line)
                        started.set()

        first, queued = [], []
        running, never = threading.Event(), threading.Event()
        a = threading.Thread(target=stream, args=(400, first, running))
        a.start()
        assert running.wait(120)  # the runner's only sequence is taken
        b = threading.Thread(target=stream, args=(4, queued, never))
        b.start()
        deadline = time.monotonic() + 60
        while gw.status()["solo"]["active"] < 2:
            assert time.monotonic() < deadline
            time.sleep(0.05)
        time.sleep(0.5)  # B waits on the runner
        assert not never.is_set()
        os.kill(victim, signal.SIGKILL)
        a.join(300)
        b.join(300)
        assert json.loads(first[-2][6:])["error"]["code"] == "replica_failed"  # it had started
        assert queued[0] == "200" and queued[-1] == "data: [DONE]", queued
        texts = [json.loads(line[6:]) for line in queued[1:-1]]
        assert all("error" not in t for t in texts) and len(texts) == 4, texts
        assert gw.status()["solo"]["pid"] not in (None, victim)
    finally:
        rc, out = stop(gw)
    assert rc == 0, out


def test_a_runner_killed_while_it_starts_says_so(tmp_path, model_path):
    """It was 'exited without output' (the model then failed with that reason); once up, the
    same kill already said 'runner killed by signal 9'."""
    import asyncio

    from justllm.gateway.config import load_config
    from justllm.gateway.runner import RunnerProcess
    from tests.gateway.test_policy import FLAGS

    spec = load_config({"models": {"a": {"source": model_path}}}, FLAGS).spec("a")
    runner = RunnerProcess(spec, tmp_path / "logs")
    runner.proc.kill()

    async def ready() -> None:
        async with httpx.AsyncClient() as http:
            await runner.wait_ready(http, 60)

    with pytest.raises(RuntimeError, match="runner killed by signal 9"):
        asyncio.run(ready())
