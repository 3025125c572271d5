"""A stand-in Hugging Face Hub on 127.0.0.1 (tests never reach the real hub).

It answers the requests huggingface_hub makes for a pull, the way the hub does: the tree listing
``GET /api/models/{repo}/tree/{rev}`` and ``HEAD``/``GET /{repo}/resolve/{rev}/{file}`` with
``X-Repo-Commit`` (the commit ``rev`` resolves to), ``ETag`` (the sha256 of an LFS file) and
``Content-Length``; unknown repos, revisions and files get a 404 with the hub's
``X-Error-Code``. Each ``push`` is a new commit of a repo, and ``main`` is the newest one.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import sys
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import unquote, urlsplit

import pytest


@dataclass
class FakeHub:
    url: str
    history: dict[str, list[tuple[str, dict[str, bytes]]]] = field(default_factory=dict)
    requests: list[tuple[str, str]] = field(default_factory=list)  # (method, path)
    # (repo, file) -> the bytes served in place of the pushed file's, whose sha256 (ETag, tree
    # lfs.oid) and size the hub still lists: a download corrupted on its way.
    corrupted: dict[tuple[str, str], bytes] = field(default_factory=dict)
    # (repo, file)s whose download sends half the bytes, sets ``midway`` and waits for
    # ``release`` before the rest: a pull to be signalled mid-file.
    held: set[tuple[str, str]] = field(default_factory=set)
    midway: threading.Event = field(default_factory=threading.Event)
    release: threading.Event = field(default_factory=threading.Event)

    def push(self, repo: str, files: dict[str, bytes]) -> str:
        """A new commit of ``repo`` holding exactly ``files``; returns its sha."""
        commits = self.history.setdefault(repo, [])
        sha = hashlib.sha1(f"{repo}@{len(commits)}".encode()).hexdigest()
        commits.append((sha, dict(files)))
        return sha

    def at(self, repo: str, rev: str) -> tuple[str, dict[str, bytes]] | None:
        commits = self.history[repo]
        if rev == "main":
            return commits[-1]
        return next((c for c in commits if c[0] == rev), None)

    def gets(self, suffix: str) -> int:
        return sum(m == "GET" and p.endswith(suffix) for m, p in self.requests)


def _handler(hub: FakeHub) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *args: object) -> None:
            pass

        def _send(self, status: int, body: bytes = b"", **headers: str) -> None:
            self.send_response(status)
            for k, v in {"Content_Length": str(len(body)), **headers}.items():
                self.send_header(k.replace("_", "-"), v)
            self.end_headers()
            if self.command != "HEAD":
                self.wfile.write(body)

        def _not_found(self, code: str) -> None:
            self._send(404, json.dumps({"error": code}).encode(), X_Error_Code=code,
                       X_Error_Message=code, Content_Type="application/json")

        def _route(self) -> None:
            path = unquote(urlsplit(self.path).path)
            hub.requests.append((self.command, path))
            parts = path.strip("/").split("/")
            api = parts[:2] == ["api", "models"]
            if api:
                parts = parts[2:]
            repo, kind, rev, rest = "/".join(parts[:2]), parts[2:3], parts[3:4], parts[4:]
            if repo not in hub.history:
                return self._not_found("RepoNotFound")
            commit = hub.at(repo, rev[0]) if rev else None
            if commit is None:
                return self._not_found("RevisionNotFound")
            sha, files = commit
            if api and kind == ["tree"] and self.command == "GET":
                tree = [{"type": "file", "path": name, "size": len(data),
                         "oid": hashlib.sha1(data).hexdigest(),
                         "lfs": {"oid": hashlib.sha256(data).hexdigest(), "size": len(data),
                                 "pointerSize": 134}}
                        for name, data in files.items()]
                return self._send(200, json.dumps(tree).encode(), Content_Type="application/json")
            name = "/".join(rest)
            if api or kind != ["resolve"] or name not in files:
                return self._not_found("EntryNotFound")
            data = files[name]
            headers = {"X_Repo_Commit": sha, "Accept_Ranges": "bytes",
                       "ETag": f'"{hashlib.sha256(data).hexdigest()}"',
                       "Content_Type": "application/octet-stream"}
            if self.command == "GET" and (repo, name) in hub.held:
                return self._send_held(data, **headers)
            self._send(200, hub.corrupted.get((repo, name), data), **headers)

        def _send_held(self, data: bytes, **headers: str) -> None:
            half = len(data) // 2
            self._send(200, data[:half], **{**headers, "Content_Length": str(len(data))})
            self.wfile.flush()
            hub.midway.set()
            hub.release.wait(60)
            with contextlib.suppress(OSError):  # (the client may be gone: killed mid-file)
                self.wfile.write(data[half:])

        do_GET = do_HEAD = _route

    return Handler


def isolate_hub_library(monkeypatch: pytest.MonkeyPatch, tmp_path: Path, endpoint: str) -> None:
    """Point huggingface_hub at ``endpoint`` with an empty home, no token and online mode, the
    models directory at ``tmp_path/models`` and justllm's logs at ``tmp_path/logs``.

    huggingface_hub copies these environment variables into constants when first imported, so
    the constants are patched as well as the environment.
    """
    from huggingface_hub import constants
    from huggingface_hub.utils import logging as _hf_logging  # noqa: F401  (adds its log handler)

    # That handler holds the sys.stderr of the moment it was made: a CliRunner's, since closed,
    # when the first import happened inside runner.invoke. Point it at the test's stderr.
    for handler in logging.getLogger("huggingface_hub").handlers:
        if isinstance(handler, logging.StreamHandler):
            monkeypatch.setattr(handler, "stream", sys.stderr)
    home = tmp_path / "hf-home"
    for key, value in {"HF_ENDPOINT": endpoint, "HF_HOME": str(home), "HF_HUB_OFFLINE": "0",
                       "JUSTLLM_MODELS_DIR": str(tmp_path / "models"),
                       # (a conversion's log: it went into the user's ~/.cache/justllm/logs)
                       "JUSTLLM_LOG_DIR": str(tmp_path / "logs")}.items():
        monkeypatch.setenv(key, value)
    for key in ("HF_TOKEN", "HUGGING_FACE_HUB_TOKEN", "HF_HUB_CACHE", "HF_TOKEN_PATH"):
        monkeypatch.delenv(key, raising=False)
    for name, value in {"ENDPOINT": endpoint,
                        "HUGGINGFACE_CO_URL_TEMPLATE": endpoint + "/{repo_id}/resolve/{revision}/{filename}",
                        "HF_HOME": str(home), "HF_HUB_CACHE": str(home / "hub"),
                        "HF_TOKEN_PATH": str(home / "token"),
                        "HF_STORED_TOKENS_PATH": str(home / "stored_tokens"),
                        "HF_HUB_OFFLINE": False}.items():
        monkeypatch.setattr(constants, name, value, raising=False)


@contextlib.contextmanager
def serve_fake_hub(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[FakeHub]:
    """The stand-in, listening until the block ends, with huggingface_hub pointed at it."""
    server = ThreadingHTTPServer(("127.0.0.1", 0), BaseHTTPRequestHandler)
    fake = FakeHub(url=f"http://127.0.0.1:{server.server_address[1]}")
    server.RequestHandlerClass = _handler(fake)
    thread = threading.Thread(target=server.serve_forever, args=(0.05,), daemon=True)
    thread.start()
    isolate_hub_library(monkeypatch, tmp_path, fake.url)
    try:
        yield fake
    finally:
        server.shutdown()
        server.server_close()
        thread.join()
