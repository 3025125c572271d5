"""The one check that a file is a GGUF before llama.cpp (or a download, or the registry) is
trusted with it.

``check_gguf_file`` looks at the magic and ``general.type`` (cheap, before every load).
``read_gguf_header``
reads the whole header without llama.cpp: the scalar metadata the registry records
(architecture, file type, context length) and where the last tensor's data ends, so a truncated
download or copy is refused with its size, not found later by llama.cpp. Array values are
skipped by their lengths, never decoded, but for the vocabulary's tokens (262k strings in
Gemma 3), which are read to refuse a token listed twice: llama.cpp asserts they are unique and
aborts the whole process otherwise. A header reads in about 0.1 s (0.02 s without that
check).

Both refuse a LoRA adapter (``general.type = adapter``) where a model is expected: llama.cpp
would fail on it with several lines about missing keys, after the registry had named it or the
quantizer had half-read it. ``read_gguf_header(path, adapter=True)`` is the adapter's own reader
(models/lora.py).
"""

from __future__ import annotations

import mmap
import struct
from dataclasses import dataclass, field
from pathlib import Path

from justllm.errors import ModelLoadError

GGUF_MAGIC = b"GGUF"
DEFAULT_ALIGNMENT = 32
MAX_DIMS = 8  # ggml has 4; anything past 8 is a corrupt header, not a bigger tensor

# GGUF value types (gguf.h: gguf_type) -> struct codes; STRING (8) and ARRAY (9) are read apart.
_SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q",
            12: "d"}
_STRING, _ARRAY = 8, 9
VOCAB_KEY = "tokenizer.ggml.tokens"
ADAPTER_TYPE = "adapter"  # general.type of a LoRA adapter (llama.cpp's convert_lora_to_gguf.py)
IMATRIX_TYPE = "imatrix"  # general.type of an importance matrix (llama-imatrix's GGUF output)


def gguf_magic(path: Path) -> bytes:
    """The first four bytes of ``path`` (a ModelLoadError when it cannot be read)."""
    try:
        with path.open("rb") as f:
            return f.read(4)
    except OSError as e:
        raise ModelLoadError(f"cannot read model file {path}: {e.strerror}") from e


def check_gguf_file(path: str | Path) -> None:
    """Fail with a clear message before llama.cpp sees a file that is not a GGUF model (not a
    GGUF, or a LoRA adapter)."""
    _check_magic(path)
    kind = _general_type(Path(path))
    if kind == ADAPTER_TYPE:
        raise adapter_error(path)
    if kind == IMATRIX_TYPE:
        raise imatrix_error(path)


def adapter_error(path: str | Path) -> ModelLoadError:
    """What a LoRA adapter given as a model is told: how it is used instead."""
    return ModelLoadError(f"{path} is a LoRA adapter, not a model: use --lora NAME={path}")


def imatrix_error(path: str | Path) -> ModelLoadError:
    """What an importance matrix given as a model is told (llama.cpp said "key not found in
    model: <arch>.context_length")."""
    return ModelLoadError(f"{path} is an importance matrix, not a model: use it with justllm "
                          f"quantize MODEL TYPE --imatrix {path}")


def _check_magic(path: str | Path) -> None:
    p = Path(path)
    if not p.is_file():
        raise ModelLoadError(f"model file not found: {path}")
    if gguf_magic(p) != GGUF_MAGIC:
        raise ModelLoadError(f"{path} is not a GGUF file (no GGUF magic at its start)")


