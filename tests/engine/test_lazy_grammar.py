"""Lazy grammars (tool_choice "auto"): the answer is free until a call's marker, then held to
the call grammar, on the real model through llama.cpp's grammar sampler."""

from __future__ import annotations

import json

import pytest

from justllm.core.sampling_params import SamplingParams
from justllm.engine.backend import grammar_from_json_schema
from justllm.engine.lazy_grammar import LazyGrammar
from justllm.errors import InvalidRequestError
from justllm.server.tools.grammar import call_schema, call_triggers, wrap_call_grammar
from justllm.server.tools.parse import parse_answer

WEATHER = {"type": "object", "properties": {"city": {"type": "string", "enum": ["Rome", "Oslo"]}},
           "required": ["city"], "additionalProperties": False}
SHOT = ('Q: What is the weather in Paris?\nA: Let me check. <tool_call>\n{"name": "get_weather", '
        '"arguments": {"city": "Paris"}}\n</tool_call>\n')
PROMPT = SHOT + SHOT + "Q: What is the weather in Paris?\nA:"


def hermes_grammar(parallel: bool) -> str:
    schema = call_schema([("get_weather", WEATHER)], "hermes")
    return wrap_call_grammar(grammar_from_json_schema(schema), "hermes", parallel)


def generate(engine, params: SamplingParams) -> tuple[str, str | None]:
    rid = engine.add_request(PROMPT, params)
    text = ""
    while True:
        for out in engine.step():
            assert out.error is None, out.error
            if out.request_id == rid:
                text += out.text
                if out.finished:
                    return text, out.finish_reason


def test_the_answer_is_free_until_the_marker_and_a_valid_call_after_it(engine):
    """The model copies its examples: a call with city Paris, which the tool's enum does not
    offer. Without a grammar that is what it writes (and the call is malformed: content);
    with the lazy grammar the words before the marker are the same, and the call names a
    city the schema allows, and ends (one call: parallel_tool_calls false)."""
    free, _ = generate(engine, SamplingParams(max_tokens=40, temperature=0))
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}' in free
    held, finish = generate(engine, SamplingParams(
        max_tokens=60, temperature=0, grammar=hermes_grammar(False),
        grammar_triggers=call_triggers("hermes", False)))
    before = held.split("<tool_call>")[0]
    assert before == free.split("<tool_call>")[0] == " Let me check. "
    assert finish == "stop", held
    answer = parse_answer(held.strip(), "hermes", frozenset({"get_weather"}), parallel=False)
    assert len(answer.calls) == 1 and json.loads(answer.calls[0].arguments)["city"] in (
        "Rome", "Oslo"), held


def tokens(engine, text: str) -> list[int]:
    return engine.backend.tokenize(text, add_special=False)


def lazy(engine, triggers: tuple[str, ...] = call_triggers("hermes", True),
         thinking: tuple[tuple[str, str], bool] | None = None) -> LazyGrammar:
    b = engine.backend
    gbnf = hermes_grammar(True)
    return LazyGrammar(b.grammar(gbnf), triggers,
                       lambda t: b.token_to_piece(t, special=True),
                       lambda text: b.tokenize(text, add_special=False), thinking)


def feed(g: LazyGrammar, ids: list[int]) -> None:
    """As the engine feeds it: only tokens it allows (a refused one aborts llama.cpp)."""
    for t in ids:
        assert g.allows(t)
        g.accept(t)


def test_it_holds_nothing_before_the_trigger_and_the_grammar_after(engine):
    g = lazy(engine)
    brace, bracket = tokens(engine, "{")[0], tokens(engine, "[")[0]
    feed(g, tokens(engine, "Sure, [calling] it now: "))
    assert not g.active and g.allows(bracket)
    feed(g, tokens(engine, "<tool_call>\n"))
    assert g.active and g.allows(brace) and not g.allows(bracket)


def test_text_after_the_trigger_that_breaks_the_grammar_leaves_the_answer_free(engine):
    """llama.cpp's own lazy sampler replays such text into the grammar, which throws through
    the C API and aborts the process: here the grammar gives up, and the answer stays free
    (a malformed call comes back as text). A trigger that reads past the marker makes the
    token that completes it carry text the call grammar refuses."""
    g = lazy(engine, (r"(<tool_call>)\s*\[",))
    feed(g, tokens(engine, "x <tool_call>\n[1, 2]"))
    assert g.given_up and not g.active and g.allows(tokens(engine, "{")[0])


THINK = ("<think>", "</think>")


