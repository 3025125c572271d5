"""Shared fixtures: the real demo model through the real llama.cpp (never skipped)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from justllm.config import EngineConfig

# Every engine the tests start (in this process or as a server) checks after each step that
# llama.cpp's KV is what the scheduler believes (justllm/core/kv_view.py).
os.environ["JUSTLLM_CHECK_KV"] = "1"
# The core tests load no installed plugin (plugins/*/tests test theirs; tests/plugins registers
# its own): a plugin in the venv must not change what they see.
os.environ["JUSTLLM_PLUGINS"] = ""
# JUSTLLM_GPU=1 is the suite's own switch to the GPU (benchmarks/gpu_check.sh sets it): every
# engine and server the tests start offloads then, and tests.helpers.ON_GPU says so.
KEEP_ENV = {"JUSTLLM_CACHE_DIR", "JUSTLLM_CHECK_KV", "JUSTLLM_PLUGINS", "JUSTLLM_GPU"}


def _share_httpx_ssl_context() -> None:
    """httpx builds a new SSL context from certifi's bundle for every client it makes, about
    50 ms of CPU, and ``httpx.get``/``post`` make one per call: the tests make thousands (a
    server's start is polled every 50 ms), each on the core the server under test runs on
    (pytest_configure). The tests talk plain HTTP to 127.0.0.1, so every default client shares
    one context here (httpx's own module attribute: where a later httpx moves it, this does
    nothing and the tests are only slower)."""
    import functools

    import httpx._transports.default as transport

    make = transport.create_ssl_context
    shared = functools.cache(lambda trust_env: make(trust_env=trust_env))

    def create_ssl_context(verify=True, cert=None, trust_env=True):
        if verify is True and cert is None:
            return shared(trust_env)
        return make(verify=verify, cert=cert, trust_env=trust_env)

    transport.create_ssl_context = create_ssl_context


# The slowest files (measured under xdist, slowest first), collected first: pytest-xdist hands
# out whole files in collection order (--dist loadfile; its own reordering by test count is
# turned off in pytest_configure), so the long ones start at once and no worker is left alone
# with one at the end. Other files keep their order.
SLOW_FIRST = (
    "tests/cluster/test_ray_cluster.py", "tests/engine/test_prefix_cache.py",
    "tests/engine/test_kv_stress.py", "tests/gateway/test_gateway.py",
    "tests/gateway/test_replicas.py", "tests/server/test_schemathesis.py",
    "tests/engine/test_engine.py", "tests/gateway/test_pd.py", "tests/server/test_soak.py",
    "tests/spec/test_spec_engine.py", "tests/server/test_reliability.py",
    "tests/test_architecture.py",
)


def pytest_collection_modifyitems(items):
    rank = {path: i for i, path in enumerate(SLOW_FIRST)}
    items.sort(key=lambda item: rank.get(item.nodeid.split("::", 1)[0], len(rank)))


def pytest_configure(config):
    """Under pytest-xdist each worker runs on its own share of the CPUs (the processes it
    starts inherit it), and llama.cpp's threads follow that share (config.usable_cpus): two
    workers' threads on the same cores would spin waiting for each other.

    Before any worker starts, justllm's and the plugins' bytecode is written once: an editable
    install has none (pip compiles only what it copies), and where ``PYTHONDONTWRITEBYTECODE``
    is set no process writes it, so each of the few hundred Python processes the suite starts
    (servers, runners, CLI calls, Ray workers) would compile justllm's sources again, ~0.2 s
    of CPU each on a 2-core Xeon."""
    _share_httpx_ssl_context()
    if not os.environ.get("PYTEST_XDIST_WORKER"):
        _compile_bytecode()
    if hasattr(config.option, "loadscopereorder"):
        config.option.loadscopereorder = False  # keep SLOW_FIRST's order
    worker, count = os.environ.get("PYTEST_XDIST_WORKER"), os.environ.get(
        "PYTEST_XDIST_WORKER_COUNT")
    if worker and count and hasattr(os, "sched_setaffinity"):
        cpus = sorted(os.sched_getaffinity(0))
        share = cpus[int(worker.removeprefix("gw")) % len(cpus)::int(count)]
        os.sched_setaffinity(0, share or cpus)


def _compile_bytecode() -> None:
    import compileall
    import re

    import justllm

    roots = [Path(justllm.__file__).parent, Path(__file__).parent.parent / "plugins"]
    for root in roots:
        if root.is_dir():  # (quiet=2: a read-only install, already compiled, says nothing)
            compileall.compile_dir(root, quiet=2, rx=re.compile(r"[/\\]tests[/\\]"))


@pytest.fixture(autouse=True)
def _no_user_config(tmp_path_factory, monkeypatch):
    """A user's ~/.config/justllm/config.yaml must not change what the tests run."""
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path_factory.mktemp("xdg-config")))
    for name in [n for n in os.environ if n.startswith("JUSTLLM_") and n not in KEEP_ENV]:
        monkeypatch.delenv(name)


@pytest.fixture
def python_ctrl_c():
    """Python's own Ctrl-C handler for the test, as at a terminal: a background job (a CI run
    started with ``&``) ignores SIGINT and Python then installs none, so a test's own SIGINT
    raised nothing there (tests/helpers.default_sigint is the same for a child process)."""
    import signal

    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, previous)


@pytest.fixture(scope="session")
def model_path() -> str:
    from justllm.models.source import demo_model_path

    return str(demo_model_path())


@pytest.fixture(scope="session")
def cli_draft6(model_path, tmp_path_factory):
    """``justllm draft make --layers 6`` of the demo model next to a (symlinked, writable)
    source, written once for the session (about 10 s: the gguf reader walks the 262k-token
    vocabulary): (source, draft, the CLI's output). tests/models/test_draft.py checks it,
    tests/spec speculates with it."""
    from typer.testing import CliRunner

    from justllm.cli import app

    src = tmp_path_factory.mktemp("draft") / "gemma.gguf"
    os.symlink(model_path, src)
    result = CliRunner().invoke(app, ["draft", "make", str(src), "--layers", "6"])
    assert result.exit_code == 0, result.output
    return src, src.with_name("gemma-draft-L6.gguf"), result.output


@pytest.fixture(scope="session")
def engine(model_path):
    """One shared engine; tests must leave it idle (every request finished or aborted)."""
    from justllm.engine.engine import Engine

    eng = Engine(EngineConfig(model=model_path, max_seqs=16, pool_blocks=512))
    yield eng
    eng.close()
