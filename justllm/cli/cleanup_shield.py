"""Ctrl-C during a command that must undo what it started when it is interrupted (`justllm
cluster deploy` stopping the Ray head it started): the first Ctrl-C interrupts it as ever; one
that comes while it undoes its work is said once on stderr and does not cut the undoing short.
A second Ctrl-C left the Ray head and the app running: it interrupted the head's stop.
"""

from __future__ import annotations

import signal
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from types import FrameType
from typing import Self


class SigintHandler:
    """A ``with`` that puts ``_handle`` in for SIGINT and Python's own handler back after:
    only in the main thread, and only where SIGINT has Python's own handler (a background
    job's ignored SIGINT stays ignored)."""

    _installed = False

    def __enter__(self) -> Self:
        if (threading.current_thread() is threading.main_thread()
                and signal.getsignal(signal.SIGINT) is signal.default_int_handler):
            signal.signal(signal.SIGINT, self._handle)
            self._installed = True
        return self

    def __exit__(self, *exc: object) -> None:
        if self._installed:
            signal.signal(signal.SIGINT, signal.default_int_handler)

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        raise NotImplementedError


class CleanupShield(SigintHandler):
    """For a ``with`` around the command. ``shielded()`` is a context for its cleanup: SIGINT
    within it calls ``say`` (once) instead of raising KeyboardInterrupt. Outside it, SIGINT
    raises as Python's own handler does."""

    def __init__(self, say: Callable[[], None]) -> None:
        self._say = say
        self._cleaning = 0
        self._told = False

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        if not self._cleaning:
            raise KeyboardInterrupt
        if not self._told:
            self._told = True
            self._say()

    @contextmanager
    def shielded(self) -> Iterator[None]:
        self._cleaning += 1
        try:
            yield
        finally:
            self._cleaning -= 1
