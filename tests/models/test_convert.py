"""What ``justllm convert`` checks and fetches before llama.cpp's converter runs, and how it
cleans up. The converter itself comes from the llama-cpp-python sdist on PyPI the first time
(kept in the justllm cache after that); the end-to-end conversions are in
tests/cli/test_convert.py."""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
import tarfile
import threading
import time
from pathlib import Path

import pytest

from justllm.errors import ModelLoadError
from justllm.models import convert as conv
from justllm.models.converter import (
    CONVERTER_FILES,
    Converter,
    fetch_converter,
    supported_architectures,
)
from justllm.models.hf_model import HFModel, read_local, side_files
from justllm.models.quantize import quant_type
from tests.models.tiny_hf import make_tiny_llama

pytestmark = pytest.mark.convert


@pytest.fixture(scope="module")
def converter() -> Converter:
    from rich.console import Console

    return conv.get_converter(Console(stderr=True))


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


def _copy(src: Path, dst: Path, drop: tuple[str, ...] = (), config: dict | None = None) -> Path:
    dst.mkdir(parents=True)
    for p in src.iterdir():
        if p.name not in drop:
            (dst / p.name).write_bytes(p.read_bytes())
    if config is not None:
        cfg = json.loads((dst / "config.json").read_text())
        (dst / "config.json").write_text(json.dumps(cfg | config))
    return dst


# -- the converter: fetched from the sdist, its registry read without importing it ------------


def test_the_pinned_converter_supports_llama_and_qwen2(converter: Converter) -> None:
    archs = converter.architectures()
    assert {"LlamaForCausalLM", "Qwen2ForCausalLM", "Gemma3ForCausalLM"} <= set(archs)
    assert len(archs) > 100 and list(archs) == sorted(archs)
    assert converter.script.is_file() and (converter.root / "gguf-py" / "gguf").is_dir()
    assert not (converter.root / "ggml").exists()  # only the converter's files were extracted


def _sdist(path: Path, files: dict[str, bytes]) -> Path:
    with tarfile.open(path, "w:gz") as tar:
        for name, data in files.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return path


def test_fetch_extracts_only_the_converter_once(tmp_path: Path) -> None:
    top = "llama_cpp_python-9.9.9/vendor/llama.cpp/"
    registry = 'TEXT_MODEL_MAP: dict[str, str] = {"BLlama": "llama", "ALlama": "llama"}\n'
    files = {top + "convert_hf_to_gguf.py": b"print('hi')\n",
             top + "convert_lora_to_gguf.py": b"print('lora')\n",
             top + "conversion/__init__.py": registry.encode(),
             top + "conversion/__pycache__/x.pyc": b"junk",
             top + "gguf-py/gguf/__init__.py": b"",
             top + "gguf-py/tests/test_x.py": b"",
             top + "models/templates/a.jinja": b"{{ x }}",
             top + "models/ggml-vocab-x.gguf": b"big",
             top + "ggml/src/ggml.c": b"int x;",
             top + "../../escape.py": b"bad",
             "llama_cpp_python-9.9.9/llama_cpp/llama.py": b""}
    calls = []

    def download(version: str, into: Path) -> Path:
        calls.append(version)
        return _sdist(into / "s.tar.gz", files)

    root = tmp_path / "converter"
    c = fetch_converter(root, version="9.9.9", download=download)
    got = sorted(str(p.relative_to(c.root)) for p in c.root.rglob("*") if p.is_file())
    assert got == ["conversion/__init__.py", "convert_hf_to_gguf.py", "convert_lora_to_gguf.py",
                   "gguf-py/gguf/__init__.py", "models/templates/a.jinja"]
    assert c.architectures() == ("ALlama", "BLlama") and c.version == "9.9.9"
    assert fetch_converter(root, version="9.9.9", download=download).root == c.root
    assert calls == ["9.9.9"]  # the second call found it
    assert sorted(p.name for p in root.iterdir()) == [".lock", "llama-cpp-python-9.9.9"]
    assert not (tmp_path / "escape.py").exists() and "LICENSE" in CONVERTER_FILES
    # A tree an older justllm extracted, without the LoRA converter, is fetched again.
    (c.root / "convert_lora_to_gguf.py").unlink()
    assert fetch_converter(root, version="9.9.9", download=download).lora_script.is_file()
    assert calls == ["9.9.9", "9.9.9"]


