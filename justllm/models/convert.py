"""``justllm convert``: a Hugging Face safetensors model to a GGUF in the models directory, by
llama.cpp's own converter (``models/converter.py``), optionally quantized by llama.cpp's
quantizer (``models/quantize.py``), then registered.

``prepare`` refuses, before anything big is downloaded or written, what would fail: the
converter's dependencies missing (the ``convert`` extra), no config, an architecture the
converter does not know, no tokenizer, no safetensors weights, an output that exists, too
little disk. For a hub repo it lists the commit, downloads the small files first, checks, and
only then downloads the weights (into the hub library's cache, so converting the same commit
again downloads nothing).

``ConvertJob.run`` starts the converter as a child process (a crash there is a one-line error
here) writing to a hidden temporary name beside the output; the output appears only by a
rename at the end. With a quantization the converter's 16-bit file is that temporary and is
removed after quantizing. ``abandon`` (Ctrl-C) stops the child and removes every temporary.
"""

from __future__ import annotations

import glob
import os
import re
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from rich.console import Console

from justllm.errors import ModelLoadError
from justllm.models.converter import Converter, check_extra, converter_dir, fetch_converter
from justllm.models.hf_model import HFModel, read_config, read_local, side_files
from justllm.models.lease import publish, sweep_dead
from justllm.models.manifest import Manifest, Source
from justllm.models.quantize import (
    MadeFolders,
    QuantizeJob,
    QuantType,
    check_output_option,
    check_replaceable,
    check_writable,
    disk_free,
    made_folder,
    nearest_dir,
    quant_type,
)

OUTTYPES = ("auto", "f16", "bf16", "q8_0", "f32")
_OUT_BYTES = {"f32": 4.0, "f16": 2.0, "bf16": 2.0, "q8_0": 34 / 32}  # per weight
_FLOAT_QUANTS = {"F32": 4.0, "F16": 2.0, "BF16": 2.0}
_Q8_BYTES = 34 / 32  # no other quantization type is wider: the bound for an estimate
_SLACK = 16 * 1024 * 1024

class AlreadyConverted(ValueError):
    """The output is there already, and it is the registered result of this very conversion
    (the same repo, commit and type): ``pull --convert`` again has nothing to do, as a plain
    ``pull`` of a file that is here has nothing to download."""

    def __init__(self, dst: Path, manifest: Manifest, label: str) -> None:
        super().__init__(f"{dst} already exists (--force overwrites it): it is "
                         f"{manifest.source}, as {manifest.quantization} (sha256:"
                         f"{manifest.short})")
        self.dst, self.manifest, self.label = dst, manifest, label


# progress(stage, done, total): "tensors" as the converter plans each one (total unknown),
# "writing" in percent, "quantizing" per tensor.
Progress = Callable[[str, int, "int | None"], None]

_TENSOR_LINE = re.compile(r"^INFO:hf-to-gguf:[^,\s]+,\s+torch\.\w+ --> \w+, shape")
_WRITING = re.compile(r"^Writing:\s+(\d+)%")
_ERROR_LINE = re.compile(r"^(?:ERROR:[\w.-]+:\s*(?P<log>.+)|(?P<exc>[\w.]*(?:Error|Exception|"
                         r"Interrupt)(?::\s*.+)?))$")


