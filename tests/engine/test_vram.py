"""A --gpu engine's KV pool from free VRAM (engine/vram.py): the demo model's real header and
file sizes, the free memory given (no GPU on the CI machine), and the real device query on
whatever build this is."""

from dataclasses import replace
from pathlib import Path

import pytest

from justllm.config import EngineConfig
from justllm.errors import GPUUnavailableError, ModelLoadError

GIB = 2**30


def test_the_pool_grows_with_free_memory_up_to_the_training_context(model_path):
    from justllm.engine.vram import with_vram_pool

    config = EngineConfig(model=model_path, gpu=True)
    # 0.9 of it less the weights (253 MB) and the compute reserve (1.6 GB) is the KV's
    pools = [with_vram_pool(config, free_bytes=int(n * GIB)).pool_blocks for n in (2.2, 2.4, 200)]
    assert 0 < pools[0] < pools[1] < pools[2]
    # The demo model: 18 layers, 1 KV head, 256 + 256 wide: 18 KiB a token in F16.
    assert pools[1] - pools[0] == pytest.approx(0.9 * 0.2 * GIB / 18432 / 16, abs=2)
    assert pools[2] * 16 == 32768  # its training context, however much is free
    assert with_vram_pool(replace(config, pool_blocks=64), free_bytes=GIB).pool_blocks == 64


def test_a_draft_model_takes_its_share(model_path):
    from justllm.engine.vram import with_vram_pool

    alone = EngineConfig(model=model_path, gpu=True)
    drafted = EngineConfig(model=model_path, gpu=True, spec="draft", draft_model=model_path)
    assert (with_vram_pool(drafted, free_bytes=int(2.4 * GIB)).pool_blocks
            < with_vram_pool(alone, free_bytes=int(2.4 * GIB)).pool_blocks)


def test_without_flash_attention_the_attention_scores_take_their_share(model_path):
    """Flash attention off: llama.cpp's compute buffer holds a micro-batch's float32 scores
    against every cell, per head (the demo model's 4 heads, micro-batch 512: 16 KiB a token,
    beside its 18 KiB of KV); the pool made room for the KV alone."""
    from justllm.engine.vram import with_vram_pool

    on = EngineConfig(model=model_path, gpu=True)
    off = replace(on, flash_attn="off")
    fa, no_fa = (with_vram_pool(c, free_bytes=int(2.4 * GIB)).pool_blocks for c in (on, off))
    assert with_vram_pool(replace(on, flash_attn="auto"), free_bytes=int(2.4 * GIB)
                          ).pool_blocks == fa
    assert no_fa == pytest.approx(fa * 18432 / (18432 + 2 * 4 * 512 * 4), abs=2)


def test_too_little_memory_is_a_clear_error(model_path):
    from justllm.engine.vram import with_vram_pool

    config = EngineConfig(model=model_path, gpu=True)
    weights = Path(model_path).stat().st_size
    with pytest.raises(ModelLoadError, match="leaves no room for a KV cache.*--pool-blocks"):
        with_vram_pool(config, free_bytes=weights)


def test_the_device_query_on_this_build(model_path):
    from justllm.engine.backend import gpu_offload_supported
    from justllm.engine.engine import Engine
    from justllm.engine.vram import with_vram_pool

    config = EngineConfig(model=model_path, gpu=True)
    if gpu_offload_supported():  # a GPU build: the pool comes from the real free memory
        assert with_vram_pool(config).pool_blocks > 0
    else:  # a CPU build says so before sizing anything, through the engine as well
        with pytest.raises(GPUUnavailableError, match="CPU-only"):
            with_vram_pool(config)
        with pytest.raises(GPUUnavailableError, match="CPU-only"):
            Engine(config)


def test_a_gpu_build_that_sees_no_gpu_says_so_not_that_it_is_cpu_only(model_path, monkeypatch):
    """llama.cpp's llama_supports_gpu_offload counts devices: a CUDA build without a visible
    GPU (driver, CUDA_VISIBLE_DEVICES) looks CPU-only to it, and was told to reinstall."""
    import justllm.engine.backend as backend
    from justllm.engine.vram import with_vram_pool

    names = backend.gpu_backends()  # (this build's: none here, CUDA on the GPU check's)
    assert "CPU" not in names and (bool(names) or not backend.gpu_offload_supported())
    monkeypatch.setattr(backend, "gpu_offload_supported", lambda: False)
    monkeypatch.setattr(backend, "gpu_backends", lambda: ["CUDA"])
    with pytest.raises(GPUUnavailableError) as e:
        with_vram_pool(EngineConfig(model=model_path, gpu=True))
    assert str(e.value) == ("--gpu: this llama-cpp-python build has a GPU backend (CUDA) but "
                            "sees no GPU (check the driver, nvidia-smi and CUDA_VISIBLE_DEVICES)")
