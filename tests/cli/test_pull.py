"""``justllm pull`` against a stand-in Hugging Face Hub on 127.0.0.1 (never the real hub;
tests/models/fake_hub.py). A pulled file lands in ``huggingface/OWNER/NAME/COMMIT/`` in the
models directory and is registered as ``stem:latest`` with its commit and sha256."""

from __future__ import annotations

import contextlib
import hashlib
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from typer.testing import CliRunner

from justllm.cli import app
from justllm.cli.pull import pick_gguf, split_ref
from justllm.errors import ModelLoadError
from justllm.models.registry import Registry
from justllm.models.store import ModelStore
from tests.models.fake_hub import FakeHub, isolate_hub_library, serve_fake_hub
from tests.models.ggufs import tiny_gguf

GGUF = tiny_gguf()
runner = CliRunner()


@pytest.fixture
def hub(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[FakeHub]:
    with serve_fake_hub(tmp_path, monkeypatch) as fake:
        yield fake


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


def _pulled(tmp_path: Path, repo: str, commit: str, file: str) -> Path:
    return (_models(tmp_path) / "huggingface" / repo / commit / file).resolve()


def _sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def test_repo_file_downloads_exact_bytes_and_registers_them(hub: FakeHub, tmp_path: Path) -> None:
    commit = hub.push("acme/tiny-GGUF", {"tiny-Q8_0.gguf": GGUF, "README.md": b"# tiny\n"})
    r = runner.invoke(app, ["pull", "acme/tiny-GGUF:tiny-Q8_0.gguf"])
    assert r.exit_code == 0, r.output
    path = _pulled(tmp_path, "acme/tiny-GGUF", commit, "tiny-Q8_0.gguf")
    assert path.read_bytes() == GGUF
    assert r.stdout.strip().splitlines()[-1] == (
        f"pulled acme/tiny-GGUF:tiny-Q8_0.gguf @ {commit[:12]} -> tiny-q8_0:latest "
        f"(sha256:{_sha(GGUF)[:12]}, {path})")
    # The stand-in served it (no listing was needed): the commit first, then the file at it.
    assert ("HEAD", "/acme/tiny-GGUF/resolve/main/tiny-Q8_0.gguf") in hub.requests
    assert ("GET", f"/acme/tiny-GGUF/resolve/{commit}/tiny-Q8_0.gguf") in hub.requests
    assert hub.gets("/tiny-Q8_0.gguf") == 1 and not any("/tree/" in p for _, p in hub.requests)
    assert ModelStore(_models(tmp_path)).paths() == [path]
    # `justllm run tiny-q8_0` (or the file's stem as it was) finds it through the registry.
    registry = Registry(_models(tmp_path))
    assert registry.find("tiny-q8_0") == registry.find("tiny-Q8_0:latest") == path
    _, m = registry.resolve("tiny-q8_0")
    assert (m.digest, m.source.kind, m.source.repo, m.source.file, m.source.revision) == (
        f"sha256:{_sha(GGUF)}", "huggingface", "acme/tiny-GGUF", "tiny-Q8_0.gguf", commit)
    assert (m.architecture, m.quantization, m.context_length, m.size) == (
        "llama", "Q8_0", 2048, len(GGUF))


def test_repo_alone_picks_the_q4_k_m_file(hub: FakeHub, tmp_path: Path) -> None:
    q4 = tiny_gguf(file_type=15, seed=1)
    commit = hub.push("acme/multi-GGUF", {"multi-Q8_0.gguf": GGUF, "multi-q4_k_m.gguf": q4,
                                          "mmproj-multi-f16.gguf": GGUF, "README.md": b"# multi\n"})
    r = runner.invoke(app, ["pull", "acme/multi-GGUF"])
    assert r.exit_code == 0, r.output
    path = _pulled(tmp_path, "acme/multi-GGUF", commit, "multi-q4_k_m.gguf")
    assert ModelStore(_models(tmp_path)).paths() == [path] and path.read_bytes() == q4
    assert ("GET", "/api/models/acme/multi-GGUF/tree/main") in hub.requests
    assert "pulled acme/multi-GGUF:multi-q4_k_m.gguf @ " in r.stdout
    assert Registry(_models(tmp_path)).tags() == {"multi-q4_k_m:latest": f"sha256:{_sha(q4)}"}


def test_tag_option_names_the_pull_and_a_bad_one_fails_first(hub: FakeHub, tmp_path: Path) -> None:
    hub.push("acme/tiny-GGUF", {"tiny-Q8_0.gguf": GGUF})
    line = _error_line(runner.invoke(app, ["pull", "acme/tiny-GGUF", "--tag", "tiny/q8"]))
    assert "'tiny/q8' is not a model name" in line and hub.requests == []
    r = runner.invoke(app, ["pull", "acme/tiny-GGUF", "--tag", "Tiny:Q8"])
    assert r.exit_code == 0, r.output
    assert list(Registry(_models(tmp_path)).tags()) == ["tiny:q8"]


def test_repo_alone_with_two_ggufs_and_no_q4_k_m_lists_them(hub: FakeHub, tmp_path: Path) -> None:
    hub.push("acme/two-GGUF", {"two-Q8_0.gguf": GGUF, "two-F16.gguf": GGUF})
    line = _error_line(runner.invoke(app, ["pull", "acme/two-GGUF"]))
    assert "two-F16.gguf" in line and "two-Q8_0.gguf" in line and "acme/two-GGUF:FILE" in line
    assert hub.gets(".gguf") == 0 and ModelStore(_models(tmp_path)).paths() == []


def test_repo_alone_with_no_gguf_fails(hub: FakeHub) -> None:
    hub.push("acme/safetensors", {"model.safetensors": b"x", "config.json": b"{}"})
    assert "no .gguf model file in acme/safetensors" in _error_line(
        runner.invoke(app, ["pull", "acme/safetensors"]))


@pytest.mark.parametrize("ref", ["acme/nope", "acme/nope:nope-Q4_K_M.gguf"])
def test_unknown_repo_is_one_line(hub: FakeHub, ref: str) -> None:
    line = _error_line(runner.invoke(app, ["pull", ref]))
    assert "repository 'acme/nope' not found" in line
    assert any(p.startswith(("/api/models/acme/nope", "/acme/nope")) for _, p in hub.requests)


def test_missing_file_and_revision_are_one_line(hub: FakeHub, tmp_path: Path) -> None:
    hub.push("acme/tiny-GGUF", {"tiny-Q8_0.gguf": GGUF})
    line = _error_line(runner.invoke(app, ["pull", "acme/tiny-GGUF:tiny-Q2_K.gguf"]))
    assert line == "error: file 'tiny-Q2_K.gguf' not found in acme/tiny-GGUF at revision 'main'"
    line = _error_line(runner.invoke(app, ["pull", "acme/tiny-GGUF", "--revision", "v9"]))
    assert line == "error: revision 'v9' not found in acme/tiny-GGUF"
    assert ModelStore(_models(tmp_path)).paths() == []


def test_not_a_gguf_name_is_refused_before_any_request(hub: FakeHub) -> None:
    hub.push("acme/tiny-GGUF", {"README.md": b"# tiny\n"})
    line = _error_line(runner.invoke(app, ["pull", "acme/tiny-GGUF:README.md"]))
    assert "'README.md' is not a .gguf file" in line and hub.requests == []
    # a FILE that climbs out of the repo said "repo not found" (the hub's refusal)
    line = _error_line(runner.invoke(app, ["pull", "acme/tiny-GGUF:../../y.gguf"]))
    assert line == "error: FILE is a path inside the repo, without '..': got '../../y.gguf'"
    assert hub.requests == []


@pytest.mark.parametrize("content, says", [
    (b"<html>not a model</html>", "is not a GGUF file"),
    (GGUF[:-100], f"is truncated: {len(GGUF) - 100} bytes, but its tensors need {len(GGUF)}"),
    (GGUF[:60], "is truncated: its header runs past the end of the file"),
])
def test_a_download_that_is_no_usable_gguf_is_deleted(hub: FakeHub, tmp_path: Path,
                                                      content: bytes, says: str) -> None:
    hub.push("acme/bad", {"bad.gguf": content})
    line = _error_line(runner.invoke(app, ["pull", "acme/bad:bad.gguf"]))
    assert line.startswith("error: cannot use acme/bad:bad.gguf (the download is deleted): ")
    assert says in line
    models = _models(tmp_path)
    assert not (models / "huggingface").exists()  # the commit's folder went with it
    assert Registry(models).tags() == {} and Registry(models).manifests() == {}


def test_file_in_a_repo_folder_stays_in_its_folder(hub: FakeHub, tmp_path: Path) -> None:
    commit = hub.push("acme/deep-GGUF", {"Q4_K_M/deep-Q4_K_M.gguf": GGUF})
    r = runner.invoke(app, ["pull", "acme/deep-GGUF", "--revision", commit])
    assert r.exit_code == 0, r.output
    path = _pulled(tmp_path, "acme/deep-GGUF", commit, "Q4_K_M/deep-Q4_K_M.gguf")
    assert path.read_bytes() == GGUF
    assert ("HEAD", f"/acme/deep-GGUF/resolve/{commit}/Q4_K_M/deep-Q4_K_M.gguf") in hub.requests
    assert Registry(_models(tmp_path)).find("deep-q4_k_m") == path


def test_pull_again_skips_an_up_to_date_file_unless_forced(hub: FakeHub, tmp_path: Path) -> None:
    commit = hub.push("acme/tiny-GGUF", {"tiny-Q8_0.gguf": GGUF})
    for args, gets in ((["pull", "acme/tiny-GGUF:tiny-Q8_0.gguf"], 1),
                       (["pull", "acme/tiny-GGUF:tiny-Q8_0.gguf"], 1),
                       (["pull", "acme/tiny-GGUF:tiny-Q8_0.gguf", "--force"], 2)):
        r = runner.invoke(app, args)
        assert r.exit_code == 0, r.output
        assert hub.gets("/tiny-Q8_0.gguf") == gets
    assert _pulled(tmp_path, "acme/tiny-GGUF", commit, "tiny-Q8_0.gguf").read_bytes() == GGUF
    # A commit that leaves the file as it was (a README edit) downloads nothing either.
    hub.push("acme/tiny-GGUF", {"tiny-Q8_0.gguf": GGUF, "README.md": b"# new\n"})
    r = runner.invoke(app, ["pull", "acme/tiny-GGUF:tiny-Q8_0.gguf"])
    assert r.exit_code == 0 and "is already here" in r.stdout and hub.gets("/tiny-Q8_0.gguf") == 2
    assert len(Registry(_models(tmp_path)).manifests()) == 1


def test_a_file_pulled_before_the_registry_is_not_downloaded_again(hub: FakeHub,
                                                                    tmp_path: Path) -> None:
    """Older pulls left the file flat in the models directory: it is adopted, and its bytes
    match what the hub lists, so the pull only records the tag."""
    hub.push("acme/tiny-GGUF", {"tiny-Q8_0.gguf": GGUF})
    _models(tmp_path).mkdir()
    (_models(tmp_path) / "tiny-Q8_0.gguf").write_bytes(GGUF)
    r = runner.invoke(app, ["pull", "acme/tiny-GGUF:tiny-Q8_0.gguf"])
    assert r.exit_code == 0, r.output
    assert "is already here" in r.stdout and hub.gets(".gguf") == 0
    registry = Registry(_models(tmp_path))
    assert registry.tags() == {"tiny-q8_0:latest": f"sha256:{_sha(GGUF)}"}
    assert registry.find("tiny-q8_0") == _models(tmp_path) / "tiny-Q8_0.gguf"


def test_a_newer_revision_moves_the_tag_and_keeps_the_old_version(hub: FakeHub,
                                                                   tmp_path: Path) -> None:
    new = tiny_gguf(seed=1)
    first = hub.push("acme/tiny-GGUF", {"tiny-Q8_0.gguf": GGUF})
    assert runner.invoke(app, ["pull", "acme/tiny-GGUF:tiny-Q8_0.gguf"]).exit_code == 0
    second = hub.push("acme/tiny-GGUF", {"tiny-Q8_0.gguf": new})
    r = runner.invoke(app, ["pull", "acme/tiny-GGUF:tiny-Q8_0.gguf"])
    assert r.exit_code == 0, r.output
    assert r.stdout.strip().splitlines()[-1] == (
        f"tiny-q8_0:latest was sha256:{_sha(GGUF)[:12]}: that version is kept "
        f"('justllm rm sha256:{_sha(GGUF)[:12]}' removes it)")
    old = _pulled(tmp_path, "acme/tiny-GGUF", first, "tiny-Q8_0.gguf")
    assert old.read_bytes() == GGUF
    assert _pulled(tmp_path, "acme/tiny-GGUF", second, "tiny-Q8_0.gguf").read_bytes() == new
    r = runner.invoke(app, ["models"])
    rows = [line.split() for line in r.stdout.splitlines()[1:]]
    assert [row[:2] for row in rows] == [["tiny-q8_0:latest", _sha(new)[:12]],
                                         ["<untagged>", _sha(GGUF)[:12]]]
    r = runner.invoke(app, ["rm", f"sha256:{_sha(GGUF)[:12]}"])
    assert r.exit_code == 0, r.output
    assert r.stdout.strip() == f"removed version sha256:{_sha(GGUF)[:12]}; deleted {old}"
    assert not old.parent.exists()


@pytest.mark.parametrize("ref", ["acme/tiny-GGUF", "acme/tiny-GGUF:tiny-Q8_0.gguf"])
def test_unreachable_hub_is_one_line(hub: FakeHub, monkeypatch: pytest.MonkeyPatch,
                                     tmp_path: Path, ref: str) -> None:
    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        dead = f"http://127.0.0.1:{s.getsockname()[1]}"
    isolate_hub_library(monkeypatch, tmp_path, dead)
    # huggingface_hub retries network errors with exponential backoff (about 23 s); skip the waits.
    import huggingface_hub.utils._http as hf_http
    monkeypatch.setattr(hf_http.time, "sleep", lambda _s: None)
    line = _error_line(runner.invoke(app, ["pull", ref]))
    said = "cannot list acme/tiny-GGUF on" if ":" not in ref else "cannot download acme/tiny-GGUF:"
    assert said in line and dead in line
    assert ModelStore(_models(tmp_path)).paths() == []


@pytest.mark.parametrize("body, says", [
    (b'{"siblings": "x", "sha": 5}', "TypeError: string indices must be integers"),
    (b"[1, 2]", "TypeError: 'int' object is not subscriptable"),
    (b"[{}]", "KeyError: 'type'"),
    (b"null", "TypeError: 'NoneType' object is not iterable"),
    (b'[{"type": "file", "path": 5, "size": 1, "oid": "x"}]', "file names that are not strings"),
])
def test_a_mirror_answering_json_that_is_not_the_hubs_is_one_line(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path, body: bytes, says: str) -> None:
    """A listing the hub library cannot read was its TypeError traceback."""
    import threading
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    class Odd(BaseHTTPRequestHandler):
        def _answer(self) -> None:
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            if self.command != "HEAD":
                self.wfile.write(body)

        do_GET = do_HEAD = _answer

        def log_message(self, *args: object) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Odd)
    threading.Thread(target=server.serve_forever, args=(0.05,), daemon=True).start()
    url = f"http://127.0.0.1:{server.server_address[1]}"
    isolate_hub_library(monkeypatch, tmp_path, url)
    try:
        line = _error_line(runner.invoke(app, ["pull", "acme/odd"]))
    finally:
        server.shutdown()
        server.server_close()
    assert line.startswith(f"error: cannot list acme/odd on {url}: its answer is not a "
                           "Hugging Face Hub's (") and says in line, line
    assert ModelStore(_models(tmp_path)).paths() == []


