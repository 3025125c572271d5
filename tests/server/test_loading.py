"""/health is 503 while the model loads, 200 after; /v1 routes say 'loading' meanwhile; a model
that fails to load ends `justllm serve` with one error line; a server stopped while its model
loads (Ctrl-C as it starts) stops the load and waits for it."""

import signal
import subprocess
import sys
import threading
import time
import weakref

import httpx
import pytest
from litestar.testing import TestClient

from justllm.config import EngineConfig
from justllm.engine.async_engine import AsyncEngine
from justllm.engine.engine import Engine
from justllm.errors import LoadCancelled
from justllm.server.app import ServerConfig, create_app
from tests.helpers import default_sigint
from tests.server.conftest import free_port


def test_health_while_loading(model_path):
    release = threading.Event()

    def loader(cancelled):
        release.wait(timeout=60)
        return AsyncEngine(Engine(EngineConfig(model=model_path, max_seqs=2, pool_blocks=32)))

    app = create_app(None, ServerConfig(), loader=loader)
    with TestClient(app) as client:
        assert client.get("/health").status_code == 503
        r = client.get("/v1/models")
        assert r.status_code == 503 and r.json()["error"]["code"] == "model_loading"
        release.set()
        for _ in range(600):
            if client.get("/health").status_code == 200:
                break
            threading.Event().wait(0.05)
        assert client.get("/health").status_code == 200
        assert client.get("/v1/models").json()["data"][0]["id"] == "gemma-3-270m-q4_k_m"


def test_a_model_that_fails_to_load_ends_serve_with_one_error_line(model_path, tmp_path):
    corrupt = tmp_path / "truncated.gguf"
    with open(model_path, "rb") as f:
        corrupt.write_bytes(f.read(1_000_000))  # a valid header, then nothing
    port = free_port()
    proc = subprocess.run([sys.executable, "-m", "justllm", "serve", str(corrupt), "--port",
                           str(port)], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "truncated.gguf" in errors[0], proc.stderr
    assert "Traceback" not in proc.stderr


def test_a_server_stopped_while_its_model_loads_stops_the_load_and_waits_for_it(model_path):
    """The process must not exit while the loader thread is inside llama.cpp: it crashed
    (SIGSEGV) when Ctrl-C stopped a server whose model was still loading."""
    outcome: list[str] = []

    def loader(cancelled):
        deadline = time.monotonic() + 30
        while not cancelled() and time.monotonic() < deadline:  # the server stops first
            time.sleep(0.01)
        try:
            return AsyncEngine(Engine(EngineConfig(model=model_path, max_seqs=2,
                                                   pool_blocks=32), cancel=cancelled))
        except LoadCancelled:
            outcome.append("cancelled")
            raise

    app = create_app(None, ServerConfig(), loader=loader)
    with TestClient(app) as client:
        assert client.get("/health").status_code == 503
    thread, cancelled = app.state["loading"]
    assert not thread.is_alive() and cancelled.is_set()  # waited for, not left running
    assert outcome == ["cancelled"] and app.state["served"] is None
    assert "load_error" not in app.state  # a stop asked for is not a failed load


def test_a_load_that_ends_as_the_server_stops_is_closed_not_served(model_path):
    closed: list[AsyncEngine] = []

    class Recorded(AsyncEngine):
        def close(self) -> None:
            closed.append(self)
            super().close()

    def loader(cancelled):
        engine = Recorded(Engine(EngineConfig(model=model_path, max_seqs=2, pool_blocks=32)))
        deadline = time.monotonic() + 30
        while not cancelled() and time.monotonic() < deadline:  # loaded; then the stop
            time.sleep(0.01)
        return engine

    app = create_app(None, ServerConfig(), loader=loader)
    with TestClient(app):
        pass
    assert len(closed) == 1 and app.state["served"] is None


@pytest.mark.parametrize("when", ["loading", "banner"])
def test_ctrl_c_as_serve_starts_ends_it_cleanly(model_path, when):
    """Ctrl-C while the model loads behind a listening server, or just as the banner is
    printed (before the server's own handlers are in): the command ends, 0 or 130, without a
    crash, a traceback or a Ctrl-C that was dropped. (A background job ignores SIGINT, and
    the process would inherit that: reset to the terminal's default here.)"""
    port = free_port()
    cmd = [sys.executable, "-m", "justllm", "serve", model_path, "--port", str(port)]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                            preexec_fn=default_sigint)
    try:
        if when == "banner":
            assert proc.stderr is not None
            line = proc.stderr.readline()
            assert b"serving" in line, line
        else:
            deadline = time.monotonic() + 60
            with httpx.Client() as http:
                while time.monotonic() < deadline:
                    try:
                        if http.get(f"http://127.0.0.1:{port}/health").status_code == 503:
                            break
                    except httpx.TransportError:
                        pass
                    time.sleep(0.005)
                else:
                    pytest.fail("the server never answered 503 while loading")
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=30)
        text = err.decode(errors="replace")
        assert proc.returncode in (0, 130), (proc.returncode, text)
        assert "Traceback" not in text and "Exception ignored" not in text, text
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_a_ctrl_c_that_python_drops_still_stops_the_server(monkeypatch):
    """Python raises KeyboardInterrupt at the next bytecode after Ctrl-C; in a weakref
    callback it prints it and drops it, and `justllm serve` started and served on. serve's
    Interrupts remembers it, and the server stops as its own handlers go in."""
    import uvicorn

    from justllm.cli.serve import Interrupts, _Server

    dropped: list[type] = []
    monkeypatch.setattr(sys, "unraisablehook", lambda u: dropped.append(u.exc_type))

    class Thing:
        pass

    previous = signal.signal(signal.SIGINT, signal.default_int_handler)  # as at a terminal
    try:
        thing = Thing()
        ref = weakref.ref(thing, lambda _: signal.raise_signal(signal.SIGINT))
        with Interrupts() as interrupts:
            del thing  # the Ctrl-C lands in the callback
            assert ref() is None and dropped == [KeyboardInterrupt] and interrupts.came
            server = _Server(uvicorn.Config(app=None), interrupts=interrupts)
            assert not server.should_exit
            with server.capture_signals():
                assert server.should_exit
        assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
        with Interrupts() as interrupts, pytest.raises(KeyboardInterrupt):
            signal.raise_signal(signal.SIGINT)  # elsewhere it is raised as before
        assert interrupts.came
    finally:
        signal.signal(signal.SIGINT, previous)


