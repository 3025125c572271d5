"""Small GGUF files for registry and pull tests: complete headers, a few hundred bytes each."""

from __future__ import annotations

import tempfile
from pathlib import Path

import gguf
import numpy as np


def tiny_gguf(path: Path | None = None, *, name: str = "tiny", file_type: int = 7,
              context: int = 2048, seed: int = 0) -> bytes:
    """A GGUF that reads as a ``llama`` model (``file_type`` 7 is Q8_0) with one small tensor;
    a different ``seed`` gives different bytes. Written to ``path`` when given; its bytes are
    returned either way. llama.cpp cannot load it (it has no weights to speak of)."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "tiny.gguf"
        w = gguf.GGUFWriter(out, arch="llama")
        w.add_name(name)
        w.add_file_type(file_type)
        w.add_context_length(context)
        w.add_block_count(1)
        w.add_tensor("token_embd.weight",
                     np.random.default_rng(seed).standard_normal((4, 32), dtype=np.float32))
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_tensors_to_file()
        w.close()
        data = out.read_bytes()
    if path is not None:
        Path(path).write_bytes(data)
    return data


# The demo model's first unused tokens, named as a code model's FIM tokens by with_fim_tokens.
FIM_IDS = {"pre": 6, "suf": 7, "mid": 8, "rep": 9, "sep": 10}  # <unused0> .. <unused4>


def with_fim_tokens(src: Path, dst: Path, names: tuple[str, ...] = ("pre", "suf", "mid")
                    ) -> Path:
    """A copy of the GGUF ``src`` whose metadata names tokens of its vocabulary (FIM_IDS) as
    the fill-in-the-middle tokens ``names``, as a code model's does (Gemma 3 has none): the
    weights are the same, so the model infills no better, but llama.cpp reads the tokens and
    /infill lays its prompt out with them."""
    return with_metadata(src, dst, lambda w, arch: [
        w.add_uint32(f"tokenizer.ggml.fim_{name}_token_id", FIM_IDS[name]) for name in names])


def with_pooling(src: Path, dst: Path, pooling: int) -> Path:
    """A copy of ``src`` whose metadata says how its embeddings are pooled (llama.cpp's
    ``{arch}.pooling_type``: 1 mean, 2 CLS, 3 last), as an embedding model's does."""
    return with_metadata(src, dst, lambda w, arch: w.add_uint32(f"{arch}.pooling_type",
                                                                  pooling))


def with_metadata(src: Path, dst: Path, add, edit=None) -> Path:
    """A copy of ``src`` (metadata and the same tensors), with what ``add(writer, arch)``
    adds to its metadata and each value through ``edit(name, value, is_array)`` if given."""
    from justllm.models.draft import _read, _value, copying_writer

    reader = _read(src)
    arch = str(_value(reader.get_field(gguf.Keys.General.ARCHITECTURE)), "utf-8")
    w = copying_writer(reader, dst, arch, edit)
    add(w, arch)
    for t in reader.tensors:
        w.add_tensor(t.name, t.data, raw_shape=t.data.shape, raw_dtype=t.tensor_type,
                     tensor_endianess=reader.endianess)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return dst


def with_chat_template(src: Path, dst: Path, template: str) -> Path:
    """A copy of ``src`` (a base model: it has none) whose metadata holds a chat template, as
    an instruction-tuned model's does."""
    return with_metadata(src, dst, lambda w, arch: w.add_chat_template(template))


def tiny_bert(path: Path, *, causal_flag: bool = True, reranker: bool = False) -> Path:
    """A two-layer BERT sentence-embedding model with random weights and a small WordPiece
    vocabulary (a few words, the letters, ``[CLS]``/``[SEP]``...), written tensor by tensor
    as llama.cpp's converter writes a BERT (``bert.attention.causal`` false when
    ``causal_flag``, mean pooling): llama.cpp loads it, tokenizes and embeds with it. Its
    embeddings mean nothing; that they are llama.cpp's is what a test can check. A
    ``reranker`` pools by rank (a score per input, from a classifier head on [CLS]), as a
    cross-encoder such as bge-reranker does."""
    rng = np.random.default_rng(0)
    words = ("hello world the cat dog sat on mat is red blue green apple river stone light "
             "paris france capital of what").split()
    special = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
    letters = [chr(c) for c in range(ord("a"), ord("z") + 1)]
    # llama.cpp's WordPiece: a word's first piece starts with "\u2581", the others bare
    tokens = list(dict.fromkeys(special + ["\u2581" + w for w in words + letters] + letters
                                + list(".,?!")))
    n_vocab, n_embd, n_ff, n_ctx = len(tokens), 64, 128, 128
    w = gguf.GGUFWriter(path, arch="bert")
    w.add_name("tiny-bert")
    w.add_context_length(n_ctx)
    w.add_embedding_length(n_embd)
    w.add_feed_forward_length(n_ff)
    w.add_block_count(2)
    w.add_head_count(4)
    w.add_layer_norm_eps(1e-12)
    if causal_flag:
        w.add_causal_attention(False)
    w.add_pooling_type(gguf.PoolingType.RANK if reranker else gguf.PoolingType.MEAN)
    w.add_file_type(gguf.LlamaFileType.ALL_F32)
    w.add_tokenizer_model("bert")
    w.add_token_list(tokens)
    w.add_token_types([gguf.TokenType.CONTROL if t in special else gguf.TokenType.NORMAL
                       for t in tokens])
    w.add_token_type_count(2)
    for add, token in ((w.add_pad_token_id, 0), (w.add_unk_token_id, 1), (w.add_bos_token_id, 2),
                       (w.add_eos_token_id, 3), (w.add_sep_token_id, 3),
                       (w.add_mask_token_id, 4)):
        add(token)
    w.add_add_bos_token(True)
    w.add_add_eos_token(True)

    def tensor(name: str, *shape: int, fill: float | None = None) -> None:
        a = (np.full(shape, fill, np.float32) if fill is not None
             else (rng.standard_normal(shape) * 0.05).astype(np.float32))
        w.add_tensor(name, a)

    tensor("token_embd.weight", n_vocab, n_embd)
    tensor("token_types.weight", 2, n_embd)
    tensor("position_embd.weight", n_ctx, n_embd)
    tensor("token_embd_norm.weight", n_embd, fill=1.0)
    tensor("token_embd_norm.bias", n_embd, fill=0.0)
    for i in range(2):
        for x in ("attn_q", "attn_k", "attn_v", "attn_output"):
            tensor(f"blk.{i}.{x}.weight", n_embd, n_embd)
            tensor(f"blk.{i}.{x}.bias", n_embd, fill=0.0)
        for norm in ("attn_output_norm", "layer_output_norm"):
            tensor(f"blk.{i}.{norm}.weight", n_embd, fill=1.0)
            tensor(f"blk.{i}.{norm}.bias", n_embd, fill=0.0)
        tensor(f"blk.{i}.ffn_up.weight", n_ff, n_embd)
        tensor(f"blk.{i}.ffn_up.bias", n_ff, fill=0.0)
        tensor(f"blk.{i}.ffn_down.weight", n_embd, n_ff)
        tensor(f"blk.{i}.ffn_down.bias", n_embd, fill=0.0)
    if reranker:
        tensor("cls.weight", n_embd, n_embd)
        tensor("cls.bias", n_embd, fill=0.0)
        tensor("cls.output.weight", 1, n_embd)
        tensor("cls.output.bias", 1, fill=0.0)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path
