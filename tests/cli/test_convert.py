"""``justllm convert`` and ``justllm pull --convert`` end to end: a tiny random Llama made in
the test (tests/models/tiny_hf.py), converted by llama.cpp's own converter (a child process,
about 10 s each, mostly importing torch), quantized by llama.cpp, loaded by justllm's engine,
which generates from it. Hub repos come from the stand-in hub (tests/models/fake_hub.py)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from typer.testing import CliRunner

from justllm.cli import app
from justllm.core.sampling_params import SamplingParams
from justllm.engine.llm import LLM
from justllm.models.gguf import read_gguf_header
from justllm.models.registry import Registry
from tests.helpers import children
from tests.models.fake_hub import FakeHub, serve_fake_hub
from tests.models.tiny_hf import make_tiny_llama, make_tiny_lora, model_files

pytestmark = pytest.mark.convert

runner = CliRunner()


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    return make_tiny_llama(tmp_path_factory.mktemp("hf") / "tiny-llama")


@pytest.fixture
def models(tmp_path, monkeypatch) -> Path:
    d = tmp_path / "models"
    monkeypatch.setenv("JUSTLLM_MODELS_DIR", str(d))
    # (a conversion's log: it went into the user's own ~/.cache/justllm/logs)
    monkeypatch.setenv("JUSTLLM_LOG_DIR", str(tmp_path / "logs"))
    return d


@pytest.fixture
def hub(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[FakeHub]:
    with serve_fake_hub(tmp_path, monkeypatch) as fake:
        yield fake


def error_line(r) -> str:
    assert r.exit_code == 1, r.output
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), r.stderr
    return lines[0]


def generates(path: Path) -> list[int]:
    llm = LLM(str(path), max_seqs=2, pool_blocks=16)
    try:
        (out,) = llm.generate("hello world", SamplingParams(max_tokens=4, ignore_eos=True))
        return out.token_ids
    finally:
        llm.close()


def leftovers(*dirs: Path) -> list[str]:
    """Temporary files a conversion or quantization would leave behind."""
    return [p.name for d in dirs if d.exists() for p in d.rglob(".*")
            if ".convert-" in p.name or ".partial-" in p.name]


def test_convert_a_local_model_to_q8_0_registers_it_and_it_generates(
        tiny: Path, models: Path, tmp_path: Path) -> None:
    out = tmp_path / "out" / "tiny.gguf"
    out.parent.mkdir()
    r = runner.invoke(app, ["convert", str(tiny), "--outtype", "q8_0", "-o", str(out),
                            "--name", "tiny:q8"])
    assert r.exit_code == 0, r.output
    assert f"wrote {out} (Q8_0, " in r.stdout and "registered as tiny:q8 (sha256:" in r.stdout
    assert "converting " in r.stderr and "(LlamaForCausalLM, " in r.stderr
    header = read_gguf_header(out)
    assert header.integer("general.file_type") == 7 and header.architecture == "llama"
    assert len(generates(out)) == 4
    _, m = Registry(models).resolve("tiny:q8")
    assert (m.path, m.quantization, m.source.kind, m.source.file) == (
        out, "Q8_0", "converted", str(tiny.resolve()))
    assert leftovers(out.parent, models) == []
    # the converter's own output, in a log of this output's (conversions at once keep theirs)
    from justllm.models.convert import convert_log
    assert convert_log(out).stat().st_size > 0
    # under JUSTLLM_LOG_DIR, apart from the runners' logs (`justllm logs` lists those)
    assert convert_log(out).parent == models.parent / "logs" / "convert"
    assert convert_log(out) != convert_log(out.with_name("other.gguf"))
    # (one file name in two folders shared a log, the later truncating the earlier's)
    assert convert_log(out) != convert_log(tmp_path / "elsewhere" / out.name)
    assert convert_log(out).name.startswith(f"convert-{out.name}-")
    # The same output again: refused without --force, nothing touched.
    before = out.stat().st_mtime_ns
    line = error_line(runner.invoke(app, ["convert", str(tiny), "--outtype", "q8_0", "-o",
                                          str(out)]))
    assert line == f"error: {out} already exists (--force overwrites it)"
    assert out.stat().st_mtime_ns == before
    # an empty --name is no name (it was taken as none given, and the default used)
    line = error_line(runner.invoke(app, ["convert", str(tiny), "--outtype", "q8_0", "-o",
                                          str(out), "--force", "--name", ""]))
    assert line.startswith("error: '' is not a model name"), line
    assert out.stat().st_mtime_ns == before


def test_pull_suggests_convert_then_converts_and_quantizes_a_safetensors_repo(
        tiny: Path, models: Path, hub: FakeHub) -> None:
    commit = hub.push("acme/Tiny-Llama", model_files(tiny) | {"README.md": b"# tiny\n"})
    line = error_line(runner.invoke(app, ["pull", "acme/Tiny-Llama"]))
    assert line == ("error: no .gguf model file in acme/Tiny-Llama, but it has safetensors "
                    "weights: 'justllm pull acme/Tiny-Llama --convert' converts them to GGUF")
    r = runner.invoke(app, ["pull", "acme/Tiny-Llama", "--convert", "--quantize", "Q4_0"])
    assert r.exit_code == 0, r.output
    out = models / "huggingface" / "acme" / "Tiny-Llama" / commit / "tiny-llama-q4_0.gguf"
    assert f"wrote {out} (Q4_0, " in r.stdout
    assert "registered as tiny-llama-q4_0:latest" in r.stdout
    assert f"converting acme/Tiny-Llama @ {commit[:12]} (LlamaForCausalLM" in r.stderr
    header = read_gguf_header(out)
    assert header.integer("general.file_type") == 2  # Q4_0
    assert header.metadata["general.name"] == "Tiny-Llama"  # not the snapshot folder's name
    _, m = Registry(models).resolve("tiny-llama-q4_0")
    assert (m.source.kind, m.source.repo, m.source.revision) == ("converted", "acme/Tiny-Llama",
                                                                 commit)
    assert len(generates(out)) == 4
    assert leftovers(models) == [] and sorted(p.name for p in out.parent.iterdir()) == [
        "tiny-llama-q4_0.gguf"]
    # config.json first (the listing's commit is the one it was downloaded at: the hub
    # library's cache records main's commit so), then the other small files and the weights
    # at that commit, each once.
    gets = [p for method, p in hub.requests if method == "GET" and "/resolve/" in p]
    assert gets[0] == "/acme/Tiny-Llama/resolve/main/config.json"
    assert all(f"/resolve/{commit}/" in p for p in gets[1:]) and len(set(gets)) == len(gets)
    assert gets[-1] == f"/acme/Tiny-Llama/resolve/{commit}/model.safetensors"
    assert hub.gets("/model.safetensors") == 1
    # `justllm rm` deletes the converted file and its commit folder.
    r = runner.invoke(app, ["rm", "tiny-llama-q4_0"])
    assert r.exit_code == 0, r.output
    assert not out.parent.exists()


def test_offline_a_repo_in_the_hub_cache_converts_without_the_hub(
        tiny: Path, models: Path, hub: FakeHub, monkeypatch: pytest.MonkeyPatch) -> None:
    """HF_HUB_OFFLINE: the listing is the cached snapshot of the revision (its commit recorded
    by the online listing), nothing is asked of the hub; what is not cached, or a pull, is one
    line naming the setting."""
    from huggingface_hub import constants

    from justllm.models import hub as hub_code

    commit = hub.push("acme/Tiny-Llama", model_files(tiny))
    hub.push("acme/Elsewhere", model_files(tiny))
    listing = hub_code.list_repo("acme/Tiny-Llama")  # what an online conversion leaves cached
    hub_code.download_files(listing, list(listing.files))
    asked = len(hub.requests)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    assert hub_code.list_repo("acme/Tiny-Llama") == listing
    r = runner.invoke(app, ["convert", "acme/Tiny-Llama", "--outtype", "q8_0"])
    assert r.exit_code == 0, r.output
    assert f"converting acme/Tiny-Llama @ {commit[:12]} (LlamaForCausalLM" in r.stderr
    out = models / "huggingface" / "acme" / "Tiny-Llama" / commit / "tiny-llama-q8_0.gguf"
    assert len(generates(out)) == 4
    line = error_line(runner.invoke(app, ["convert", "acme/Elsewhere"]))
    assert line.startswith("error: acme/Elsewhere at revision 'main' is not in the Hugging Face "
                           "cache (") and line.endswith("HF_HUB_OFFLINE is set: download it "
                                                        "once online")
    line = error_line(runner.invoke(app, ["pull", "acme/Tiny-Llama:tiny.gguf"]))
    assert line.startswith("error: HF_HUB_OFFLINE is set: pulling acme/Tiny-Llama:tiny.gguf "
                           "needs the hub")
    assert len(hub.requests) == asked


def test_an_unsupported_architecture_is_refused_before_the_weights_are_downloaded(
        tiny: Path, models: Path, hub: FakeHub) -> None:
    files = model_files(tiny)
    config = json.loads(files["config.json"]) | {"architectures": ["FrobnicatorForCausalLM"]}
    hub.push("acme/frob", files | {"config.json": json.dumps(config).encode()})
    line = error_line(runner.invoke(app, ["convert", "acme/frob"]))
    assert line.startswith("error: architecture FrobnicatorForCausalLM is not supported by "
                           "llama.cpp's converter (it converts ")
    assert "architectures; the nearest: " in line and len(line) < 400
    assert hub.gets("/config.json") == 1 and hub.gets("/model.safetensors") == 0
    assert not models.exists()


def test_a_model_without_tokenizer_is_one_line(tiny: Path, models: Path, tmp_path: Path) -> None:
    src = tmp_path / "no-tok"
    src.mkdir()
    for name in ("config.json", "model.safetensors"):
        (src / name).write_bytes((tiny / name).read_bytes())
    line = error_line(runner.invoke(app, ["convert", str(src)]))
    assert line.startswith(f"error: no tokenizer in {src}: llama.cpp's converter needs")
    line = error_line(runner.invoke(app, ["convert", str(tmp_path / "nowhere")]))
    assert "nowhere is not found: give a Hugging Face model directory" in line
    assert not models.exists()


def test_a_quantization_that_fails_names_the_conversion_not_its_hidden_file(
        tiny: Path, models: Path, tmp_path: Path) -> None:
    """Q1_0 has no fallback for the tiny model's small tensors: the error named the hidden
    file in between (.tiny-llama-q1_0.gguf.convert-PID), removed by then."""
    out = tmp_path / "out"
    r = runner.invoke(app, ["convert", str(tiny), "--quantize", "Q1_0", "-o", f"{out}/"])
    assert r.exit_code == 1 and "Traceback" not in r.output
    line = r.stderr.strip().splitlines()[-1]  # (after Q1_0's warning)
    assert line.startswith("error: llama.cpp could not quantize the converted f16 model: "), line
    assert ".convert-" not in line and not out.exists()


def test_weights_that_do_not_fit_the_config_are_refused_not_registered(
        tiny: Path, models: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        capfd: pytest.CaptureFixture[str]) -> None:
    """llama.cpp's converter writes the tensors beside the config's sizes without checking
    them; the result is loaded before it is registered, and llama.cpp's reason is the error
    (a model registered here would fail every later ``run`` and ``serve``). Then such a file
    registered anyway (the check switched off): loading it gives the same reason on one line
    instead of llama.cpp's log lines and a guess."""
    src = tmp_path / "misfit"
    src.mkdir()
    for p in tiny.iterdir():
        if p.is_file():
            (src / p.name).write_bytes(p.read_bytes())
    config = json.loads((src / "config.json").read_text())
    config["intermediate_size"] = 96  # the weights' is 128
    (src / "config.json").write_text(json.dumps(config))
    out = tmp_path / "out" / "misfit.gguf"
    out.parent.mkdir()
    args = ["convert", str(src), "--outtype", "f16", "-o", str(out), "--name", "misfit:1"]
    reason = ("check_tensor_dims: tensor 'blk.0.ffn_gate.weight' has wrong shape; expected "
              "64, 96, got 64, 128, 1, 1")
    r = runner.invoke(app, args)
    assert r.exit_code == 1, r.output
    *progress, line = r.stderr.strip().splitlines()  # its progress line, then the error
    assert progress[0].startswith(f"converting {src} ") and "error" not in "".join(progress)
    assert line == (f"error: the converted model does not load in llama.cpp: {reason} (does "
                    "config.json fit the weights?)")
    assert not out.exists() and leftovers(out.parent, models) == []
    assert Registry(models).find("misfit:1") is None
    monkeypatch.setattr("justllm.engine.backend.load_problem", lambda path: None)
    assert runner.invoke(app, args).exit_code == 0
    capfd.readouterr()
    line = error_line(runner.invoke(app, ["run", "misfit:1", "hello"]))
    assert line == f"error: llama.cpp could not load {out}: {reason}"
    assert "llama_model_load" not in capfd.readouterr().err  # llama.cpp's own lines kept back


