"""``justllm quantize``: a GGUF re-quantized by llama.cpp's own ``llama_model_quantize``.

Everything that can be refused is refused before a byte is written: an unknown type, an output
that exists, a model that is quantized already (unless ``allow_requantize``), a type that needs
an importance matrix for this model, and too little disk space. The last two come from a dry
run of llama.cpp's quantizer (well under a second): it computes every tensor's new type and size
without quantizing, so the estimate is llama.cpp's, not a guess. The output is written to a
hidden temporary name in its own directory and renamed at the end, so a run that fails or is
interrupted leaves no partial GGUF (and nothing the models directory would adopt).
"""

from __future__ import annotations

import contextlib
import glob
import os
import re
import shutil
import struct
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from justllm.config import MAX_THREADS
from justllm.errors import ModelLoadError
from justllm.models.gguf import IMATRIX_TYPE, imatrix_error, read_gguf_header
from justllm.models.lease import publish, sweep_dead


@dataclass(frozen=True)
class QuantType:
    name: str
    ftype: int  # llama.cpp's llama_ftype
    description: str  # llama.cpp's own (tools/quantize/quantize.cpp)
    needs_imatrix: bool = False  # on typical models: llama.cpp's dry run decides per model
    # Formats for models trained in them (llama.cpp quantizes any model to them, saying
    # nothing, and the answers of one that was not are gibberish): what to say.
    trained_for: str | None = None


# llama.cpp 0.3.36's tools/quantize/quantize.cpp QUANT_OPTIONS, in its order, without COPY
# (a plain copy) and MXFP4_MOE (mixture-of-experts models only). Whether a type needs an
# importance matrix: its default tensor type is one of those llama.cpp refuses without one
# (llama-quant.cpp: tensor_requires_imatrix), checked with a dry run on the demo model.
QUANT_TYPES: tuple[QuantType, ...] = (
    QuantType("Q1_0", 40, "1.125 bpw quantization", trained_for="1-bit"),
    QuantType("Q2_0", 41, "2.25 bpw quantization (group 64)", trained_for="2-bit"),
    QuantType("Q4_0", 2, "4.34G, +0.4685 ppl @ Llama-3-8B"),
    QuantType("Q4_1", 3, "4.78G, +0.4511 ppl @ Llama-3-8B"),
    QuantType("Q5_0", 8, "5.21G, +0.1316 ppl @ Llama-3-8B"),
    QuantType("Q5_1", 9, "5.65G, +0.1062 ppl @ Llama-3-8B"),
    QuantType("IQ2_XXS", 19, "2.06 bpw quantization", True),
    QuantType("IQ2_XS", 20, "2.31 bpw quantization", True),
    QuantType("IQ2_S", 28, "2.5  bpw quantization", True),
    QuantType("IQ2_M", 29, "2.7  bpw quantization", True),
    QuantType("IQ1_S", 24, "1.56 bpw quantization", True),
    QuantType("IQ1_M", 31, "1.75 bpw quantization", True),
    QuantType("TQ1_0", 36, "1.69 bpw ternarization", trained_for="ternary"),
    QuantType("TQ2_0", 37, "2.06 bpw ternarization", trained_for="ternary"),
    QuantType("Q2_K", 10, "2.96G, +3.5199 ppl @ Llama-3-8B"),
    QuantType("Q2_K_S", 21, "2.96G, +3.1836 ppl @ Llama-3-8B", True),
    QuantType("IQ3_XXS", 23, "3.06 bpw quantization"),
    QuantType("IQ3_S", 26, "3.44 bpw quantization"),
    QuantType("IQ3_M", 27, "3.66 bpw quantization mix"),
    QuantType("Q3_K", 12, "alias for Q3_K_M"),
    QuantType("IQ3_XS", 22, "3.3 bpw quantization"),
    QuantType("Q3_K_S", 11, "3.41G, +1.6321 ppl @ Llama-3-8B"),
    QuantType("Q3_K_M", 12, "3.74G, +0.6569 ppl @ Llama-3-8B"),
    QuantType("Q3_K_L", 13, "4.03G, +0.5562 ppl @ Llama-3-8B"),
    QuantType("IQ4_NL", 25, "4.50 bpw non-linear quantization"),
    QuantType("IQ4_XS", 30, "4.25 bpw non-linear quantization"),
    QuantType("Q4_K", 15, "alias for Q4_K_M"),
    QuantType("Q4_K_S", 14, "4.37G, +0.2689 ppl @ Llama-3-8B"),
    QuantType("Q4_K_M", 15, "4.58G, +0.1754 ppl @ Llama-3-8B"),
    QuantType("Q5_K", 17, "alias for Q5_K_M"),
    QuantType("Q5_K_S", 16, "5.21G, +0.1049 ppl @ Llama-3-8B"),
    QuantType("Q5_K_M", 17, "5.33G, +0.0569 ppl @ Llama-3-8B"),
    QuantType("Q6_K", 18, "6.14G, +0.0217 ppl @ Llama-3-8B"),
    QuantType("Q8_0", 7, "7.96G, +0.0026 ppl @ Llama-3-8B"),
    QuantType("F16", 1, "14.00G, +0.0020 ppl @ Mistral-7B"),
    QuantType("BF16", 32, "14.00G, -0.0050 ppl @ Mistral-7B"),
    QuantType("F32", 0, "26.00G              @ 7B"),
)
# general.file_type values whose tensors are not quantized (quantizing them is no requantize).
_FLOAT_FILE_TYPES = (0, 1, 32)
# Room kept free beyond the estimate (file system blocks, the registry's small files).
_DISK_SLACK = 16 * 1024 * 1024


