import pytest

from justllm.core.sampling_params import SamplingParams
from justllm.errors import InvalidRequestError


@pytest.mark.parametrize("kw, param", [
    ({"max_tokens": -5}, "max_tokens"),
    ({"temperature": -1}, "temperature"),
    ({"top_p": -0.1}, "top_p"),
    ({"top_p": 1.5}, "top_p"),
    ({"top_k": -1}, "top_k"),
    ({"min_p": 2}, "min_p"),
    ({"presence_penalty": 3}, "presence_penalty"),
    ({"seed": "x"}, "seed"),
    ({"seed": 2**64}, "seed"),
    ({"seed": -2**63 - 1}, "seed"),
    ({"stop": [""]}, "stop"),
    ({"logprobs": 50}, "logprobs"),
    ({"max_tokens": True}, "max_tokens"),
    ({"temperature": float("nan")}, "temperature"),
    ({"max_tokens": 2.0}, "max_tokens"),
    ({"logit_bias": {5: 101}}, "logit_bias"),
    ({"logit_bias": {-1: 1}}, "logit_bias"),
    ({"logit_bias": {"5": 1}}, "logit_bias"),
    ({"logit_bias": {5: float("nan")}}, "logit_bias"),
    ({"stop": ["x"] * 33}, "stop"),
])
def test_bad_values_name_the_parameter(kw, param):
    with pytest.raises(InvalidRequestError) as e:
        SamplingParams(**kw)
    assert e.value.param == param


def test_stop_string_is_normalised_to_tuple():
    assert SamplingParams(stop="END").stop == ("END",)
    assert SamplingParams(stop=["a", "b"]).stop == ("a", "b")
    assert SamplingParams().greedy and not SamplingParams(temperature=0.7).greedy


def test_max_tokens_none_means_to_the_context_and_logit_bias_is_normalised():
    assert SamplingParams(max_tokens=None).max_tokens is None
    assert SamplingParams(logit_bias={7: -100, 9: 2.5}).logit_bias == ((7, -100), (9, 2.5))
    assert SamplingParams(logit_bias=[(7, 1)]).logit_bias == ((7, 1),)


def test_a_negative_seed_is_a_64_bit_seed_like_any_other():
    """A negative seed reached numpy's generator as is, which refuses it: a 500."""
    assert SamplingParams(seed=-1).seed == 2**64 - 1
    assert SamplingParams(seed=-2**63).seed == 2**63
    assert SamplingParams(seed=5).seed == 5


def test_max_tokens_0_computes_the_prompt_alone():
    """(the prompt scored for its logprobs, or only cached: llama-server's n_predict 0; the
    OpenAI routes take it only with the prompt's logprobs, tests/server/test_prompt_logprobs)"""
    assert SamplingParams(max_tokens=0, prompt_logprobs=0).max_tokens == 0
    assert SamplingParams(max_tokens=0).max_tokens == 0


def test_the_infill_step_needs_a_bounded_top_k_before_it():
    ok = SamplingParams(top_k=40, samplers=("top_k", "top_p", "infill"))
    assert ok.samplers == ("top_k", "top_p", "infill")
    for kw in ({"top_k": 40, "samplers": ("infill", "top_k")}, {"samplers": ("top_k", "infill")},
               {"top_k": 257, "samplers": ("top_k", "infill")}):
        with pytest.raises(InvalidRequestError, match="infill needs a top_k step before it"):
            SamplingParams(**kw)


@pytest.mark.parametrize("param", ["temperature", "top_p", "min_p", "repeat_penalty",
                                   "presence_penalty", "frequency_penalty", "spec_p_min"])
@pytest.mark.parametrize("value", [float("inf"), float("-inf"), float("nan"), 10**400])
def test_every_float_parameter_is_finite(param, value):
    """repeat_penalty inf passed its "> 0" (only NaN was refused): the sampler then made NaN
    logits, and a chat with --url failed each message blaming the server. An int too large
    for a float is no value either."""
    with pytest.raises(InvalidRequestError) as e:
        SamplingParams(**{param: value})
    assert e.value.param == ("speculative.p_min" if param == "spec_p_min" else param)


def test_infinite_lora_scales_and_biases_are_refused_and_large_finite_penalties_are_not():
    for kw, param in (({"lora": {"a": float("inf")}}, "lora"),
                      ({"logit_bias": {5: float("-inf")}}, "logit_bias")):
        with pytest.raises(InvalidRequestError) as e:
            SamplingParams(**kw)
        assert e.value.param == param
    with pytest.raises(InvalidRequestError,
                       match=r"^repeat_penalty must be a finite number > 0$"):
        SamplingParams(repeat_penalty=float("inf"))
    assert SamplingParams(repeat_penalty=1e300).repeat_penalty == 1e300
    assert SamplingParams(repeat_penalty=3).repeat_penalty == 3


def test_top_p_0_keeps_the_best_token_alone_and_is_shown_as_given():
    """OpenAI's and Ollama's clients send 0 (it was a 400): a nucleus of one, shown as 0 in
    /slots and request records."""
    from justllm.engine.records import recorded_params

    p = SamplingParams(temperature=1.0, top_p=0)
    assert 0 < p.top_p < 1e-9 and p.shown_top_p == 0.0
    assert recorded_params(p)["top_p"] == 0.0
    assert SamplingParams(top_p=0.5).shown_top_p == 0.5
