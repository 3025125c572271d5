"""Leases: a running model's claim on the version it loaded, so ``justllm rm`` leaves it alone.

A process that holds a model creates ``ROOT/leases/<hex>.<pid>.<n>`` and keeps an exclusive
``flock`` on it while the model is loaded. The kernel drops the lock when the process ends,
however it ends (a crash, SIGKILL), so a lease file nobody has locked is stale, whatever its pid
says (pids are reused), and whoever finds one deletes it. The pid in the name is for messages.
Where there is no ``flock`` (Windows) the pid alone is checked.

The registry takes leases and checks them under its lock, so a lease cannot be taken on a
version between ``rm``'s check and its delete.
"""

from __future__ import annotations

import contextlib
import os
import secrets
from pathlib import Path

try:
    import fcntl
except ImportError:
    fcntl = None  # type: ignore[assignment]

LEASE_DIR = "leases"


class Lease:
    """One held lease; ``release()`` (or the end of the process) gives it up."""

    def __init__(self, file: Path, fd: int) -> None:
        self.file = file
        self._fd: int | None = fd

    def release(self) -> None:
        if self._fd is None:
            return
        with contextlib.suppress(OSError):
            self.file.unlink()
        os.close(self._fd)
        self._fd = None


def acquire_lease(root: Path, hex_digest: str) -> Lease:
    """A new lease on version ``hex_digest`` for this process (call under the registry lock)."""
    folder = root / LEASE_DIR
    folder.mkdir(parents=True, exist_ok=True)
    file = folder / f"{hex_digest}.{os.getpid()}.{secrets.token_hex(4)}"
    fd = os.open(file, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    if fcntl is not None:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # a new file: never contended
    return Lease(file, fd)


def release_lease(lease: Lease) -> None:
    lease.release()


def holders(root: Path, hex_digest: str) -> list[int]:
    """The pids with a live lease on ``hex_digest`` (stale lease files are deleted)."""
    pids = set()
    for file in (root / LEASE_DIR).glob(f"{hex_digest}.*"):
        pid_text = file.name.split(".")[1]
        pid = int(pid_text) if pid_text.isdigit() else 0
        if _held(file, pid):
            pids.add(pid)
    return sorted(pids)


def _held(file: Path, pid: int) -> bool:
    if fcntl is None:
        if not (alive := pid_alive(pid)):
            file.unlink(missing_ok=True)
        return alive
    try:
        fd = os.open(file, os.O_RDONLY)
    except FileNotFoundError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    else:
        file.unlink(missing_ok=True)  # stale: its holder is gone
        return False
    finally:
        os.close(fd)


def pid_alive(pid: int) -> bool:
    """Whether process ``pid`` runs (another user's counts)."""
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:
        return True  # alive, but another user's
    return True


def sweep_dead(folder: Path, pattern: str) -> None:
    """Remove the temporary files matching ``pattern`` (``NAME-PID`` at the end) in ``folder``
    whose process is gone: what a killed quantization or conversion left."""
    for old in folder.glob(pattern):
        pid = old.name.rpartition("-")[2]
        if pid.isdigit() and int(pid) != os.getpid() and not pid_alive(int(pid)):
            old.unlink(missing_ok=True)


def publish(tmp: Path, dst: Path, *, force: bool) -> None:
    """Move the finished ``tmp`` to ``dst``. Without ``force`` the output must still be
    missing: another run to the same output, checked before it as this one was, may have
    finished first (both said they wrote it, and the later rename silently replaced the
    earlier's file). A hard link checks and moves in one step; on a file system without
    hard links the check comes just before the rename. (Quantize, convert and ``draft make``.)"""
    if force:
        os.replace(tmp, dst)
        return
    try:
        os.link(tmp, dst)
    except FileExistsError:
        raise ValueError(f"{dst} already exists (--force overwrites it): another run wrote "
                         "it while this one ran") from None
    except OSError:  # (no hard links here: FAT, some network file systems)
        if os.path.lexists(dst):
            raise ValueError(f"{dst} already exists (--force overwrites it): another run "
                             "wrote it while this one ran") from None
        os.replace(tmp, dst)
        return
    tmp.unlink()
