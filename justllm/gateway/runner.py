"""One runner: a single-model ``justllm serve`` child process on a private loopback port, its
log file, and its health. The runner exits by itself if the gateway dies (it is given the
gateway's pid in JUSTLLM_PARENT_PID and watches it), so no process outlives a SIGKILLed
gateway."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from urllib.parse import quote, unquote

import httpx

from justllm.gateway.config import ModelSpec


def free_port() -> int:
    return free_ports(1)[0]


def free_ports(n: int) -> list[int]:
    """``n`` distinct ports free on 127.0.0.1 now. The sockets stay bound until all are
    chosen: one at a time, the kernel may hand the same port out twice."""
    with contextlib.ExitStack() as stack:
        socks = [stack.enter_context(socket.socket()) for _ in range(n)]
        for s in socks:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in socks]


def last_error_line(log: Path, start: int = 0) -> str:
    """The runner's last 'error:' line (the CLI's one-line errors, without the prefix), else
    its last line; of what it wrote from byte ``start`` on (its own run: the file holds the
    runs before it too, whose errors are not its own)."""
    try:
        with log.open("rb") as f:
            f.seek(start)
            text = f.read().decode(errors="replace")
    except OSError:
        return "no log"
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    errors = [ln.removeprefix("error:").strip() for ln in lines if ln.startswith("error:")]
    return (errors or lines or ["exited without output"])[-1]


def log_name(model: str, replica: str = "0") -> str:
    """A runner's log file: ``MODEL.log`` for the first replica, ``MODEL@N.log`` for others;
    percent-encoded, so that ``org/model`` is one file in the log directory and ``../x``
    cannot leave it (:func:`log_model` reads the name back)."""
    name = model if replica == "0" else f"{model}@{replica}"
    return quote(name, safe="@:+=,") + ".log"


def log_model(path: Path) -> str:
    """The model (and ``@N`` replica) a log file is named after."""
    return unquote(path.stem)


class RunnerProcess:
    def __init__(self, spec: ModelSpec, log_dir: Path, shutdown_timeout: float = 5.0,
                 replica: str = "0", gpu: int | None = None, role: str = "both",
                 api_key: str | None = None) -> None:
        """``api_key``: the key the runner asks of its clients (the gateway's own, never the
        user's: a JUSTLLM_API_KEY in the gateway's environment is not inherited)."""
        self.spec = spec
        self.replica = replica
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = log_dir / log_name(spec.name, replica)
        self.started = time.monotonic()
        log_dir.mkdir(parents=True, exist_ok=True)
        cmd = [sys.executable, "-m", "justllm", "serve", spec.source, "--host", "127.0.0.1",
               "--port", str(self.port), "--served-model-name", spec.name,
               "--shutdown-timeout", str(shutdown_timeout), *spec.runner_args(),
               *(["--role", role] if role != "both" else [])]
        with self.log_path.open("ab") as log:
            log.write(f"\n--- {time.strftime('%Y-%m-%d %H:%M:%S')} starting: "
                      f"{' '.join(cmd)}\n".encode())
            log.flush()
            self.log_start = log.tell()  # where this run's output begins
            self.proc = subprocess.Popen(
                cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                env={**{k: v for k, v in os.environ.items()
                        if k != "JUSTLLM_API_KEY" and k not in spec.unset_switches_env()},
                     "JUSTLLM_PARENT_PID": str(os.getpid()),
                     **({"JUSTLLM_API_KEY": api_key} if api_key else {}),
                     **({"CUDA_VISIBLE_DEVICES": str(gpu)} if gpu is not None else {})})

    def last_error(self) -> str:
        """What this run of the runner last said went wrong (:func:`last_error_line`)."""
        return last_error_line(self.log_path, self.log_start)

    def killed_by(self) -> str | None:
        """"runner killed by signal N" once a signal ended it (its log then says nothing of
        why); None while it runs or after it exited by itself."""
        rc = self.proc.returncode
        return f"runner killed by signal {-rc}" if rc is not None and rc < 0 else None

    @property
    def pid(self) -> int:
        return self.proc.pid

    def alive(self) -> bool:
        return self.proc.poll() is None

    async def wait_ready(self, http: httpx.AsyncClient, timeout: float) -> None:
        """Until /health says 200; raises RuntimeError with the runner's last error line if it
        exits, TimeoutError if it takes longer than ``timeout``."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if not self.alive():
                raise RuntimeError(self.killed_by() or self.last_error())
            try:
                if (await http.get(self.url + "/health", timeout=2)).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            await asyncio.sleep(0.1)
        raise TimeoutError(f"model '{self.spec.name}' did not load within {timeout:.0f} s")

    async def healthy(self, http: httpx.AsyncClient) -> bool:
        try:
            return (await http.get(self.url + "/health", timeout=5)).status_code == 200
        except httpx.HTTPError:
            return False

    async def stop(self, grace: float = 10.0) -> None:
        """SIGTERM (the runner drains for its shutdown timeout), then SIGKILL after ``grace``."""
        if self.alive():
            self.proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + grace
        while self.alive() and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        if self.alive():
            self.proc.kill()
        self.proc.wait()

    def kill_now(self, wait: bool = True) -> None:
        """SIGKILL; ``wait=False`` from a signal handler, which may have interrupted this very
        thread inside a wait for the process (its lock would never be released)."""
        if self.alive():
            self.proc.kill()
        if wait:
            self.proc.wait()