@dataclass
class ConvertJob:
    """A checked conversion, ready to run (``prepare`` makes it)."""

    converter: Converter
    model: HFModel
    source_dir: Path  # the model's files on this machine (a hub commit's snapshot folder)
    repo: str | None
    commit: str | None
    outtype: str  # what the converter writes: f16, bf16, q8_0 or f32 (auto resolved)
    quant: QuantType | None
    dst: Path
    label: str  # the NAME:TAG the result is registered as
    estimate_bytes: int
    log_path: Path
    force: bool = False  # an output that appears while it runs is replaced (else refused)
    _proc: subprocess.Popen | None = field(default=None, repr=False)
    _quantize: QuantizeJob | None = field(default=None, repr=False)
    _made: MadeFolders | None = field(default=None, repr=False)

    @property
    def output_type(self) -> str:
        return self.quant.name if self.quant else self.outtype.upper()

    @property
    def intermediate(self) -> Path:
        """The converter's output: hidden, not ``*.gguf``, so the registry never adopts it."""
        return self.dst.with_name(f".{self.dst.name}.convert-{os.getpid()}")

    def sweep(self) -> None:
        """Remove what earlier conversions to this output left when they were killed
        (SIGKILL, a crash): intermediates of processes that are gone."""
        sweep_dead(self.dst.parent, f".{glob.escape(self.dst.name)}.convert-*")

    def run(self, progress: Progress | None = None) -> Path:
        report = progress or (lambda _stage, _done, _total: None)
        with made_folder(self.dst.parent) as made:  # (failed or interrupted: nothing left)
            self._made = made
            try:
                self.sweep()
                self._convert(self.intermediate, report)
                if self.quant is None:
                    publish(self.intermediate, self.dst, force=self.force)
                else:
                    self._quantize_to_dst(report)
            finally:
                self.abandon()
        return self.dst

    def _script_args(self, out: Path) -> list[str]:
        """The converter script and its arguments, writing to ``out``."""
        args = [str(self.converter.script), str(self.source_dir), "--outfile", str(out),
                "--outtype", self.outtype]
        # (else general.name would be the snapshot folder: a commit)
        name = (self.repo.rpartition("/")[2] if self.repo is not None
                else snapshot_model_name(self.source_dir))
        if name:
            args += ["--model-name", name]
        return args

    def _convert(self, out: Path, report: Progress) -> None:
        from justllm.engine.backend import load_problem
        from justllm.models.gguf import read_gguf_header

        cmd = [sys.executable, "-m", "justllm.models.converter_process", str(os.getpid()),
               str(out), *self._script_args(out)]
        env = {k: v for k, v in os.environ.items() if k != "NO_LOCAL_GGUF"}
        env.update(PYTHONUNBUFFERED="1", PYTHONIOENCODING="utf-8", HF_HUB_OFFLINE="1",
                   TOKENIZERS_PARALLELISM="false")
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with self.log_path.open("wb") as log:
            log.write(f"$ {' '.join(cmd)}\n".encode())
            log.flush()
            proc = self._proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL,
                                                 stdout=subprocess.PIPE,
                                                 stderr=subprocess.STDOUT, env=env)
            lines = _follow(proc, log, report)
            code = proc.wait()
        self._proc = None
        if code != 0:
            raise ModelLoadError(f"llama.cpp's converter failed: {_failure(lines, code)} "
                                 f"(its log: {self.log_path})")
        if not out.is_file():
            raise ModelLoadError(f"llama.cpp's converter wrote no {out.name} (its log: "
                                 f"{self.log_path})")
        read_gguf_header(out, adapter=self.makes_adapter)
        if not self.makes_adapter:
            # The converter writes the tensors it finds beside the config's sizes without
            # checking that they fit: a model llama.cpp refuses must not be registered.
            problem = load_problem(str(out))
            if problem is not None:
                raise ModelLoadError(f"the converted model does not load in llama.cpp: "
                                     f"{problem} (does config.json fit the weights?)")

    makes_adapter = False  # the output is a LoRA adapter (convert_lora.LoraConvertJob)

    def _quantize_to_dst(self, report: Progress) -> None:
        from justllm.models.quantize import prepare as prepare_quantize

        assert self.quant is not None
        try:
            self._quantize = prepare_quantize(self.intermediate, self.quant, self.dst,
                                              force=self.force)
            self._quantize.run(lambda i, n, _name: report("quantizing", i - 1, n))
        except ModelLoadError as e:  # (it named the hidden file in between, removed by now)
            raise ModelLoadError(str(e).replace(
                str(self.intermediate), f"the converted {self.outtype} model")) from None

    def abandon(self) -> None:
        """Stop the converter if it runs and remove every temporary file (the output, once
        renamed into place, stays)."""
        proc = self._proc
        if proc is not None and proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(5)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        self._proc = None
        if self._quantize is not None:
            self._quantize.abandon()
        self.intermediate.unlink(missing_ok=True)
        if self._made is not None:  # (interrupted: the folders made for it, left empty;
            self._made.remove()     # after a success the output keeps its own)


def snapshot_model_name(folder: Path) -> str | None:
    """NAME for a Hugging Face cache's snapshot folder (``models--ORG--NAME/snapshots/COMMIT``,
    what ``huggingface-cli download`` leaves), whose own name is a commit: a conversion of it
    was named ``<commit>-f16.gguf``. None for any other folder."""
    repo = folder.parent.parent.name
    if folder.parent.name == "snapshots" and repo.startswith("models--") and "--" in repo[8:]:
        return repo.rpartition("--")[2] or None
    return None


