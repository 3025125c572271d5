"""The bytes a prefill hands to a decode replica: one sequence's KV as llama.cpp writes it
(``llama_state_seq_get_data``), behind a header that says what it fits and a checksum.

    b"JLKV" | u32 little-endian header length | header (JSON) | data

The header names the model (the GGUF's sha256), the KV cache type, the layer count, the token
ids the data holds at positions ``0..len(tokens)-1``, the data's length and its sha256, and how
the data is cut: llama.cpp leaves out of a sequence's state the cells its sliding-window layers
no longer attend to, which a shared prefix still needs, so a sliding-window model's KV is
written in chunks of ``chunk_tokens`` positions (its window), each a state of its own
(``chunks``: their byte lengths). Pure:
no llama.cpp, no I/O; :func:`unpack` and :func:`check_fits` refuse, with a clear
:class:`KVTransferError`, everything that must not reach llama.cpp (a truncated blob, a wrong
checksum, another model, quantization or KV type), so a bad transfer never aborts a process.
"""

from __future__ import annotations

import hashlib
import json
import struct
from collections.abc import Sequence
from dataclasses import asdict, dataclass

from justllm.errors import JustLLMError

MAGIC = b"JLKV"
VERSION = 1
MAX_HEADER = 64 * 2**20  # a header (mostly token ids) larger than this is not ours


class KVTransferError(JustLLMError):
    """KV bytes that cannot be imported here (the caller computes the prompt itself)."""


@dataclass(frozen=True)
class KVIdentity:
    """What an engine's KV data depends on: two engines with equal identities can exchange it."""

    model: str  # sha256 of the GGUF file
    kv_type: str  # e.g. "f16"
    n_layer: int
    # V stored transposed: llama.cpp does so without flash attention (--flash-attn off), and
    # refuses the other layout's state
    v_trans: bool = False


@dataclass(frozen=True)
class KVHeader:
    identity: KVIdentity
    tokens: tuple[int, ...]  # at positions 0..len-1
    n_bytes: int
    sha256: str
    chunk_tokens: int  # chunk k holds positions k*chunk_tokens .. (k+1)*chunk_tokens - 1
    chunks: tuple[int, ...]  # each chunk's bytes

    def spans(self) -> list[tuple[int, int]]:
        """Each chunk's positions, [start, end)."""
        n, step = len(self.tokens), self.chunk_tokens
        return [(a, min(a + step, n)) for a in range(0, n, step)]


def pack(identity: KVIdentity, tokens: list[int], chunks: Sequence[bytes | bytearray],
         chunk_tokens: int) -> bytes:
    data = b"".join(chunks)
    header = json.dumps({"version": VERSION, **asdict(identity), "tokens": list(tokens),
                         "n_bytes": len(data), "sha256": hashlib.sha256(data).hexdigest(),
                         "chunk_tokens": chunk_tokens, "chunks": [len(c) for c in chunks]},
                        separators=(",", ":")).encode()
    return MAGIC + struct.pack("<I", len(header)) + header + data


def unpack(blob: bytes | memoryview) -> tuple[KVHeader, list[memoryview]]:
    """The header and the chunks of ``blob``, checked whole (sizes, types, checksum)."""
    view = memoryview(blob)
    if bytes(view[:4]) != MAGIC[:len(view)]:
        raise KVTransferError("not justllm KV data (bad magic)")
    if len(view) < 8:
        raise KVTransferError(f"KV data truncated: {len(view)} bytes")
    (n,) = struct.unpack("<I", view[4:8])
    if n > MAX_HEADER or len(view) < 8 + n:
        raise KVTransferError(f"KV data truncated: a {n}-byte header, {len(view) - 8} bytes "
                              "after the length")
    try:
        raw = json.loads(bytes(view[8:8 + n]))
    except ValueError:
        raise KVTransferError("KV header is not valid JSON") from None
    try:
        if raw["version"] != VERSION:
            raise KVTransferError(f"KV format version {raw['version']!r}; this justllm reads "
                                  f"version {VERSION}")
        identity = KVIdentity(str(raw["model"]), str(raw["kv_type"]), int(raw["n_layer"]),
                              raw.get("v_trans", False) is True)
        tokens = raw["tokens"]
        if not isinstance(tokens, list) or not tokens or not all(
                isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in tokens):
            raise KVTransferError("KV header: tokens must be a non-empty list of token ids")
        chunks = raw["chunks"]
        if not isinstance(chunks, list) or not all(
                isinstance(c, int) and not isinstance(c, bool) and c > 0 for c in chunks):
            raise KVTransferError("KV header: chunks must be a list of byte lengths")
        header = KVHeader(identity, tuple(tokens), int(raw["n_bytes"]), str(raw["sha256"]),
                          int(raw["chunk_tokens"]), tuple(chunks))
    except (KeyError, TypeError, ValueError) as e:
        raise KVTransferError(f"KV header is malformed ({type(e).__name__}: {e})") from None
    if header.chunk_tokens < 1 or len(header.spans()) != len(header.chunks) or \
            sum(header.chunks) != header.n_bytes:
        raise KVTransferError("KV header: the chunks do not add up to the tokens and bytes")
    data = view[8 + n:]
    if len(data) != header.n_bytes:
        raise KVTransferError(f"KV data truncated: {len(data)} bytes of {header.n_bytes}")
    if hashlib.sha256(data).hexdigest() != header.sha256:
        raise KVTransferError("KV data checksum mismatch (corrupted in transfer)")
    parts, at = [], 0
    for size in header.chunks:
        parts.append(data[at:at + size])
        at += size
    return header, parts


def check_fits(header: KVHeader, here: KVIdentity, vocab_size: int) -> None:
    """Refuse data made by another model, quantization or KV layout than ``here``."""
    theirs = header.identity
    if theirs.model != here.model:
        raise KVTransferError(f"KV data is from another model file (sha256 "
                              f"{theirs.model[:12]}…, this one {here.model[:12]}…): the same "
                              "GGUF, quantization included, must serve both sides")
    if (theirs.kv_type, theirs.n_layer) != (here.kv_type, here.n_layer):
        raise KVTransferError(f"KV data has type {theirs.kv_type} over {theirs.n_layer} layers; "
                              f"this engine uses {here.kv_type} over {here.n_layer}")
    if theirs.v_trans != here.v_trans:
        raise KVTransferError("KV data stores V " + ("transposed (flash attention off)"
                              if theirs.v_trans else "by rows (flash attention on)")
                              + ", this engine the other way: give both sides the same "
                              "--flash-attn")
    if max(header.tokens) >= vocab_size:
        raise KVTransferError(f"KV header: a token id is outside the vocabulary ({vocab_size})")
