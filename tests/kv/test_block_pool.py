import pytest

from justllm.kv.block_pool import BlockPool


def test_allocate_and_free_track_usage_exactly():
    pool = BlockPool(8, 16)
    a = pool.allocate(3)
    b = pool.allocate(5)
    assert a == [0, 1, 2] and b == [3, 4, 5, 6, 7]
    assert pool.usage().used == 8 and pool.usage().free == 0
    assert not pool.can_allocate(1)
    with pytest.raises(ValueError):
        pool.allocate(1)
    pool.free(a)
    assert pool.usage().free == 3
    assert pool.allocate(2) == [0, 1]


def test_blocks_for_rounds_up():
    pool = BlockPool(4, 16)
    assert [pool.blocks_for(n) for n in (0, 1, 16, 17, 32, 33)] == [0, 1, 1, 2, 2, 3]
    assert pool.capacity_tokens == 64


def test_invalid_sizes():
    with pytest.raises(ValueError):
        BlockPool(0, 16)
    with pytest.raises(ValueError):
        BlockPool(4, 0)
