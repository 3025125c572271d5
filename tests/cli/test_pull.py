"""``justllm pull`` against a stand-in Hugging Face Hub on 127.0.0.1 (never the real hub).

The stand-in answers the two kinds of request huggingface_hub makes for a pull, the way the hub
does: the tree listing ``GET /api/models/{repo}/tree/{rev}`` and ``HEAD``/``GET
/{repo}/resolve/{rev}/{file}`` with ``X-Repo-Commit``, ``ETag`` (the sha256 of an LFS file) and
``Content-Length``; unknown repos, revisions and files get a 404 with the hub's ``X-Error-Code``.
"""

from __future__ import annotations

import hashlib
import json
import logging
import socket
import sys
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import unquote, urlsplit

import pytest
import typer
from typer.testing import CliRunner

from justllm.cli.pull import pick_gguf, pull, split_ref
from justllm.errors import ModelLoadError
from justllm.models.store import ModelStore

COMMIT = "0123456789abcdef0123456789abcdef01234567"
GGUF = b"GGUF" + bytes([3, 0, 0, 0]) + bytes(range(256)) * 16  # a few KB; pull never parses it

runner = CliRunner()
app = typer.Typer()
app.command("pull")(pull)


@app.callback()
def _root() -> None:
    """Stands in for the justllm app until the lead registers the command there."""


@dataclass
class FakeHub:
    url: str
    repos: dict[str, dict[str, bytes]] = field(default_factory=dict)
    requests: list[tuple[str, str]] = field(default_factory=list)  # (method, path)

    def gets(self, suffix: str) -> int:
        return sum(m == "GET" and p.endswith(suffix) for m, p in self.requests)


def _handler(hub: FakeHub) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *args: object) -> None:
            pass

        def _send(self, status: int, body: bytes = b"", **headers: str) -> None:
            self.send_response(status)
            for k, v in {"Content-Length": str(len(body)), **headers}.items():
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
            if repo not in hub.repos:
                return self._not_found("RepoNotFound")
            if rev not in (["main"], [COMMIT]):
                return self._not_found("RevisionNotFound")
            files = hub.repos[repo]
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
            self._send(200, data, X_Repo_Commit=COMMIT, Accept_Ranges="bytes",
                       ETag=f'"{hashlib.sha256(data).hexdigest()}"',
                       Content_Type="application/octet-stream")

        do_GET = do_HEAD = _route

    return Handler


