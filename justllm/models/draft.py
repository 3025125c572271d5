"""A draft model built from the target itself: the first ``N`` transformer blocks of a GGUF.

Speculative decoding needs a small model that shares the target's vocabulary exactly. Not every
model ships one, and the tests need one too, so ``make_draft`` writes a layer-truncated copy:
the same metadata (tokenizer arrays included), the same embedding, output norm and head, and
blocks ``0..N-1`` with their quantization and bytes untouched. Such a draft is weak (it skips
the later blocks without any retraining) but it is free, its tokens are always in the target's
vocabulary, and on repetitive text it agrees with the target often enough to measure with.

Reading and writing go through the ``gguf`` package (llama.cpp's own Python reader/writer), the
way its ``gguf_new_metadata.py`` script copies a file; nothing here touches llama.cpp.
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from justllm.errors import JustLLMError, ModelLoadError
from justllm.models.gguf import read_gguf_header

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
    read_gguf_header(src)  # missing, not a GGUF or truncated: one clear error, not numpy's
    if not dst.parent.is_dir():  # as quantize refuses (it was created, parents and all)
        raise ValueError(f"the output's directory {dst.parent} does not exist")
    if dst.resolve() == src.resolve():
        raise ValueError(f"the draft would overwrite its source {src}; pick another output path")
    if dst.exists() and not force:
        raise ValueError(f"{dst} already exists (--force overwrites it)")

    reader = _read(src)
    arch_field = reader.get_field(gguf.Keys.General.ARCHITECTURE)
    if arch_field is None:
        raise ModelLoadError(f"{src} has no general.architecture key")
    arch = _value(arch_field).decode("utf-8")
    count_key = f"{arch}.block_count"
    count_field = reader.get_field(count_key)
    if count_field is None:
        raise ModelLoadError(f"{src} has no {count_key} key, so it has no layers to cut")
    source_layers = int(_value(count_field))
    if layers >= source_layers:
        raise ValueError(f"layers must be below the source's {source_layers} (got {layers})")

    dst.parent.mkdir(parents=True, exist_ok=True)
    part = dst.with_name(dst.name + ".part")
    try:
        _write(reader, part, arch, count_key, layers, source_layers)
        os.replace(part, dst)
    except OSError as e:
        part.unlink(missing_ok=True)
        raise JustLLMError(f"cannot write {dst}: {e.strerror or e}") from e
    except BaseException:
        part.unlink(missing_ok=True)
        raise
    return DraftInfo(dst, layers, source_layers, dst.stat().st_size)


def _read(src: Path):
    """``GGUFReader`` over plain ndarray views: the same parse, about 2.5x faster on a 262k-token
    vocabulary, because slicing an ``np.memmap`` runs Python hooks on each of the ~1M slices
    its parser takes. If a later ``gguf`` renames ``_get``, this is only slower, never wrong."""
    import gguf

    class _PlainViewReader(gguf.GGUFReader):
        def _get(self, *args: Any, **kwargs: Any) -> np.ndarray:
            if type(self.data) is np.memmap:
                self.data = self.data.view(np.ndarray)  # type: ignore[assignment]  # gguf: a memmap
            return super()._get(*args, **kwargs)

    try:
        return _PlainViewReader(src, "r")
    except (ValueError, KeyError, IndexError) as e:
        raise ModelLoadError(f"{src} is not a readable GGUF file ({e})") from None
    except OSError as e:
        raise ModelLoadError(f"cannot read {src}: {e.strerror or e}") from None


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


def copying_writer(reader, path: Path, arch: str,
                   edit: Callable[[str, Any, bool], Any] | None = None):
    """A ``GGUFWriter`` to ``path`` holding ``reader``'s metadata (its alignment and every
    field but the header's and the architecture, which the writer adds), each value through
    ``edit(name, value, is_array)`` when given; the tensors are the caller's to add."""
    import gguf

    writer = gguf.GGUFWriter(path, arch=arch, endianess=reader.endianess)
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
