"""The grammars that hold a gpt-oss answer in its harmony messages
(server/tools/harmony_grammar.py), through llama.cpp's own grammar, a character at a time:
what gpt-oss writes is taken, a call's arguments follow its own function's schema, and an
analysis body can end in "<"."""

from __future__ import annotations

import pytest

from justllm.engine.async_engine import schema_grammar
from justllm.server.tools.harmony_grammar import answer_grammar, call_grammar
from tests.engine.grammar_text import takes

A = schema_grammar({"type": "object", "properties": {"a": {"type": "integer"}},
                    "required": ["a"]})
B = schema_grammar({"type": "object", "properties": {"b": {"type": "string"}},
                    "required": ["b"]})
CALLS = call_grammar([("get", A), ("get_weather", B)])
HEAD = "<|channel|>analysis<|message|>Think.<|end|><|start|>assistant"


@pytest.fixture(scope="module")
def backend(engine):
    return engine.backend


@pytest.mark.parametrize(("text", "taken"), [
    # a call in either header form, its type said or not, after an analysis or at once
    (HEAD + '<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>'
            '{"b": "x"}', True),
    (' to=functions.get_weather<|channel|>commentary json<|message|>{"b": "x"}', True),
    (' to=functions.get_weather<|channel|>commentary<|constrain|>json<|message|>{"b": "x"}',
     True),
    ('<|channel|>commentary to=functions.get<|message|>{"a": 1}', True),
    # a name run on into a type word: get_weather's header, get's arguments
    ('<|channel|>commentary to=functions.get_weather<|message|>{"a": 1}', False),
    ('<|channel|>commentary to=functions.nope<|message|>{"a": 1}', False),
    # the final message in the format; an analysis ending in "<", or holding one
    ('<|channel|>final<|message|>{"a": 1}', True),
    ('<|channel|>final <|constrain|>json<|message|>{"a": 1}', True),
    ('<|channel|>analysis<|message|>x <<|end|><|start|>assistant<|channel|>final<|message|>'
     '{"a": 1}', True),
    ('<|channel|>analysis<|message|>if a < b<|end|><|start|>assistant<|channel|>final'
     '<|message|>{"a": 1}', True),
    ('<|channel|>final<|message|>{"b": "x"}', False),  # (the format's schema holds)
    ('{"a": 1}', False),  # (no message header)
])
def test_the_answer_grammar(backend, text, taken):
    assert takes(backend, answer_grammar(CALLS, A), text) is taken


def test_the_lazy_call_grammar_from_its_trigger(backend):
    assert takes(backend, CALLS, 'to=functions.get<|channel|>commentary json<|message|>'
                                 '{"a": 2}')
    assert takes(backend, CALLS, '<|channel|>analysis to=functions.get_weather<|message|>'
                                 '{"b": "y"}')
    assert not takes(backend, CALLS, 'to=functions.get_weather<|message|>{"a": 1}')