def _isolate_hub_library(monkeypatch: pytest.MonkeyPatch, tmp_path: Path, endpoint: str) -> None:
    """Point huggingface_hub at ``endpoint`` with an empty home, no token and online mode.

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
                       "JUSTLLM_MODELS_DIR": str(tmp_path / "models")}.items():
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


@pytest.fixture
def hub(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[FakeHub]:
    server = ThreadingHTTPServer(("127.0.0.1", 0), BaseHTTPRequestHandler)
    fake = FakeHub(url=f"http://127.0.0.1:{server.server_address[1]}")
    server.RequestHandlerClass = _handler(fake)
    thread = threading.Thread(target=server.serve_forever, args=(0.05,), daemon=True)
    thread.start()
    _isolate_hub_library(monkeypatch, tmp_path, fake.url)
    yield fake
    server.shutdown()
    server.server_close()
    thread.join()


def _models(tmp_path: Path) -> Path:
    return tmp_path / "models"


def _error_line(r) -> str:
    """The one ``error:`` line a failed pull prints, asserting there is no more than that."""
    assert r.exit_code == 1, r.output
    assert not isinstance(r.exception, Exception) or isinstance(r.exception, SystemExit), r.exception
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), r.stderr
    assert "Traceback" not in r.output
    return lines[0]


def test_repo_file_downloads_exact_bytes(hub: FakeHub, tmp_path: Path) -> None:
    hub.repos["acme/tiny-GGUF"] = {"tiny-Q8_0.gguf": GGUF, "README.md": b"# tiny\n"}
    r = runner.invoke(app, ["pull", "acme/tiny-GGUF:tiny-Q8_0.gguf"])
    assert r.exit_code == 0, r.output
    path = (_models(tmp_path) / "tiny-Q8_0.gguf").resolve()
    assert path.read_bytes() == GGUF
    assert r.stdout.strip().splitlines()[-1] == f"pulled acme/tiny-GGUF:tiny-Q8_0.gguf -> {path}"
    # The stand-in served it (no listing was needed), and `justllm run tiny-Q8_0` finds it.
    assert ("HEAD", "/acme/tiny-GGUF/resolve/main/tiny-Q8_0.gguf") in hub.requests
    assert hub.gets("/tiny-Q8_0.gguf") == 1 and not any("/tree/" in p for _, p in hub.requests)
    assert ModelStore(_models(tmp_path)).paths() == [path]
    assert ModelStore(_models(tmp_path)).find("tiny-Q8_0") == path


def test_repo_alone_picks_the_q4_k_m_file(hub: FakeHub, tmp_path: Path) -> None:
    q4 = GGUF + b"q4"
    hub.repos["acme/multi-GGUF"] = {"multi-Q8_0.gguf": GGUF, "multi-q4_k_m.gguf": q4,
                                    "mmproj-multi-f16.gguf": GGUF, "README.md": b"# multi\n"}
    r = runner.invoke(app, ["pull", "acme/multi-GGUF"])
    assert r.exit_code == 0, r.output
    assert [p.name for p in ModelStore(_models(tmp_path)).paths()] == ["multi-q4_k_m.gguf"]
    assert (_models(tmp_path) / "multi-q4_k_m.gguf").read_bytes() == q4
    assert ("GET", "/api/models/acme/multi-GGUF/tree/main") in hub.requests
    assert "pulled acme/multi-GGUF:multi-q4_k_m.gguf -> " in r.stdout


def test_repo_alone_with_two_ggufs_and_no_q4_k_m_lists_them(hub: FakeHub, tmp_path: Path) -> None:
    hub.repos["acme/two-GGUF"] = {"two-Q8_0.gguf": GGUF, "two-F16.gguf": GGUF}
    line = _error_line(runner.invoke(app, ["pull", "acme/two-GGUF"]))
    assert "two-F16.gguf" in line and "two-Q8_0.gguf" in line and "acme/two-GGUF:FILE" in line
    assert hub.gets(".gguf") == 0 and ModelStore(_models(tmp_path)).paths() == []


def test_repo_alone_with_no_gguf_fails(hub: FakeHub) -> None:
    hub.repos["acme/safetensors"] = {"model.safetensors": b"x", "config.json": b"{}"}
    assert "no .gguf model file in acme/safetensors" in _error_line(
        runner.invoke(app, ["pull", "acme/safetensors"]))


@pytest.mark.parametrize("ref", ["acme/nope", "acme/nope:nope-Q4_K_M.gguf"])
def test_unknown_repo_is_one_line(hub: FakeHub, ref: str) -> None:
    line = _error_line(runner.invoke(app, ["pull", ref]))
    assert "repository 'acme/nope' not found" in line
    assert any(p.startswith(("/api/models/acme/nope", "/acme/nope")) for _, p in hub.requests)


def test_missing_file_and_revision_are_one_line(hub: FakeHub, tmp_path: Path) -> None:
    hub.repos["acme/tiny-GGUF"] = {"tiny-Q8_0.gguf": GGUF}
    line = _error_line(runner.invoke(app, ["pull", "acme/tiny-GGUF:tiny-Q2_K.gguf"]))
    assert line == "error: file 'tiny-Q2_K.gguf' not found in acme/tiny-GGUF at revision 'main'"
    line = _error_line(runner.invoke(app, ["pull", "acme/tiny-GGUF", "--revision", "v9"]))
    assert line == "error: revision 'v9' not found in acme/tiny-GGUF"
    assert ModelStore(_models(tmp_path)).paths() == []


def test_not_a_gguf_name_is_refused_before_any_request(hub: FakeHub) -> None:
    hub.repos["acme/tiny-GGUF"] = {"README.md": b"# tiny\n"}
    line = _error_line(runner.invoke(app, ["pull", "acme/tiny-GGUF:README.md"]))
    assert "'README.md' is not a .gguf file" in line and hub.requests == []


def test_content_that_is_not_gguf_is_removed(hub: FakeHub, tmp_path: Path) -> None:
    hub.repos["acme/html"] = {"fake.gguf": b"<html>not a model</html>"}
    line = _error_line(runner.invoke(app, ["pull", "acme/html:fake.gguf"]))
    assert "is not a GGUF file" in line and not (_models(tmp_path) / "fake.gguf").exists()


def test_file_in_a_repo_folder_lands_flat(hub: FakeHub, tmp_path: Path) -> None:
    hub.repos["acme/deep-GGUF"] = {"Q4_K_M/deep-Q4_K_M.gguf": GGUF}
    r = runner.invoke(app, ["pull", "acme/deep-GGUF", "--revision", COMMIT])
    assert r.exit_code == 0, r.output
    assert (_models(tmp_path) / "deep-Q4_K_M.gguf").read_bytes() == GGUF
    assert not (_models(tmp_path) / "Q4_K_M").exists()
    assert ("HEAD", f"/acme/deep-GGUF/resolve/{COMMIT}/Q4_K_M/deep-Q4_K_M.gguf") in hub.requests


def test_pull_again_skips_an_up_to_date_file_unless_forced(hub: FakeHub, tmp_path: Path) -> None:
    hub.repos["acme/tiny-GGUF"] = {"tiny-Q8_0.gguf": GGUF}
    for args, gets in ((["pull", "acme/tiny-GGUF:tiny-Q8_0.gguf"], 1),
                       (["pull", "acme/tiny-GGUF:tiny-Q8_0.gguf"], 1),
                       (["pull", "acme/tiny-GGUF:tiny-Q8_0.gguf", "--force"], 2)):
        r = runner.invoke(app, args)
        assert r.exit_code == 0, r.output
        assert hub.gets("/tiny-Q8_0.gguf") == gets
    assert (_models(tmp_path) / "tiny-Q8_0.gguf").read_bytes() == GGUF


@pytest.mark.parametrize("ref", ["acme/tiny-GGUF", "acme/tiny-GGUF:tiny-Q8_0.gguf"])
def test_unreachable_hub_is_one_line(hub: FakeHub, monkeypatch: pytest.MonkeyPatch,
                                     tmp_path: Path, ref: str) -> None:
    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        dead = f"http://127.0.0.1:{s.getsockname()[1]}"
    _isolate_hub_library(monkeypatch, tmp_path, dead)
    # huggingface_hub retries network errors with exponential backoff (about 23 s); skip the waits.
    import huggingface_hub.utils._http as hf_http
    monkeypatch.setattr(hf_http.time, "sleep", lambda _s: None)
    line = _error_line(runner.invoke(app, ["pull", ref]))
    assert "cannot download acme/tiny-GGUF:" in line and dead in line
    assert ModelStore(_models(tmp_path)).paths() == []


def test_split_ref_and_pick_gguf() -> None:
    assert split_ref("a/b") == ("a/b", None)
    assert split_ref("a/b:dir/x.gguf") == ("a/b", "dir/x.gguf")
    for bad in ("", ":x.gguf", "a/b:"):
        with pytest.raises(ModelLoadError):
            split_ref(bad)
    assert pick_gguf("r", ["a-Q8_0.gguf"]) == "a-Q8_0.gguf"
    assert pick_gguf("r", ["mmproj-f16.gguf", "a-Q8_0.gguf"]) == "a-Q8_0.gguf"
    with pytest.raises(ModelLoadError, match=r"2 \.gguf files \(x-Q4_K_M-00001-of-00002.gguf, "):
        pick_gguf("r", ["x-Q4_K_M-00002-of-00002.gguf", "x-Q4_K_M-00001-of-00002.gguf", "x-Q8_0.gguf"])


def test_hf_endpoint_is_read_when_pulling(hub: FakeHub, monkeypatch: pytest.MonkeyPatch,
                                          tmp_path: Path) -> None:
    """huggingface_hub's import-time copy of HF_ENDPOINT is stale here; pull must not use it."""
    from huggingface_hub import constants

    dead = "http://127.0.0.1:9"
    monkeypatch.setattr(constants, "ENDPOINT", dead)
    monkeypatch.setattr(constants, "HUGGINGFACE_CO_URL_TEMPLATE",
                        dead + "/{repo_id}/resolve/{revision}/{filename}")
    hub.repos["acme/multi-GGUF"] = {"a-Q4_K_M.gguf": GGUF, "a-Q8_0.gguf": GGUF}
    r = runner.invoke(app, ["pull", "acme/multi-GGUF"])
    assert r.exit_code == 0, r.output
    assert (_models(tmp_path) / "a-Q4_K_M.gguf").read_bytes() == GGUF
    assert hub.gets("/tree/main") == 1 and hub.gets("/a-Q4_K_M.gguf") == 1


def test_run_accepts_a_hub_repo_as_the_model(hub: FakeHub, tmp_path: Path) -> None:
    """``justllm run REPO:FILE`` pulls first, then loads: the stand-in's file is only a GGUF
    header, so loading then fails with llama.cpp's one-line error, after the download."""
    from justllm.cli import app as main_app

    hub.repos["acme/tiny-GGUF"] = {"tiny-Q4_K_M.gguf": GGUF}
    r = CliRunner().invoke(main_app, ["run", "acme/tiny-GGUF:tiny-Q4_K_M.gguf", "-p", "hi"])
    assert r.exit_code == 1
    assert (_models(tmp_path) / "tiny-Q4_K_M.gguf").is_file()
    assert "could not load" in r.output or "could not read" in r.output