def check_not_a_source_file(dst: Path, source_dir: Path) -> None:
    """ValueError for an output that is one of the files the conversion reads (``-o
    MODEL/model.safetensors --force`` replaced the weights with the GGUF, and the folder
    could not be converted again); a new file in the model's folder is fine."""
    if dst.exists() and dst.resolve().parent == Path(source_dir).resolve():
        raise ValueError(f"the output would overwrite {dst.name}, a file of the model being "
                         "converted; pick another --output")


def _follow(proc: subprocess.Popen, log, report: Progress) -> list[str]:
    """Copy the converter's output to ``log`` as it comes, turning its per-tensor lines and
    its writer's progress bar (tqdm, redrawn with ``\\r``) into ``report`` calls; returns the
    last lines, for the error message."""
    assert proc.stdout is not None
    tail: list[str] = []
    tensors = 0
    pending = b""
    fd = proc.stdout.fileno()
    while True:
        chunk = os.read(fd, 65536)
        if not chunk:
            break
        log.write(chunk)
        pending += chunk
        *parts, pending = re.split(rb"[\r\n]", pending)
        for raw in parts:
            line = raw.decode("utf-8", "replace").strip()
            if not line:
                continue
            if _TENSOR_LINE.match(line):
                tensors += 1
                report("tensors", tensors, None)
            elif m := _WRITING.match(line):
                report("writing", int(m.group(1)), 100)
            else:
                tail = [*tail[-40:], line]
    log.flush()
    proc.stdout.close()
    return tail


def _failure(lines: list[str], code: int) -> str:
    """The converter's own reason, one line: its last error log line or exception."""
    for i in range(len(lines) - 1, -1, -1):
        m = _ERROR_LINE.match(lines[i])
        if m and m.group("log"):
            return m.group("log")
        if m:  # an exception's message may go on over the lines after it (it is the last)
            rest = " ".join(line.strip() for line in lines[i + 1:] if line.strip())
            return f"{m.group('exc')} {rest}".strip()[:600]
    if code < 0:
        return f"killed by signal {-code}" + (" (out of memory?)" if code == -9 else "")
    return lines[-1] if lines else f"exit code {code}"


# -- preparing -------------------------------------------------------------------------------


def converter_root() -> Path:
    from justllm.models.source import cache_dir

    return cache_dir() / "converter"


def get_converter(console: Console) -> Converter:
    """The converter matching the installed llama.cpp, fetched with a spinner the first time."""
    from justllm.models.converter import is_complete, llama_cpp_version

    root, version = converter_root(), llama_cpp_version()
    if is_complete(converter_dir(root, version)):
        return fetch_converter(root, version=version)
    console.print(f"fetching llama.cpp's converter from the llama-cpp-python {version} sdist "
                  f"(once: it is kept in {root})", highlight=False, soft_wrap=True)
    with console.status("pip download llama-cpp-python (about 80 MB)"):
        return fetch_converter(root, version=version)


def resolve_outtype(outtype: str, model: HFModel) -> str:
    """``auto``: bf16 for a model stored in bfloat16 (f16 could overflow it), else f16; the
    converter is then told the type, so the file's name and content agree."""
    wanted = outtype.strip().lower()
    if wanted not in OUTTYPES:
        raise ValueError(f"--outtype must be one of {', '.join(OUTTYPES)}, not '{outtype}'")
    if wanted != "auto":
        return wanted
    return "bf16" if model.source_dtype == "bfloat16" else "f16"


def estimate_bytes(model: HFModel, outtype: str, quant: QuantType | None) -> int:
    """The converter's output (parameters x bytes per weight), plus the quantized copy that
    sits beside it until the end; a little slack for metadata and vocabulary."""
    params = model.parameters
    total = params * _OUT_BYTES[outtype]
    if quant is not None:
        total += params * _FLOAT_QUANTS.get(quant.name, _Q8_BYTES)
    return int(total * 1.02) + _SLACK


def _device(path: Path) -> int:
    return nearest_dir(path).stat().st_dev


def _gb(n: float) -> str:
    if n < 1e6:  # a small adapter or test model: not "0 MB"
        return f"{max(n / 1e3, 1):.0f} KB"
    return f"{n / 1e9:.1f} GB" if n >= 1e8 else f"{n / 1e6:.0f} MB"


