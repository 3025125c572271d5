"""A server child process on a free loopback port: ``justllm serve`` for ``bench`` without
``--url``, or any server a benchmark script starts (:meth:`LocalServer.launch`)."""

from __future__ import annotations

import contextlib
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import IO

import httpx

from justllm.errors import JustLLMError


@dataclass
class LocalServer:
    proc: subprocess.Popen
    url: str

    @classmethod
    def start(cls, model: str | None, *, max_seqs: int, timeout: float = 300) -> "LocalServer":
        """``justllm serve MODEL`` (the configured default model without one)."""
        return cls.launch(lambda port: [
            sys.executable, "-m", "justllm", "serve", "--port", str(port),
            "--max-seqs", str(max_seqs)] + ([model] if model else []), timeout=timeout)

    @classmethod
    def launch(cls, command: Callable[[int], list[str]], *, log: IO[bytes] | None = None,
               timeout: float = 300) -> "LocalServer":
        """``command(port)`` run on a free loopback port until its ``/health`` answers 200.
        Its output goes to ``log``, or to a temporary file (a pipe nobody reads would stop a
        server that logs much once the pipe is full); if it exits first, the error names the
        output's last line."""
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        out = log if log is not None else tempfile.TemporaryFile()
        proc: subprocess.Popen | None = None
        try:
            try:
                with _deferred_signals():
                    proc = subprocess.Popen(command(port), stdout=out,
                                            stderr=subprocess.STDOUT)
            except OSError as e:
                raise JustLLMError(f"the local server did not start: {e}") from None
            return cls._ready(proc, f"http://127.0.0.1:{port}", out, timeout)
        except BaseException:  # (Ctrl-C or a signal while it loaded left it running)
            if proc is not None and proc.poll() is None:
                proc.kill()
                proc.wait()
            raise
        finally:
            if log is None:  # (the child keeps its own descriptor)
                out.close()

    @classmethod
    def _ready(cls, proc: subprocess.Popen, url: str, out: IO[bytes],
               timeout: float) -> "LocalServer":
        deadline = time.monotonic() + timeout
        # One client for the polls: each new one builds an SSL context (~50 ms of CPU), taken
        # from the server starting beside it.
        try:
            with httpx.Client(timeout=2, trust_env=False) as http:
                while time.monotonic() < deadline:
                    if proc.poll() is not None:
                        raise JustLLMError(f"the local server failed: "
                                           f"{_last_line(out) or f'exit {proc.returncode}'}")
                    try:
                        if http.get(url + "/health").status_code == 200:
                            return cls(proc, url)
                    except httpx.HTTPError:
                        pass
                    time.sleep(0.1)
            raise JustLLMError(f"the local server did not become ready in {timeout:.0f} s")
        except BaseException:  # (Ctrl-C while it loaded left it running)
            proc.kill()
            proc.wait()
            raise

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


_STOPPING = (signal.SIGTERM, signal.SIGHUP, signal.SIGINT)


@contextlib.contextmanager
def _deferred_signals() -> Iterator[None]:
    """The Python handlers of SIGTERM, SIGHUP and SIGINT run after the block, not inside it:
    a handler that raises (bench's SystemExit, Ctrl-C's KeyboardInterrupt) raised inside
    Popen once the child was forked, and the child, whose Popen never returned, was left
    running (a signal mask would be inherited by the child: it ignored SIGTERM). Only on the
    main thread, where handlers run."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    came: list[int] = []
    previous = {sig: signal.getsignal(sig) for sig in _STOPPING}
    handlers = {sig: h for sig, h in previous.items() if callable(h)}
    for sig in handlers:
        signal.signal(sig, lambda signum, frame: came.append(signum))
    try:
        yield
    finally:
        for sig, handler in previous.items():
            if sig in handlers:
                signal.signal(sig, handler)
        for signum in came:  # (now: the caller cleans up after what it raises)
            handlers[signal.Signals(signum)](signum, None)


def _last_line(out: IO[bytes]) -> str:
    """The last non-empty line a child wrote to ``out`` (a file, read from its start), without
    a CLI's own ``error:`` prefix."""
    try:
        out.flush()
        out.seek(0)
        lines = out.read().decode("utf-8", "replace").strip().splitlines()
    except (OSError, ValueError):  # (not seekable or readable)
        return ""
    return lines[-1].strip().removeprefix("error: ") if lines else ""
