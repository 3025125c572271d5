"""A real ``justllm serve`` process on a free loopback port, with the demo model."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from typing import IO

import httpx
import pytest

from justllm.gateway.runner import free_port
from tests.helpers import logged_text, start_logged
from tests.models.ggufs import with_chat_template


@dataclass
class Server:
    proc: subprocess.Popen
    url: str
    model: str
    log: IO[bytes] = field(repr=False)

    def output(self) -> str:
        """What the server has printed so far, stdout and stderr."""
        return logged_text(self.log)

    def stop(self) -> int:
        """SIGTERM, as a supervisor would; returns the exit code."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            return -9


def template_server(model_path, gguf, template: str, *args: str) -> Server:
    """The demo model with ``template`` as the chat template in its GGUF (a copy written to
    ``gguf``), served with ``args`` and without its prefix cache, so a greedy answer to the
    same prompt is the same every time."""
    return start_server(str(with_chat_template(model_path, gguf, template)), *args,
                        "--no-prefix-cache")


def start_server(model_path: str, *args: str, env: dict | None = None,
                 launcher: tuple[str, ...] = ("-m", "justllm", "serve")) -> Server:
    """``launcher``: what Python runs before the model and flags (a script that wraps
    ``justllm serve``, such as benchmarks/step_trace.py)."""
    port = free_port()
    cmd = [sys.executable, *launcher, model_path, "--port", str(port), *args]
    proc, log = start_logged(cmd, {**os.environ, **(env or {})})
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 120
    seen_503 = False
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited: {logged_text(log)}")
        try:
            r = httpx.get(url + "/health", timeout=2)
            if r.status_code == 200:
                break
            seen_503 |= r.status_code == 503
        except httpx.TransportError:
            pass
        time.sleep(0.05)
    else:
        proc.kill()
        raise RuntimeError("server did not become healthy")
    model = httpx.get(url + "/v1/models", headers=_auth(args), timeout=60).json()["data"][0]["id"]
    server = Server(proc, url, model, log)
    server.saw_loading = seen_503  # type: ignore[attr-defined]
    return server


def _auth(args: tuple[str, ...]) -> dict:
    if "--api-key" in args:
        return {"Authorization": f"Bearer {args[args.index('--api-key') + 1]}"}
    return {}


@pytest.fixture(scope="session")
def server(model_path):
    # Gemma's turn format (not the transcript a base model gets by default): its stop string
    # is an end-of-generation token, so ignore_eos answers run to max_tokens as tests expect.
    s = start_server(model_path, "--max-seqs", "16", "--pool-blocks", "512",
                     "--chat-template", "gemma")
    yield s
    assert s.stop() == 0
