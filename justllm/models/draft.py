"""A draft model built from the target itself: the first ``N`` transformer blocks of a GGUF.

Speculative decoding needs a small model that shares the target's vocabulary exactly. Not every
model ships one, and the tests need one too, so ``make_draft`` writes a layer-truncated copy:
the same metadata (tokenizer arrays included), the same embedding, output norm and head, and
blocks ``0..N-1`` with their quantization and bytes untouched. Such a draft is weak (it skips
the later blocks without any retraining) but it is free, its tokens are always in the target's
vocabulary, and on repetitive text it agrees with the target often enough to measure with.

Reading and writing go through the ``gguf`` package (llama.cpp's own Python reader/writer), the
way its ``gguf_new_metadata.py`` script copies a file; nothing here touches llama.cpp. Its reader
and writer take each item of an array on its own, ~1M items for a 262k-token vocabulary, so
``_read`` and ``copying_writer`` take arrays whole (the same fields and bytes): a 6-layer draft
of the demo model takes 2.3 s, where it took 10.6.
"""

from __future__ import annotations

import glob
import os
import re
import struct
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from justllm.errors import JustLLMError, ModelLoadError
from justllm.models.gguf import read_gguf_header
from justllm.models.lease import publish, sweep_dead
from justllm.models.quantize import check_replaceable

_BLOCK_TENSOR = re.compile(r"blk\.(\d+)\.")


@dataclass(frozen=True)
class DraftInfo:
    path: Path
    layers: int
    source_layers: int
    size_bytes: int


def default_draft_path(src: Path, layers: int, directory: Path | None = None) -> Path:
    """``<stem>-draft-L<N>.gguf`` in ``directory``; by default next to the source, or in the
    models directory when the source's directory is not writable (a read-only download cache,
    a system path)."""
    name = f"{src.stem}-draft-L{layers}.gguf"
    if directory is not None:
        return directory / name
    if os.access(src.parent, os.W_OK):
        return src.parent / name
    from justllm.models.store import models_dir

    return models_dir() / name


def make_draft(src: Path, dst: Path, layers: int, *, force: bool = False) -> DraftInfo:
    """Write the first ``layers`` blocks of ``src`` to ``dst`` as a complete GGUF.

    ``{arch}.block_count`` becomes ``layers`` and per-layer metadata arrays (length
    ``block_count``, e.g. per-layer head counts) are cut to ``layers`` entries; every other key
    and every tensor outside ``blk.{i}.*`` for ``i >= layers`` is copied as is. The file is
    written beside ``dst`` and renamed into place, so a failed run leaves no half-written GGUF.
    """
    import gguf

    src, dst = Path(src), Path(dst)
    if layers < 1:
        raise ValueError(f"layers must be at least 1 (got {layers})")
    # missing, not a GGUF or truncated: one clear error, not numpy's; and the layer count is
    # checked before the whole parse
    header = read_gguf_header(src)  # (and a token listed twice, which llama.cpp aborts on)
    arch = header.metadata.get(gguf.Keys.General.ARCHITECTURE)
    if not isinstance(arch, str):
        raise ModelLoadError(f"{src} has no general.architecture key")
    count_key = f"{arch}.block_count"
    source_layers = header.integer(count_key)
    if source_layers is None:
        raise ModelLoadError(f"{src} has no {count_key} key, so it has no layers to cut")
    if layers >= source_layers:
        raise ValueError(f"layers must be below the source's {source_layers} (got {layers})")
    if not dst.parent.is_dir():  # as quantize refuses (it was created, parents and all)
        raise ValueError(f"the output's directory {dst.parent} does not exist")
    if dst.resolve() == src.resolve():
        raise ValueError(f"the draft would overwrite its source {src}; pick another output path")
    check_replaceable(dst)
    if dst.exists() and not force:
        raise ValueError(f"{dst} already exists (--force overwrites it)")
    if dst.exists():  # (a version a running model holds: refused, as quantize refuses it)
        from justllm.models.registry import Registry

        Registry().check_overwritable(dst)

    reader = _read(src)
    dst.parent.mkdir(parents=True, exist_ok=True)
    # (one partial file per process, moved into place only while the output is still
    # missing: two runs to one output both wrote DST.part, and the later replaced the
    # earlier's draft, though neither had --force)
    sweep_dead(dst.parent, f".{glob.escape(dst.name)}.partial-*")
    part = dst.with_name(f".{dst.name}.partial-{os.getpid()}")
    try:
        _write(reader, part, arch, count_key, layers, source_layers)
        publish(part, dst, force=force)
    except OSError as e:
        part.unlink(missing_ok=True)
        raise JustLLMError(f"cannot write {dst}: {e.strerror or e}") from e
    except BaseException:
        part.unlink(missing_ok=True)
        raise
    return DraftInfo(dst, layers, source_layers, dst.stat().st_size)