@pytest.mark.parametrize("opened, answer", [
    (False, " <think>I could write <tool_call>\n[1] here.</think> Checking. <tool_call>\n"),
    (True, "Maybe <tool_call>\n[1]? No.\n</think>\n\n<tool_call>\n"),
])
def test_a_thinking_models_triggers_count_only_after_its_thinking(engine, opened, answer):
    """A reasoning model's thinking may name the call's marker (it was why thinking models
    were left free): the grammar takes hold only at a marker after the thinking."""
    g = lazy(engine, thinking=(THINK, opened))
    thinking, after = answer.split("</think>")
    feed(g, tokens(engine, thinking))
    assert not g.active and not g.given_up  # (the [1] after the marker would break it)
    feed(g, tokens(engine, "</think>" + after))
    assert g.active and g.allows(tokens(engine, "{")[0])


def test_an_answer_that_does_not_open_its_thinking_is_held_from_the_start(engine):
    """Not opened by the prompt and not begun with the start tag (thinking switched off):
    the whole answer is the answer; the anchored triggers of the fallback text hold from its
    first character."""
    g = lazy(engine, thinking=(THINK, False))
    feed(g, tokens(engine, "  <thi"))
    assert not g.active
    g = lazy(engine, thinking=(THINK, False))
    feed(g, tokens(engine, "OK. <tool_call>\n"))
    assert g.active
    b = engine.backend
    generic = wrap_call_grammar(grammar_from_json_schema(call_schema(
        [("get_weather", WEATHER)], "generic")), "generic", False)
    anchored = LazyGrammar(b.grammar(generic), call_triggers("generic", False),
                           lambda t: b.token_to_piece(t, special=True),
                           lambda text: b.tokenize(text, add_special=False), (THINK, True))
    feed(anchored, tokens(engine, 'x {"name"</think> '))
    assert not anchored.active
    feed(anchored, tokens(engine, '{"name"'))
    assert anchored.active


def test_a_thinking_model_with_tools_writes_a_valid_call_after_thinking_freely(engine):
    """On the real model: its thinking copies the examples' marker and a malformed call
    freely (a grammar there would have forced it into a call), and the call after the
    thinking is held to the schema (Paris is not in its enum)."""
    shot = ('Q: What is the weather in Paris?\nA: <think>I will use <tool_call> with Paris.'
            '</think> <tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n'
            '</tool_call>\n')
    rid = engine.add_request(shot + shot + "Q: What is the weather in Paris?\nA:",
                             SamplingParams(max_tokens=60, temperature=0,
                                            grammar=hermes_grammar(False),
                                            grammar_triggers=call_triggers("hermes", False),
                                            thinking_tags=THINK))
    text = ""
    while True:
        outs = [o for o in engine.step() if o.request_id == rid]
        if outs:
            text += outs[0].text
            if outs[0].finished:
                break
    thinking, answer = text.split("</think>")
    assert "<tool_call> with Paris" in thinking, text
    calls = parse_answer(answer.strip(), "hermes", frozenset({"get_weather"}), False).calls
    assert len(calls) == 1 and json.loads(calls[0].arguments)["city"] in ("Rome", "Oslo"), text


def test_triggers_need_a_grammar_and_must_compile():
    with pytest.raises(InvalidRequestError, match="need a grammar"):
        SamplingParams(grammar_triggers=("(<tool_call>)",))
    with pytest.raises(InvalidRequestError, match="regular expressions"):
        SamplingParams(grammar='root ::= "a"', grammar_triggers=("(",))


def test_a_lazy_grammar_is_compiled_once_when_the_request_is_prepared(engine, monkeypatch):
    """Compiled when the request is prepared (a grammar llama.cpp refuses is a 400 before the
    queue), and that matcher is the one the trigger starts: no second compile on the engine
    thread, which every other request's step waits on."""
    b = engine.backend
    made = []
    compile_grammar = type(b).grammar

    def counted(self, gbnf):
        made.append(gbnf)
        return compile_grammar(self, gbnf)

    monkeypatch.setattr(type(b), "grammar", counted)
    held, finish = generate(engine, SamplingParams(
        max_tokens=60, temperature=0, grammar=hermes_grammar(False),
        grammar_triggers=call_triggers("hermes", False)))
    assert "<tool_call>" in held and finish == "stop", held
    assert len(made) == 1
    with pytest.raises(InvalidRequestError, match="could not be parsed"):
        engine.prepare(PROMPT, SamplingParams(grammar='root ::= "a', grammar_triggers=(
            "(<tool_call>)",)))