def quant_type(name: str) -> QuantType:
    """The type called ``name`` (any case; an alias such as Q4_K gives its target's name)."""
    wanted = name.strip().upper()
    for t in QUANT_TYPES:
        if t.name == wanted:
            if t.description.startswith("alias for "):
                return quant_type(t.description.removeprefix("alias for "))
            return t
    raise ValueError(f"unknown quantization type '{name}' (justllm quantize --list shows "
                     "them)")


def default_output(src: Path, qtype: QuantType, directory: Path) -> Path:
    """``<stem>-<type>.gguf`` in ``directory``, the source's own type suffix replaced:
    gemma-3-270m-q4_k_m.gguf to Q8_0 is gemma-3-270m-q8_0.gguf."""
    stem = src.stem
    names = sorted((t.name for t in QUANT_TYPES), key=len, reverse=True)
    m = re.search(r"[-_.](" + "|".join(names) + r")$", stem, flags=re.IGNORECASE)
    if m:
        stem = stem[:m.start()]
    return directory / f"{stem}-{qtype.name.lower()}.gguf"


@dataclass(frozen=True)
class Imatrix:
    """An importance matrix (llama.cpp's llama-imatrix output, GGUF or the legacy .dat):
    tensor name -> mean squared activation per input column."""

    path: Path
    values: dict[str, np.ndarray]
    chunks: int
    dataset: str | None


def load_imatrix(path: str | Path) -> Imatrix:
    """Read an importance matrix the way llama.cpp's quantize tool does (common/
    imatrix-loader.cpp): GGUF ``<tensor>.in_sum2`` divided by ``<tensor>.counts``, or the
    legacy format's sums divided by their call count."""
    p = Path(path).expanduser()
    if p.is_dir():
        raise ModelLoadError(f"--imatrix {p} is a directory; pass the importance matrix file "
                             "(llama-imatrix's .gguf or .dat)")
    if not p.is_file():
        raise ModelLoadError(f"imatrix file not found: {p}")
    try:
        with p.open("rb") as f:
            magic = f.read(4)
        matrix = _imatrix_gguf(p) if magic == b"GGUF" else _imatrix_legacy(p)
    except (OSError, ValueError, struct.error, KeyError, IndexError) as e:
        raise ModelLoadError(f"{p} is not a readable importance matrix ({e})") from None
    for name, v in matrix.values.items():
        # Mean squared activations: never negative. llama.cpp takes a negative one and its
        # IQ quantizers fail an assert (on several threads at once ggml's backtrace deadlocked
        # the process, leaving its partial output).
        if not np.isfinite(v).all() or (v < 0).any():
            raise ModelLoadError(f"{p}: the importance of {name} has negative or non-finite "
                                 "values (an importance matrix holds mean squared "
                                 "activations, never below 0)")
    return matrix


