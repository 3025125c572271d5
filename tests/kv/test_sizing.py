"""The GPU pool's size policy (kv/sizing.py): pure arithmetic, so plain numbers."""

from justllm.kv.sizing import (
    MAX_POOL_TOKENS,
    VRAM_SHARE,
    compute_reserve,
    pool_cap,
    vram_pool_blocks,
)

GIB = 2**30


def test_the_pool_takes_the_share_of_free_memory_left_after_weights_and_reserve():
    blocks = vram_pool_blocks(10 * GIB, weights_bytes=2 * GIB, reserve_bytes=1 * GIB,
                              kv_bytes_per_token=2**17, block_size=16, max_tokens=10**9)
    # 0.9 * 10 GiB - 3 GiB = 6 GiB of KV at 128 KiB a token: 49152 tokens, 3072 blocks
    assert VRAM_SHARE == 0.9
    assert blocks == int((0.9 * 10 * GIB - 3 * GIB) // 2**17) // 16 == 3072


def test_the_pool_is_capped_at_the_training_context_within_a_floor_and_a_ceiling():
    assert vram_pool_blocks(100 * GIB, 0, 0, 1024, 16, max_tokens=32768) == 32768 // 16
    assert pool_cap(32768, 16384) == 32768  # the training context (llama-server's n_ctx)
    assert pool_cap(2048, 16384) == 16384  # a short-context model still gets the CPU's pool
    assert pool_cap(1 << 20, 16384) == MAX_POOL_TOKENS  # a 1M-token model does not


def test_nothing_fits_is_zero_blocks():
    assert vram_pool_blocks(4 * GIB, weights_bytes=4 * GIB, reserve_bytes=0,
                            kv_bytes_per_token=1024, block_size=16, max_tokens=10**6) == 0
    assert vram_pool_blocks(GIB, 0, 0, kv_bytes_per_token=GIB, block_size=16,
                            max_tokens=10**6) == 0  # less than a block


def test_the_compute_reserve_grows_with_the_micro_batch_and_the_vocabulary():
    base = compute_reserve(512, 32000, 4096)
    assert compute_reserve(1024, 32000, 4096) > base
    assert compute_reserve(512, 262144, 4096) > base
    assert base > 512 * 2**20
