"""Which partial downloads a pull sweeps (justllm/models/hub.py ``sweep_partials``): only
those of a process that is gone, never a running download's."""

from __future__ import annotations

import fcntl
import os
import time
from pathlib import Path

from justllm.models.hub import sweep_partials


def _download_dir(repo_dir: Path, commit: str) -> Path:
    folder = repo_dir / commit / ".cache" / "huggingface" / "download"
    folder.mkdir(parents=True)
    return folder


def _partial(folder: Path, file: str, *, lock: bool = True) -> Path:
    """A partial download of ``file`` named as huggingface_hub 2.x names it, with its lock
    file (``FILE.lock``) unless ``lock`` is False."""
    from huggingface_hub._local_folder import _short_hash

    if lock:
        (folder / f"{file}.lock").touch()
    part = folder / f"{_short_hash(file + '.metadata')}.{'ab' * 32}.1234abcd.incomplete"
    part.write_bytes(b"half a model")
    return part


def test_only_partials_no_running_download_holds_and_older_than_the_pull_go(
        tmp_path: Path) -> None:
    repo_dir = tmp_path / "huggingface" / "acme" / "tiny-GGUF"
    old = _download_dir(repo_dir, "c1")
    abandoned = _partial(old, "a.gguf")
    running = _partial(old, "b.gguf")
    no_lock = _partial(old, "c.gguf", lock=False)
    newer = _partial(_download_dir(repo_dir, "c2"), "a.gguf")
    started = time.time_ns()
    os.utime(newer, ns=(started + 10**9, started + 10**9))  # written after this pull began
    fd = os.open(old / "b.gguf.lock", os.O_RDWR)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)  # as huggingface_hub holds it while it downloads
        assert sweep_partials(repo_dir, started) == [abandoned]
    finally:
        os.close(fd)
    assert not abandoned.exists() and running.exists() and no_lock.exists() and newer.exists()
    assert sweep_partials(repo_dir, started) == [running]  # its process is gone now
    assert sweep_partials(tmp_path / "no-such-repo", started) == []