def _imatrix_gguf(p: Path) -> Imatrix:
    import gguf

    reader = gguf.GGUFReader(str(p))
    sums: dict[str, np.ndarray] = {}
    counts: dict[str, np.ndarray] = {}
    for t in reader.tensors:
        for suffix, into in ((".in_sum2", sums), (".counts", counts)):
            if t.name.endswith(suffix):
                into[t.name[:-len(suffix)]] = np.asarray(t.data, dtype=np.float32).reshape(-1)
    if not sums or sums.keys() != counts.keys():
        raise ValueError("it needs matching <tensor>.in_sum2 and <tensor>.counts tensors")
    values = {}
    for name, s in sums.items():
        c = np.rint(counts[name]).astype(np.float32)
        rows = s.reshape(c.size, -1)
        safe = np.where(c > 0, c, 1.0)[:, None]
        values[name] = np.where(c[:, None] > 0, rows / safe, 1.0).reshape(-1)
    field = reader.get_field("imatrix.chunk_count")
    chunks = int(field.parts[field.data[0]][0]) if field is not None else 0
    field = reader.get_field("imatrix.datasets")
    dataset = bytes(field.parts[field.data[0]]).decode() if field is not None and field.data \
        else None
    return Imatrix(p, values, chunks, dataset)


def _imatrix_legacy(p: Path) -> Imatrix:
    data = p.read_bytes()
    pos = 0

    def need(size: int) -> None:  # a length read from a file that is not one: a clear error
        if size < 0:
            raise ValueError(f"not GGUF, and as a legacy .dat it has a negative length at "
                             f"byte {pos - 4}")
        if pos + size > len(data):
            raise ValueError(f"not GGUF, and as a legacy .dat it ends early: {pos + size} "
                             f"bytes needed, the file has {len(data)}")

    def take(fmt: str) -> tuple:
        nonlocal pos
        need(struct.calcsize(fmt))
        out = struct.unpack_from(fmt, data, pos)
        pos += struct.calcsize(fmt)
        return out

    (n_entries,) = take("<i")
    if n_entries < 1:
        raise ValueError("not GGUF, and as a legacy .dat it has no entries")
    values = {}
    for _ in range(n_entries):
        (n,) = take("<i")
        need(n)
        name = data[pos:pos + n].decode("utf-8", "replace")
        pos += n
        ncall, nval = take("<ii")
        if nval < 1:
            raise ValueError(f"entry {name} has no values")
        need(4 * nval)
        sums = np.frombuffer(data, dtype="<f4", count=nval, offset=pos).astype(np.float32)
        pos += 4 * nval
        values[name] = sums / ncall if ncall > 0 else sums
    chunks, dataset = 0, None
    if pos + 4 <= len(data):
        (chunks,) = take("<i")
        if pos + 4 <= len(data):
            (n,) = take("<i")
            dataset = data[pos:pos + n].decode("utf-8", "replace") if n > 0 else None
    return Imatrix(p, values, chunks, dataset)


@dataclass
class QuantizeJob:
    """A checked quantization, ready to run: ``run()`` writes the temporary file and renames
    it into place; ``abandon()`` removes the temporary file (an interrupted run)."""

    src: Path
    dst: Path
    qtype: QuantType
    threads: int
    allow_requantize: bool
    imatrix: Imatrix | None
    estimate_bytes: int
    make_dir: bool = False  # the output's directory is made by run() (and removed on failure)
    force: bool = False  # an output that appears while it runs is replaced (else refused)
    _made: MadeFolders | None = field(default=None, init=False, repr=False)

    @property
    def partial(self) -> Path:
        return self.dst.with_name(f".{self.dst.name}.partial-{os.getpid()}")

    def sweep(self) -> None:
        """Remove what earlier runs writing this output left when they were killed (SIGKILL,
        a crash): temporary files of processes that are gone."""
        sweep_dead(self.dst.parent, f".{glob.escape(self.dst.name)}.partial-*")

    def run(self, progress: Callable[[int, int, str], None] | None = None) -> Path:
        from justllm.engine.backend import quantize_model

        tmp = self.partial
        with made_folder(self.dst.parent) if self.make_dir else contextlib.nullcontext() as made:
            self._made = made
            self.sweep()
            try:
                quantize_model(str(self.src), str(tmp), self.qtype.ftype,
                               threads=self.threads, allow_requantize=self.allow_requantize,
                               imatrix=self.imatrix.values if self.imatrix else None,
                               metadata=_imatrix_metadata(self.imatrix), progress=progress)
                publish(tmp, self.dst, force=self.force)
            except BaseException:
                self.abandon()
                raise
        return self.dst

    def abandon(self) -> None:
        self.partial.unlink(missing_ok=True)
        if self._made is not None:  # (interrupted: the folders -o new/dir/ made, too)
            self._made.remove()


