"""A ``justllm serve`` child process on a free loopback port, for ``bench`` without ``--url``."""

from __future__ import annotations

import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass

import httpx

from justllm.errors import JustLLMError


@dataclass
class LocalServer:
    proc: subprocess.Popen
    url: str

    @classmethod
    def start(cls, model: str | None, *, max_seqs: int, timeout: float = 300) -> "LocalServer":
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        cmd = [sys.executable, "-m", "justllm", "serve", "--port", str(port),
               "--max-seqs", str(max_seqs)] + ([model] if model else [])
        proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                out = proc.stderr.read() if proc.stderr is not None else b""
                err = out.decode("utf-8", "replace").strip().splitlines()
                raise JustLLMError(f"the local server failed: {err[-1] if err else proc.returncode}")
            try:
                if httpx.get(url + "/health", timeout=2, trust_env=False).status_code == 200:
                    return cls(proc, url)
            except httpx.HTTPError:
                pass
            time.sleep(0.1)
        proc.kill()
        raise JustLLMError("the local server did not become ready")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
