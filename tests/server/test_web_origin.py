"""A web page of another site cannot drive the server through its visitor's browser
(``justllm/server/web_origin.py``): its ``text/plain`` POST, which a browser sends without
asking, is a 403 in the route's own error shape; the server's own pages, loopback web apps and
clients that send no ``Origin`` are served."""

from __future__ import annotations

import httpx
import pytest

from justllm.server.web_origin import allowed_host, allowed_origin, extra_origins
from tests.gateway.test_gateway import RUNNER_FLAGS, start_gateway, stop

CHAT = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}


def _from_page(url: str, origin: str, path: str = "/v1/chat/completions",
               body: str = '{"messages":[{"role":"user","content":"hi"}],"max_tokens":1}'
               ) -> httpx.Response:
    """What a page at ``origin`` sends with ``fetch(url, {method: "POST", body})``."""
    return httpx.post(url + path, content=body, timeout=60,
                      headers={"Origin": origin, "Content-Type": "text/plain;charset=UTF-8"})


@pytest.mark.parametrize(("path", "shape"), [
    ("/v1/chat/completions", lambda j: j["error"]["type"] == "permission_error"),
    ("/api/chat", lambda j: "other sites" in j["error"]),
    ("/v1/messages", lambda j: j["error"]["type"] == "permission_error"),
    ("/completion", lambda j: j["error"]["code"] == 403),
    ("/lora-adapters", lambda j: j["error"]["code"] == 403),
    ("/slots/0?action=erase", lambda j: j["error"]["code"] == 403)])
def test_another_sites_page_is_refused(server, path, shape):
    for origin in ("http://evil.example", "null"):
        r = _from_page(server.url, origin, path)  # (it was answered: 200, or the route's 400)
        assert r.status_code == 403 and shape(r.json()), (path, r.status_code, r.text)


def test_own_and_local_pages_and_plain_clients_are_served(server):
    for origin in (server.url, "http://localhost:3000", "http://127.0.0.1:5173",
                   "vscode-webview://abc"):
        assert _from_page(server.url, origin).status_code == 200, origin
    assert httpx.post(server.url + "/v1/chat/completions", json=CHAT,
                      timeout=60).status_code == 200


def _preflight(url: str, origin: str, path: str = "/v1/chat/completions") -> httpx.Response:
    """What a browser asks before a page at ``origin`` POSTs JSON with an API key."""
    return httpx.options(url + path, timeout=60, headers={
        "Origin": origin, "Access-Control-Request-Method": "POST",
        "Access-Control-Request-Headers": "authorization, content-type"})


def test_pages_it_serves_may_read_the_answers_and_others_may_not(server):
    """A web app of this machine (``http://localhost:3000``) could call the server but not
    read what it answered: no CORS headers were sent, its preflight (before a JSON POST with
    a key) and answers had none, so its ``fetch`` failed, as it does not with llama-server
    or Ollama."""
    for origin in ("http://localhost:3000", "vscode-webview://abc"):
        pre = _preflight(server.url, origin)
        assert pre.status_code == 204, pre.text
        assert pre.headers["access-control-allow-origin"] == origin
        assert "authorization" in pre.headers["access-control-allow-headers"].lower()
        assert "POST" in pre.headers["access-control-allow-methods"]
        r = httpx.post(server.url + "/v1/chat/completions", json=CHAT, timeout=60,
                       headers={"Origin": origin})
        assert r.status_code == 200 and r.headers["access-control-allow-origin"] == origin
        assert "x-request-id" in r.headers["access-control-expose-headers"]
    for origin in ("http://evil.example", "null"):
        pre = _preflight(server.url, origin)
        assert pre.status_code >= 400 and "access-control-allow-origin" not in pre.headers
        r = httpx.post(server.url + "/v1/chat/completions", json=CHAT, timeout=60,
                       headers={"Origin": origin})
        assert r.status_code == 403 and "access-control-allow-origin" not in r.headers
    assert "access-control-allow-origin" not in httpx.post(
        server.url + "/v1/chat/completions", json=CHAT, timeout=60).headers


