"""``justllm top`` at 80x24 through Textual's pilot: a live server, and one that is down."""

from __future__ import annotations

import asyncio
import contextlib
import signal
import threading
import time
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import httpx
import pytest
from textual.widgets import DataTable, Digits, Sparkline, Static

from justllm.tui.top import TopApp
from tests.server.conftest import free_port, start_server
from tests.tui.pages import gateway_page

# About 300 tokens shared by both prompts, so the second one reuses the first one's KV blocks.
PREFIX = "The quick brown fox jumps over the lazy dog near the river bank. " * 22


async def _until(pilot, condition: Callable[[], bool], timeout: float = 15.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out waiting for the dashboard"
        await pilot.pause(0.05)


def _text(app: TopApp, selector: str) -> str:
    return str(app.query_one(selector, Static).content)


def _ratio(app: TopApp) -> str:
    return app.query_one("#hit-ratio", Digits).value


def _rows(app: TopApp) -> dict[str, list[str]]:
    table = app.query_one("#models", DataTable)
    return {key.value: [str(cell) for cell in table.get_row(key)] for key in table.rows}


def _fits(app: TopApp, *selectors: str) -> None:
    for selector in selectors:
        region = app.query_one(selector).region
        assert region.height >= 1 and region.bottom <= 24 and region.right <= 80, selector


PANELS = ("#hit-ratio", "#hit-detail", "#running", "#waiting", "#ttft-p50", "#ttft-p99", "#spec",
          "#kv-bar", "#kv-detail", "#tok-rate", "#tok-spark", "#status")


@pytest.mark.model
def test_live_server_hit_ratio_moves_pause_and_quit(model_path):
    # (no host memory: the shared 300-token prefix stays in the KV, and the cache panel shows it)
    server = start_server(model_path, "--max-seqs", "4", "--pool-blocks", "128",
                          "--cache-ram", "0")
    try:
        asyncio.run(_live(server))
    finally:
        assert server.stop() == 0


async def _live(server) -> None:
    app = TopApp(url=server.url, interval=0.2)
    async with app.run_test(size=(80, 24)) as pilot:
        await _until(pilot, lambda: app.snapshot is not None and not app.snapshot.empty)
        assert "connected" in _text(app, "#status")
        assert server.model in _text(app, "#status")
        before = _ratio(app)
        assert before == "0.0%"  # a fresh server: no requests yet
        assert _text(app, "#running").split() == ["running", "0"]
        assert _text(app, "#ttft-p50").split() == ["TTFT", "p50", "-"]

        async with httpx.AsyncClient(base_url=server.url, timeout=60) as client:
            for question in ("What is the fox doing?", "Where is the dog?"):
                r = await client.post("/v1/completions", json={
                    "model": server.model, "prompt": PREFIX + question, "max_tokens": 2,
                    "temperature": 0})
                assert r.status_code == 200, r.text
        await _until(pilot, lambda: app.snapshot.hits and _ratio(app) != before)
        after = _ratio(app)
        assert after != before and float(after.rstrip("%")) > 0
        assert _text(app, "#hit-detail") == "hits 1 · misses 1"
        assert "ms" in _text(app, "#ttft-p50") or " s" in _text(app, "#ttft-p50")
        assert app.snapshot.kv_total == 128 and app.snapshot.cache_blocks > 0
        assert 0 < app.snapshot.generation_tokens <= 4  # two requests, max_tokens 2

        # Everything fits on an 80x24 screen; one model: no models table.
        _fits(app, *PANELS)
        assert not app.query_one("#models-panel").display

        await pilot.press("p")
        assert app.paused and app.query_one("#paused").display
        assert "PAUSED" in _text(app, "#paused")
        polls = app.polls
        await pilot.pause(0.6)
        assert app.polls == polls  # no polling while paused
        await pilot.press("p")
        assert not app.paused and not app.query_one("#paused").display
        await _until(pilot, lambda: app.polls > polls)

        await pilot.press("q")
        await pilot.pause()
        assert app.return_code == 0
    assert not app.is_running


def test_server_down_says_so_and_keeps_polling():
    asyncio.run(_down())


async def _down() -> None:
    url = f"http://127.0.0.1:{free_port()}"
    app = TopApp(url=url, interval=0.2)
    async with app.run_test(size=(80, 24)) as pilot:
        await _until(pilot, lambda: app.polls >= 1 and "cannot reach" in _text(app, "#status"))
        assert f"cannot reach {url}" in _text(app, "#status")
        polls = app.polls
        await _until(pilot, lambda: app.polls >= polls + 3)  # still polling, still alive
        assert app.is_running and app.return_code is None
        assert f"cannot reach {url}" in _text(app, "#status")
        assert _ratio(app) == "-"
        assert _text(app, "#ttft-p99").split() == ["TTFT", "p99", "-"]
        assert _text(app, "#spec").split() == ["spec", "accept", "-"]
        await pilot.press("ctrl+c")  # quits, as in top (Textual's own only said to press ^q)
        await pilot.pause()
    assert app.return_code == 0 and not app.is_running


def test_sigterm_ends_top_and_gives_the_terminal_back(tmp_path):
    """Its default ended the process with the alternate screen and mouse reporting on."""
    import os
    import pty
    import subprocess
    import sys

    leader, follower = pty.openpty()
    proc = subprocess.Popen([sys.executable, "-m", "justllm", "top", "--url",
                             f"http://127.0.0.1:{free_port()}"], stdin=follower, stdout=follower,
                            stderr=follower, env={**os.environ, "TERM": "xterm-256color"})
    os.close(follower)
    out = b""
    try:
        deadline = time.monotonic() + 60
        while b"cannot reach" not in out:  # running, its first poll shown
            assert time.monotonic() < deadline, out[-300:]
            out += os.read(leader, 65536)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 0
        with contextlib.suppress(OSError):
            while chunk := os.read(leader, 65536):
                out += chunk
    finally:
        proc.kill()
        os.close(leader)
    assert b"\x1b[?1049l" in out  # the screen given back


def test_cli_command_help_and_bad_url():
    import typer
    from typer.testing import CliRunner

    from justllm.cli.top import top

    cli = typer.Typer()
    cli.command()(top)
    result = CliRunner().invoke(cli, ["--help"])
    assert result.exit_code == 0
    for option in ("--url", "--interval", "--api-key"):
        assert option in result.output
    result = CliRunner().invoke(cli, ["--url", "localhost:8080"])
    assert result.exit_code == 1
    assert "--url must start with http:// or https://" in result.output
    # Without a terminal (CliRunner's pipes) it says so: Textual drew into the pipe for ever.
    result = CliRunner().invoke(cli, ["--url", "http://127.0.0.1:9"])
    assert result.exit_code == 1 and "justllm top needs a terminal" in result.output
    # the page it names is the one top reads (a /v1 URL named /v1/metrics, a 404)
    for url in ("http://127.0.0.1:9/v1", "http://127.0.0.1:9/metrics", "http://127.0.0.1:9/"):
        result = CliRunner().invoke(cli, ["--url", url])
        assert "read http://127.0.0.1:9/metrics (" in " ".join(result.output.split()), url
    # a NaN interval said "must be less than or equal to 3600" (typer's range check)
    for interval in ("nan", "0.01", "3601"):
        result = CliRunner().invoke(cli, ["--interval", interval])
        assert result.exit_code == 1, interval
        assert "--interval must be a number of seconds from 0.05 to 3600" in result.output, interval


class StubMetrics:
    """A /metrics page whose token counter and status the test sets; ``hold()`` keeps the next
    replies back until ``release()`` (a poll in flight). ``page`` replaces the single-model
    page: it is called on every request."""

    def __init__(self, page: Callable[[], str] | None = None) -> None:
        self.tokens = 100_000.0  # generated before the dashboard started
        self.page = page or (lambda: '# TYPE vllm:generation_tokens counter\n'
                             f'vllm:generation_tokens_total{{model_name="m"}} {self.tokens}\n')
        self.status = 200
        self.requests = 0
        self._go = threading.Event()
        self._go.set()
        stub = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:  # noqa: N802
                stub.requests += 1
                stub._go.wait(10)
                body = (stub.page() if stub.status == 200 else "down").encode()
                self.send_response(stub.status)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args: object) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def hold(self) -> None:
        self._go.clear()

    def release(self) -> None:
        self._go.set()

    def close(self) -> None:
        self.release()
        self.server.shutdown()
        self.server.server_close()


