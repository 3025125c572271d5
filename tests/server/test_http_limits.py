"""A connection's limits before a request reaches the app (``justllm/server/http_limits.py``):
a request head too large is a 431 and costs no memory, on ``justllm serve`` and router mode
alike, and what is no HTTP request a 400, both in OpenAI's shape; a connection that sends nothing, a head or a body that stops coming, is closed; a slow
body that keeps coming, and a request the app answers slowly, are not cut."""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import uvicorn
from litestar import Litestar, Request, post

from justllm.gateway.runner import free_port
from justllm.server.http_limits import LimitedHttpProtocol
from tests.gateway.test_gateway import RUNNER_FLAGS, start_gateway, stop
from tests.server.conftest import start_server

KEY = "sekret"


def _recv_all(sock: socket.socket, timeout: float = 30) -> bytes:
    """What the server sends until it closes the connection."""
    sock.settimeout(timeout)
    out = b""
    while chunk := sock.recv(65536):
        out += chunk
    return out


def _huge_head(port: int) -> bytes:
    """A request whose one header is 1 MiB, sent whole; the server's answer."""
    with socket.create_connection(("127.0.0.1", port)) as s:
        s.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * (1 << 20) + b"\r\n\r\n")
        return _recv_all(s)


def _assert_431(answer: bytes) -> None:
    head, _, body = answer.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 431 "), answer[:300]
    error = json.loads(body)["error"]
    assert error["type"] == "invalid_request_error" and "headers" in error["message"], error


def _rss_mib(pid: int) -> float:
    status = Path(f"/proc/{pid}/status").read_text()
    return int(status.split("VmRSS:")[1].split()[0]) / 1024


def _flood_headers(port: int, total: int) -> None:
    """``total`` bytes of headers on one connection that never ends its head."""
    with socket.create_connection(("127.0.0.1", port)) as s:
        s.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n")
        line = b"X-A: " + b"a" * 65000 + b"\r\n"
        with contextlib.suppress(OSError):  # (the server closes it)
            for _ in range(total // len(line)):
                s.sendall(line)


def test_serve_refuses_a_huge_head_without_holding_it(model_path):
    server = start_server(model_path, "--api-key", KEY)
    try:
        port = int(server.url.rsplit(":", 1)[1])
        _assert_431(_huge_head(port))  # (it was answered 200: no limit at all)
        for no_request in (b"FOO / HTTP/1.1\r\nHost: x\r\n\r\n",
                           b"POST /v1/completions HTTP/1.1\r\nContent-Length: -1\r\n\r\n"):
            with socket.create_connection(("127.0.0.1", port)) as s:
                s.sendall(no_request)  # uvicorn's own 400, in plain text before
                head, _, body = _recv_all(s).partition(b"\r\n\r\n")
            assert head.startswith(b"HTTP/1.1 400 "), head
            assert json.loads(body)["error"]["code"] == "invalid_http", body
        before = _rss_mib(server.proc.pid)
        _flood_headers(port, 256 << 20)  # no key: the head is read before any key is asked
        assert _rss_mib(server.proc.pid) - before < 64, "the server kept the headers"
        r = httpx.post(server.url + "/v1/completions", timeout=60,
                       headers={"Authorization": f"Bearer {KEY}"},
                       json={"prompt": "Hello", "max_tokens": 2})
        assert r.status_code == 200, r.text
    finally:
        assert server.stop() == 0


def test_router_mode_refuses_a_huge_head(model_path, tmp_path):
    gw = start_gateway(tmp_path, {"alpha": {"source": model_path, **RUNNER_FLAGS}})
    try:
        _assert_431(_huge_head(int(gw.url.rsplit(":", 1)[1])))
        assert httpx.get(gw.url + "/health", timeout=10).status_code == 200
    finally:
        assert stop(gw)[0] == 0


class _Quick(LimitedHttpProtocol):
    head_timeout = 1.0
    body_idle_timeout = 1.0


@post("/echo", status_code=200)
async def _echo(request: Request) -> dict:
    body = await request.body()
    if body == b"slow":
        await asyncio.sleep(2.5)  # an answer that takes longer than every timeout
    return {"bytes": len(body)}


@pytest.fixture(scope="module")
def quick() -> Iterator[int]:
    """A Litestar app on uvicorn with :class:`_Quick`'s timeouts, in this process."""
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(Litestar([_echo]), host="127.0.0.1", port=port,
                                           http=_Quick, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    while not server.started:
        time.sleep(0.01)
    yield port
    server.should_exit = True
    thread.join(timeout=30)


def _post_head(length: int | None) -> bytes:
    size = (b"Content-Length: %d\r\n" % length if length is not None
            else b"Transfer-Encoding: chunked\r\n")
    return b"POST /echo HTTP/1.1\r\nHost: x\r\n" + size + b"\r\n"


@pytest.mark.parametrize("sent", [b"", b"POST /echo HTTP/1.1\r\nHost: x\r\nX-A: ",
                                  _post_head(100) + b"abc",
                                  _post_head(None) + b"3\r\nabc\r\n"],
                         ids=["nothing", "head", "body", "chunked-body"])
def test_a_connection_that_stops_sending_is_closed(quick, sent):
    with socket.create_connection(("127.0.0.1", quick)) as s:
        s.sendall(sent)
        assert _recv_all(s) == b""  # closed, without an answer (it used to wait forever)


def test_a_body_that_keeps_coming_and_a_slow_answer_are_not_cut(quick):
    with socket.create_connection(("127.0.0.1", quick)) as s:
        s.sendall(_post_head(8))
        for _ in range(8):  # 1.6 s in all, every byte well within the idle timeout of the last
            time.sleep(0.2)
            s.sendall(b"x")
        s.settimeout(30)
        assert s.recv(65536).startswith(b"HTTP/1.1 200 ")
    r = httpx.post(f"http://127.0.0.1:{quick}/echo", content=b"slow", timeout=30)
    assert r.status_code == 200 and r.json() == {"bytes": 4}


def test_a_pipelined_request_waits_without_cutting_the_answer_before_it(quick):
    """uvicorn reads no more of a connection while it answers an earlier request, so the
    next one's body stops coming: the earlier answer is not cut for it."""
    with socket.create_connection(("127.0.0.1", quick)) as s:
        s.sendall(_post_head(4) + b"slow" + _post_head(10) + b"abc")
        answer = _recv_all(s)
    assert answer.startswith(b"HTTP/1.1 200 ") and b'{"bytes":4}' in answer, answer
