"""Long C-level work (llama.cpp's quantizer, the converter's child) with a progress display:
the work runs on a thread so the main thread stays free for Ctrl-C."""

from __future__ import annotations

import contextlib
import os
import signal
import threading
from collections.abc import Callable, Iterator

from rich.console import Console
from rich.progress import Progress


class _Terminated(Exception):
    """SIGTERM arrived (a supervisor, ``kill``, ``timeout``), or SIGHUP (the terminal or the
    SSH session closed)."""


def _terminate(signum: int, frame: object) -> None:
    raise _Terminated(signum)


def run_interruptible(work: Callable[[], None], abandon: Callable[[], None],
                      progress: Progress, name: str) -> None:
    """``work()`` on a daemon thread; its exception is raised here. On Ctrl-C, SIGTERM or SIGHUP,
    ``abandon()`` (remove temporary files, stop children) and exit 128 + the signal at once: a
    llama.cpp call in C cannot be stopped, so the process ends under it. (SIGTERM's default
    ended the process without ``abandon()``, leaving the temporary output behind.)"""
    result: dict[str, BaseException] = {}

    def run() -> None:
        try:
            work()
        except BaseException as e:  # re-raised on the main thread
            result["error"] = e

    worker = threading.Thread(target=run, name=name, daemon=True)
    main = threading.current_thread() is threading.main_thread()
    previous = ({sig: signal.signal(sig, _terminate) for sig in (signal.SIGTERM, signal.SIGHUP)}
                if main else {})
    worker.start()
    try:
        while worker.is_alive():
            worker.join(0.1)
    except (KeyboardInterrupt, _Terminated) as e:
        abandon()
        progress.stop()
        how = "interrupted" if isinstance(e, KeyboardInterrupt) else "terminated"
        Console(stderr=True, emoji=False).print(f"[yellow]{how}[/yellow]: no output written")
        os._exit(130 if isinstance(e, KeyboardInterrupt) else 128 + e.args[0])
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    if "error" in result:
        raise result["error"]


@contextlib.contextmanager
def terminable() -> Iterator[None]:
    """For Python work on the main thread (``draft make``'s writer): SIGTERM and SIGHUP
    raise in it as Ctrl-C does, so its own cleanup runs (SIGTERM's default ended the process
    and left the partial file), then the process exits 128 + the signal."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = {sig: signal.signal(sig, _terminate) for sig in (signal.SIGTERM, signal.SIGHUP)}
    try:
        yield
    except _Terminated as e:
        Console(stderr=True, emoji=False).print("[yellow]terminated[/yellow]: no output written")
        raise SystemExit(128 + e.args[0]) from None
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