def _read(src: Path):
    """``GGUFReader``'s parse, the same fields and parts, about 10x faster on a 262k-token
    vocabulary (0.7 against 7.7 s for the demo model). Its parser takes a numpy view of every
    element of every array, ~1M of them, each through a memmap's Python hooks; here the views
    are plain ndarrays, an array of numbers is one view cut into rows, and an array of strings
    is walked with ``struct``. If a later ``gguf`` renames these methods, this is only slower,
    never wrong (``tests/models/test_draft.py`` compares the two parses)."""
    import gguf

    class _FastReader(gguf.GGUFReader):
        def _get(self, *args: Any, **kwargs: Any) -> np.ndarray:
            if type(self.data) is np.memmap:
                self.data = self.data.view(np.ndarray)  # type: ignore[assignment]  # gguf: a memmap
            return super()._get(*args, **kwargs)

        def _get_field_parts(self, orig_offs: int, raw_type: int) -> Any:
            array = _array_parts(self, orig_offs, raw_type)
            return array if array is not None else super()._get_field_parts(orig_offs, raw_type)

    try:
        return _FastReader(src, "r")
    except (ValueError, KeyError, IndexError) as e:
        raise ModelLoadError(f"{src} is not a readable GGUF file ({e})") from None
    except OSError as e:
        raise ModelLoadError(f"cannot read {src}: {e.strerror or e}") from None


def _array_parts(reader, offs: int, raw_type: int) -> Any:
    """``GGUFReader._get_field_parts``'s answer for a non-empty array of numbers or strings:
    its size, its parts (the item type, the length, then each item: a one-element array, or a
    string's length and bytes), the indices of the items' parts, and its types. None for
    anything else (a scalar, an empty array, an array of arrays: the reader's own parse, which
    comes back here for each inner array)."""
    import gguf

    vtype = gguf.GGUFValueType
    if raw_type != vtype.ARRAY:
        return None
    raw_itype = reader._get(offs, np.uint32)
    count = reader._get(offs + 4, np.uint64)
    n, start = int(count[0]), offs + 12
    try:
        itype = vtype(int(raw_itype[0]))
    except ValueError:
        return None  # the reader's own parse says what is wrong
    nptype = reader.gguf_scalar_to_np.get(itype)
    if n == 0 or (nptype is None and itype != vtype.STRING):
        return None
    parts: list[np.ndarray] = [raw_itype, count]
    if nptype is not None:
        if start + n * np.dtype(nptype).itemsize > len(reader.data):
            raise ValueError("an array runs past the end of the file")
        values = reader._get(start, nptype, n)
        parts += list(values.reshape(n, 1))
        return 12 + values.nbytes, parts, list(range(2, 2 + n)), [vtype.ARRAY, itype]
    data = reader.data  # a plain ndarray once _get has run
    swapped = reader.byte_order == "S"
    order = "=" if not swapped else (">" if sys.byteorder == "little" else "<")
    length = struct.Struct(order + "Q")
    lengths, pos, end, buf = [], start, len(data), memoryview(data)
    for _ in range(n):
        if pos + 8 > end:
            raise ValueError("an array of strings runs past the end of the file")
        (size,) = length.unpack_from(buf, pos)
        pos += 8
        lengths.append(size)
        parts.append(data[pos:pos + size])
        pos += size
        if pos > end:
            raise ValueError("an array of strings runs past the end of the file")
    dtype = np.dtype(np.uint64).newbyteorder(">" if swapped != (sys.byteorder == "big") else "<")
    texts = parts[2:]
    parts[2:] = [p for pair in zip(np.array(lengths, dtype=dtype).reshape(n, 1), texts, strict=True)
                 for p in pair]
    return pos - offs, parts, list(range(3, 2 + 2 * n, 2)), [vtype.ARRAY, itype]


