"""Line editing for the chat's prompt: arrow keys, Ctrl-A/E, and history (up arrow), kept
between sessions in a file only the user can read.

Python's ``input()`` edits lines through GNU readline (or libedit) once the stdlib
``readline`` module is imported; without it a terminal sends arrow keys as escape sequences
that end up in the message.
"""

from __future__ import annotations

import contextlib
import io
import os
import sys
from collections.abc import Iterator
from pathlib import Path

HISTORY_LINES = 1000
NO_HISTORY = "JUSTLLM_NOHISTORY"  # set (1, true, yes, on): no history is read or written


def keeps_history() -> bool:
    """False when JUSTLLM_NOHISTORY asks for no history (as OLLAMA_NOHISTORY does)."""
    return os.environ.get(NO_HISTORY, "").strip().lower() not in ("1", "true", "yes", "on")


def history_file() -> Path:
    """Under justllm's cache dir (``JUSTLLM_CACHE_DIR``, else ``~/.cache/justllm``)."""
    from justllm.models.source import cache_dir

    return cache_dir() / "chat_history"


def piped_stdin() -> None:
    """A pipe's bytes that are not in the locale's encoding read as U+FFFD, not as an error
    that ended the chat (or run) and lost the good lines read with them."""
    if isinstance(sys.stdin, io.TextIOWrapper):
        sys.stdin.reconfigure(errors="replace")


@contextlib.contextmanager
def line_editing() -> Iterator[None]:
    """Editing and history for ``input()`` while the block runs, when stdin is a terminal (a
    pipe's lines are read as they are). The history is loaded from ``history_file()`` and
    saved back at the end, the file made private (0600): it holds what was typed; with
    JUSTLLM_NOHISTORY set, neither. A history that cannot be read or written is left alone,
    silently: editing still works."""
    if not sys.stdin.isatty():
        piped_stdin()
        yield
        return
    try:
        import readline
    except ImportError:  # a Python built without it (Windows): plain input()
        yield
        return
    if not keeps_history():  # the up arrow still recalls this session's lines
        yield
        return
    path = history_file()
    with contextlib.suppress(OSError):
        readline.read_history_file(path)
    readline.set_history_length(HISTORY_LINES)
    try:
        yield
    finally:
        with contextlib.suppress(OSError):
            _save(readline, path)


def _save(readline, path: Path) -> None:
    """Write the history, creating the file 0600 first, so it is never readable by others,
    not even between its creation and a chmod."""
    path.parent.mkdir(parents=True, exist_ok=True)
    os.close(os.open(path, os.O_WRONLY | os.O_CREAT, 0o600))
    os.chmod(path, 0o600)
    readline.write_history_file(path)
