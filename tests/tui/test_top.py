"""``justllm top`` at 80x24 through Textual's pilot: a live server, and one that is down."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

import httpx
import pytest
from textual.widgets import Digits, Static

from justllm.tui.top import TopApp
from tests.server.conftest import free_port, start_server

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


@pytest.mark.model
def test_live_server_hit_ratio_moves_pause_and_quit(model_path):
    server = start_server(model_path, "--max-seqs", "4", "--pool-blocks", "128")
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

        # Everything fits on an 80x24 screen.
        for selector in ("#hit-ratio", "#hit-detail", "#running", "#waiting", "#ttft-p50",
                         "#ttft-p99", "#spec", "#kv-bar", "#kv-detail", "#tok-rate",
                         "#tok-spark", "#status"):
            region = app.query_one(selector).region
            assert region.height >= 1 and region.bottom <= 24 and region.right <= 80, selector

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
        await pilot.press("q")
    assert app.return_code == 0


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