def test_router_mode_refuses_another_sites_page(model_path, tmp_path):
    gw = start_gateway(tmp_path, {"alpha": {"source": model_path, **RUNNER_FLAGS}})
    try:
        pre = _preflight(gw.url, "http://localhost:5173", "/models/load")
        assert pre.status_code == 204
        assert pre.headers["access-control-allow-origin"] == "http://localhost:5173"
        assert _preflight(gw.url, "http://evil.example").status_code >= 400
        r = _from_page(gw.url, "http://evil.example", "/models/unload",
                       '{"model": "alpha"}')
        assert r.status_code == 403 and r.json()["error"]["code"] == "cross_site_request"
        assert _from_page(gw.url, "https://evil.example", "/models/load",
                          '{"model": "alpha"}').status_code == 403
    finally:
        assert stop(gw)[0] == 0


def test_allowed_origin():
    assert allowed_origin("http://example.com:8080", "example.com:8080")  # its own page
    assert allowed_origin("http://localhost", "example.com")
    assert allowed_origin("http://app.localhost:3000", None)
    assert allowed_origin("http://[::1]:3000", None)
    assert allowed_origin("chrome-extension://abcdef", None)
    assert not allowed_origin("http://example.com", "127.0.0.1:8080")
    assert not allowed_origin("http://example.com:8081", "example.com:8080")
    assert not allowed_origin("http://127.0.0.1.evil.example", None)
    assert not allowed_origin("null", None)
    assert not allowed_origin("NULL", None)
    assert not allowed_origin("", None)
    assert not allowed_origin("http://[bad", None)


def test_justllm_origins_allows_more():
    """A web UI behind a proxy that rewrites Host (its pages' Origin is no longer the
    server's own) was refused with no way out: ``JUSTLLM_ORIGINS``, as Ollama's
    ``OLLAMA_ORIGINS``."""
    assert extra_origins({"JUSTLLM_ORIGINS": " https://Chat.example.com/ , http://x:1"}) == {
        "https://chat.example.com", "http://x:1"}
    assert extra_origins({}) == frozenset()


def test_an_allowed_origin_is_served(model_path):
    from tests.server.conftest import start_server

    server = start_server(model_path, "--max-seqs", "2", "--pool-blocks", "64",
                          "--api-key", "sk-test",
                          env={"JUSTLLM_ORIGINS": "https://chat.example.com"})
    try:
        pre = _preflight(server.url, "https://chat.example.com")  # (a browser sends no key)
        assert pre.status_code == 204, pre.text
        assert pre.headers["access-control-allow-origin"] == "https://chat.example.com"
        assert _preflight(server.url, "https://evil.example").status_code >= 400
        assert _from_page(server.url, "https://chat.example.com").status_code == 401
        r = httpx.post(server.url + "/v1/chat/completions", json=CHAT, timeout=60,
                       headers={"Origin": "https://chat.example.com",
                                "Authorization": "Bearer sk-test"})
        assert r.status_code == 200
        assert r.headers["access-control-allow-origin"] == "https://chat.example.com"
        r = _from_page(server.url, "https://evil.example")  # (the guard comes before the key's)
        assert r.status_code == 403 and "JUSTLLM_ORIGINS" in r.json()["error"]["message"]
    finally:
        assert server.stop() == 0


def test_a_loopback_server_answers_only_requests_for_a_loopback_name(server):
    """DNS rebinding: a page whose name an attacker's DNS points at 127.0.0.1 sends its own
    name as Host (and as Origin, which then passed as "the server's own"), and its requests
    were answered, the answers readable to it."""
    url = server.url + "/v1/chat/completions"
    for host in ("evil.example", "evil.example:8080", "192.168.1.7:8080"):
        r = httpx.post(url, json=CHAT, timeout=60,
                       headers={"Host": host, "Origin": f"http://{host}"})
        assert r.status_code == 403, (host, r.text)
        assert "JUSTLLM_HOSTS" in r.json()["error"]["message"]
    for host in ("localhost:8080", "127.0.0.1", "[::1]:1", "app.localhost"):
        assert httpx.post(url, json=CHAT, headers={"Host": host},
                          timeout=60).status_code == 200, host


def test_allowed_host():
    assert allowed_host(None, {}) and allowed_host("LOCALHOST:1", {})
    assert not allowed_host("evil.example", {}) and not allowed_host("[bad", {})
    assert allowed_host("evil.example:9", {"JUSTLLM_HOSTS": "Evil.example, x"})
    assert allowed_host("any.where", {"JUSTLLM_HOSTS": "*"})