def check_space(needs: list[tuple[Path, int, str]],
                free_bytes: Callable[[Path], int] = disk_free) -> None:
    """``needs``: (folder, bytes, what for); needs on one filesystem add up."""
    by_device: dict[int, tuple[Path, int, list[str]]] = {}
    for folder, n, what in needs:
        dev = _device(folder)
        where, total, whats = by_device.get(dev, (folder, 0, []))
        by_device[dev] = (where, total + n, [*whats, what])
    for where, total, whats in by_device.values():
        free = free_bytes(where)
        if free < total:
            verb = "needs" if len(whats) == 1 else "need"
            raise ModelLoadError(f"not enough disk space in {where}: {' and '.join(whats)} "
                                 f"{verb} about {_gb(total)}, {_gb(free)} free")


def default_output(model_name: str, type_name: str, repo: str | None,
                   commit: str | None) -> Path:
    """``NAME-TYPE.gguf`` in the models directory; from a hub repo, in that commit's folder
    (where ``justllm pull`` puts files), so converting a newer revision keeps the older."""
    from justllm.models.hub import revision_dir
    from justllm.models.refs import name_for_file
    from justllm.models.store import models_dir

    file = f"{name_for_file(model_name)}-{type_name.lower()}.gguf"
    if repo is not None and commit is not None:
        return revision_dir(models_dir(), repo, commit) / file
    return models_dir() / file


def prepare(source: str, *, outtype: str = "auto", quantize: str | None = None,
            output: str | None = None, name: str | None = None, revision: str = "main",
            force: bool = False, console: Console | None = None,
            free_bytes: Callable[[Path], int] = disk_free) -> ConvertJob:
    """Check everything and fetch what a conversion of ``source`` (a local model directory or
    a hub repo id) needs; raises ValueError, ModelLoadError or MissingExtraError, one line
    each. A hub repo's weights are downloaded here, last."""
    from justllm.models import hub
    from justllm.models.refs import DEFAULT_TAG, label, name_for_file, new_ref

    console = console or Console(stderr=True, emoji=False)
    check_output_option(output)
    wanted_label = label(*new_ref(name)) if name is not None else None  # ('' is refused)
    quant = quant_type(quantize) if quantize else None
    if outtype.strip().lower() not in OUTTYPES:
        raise ValueError(f"--outtype must be one of {', '.join(OUTTYPES)}, not '{outtype}'")
    if quant is not None and outtype.strip().lower() == "q8_0":
        raise ValueError("--quantize starts from a 16-bit conversion: leave --outtype out "
                         "(or give f16, bf16 or f32) with --quantize")
    check_extra()

    if quant is not None and quant.needs_imatrix:  # found out only after the conversion
        raise ValueError(f"{quant.name} needs an importance matrix, which convert does not "
                         f"take: convert to 16 bits first, then 'justllm quantize MODEL "
                         f"{quant.name} --imatrix FILE'")
    local = Path(source).expanduser()
    listing: hub.RepoListing | None = None
    if local.exists() or not hub.looks_like_repo(source) or ":" in source:
        if revision != "main":
            raise ValueError(f"--revision is a Hugging Face repo's: {source} is a local "
                             "directory")
        model = read_local(local)
        source_dir = local.resolve()
        model_name = snapshot_model_name(source_dir) or source_dir.name
    else:
        listing = hub.list_repo(source, revision)
        where = f"{source} @ {listing.commit[:12]}"
        if "config.json" not in listing.files:
            raise ModelLoadError(f"{where} is not a Hugging Face model: it has no config.json")
        small = side_files(list(listing.files))
        source_dir = hub.download_files(listing, small)
        model = HFModel(where, read_config(source_dir / "config.json", where), listing.files)
        model_name = source.rpartition("/")[2]

    model.check_files()  # the cheap checks before the converter is fetched (it is 77 MB)
    resolved = resolve_outtype(outtype, model)
    if quant is not None and quant.name in _FLOAT_QUANTS and outtype.strip().lower() == "auto":
        # The converter writes that type itself. Through the 16-bit file in between, F32
        # lost the float32 weights' last bits (and BF16 of a float32 model, f16's range).
        resolved, quant = quant.name.lower(), None
    type_name = quant.name if quant else resolved
    repo, commit = (listing.repo, listing.commit) if listing else (None, None)
    dst = default_output(model_name, type_name, repo, commit)
    if output:
        dst = output_path(output, dst.name)
    check_not_a_source_file(dst, source_dir)
    check_replaceable(dst)
    job_label = wanted_label or label(name_for_file(dst.stem), DEFAULT_TAG)
    if dst.exists() and not force:
        done = converted_here(dst, repo, commit, type_name)
        if done is not None:
            raise AlreadyConverted(dst, done, job_label)
        raise ValueError(f"{dst} already exists (--force overwrites it)")
    if dst.exists():
        from justllm.models.registry import Registry

        Registry().check_overwritable(dst)
    check_writable(nearest_dir(dst.parent))
    estimate = estimate_bytes(model, resolved, quant)
    needs = [(dst.parent, estimate, "the GGUF")]
    if listing is not None:
        download = model.weights_bytes - hub.cached_bytes(listing, model.weights)
        needs.append((hub.hub_cache_dir(), download, "the download"))
    check_space(needs, free_bytes)
    converter = get_converter(console)
    model.check_architecture(converter.architectures())
    if listing is not None:
        console.print(f"downloading {source} @ {listing.commit[:12]}: {len(model.weights)} "
                      f"safetensors file(s), {_gb(model.weights_bytes)}", highlight=False,
                      soft_wrap=True)
        source_dir = hub.download_files(listing, model.weights)
    return ConvertJob(converter, model, source_dir, repo, commit, resolved, quant, dst,
                      job_label, estimate, convert_log(dst), force)