def test_a_failed_fetch_leaves_nothing(tmp_path: Path) -> None:
    def download(version: str, into: Path) -> Path:
        return _sdist(into / "s.tar.gz", {"x/vendor/llama.cpp/README.md": b""})

    with pytest.raises(ModelLoadError, match="holds no vendor/llama.cpp/convert_hf_to_gguf.py"):
        fetch_converter(tmp_path, version="1.0", download=download)
    assert sorted(p.name for p in tmp_path.iterdir()) == [".lock"]


def test_older_converters_register_with_decorators(tmp_path: Path) -> None:
    (tmp_path / "convert_hf_to_gguf.py").write_text(
        '@ModelBase.register("LlamaForCausalLM", "MistralForCausalLM")\nclass A: pass\n'
        '@ModelBase.register("Qwen2ForCausalLM")\nclass B(A): pass\n')
    assert supported_architectures(tmp_path) == ("LlamaForCausalLM", "MistralForCausalLM",
                                                 "Qwen2ForCausalLM")


# -- checks before converting ------------------------------------------------------------------


def test_a_model_directory_is_read_and_checked(tiny: Path, converter: Converter) -> None:
    m = read_local(tiny)
    assert m.weights == ["model.safetensors"] and m.has_tokenizer
    assert m.candidate_architectures() == ["LlamaForCausalLM"] and m.source_dtype == "float32"
    from safetensors.numpy import load_file

    # counted from the header (it was the file's size over 4: its header's bytes too)
    assert m.parameters == sum(a.size for a in load_file(tiny / "model.safetensors").values())
    m.check(converter.architectures())
    assert side_files(["config.json", "model.safetensors", "tokenizer.json", "tokenizer.model",
                       "original/params.json", "chat_template.jinja", "README.md", "x.bin"]) == [
        "README.md", "chat_template.jinja", "config.json", "tokenizer.json", "tokenizer.model"]


@pytest.mark.parametrize("drop, config, says", [
    ((), {"architectures": ["LlamaForCausalLMX"]},
     "architecture LlamaForCausalLMX is not supported by llama.cpp's converter (it converts "),
    (("tokenizer.json",), None, "no tokenizer in "),
    (("model.safetensors",), None, "no *.safetensors weights in "),
    (("config.json",), None, "is not a Hugging Face model: it has no config.json"),
    ((), {"architectures": []}, "config.json names no 'architectures'"),
])
def test_what_the_converter_would_fail_on_is_refused_first(
        tiny: Path, tmp_path: Path, models: Path, converter: Converter,
        drop: tuple[str, ...], config: dict | None, says: str) -> None:
    src = _copy(tiny, tmp_path / "m", drop, config)
    with pytest.raises(ModelLoadError) as e:
        conv.prepare(str(src))
    assert says in str(e.value) and "\n" not in str(e.value)
    if "LlamaForCausalLMX" in says:  # the nearest names, not all ~270 (a 10,000-character line)
        assert "; the nearest: LlamaForCausalLM" in str(e.value) and len(str(e.value)) < 400
    assert not models.exists()


@pytest.mark.parametrize("drop, config", [
    (("model.safetensors",), None), (("tokenizer.json",), None), ((), {"architectures": []}),
    ((), None)])  # the last: an output that exists
def test_the_cheap_checks_come_before_the_converter_is_fetched(
        tiny: Path, tmp_path: Path, models: Path, monkeypatch: pytest.MonkeyPatch,
        drop: tuple[str, ...], config: dict | None) -> None:
    """It fetched the converter (77 MB, 12 s online; an error offline) before looking at the
    directory or the output."""
    monkeypatch.setattr(conv, "get_converter",
                        lambda console: pytest.fail("the converter was fetched"))
    src = _copy(tiny, tmp_path / "m", drop, config)
    if not drop and config is None:
        models.mkdir()
        (models / "m-f16.gguf").write_bytes(b"x")
    with pytest.raises((ModelLoadError, ValueError)):
        conv.prepare(str(src), outtype="f16")


def test_a_hugging_face_cache_snapshot_is_named_after_its_repo(tiny: Path, tmp_path: Path,
                                                                 models: Path) -> None:
    """``convert ~/.cache/huggingface/hub/models--acme--Tiny/snapshots/<commit>`` (where
    ``huggingface-cli download`` leaves a model) wrote ``<commit>-f16.gguf``, and the
    converter named the model after the commit too."""
    snapshot = _copy(tiny, tmp_path / "hub" / "models--acme--Tiny-Llama" / "snapshots" /
                     ("0123abcd" * 5))
    job = conv.prepare(str(snapshot), outtype="f16")
    assert job.dst == models / "tiny-llama-f16.gguf" and job.label == "tiny-llama-f16:latest"
    args = job._script_args(tmp_path / "out.gguf")
    assert args[args.index("--model-name") + 1] == "Tiny-Llama"
    assert "--model-name" not in conv.prepare(str(tiny), outtype="f16")._script_args(
        tmp_path / "out.gguf")  # (a folder of its own name: the converter's own reading)


