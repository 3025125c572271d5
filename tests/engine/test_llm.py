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


def test_an_llm_used_after_close_says_so_instead_of_crashing(model_path):
    """generate, and the engine's tokenize, after close() read freed llama.cpp memory: a
    segfault (after a `with` block, std::out_of_range and an abort)."""
    from justllm.errors import EngineClosedError

    with LLM(model_path, max_seqs=2, pool_blocks=64) as llm:
        pass
    with pytest.raises(EngineClosedError):
        llm.generate("Hello", SamplingParams(max_tokens=2))
    with pytest.raises(EngineClosedError):
        llm.engine.tokenize("Hello")
    with pytest.raises(EngineClosedError):
        llm.engine.add_request([2, 100], SamplingParams(max_tokens=2))
    llm.close()  # (twice: nothing more)


def test_generate_from_two_threads_takes_turns(model_path):
    """Two threads' generate calls on one LLM both stepped the engine: llama.cpp aborted the
    process (GGML_ASSERT), or one thread ate the other's tokens."""
    import threading

    results: dict[int, list] = {}
    with LLM(model_path, max_seqs=4, pool_blocks=128) as llm:
        def run(k: int, n: int) -> None:
            results[k] = llm.generate(["Once upon a time", "1, 2, 3,"],
                                      SamplingParams(max_tokens=n, ignore_eos=True))

        threads = [threading.Thread(target=run, args=(k, n)) for k, n in ((0, 8), (1, 12))]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=120)
        assert not any(t.is_alive() for t in threads)
        assert [len(o.token_ids) for o in results[0]] == [8, 8]
        assert [len(o.token_ids) for o in results[1]] == [12, 12]
        assert not llm.engine.has_unfinished()


def test_a_failed_request_says_why_and_prompt_logprobs_come_back(model_path):
    """The Python API dropped a failed request's error (a grammar with no way forward came
    back as an empty 'abort'), the stop string that ended an answer, and prompt_logprobs."""
    with LLM(model_path, max_seqs=4, pool_blocks=128) as llm:
        dead, stopped, scored = llm.generate(
            ["Hello", "1, 2, 3,", "The capital of France is"],
            [SamplingParams(max_tokens=4, grammar='root ::= "\\x00"'),
             SamplingParams(max_tokens=16, stop=[","]),
             SamplingParams(max_tokens=1, prompt_logprobs=2)])
        assert dead.finish_reason == "abort" and "grammar" in (dead.error or "")
        assert stopped.stop == "," and stopped.error is None
        tokens = llm.engine.tokenize("The capital of France is")
        assert scored.prompt_token_ids == tokens
        assert scored.prompt_logprobs is not None and len(scored.prompt_logprobs) == len(tokens)
        assert scored.prompt_logprobs[0] is None and scored.prompt_logprobs[1] is not None


def test_out_of_vocabulary_stop_token_ids_are_refused_before_they_harm_others(model_path):
    """With min_tokens they were numpy's IndexError inside the step, which ended every
    request in it; without, silently accepted."""
    with LLM(model_path, max_seqs=4, pool_blocks=128) as llm:
        for ids in ([10**7], [2**64]):
            with pytest.raises(InvalidRequestError, match="stop_token_ids"):
                llm.generate(["Hello", "World"], [
                    SamplingParams(max_tokens=4),
                    SamplingParams(max_tokens=4, stop_token_ids=ids, min_tokens=1)])
        assert not llm.engine.has_unfinished()


def test_an_llm_dropped_without_close_frees_its_model(model_path):
    import gc

    llm = LLM(model_path, max_seqs=2, pool_blocks=64)
    backend = llm.engine.backend
    del llm
    gc.collect()
    assert not backend._model  # (freed: four dropped LLMs held 1.5 GiB)


@pytest.mark.parametrize("field, value", [
    ("ignore_eos", "false"), ("llama_penalties", 1), ("thinking_open", "no"),
    ("stop", 5), ("stop_token_ids", 5), ("keep_stops", None), ("samplers", 5),
    ("logit_bias", 5), ("logit_bias", [(1, 2, 3)]), ("lora", 5), ("grammar_triggers", "x"),
])
def test_sampling_params_of_the_wrong_kind_are_refused_naming_the_field(field, value):
    """A truthy string was a true ignore_eos (the answer ran on); containers of the wrong
    kind were TypeErrors from inside (\"'int' object is not iterable\")."""
    with pytest.raises(InvalidRequestError) as e:
        SamplingParams(**{field: value})
    assert e.value.param == (field if field != "keep_stops" else "stop")