def test_a_hub_that_does_not_resolve_fails_at_once_and_a_missing_path_is_not_a_repo(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """Offline, a repo's listing waited out the hub library's five retries (~25 s, a warning
    line each); a mistyped dir/model.gguf was taken for a repo and did the same."""
    import huggingface_hub.utils._http as hf_http

    isolate_hub_library(monkeypatch, tmp_path, "http://no-such-host.invalid")
    slept: list[float] = []
    monkeypatch.setattr(hf_http.time, "sleep", slept.append)
    line = _error_line(runner.invoke(app, ["pull", "acme/tiny-GGUF"]))
    assert line.startswith("error: cannot list acme/tiny-GGUF on http://no-such-host.invalid")
    assert slept == []  # not retried
    r = runner.invoke(app, ["run", str(Path("nodir") / "model.gguf"), "-p", "hi"])
    assert r.exit_code == 1 and "model not found: nodir/model.gguf" in r.output
    assert slept == []
    # A mirror that is down (nothing listens): refused at once, not retried either.
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        closed = f"http://127.0.0.1:{s.getsockname()[1]}"
    isolate_hub_library(monkeypatch, tmp_path, closed)
    line = _error_line(runner.invoke(app, ["pull", "acme/tiny-GGUF"]))
    assert line.startswith(f"error: cannot list acme/tiny-GGUF on {closed}") and "refused" in line
    assert slept == []


def test_a_local_path_is_refused_before_any_request(hub: FakeHub, tmp_path: Path,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """``pull /abs/model.gguf`` asked the hub for the repo ``abs/model.gguf`` (its leading '/'
    stripped), and failed with "cannot list ... on the Hugging Face Hub"."""
    file = tmp_path / "model.gguf"
    tiny_gguf(file)
    monkeypatch.chdir(tmp_path)
    is_file = "is a local file, not a Hugging Face REPO[:FILE]: register it with 'justllm tag"
    for ref, says in (
            (str(file), f"error: {file} {is_file} {file} NAME' (or run it directly)"),
            ("model.gguf", f"error: model.gguf {is_file} model.gguf NAME' (or run it directly)"),
            ("./nope.gguf", "error: ./nope.gguf is a local path, not a Hugging Face "
                            "REPO[:FILE], and no file is there"),
            ("../nope/x.gguf", "error: ../nope/x.gguf is a local path, not a Hugging Face "
                               "REPO[:FILE], and no file is there"),
            ("~/no-such-dir/x.gguf", "error: ~/no-such-dir/x.gguf is a local path, not a "
                                     "Hugging Face REPO[:FILE], and no file is there"),
            (str(tmp_path), f"error: {tmp_path} is a local folder, not a Hugging Face "
                            f"REPO[:FILE] ('justllm convert {tmp_path}' converts a safetensors "
                            "model there)")):
        assert _error_line(runner.invoke(app, ["pull", ref])) == says, ref
    assert hub.requests == []
    # A folder that is only named like a repo (a git clone of it) does not stop a pull.
    (tmp_path / "acme" / "tiny-GGUF").mkdir(parents=True)
    assert split_ref("acme/tiny-GGUF") == ("acme/tiny-GGUF", None)


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
    commit = hub.push("acme/multi-GGUF", {"a-Q4_K_M.gguf": GGUF, "a-Q8_0.gguf": GGUF})
    r = runner.invoke(app, ["pull", "acme/multi-GGUF"])
    assert r.exit_code == 0, r.output
    assert _pulled(tmp_path, "acme/multi-GGUF", commit, "a-Q4_K_M.gguf").read_bytes() == GGUF
    assert hub.gets("/tree/main") == 1 and hub.gets("/a-Q4_K_M.gguf") == 1


def test_run_accepts_a_hub_repo_as_the_model(hub: FakeHub, tmp_path: Path) -> None:
    """``justllm run REPO:FILE`` pulls first, then loads: the stand-in's file is a GGUF with no
    weights, so loading then fails with llama.cpp's one-line error, after the download; a second
    run finds the pulled file without asking the hub."""
    commit = hub.push("acme/tiny-GGUF", {"tiny-Q4_K_M.gguf": GGUF})
    for _ in range(2):
        r = CliRunner().invoke(app, ["run", "acme/tiny-GGUF:tiny-Q4_K_M.gguf", "-p", "hi"])
        assert r.exit_code == 1
        assert "could not load" in r.output or "could not read" in r.output
    assert _pulled(tmp_path, "acme/tiny-GGUF", commit, "tiny-Q4_K_M.gguf").is_file()
    assert hub.gets(".gguf") == 1 and Registry(_models(tmp_path)).find("tiny-q4_k_m") is not None


def test_a_tag_that_reads_as_a_digest_is_refused_first(hub: FakeHub, tmp_path: Path) -> None:
    hub.push("acme/tiny-GGUF", {"tiny-Q8_0.gguf": GGUF})
    for tag in ("sha256:123456789012", "123456789012"):
        line = _error_line(runner.invoke(app, ["pull", "acme/tiny-GGUF", "--tag", tag]))
        assert line.startswith(f"error: '{tag}' cannot be a model name: it reads as a digest")
    assert hub.requests == [] and not _models(tmp_path).exists()


@pytest.mark.convert
def test_pull_convert_again_is_already_here_unless_the_file_is_another(
        hub: FakeHub, tmp_path: Path) -> None:
    """A second ``pull REPO --convert --quantize Q8_0`` said the output "already exists" and
    failed, where a second plain pull says "already here". It is already here when the file is
    the registered conversion of that commit to that type; any other file is still refused."""
    from tests.models.tiny_hf import make_tiny_llama, model_files

    tiny = make_tiny_llama(tmp_path / "hf" / "tiny-llama")
    commit = hub.push("acme/Tiny-Llama", model_files(tiny))
    args = ["pull", "acme/Tiny-Llama", "--convert", "--quantize", "Q8_0"]
    assert runner.invoke(app, args).exit_code == 0
    out = _models(tmp_path) / "huggingface" / "acme" / "Tiny-Llama" / commit / "tiny-llama-q8_0.gguf"
    written, digest = out.stat().st_mtime_ns, Registry(_models(tmp_path)).resolve("tiny-llama-q8_0")[1]
    r = runner.invoke(app, [*args, "--tag", "tiny:q8"])
    assert r.exit_code == 0, r.output
    assert "converting" not in r.stderr and out.stat().st_mtime_ns == written
    assert " ".join(r.stdout.split()) == (
        f"converted from acme/Tiny-Llama @ {commit} (Q8_0) is already here: {out} registered "
        f"as tiny:q8 (sha256:{digest.short}; justllm run tiny:q8)")
    assert Registry(_models(tmp_path)).tags() == {"tiny-llama-q8_0:latest": digest.digest,
                                                  "tiny:q8": digest.digest}
    # `justllm convert REPO` again is the same (it failed as the pull did).
    r = runner.invoke(app, ["convert", "acme/Tiny-Llama", "--quantize", "Q8_0"])
    assert r.exit_code == 0 and "is already here" in r.stdout, r.output
    assert out.stat().st_mtime_ns == written
    out.write_bytes(GGUF)  # another file in its place: not this conversion any more
    line = _error_line(runner.invoke(app, args))
    assert line == f"error: {out} already exists (--force overwrites it)"
    assert out.read_bytes() == GGUF


def test_a_file_larger_than_the_free_disk_is_refused_before_its_download(
        hub: FakeHub, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """It failed once the disk was full, after the hub library's warnings (two lines each);
    quantize and convert check first."""
    import collections

    import justllm.models.hub as hub_module

    hub.push("acme/tiny-GGUF", {"tiny-Q8_0.gguf": GGUF})
    usage = collections.namedtuple("usage", "total used free")
    monkeypatch.setattr(hub_module.shutil, "disk_usage", lambda _p: usage(10**9, 10**9, 10))
    line = _error_line(runner.invoke(app, ["pull", "acme/tiny-GGUF:tiny-Q8_0.gguf"]))
    assert "not enough disk space in " in line and "for acme/tiny-GGUF:tiny-Q8_0.gguf" in line
    assert hub.gets("/tiny-Q8_0.gguf") == 0
    assert ModelStore(_models(tmp_path)).paths() == []


def _corrupt(data: bytes) -> bytes:
    """``data`` with its last byte (tensor data) flipped: still a GGUF, of the same size."""
    return data[:-1] + bytes([data[-1] ^ 0xFF])


def test_a_download_whose_bytes_are_not_the_hubs_sha256_is_deleted_and_not_registered(
        hub: FakeHub, tmp_path: Path) -> None:
    """A corrupted download was registered as a working model without a word (and, as its
    digest never matched the hub's, downloaded again by every later pull)."""
    commit = hub.push("acme/tiny-GGUF", {"tiny-Q8_0.gguf": GGUF})
    hub.corrupted[("acme/tiny-GGUF", "tiny-Q8_0.gguf")] = _corrupt(GGUF)
    line = _error_line(runner.invoke(app, ["pull", "acme/tiny-GGUF:tiny-Q8_0.gguf"]))
    assert line == (
        f"error: digest mismatch: acme/tiny-GGUF:tiny-Q8_0.gguf downloaded with "
        f"sha256:{_sha(_corrupt(GGUF))[:12]}, but the hub lists sha256:{_sha(GGUF)[:12]} (the "
        "download is deleted and nothing is registered: pull it again)")
    models = _models(tmp_path)
    assert not (models / "huggingface").exists()
    assert Registry(models).tags() == {} and Registry(models).manifests() == {}
    # Once the bytes arrive whole, the pull registers them, and a later pull is "already here".
    del hub.corrupted[("acme/tiny-GGUF", "tiny-Q8_0.gguf")]
    assert runner.invoke(app, ["pull", "acme/tiny-GGUF:tiny-Q8_0.gguf"]).exit_code == 0
    r = runner.invoke(app, ["pull", "acme/tiny-GGUF:tiny-Q8_0.gguf"])
    assert r.exit_code == 0 and "is already here" in r.stdout and hub.gets(".gguf") == 2
    path = _pulled(tmp_path, "acme/tiny-GGUF", commit, "tiny-Q8_0.gguf")
    assert Registry(models).find("tiny-q8_0") == path and path.read_bytes() == GGUF


def test_a_forced_pull_that_arrives_corrupted_leaves_no_bad_file(hub: FakeHub,
                                                                 tmp_path: Path) -> None:
    """``--force`` downloads over the registered file: corrupted bytes there are deleted (the
    version's own bytes are gone then), never kept under the version's name."""
    commit = hub.push("acme/tiny-GGUF", {"tiny-Q8_0.gguf": GGUF})
    assert runner.invoke(app, ["pull", "acme/tiny-GGUF:tiny-Q8_0.gguf"]).exit_code == 0
    hub.corrupted[("acme/tiny-GGUF", "tiny-Q8_0.gguf")] = _corrupt(GGUF)
    line = _error_line(runner.invoke(app, ["pull", "acme/tiny-GGUF:tiny-Q8_0.gguf", "--force"]))
    assert line.startswith("error: digest mismatch: acme/tiny-GGUF:tiny-Q8_0.gguf downloaded")
    assert not _pulled(tmp_path, "acme/tiny-GGUF", commit, "tiny-Q8_0.gguf").exists()
    assert [m.hex for m in Registry(_models(tmp_path)).manifests().values()] == [_sha(GGUF)]


def _partials(tmp_path: Path) -> list[Path]:
    """huggingface_hub's partial downloads under the models directory."""
    return sorted(_models(tmp_path).rglob("*.incomplete"))


@contextlib.contextmanager
def _pull_held_mid_file(hub: FakeHub, tmp_path: Path, ref: str) -> Iterator[subprocess.Popen]:
    """A real ``justllm pull ref`` whose download the stand-in holds halfway: yielded once the
    hub has sent half the file and the partial file exists; killed if still running after."""
    repo, _, file = ref.partition(":")
    hub.held.add((repo, file))
    proc = subprocess.Popen([sys.executable, "-m", "justllm", "pull", ref],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 60
        while not (hub.midway.is_set() and _partials(tmp_path)):
            assert proc.poll() is None, proc.communicate()
            assert time.monotonic() < deadline, "the pull never got halfway"
            time.sleep(0.05)
        yield proc
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.communicate()
        hub.held.discard((repo, file))
        hub.release.set()


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGHUP])
def test_a_pull_terminated_mid_file_leaves_no_partial_file(hub: FakeHub, tmp_path: Path,
                                                           sig: signal.Signals) -> None:
    """SIGTERM or SIGHUP (a closed terminal) ended the process at once, and the hub library's
    ``*.incomplete`` file stayed in the models directory, one more for each such pull; Ctrl-C
    deleted it. Now both go the way Ctrl-C goes, and exit 128 + the signal, as quantize does."""
    hub.push("acme/tiny-GGUF", {"tiny-Q8_0.gguf": GGUF})
    with _pull_held_mid_file(hub, tmp_path, "acme/tiny-GGUF:tiny-Q8_0.gguf") as proc:
        proc.send_signal(sig)
        _, err = proc.communicate(timeout=60)
        assert proc.returncode == 128 + sig, err
        assert err.strip() == "terminated: no output written" and "Traceback" not in err
    assert _partials(tmp_path) == []
    assert ModelStore(_models(tmp_path)).paths() == []
    assert Registry(_models(tmp_path)).tags() == {}


def test_a_partial_file_left_by_a_killed_pull_is_swept_by_the_next_pull(hub: FakeHub,
                                                                         tmp_path: Path) -> None:
    """SIGKILL leaves no chance to clean up: the next pull of the repo deletes the partial file,
    whose download lock its dead process no longer holds."""
    commit = hub.push("acme/tiny-GGUF", {"tiny-Q8_0.gguf": GGUF})
    with _pull_held_mid_file(hub, tmp_path, "acme/tiny-GGUF:tiny-Q8_0.gguf") as proc:
        proc.send_signal(signal.SIGKILL)
        proc.communicate(timeout=60)
    left = _partials(tmp_path)
    assert len(left) == 1
    r = runner.invoke(app, ["pull", "acme/tiny-GGUF:tiny-Q8_0.gguf"])
    assert r.exit_code == 0, r.output
    assert _partials(tmp_path) == []
    path = _pulled(tmp_path, "acme/tiny-GGUF", commit, "tiny-Q8_0.gguf")
    assert path.read_bytes() == GGUF and Registry(_models(tmp_path)).find("tiny-q8_0") == path


def _offline(monkeypatch: pytest.MonkeyPatch) -> None:
    from huggingface_hub import constants

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)


def test_every_repo_file_a_version_was_pulled_from_finds_it_offline(
        hub: FakeHub, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The same bytes pulled again from a mirror (another repo and file) were "already here",
    but only the first origin was recorded: offline, ``serve MIRROR:FILE`` said "pulling ...
    needs the hub", though a model pulled before needs none."""
    from justllm.models.source import resolve_model

    commit = hub.push("acme/tiny-GGUF", {"tiny-Q8_0.gguf": GGUF})
    mirror = hub.push("acme/sub-GGUF", {"UPPER-Q8_0.gguf": GGUF})
    assert runner.invoke(app, ["pull", "acme/tiny-GGUF:tiny-Q8_0.gguf"]).exit_code == 0
    r = runner.invoke(app, ["pull", "acme/sub-GGUF:UPPER-Q8_0.gguf"])
    assert r.exit_code == 0 and "is already here" in r.stdout, r.output
    path = _pulled(tmp_path, "acme/tiny-GGUF", commit, "tiny-Q8_0.gguf")
    _offline(monkeypatch)
    for ref in ("acme/tiny-GGUF:tiny-Q8_0.gguf", "acme/sub-GGUF:UPPER-Q8_0.gguf"):
        assert Path(resolve_model(ref)).resolve() == path, ref
    assert hub.gets(".gguf") == 1
    m = Registry(_models(tmp_path)).resolve("upper-q8_0")[1]
    assert (m.source.repo, m.source.file, m.source.revision) == (
        "acme/tiny-GGUF", "tiny-Q8_0.gguf", commit)
    assert [(o.repo, o.file, o.revision) for o in m.origins] == [
        ("acme/sub-GGUF", "UPPER-Q8_0.gguf", mirror)]
