"""The Ray head `justllm cluster deploy` starts on this machine when no cluster is named
(no ``RAY_ADDRESS``, no Ray started here with ``ray start``), and `justllm cluster down`
stops. No ``ray`` import: the head is a process.

It must outlive the command that starts it (the Serve app on it is detached), so it is
``ray start --head --block`` in a session of its own: the ``--block`` process owns every Ray
process of the head (GCS, raylet, workers) and stops them all on SIGTERM. Its pid, address and
log are recorded in justllm's cache directory (``cluster/local-ray.json``); only a head
recorded there is ever stopped, by that pid and then by its session (stragglers get SIGKILL),
never by name. Its ports are free ones (two such heads, or a user's own Ray, do not collide),
and the clients justllm points at it use 127.0.0.1. It is this machine's cluster: a cluster of
several machines is started by the user (``ray start --head``, then ``ray start --address`` on
the others; see the README's "More than one machine") and found through ``RAY_ADDRESS`` or
Ray's own record of the last ``ray start`` here.
"""

from __future__ import annotations

import fcntl
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from dataclasses import asdict, dataclass
from pathlib import Path

from justllm.errors import JustLLMError
from justllm.gateway.runner import free_ports
from justllm.models.source import cache_dir

STARTED = "Ray runtime started"
# Logs of earlier heads kept beside a new one's (one file per head ever started, named by its
# port: they only grew in number).
KEPT_LOGS = 4


class RayUnavailable(JustLLMError):
    """No Ray to connect to, or a head that would not start."""


@dataclass(frozen=True)
class LocalHead:
    pid: int  # the `ray start --block` process, leader of the head's session
    address: str  # its GCS, host:port
    log: str


def record_path() -> Path:
    return cache_dir() / "cluster" / "local-ray.json"


def reachable(address: str, timeout: float = 2.0) -> bool:
    """Something accepts TCP connections at ``host:port`` (or ``ray://host:port``)."""
    host, _, port = address.removeprefix("ray://").rpartition(":")
    if not host or not port.isdigit():
        return False
    try:
        with socket.create_connection((host, int(port)), timeout=timeout):
            return True
    except OSError:
        return False


def _is_head(pid: int, address: str | None = None) -> bool:
    """``pid`` is still a `ray start ... --block` process (not a reused pid), the one started
    at ``address`` when given (another `ray start --block` that took the pid is not ours:
    `down` stopped its whole session)."""
    try:
        argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    except OSError:
        try:
            os.kill(pid, 0)
        except OSError:
            return False
        return True  # no /proc (macOS): trust the pid
    if b"start" not in argv or b"--block" not in argv:
        return False
    if address is None:
        return True
    port = address.rpartition(":")[2].encode()
    return any(a == b"--port" and b == port for a, b in zip(argv, argv[1:]))


def recorded() -> LocalHead | None:
    """The head this machine's justllm started, if it is still running (a stale record is
    removed)."""
    path = record_path()
    try:
        head = LocalHead(**json.loads(path.read_text()))
    except (OSError, ValueError, TypeError):
        return None
    if _is_head(head.pid, head.address):
        return head
    path.unlink(missing_ok=True)
    return None


def user_head_address() -> str | None:
    """The head ``ray start`` last started on this machine, as ``ray.init()`` finds it (the
    address file in Ray's temp directory), if something answers there."""
    base = os.environ.get("RAY_TMPDIR") or (
        os.environ.get("TMPDIR") if sys.platform.startswith("linux") else None) or "/tmp"
    try:
        address = (Path(base) / "ray" / "ray_current_cluster").read_text().strip()
    except OSError:
        return None
    return address if address and reachable(address, 0.5) else None


def _ray_command() -> str:
    beside = Path(sys.executable).with_name("ray")
    found = str(beside) if beside.exists() else shutil.which("ray")
    if found is None:
        raise RayUnavailable("the `ray` command is not installed: pip install 'justllm[cluster]'")
    return found