def test_without_the_convert_extra_one_line_names_it(tiny: Path, tmp_path: Path) -> None:
    """The extra's absence simulated in a child process: ``sys.modules[name] = None`` makes an
    import of ``name`` fail, as when it is not installed."""
    code = ("import sys; sys.modules['torch'] = None; sys.modules['sentencepiece'] = None\n"
            "from justllm.cli import main; sys.argv = ['justllm', 'convert', sys.argv[1]]; main()")
    r = subprocess.run([sys.executable, "-c", code, str(tiny)], capture_output=True, text=True,
                       timeout=120, env={**__import__("os").environ,
                                         "JUSTLLM_MODELS_DIR": str(tmp_path / "models")})
    assert r.returncode == 1, r.stderr
    assert r.stderr.strip() == ("error: converting needs torch, sentencepiece (not installed): "
                                "pip install 'justllm[convert]' (pipx: pipx install --force "
                                "'justllm[convert]')")
    assert not (tmp_path / "models").exists()


def test_pull_convert_options_are_checked() -> None:
    assert "--convert takes REPO" in error_line(
        runner.invoke(app, ["pull", "acme/x:x.gguf", "--convert"]))
    assert "error: --quantize goes with --convert" in error_line(  # named what was given
        runner.invoke(app, ["pull", "acme/x", "--quantize", "Q4_0"]))
    assert "error: --outtype and --quantize go with --convert" in error_line(
        runner.invoke(app, ["pull", "acme/x", "--quantize", "Q4_0", "--outtype", "f16"]))