def _imatrix_metadata(imatrix: Imatrix | None) -> dict[str, str | int] | None:
    """The keys llama.cpp's quantize tool records about the importance matrix it used."""
    if imatrix is None:
        return None
    out: dict[str, str | int] = {"quantize.imatrix.file": str(imatrix.path),
                                 "quantize.imatrix.entries_count": len(imatrix.values),
                                 "quantize.imatrix.chunks_count": imatrix.chunks}
    if imatrix.dataset:
        out["quantize.imatrix.dataset"] = imatrix.dataset
    return out


def prepare(src: Path, qtype: QuantType, dst: Path, *, force: bool = False,
            allow_requantize: bool = False, imatrix: str | None = None, threads: int = 0,
            free_bytes: Callable[[Path], int] | None = None,
            make_dir: bool = False) -> QuantizeJob:
    """Check everything a quantization of ``src`` into ``dst`` needs; raises ValueError or
    ModelLoadError (one line each) for anything that would make it fail. ``make_dir``: the
    output's directory may be missing (``-o newdir/``); the job makes it when it runs."""
    from justllm.engine.backend import quantize_model
    from justllm.models.store import quantization_name

    src, dst = Path(src), Path(dst).expanduser()
    if not 0 <= threads <= MAX_THREADS:
        raise ValueError(f"--threads must be in [0, {MAX_THREADS}] (ggml's most)")
    if imatrix is not None and not imatrix.strip():  # (it meant "none", and quantized anyway)
        raise ValueError("--imatrix is empty: give the importance matrix file (llama-imatrix's "
                         ".gguf or .dat), or leave --imatrix out")
    header = read_gguf_header(src, adapter=True)  # a missing, foreign or truncated file
    if header.metadata.get("general.type") == "adapter":
        raise ValueError(f"{src} is a LoRA adapter: quantize takes models (an adapter is "
                         "small; 'justllm convert ADAPTER_DIR --outtype q8_0' writes a Q8_0 one)")
    if header.metadata.get("general.type") == IMATRIX_TYPE:
        raise imatrix_error(src)
    if dst.exists() and dst.resolve() == src.resolve():
        raise ValueError(f"the output would overwrite the model itself ({src}); pick another "
                         "--output")
    check_replaceable(dst)
    if dst.exists() and not force:
        raise ValueError(f"{dst} already exists (--force overwrites it)")
    if dst.exists():
        from justllm.models.registry import Registry

        Registry().check_overwritable(dst)
    if not make_dir and not dst.parent.is_dir():
        raise ValueError(f"the output's directory {dst.parent} does not exist")
    # (the folder to make: where it would go, or the disk space check blamed /proc's 0 MB)
    check_writable(nearest_dir(dst.parent))
    file_type = header.integer("general.file_type")
    if file_type is not None and file_type not in _FLOAT_FILE_TYPES and not allow_requantize:
        raise ValueError(f"{src.name} is quantized already ({quantization_name(file_type)}); "
                         "quantizing it again loses more quality than quantizing the F16/BF16 "
                         "original. --allow-requantize does it anyway")
    matrix = load_imatrix(imatrix) if imatrix else None
    if matrix is not None and not matrix.values.keys() & header.tensor_names:
        # (llama.cpp would only log "did not find weights" for each tensor, and go on without)
        raise ValueError(f"the importance matrix {matrix.path.name} has none of {src.name}'s "
                         f"tensors (its {len(matrix.values)} entries name e.g. "
                         f"{next(iter(matrix.values))}): it was made for another model")
    dry = quantize_model(str(src), str(dst), qtype.ftype, threads=threads,
                         allow_requantize=True, dry_run=True,
                         imatrix=matrix.values if matrix else None)
    if dry.needs_imatrix and matrix is None:
        raise ValueError(f"{qtype.name} needs an importance matrix for this model (--imatrix "
                         "FILE, made by llama.cpp's llama-imatrix); without one its very "
                         "low-bit tensors come out as garbage")
    # The tensors' new size, plus what the source has besides its tensors (metadata, vocab).
    estimate = dry.quant_bytes + max(0, src.stat().st_size - dry.model_bytes)
    free = (free_bytes or disk_free)(dst.parent)
    if free < estimate + _DISK_SLACK:
        raise ValueError(f"not enough disk space in {dst.parent}: the output needs about "
                         f"{_mb(estimate + _DISK_SLACK)} ({_mb(estimate)} estimated plus "
                         f"{_mb(_DISK_SLACK)} kept free), {_mb(free)} free")
    return QuantizeJob(src, dst, qtype, threads, allow_requantize, matrix, estimate, make_dir,
                       force)


