"""The offline Python API."""

import pytest

from justllm import LLM, SamplingParams
from justllm.errors import InvalidRequestError


def test_llm_generate_batch(model_path):
    with LLM(model_path, max_seqs=4, pool_blocks=128) as llm:
        outs = llm.generate(["The capital of France is", "1, 2, 3,"],
                            SamplingParams(max_tokens=8, ignore_eos=True))
        assert [len(o.token_ids) for o in outs] == [8, 8]
        assert all(o.finish_reason == "length" and o.text for o in outs)
        assert outs[0].prompt == "The capital of France is"
        single = llm.generate("The capital of France is", SamplingParams(max_tokens=8, ignore_eos=True))
        assert len(single) == 1 and single[0].text
        stats = llm.engine.stats()
        assert stats.kv_blocks.used == stats.prefix_cache.blocks > 0
        # the repeated prompt reused its KV: all of it but the last token
        assert stats.prefix_cache.hit_tokens >= len(llm.engine.tokenize("The capital of France is")) - 1


def test_a_refused_prompt_leaves_the_llm_usable(model_path):
    """One bad prompt in a batch left the others queued, and every later call failed
    (KeyError on their ids); bytes passed for token ids."""
    with LLM(model_path, max_seqs=4, pool_blocks=128) as llm:
        with pytest.raises(InvalidRequestError, match="prompt is empty"):
            llm.generate(["Once upon a time", ""], SamplingParams(max_tokens=4))
        assert not llm.engine.has_unfinished()
        with pytest.raises(InvalidRequestError, match="not bytes"):
            llm.generate([b"bytes"], SamplingParams(max_tokens=4))  # type: ignore[list-item]
        (out,) = llm.generate(["Hello"], SamplingParams(max_tokens=4, ignore_eos=True))
        assert len(out.token_ids) == 4 and out.prompt == "Hello"