def _general_type(p: Path) -> object | None:
    """``general.type`` (``model``, ``adapter``...), read key by key until it comes (writers
    put it second, so a model's vocabulary is not walked); None when there is none or the
    header cannot be read (``read_gguf_header`` and llama.cpp say why)."""
    try:
        with p.open("rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
            (little,) = struct.unpack_from("<I", buf, 4)
            r = _Reader(buf, "<" if little & 0xFFFF else ">")
            r.pos = 8
            _tensor_count, kv_count = r.scalar("Q"), r.scalar("Q")
            for _ in range(min(kv_count, len(buf))):
                key = r.string()
                value = r.value(r.scalar("I"))
                if key == b"general.type":
                    return value
    except (OSError, ValueError, struct.error, _Corrupt):
        return None
    return None


@dataclass(frozen=True)
class GGUFHeader:
    version: int
    metadata: dict[str, object]  # scalar keys only; strings decoded as UTF-8
    tensor_count: int
    data_end: int  # the size the file needs: where the data of its last tensor ends
    array_lengths: dict[str, int] = field(default_factory=dict)  # array keys: their lengths
    tensor_names: frozenset[str] = frozenset()

    @property
    def architecture(self) -> str:
        return str(self.metadata.get("general.architecture", "?"))

    def integer(self, key: str) -> int | None:
        value = self.metadata.get(key)
        return value if isinstance(value, int) and not isinstance(value, bool) else None


@dataclass(frozen=True)
class ModelShape:
    """What a model's memory depends on beyond its weights, from its GGUF header."""

    n_layer: int
    n_head_kv: int
    key_length: int
    value_length: int
    n_embd: int
    n_vocab: int
    n_ctx_train: int
    n_head: int = 1  # attention (query) heads

    @property
    def kv_bytes_per_token(self) -> int:
        """An F16 K and V cache entry in every layer (sliding-window layers counted as full:
        the engine keeps their whole window, llama.cpp's ``swa_full``)."""
        return self.n_layer * self.n_head_kv * (self.key_length + self.value_length) * 2

    @classmethod
    def of(cls, header: GGUFHeader) -> ModelShape:
        arch = header.architecture
        n_embd = header.integer(f"{arch}.embedding_length") or 0
        n_head = header.integer(f"{arch}.attention.head_count") or 1
        head_dim = n_embd // n_head
        return cls(n_layer=header.integer(f"{arch}.block_count") or 0,
                   n_head_kv=header.integer(f"{arch}.attention.head_count_kv") or n_head,
                   key_length=header.integer(f"{arch}.attention.key_length") or head_dim,
                   value_length=header.integer(f"{arch}.attention.value_length") or head_dim,
                   n_embd=n_embd,
                   n_vocab=header.array_lengths.get("tokenizer.ggml.tokens", 0),
                   n_ctx_train=header.integer(f"{arch}.context_length") or 0,
                   n_head=n_head)


class _Corrupt(Exception):
    pass


class _Reader:
    """A cursor over the mapped file; every read past its end is a truncated header."""

    def __init__(self, buf: mmap.mmap, order: str) -> None:
        self.buf, self.order, self.pos = buf, order, 0
        self.last_array_length = 0
        self._u64 = struct.Struct(order + "Q")

    def scalar(self, code: str):
        s = struct.Struct(self.order + code)
        (value,) = s.unpack_from(self.buf, self.pos)
        self.pos += s.size
        return value

    def string(self) -> bytes:
        n = self.scalar("Q")
        if self.pos + n > len(self.buf):
            raise _Corrupt(f"a string of {n} bytes runs past the end of the file")
        s = self.buf[self.pos:self.pos + n]
        self.pos += n
        return s

    def skip_strings(self, count: int) -> None:
        buf, pos, unpack, end = self.buf, self.pos, self._u64.unpack_from, len(self.buf)
        for _ in range(count):
            pos += 8 + unpack(buf, pos)[0]
            if pos > end:
                raise _Corrupt("an array of strings runs past the end of the file")
        self.pos = pos

    def check_unique_strings(self, count: int) -> None:
        """Read ``count`` strings, failing if one repeats an earlier one (naming the first
        that does). The strings are collected and counted as a set, and searched one by one
        only when the set is short: ~40% less time than a dict lookup per string, on a
        262k-token vocabulary read at every model load."""
        buf, pos, unpack, end = self.buf, self.pos, self._u64.unpack_from, len(self.buf)
        texts: list[bytes] = []
        add = texts.append
        for _ in range(count):
            start = pos + 8
            pos = start + unpack(buf, pos)[0]
            if pos > end:
                raise _Corrupt("an array of strings runs past the end of the file")
            add(buf[start:pos])
        if len(set(texts)) != count:
            seen: dict[bytes, int] = {}
            for i, text in enumerate(texts):
                first = seen.setdefault(text, i)
                if first != i:
                    raise _Corrupt(f"its vocabulary lists the token "
                                   f"{text.decode('utf-8', 'replace')!r} twice (ids {first} and "
                                   f"{i}), which llama.cpp aborts on")
        self.pos = pos

    def value(self, vtype: int, unique: bool = False) -> object | None:
        """A scalar or string value; arrays are skipped and give None (``last_array_length``
        says how long). ``unique``: an array of strings is read, each checked to be new."""
        if vtype in _SCALARS:
            return self.scalar(_SCALARS[vtype])
        if vtype == _STRING:
            return self.string().decode("utf-8", "replace")
        if vtype != _ARRAY:
            raise _Corrupt(f"unknown value type {vtype}")
        item, count = self.scalar("I"), self.scalar("Q")
        self.last_array_length = count
        if item == _STRING:
            (self.check_unique_strings if unique else self.skip_strings)(count)
        elif item in _SCALARS:
            self.pos += count * struct.calcsize(_SCALARS[item])
        else:
            for _ in range(count):
                self.value(item)
        if self.pos > len(self.buf):
            raise _Corrupt("an array runs past the end of the file")
        return None


def read_gguf_header(path: str | Path, *, adapter: bool = False,
                     vocabulary: bool = True) -> GGUFHeader:
    """The header of a GGUF (v2 or v3, either byte order), checked to the last byte its tensors
    need. Any problem is a ModelLoadError naming the file: not a GGUF, a header that makes no
    sense, a file shorter than its tensors (a truncated download or copy), or a LoRA adapter
    where a model is wanted (``adapter=True``: an adapter is what is wanted).
    ``vocabulary=False``: its tokens are skipped, not checked to be unique (two thirds of the
    time on a 262k-token vocabulary, ~70 ms): for a reader of the header's numbers, where the
    load itself checks the file again before llama.cpp reads it."""
    p = Path(path)
    _check_magic(path)
    try:
        with p.open("rb") as f:
            size = p.stat().st_size
            if size < 24:
                raise ModelLoadError(f"{path} is truncated: {size} bytes, shorter than a GGUF "
                                     "header")
            with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
                header = _parse(buf, vocabulary)
    except OSError as e:
        raise ModelLoadError(f"cannot read model file {path}: {e.strerror or e}") from None
    except _Corrupt as e:
        raise ModelLoadError(f"{path} is not a readable GGUF file ({e})") from None
    except struct.error:
        raise ModelLoadError(f"{path} is truncated: its header runs past the end of the "
                             f"file ({size} bytes)") from None
    if header.data_end > size:
        raise ModelLoadError(f"{path} is truncated: {size} bytes, but its tensors need "
                             f"{header.data_end}")
    if not adapter and header.metadata.get("general.type") == ADAPTER_TYPE:
        raise adapter_error(path)
    if not adapter and header.metadata.get("general.type") == IMATRIX_TYPE:
        raise imatrix_error(path)
    return header


def _parse(buf: mmap.mmap, vocabulary: bool = True) -> GGUFHeader:
    import gguf

    (little,) = struct.unpack_from("<I", buf, 4)
    order = "<" if little & 0xFFFF else ">"  # a big-endian file's version reads as 0x0N000000
    r = _Reader(buf, order)
    r.pos = 4
    version = r.scalar("I")
    if version not in (2, 3):
        raise _Corrupt(f"GGUF version {version}; justllm reads versions 2 and 3")
    tensor_count, kv_count = r.scalar("Q"), r.scalar("Q")
    if tensor_count > len(buf) or kv_count > len(buf):
        raise _Corrupt(f"the header claims {tensor_count} tensors and {kv_count} keys")
    metadata: dict[str, object] = {}
    arrays: dict[str, int] = {}
    for _ in range(kv_count):
        key = r.string().decode("utf-8", "replace")
        # (llama.cpp asserts that every token is unique: the whole process would abort)
        value = r.value(r.scalar("I"), unique=vocabulary and key == VOCAB_KEY)
        if value is not None:
            metadata[key] = value
        else:
            arrays[key] = r.last_array_length
    tensors = []
    for _ in range(tensor_count):
        name = r.string()
        n_dims = r.scalar("I")
        if n_dims > MAX_DIMS:
            raise _Corrupt(f"tensor {name.decode('utf-8', 'replace')} has {n_dims} dimensions")
        dims = [r.scalar("Q") for _ in range(n_dims)]
        tensors.append((name, dims, r.scalar("I"), r.scalar("Q")))
    alignment = metadata.get("general.alignment", DEFAULT_ALIGNMENT)
    if not isinstance(alignment, int) or alignment <= 0:
        raise _Corrupt(f"general.alignment is {alignment!r}")
    data_start = -(-r.pos // alignment) * alignment
    data_end = r.pos if not tensors else data_start
    for name, dims, ttype, offset in tensors:
        try:
            block, type_size = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType(ttype)]
        except (KeyError, ValueError):
            continue  # a type newer than the gguf package: llama.cpp will judge it
        elements = 1
        for d in dims[1:]:
            elements *= d
        if dims and dims[0] % block:
            raise _Corrupt(f"tensor {name.decode('utf-8', 'replace')} has {dims[0]} columns, "
                           f"not a multiple of its block size {block}")
        nbytes = (dims[0] // block * type_size if dims else type_size) * elements
        data_end = max(data_end, data_start + offset + nbytes)
    names = frozenset(name.decode("utf-8", "replace") for name, *_ in tensors)
    return GGUFHeader(version, metadata, tensor_count, data_end, arrays, names)