def check_output_option(output: str | None) -> None:
    """ValueError for an empty ``--output`` (``-o ''``): it meant "the default path", so
    quantize wrote into the models directory as if -o were not there (--tag '' and --imatrix
    '' are refused the same way)."""
    if output is not None and not output.strip():
        raise ValueError("--output is empty: give a file or folder path, or leave --output out")


def check_replaceable(dst: Path) -> None:
    """ValueError for an output path that is there and is not a regular file (a FIFO, a
    socket, a device such as /dev/null): the output is written beside it and moved over it,
    which would put a file where the special one was (as root, /dev/null too)."""
    if os.path.lexists(dst) and not dst.is_file():
        kind = "a directory" if dst.is_dir() else "not a regular file"
        raise ValueError(f"--output {dst} is {kind}; give the path of a file")


def check_writable(directory: Path) -> None:
    """ValueError unless a file can be made in ``directory``, before any work: a read-only
    folder failed only once the converter (or llama.cpp, with its iostream error) wrote."""
    probe = directory / f".justllm-write-check-{os.getpid()}"
    try:
        probe.touch()
    except OSError as e:
        raise ValueError(f"cannot write to {directory}: {e.strerror or e}") from None
    probe.unlink(missing_ok=True)


def nearest_dir(directory: Path) -> Path:
    """``directory``, or the nearest of its parents that exists (where it would be made)."""
    return next((d for d in (directory, *directory.parents) if d.is_dir()), Path.cwd())


class MadeFolders:
    """``directory`` made, with any missing parents, for an output to be written into;
    ``remove()`` takes away again those of them left empty (``-o new/dir/`` leaves nothing
    behind). Called from an interrupted run's ``abandon`` too, which ends the process without
    unwinding (llama.cpp's C call cannot be stopped)."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self.made = next((d for d in reversed((directory, *directory.parents))
                          if not d.exists()), None)
        try:
            directory.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise ModelLoadError(f"cannot make the output's directory {directory}: "
                                 f"{e.strerror or e}") from None

    def remove(self) -> None:
        for d in (self.directory, *self.directory.parents) if self.made is not None else ():
            try:
                d.rmdir()
            except OSError:
                break
            if d == self.made:
                break


@contextlib.contextmanager
def made_folder(directory: Path) -> Iterator[MadeFolders]:
    """:class:`MadeFolders` for the body; when it fails or is interrupted, removed again."""
    folders = MadeFolders(directory)
    try:
        yield folders
    except BaseException:
        folders.remove()
        raise


def disk_free(directory: Path) -> int:
    """Free space where ``directory`` is, or would be (its nearest existing folder)."""
    return shutil.disk_usage(nearest_dir(directory)).free


def _mb(n: int) -> str:
    return f"{n / 1e6:.0f} MB"
