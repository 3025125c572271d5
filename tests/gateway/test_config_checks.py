"""Router mode refuses at start-up, in one line, what its runners would refuse (or what would
break it later), as single-model `justllm serve` does: the process-level half of
test_policy.py's config checks."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from justllm.engine.backend import gpu_offload_supported
from tests.gateway.test_gateway import start_gateway, stop
from tests.helpers import logged_text, start_logged
from tests.server.conftest import free_port


def gateways_runners(pid: int) -> list[int]:
    """The runners a gateway started (they carry its pid in JUSTLLM_PARENT_PID), alive."""
    mark = f"JUSTLLM_PARENT_PID={pid}".encode()
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if mark in (entry / "environ").read_bytes().split(b"\0"):
                    found.append(int(entry.name))
            except OSError:
                pass  # gone, or not ours to read
    return found


def refused(tmp_path: Path, args: list[str], cache: Path | None = None) -> str:
    """``justllm serve ARGS``, which must stop at once: exit status 1 and one ``error:`` line
    (returned), no traceback, nothing listening and no runner left behind."""
    port = free_port()
    proc, log = start_logged([sys.executable, "-m", "justllm", "serve", *args, "--port",
                              str(port)],
                             {**os.environ, "JUSTLLM_CACHE_DIR": str(cache or tmp_path / "cache")})
    try:
        rc = proc.wait(timeout=30)
    except subprocess.TimeoutExpired:  # it started: the check is missing
        proc.kill()
        proc.wait()
        rc = None
    out = logged_text(log)
    left = gateways_runners(proc.pid)
    for pid in left:
        os.kill(pid, 9)
    assert rc == 1, out
    assert "Traceback" not in out and len(out.splitlines()) == 1, out
    assert out.startswith("error: "), out
    assert not left, f"runners left behind: {left}"
    with socket.socket() as s:  # nothing bound the port
        s.bind(("127.0.0.1", port))
    return out.strip()


@pytest.mark.parametrize("entry, says", [
    # a traceback (OverflowError)
    ("max-loaded: .inf\nmodels:\n  a: {source: MODEL, preload: true}",
     "error: max-loaded must be an integer (got inf)"),
    # started; each request then got a 500 (asyncio.wait_for(..., nan))
    ("load-timeout: .nan\nmodels:\n  a: {source: MODEL, preload: true}",
     "error: load-timeout must be a finite number (got nan)"),
    # started; the first request got a 503 after three runner starts (single-model serve
    # refuses them before it starts)
    ("models:\n  a: {source: MODEL, preload: true, spec: bogus}",
     "error: model 'a': spec must be one of ngram, draft, tree (got 'bogus')"),
    ("models:\n  a: {source: MODEL, preload: true, chat-template: nope}",
     "error: model 'a': --chat-template 'nope' is neither a built-in template (chatml, gemma, "
     "llama3, transcript) nor a Jinja file"),
    # accepted, and reached no runner: the model's replicas are all urls
    ("models:\n  r: {urls: [http://127.0.0.1:9], gpu: true}",
     "error: model 'r': gpu: engine flags of local replicas, and this model's replicas are all "
     "urls (give them to the `justllm serve` behind each url)"),
    # each taken, and failed at the first request (the runner refused it at each try)
    ("models:\n  lo: {source: MODEL, lora: [x=/nope/x.gguf]}",
     "error: model 'lo': LoRA adapter /nope/x.gguf: file not found"),
    ("models:\n  d: {source: /tmp}",
     "error: model 'd': source /tmp is a directory; give a .gguf file or a model name"),
    # served as a model named "None"
    ("models:\n  ~: {source: MODEL, preload: true}",
     "error: models.yaml: a model's name is ~ (null): give it a name"),
])
def test_a_models_yaml_the_gateway_cannot_serve_is_refused_at_start(tmp_path, model_path,
                                                                     entry, says):
    config = tmp_path / "models.yaml"
    config.write_text(entry.replace("MODEL", model_path))
    # (the file's own errors name the file as given)
    assert refused(tmp_path, ["--models", str(config)]) == says.replace(
        "error: models.yaml:", f"error: {config}:")


def test_a_runner_log_folder_that_cannot_be_made_is_refused_at_start(tmp_path, model_path):
    """Found by an audit: router mode started, and each request failed after three runner
    starts."""
    config = tmp_path / "models.yaml"
    config.write_text(f"models:\n  a: {{source: {model_path}, preload: true}}\n")
    blocker = tmp_path / "a-file"
    blocker.write_text("x")
    said = refused(tmp_path, ["--models", str(config)], cache=blocker / "cache")
    assert said.startswith(f"error: cannot make the runner log folder {blocker}/cache"), said


def test_a_pool_larger_than_the_machines_memory_is_refused_at_start(tmp_path, model_path):
    """Single-model serve refuses it before llama.cpp allocates it; router mode started, and
    the model's runner was refused at its first request (three failed starts, then 503)."""
    config = tmp_path / "models.yaml"
    config.write_text(f"models:\n  a: {{source: {model_path}, pool-blocks: 99999999}}\n")
    said = refused(tmp_path, ["--models", str(config)])
    assert said.startswith("error: model 'a': --pool-blocks 99999999: a KV pool of "), said
    assert said.endswith("GiB of memory this machine has"), said