def convert_log(dst: Path) -> Path:
    """Where a conversion to ``dst`` writes the converter's output: one log per output, so
    two conversions running at once (to different files) do not write into each other's.
    The output's folder is in the name, as a short hash: two outputs of one file name (``-o
    runA/`` and ``-o runB/``, two repos of one name) shared a log, the later truncating the
    earlier's, whose error message then named the other's log."""
    import hashlib

    from justllm.models.source import log_dir

    folder = hashlib.sha256(str(dst.parent.expanduser().absolute()).encode()).hexdigest()[:8]
    # (a folder of their own: `justllm logs` lists the runners' logs, and read these as models)
    return log_dir() / "convert" / f"convert-{dst.name}-{folder}.log"


def output_path(output: str, file: str) -> Path:
    """Where ``--output`` writes: the path given (in a folder that exists), or ``file`` in it
    when it is a folder (one that exists, or a path ending in /, which the job makes when it
    runs and removes again if the conversion fails: it was made here, before the checks, and
    a refused or failed conversion left it behind)."""
    path = Path(output).expanduser()
    if not (output.endswith(("/", os.sep)) or path.is_dir()):
        if not path.parent.is_dir():
            raise ValueError(f"the output's directory {path.parent} does not exist")
        return path
    there = next(d for d in (path, *path.parents) if d.exists() or d == d.parent)
    if not there.is_dir():
        raise ValueError(f"cannot make the output's directory {path}: {there} is a file")
    return path / file


def converted_here(dst: Path, repo: str | None, commit: str | None,
                   type_name: str) -> Manifest | None:
    """The registered version at ``dst`` when it is the conversion of ``repo`` at ``commit``
    to ``type_name`` and the file still holds its bytes; None otherwise (a local folder's
    files can change under the same name, so only a hub commit counts)."""
    from justllm.models.registry import Registry

    if repo is None or commit is None:
        return None
    registry = Registry()
    m = registry.manifest_for_path(dst)
    if m is None or (m.source.kind, m.source.repo, m.source.revision, m.quantization) != (
            "converted", repo, commit, type_name.upper()):
        return None
    return m if registry.digests.digest(dst) == m.hex else None


def register(job: ConvertJob) -> tuple[str, Manifest, Manifest | None]:
    """Record the output in the registry (a file outside the models directory is registered
    where it is), with where it came from, and point the job's NAME:TAG at it. Returns the
    tag, the version and the version the tag pointed to before, if another."""
    from justllm.models.registry import Registry

    registry = Registry()
    source = Source("converted", repo=job.repo,
                    file=None if job.repo else str(job.source_dir), revision=job.commit)
    rewritten = registry.rewritten(job.dst, source)  # --force over a registered file
    m = rewritten.manifest if rewritten is not None else registry.register(job.dst, source)
    return registry.tag(m.digest, job.label)