def start_head(*, num_cpus: int | None = None, timeout: float = 120.0,
               shielded: Callable[[], AbstractContextManager[None]] = nullcontext
               ) -> LocalHead:
    """Start a head on 127.0.0.1 and record it; returns once Ray says it runs. A start that
    fails or is interrupted stops the head again, in ``shielded()`` (a second Ctrl-C)."""
    flags = ("--ray-client-server-port", "--dashboard-port", "--dashboard-agent-listen-port",
             "--dashboard-agent-grpc-port", "--runtime-env-agent-port", "--metrics-export-port")
    # Distinct: Ray refuses to start when two of its components are given the same port.
    port, *others = free_ports(1 + len(flags))
    log = record_path().with_name(f"local-ray-{port}.log")  # (one per head: two truncated one)
    log.parent.mkdir(parents=True, exist_ok=True)
    prune_logs(log.parent)
    args = [_ray_command(), "start", "--head", "--block", "--port", str(port),
            "--include-dashboard=false", "--disable-usage-stats", "--log-color", "false"]
    for flag, other in zip(flags, others):
        args += [flag, str(other)]
    if num_cpus is not None:
        args += ["--num-cpus", str(num_cpus)]
    with open(log, "wb") as out:
        proc = subprocess.Popen(args, stdin=subprocess.DEVNULL, stdout=out,
                                stderr=subprocess.STDOUT, start_new_session=True)
    head = LocalHead(proc.pid, f"127.0.0.1:{port}", str(log))
    deadline = time.monotonic() + timeout
    try:
        while STARTED not in log.read_text(errors="replace"):
            if proc.poll() is not None or time.monotonic() > deadline:
                lines = [x for x in log.read_text(errors="replace").splitlines() if x.strip()]
                raise RayUnavailable(f"a local Ray head did not start ({head.log}): "
                                     f"{lines[-1] if lines else 'no output'}")
            time.sleep(0.2)
    except BaseException:  # (Ctrl-C while it started left a head no record names)
        with shielded():
            _stop(head.pid, grace=5.0)
        raise
    record_path().write_text(json.dumps(asdict(head)))
    return head


def prune_logs(folder: Path, keep: int = KEPT_LOGS) -> None:
    """All but the newest ``keep`` earlier heads' logs in ``folder`` (a new head is started
    only when none recorded runs: start_lock; the last ones stay for a look back)."""
    def age(path: Path) -> float:
        try:
            return path.stat().st_mtime
        except OSError:
            return 0.0

    for old in sorted(folder.glob("local-ray-*.log"), key=age, reverse=True)[keep:]:
        old.unlink(missing_ok=True)


@contextmanager
def start_lock() -> Iterator[None]:
    """Held while a command finds the cluster and starts a local head if there is none: two
    deploys at once on a machine without Ray each started a head, and one was orphaned."""
    path = record_path().with_name("local-ray.lock")
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def _session(pid: int) -> list[int]:
    """Every process in ``pid``'s session (the head's Ray processes, its workers too)."""
    found = []
    for entry in Path("/proc").glob("[0-9]*"):
        try:
            fields = entry.joinpath("stat").read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        # (a zombie has ended: the head's leader is one until this process, which started
        # it, reaps it; counted, every stop here waited out its whole grace)
        if (len(fields) > 3 and int(fields[3]) == pid and fields[0] != "Z"
                and int(entry.name) != os.getpid()):
            found.append(int(entry.name))
    return found


def _stop(pid: int, grace: float) -> None:
    """SIGTERM the head's leader (Ray drains the node and stops its processes), then SIGKILL
    whatever of its session is left after ``grace`` seconds."""
    try:
        os.kill(pid, signal.SIGTERM)
    except ProcessLookupError:
        pass
    deadline = time.monotonic() + grace
    while time.monotonic() < deadline and (_is_head(pid) or _session(pid)):
        time.sleep(0.2)
    for left in _session(pid):
        try:
            os.kill(left, signal.SIGKILL)
        except ProcessLookupError:
            pass
    try:  # reap it if it is our child (a head started by this very process)
        os.waitpid(pid, os.WNOHANG)
    except ChildProcessError:
        pass


def stop_head(head: LocalHead, *, grace: float = 40.0) -> None:
    """Stop a recorded head and forget it. Ray drains a node with actors on it for up to
    30 s, so ``grace`` covers that; delete the Serve apps first and it takes a second."""
    _stop(head.pid, grace)
    record_path().unlink(missing_ok=True)
