"""The backend refuses what would abort the process, with an exception instead."""

import pytest

from justllm.errors import EngineError


def test_guards(engine):
    b = engine.backend
    with pytest.raises(EngineError):
        b.decode(b.config.n_batch + 1)  # more tokens than n_batch
    with pytest.raises(EngineError):
        b.decode(0)  # empty batch
    b.batch_tokens[:2] = [2, 100]
    b.batch_pos[:2] = [0, 1]
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