def test_an_ignored_ctrl_c_stays_ignored():
    """A background job (`justllm serve &`) inherits an ignored SIGINT: serve keeps it so."""
    from justllm.cli.serve import Interrupts

    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        with Interrupts() as interrupts:
            assert signal.getsignal(signal.SIGINT) is signal.SIG_IGN
            signal.raise_signal(signal.SIGINT)
        assert not interrupts.came and signal.getsignal(signal.SIGINT) is signal.SIG_IGN
    finally:
        signal.signal(signal.SIGINT, previous)


def test_an_early_load_is_taken_over_or_stopped_and_closed():
    """serve starts its model's load before it imports the web framework (EarlyLoad); the
    app takes it over as it starts, and serve stops it on its way out, whatever happened."""
    from justllm.server.loading import EarlyLoad

    closed: list[str] = []
    go = threading.Event()

    def load(cancelled):
        go.wait(10)
        if cancelled():
            raise LoadCancelled("stopped")
        return "engine"

    taken = EarlyLoad(load, closed.append).start()
    go.set()
    assert taken.take(lambda: False) == "engine"
    taken.stop()
    assert closed == []  # the app owns what it took

    go.clear()
    saw: list[bool] = []

    def load_then_check(cancelled):
        go.wait(10)
        saw.append(cancelled())
        return "made anyway"

    untaken = EarlyLoad(load_then_check, closed.append).start()
    stopper = threading.Thread(target=untaken.stop)
    stopper.start()
    time.sleep(0.05)
    assert stopper.is_alive()  # stop() waits for the load
    go.set()
    stopper.join(10)
    assert not stopper.is_alive() and saw == [True] and closed == ["made anyway"]
    with pytest.raises(LoadCancelled):
        untaken.take(lambda: False)  # nothing to take once stopped


def test_a_second_ctrl_c_while_serve_waits_for_its_early_load_waits_on():
    """A first Ctrl-C before the app ran sends serve to EarlyLoad.stop(); a second one broke
    out of its wait, and the process exited with llama.cpp loading on the other thread. It is
    held now, and given to serve's handler (it raises, and remembers) once the load ended and
    what it made is closed."""
    from justllm.cli.serve import Interrupts
    from justllm.server.loading import EarlyLoad

    closed: list[str] = []

    def deaf_load(cancelled):  # as llama.cpp's vocabulary read: it cannot be cut short
        time.sleep(1.0)
        return "engine"

    previous = signal.signal(signal.SIGINT, signal.default_int_handler)  # as at a terminal
    try:
        with Interrupts() as interrupts:
            load = EarlyLoad(deaf_load, closed.append).start()
            timer = threading.Timer(0.3, signal.raise_signal, (signal.SIGINT,))
            timer.start()
            with pytest.raises(KeyboardInterrupt):
                load.stop()
            timer.join()
            assert not load._thread.is_alive() and closed == ["engine"] and interrupts.came
            assert signal.getsignal(signal.SIGINT) == interrupts._handle  # put back
    finally:
        signal.signal(signal.SIGINT, previous)


def test_an_early_loads_taker_can_cancel_it_and_gets_its_error():
    from justllm.server.loading import EarlyLoad

    def until_cancelled(cancelled):
        deadline = time.monotonic() + 10
        while not cancelled() and time.monotonic() < deadline:
            time.sleep(0.01)
        raise LoadCancelled("stopped")

    load = EarlyLoad(until_cancelled, lambda _: None).start()
    with pytest.raises(LoadCancelled):
        load.take(lambda: True)  # the app's server stopped: the take cancels the load
    load.stop()

    def broken(cancelled):
        raise ValueError("not a model")

    with pytest.raises(ValueError, match="not a model"):
        EarlyLoad(broken, lambda _: None).start().take(lambda: False)


def test_an_early_load_of_a_real_model_stops_when_serve_ends_before_the_app(model_path):
    from justllm.server.loading import EarlyLoad

    closed: list[AsyncEngine] = []
    load = EarlyLoad(lambda cancelled: AsyncEngine(Engine(
        EngineConfig(model=model_path, max_seqs=2, pool_blocks=32), cancel=cancelled)),
        closed.append).start()
    load.stop()  # at once: the load is cancelled, or, if it already ended, closed
    assert not load._thread.is_alive()
    assert len(closed) == 1 or isinstance(load._error, LoadCancelled)
    for engine in closed:
        engine.close()
