"""justllm-ollama against a stand-in Ollama store: manifests as Ollama writes them, and as the
model blob the demo GGUF (Gemma 3 270M), linked in. The source is tested directly, through
justllm's plugin loading (the installed entry point), and end to end through the ``justllm``
console script: run, models, plugins and serve."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
from justllm.errors import ModelLoadError

import justllm_ollama
from justllm_ollama import OllamaName, OllamaSource

JUSTLLM = str(Path(sys.executable).with_name("justllm"))
# The digest Ollama would have recorded for this blob (the demo GGUF's own sha256).
DIGEST = "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818"
MODEL_LAYER = "application/vnd.ollama.image.model"


# ---- a stand-in Ollama store -----------------------------------------------------------------


def write_manifest(root: Path, parts: tuple[str, str, str, str], layers: list[dict]) -> Path:
    path = root.joinpath("manifests", *parts)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({
        "schemaVersion": 2,
        "mediaType": "application/vnd.docker.distribution.manifest.v2+json",
        "config": {"mediaType": "application/vnd.docker.container.image.v1+json",
                   "digest": "sha256:" + "c" * 64, "size": 487},
        "layers": layers}))
    return path


def layer(digest: str, media_type: str = MODEL_LAYER) -> dict:
    return {"mediaType": media_type, "digest": f"sha256:{digest}", "size": 1}


def link(source: Path, target: Path) -> None:
    """A hard link (what a real store would hold: a file), else a symlink, else a copy."""
    target.parent.mkdir(parents=True, exist_ok=True)
    try:
        os.link(source, target)
    except OSError:
        try:
            target.symlink_to(source)
        except OSError:
            shutil.copyfile(source, target)


def build_store(root: Path, demo: Path) -> Path:
    """Three names for the demo blob (each name form) and a template layer beside it."""
    link(demo, root / "blobs" / f"sha256-{DIGEST}")
    (root / "blobs" / f"sha256-{'d' * 64}").write_text("{{ .Prompt }}")
    layers = [layer(DIGEST), layer("d" * 64, "application/vnd.ollama.image.template")]
    write_manifest(root, ("registry.ollama.ai", "library", "gemma3", "270m"), layers)
    write_manifest(root, ("registry.ollama.ai", "someone", "tiny", "latest"), layers)
    write_manifest(root, ("hf.co", "owner", "repo-GGUF", "Q4_K_M"), layers)
    return root


@pytest.fixture(scope="module")
def demo() -> Path:
    """The demo GGUF, assembled into the real cache before any test moves JUSTLLM_CACHE_DIR."""
    from justllm.models.source import demo_model_path

    return demo_model_path()


@pytest.fixture
def store(tmp_path: Path, demo: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    root = build_store(tmp_path / "ollama-models", demo)
    monkeypatch.setenv("OLLAMA_MODELS", str(root))
    monkeypatch.setenv("JUSTLLM_PLUGINS", "justllm-ollama")
    monkeypatch.setenv("JUSTLLM_CACHE_DIR", str(tmp_path / "justllm-cache"))
    return root


def blob(root: Path) -> Path:
    return root / "blobs" / f"sha256-{DIGEST}"


# ---- names -------------------------------------------------------------------------------------


@pytest.mark.parametrize("text, parts, short", [
    ("llama3.2", ("registry.ollama.ai", "library", "llama3.2", "latest"), "llama3.2:latest"),
    ("llama3.2:1b", ("registry.ollama.ai", "library", "llama3.2", "1b"), "llama3.2:1b"),
    ("someone/tiny", ("registry.ollama.ai", "someone", "tiny", "latest"), "someone/tiny:latest"),
    ("hf.co/owner/repo-GGUF:Q4_K_M", ("hf.co", "owner", "repo-GGUF", "Q4_K_M"),
     "hf.co/owner/repo-GGUF:Q4_K_M"),
    ("localhost:5000/team/m", ("localhost:5000", "team", "m", "latest"),
     "localhost:5000/team/m:latest"),
    ("https://registry.ollama.ai/library/qwen3:4b",
     ("registry.ollama.ai", "library", "qwen3", "4b"), "qwen3:4b"),
])
def test_name_forms_fill_in_what_ollama_fills_in(text, parts, short):
    name = OllamaName.parse(text)
    assert name.parts == parts
    assert name.short == short


@pytest.mark.parametrize("text", ["../../etc/passwd", "a/b/c/d", "model:", ".hidden",
                                  "a//b", "m@sha256-" + "0" * 64, "spa ce"])
def test_names_that_are_no_ollama_name_are_refused(text):
    with pytest.raises(ModelLoadError, match=r"ollama:"):
        OllamaName.parse(text)


# ---- resolution --------------------------------------------------------------------------------


@pytest.mark.parametrize("ref", ["ollama:gemma3:270m", "ollama:someone/tiny",
                                 "ollama:someone/tiny:latest", "ollama:hf.co/owner/repo-GGUF:Q4_K_M",
                                 "ollama:registry.ollama.ai/library/gemma3:270m",
                                 "ollama:Gemma3:270M"])  # Ollama's names ignore case
def test_each_name_form_resolves_to_the_blob(store, ref):
    assert OllamaSource().find(ref) == blob(store)


@pytest.mark.parametrize("ref", ["gemma3:270m", "demo", "/tmp/x.gguf", "owner/repo:f.gguf",
                                 "Ollama:gemma3:270m"])
def test_other_references_are_left_to_other_sources(store, ref):
    assert OllamaSource().find(ref) is None


def test_an_unknown_model_names_the_directory_and_the_pull(store):
    with pytest.raises(ModelLoadError) as e:
        OllamaSource().find("ollama:llama3.2")
    message = str(e.value)
    assert "llama3.2:latest not found in " + str(store) in message
    assert "manifests/registry.ollama.ai/library/llama3.2/latest" in message
    assert message.endswith("ollama pull llama3.2") and "\n" not in message


def test_the_served_name_is_the_name_without_its_blanks(store):
    """``serve "ollama: gemma3 "`` answered to " gemma3 ", blanks and all."""
    assert OllamaSource().served_name("ollama: gemma3:270m ") == "gemma3:270m"
    assert OllamaSource().served_name("ollama:  ") is None
    assert OllamaSource().served_name("gemma3") is None


def test_an_empty_name_is_an_error(store):
    with pytest.raises(ModelLoadError, match="needs a model name"):
        OllamaSource().find("ollama:")


def test_a_missing_blob_is_an_error(store):
    blob(store).unlink()
    with pytest.raises(ModelLoadError, match=r"gemma3:270m: its model blob .* is missing "
                                             r"\(pull it again with: ollama pull gemma3:270m\)"):
        OllamaSource().find("ollama:gemma3:270m")


def test_a_manifest_without_a_model_layer_is_an_error(store):
    write_manifest(store, ("registry.ollama.ai", "library", "cloudy", "latest"),
                   [layer("d" * 64, "application/vnd.ollama.image.template")])
    with pytest.raises(ModelLoadError, match="cloudy:latest has no local model layer"):
        OllamaSource().find("ollama:cloudy")


def test_a_blob_that_is_no_gguf_is_an_error(store):
    write_manifest(store, ("registry.ollama.ai", "library", "notgguf", "latest"),
                   [layer("e" * 64)])
    (store / "blobs" / f"sha256-{'e' * 64}").write_bytes(b"PK\x03\x04 safetensors, say")
    with pytest.raises(ModelLoadError, match=r"notgguf:latest: its model blob .* is not a GGUF"):
        OllamaSource().find("ollama:notgguf")


def test_an_adapter_as_the_model_layer_is_said_to_be_one(store):
    """Not "not a GGUF file": it is one, a LoRA adapter, and the message says how to use it."""
    import gguf

    adapter = store / "blobs" / f"sha256-{'a' * 64}"
    writer = gguf.GGUFWriter(str(adapter), "gemma3")
    writer.add_type(gguf.GGUFType.ADAPTER)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.close()
    write_manifest(store, ("registry.ollama.ai", "library", "lora", "latest"), [layer("a" * 64)])
    with pytest.raises(ModelLoadError, match=r"^ollama model lora:latest: .* is a LoRA adapter, "
                                             r"not a model: use --lora NAME="):
        OllamaSource().find("ollama:lora")


def test_an_adapter_or_projector_left_out_is_said(store, caplog):
    """Ollama would apply the adapter (and could see images): justllm serves the base model,
    text only, and says so with the --lora that applies the adapter, where it said nothing."""
    adapter = f"sha256-{'7' * 64}"
    write_manifest(store, ("registry.ollama.ai", "library", "tuned", "latest"), [
        layer(DIGEST), layer("7" * 64, "application/vnd.ollama.image.adapter"),
        layer("6" * 64, "application/vnd.ollama.image.projector"),
        layer("d" * 64, "application/vnd.ollama.image.template")])
    with caplog.at_level("WARNING", logger="justllm.plugins.ollama"):
        assert OllamaSource().find("ollama:gemma3:270m") == blob(store)
        assert caplog.messages == []  # a model and a template: nothing left out but the
        assert OllamaSource().find("ollama:tuned") == blob(store)  # template (the README)
    assert caplog.messages == [
        "ollama model tuned:latest: its adapter is not applied, so the answers are the base "
        f"model's (load it with --lora NAME={store / 'blobs' / adapter})",
        "ollama model tuned:latest: its vision projector is not used (text only)"]


def test_a_manifest_that_is_no_json_is_an_error(store):
    path = write_manifest(store, ("registry.ollama.ai", "library", "broken", "latest"), [])
    path.write_text("{not json")
    with pytest.raises(ModelLoadError, match="manifest .* is unreadable"):
        OllamaSource().find("ollama:broken")


def test_ollama_models_is_read_at_call_time(store, tmp_path, demo, monkeypatch):
    other = build_store(tmp_path / "elsewhere", demo)
    monkeypatch.setenv("OLLAMA_MODELS", f'  "{other}" ')  # trimmed as Ollama trims it
    assert OllamaSource().find("ollama:gemma3:270m") == blob(other)
    monkeypatch.setenv("OLLAMA_MODELS", str(tmp_path / "nowhere"))
    with pytest.raises(ModelLoadError, match=f"no Ollama models directory at {tmp_path}/nowhere "
                                             r"\(set OLLAMA_MODELS, or ollama pull gemma3:270m\)"):
        OllamaSource().find("ollama:gemma3:270m")


def test_without_ollama_models_home_then_the_service_directory(tmp_path, demo, monkeypatch):
    monkeypatch.delenv("OLLAMA_MODELS", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    service = build_store(tmp_path / "service", demo)
    monkeypatch.setattr(justllm_ollama, "SERVICE_MODELS_DIR", service)
    assert justllm_ollama.models_dir() == service  # no ~/.ollama/models yet
    assert OllamaSource().find("ollama:gemma3:270m") == blob(service)
    home = build_store(tmp_path / "home" / ".ollama" / "models", demo)
    assert OllamaSource().find("ollama:gemma3:270m") == blob(home)


def test_models_lists_each_pulled_model_with_its_blob(store):
    write_manifest(store, ("registry.ollama.ai", "library", "cloudy", "latest"), [])
    (store / "manifests" / "registry.ollama.ai" / "library" / "junk").mkdir()
    listed = {m.name: m.path for m in OllamaSource().models()}
    assert listed == {"ollama:gemma3:270m": blob(store), "ollama:someone/tiny:latest": blob(store),
                      "ollama:hf.co/owner/repo-GGUF:Q4_K_M": blob(store)}
    # each listed name finds its model again
    assert all(OllamaSource().find(name) == path for name, path in listed.items())


def test_the_installed_entry_point_resolves_before_the_registry(store):
    from justllm.plugins import load_plugins

    plugins = load_plugins()
    assert not plugins.problems
    names = [s.name for s in plugins.model_sources()]
    assert names.index("ollama") == names.index("path") + 1 < names.index("registry")
    assert plugins.resolve_model("ollama:gemma3:270m") == str(blob(store))
    assert ("ollama", "ollama:gemma3:270m") in [(src, m.name) for src, m in
                                                plugins.listed_models()]


# ---- the justllm command, end to end -----------------------------------------------------------


def cli_env(tmp_path: Path) -> dict[str, str]:
    """This test's environment for a subprocess, without the user's config or other plugins."""
    env = {k: v for k, v in os.environ.items()
           if not k.startswith("JUSTLLM_") or k in ("JUSTLLM_PLUGINS", "JUSTLLM_CACHE_DIR")}
    return env | {"XDG_CONFIG_HOME": str(tmp_path / "config"), "NO_COLOR": "1",
                  "COLUMNS": "200"}


def justllm(tmp_path: Path, *args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([JUSTLLM, *args], env=cli_env(tmp_path), capture_output=True,
                          text=True, timeout=timeout)


def test_run_generates_from_the_ollama_blob(store, tmp_path):
    r = justllm(tmp_path, "run", "ollama:gemma3:270m", "-p", "The capital of France is",
                "-n", "8", "--raw")
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip()  # the continuation; the speeds go to stderr
    assert re.search(r"generation [1-8] tok", r.stderr), r.stderr


def test_run_of_a_missing_model_is_one_line(store, tmp_path):
    r = justllm(tmp_path, "run", "ollama:missing", "-p", "hi")
    assert r.returncode == 1
    lines = [line for line in r.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, r.stderr
    assert lines[0].startswith("error: ollama model missing:latest not found in ")
    assert lines[0].endswith("pull it with: ollama pull missing")


def test_models_lists_ollama_models_from_their_gguf_headers(store, tmp_path):
    r = justllm(tmp_path, "models")
    assert r.returncode == 0, r.stderr
    rows = {line.split()[0]: line.split() for line in r.stdout.splitlines()[1:]}
    assert set(rows) == {"ollama:gemma3:270m", "ollama:someone/tiny:latest",
                         "ollama:hf.co/owner/repo-GGUF:Q4_K_M"}  # the registry is empty here
    assert rows["ollama:gemma3:270m"][1:] == ["-", "253.1", "MB", "Q4_K_M", "gemma3", "32768"]


def test_show_and_tag_take_an_ollama_name(store, tmp_path):
    """show reads the blob's GGUF header; tag registers the blob where it is under a name of
    justllm's own, which then resolves without the plugin's prefix; rm refuses to remove it;
    a missing model is the plugin's one-line error."""
    r = justllm(tmp_path, "show", "ollama:gemma3:270m")
    assert r.returncode == 0, r.stderr
    assert r.stdout.splitlines()[0].startswith("ollama:gemma3:270m")
    assert f"path: {blob(store)}" in r.stdout
    assert "architecture: gemma3" in r.stdout
    r = justllm(tmp_path, "tag", "ollama:someone/tiny", "tiny:v1")
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith("tiny:v1 -> sha256:") and str(blob(store)) in r.stdout
    r = justllm(tmp_path, "show", "tiny:v1")
    assert r.returncode == 0, r.stderr
    assert "tags: tiny:v1" in r.stdout and f"path: {blob(store)}" in r.stdout
    r = justllm(tmp_path, "rm", "ollama:gemma3:270m")  # Ollama's store is not ours
    assert r.returncode == 1 and blob(store).is_file()
    assert r.stderr.startswith("error: ollama:gemma3:270m is a plugin's model"), r.stderr
    for command in (("show", "ollama:missing"), ("tag", "ollama:missing", "x:1"),
                    ("rm", "ollama:missing")):
        r = justllm(tmp_path, *command)
        assert r.returncode == 1
        lines = [line for line in r.stderr.splitlines() if line.strip()]
        assert len(lines) == 1 and "ollama model missing:latest not found" in lines[0], r.stderr
    # A name of the plugin's is not ours to make: `run` asks the plugin first, so it ran
    # Ollama's model (or failed) where `show` and `rm` read justllm's tag.
    for command in (("tag", str(blob(store)), "ollama:tiny"),
                    ("tag", str(blob(store)), "Ollama:foo"),
                    ("pull", "acme/x", "--tag", "ollama:foo"),
                    ("convert", "acme/x", "--name", "ollama:foo")):
        r = justllm(tmp_path, *command)
        assert r.returncode == 1
        lines = [line for line in r.stderr.splitlines() if line.strip()]
        assert len(lines) == 1 and "names a plugin's model (ollama:NAME): pick another" \
            in lines[0], r.stderr