def test_prepare_plans_the_output_and_refuses_an_existing_one(tiny: Path, models: Path) -> None:
    job = conv.prepare(str(tiny), outtype="auto")
    assert (job.dst, job.outtype, job.quant, job.label) == (
        models / "tiny-llama-f16.gguf", "f16", None, "tiny-llama-f16:latest")
    job = conv.prepare(str(tiny), quantize="q4_k_m", name="Tiny:Q4")
    assert (job.dst.name, job.outtype, job.output_type, job.label) == (
        "tiny-llama-q4_k_m.gguf", "f16", "Q4_K_M", "tiny:q4")
    models.mkdir()
    (models / "tiny-llama-q8_0.gguf").write_bytes(b"x")
    with pytest.raises(ValueError, match=r"tiny-llama-q8_0.gguf already exists \(--force "):
        conv.prepare(str(tiny), outtype="q8_0")
    # -o '' meant no -o (the models directory), as --name '' is refused
    with pytest.raises(ValueError, match="--output is empty"):
        conv.prepare(str(tiny), output=" ")
    assert conv.prepare(str(tiny), outtype="q8_0", force=True).dst.name == "tiny-llama-q8_0.gguf"
    with pytest.raises(ValueError, match="--quantize starts from a 16-bit conversion"):
        conv.prepare(str(tiny), outtype="q8_0", quantize="Q4_0")
    with pytest.raises(ValueError, match="--outtype must be one of auto, f16, bf16, q8_0, f32"):
        conv.prepare(str(tiny), outtype="q4")
    with pytest.raises(ValueError, match="unknown quantization type 'Q9'"):
        conv.prepare(str(tiny), quantize="Q9")


def test_what_would_fail_later_is_refused_before_any_work(tiny: Path, models: Path,
                                                          tmp_path: Path) -> None:
    """An importance-matrix type failed after the whole conversion; a --revision of a local
    folder was ignored; '-o DIR/' wrote a file called DIR; a read-only folder failed only once
    the converter wrote."""
    with pytest.raises(ValueError, match="IQ2_XS needs an importance matrix, which convert "
                                         "does not take: .* --imatrix FILE"):
        conv.prepare(str(tiny), quantize="IQ2_XS")
    with pytest.raises(ValueError, match="--revision is a Hugging Face repo's"):
        conv.prepare(str(tiny), revision="v2")
    job = conv.prepare(str(tiny), output=str(tmp_path / "new" / "dir") + "/")
    assert job.dst == tmp_path / "new" / "dir" / "tiny-llama-f16.gguf"
    # made when the job runs, and gone again when it fails (prepare made it: a refused or
    # failed conversion left an empty folder behind)
    assert not (tmp_path / "new").exists()

    def fails(out: Path, report) -> None:
        assert out.parent.is_dir()
        raise ModelLoadError("llama.cpp's converter failed: exit code 1")

    job._convert = fails  # type: ignore[method-assign]
    with pytest.raises(ModelLoadError):
        job.run()
    assert not (tmp_path / "new").exists()
    (tmp_path / "file").write_text("x")
    with pytest.raises(ValueError, match="cannot make the output's directory .*: .* is a file"):
        conv.prepare(str(tiny), output=str(tmp_path / "file" / "sub") + "/")
    with pytest.raises(ValueError, match="the output's directory .*nowhere does not exist"):
        conv.prepare(str(tiny), output=str(tmp_path / "nowhere" / "x.gguf"))
    assert conv.prepare(str(tiny), output=str(tmp_path)).dst == tmp_path / "tiny-llama-f16.gguf"
    # /proc takes no files, even from root (whom a read-only mode does not stop)
    with pytest.raises(ValueError, match="cannot write to /proc: "):
        conv.prepare(str(tiny), output="/proc/x.gguf")
    # (-o MODEL/model.safetensors --force replaced the weights with the GGUF)
    with pytest.raises(ValueError, match="would overwrite model.safetensors, a file of the "
                                         "model being converted"):
        conv.prepare(str(tiny), output=str(tiny / "model.safetensors"), force=True)
    assert conv.prepare(str(tiny), output=str(tiny / "new.gguf")).dst == tiny / "new.gguf"