@pytest.mark.parametrize("config, says", [
    ({"ctx": float("nan")}, "ctx must be an integer"),
    ({"threads": 1.5}, "threads must be an integer"),
    ({"gpu": "no"}, "gpu must be True or False"),
    ({"max_seqs": True}, "max_seqs must be an integer"),
    ({"n_batch": 10**9}, "n_batch must be at most 65536"),
    ({"draft_p_min": "x"}, "draft_p_min must be in"),
])
def test_engine_config_values_of_the_wrong_kind_are_refused(config, says):
    from justllm.config import EngineConfig

    with pytest.raises(ValueError, match=says):
        EngineConfig(**config)


def test_prompts_of_another_kind_are_refused(model_path):
    import numpy as np

    with LLM(model_path, max_seqs=2, pool_blocks=64) as llm:
        for prompts in (np.array([2, 818]), None, 5, (t for t in [2, 818])):
            with pytest.raises(InvalidRequestError, match="prompts must be"):
                llm.generate(prompts, SamplingParams(max_tokens=2))  # type: ignore[arg-type]


def test_more_prompts_than_the_queue_holds_are_queued_as_it_takes_them(model_path):
    """A batch larger than max_queue was a QueueFullError ('retry later') for the whole
    call: the offline API cannot retry; it now feeds the queue as requests finish."""
    prompts = [f"{k} + {k} =" for k in range(7)]
    with LLM(model_path, max_seqs=2, max_queue=2, pool_blocks=64) as llm:
        outs = llm.generate(prompts, SamplingParams(max_tokens=3, ignore_eos=True))
        assert [o.prompt for o in outs] == prompts
        assert all(len(o.token_ids) == 3 for o in outs)
        assert len({o.request_id for o in outs}) == 7 and not llm.engine.has_unfinished()


def test_one_sampling_params_per_prompt_in_a_tuple_too(model_path):
    """Prompts may come as a tuple; their SamplingParams as one were refused ("params must be
    a SamplingParams"), where a list was taken."""
    with LLM(model_path, max_seqs=2, pool_blocks=64) as llm:
        outs = llm.generate(("1, 2, 3,", "a, b, c,"), (SamplingParams(max_tokens=2, ignore_eos=True),
                                                     SamplingParams(max_tokens=3, ignore_eos=True)))
        assert [len(o.token_ids) for o in outs] == [2, 3]
        with pytest.raises(ValueError, match="one SamplingParams per prompt, or one for all"):
            llm.generate(("1, 2, 3,", "a, b, c,"), (SamplingParams(),))


def test_llm_chat_renders_with_the_template_and_stops_at_its_turn_end(model_path):
    """vLLM's LLM.chat was missing (and chat_template= was taken and used for nothing): a
    conversation is rendered as the server renders it, stopped at the template's turn end."""
    from justllm.engine.chat_template import ChatTemplate

    ask = [{"role": "user", "content": "What is the capital of France?"}]
    greedy = SamplingParams(max_tokens=24, temperature=0)
    with LLM(model_path, max_seqs=4, pool_blocks=128) as llm:
        with pytest.warns(UserWarning, match="no chat template"):
            (out,) = llm.chat(ask, greedy)
        transcript = ChatTemplate.named("transcript")
        assert out.prompt == transcript.render(ask, add_generation_prompt=True)
        (same,) = llm.generate(out.prompt, SamplingParams(max_tokens=24, temperature=0,
                                                          stop=transcript.stop))
        assert out.text == same.text and out.token_ids == same.token_ids
        assert "User:" not in out.text
        two = llm.chat([ask, [{"role": "user", "content": "Name a colour."}]],
                       [greedy, SamplingParams(max_tokens=4, temperature=0, stop=("x",))])
        assert two[0].text == out.text and len(two[1].token_ids) <= 4
        going = [*ask, {"role": "assistant", "content": "The capital of France is"}]
        (cont,) = llm.chat(going, greedy, add_generation_prompt=False,
                           continue_final_message=True)
        assert cont.prompt.endswith("The capital of France is")
        for bad, kw in (("hi", {}), ([], {}), ([ask, "x"], {}),
                        (going, {"continue_final_message": True})):
            with pytest.raises(InvalidRequestError):
                llm.chat(bad, greedy, **kw)
    with LLM(model_path, max_seqs=2, pool_blocks=64, chat_template="chatml") as llm:
        (out,) = llm.chat(ask, SamplingParams(max_tokens=4, temperature=0))
        assert out.prompt.endswith("<|im_start|>assistant\n")