def _value(field) -> Any:
    """A field's value as the writer takes it back; strings stay bytes, so a vocabulary with
    invalid UTF-8 pieces is copied byte for byte instead of failing to decode."""
    import gguf

    t = field.types
    if t[0] == gguf.GGUFValueType.STRING:
        return bytes(field.parts[field.data[0]])
    if t[0] != gguf.GGUFValueType.ARRAY:
        return field.contents()
    if len(t) > 2:
        raise ModelLoadError(f"metadata key {field.name} is a nested array; not supported")
    if t[-1] == gguf.GGUFValueType.STRING:
        return [bytes(field.parts[i]) for i in field.data]
    return field.contents()


def _fast_writer_class():
    """``GGUFWriter`` packing an array of numbers in one ``struct.pack`` and an array of
    strings in one join, where the writer packs each item on its own (786k items in the demo
    model's vocabulary: ~2 s). The bytes are the writer's (``tests/models/test_draft.py``)."""
    import gguf

    vtype = gguf.GGUFValueType

    class FastWriter(gguf.GGUFWriter):
        def _pack_val(self, val: Any, kind: Any, add_vtype: bool, sub_type: Any = None) -> bytes:
            fmt = self._simple_value_packing.get(sub_type) if sub_type is not None else None
            if (kind != vtype.ARRAY or not isinstance(val, list | tuple) or not val
                    or (fmt is None and sub_type != vtype.STRING)):
                return super()._pack_val(val, kind, add_vtype, sub_type)
            order = "<" if self.endianess == gguf.GGUFEndian.LITTLE else ">"
            head = struct.pack(order + "I", kind) if add_vtype else b""
            head += struct.pack(order + "IQ", sub_type, len(val))
            if fmt is not None:
                return head + struct.pack(f"{order}{len(val)}{fmt}", *val)
            size = struct.Struct(order + "Q").pack
            items = [v.encode("utf-8") if isinstance(v, str) else v for v in val]
            return head + b"".join(b for item in items for b in (size(len(item)), item))

    return FastWriter


def copying_writer(reader, path: Path, arch: str,
                   edit: Callable[[str, Any, bool], Any] | None = None):
    """A ``GGUFWriter`` to ``path`` holding ``reader``'s metadata (its alignment and every
    field but the header's and the architecture, which the writer adds), each value through
    ``edit(name, value, is_array)`` when given; the tensors are the caller's to add."""
    import gguf

    writer = _fast_writer_class()(path, arch=arch, endianess=reader.endianess)
    alignment = reader.get_field(gguf.Keys.General.ALIGNMENT)
    if alignment is not None:
        writer.data_alignment = int(_value(alignment))
    for field in reader.fields.values():
        # GGUF.* are the reader's views of the header; the writer adds the architecture itself.
        if field.name.startswith("GGUF.") or field.name == gguf.Keys.General.ARCHITECTURE:
            continue
        vtype = field.types[0]
        sub_type = field.types[-1] if vtype == gguf.GGUFValueType.ARRAY else None
        value = _value(field)
        if edit is not None:
            value = edit(field.name, value, sub_type is not None)
        if sub_type is not None and len(value) == 0:
            continue  # the writer cannot write an empty array; absent and empty read the same
        writer.add_key_value(field.name, value, vtype, sub_type=sub_type)
    return writer


def _write(reader, path: Path, arch: str, count_key: str, layers: int, source_layers: int) -> None:
    def edit(name: str, value: Any, is_array: bool) -> Any:
        if name == count_key:
            return layers
        if is_array and name.startswith(f"{arch}.") and len(value) == source_layers:
            return value[:layers]
        return value

    writer = copying_writer(reader, path, arch, edit)
    for tensor in reader.tensors:
        block = _BLOCK_TENSOR.match(tensor.name)
        if block is not None and int(block.group(1)) >= layers:
            continue
        # The reader's data has numpy's (reversed) shape, in bytes for quantized types; the
        # writer reverses it back and turns byte shapes into element shapes given raw_dtype.
        writer.add_tensor(tensor.name, tensor.data, raw_shape=tensor.data.shape,
                          raw_dtype=tensor.tensor_type, tensor_endianess=reader.endianess)
    try:
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
    finally:
        writer.close()