def test_tokens_per_second_counts_only_what_was_generated_while_watching():
    stub = StubMetrics()
    try:
        asyncio.run(_baselines(stub))
    finally:
        stub.close()


async def _baselines(stub: StubMetrics) -> None:
    now = [0.0]
    # The timer never fires during the test (30 s); the test polls, on a clock it moves.
    app = TopApp(url=stub.url, interval=30.0, clock=lambda: now[0])
    async with app.run_test(size=(80, 24)) as pilot:
        async def poll(seconds: float, tokens: float) -> None:
            now[0] += seconds
            stub.tokens += tokens
            polls = app.polls
            app.poll()
            await _until(pilot, lambda: app.polls > polls and not app._in_flight)

        await _until(pilot, lambda: app.polls == 1 and not app._in_flight)
        assert list(app.rates) == []  # the first reading only sets the baseline
        # One model: the single-model look, no models table, no views to pick.
        assert not app.query_one("#models-panel").display
        assert app.query_one("#models", DataTable).row_count == 0
        await pilot.press("m")
        assert app.selected is None
        assert _text(app, "#status") == "● connected · m"
        await poll(1.0, 320)  # a second reading right after the first: one step's burst
        assert list(app.rates) == []
        await poll(29.0, 1600)  # one interval after the baseline: 1920 tokens in 30 s
        assert list(app.rates) == [64.0]

        stub.status = 503  # an outage; the server goes on generating
        await poll(30.0, 1920)
        assert "HTTP 503" in _text(app, "#status")
        # no figure of before the outage stands as the server's now (they stayed on show)
        assert _text(app, "#tok-rate") == "- · peak 64.0" and app.snapshot is None
        stub.status = 200
        await poll(30.0, 1920)  # back: a new baseline, not the tokens of the outage
        assert list(app.rates) == [64.0]
        # the rate from before the outage is no current one (only the peak)
        assert _text(app, "#tok-rate").startswith("- · peak 64.0")
        await poll(30.0, 1920)
        assert list(app.rates) == [64.0, 64.0]
        assert _text(app, "#tok-rate").startswith("64.0 tok/s")

        stub.tokens = 500.0  # restarted: the counter went down
        await poll(30.0, 0)
        assert list(app.rates) == [64.0, 64.0]
        await poll(30.0, 1920)
        assert list(app.rates) == [64.0, 64.0, 64.0]

        # Paused while a poll is in flight: its reply is no baseline for after the pause.
        stub.hold()
        now[0] += 30.0
        app.poll()
        await _until(pilot, lambda: stub.requests == app.polls)
        await pilot.press("p")
        stub.release()
        await _until(pilot, lambda: not app._in_flight)
        now[0] += 300.0
        stub.tokens += 19_200
        polls = app.polls
        await pilot.press("p")  # resuming polls at once: a new baseline
        await _until(pilot, lambda: app.polls > polls and not app._in_flight)
        assert list(app.rates) == [64.0, 64.0, 64.0]
        await poll(30.0, 1920)
        assert list(app.rates) == [64.0] * 4
        assert _text(app, "#tok-rate").startswith("64.0 tok/s · peak 64.0")
        await pilot.press("q")
    assert app.return_code == 0


