"""The offline Python API."""

from justllm import LLM, SamplingParams


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