def unprivileged() -> list[str]:
    """A command prefix that makes file permissions count: root without the capabilities that
    read and search whatever it likes (a user has none of them)."""
    if os.geteuid() != 0:
        return []
    setpriv = shutil.which("setpriv")
    if setpriv is None:
        pytest.skip("root without setpriv: a permission cannot be denied")
    return [setpriv, "--bounding-set", "-dac_override,-dac_read_search"]


@pytest.mark.parametrize("locked", ["models directory", "manifest directory", "blob"])
def test_a_store_this_user_may_not_read_is_one_line_saying_so(store, tmp_path, locked):
    """As a stock Linux install is to a user outside the ollama group (its models are in the
    service user's home): not "model not found", not the plugin skipped as broken, not "not
    a GGUF"."""
    env = cli_env(tmp_path)
    target = {"manifest directory": store / "manifests" / "registry.ollama.ai" / "library",
              "blob": store / "blobs" / f"sha256-{'b' * 64}"}.get(locked)
    if locked == "blob":  # its own file: the demo GGUF's link shares its mode with the cache's
        target.write_bytes(b"GGUF")
        write_manifest(store, ("registry.ollama.ai", "library", "gemma3", "270m"),
                       [layer("b" * 64)])
    if target is None:  # the service's home, which only its user may enter
        home = tmp_path / "service-home"
        home.mkdir()
        store.rename(home / "models")
        env["OLLAMA_MODELS"] = str(home / "models")
        target = home
    mode = target.stat().st_mode
    target.chmod(0)
    try:
        r = subprocess.run([*unprivileged(), JUSTLLM, "show", "ollama:gemma3:270m"], env=env,
                           capture_output=True, text=True, timeout=120)
    finally:
        target.chmod(mode)
    assert r.returncode == 1
    lines = [line for line in r.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, r.stderr
    # (the path that could not be read: the locked one, or one below it)
    assert re.fullmatch(f"error: ollama model gemma3:270m: cannot read {re.escape(str(target))}"
                        r"(/\S+)?: Permission denied \(Ollama's Linux service keeps its models "
                        r"as the 'ollama' user: join its group, or set OLLAMA_MODELS\)",
                        lines[0]), r.stderr


def test_plugins_lists_the_plugin_and_its_hook(store, tmp_path):
    r = justllm(tmp_path, "plugins", "--json")
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout) == [{"name": "justllm-ollama", "version": "0.1.0",
                                     "hooks": ["register_model_sources"]}]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_serve_answers_completions_from_the_ollama_blob(store, tmp_path):
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    log = (tmp_path / "serve.log").open("w")
    proc = subprocess.Popen([JUSTLLM, "serve", "ollama:gemma3:270m", "--port", str(port)],
                            env=cli_env(tmp_path), stdout=log, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 90
        while True:
            assert proc.poll() is None, (tmp_path / "serve.log").read_text()
            assert time.monotonic() < deadline, "the server did not become healthy"
            try:
                if httpx.get(url + "/health", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            time.sleep(0.1)
        model = httpx.get(url + "/v1/models", timeout=10).json()["data"][0]["id"]
        assert model == "gemma3:270m"  # the name as given, not the blob's sha256-... stem
        r = httpx.post(url + "/v1/completions", timeout=60, json={
            "model": model, "prompt": "The capital of France is", "max_tokens": 4,
            "temperature": 0})
        assert r.status_code == 200, r.text
        body = r.json()
        assert body["choices"][0]["text"].strip()
        assert 1 <= body["usage"]["completion_tokens"] <= 4
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        log.close()
