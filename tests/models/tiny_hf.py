"""A tiny random Hugging Face Llama model made on the spot (no hub, no download): 2 layers,
hidden size 64, a 300-odd-token byte-fallback BPE tokenizer trained with the `tokenizers`
library and saved by transformers' ``save_pretrained``, and safetensors weights written with
numpy. About 0.2 MB; llama.cpp's converter turns it into a GGUF that llama.cpp loads and runs.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

HIDDEN, LAYERS, HEADS, KV_HEADS, FFN = 64, 2, 4, 2, 128
TEXT = ["the quick brown fox jumps over the lazy dog", "hello world, hello justllm",
        "a small model made for the tests", "converting safetensors to gguf"] * 16


def tokenizer_files(into: Path) -> int:
    """tokenizer.json + tokenizer_config.json + special_tokens_map.json; returns the vocab
    size. Llama's style (Metaspace, byte fallback, a decoder sequence), which llama.cpp's
    converter reads as a Llama HF vocabulary."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(byte_fallback=True, unk_token="<unk>", fuse_unk=True))
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="\u2581", prepend_scheme="first")
    tok.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(),
                                     decoders.Fuse(), decoders.Strip(" ", 1, 0)])
    specials = ["<unk>", "<s>", "</s>", *(f"<0x{i:02X}>" for i in range(256))]
    tok.train_from_iterator(TEXT, trainers.BpeTrainer(vocab_size=400, special_tokens=specials,
                                                      show_progress=False))
    PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>",
                            unk_token="<unk>").save_pretrained(into)
    return tok.get_vocab_size()


def weights(vocab: int, seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    head = HIDDEN // HEADS

    def w(*shape: int) -> np.ndarray:
        return (rng.standard_normal(shape) * 0.05).astype(np.float32)

    out = {"model.embed_tokens.weight": w(vocab, HIDDEN), "lm_head.weight": w(vocab, HIDDEN),
           "model.norm.weight": np.ones(HIDDEN, np.float32)}
    for i in range(LAYERS):
        p = f"model.layers.{i}."
        out |= {p + "self_attn.q_proj.weight": w(HIDDEN, HIDDEN),
                p + "self_attn.k_proj.weight": w(KV_HEADS * head, HIDDEN),
                p + "self_attn.v_proj.weight": w(KV_HEADS * head, HIDDEN),
                p + "self_attn.o_proj.weight": w(HIDDEN, HIDDEN),
                p + "mlp.gate_proj.weight": w(FFN, HIDDEN),
                p + "mlp.up_proj.weight": w(FFN, HIDDEN),
                p + "mlp.down_proj.weight": w(HIDDEN, FFN),
                p + "input_layernorm.weight": np.ones(HIDDEN, np.float32),
                p + "post_attention_layernorm.weight": np.ones(HIDDEN, np.float32)}
    return out


def config(vocab: int, architecture: str = "LlamaForCausalLM") -> dict:
    return {"architectures": [architecture], "model_type": "llama", "vocab_size": vocab,
            "hidden_size": HIDDEN, "intermediate_size": FFN, "num_hidden_layers": LAYERS,
            "num_attention_heads": HEADS, "num_key_value_heads": KV_HEADS,
            "max_position_embeddings": 256, "rms_norm_eps": 1e-6, "rope_theta": 10000.0,
            "hidden_act": "silu", "tie_word_embeddings": False, "bos_token_id": 1,
            "eos_token_id": 2, "torch_dtype": "float32"}


def make_tiny_llama(into: Path, *, architecture: str = "LlamaForCausalLM",
                    tokenizer: bool = True) -> Path:
    """Write the model into ``into`` (created); returns it."""
    from safetensors.numpy import save_file

    into.mkdir(parents=True, exist_ok=True)
    vocab = tokenizer_files(into) if tokenizer else 347
    save_file(weights(vocab), str(into / "model.safetensors"), metadata={"format": "pt"})
    (into / "config.json").write_text(json.dumps(config(vocab, architecture), indent=1))
    return into


def model_files(directory: Path) -> dict[str, bytes]:
    """Every file of a model directory, for a stand-in hub's ``push``."""
    return {p.name: p.read_bytes() for p in sorted(directory.iterdir()) if p.is_file()}


def make_tiny_lora(into: Path, base: str | None, *, rank: int = 4, seed: int = 1) -> Path:
    """A PEFT LoRA adapter for the tiny Llama (q_proj and v_proj of every layer, weights large
    enough to change its answers), as PEFT's save_pretrained writes it; ``base`` is its
    ``base_model_name_or_path`` (None: left out)."""
    from safetensors.numpy import save_file

    into.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    tensors = {}
    for i in range(LAYERS):
        for module, out in (("q_proj", HIDDEN), ("v_proj", KV_HEADS * (HIDDEN // HEADS))):
            p = f"base_model.model.model.layers.{i}.self_attn.{module}."
            tensors[p + "lora_A.weight"] = (rng.standard_normal((rank, HIDDEN)) * 0.5).astype(
                np.float32)
            tensors[p + "lora_B.weight"] = (rng.standard_normal((out, rank)) * 0.5).astype(
                np.float32)
    save_file(tensors, str(into / "adapter_model.safetensors"), metadata={"format": "pt"})
    config = {"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": rank, "lora_alpha": 2 * rank,
              "target_modules": ["q_proj", "v_proj"], "bias": "none", "fan_in_fan_out": False}
    if base is not None:
        config["base_model_name_or_path"] = base
    (into / "adapter_config.json").write_text(json.dumps(config, indent=1))
    return into