def test_a_string_for_architectures_is_read_as_one(tmp_path: Path) -> None:
    """("architecture L is not supported": the string was sliced as a list)"""
    assert HFModel("m", {"architectures": "LlamaForCausalLM"}, {}).candidate_architectures() \
        == ["LlamaForCausalLM"]
    assert HFModel("m", {"architectures": 5}, {}).candidate_architectures() == []


def test_a_killed_conversions_leftovers_are_swept(tiny: Path, models: Path) -> None:
    job = conv.prepare(str(tiny))
    models.mkdir()
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    stale = models / f".{job.dst.name}.convert-{dead.pid}"
    live = models / f".{job.dst.name}.convert-{os.getppid()}"  # a process that runs
    stale.write_bytes(b"x")
    live.write_bytes(b"x")
    job.sweep()
    assert not stale.exists() and live.exists()


def test_not_enough_disk_is_refused_with_the_estimate(tiny: Path, models: Path) -> None:
    with pytest.raises(ModelLoadError, match=r"not enough disk space in .*: the GGUF needs about "
                                             r"17 MB, 1 MB free"):
        conv.prepare(str(tiny), free_bytes=lambda _p: 1_000_000)


def test_needs_on_one_filesystem_add_up(tmp_path: Path) -> None:
    needs = [(tmp_path / "models" / "x", 1_000_000_000, "the GGUF"),
             (tmp_path / "hf-cache", 2_000_000_000, "the download")]
    with pytest.raises(ModelLoadError, match=r"the GGUF and the download need about 3.0 GB, "
                                             r"2.5 GB free"):
        conv.check_space(needs, lambda _p: 2_500_000_000)
    conv.check_space(needs, lambda _p: 3_000_000_000)


def test_estimates_follow_bytes_per_weight() -> None:
    model = HFModel("m", {"torch_dtype": "bfloat16"}, {"model.safetensors": 2_000_000_000})
    assert model.parameters == 1_000_000_000
    assert conv.resolve_outtype("auto", model) == "bf16"
    assert conv.resolve_outtype("auto", HFModel("m", {"dtype": "float32"}, {})) == "f16"
    gb = 1e9 * 1.02
    assert conv.estimate_bytes(model, "bf16", None) == int(2 * gb) + conv._SLACK
    assert conv.estimate_bytes(model, "q8_0", None) == int(34 / 32 * gb) + conv._SLACK
    # The quantized copy is bounded by Q8_0's width while the 16-bit file is still there.
    assert conv.estimate_bytes(model, "f16", quant_type("Q4_K_M")) == int(
        (2 + 34 / 32) * gb) + conv._SLACK


def test_converter_errors_become_one_line() -> None:
    lines = ["INFO:hf-to-gguf:Loading model: x", "Traceback (most recent call last):",
             'File "x.py", line 3, in <module>',
             "NotImplementedError: BPE pre-tokenizer was not recognized - update it"]
    assert conv._failure(lines, 1) == "NotImplementedError: BPE pre-tokenizer was not " \
                                      "recognized - update it"
    assert conv._failure(["ERROR:hf-to-gguf:Model Foo is not supported"], 1) == \
        "Model Foo is not supported"
    assert conv._failure(["INFO:x"], -9) == "killed by signal 9 (out of memory?)"
    assert conv._failure([], 3) == "exit code 3"
    # (an exception's message over several lines was cut to its first: the reason went)
    many = ["Traceback (most recent call last):", "ValueError: Couldn't instantiate the "
            "backend tokenizer from one of:", "(1) a `tokenizers` library serialization file,",
            "(2) a slow tokenizer instance to convert or", ""]
    assert conv._failure(many, 1) == (
        "ValueError: Couldn't instantiate the backend tokenizer from one of: (1) a "
        "`tokenizers` library serialization file, (2) a slow tokenizer instance to convert or")


def test_an_abandoned_conversion_stops_the_converter_and_leaves_nothing(
        tiny: Path, models: Path) -> None:
    """What Ctrl-C does (cli/convert.py calls ``abandon`` from the main thread)."""
    job = conv.prepare(str(tiny))
    errors: list[BaseException] = []

    def work() -> None:
        try:
            job.run()
        except BaseException as e:
            errors.append(e)

    worker = threading.Thread(target=work)
    worker.start()
    deadline = time.monotonic() + 60
    while job._proc is None and worker.is_alive() and time.monotonic() < deadline:
        time.sleep(0.01)
    proc = job._proc
    assert proc is not None
    job.abandon()
    worker.join(30)
    assert not worker.is_alive() and proc.poll() is not None
    assert errors and "llama.cpp's converter failed" in str(errors[0])
    assert not models.exists() or [p.name for p in models.iterdir()] == []