def generates_with(path: Path, lora: Path | None) -> list[int]:
    from justllm.config import LoraSpec

    llm = LLM(str(path), max_seqs=2, pool_blocks=16,
              lora=(LoraSpec("a", str(lora)),) if lora else ())
    try:
        (out,) = llm.generate("hello world", SamplingParams(
            max_tokens=6, ignore_eos=True, lora=(("a", 1.0),) if lora else ()))
        return out.token_ids
    finally:
        llm.close()


def test_a_peft_lora_adapter_becomes_an_adapter_gguf_that_changes_the_answer(
        tiny: Path, models: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Ollama takes a PEFT adapter's safetensors; the README sent users to llama.cpp's
    script by hand. The base model's folder is the adapter's base_model_name_or_path."""
    adapter = make_tiny_lora(tmp_path / "my-adapter", str(tiny))
    monkeypatch.chdir(tmp_path)
    r = runner.invoke(app, ["convert", str(adapter)])
    out = tmp_path / "my-adapter-lora-f16.gguf"
    assert r.exit_code == 0, r.output
    assert f"wrote {out} (F16, " in r.stdout and f"--lora NAME={out}" in r.stdout
    assert "converting the LoRA adapter" in r.stderr and "(rank 4, alpha 8)" in r.stderr
    header = read_gguf_header(out, adapter=True)
    assert header.metadata["general.type"] == "adapter"
    assert header.metadata["adapter.lora.alpha"] == 8.0
    assert not models.exists() or list(models.iterdir()) == []  # an adapter is not registered
    base = tmp_path / "base.gguf"
    assert runner.invoke(app, ["convert", str(tiny), "-o", str(base)]).exit_code == 0
    assert generates_with(base, out) != generates_with(base, None)
    assert leftovers(tmp_path) == []


def test_a_hub_adapter_and_its_base_come_from_the_hub_without_the_base_weights(
        tiny: Path, models: Path, hub: FakeHub, tmp_path: Path) -> None:
    hub.push("acme/Tiny-Llama", model_files(tiny))
    commit = hub.push("acme/tiny-lora",
                      model_files(make_tiny_lora(tmp_path / "a", "acme/Tiny-Llama")))
    r = runner.invoke(app, ["convert", "acme/tiny-lora", "--outtype", "q8_0", "-o",
                            str(tmp_path / "out") + "/"])
    assert r.exit_code == 0, r.output
    out = tmp_path / "out" / "tiny-lora-lora-q8_0.gguf"
    assert f"wrote {out} (Q8_0, " in r.stdout
    assert f"downloading the adapter acme/tiny-lora @ {commit[:12]}" in r.stderr
    assert hub.gets("/model.safetensors") == 0  # the base model's config and tokenizer only
    assert read_gguf_header(out, adapter=True).metadata["general.type"] == "adapter"
    # pull points to convert for an adapter, and does not suggest --convert where it would fail
    for args in (["acme/tiny-lora"], ["acme/tiny-lora", "--convert"]):
        assert "is a PEFT LoRA adapter" in error_line(runner.invoke(app, ["pull", *args]))
    hub.push("acme/no-config", {"model.safetensors": (tiny / "model.safetensors").read_bytes()})
    assert "come without a config.json" in error_line(runner.invoke(app, [
        "pull", "acme/no-config"]))


def test_adapter_options_and_a_missing_base_are_one_line(tiny: Path, tmp_path: Path) -> None:
    adapter = make_tiny_lora(tmp_path / "a", None)
    cases = [
        ([str(adapter)], "names no base model (base_model_name_or_path): give --base"),
        ([str(adapter), "--base", str(tmp_path / "nowhere")], "neither a folder here nor"),
        ([str(adapter), "--base", str(tiny), "-q", "Q4_0"], "--quantize is for models"),
        ([str(adapter), "--base", str(tiny), "--outtype", "q4"],
         "--outtype for a LoRA adapter must be one of f16, bf16, f32, q8_0"),
        ([str(tiny), "--base", str(tiny)], "--base is for a LoRA adapter"),
    ]
    for args, says in cases:
        assert says in error_line(runner.invoke(app, ["convert", *args]))
    (adapter / "adapter_config.json").write_text('{"peft_type": "IA3", "r": 4}')
    assert "is a PEFT IA3 adapter; llama.cpp takes LoRA adapters only" in error_line(
        runner.invoke(app, ["convert", str(adapter), "--base", str(tiny)]))
    # (a list was a TypeError traceback; a word, "could not convert string to float")
    for key, value in (("r", "[4]"), ("lora_alpha", "[8]"), ("lora_alpha", '"eight"')):
        (adapter / "adapter_config.json").write_text(
            f'{{"peft_type": "LORA", "r": 4, "lora_alpha": 8, "{key}": {value}}}')
        assert f"adapter_config.json: {key} must be a number" in error_line(
            runner.invoke(app, ["convert", str(adapter), "--base", str(tiny)]))


SLOW_FETCH = """
import subprocess, sys
from justllm.models import converter

def slow_pip(version, into):  # a download that takes long (pip's of the sdist)
    subprocess.run([sys.executable, "-c", "import time; time.sleep(120)"],
                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    raise SystemExit("the download was not stopped")

converter.pip_download = slow_pip
from justllm.cli import app
app(sys.argv[1:], prog_name="justllm")
"""


def _running(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[0]
    except OSError:
        return False
    return state != "Z"


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGHUP])
def test_sigterm_while_the_converter_is_fetched_stops_the_download(
        tiny: Path, tmp_path: Path, sig: int) -> None:
    """SIGTERM or SIGHUP while pip downloaded the converter's sdist (a first conversion)
    ended justllm alone: pip went on writing into a temporary folder of the converter cache
    that nothing removed."""
    env = {**os.environ, "JUSTLLM_CACHE_DIR": str(tmp_path / "cache"),
           "JUSTLLM_MODELS_DIR": str(tmp_path / "models"),
           "JUSTLLM_LOG_DIR": str(tmp_path / "logs")}
    proc = subprocess.Popen([sys.executable, "-c", SLOW_FETCH, "convert", str(tiny), "-o",
                             str(tmp_path / "out.gguf")], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    pids: list[int] = []
    try:
        deadline = time.monotonic() + 60
        while not (pids := children(proc.pid)):
            assert time.monotonic() < deadline and proc.poll() is None, proc.communicate()
            time.sleep(0.05)
        proc.send_signal(sig)
        _, err = proc.communicate(timeout=30)
        time.sleep(0.5)  # (the download's end, if it was told to end)
        left = [p for p in pids if _running(p)]
    finally:
        proc.kill()
        for p in pids:
            if _running(p):
                os.kill(p, signal.SIGKILL)
    assert proc.returncode == 128 + sig and "terminated: no output written" in err, err
    assert left == []
    assert [p.name for p in (tmp_path / "cache" / "converter").iterdir()] == [".lock"]
    assert not (tmp_path / "out.gguf").exists()


def test_a_type_for_models_trained_in_it_is_said_to_be(tmp_path: Path) -> None:
    """convert --quantize TQ2_0 (or pull --convert --quantize) said nothing, where quantize
    warns: any other model quantized to it answers gibberish."""
    r = runner.invoke(app, ["convert", str(tmp_path / "missing"), "--quantize", "tq2_0"])
    assert r.exit_code == 1
    assert ("warning: TQ2_0 is for models trained with ternary weights; "
            "any other model quantized to it answers gibberish") in " ".join(r.stderr.split())
    r = runner.invoke(app, ["convert", str(tmp_path / "missing"), "--quantize", "Q2_K"])
    assert r.exit_code == 1 and "warning" not in r.stderr


@pytest.mark.parametrize("command", [["convert", "acme/tiny-llama"],
                                     ["pull", "acme/tiny-llama", "--convert"]])
def test_an_unreachable_hub_names_the_repo_not_the_adapter_probe(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, command: list[str]) -> None:
    """Whether the repo is a PEFT adapter is asked first: with no hub, the one line said
    "cannot download acme/tiny-llama:adapter_config.json", a file the user never asked for."""
    from tests.models.fake_hub import isolate_hub_library

    isolate_hub_library(monkeypatch, tmp_path, "http://no-such-host.invalid")
    line = error_line(runner.invoke(app, command))
    assert line.startswith("error: cannot list acme/tiny-llama on http://no-such-host.invalid"), \
        line
