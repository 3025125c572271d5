"""Long C-level work (llama.cpp's quantizer, the converter's child) with a progress display:
the work runs on a thread so the main thread stays free for Ctrl-C."""

from __future__ import annotations

import os
import threading
from collections.abc import Callable

from rich.console import Console
from rich.progress import Progress


def run_interruptible(work: Callable[[], None], abandon: Callable[[], None],
                      progress: Progress, name: str) -> None:
    """``work()`` on a daemon thread; its exception is raised here. On Ctrl-C, ``abandon()``
    (remove temporary files, stop children) and exit 130 at once: a llama.cpp call in C
    cannot be stopped, so the process ends under it."""
    result: dict[str, BaseException] = {}

    def run() -> None:
        try:
            work()
        except BaseException as e:  # re-raised on the main thread
            result["error"] = e

    worker = threading.Thread(target=run, name=name, daemon=True)
    worker.start()
    try:
        while worker.is_alive():
            worker.join(0.1)
    except KeyboardInterrupt:
        abandon()
        progress.stop()
        Console(stderr=True, emoji=False).print("[yellow]interrupted[/yellow]: no output written")
        os._exit(130)
    if "error" in result:
        raise result["error"]