def test_an_output_another_conversion_wrote_meanwhile_is_not_replaced(
        tiny: Path, models: Path, tmp_path: Path) -> None:
    """Two conversions to one output, both checked before either wrote (two fine-tunes in
    folders of the same name, converted at once): the later rename replaced the earlier's
    file without --force, and both said they wrote it."""
    for quantize in (None, "Q8_0"):
        out = tmp_path / f"out-{quantize}.gguf"
        job = conv.prepare(str(tiny), quantize=quantize, output=str(out))
        out.write_bytes(b"the other run's model")
        with pytest.raises(ValueError, match=r"already exists \(--force overwrites it\)"):
            job.run()
        assert out.read_bytes() == b"the other run's model"
    assert sorted(p.name for p in tmp_path.iterdir() if p.is_file()) == [
        "out-None.gguf", "out-Q8_0.gguf"]
    forced = conv.prepare(str(tiny), output=str(tmp_path / "out-None.gguf"), force=True)
    assert forced.run().read_bytes()[:4] == b"GGUF"


def _restored(src: Path, dst: Path, dtype: str, config: dict) -> Path:
    """A copy of ``src`` with its weights stored as ``dtype`` (torch's name) and ``config``
    merged into its config.json."""
    import torch
    from safetensors.torch import load_file, save_file

    _copy(src, dst, drop=("model.safetensors",), config=config)
    weights = load_file(str(src / "model.safetensors"))
    save_file({k: v.to(getattr(torch, dtype)) for k, v in weights.items()},
              str(dst / "model.safetensors"), metadata={"format": "pt"})
    return dst


def test_auto_follows_the_dtype_the_weights_are_stored_in(tiny: Path, models: Path,
                                                          tmp_path: Path) -> None:
    """auto read config.json's dtype alone: bfloat16 weights under a config that names no
    dtype (or another) became F16, which overflows past 65504, and float32 weights under a
    config saying bfloat16 became BF16. llama.cpp's converter decides its auto from the
    tensors, "because some finetunes lie"."""
    no_dtype = {"torch_dtype": None}
    bf16 = _restored(tiny, tmp_path / "bf16-weights", "bfloat16", no_dtype)
    job = conv.prepare(str(bf16))
    assert (job.outtype, job.dst.name) == ("bf16", "bf16-weights-bf16.gguf")
    assert job.model.parameters == read_local(tiny).parameters
    f32 = _copy(tiny, tmp_path / "f32-weights", config={"torch_dtype": "bfloat16"})
    assert conv.prepare(str(f32)).outtype == "f16"
    f16 = _restored(tiny, tmp_path / "f16-weights", "float16", {"torch_dtype": "bfloat16"})
    assert conv.prepare(str(f16)).outtype == "f16"
    # the conversion is what its name says
    from justllm.models.gguf import read_gguf_header

    assert read_gguf_header(job.run()).integer("general.file_type") == 32  # MOSTLY_BF16
    # weights whose header cannot be read: config.json's dtype, and the converter says why
    broken = _copy(tiny, tmp_path / "broken", drop=("model.safetensors",),
                   config={"torch_dtype": "bfloat16"})
    (broken / "model.safetensors").write_bytes(b"\xff" * 64)
    assert conv.prepare(str(broken)).outtype == "bf16"


def test_a_float_type_to_quantize_to_is_what_the_converter_writes(tiny: Path,
                                                                  models: Path) -> None:
    """--quantize F32 went through the f16 file in between: an F32 GGUF whose weights had
    lost their last bits (BF16 of a float32 model: through f16's range)."""
    import gguf
    import numpy as np
    from safetensors.numpy import load_file

    for quantize, outtype in (("F32", "f32"), ("bf16", "bf16"), ("F16", "f16")):
        job = conv.prepare(str(tiny), quantize=quantize)
        assert (job.outtype, job.quant, job.output_type) == (outtype, None, outtype.upper())
        assert job.dst.name == f"tiny-llama-{outtype}.gguf"
    # an --outtype given is kept: the user chose the file in between
    assert conv.prepare(str(tiny), quantize="F32", outtype="f16").quant == quant_type("F32")
    job = conv.prepare(str(tiny), quantize="F32")
    tensors = {t.name: t for t in gguf.GGUFReader(str(job.run())).tensors}
    want = load_file(tiny / "model.safetensors")["model.layers.0.mlp.down_proj.weight"]
    got = np.asarray(tensors["blk.0.ffn_down.weight"].data).reshape(want.shape)
    assert np.array_equal(got, want)
