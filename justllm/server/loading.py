"""A model load started before the web framework is imported, for the app to take over.

``justllm serve`` spends about 0.3 s importing Litestar and building its app, and llama.cpp
reads the model on its own thread meanwhile (a ctypes call lets go of the GIL): the model is
ready that much sooner. This module imports no web framework for that reason.
"""

from __future__ import annotations

import contextlib
import signal
import threading
from collections.abc import Callable, Iterator
from typing import Generic, TypeVar

from justllm.errors import LoadCancelled

T = TypeVar("T")

# How often a caller waiting in take() looks at its own cancel flag (seconds).
_POLL = 0.05


class EarlyLoad(Generic[T]):
    """``load(cancelled)`` on a thread of its own from :meth:`start`. :meth:`take` hands its
    result over once (create_app's loader, which passes its own ``cancelled`` on). Whoever
    started it calls :meth:`stop` when done, even on an error: a load that nobody took is
    cancelled and waited for (the process must not exit while llama.cpp works on another
    thread), and what it made is closed with ``close``."""

    def __init__(self, load: Callable[[Callable[[], bool]], T],
                 close: Callable[[T], None]) -> None:
        self._load = load
        self._close = close
        self._cancelled = threading.Event()
        self._done = threading.Event()
        self._result: T | None = None
        self._error: BaseException | None = None
        self._taken = False
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._work, name="justllm-early-load",
                                        daemon=True)

    def start(self) -> EarlyLoad[T]:
        self._thread.start()
        return self

    def _work(self) -> None:
        try:
            self._result = self._load(self._cancelled.is_set)
        except BaseException as e:  # handed to take()'s caller
            self._error = e
        finally:
            self._done.set()

    def take(self, cancelled: Callable[[], bool]) -> T:
        """The load's result (or its exception) once it ends; ``cancelled()`` turning True
        meanwhile cancels it (LoadCancelled). Only once."""
        while not self._done.wait(_POLL):
            if cancelled():
                self._cancelled.set()
        with self._lock:
            if self._taken:
                raise LoadCancelled("the load was taken or stopped before")
            self._taken = True
        if self._error is not None:
            raise self._error
        assert self._result is not None
        return self._result

    def stop(self) -> None:
        """Cancel the load unless it was taken, wait for its thread, and close what it made
        if nobody took it."""
        with self._lock:
            if self._taken:
                return
            self._taken = True  # (take() after this refuses)
            self._cancelled.set()
        with _ctrl_c_deferred():  # (a second Ctrl-C must not end the wait: it ends the process)
            self._thread.join()
            if self._result is not None:
                self._close(self._result)


@contextlib.contextmanager
def _ctrl_c_deferred() -> Iterator[None]:
    """Ctrl-C held until the block ends, then given to the SIGINT handler that was there
    (serve's Interrupts: it raises KeyboardInterrupt and remembers it). Without this a second
    Ctrl-C during stop() broke out of the wait and the process exited with llama.cpp still
    loading on the other thread (and an interrupted join() leaves a thread looking stopped).
    Only on the main thread and under a Python handler: an ignored SIGINT stays ignored."""
    previous = signal.getsignal(signal.SIGINT)
    if threading.current_thread() is not threading.main_thread() or not callable(previous):
        yield
        return
    came: list[int] = []
    signal.signal(signal.SIGINT, lambda signum, frame: came.append(signum))
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)
        if came:
            previous(signal.SIGINT, None)
