"""`justllm cluster`'s edges, with no Ray cluster: one red line and exit 1 for a bad YAML, a
model a cluster cannot run, an unreachable RAY_ADDRESS, nothing deployed, and Ray not
installed (while `justllm --help` still works without it)."""

from __future__ import annotations

import contextlib
import json
import subprocess
import sys
import time
from pathlib import Path

import pytest
from typer.testing import CliRunner

from justllm.cli import app
from justllm.gateway.runner import free_port

runner = CliRunner()

WITHOUT_RAY = ("import sys; sys.modules['ray'] = None; from justllm.cli import main; "
               "sys.argv = ['justllm', *sys.argv[1:]]; main()")


@pytest.fixture(autouse=True)
def no_cluster(tmp_path, monkeypatch):
    """No RAY_ADDRESS, no head recorded by justllm, no `ray start` here (Ray's own record)."""
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    monkeypatch.setenv("RAY_TMPDIR", str(tmp_path / "ray"))
    monkeypatch.setenv("JUSTLLM_CACHE_DIR", str(tmp_path / "cache"))


def one_error_line(result) -> str:
    assert result.exit_code == 1, result.output
    lines = [line for line in result.output.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error:"), result.output
    return lines[0]


def test_a_bad_yaml_is_one_line(tmp_path):
    bad = tmp_path / "cluster.yaml"
    bad.write_text("models: [unclosed\n")
    assert "is not valid YAML" in one_error_line(runner.invoke(app, ["cluster", "deploy",
                                                                     str(bad)]))
    bad.write_text("models:\n  m:\n    source: /m.gguf\n    bogus: 1\n")
    assert "unknown key(s) bogus" in one_error_line(runner.invoke(app, ["cluster", "deploy",
                                                                        str(bad)]))
    missing = str(tmp_path / "missing.yaml")
    assert "cannot read" in one_error_line(runner.invoke(app, ["cluster", "deploy", missing]))
    # a flag that would do nothing, at its default too, as router mode refuses it (a replica
    # passed it over)
    bad.write_text("models:\n  m:\n    source: /m.gguf\n    gamma: 4\n")
    assert "model 'm': --gamma is for --spec" in one_error_line(
        runner.invoke(app, ["cluster", "deploy", str(bad)]))


@pytest.mark.parametrize("entry, said", [
    ("source: {model}\n    chat-template: nope",
     "model 'demo': --chat-template 'nope' is neither a built-in template (chatml, gemma, "
     "llama3, transcript) nor a Jinja file"),
    ("source: {tmp}/missing.gguf", "model 'demo': source {tmp}/missing.gguf is not a file"),
    ("source: {tmp}/cut.gguf", "model 'demo': {tmp}/cut.gguf is not a GGUF file (no GGUF magic at its start)"),
])
def test_what_a_replica_here_would_refuse_is_refused_before_a_head_starts(tmp_path, model_path,
                                                                          entry, said):
    """Each failed only inside the replicas, after a local head's start and Ray's retries, a
    minute and more; `justllm serve --models` refuses them before a runner starts."""
    (tmp_path / "cut.gguf").write_bytes(b"GGU")
    cfg = tmp_path / "cluster.yaml"
    cfg.write_text("models:\n  demo:\n    " + entry.format(tmp=tmp_path, model=model_path))
    line = one_error_line(runner.invoke(app, ["cluster", "deploy", str(cfg)]))
    assert line == f"error: {said.format(tmp=tmp_path)}"
    assert not (tmp_path / "cache" / "cluster" / "local-ray.json").exists()  # no head started


def test_a_model_with_urls_is_refused(tmp_path):
    cfg = tmp_path / "cluster.yaml"
    cfg.write_text("models:\n  m:\n    urls: [http://10.0.0.7:8080]\n")
    assert "urls are router mode's" in one_error_line(
        runner.invoke(app, ["cluster", "deploy", str(cfg)]))


def test_an_unreachable_ray_address_is_one_line_and_starts_nothing(tmp_path, monkeypatch,
                                                                    model_path):
    cfg = tmp_path / "cluster.yaml"
    cfg.write_text(f"models:\n  demo: {model_path}\n")
    address = f"127.0.0.1:{free_port()}"
    monkeypatch.setenv("RAY_ADDRESS", address)
    line = one_error_line(runner.invoke(app, ["cluster", "deploy", str(cfg)]))
    assert f"cannot reach the Ray cluster at {address} (RAY_ADDRESS)" in line
    assert not (tmp_path / "cache" / "cluster" / "local-ray.json").exists()
    line = one_error_line(runner.invoke(app, ["cluster", "status"]))
    assert "cannot reach the Ray cluster" in line


def test_an_address_that_accepts_but_never_answers_is_one_line(tmp_path, monkeypatch,
                                                              model_path):
    """ray.init to a port that accepts TCP and then says nothing (a hung GCS, another
    program's port) retried for 13 minutes, printing C++ warnings."""
    import socket
    import threading

    from justllm.cluster import deploy

    monkeypatch.setattr(deploy, "GCS_CONNECT_TIMEOUT", 1.0)
    cfg = tmp_path / "cluster.yaml"
    cfg.write_text(f"models:\n  demo: {model_path}\n")
    with socket.socket() as silent:
        silent.bind(("127.0.0.1", 0))
        silent.listen()
        accepted: list[socket.socket] = []
        threading.Thread(target=lambda: accepted.extend(iter(lambda: silent.accept()[0], None)),
                         daemon=True).start()
        address = f"127.0.0.1:{silent.getsockname()[1]}"
        monkeypatch.setenv("RAY_ADDRESS", address)
        try:
            said = (f"error: cannot connect to the Ray cluster at {address}: it accepts "
                    "connections but did not answer as Ray does within 1 s (a Ray GCS that "
                    "hangs, or another program on that port)")
            for command in ("status", "down"):
                assert one_error_line(runner.invoke(app, ["cluster", command])) == said
            r = runner.invoke(app, ["cluster", "deploy", str(cfg)])
            assert r.exit_code == 1 and r.output.splitlines()[-1] == said, r.output
            assert accepted  # (the probe did reach it)
        finally:
            for conn in accepted:
                conn.close()
    assert not (tmp_path / "cache" / "cluster" / "local-ray.json").exists()


@pytest.mark.parametrize("command", ["status", "down"])
def test_nothing_deployed_is_one_line(command):
    line = one_error_line(runner.invoke(app, ["cluster", command]))
    assert "nothing deployed: no Ray cluster" in line


def test_without_ray_help_works_and_cluster_names_the_extra():
    r = subprocess.run([sys.executable, "-c", WITHOUT_RAY, "--help"], capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 0 and "cluster" in r.stdout, r.stderr
    r = subprocess.run([sys.executable, "-c", WITHOUT_RAY, "cluster", "status"],
                       capture_output=True, text=True, timeout=120)
    lines = [line for line in r.stderr.splitlines() if line.strip()]
    assert r.returncode == 1 and len(lines) == 1, r.stderr
    assert "pip install 'justllm[cluster]'" in lines[0]


def test_status_shows_a_row_per_replica(monkeypatch):
    from justllm.cluster import deploy

    replica = {"replica": "abc123", "node_ip": "10.0.0.7", "node_id": "f00d", "healthy": True,
               "running": 2, "waiting": 1, "kv_usage": 0.25, "hit_ratio": 0.8,
               "ttft_p50": 0.05, "age": 0.4}
    body = {"app": "justllm", "status": "RUNNING", "message": "", "address": "10.0.0.1:6379",
            "local": False, "url": "http://10.0.0.1:8000", "models": [
                {"model": "chat", "deployment": "model-chat", "status": "UPDATING",
                 "replica_states": {"RUNNING": 2, "STARTING": 1}, "message": "", "replicas": [
                     {**replica, "adapters": ["pirate", "sql"]},
                     {**replica, "replica": "def456", "healthy": False,
                      "hit_ratio": None, "ttft_p50": None}]}]}
    monkeypatch.setattr(deploy, "status", lambda app: body)
    r = runner.invoke(app, ["cluster", "status"])
    assert r.exit_code == 0, r.output
    rows = [line.split() for line in r.output.splitlines()]
    assert ["chat", "abc123", "10.0.0.7", "healthy", "2", "1", "25%", "80%", "50", "ms",
            "pirate,sql"] in rows
    # a replica of an older justllm reports no adapters
    assert ["chat", "def456", "10.0.0.7", "engine", "down", "2", "1", "25%", "-", "-",
            "-"] in rows
    assert "chat: updating, Ray replicas running 2, starting 1" in r.output
    r = runner.invoke(app, ["cluster", "status", "--json"])
    assert r.exit_code == 0 and json.loads(r.output) == body


def test_an_interrupted_head_start_leaves_no_head_behind(monkeypatch, python_ctrl_c):
    """Ctrl-C while the local head started left it running, and no record named it: `down`
    could not stop it; a second Ctrl-C, while the head was stopped, cut its stop short. (A
    real `ray start`, interrupted as it comes up and again as it is stopped.)"""
    import os
    import signal
    import time

    from justllm.cli.cleanup_shield import CleanupShield
    from justllm.cluster import local_ray
    from tests.gateway.test_gateway import alive

    started: list[int] = []
    said: list[str] = []
    real_popen, real_sleep = local_ray.subprocess.Popen, time.sleep

    def popen(*args, **kwargs):
        proc = real_popen(*args, **kwargs)
        started.append(proc.pid)
        return proc

    def sleep(seconds: float) -> None:  # the first wait for Ray to come up: interrupted
        if started and -1 not in started:
            started.append(-1)
            raise KeyboardInterrupt
        real_sleep(seconds)

    monkeypatch.setattr(local_ray.subprocess, "Popen", popen)
    monkeypatch.setattr(local_ray.time, "sleep", sleep)
    try:
        with CleanupShield(lambda: said.append("said")) as shield:
            @contextlib.contextmanager
            def second_ctrl_c():
                with shield.shielded():
                    signal.raise_signal(signal.SIGINT)
                    yield

            with pytest.raises(KeyboardInterrupt):
                local_ray.start_head(shielded=second_ctrl_c)
        head = started[0]
        assert not alive(head) and local_ray._session(head) == []
        assert not local_ray.record_path().exists() and said == ["said"]
    finally:
        for pid in [started[0], *local_ray._session(started[0])] if started else []:
            if alive(pid):
                os.kill(pid, 9)


def test_a_stopped_heads_leader_not_yet_reaped_is_not_waited_for():
    """The head's leader is a zombie once it exits until the process that started it (a
    deploy that stops the head it started) reaps it: counted as running, every such stop
    waited out its whole grace, 40 s, after Ray had stopped in 2."""
    from justllm.cluster import local_ray

    leader = subprocess.Popen([sys.executable, "-c", "pass"], start_new_session=True)
    try:
        stat = Path(f"/proc/{leader.pid}/stat")
        while stat.read_text().rsplit(")", 1)[1].split()[0] != "Z":
            time.sleep(0.05)
        assert local_ray._session(leader.pid) == []
    finally:
        leader.wait()


def test_a_recorded_head_whose_pid_another_ray_took_is_not_ours(tmp_path):
    """The record named a pid that another `ray start --block` had taken: `down` stopped that
    other head's whole session."""
    import json
    import time

    from justllm.cluster import local_ray

    other = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)", "start",
                              "--head", "--block", "--port", "6380"])
    try:
        record = local_ray.record_path()
        record.parent.mkdir(parents=True, exist_ok=True)
        for address, ours in (("127.0.0.1:6380", True), ("127.0.0.1:6999", False)):
            record.write_text(json.dumps({"pid": other.pid, "address": address, "log": "x"}))
            deadline = time.monotonic() + 10
            while b"--block" not in open(f"/proc/{other.pid}/cmdline", "rb").read():
                assert time.monotonic() < deadline
                time.sleep(0.05)
            assert (local_ray.recorded() is not None) is ours
        assert not record.exists()  # a stale record is removed
    finally:
        other.kill()
        other.wait()
