"""The check a LoRA adapter file passes before llama.cpp loads it.

llama.cpp's ``llama_adapter_lora_init`` validates most of an adapter and returns NULL with a
logged reason (architecture, tensor names and shapes against the base), but a few malformed
files abort the whole process instead: its metadata getters assert their value's type
(``general.type``, ``general.architecture`` and ``adapter.type`` must be strings,
``adapter.lora.alpha`` a float32), and a LoRA tensor with more than two dimensions passes its
shape check and aborts in the first matrix product. Those are checked here, with the ``gguf``
package, and every problem is one line naming the file. Only the adapter is read (it is small);
the shapes against the base model are llama.cpp's check.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from justllm.errors import ModelLoadError
from justllm.models.gguf import read_gguf_header

_SUFFIXES = (".lora_a", ".lora_b")
# What convert_lora_to_gguf.py writes (--outtype f32, f16, bf16, q8_0); llama.cpp multiplies
# each with the activations as it is.
_TENSOR_TYPES = ("F32", "F16", "BF16", "Q8_0")


@dataclass(frozen=True)
class LoraFileInfo:
    path: Path
    architecture: str
    alpha: float  # 0: none given (llama.cpp then scales by the request's scale alone)
    rank: int
    targets: tuple[str, ...]  # the base model's weights it changes


def not_a_file(path: Path) -> str | None:
    """Why ``path`` is no regular file to read ("file not found", "a directory, not a
    file", ...), or None when it is one."""
    try:
        there, found = path.exists(), path.is_file()
    except (OSError, ValueError):  # a name the OS cannot take (a NUL byte, too long)
        there = found = False
    if found:
        return None
    # (a folder or a device said "file not found")
    return ("a directory, not a file" if there and path.is_dir()
            else "not a regular file" if there else "file not found")


def check_lora_file(path: str | Path, architecture: str) -> LoraFileInfo:
    """``path`` as a LoRA adapter for a model of ``architecture``; ModelLoadError otherwise."""
    if not str(path).strip():  # (it said "LoRA adapter .: file not found")
        raise ModelLoadError("a LoRA adapter's path is empty")
    p = Path(path).expanduser()
    where = f"LoRA adapter {p}"
    missing = not_a_file(p)
    if missing is not None:
        raise ModelLoadError(f"{where}: {missing}")
    try:
        header = read_gguf_header(p, adapter=True)
    except ModelLoadError as e:
        raise ModelLoadError(f"{where}: {e}") from None
    kind = header.metadata.get("general.type")
    if kind != "adapter":  # checked first: a whole model file would be slow to read below
        raise ModelLoadError(f"{where}: not a LoRA adapter (general.type is {kind!r}, not "
                             "'adapter'; `justllm convert ADAPTER_DIR` converts a PEFT "
                             "adapter into one)")
    import gguf

    try:
        reader = gguf.GGUFReader(str(p))
    except Exception as e:  # the reader raises plain exceptions on what it cannot parse
        raise ModelLoadError(f"{where}: unreadable GGUF ({e})") from None
    strings = {}
    for key in ("general.type", "general.architecture", "adapter.type"):
        strings[key] = _string(reader, key, where)
    if strings["adapter.type"] != "lora":
        raise ModelLoadError(f"{where}: adapter.type is {strings['adapter.type']!r}; only "
                             "'lora' adapters are supported")
    if strings["general.architecture"] != architecture:
        raise ModelLoadError(f"{where}: made for a '{strings['general.architecture']}' model; "
                             f"this model is '{architecture}'")
    alpha = _alpha(reader, where)
    rank, targets = _tensors(reader, where)
    return LoraFileInfo(p, architecture, alpha, rank, targets)


def _string(reader, key: str, where: str) -> str:
    import gguf

    field = reader.get_field(key)
    if field is None:
        raise ModelLoadError(f"{where}: no {key} key")
    if field.types != [gguf.GGUFValueType.STRING]:
        raise ModelLoadError(f"{where}: {key} must be a string")
    return bytes(field.parts[field.data[0]]).decode("utf-8", "replace")


def _alpha(reader, where: str) -> float:
    import gguf

    field = reader.get_field(gguf.Keys.Adapter.LORA_ALPHA)
    if field is None:
        return 0.0
    if field.types != [gguf.GGUFValueType.FLOAT32]:
        raise ModelLoadError(f"{where}: adapter.lora.alpha must be a float32")
    return float(field.parts[field.data[0]][0])


def _tensors(reader, where: str) -> tuple[int, tuple[str, ...]]:
    """The rank and the target weights; every LoRA tensor in a complete A/B pair, 2-D, of a
    type llama.cpp multiplies, with matching ranks."""
    pairs: dict[str, dict[str, list[int]]] = {}
    for t in reader.tensors:
        name = t.name
        suffix = next((s for s in _SUFFIXES if name.endswith(s)), None)
        if suffix is None:
            if name.endswith("_norm.weight"):
                continue  # llama.cpp skips these
            raise ModelLoadError(f"{where}: tensor '{name}' is not a LoRA tensor (.lora_a or "
                                 ".lora_b)")
        dims = [int(d) for d in t.shape]
        if len(dims) < 2 or any(d != 1 for d in dims[2:]):
            raise ModelLoadError(f"{where}: tensor '{name}' has shape {dims}; LoRA tensors are "
                                 "matrices")
        if t.tensor_type.name not in _TENSOR_TYPES:
            raise ModelLoadError(f"{where}: tensor '{name}' is {t.tensor_type.name}; LoRA "
                                 f"tensors must be {', '.join(_TENSOR_TYPES)}")
        pairs.setdefault(name[:-len(suffix)], {})[suffix] = dims
    if not pairs:
        raise ModelLoadError(f"{where}: no LoRA tensors")
    ranks = set()
    for target, ab in sorted(pairs.items()):
        if len(ab) != 2:
            missing = next(s for s in _SUFFIXES if s not in ab)
            raise ModelLoadError(f"{where}: '{target}' has no {missing} tensor")
        # ggml order: A is [n_in, rank], B is [rank, n_out] (token_embd's are swapped).
        a, b = ab[".lora_a"], ab[".lora_b"]
        rank = b[0] if not target.endswith("token_embd.weight") else a[0]
        if not target.endswith("token_embd.weight") and a[1] != b[0]:
            raise ModelLoadError(f"{where}: '{target}' has a rank-{a[1]} A and a rank-{b[0]} B")
        ranks.add(rank)
    return max(ranks), tuple(sorted(pairs))