def test_a_gateway_has_a_row_per_model_and_the_panels_show_the_one_picked():
    tokens = {"chat": 1000.0, "coder": 500.0}
    stub = StubMetrics(lambda: gateway_page(tokens["chat"], tokens["coder"], unloaded=False))
    try:
        asyncio.run(_gateway(stub, tokens))
    finally:
        stub.close()


async def _gateway(stub: StubMetrics, tokens: dict[str, float]) -> None:
    now = [0.0]
    app = TopApp(url=stub.url, interval=30.0, clock=lambda: now[0])
    async with app.run_test(size=(80, 24)) as pilot:
        async def poll(chat: float, coder: float) -> None:
            now[0] += 30.0
            tokens["chat"] += chat
            tokens["coder"] += coder
            polls = app.polls
            app.poll()
            await _until(pilot, lambda: app.polls > polls and not app._in_flight)

        def spark() -> list[float]:
            return list(app.query_one("#tok-spark", Sparkline).data)

        await _until(pilot, lambda: app.polls == 1 and not app._in_flight)
        table = app.query_one("#models", DataTable)
        assert app.query_one("#models-panel").display and table.row_count == 2
        assert _rows(app)["chat"][-1] == "-"  # the first reading only sets the baselines
        await poll(1920, 960)  # 30 s: chat 64 tok/s, coder 32
        assert _rows(app) == {
            "chat": ["  chat", "loaded", "1", "2", "1", "37.5%", "75.0%", "64.0"],
            "coder": ["  coder", "loaded", "1P 2D", "1", "0", "39.1%", "25.0%", "32.0"]}
        assert app.query_one("#models-panel").border_title == "models · 2 waiting for a load"

        # All models by default: the panels show the sums.
        assert _text(app, "#status") == \
            "● connected · gateway, 2/2 models loaded · showing all models"
        assert app.sub_title == f"{stub.url} · showing all models"
        assert _text(app, "#running").split() == ["running", "3"]
        assert _text(app, "#waiting").split() == ["waiting", "1"]
        assert _ratio(app) == "50.0%"
        assert _text(app, "#hit-detail") == "hits 4 · misses 4"
        assert _text(app, "#kv-detail").startswith("used 148/384 (38.5%)")
        assert _text(app, "#tok-rate") == "96.0 tok/s · peak 96.0 · 4380 generated"
        # Everything fits on an 80x24 screen, both models' rows included.
        _fits(app, "#models", *PANELS)
        assert table.region.height >= 3  # the header and two rows

        # Pick coder with the keyboard: the panels show coder alone, its own history included.
        assert app.focused is table
        await pilot.press("down", "enter")
        assert app.selected == "coder"
        assert "showing coder" in _text(app, "#status") and app.sub_title.endswith("coder")
        assert _rows(app)["coder"][0] == "▸ coder" and _rows(app)["chat"][0] == "  chat"
        assert _text(app, "#running").split() == ["running", "1"]
        assert _text(app, "#waiting").split() == ["waiting", "0"]
        assert _ratio(app) == "25.0%"
        assert _text(app, "#hit-detail") == "hits 1 · misses 3"
        assert _text(app, "#cache-blocks") == "holds 60 KV blocks"
        assert _text(app, "#kv-detail").startswith("used 100/256 (39.1%)")
        assert _text(app, "#ttft-p50").split() == ["TTFT", "p50", "750", "ms"]
        assert _text(app, "#spec").split() == ["spec", "accept", "75.0%"]
        assert _text(app, "#tok-rate") == "32.0 tok/s · peak 32.0 · 1460 generated"
        assert spark() == [32.0]
        await poll(3840, 960)  # chat 128 tok/s, coder still 32: no peak from the other counter
        assert _text(app, "#tok-rate").startswith("32.0 tok/s · peak 32.0")
        assert spark() == [32.0, 32.0]

        # Back to all models: the sums, and the sum's own history.
        await pilot.press("a")
        assert app.selected is None and "showing all models" in _text(app, "#status")
        assert _text(app, "#running").split() == ["running", "3"]
        assert _ratio(app) == "50.0%"
        assert spark() == [96.0, 160.0]
        assert _rows(app)["coder"][0] == "  coder"

        # m steps through the views: chat, coder, all models.
        await pilot.press("m")
        assert app.selected == "chat" and _text(app, "#running").split() == ["running", "2"]
        assert spark() == [64.0, 128.0]
        await pilot.press("m")
        assert app.selected == "coder"
        await pilot.press("m")
        assert app.selected is None

        # coder's runner restarts: its counter drops, chat's increase hides that in the sum,
        # which is then no counter either: only chat gets a sample.
        tokens["coder"] = 10.0
        await poll(3000, 0)
        assert spark() == [96.0, 160.0]
        assert [list(app.histories[m]) for m in ("chat", "coder")] == \
            [[64.0, 128.0, 100.0], [32.0, 32.0]]
        assert _rows(app)["coder"][-1] == "32.0"
        await pilot.press("q")
    assert app.return_code == 0


