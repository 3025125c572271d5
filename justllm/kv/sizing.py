"""How large a GPU's KV pool is when the user does not say (``--gpu`` without ``--pool-blocks``).

Pure arithmetic on numbers the engine reads (free VRAM, the model's file and shape), so the
policy is tested without a GPU. The pool is the model's training context (llama-server's
default context; at least the CPU's default pool), shrunk to what fits in a share of the memory
free when the model starts, once the weights and llama.cpp's compute buffers are counted.

Why not fill the GPU, as vLLM's ``gpu_memory_utilization`` does? Router mode puts several
models, or several replicas of one, on a GPU: the first to start would take it all. And with
llama.cpp's unified KV cache a step attends over every cell up to the highest one in use, so a
pool far beyond what the running sequences use mostly keeps more cached prefixes, each costing
every later step attention time. ``--pool-blocks`` sets any size.
"""

from __future__ import annotations

VRAM_SHARE = 0.9  # of the free memory; the rest is headroom (CUDA's context, fragmentation)
MAX_POOL_TOKENS = 1 << 18  # 262144 tokens, whatever the training context


def pool_cap(n_ctx_train: int, floor_tokens: int) -> int:
    """The most tokens a default pool holds: the training context, at least ``floor_tokens``,
    at most :data:`MAX_POOL_TOKENS`."""
    return min(max(n_ctx_train, floor_tokens), MAX_POOL_TOKENS)


def compute_reserve(n_ubatch: int, n_vocab: int, n_embd: int) -> int:
    """Bytes llama.cpp's compute buffers may take on the GPU: a micro-batch's float32 logits and
    hidden states (twice over, for the graph's intermediates) and a fixed 512 MiB for the
    rest. On the safe side: a pool a little smaller than it could be beats a failed start."""
    return 2 * n_ubatch * (n_vocab + 4 * n_embd) * 4 + (512 << 20)


def scores_bytes_per_token(n_ubatch: int, n_head: int) -> int:
    """Without flash attention llama.cpp's attention computes a micro-batch's float32 scores
    against every cell of the cache, for each head (and their softmax beside them), in a
    compute buffer sized for the whole cache: a cost per token of the pool, like the KV's
    (a 128k pool, 32 heads, micro-batch 512: 16 GiB)."""
    return 2 * 4 * n_ubatch * n_head


def vram_pool_blocks(free_bytes: int, weights_bytes: int, reserve_bytes: int,
                     kv_bytes_per_token: int, block_size: int, max_tokens: int,
                     share: float = VRAM_SHARE) -> int:
    """Blocks of ``block_size`` tokens that fit in ``share`` of ``free_bytes`` after the weights
    and the compute reserve, at most ``max_tokens`` (:func:`pool_cap`); 0 when nothing
    fits."""
    budget = int(free_bytes * share) - weights_bytes - reserve_bytes
    if budget <= 0 or kv_bytes_per_token <= 0:
        return 0
    tokens = min(budget // kv_bytes_per_token, max_tokens)
    return max(0, tokens // block_size)
