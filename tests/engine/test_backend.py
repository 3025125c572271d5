"""The backend refuses what would abort the process, with an exception instead."""

import pytest

from justllm.errors import EngineError


def test_guards(engine):
    b = engine.backend
    # The engine is shared: tests before may have left cached prefixes in its sequences.
    engine.flush_prefix_cache()
    engine.runner.apply_kv_ops(engine.scheduler.take_kv_ops())
    assert b.seq_pos_max(0) == -1
    with pytest.raises(EngineError):
        b.decode(b.config.n_batch + 1)  # more tokens than n_batch
    with pytest.raises(EngineError):
        b.decode(0)  # empty batch
    b.batch_tokens[:2] = [2, 100]
    b.batch_pos[:2] = [0, 1]
    b.batch_n_seq[:2] = 1  # one sequence each (the shared engine's last batch may have had more)
    b.batch_seq[:2] = [b.config.n_seq_max, 0]  # sequence id out of range
    b.batch_logits[:2] = [0, 1]
    with pytest.raises(EngineError):
        b.decode(2)
    b.batch_seq[:2] = [0, 0]
    b.batch_tokens[1] = b.n_vocab  # token id past the vocabulary
    with pytest.raises(EngineError):
        b.decode(2)
    with pytest.raises(EngineError):
        b.seq_rm(300)  # would abort inside llama.cpp's memory functions
    with pytest.raises(EngineError):
        b.seq_cp(0, b.config.n_seq_max)
    # still healthy afterwards
    b.batch_tokens[:2] = [2, 100]
    logits = b.decode(2)
    assert logits.shape == (1, b.n_vocab)
    b.seq_rm(0)
    assert b.seq_pos_max(0) == -1


def test_the_context_takes_the_micro_batch_and_flash_attention_it_is_given(model_path):
    """n_ubatch and flash attention (the knobs --gpu's defaults are tuned by) reach
    llama.cpp's context; a prompt longer than the micro-batch still prefills and generates,
    to the same first greedy token (later ones may differ: other kernels, other rounding)."""
    from justllm.config import EngineConfig
    from justllm.core.sampling_params import SamplingParams
    from justllm.engine.backend import gpu_devices, gpu_offload_supported
    from justllm.engine.llm import LLM

    prompt = "The history of the lighthouse on the northern cliffs began " * 6
    params = SamplingParams(max_tokens=6)
    firsts = []
    for ubatch, fa in ((0, "auto"), (32, "on"), (32, "off")):
        llm = LLM(model_path, pool_blocks=64, n_ubatch=ubatch, flash_attn=fa, max_seqs=2)
        try:
            assert llm.engine.backend.n_ubatch == (ubatch or llm.engine.config.n_ubatch)
            out = llm.generate([prompt], params)[0]
            assert len(out.token_ids) == 6
            firsts.append(out.token_ids[0])
        finally:
            llm.close()
    assert len(set(firsts)) == 1
    assert (gpu_devices() == []) is (not gpu_offload_supported())  # a CPU build sees no GPU
    with pytest.raises(ValueError, match="flash_attn must be auto, on or off"):
        EngineConfig(flash_attn="yes")
    with pytest.raises(ValueError, match="n_ubatch must be an integer >= 0"):
        EngineConfig(n_ubatch=-1)