def test_an_unloaded_model_has_a_row_without_numbers():
    stub = StubMetrics(gateway_page)
    try:
        asyncio.run(_unloaded(stub))
    finally:
        stub.close()


async def _unloaded(stub: StubMetrics) -> None:
    app = TopApp(url=stub.url, interval=30.0)
    async with app.run_test(size=(80, 24)) as pilot:
        await _until(pilot, lambda: app.polls == 1 and not app._in_flight)
        assert list(_rows(app)) == ["chat", "coder", "embed"]
        assert _rows(app)["embed"] == ["  embed", "unloaded", "-", "-", "-", "-", "-", "-"]
        assert _text(app, "#status").startswith("● connected · gateway, 2/3 models loaded")
        _fits(app, "#models", *PANELS)
        await pilot.press("down", "down", "enter")
        assert app.selected == "embed"
        assert _ratio(app) == "-" and _text(app, "#running").split() == ["running", "-"]
        assert _text(app, "#tok-rate") == "-"
        await pilot.press("q")
    assert app.return_code == 0


def test_odd_model_names_nan_gauges_and_a_v1_url():
    """A model named like Rich markup crashed the table (MarkupError); a NaN KV gauge crashed
    the bar; --url .../v1 (an OpenAI client's base URL) polled /v1/metrics, a 404."""
    page = ('# TYPE justllm_gateway_model_loaded gauge\n'
            'justllm_gateway_model_loaded{model_name="org/m[/x]"} 1\n'
            'vllm:num_requests_running{model_name="org/m[/x]"} 1.0\n'
            'justllm_kv_blocks_used{model_name="org/m[/x]"} NaN\n'
            'justllm_kv_blocks_total{model_name="org/m[/x]"} NaN\n')
    stub = StubMetrics(lambda: page)
    try:
        asyncio.run(_odd(stub))
    finally:
        stub.close()


async def _odd(stub: StubMetrics) -> None:
    app = TopApp(url=stub.url + "/v1/", interval=30.0)
    assert app.metrics_url == stub.url + "/metrics"
    async with app.run_test(size=(80, 24)) as pilot:
        await _until(pilot, lambda: app.polls == 1 and not app._in_flight)
        assert list(_rows(app)) == ["org/m[/x]"]
        assert _rows(app)["org/m[/x]"][0] == "  org/m[/x]"
        assert _text(app, "#status").startswith("● connected")
        await pilot.press("q")
    assert app.return_code == 0
