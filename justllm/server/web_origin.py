"""Requests that a web page on another site sent through its visitor's browser: refused (403).

A page may POST to any address -- ``http://127.0.0.1:8080`` included -- without asking first,
if its body is ``text/plain`` or a form; the server reads any body as JSON whatever its
``Content-Type``, so a page the user merely visited ran completions on their server, set its
LoRA scales, erased its slots, loaded and unloaded router mode's models (it could not read the
answers: no other site is sent CORS headers). The browser names such a page in ``Origin``; other
clients (SDKs, curl, the gateway's own calls to its runners) send none. Allowed: no ``Origin``,
the server's own (its ``/docs`` page), a loopback one (a web app of this machine), and a
desktop or extension app's own scheme (``app:``, ``vscode-webview:``, ...: no web page can
claim one). ``null`` (a sandboxed frame, which any page can make) is refused, as Ollama refuses
it by default. ``JUSTLLM_ORIGINS`` (a comma list, as Ollama's ``OLLAMA_ORIGINS``) allows more:
exact origins (``https://chat.example.com``, a web UI behind a proxy that rewrites ``Host``),
or ``*`` for any. A server listening on loopback also answers only requests for a loopback
name (DNS rebinding: :func:`allowed_host`; ``JUSTLLM_HOSTS`` allows more).

The origins allowed are also sent CORS headers (:func:`cors_config`), as llama-server, Ollama and
vLLM send them: a web app of this machine (``http://localhost:3000``), an extension's or desktop
app's page, or one ``JUSTLLM_ORIGINS`` lists, may read the answers, its preflight answered
without the API key (a browser sends none there); any other origin's preflight fails.
"""

from __future__ import annotations

import ipaddress
import os
from collections.abc import Mapping
from urllib.parse import urlsplit

from litestar.config.cors import CORSConfig
from litestar.connection import ASGIConnection
from litestar.handlers.base import BaseRouteHandler

from justllm.server.errors import APIError
from justllm.server.request_id import HEADER as REQUEST_ID_HEADER


def _loopback(hostname: str) -> bool:
    name = hostname.lower().rstrip(".")
    if name == "localhost" or name.endswith(".localhost"):
        return True
    try:
        return ipaddress.ip_address(name).is_loopback
    except ValueError:
        return False


def allowed_origin(origin: str, host: str | None) -> bool:
    """Whether a request whose ``Origin`` header is ``origin``, sent to ``host`` (its ``Host``
    header), may be served."""
    try:
        parts = urlsplit(origin.strip())
        hostname = parts.hostname
    except ValueError:
        return False
    if parts.scheme not in ("http", "https"):
        return bool(parts.scheme) and origin.strip().lower() != "null"
    if not hostname:
        return False
    if _loopback(hostname):
        return True
    return host is not None and parts.netloc.lower() == host.strip().lower()


def extra_origins(environ: Mapping[str, str]) -> frozenset[str]:
    """The origins ``JUSTLLM_ORIGINS`` allows besides (``*``: every one), as written but
    without a trailing slash and in lower case, as ``Origin`` compares."""
    return frozenset(o.strip().rstrip("/").lower()
                     for o in environ.get("JUSTLLM_ORIGINS", "").split(",") if o.strip())


def origin_allowed(origin: str, host: str | None, environ: Mapping[str, str]) -> bool:
    """:func:`allowed_origin`, or one that ``JUSTLLM_ORIGINS`` in ``environ`` allows."""
    if allowed_origin(origin, host):
        return True
    extra = extra_origins(environ)  # (read only past the rule: the process's own setting)
    return "*" in extra or origin.strip().rstrip("/").lower() in extra


class _ServedOrigins(CORSConfig):
    """CORS headers for exactly the origins :func:`refuse_other_sites` serves (a same-origin
    request needs none, so the server's own page is left to the guard)."""

    def is_origin_allowed(self, origin: str) -> bool:
        return origin_allowed(origin, None, os.environ)


def cors_config() -> CORSConfig:
    """The apps' CORS: any method and request header (``Authorization`` and ``x-api-key``
    included, which a browser asks for by name), the request id readable, preflights
    cached 10 minutes; no cookies (the API key is a header)."""
    return _ServedOrigins(allow_origins=[], expose_headers=[REQUEST_ID_HEADER])


def host_name(host: str) -> str | None:
    """The name in a ``Host`` header (``[::1]:8080`` -> ``::1``), None when it has none."""
    try:
        return urlsplit(f"//{host.strip()}").hostname
    except ValueError:
        return None


def allowed_host(host: str | None, environ: Mapping[str, str]) -> bool:
    """Whether a server listening on loopback answers a request for ``host`` (its ``Host``
    header): a loopback name or address, or one ``JUSTLLM_HOSTS`` lists (``*``: any). A page
    whose own name an attacker's DNS points at 127.0.0.1 (DNS rebinding) sends its own name:
    its requests are then its own site's to the browser, Origin and all, and it read the
    answers; Ollama refuses such a Host the same way."""
    if host is None:  # (no browser sends a request without one)
        return True
    name = host_name(host)
    if name is None or _loopback(name):  # (every request's: the setting read only past it)
        return name is not None
    extra = {h.strip().lower() for h in environ.get("JUSTLLM_HOSTS", "").split(",")
             if h.strip()}
    return "*" in extra or name.lower() in extra


def refuse_other_sites(connection: ASGIConnection, _: BaseRouteHandler) -> None:
    """Every route's guard (before ``--api-key``'s): see the module's docstring, and
    :func:`allowed_host` for a server that listens on loopback."""
    server = connection.scope.get("server")
    host = connection.headers.get("host")
    if server and _loopback(str(server[0])) and not allowed_host(host, os.environ):
        raise APIError(403, f"this server listens on loopback and answers only requests for "
                            f"a loopback name (Host: {(host or '')[:200]}); JUSTLLM_HOSTS "
                            "allows more (a proxy that passes its own Host on)",
                       type="permission_error", code="cross_site_request")
    origin = connection.headers.get("origin")
    if origin is None or origin_allowed(origin, connection.headers.get("host"), os.environ):
        return
    raise APIError(403, f"requests from web pages of other sites are refused (Origin: "
                        f"{origin[:200]}; JUSTLLM_ORIGINS allows more)",
                   type="permission_error", code="cross_site_request")