def test_flags_for_every_model_are_checked_as_serve_checks_them(tmp_path, model_path):
    """The gateway's own flags reach every runner: a bad one was found by the first request."""
    (tmp_path / "other.gguf").symlink_to(model_path)
    models = [model_path, str(tmp_path / "other.gguf")]
    assert refused(tmp_path, [*models, "--chat-template", "nope"]) == (
        "error: model 'gemma-3-270m-q4_k_m': --chat-template 'nope' is neither a built-in "
        "template (chatml, gemma, llama3, transcript) nor a Jinja file")


@pytest.mark.skipif(gpu_offload_supported(), reason="a GPU build of llama-cpp-python")
def test_gpu_on_a_cpu_only_build_is_refused_unless_the_model_runs_elsewhere(tmp_path,
                                                                            model_path):
    """Single-model serve stops at once; router mode started, and each model failed at its
    first request. A model whose replicas are all urls is another machine's business."""
    config = tmp_path / "models.yaml"
    config.write_text(f"models:\n  a: {{source: {model_path}, gpu: true}}\n")
    assert refused(tmp_path, ["--models", str(config)]).startswith(
        "error: --gpu needs a llama-cpp-python built with a GPU backend; this one is CPU-only")
    (tmp_path / "other.gguf").symlink_to(model_path)
    assert refused(tmp_path, [model_path, str(tmp_path / "other.gguf"), "--gpu"]).startswith(
        "error: --gpu needs")
    # The gateway's own --gpu (here JUSTLLM_GPU) is for the models it runs; a model whose
    # replicas are all urls runs none.
    gw = start_gateway(tmp_path, {"remote": {"urls": [f"http://127.0.0.1:{free_port()}"]}},
                       env={"JUSTLLM_GPU": "1"})
    rc, out = stop(gw)
    assert rc == 0 and out.startswith("justllm: router mode on") and "Traceback" not in out, out


@pytest.mark.skipif(gpu_offload_supported(), reason="a GPU build of llama-cpp-python")
def test_a_models_gpu_false_wins_over_the_gateways_environment(tmp_path, model_path):
    """JUSTLLM_GPU=1 reaches every model as --gpu, and a model's gpu: false wins; but its
    runner inherited JUSTLLM_GPU and turned the GPU on anyway (here: a CPU-only build, so it
    failed to start, and the request got a 503)."""
    gw = start_gateway(tmp_path, {"a": {"source": model_path, "gpu": False,
                                        "max-seqs": 2, "pool-blocks": 64}},
                       env={"JUSTLLM_GPU": "1"})
    try:
        r = httpx.post(gw.url + "/v1/completions", timeout=120, json={
            "model": "a", "prompt": "Hi", "max_tokens": 1})
        assert r.status_code == 200, r.text
    finally:
        rc, out = stop(gw)
    assert rc == 0 and "Traceback" not in out, out
