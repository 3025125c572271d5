"""Tool calls streamed as they are written where a grammar holds them: each piece of the
arguments is a piece of what the whole answer's parse gives, for every way the text can be cut
into pieces and every point the answer can be cut off at (pure logic; the real server's
stream is tested in test_tools.py)."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from justllm.server.tools.answer import ChoiceText, Thinking
from justllm.server.tools.json_stream import JsonStream, healed
from justllm.server.tools.parse import ParsedAnswer, ParsedCall, parse_answer
from justllm.server.tools.stream import (
    CallOpened,
    CallPiece,
    CallSplitter,
    read_whole,
)

NAMES = frozenset({"get_weather", "add"})


def _canonical(text: str) -> str:
    """What parse.py gives for a call's arguments."""
    return parse_answer('{"name": "add", "arguments": ' + text + "}", "generic",
                        None).calls[0].arguments


def _streamed(text: str, cuts: list[int]) -> tuple[list[str], JsonStream]:
    js, pieces, at = JsonStream(), [], 0
    for cut in [*sorted(cuts), len(text)]:
        pieces.append(js.feed(text[at:cut]))
        at = cut
    return pieces, js


_JSON = st.recursive(
    st.none() | st.booleans() | st.integers(-10**20, 10**20)
    | st.floats(allow_nan=False, allow_infinity=False) | st.text(max_size=12),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=6), inner,
                                                                max_size=4),
    max_leaves=12)


@settings(max_examples=150, deadline=None)
@given(value=st.dictionaries(st.text(max_size=6), _JSON, max_size=4), ascii=st.booleans(),
       indent=st.sampled_from([None, 0, 2]), data=st.data())
def test_json_pieces_join_to_the_canonical_text_wherever_the_text_is_cut(value, ascii,
                                                                         indent, data):
    # (ensure_ascii writes characters past U+FFFF as surrogate pairs of escapes)
    text = json.dumps(value, ensure_ascii=ascii, indent=indent)
    cuts = data.draw(st.lists(st.integers(0, len(text)), max_size=8))
    pieces, js = _streamed(text + "\n</tool_call>", cuts)
    assert "".join(pieces) == _canonical(text) == json.dumps(value, ensure_ascii=False)
    assert js.end == len(text) and not js.broken


@pytest.mark.parametrize("text, canonical", [
    ('{"a":1.50,"b":-0,"c":1E5,"d":[true,null,false]}',
     '{"a": 1.5, "b": 0, "c": 100000.0, "d": [true, null, false]}'),
    ('{"k": "v", "k": 2}', '{"k": "v", "k": 2}'),  # a key given twice stays as written
    # (a lone surrogate stays an escape: no UTF-8 carries it)
    ('{"s": "\\ud83d\\ude00 \\ud83d x \\u00e9\\n\\/"}', '{"s": "😀 \\ud83d x é\\n/"}'),
    ('{"s": "raw\ttab"}', '{"s": "raw\\ttab"}'),
])
def test_json_pieces_every_one_character_cut(text, canonical):
    assert _canonical(text) == canonical
    pieces, js = _streamed(text, list(range(len(text))))
    assert "".join(pieces) == _canonical(text) and js.end == len(text)


def test_a_number_waits_for_what_ends_it_and_a_bad_text_stops_the_stream():
    js = JsonStream()
    assert js.feed('{"n": 12') == '{"n": '
    assert js.feed("3") == ""
    assert js.feed("}") == "123}"
    bad = JsonStream()
    assert bad.feed('{"n": @') == '{"n": ' and bad.broken


# What each family's forcing grammar spells (tools/grammar.py), with two calls where the
# family takes two.
HELD = {
    "hermes": '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Par\\u00eds", '
              '"days": [1, 2.50]}}\n</tool_call>\n<tool_call>\n{"name": "add", "arguments": '
              '{"a": 1, "b": -20}}\n</tool_call>',
    "mistral": '[TOOL_CALLS][{"name": "add", "arguments": {"a": 1, "b": 2}}, {"name": '
               '"get_weather", "arguments": {"city": "Oslo"}}]',
    "generic": ' [{"name":"add","arguments":{"a":1,"b":2}},{"name":"add","arguments":{}}]',
    "llama3": '{"name": "get_weather", "parameters": {"city": "Rome \\"R\\""}}',
    # the XML forms (untyped here: a value that is JSON is read as JSON)
    "qwen3_coder": "<tool_call>\n<function=get_weather>\n<parameter=city>\nPar\u00eds\n"
                   "</parameter>\n<parameter=days>\n[1, 2.50]\n</parameter>\n</function>\n"
                   "</tool_call>\n<tool_call>\n<function=add>\n<parameter=a>\n1\n</parameter>"
                   "\n</function>\n</tool_call>",
    "glm": "<tool_call>add<arg_key>a</arg_key><arg_value>1</arg_value><arg_key>b</arg_key>"
           "<arg_value>-20</arg_value></tool_call><tool_call>get_weather<arg_key>city"
           "</arg_key><arg_value>Oslo</arg_value></tool_call>",
    "kimi_k2": "<|tool_calls_section_begin|><|tool_call_begin|>functions.add:0"
               '<|tool_call_argument_begin|>{"a": 1, "b": [2.50]}<|tool_call_end|>'
               "<|tool_call_begin|>functions.get_weather:1<|tool_call_argument_begin|>"
               '{"city": "Oslo"}<|tool_call_end|><|tool_calls_section_end|>',
    "deepseek_v3_1": "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>add<｜tool▁sep｜>"
                     '{"a": 1, "b": -2}<｜tool▁call▁end｜><｜tool▁call▁begin｜>get_weather'
                     '<｜tool▁sep｜>{"city": "Oslo"}<｜tool▁call▁end｜><｜tool▁calls▁end｜>',
    # Mistral's newer form (a template that writes [ARGS])
    "mistral-args": '[TOOL_CALLS]add[ARGS]{"a": 1,"b": [2]}[TOOL_CALLS]get_weather[ARGS]{}',
}


def fmt_of(case: str) -> str:
    return case.split("-")[0]


def _stream(fmt: str, text: str, size: int, held: bool = True
            ) -> tuple[str, list[CallOpened | CallPiece], list, ParsedAnswer]:
    """``text`` fed in pieces of ``size``: content shown, the calls' news while it streamed,
    what finishing added, and the answer."""
    splitter = CallSplitter(fmt, NAMES)
    shown, news = "", []
    for i in range(0, len(text), size):
        shown += splitter.feed(text[i:i + size], held)
        news += splitter.deltas()
    rest, answer = splitter.finish()
    return shown + rest, news, splitter.deltas(), answer


def _joined(deltas: list) -> list[tuple[str, str]]:
    calls: list[tuple[str, str]] = []
    for d in deltas:
        if isinstance(d, CallOpened):
            assert d.call_index == len(calls)
            calls.append((d.name, ""))
        else:
            name, so_far = calls[d.call_index]
            calls[d.call_index] = (name, so_far + d.arguments)
    return calls


@pytest.mark.parametrize("case", sorted(HELD))
@pytest.mark.parametrize("size", [1, 4, 1000])
def test_held_calls_stream_as_they_grow_and_join_to_the_whole_parse(case, size):
    text, fmt = HELD[case], fmt_of(case)
    content, news, rest, answer = _stream(fmt, text, size)
    whole = parse_answer(text, fmt, NAMES)
    assert whole.calls and answer == whole and content == whole.content == ""
    assert _joined(news + rest) == [(c.name, c.arguments) for c in whole.calls]
    if size == 1:  # the arguments came as they were written, not at the end
        assert len([d for d in news if isinstance(d, CallPiece)]) > 5
        assert not rest or all(isinstance(d, CallPiece) and d.arguments in "}]" for d in rest)


@pytest.mark.parametrize("case", sorted(HELD))
def test_calls_no_grammar_holds_come_whole_at_the_end(case):
    _, news, rest, answer = _stream(fmt_of(case), HELD[case], 1, held=False)
    assert news == [] and _joined(rest) == [(c.name, c.arguments) for c in answer.calls]


@pytest.mark.parametrize("case", sorted(HELD))
def test_every_cut_off_point_reads_the_same_streamed_and_whole(case):
    text, fmt = HELD[case], fmt_of(case)
    for end in range(len(text) + 1):
        cut = text[:end]
        content, news, rest, answer = _stream(fmt, cut, 3)
        assert answer == read_whole(cut, fmt, NAMES, True, True), cut
        assert _joined(news + rest) == [(c.name, c.arguments) for c in answer.calls], cut
        assert content == answer.content, cut
        if answer.cut:  # the calls as far as they came, each a beginning of the whole one
            whole = parse_answer(text, fmt, NAMES).calls
            assert all(c.name == w.name and w.arguments.startswith(c.arguments)
                       for c, w in zip(answer.calls, whole)), cut
        else:  # whole, or cut before a call's arguments began (its text is content)
            parsed = parse_answer(cut, fmt, NAMES)
            assert answer.calls == parsed.calls, cut
            # (after complete calls, a cut-off marker of another is not content)
            assert answer.content == ("" if parsed.calls else parsed.content), cut


def test_text_before_a_held_call_is_content_and_only_offered_names_open():
    text = 'Sure.\n<tool_call>\n{"name": "add", "arguments": {"a": 1'
    content, news, _, answer = _stream("hermes", text, 2)
    assert content == "Sure." and answer.cut
    # (a number at the very end waits for what ends it: it may go on)
    assert answer.calls == (ParsedCall("add", '{"a": '),)
    other = CallSplitter("hermes", frozenset({"get_weather"}))
    other.feed('<tool_call>\n{"name": "add", "arguments": {"a": 1}}', True)
    assert other.deltas() == []


def test_parallel_false_streams_one_call():
    splitter = CallSplitter("hermes", NAMES, parallel=False)
    splitter.feed(HELD["hermes"], True)
    news = splitter.deltas()
    _, answer = splitter.finish()
    assert len(answer.calls) == 1 and _joined(news + splitter.deltas()) == [
        (answer.calls[0].name, answer.calls[0].arguments)]


def test_a_cut_off_text_heals_to_what_is_complete_of_it():
    """Anthropic's and Ollama's calls carry an object: a call cut off by max_tokens gives
    what is complete of its arguments."""
    text = _canonical('{"city": "Par\\"is", "days": [1, 2, {"at": true}], "unit": "celsius"}')
    cuts = {k: healed(text[:k]) for k in range(len(text) + 1)}
    assert cuts[0] is None and cuts[1] == {} and cuts[len(text)] == json.loads(text)
    assert cuts[text.index(", ") + 3] == {"city": 'Par"is'}  # (a key without its value)
    assert cuts[text.index("true") + 3] == {"city": 'Par"is', "days": [1, 2, {}]}
    whole = json.loads(text)
    for value in cuts.values():  # every one a part of the whole, in its order
        assert value is None or all(whole[k] == v or isinstance(v, (list, dict))
                                    for k, v in value.items())
    assert healed("not json") is None


def test_arguments_given_as_json_text_are_not_streamed():
    """A schema that takes any value lets a held call write its arguments as a JSON string,
    which the parse reads as the object it holds: that call comes whole at the end."""
    text = '<tool_call>\n{"name": "add", "arguments": "{\\"a\\": 1}"}\n</tool_call>'
    content, news, rest, answer = _stream("hermes", text, 1)
    assert news == [] and answer.calls == (ParsedCall("add", '{"a": 1}'),)
    assert _joined(rest) == [("add", '{"a": 1}')]


def test_a_thinking_kept_in_the_text_that_names_the_marker_reads_the_same_both_ways():
    """reasoning_format none: the thinking's marker begins the call region, the lazy grammar
    holds only the call after the thinking. The reader stops at the thinking's words, so the
    stream and the whole answer agree (the parse from the thinking's marker: all content)."""
    thinking = "<think>I could use <tool_call> here.</think>\n"
    call = '<tool_call>\n{"name": "add", "arguments": {"a": 1}}\n</tool_call>'
    splitter = CallSplitter("hermes", NAMES)
    shown = splitter.feed(thinking, False) + splitter.feed(call, True)
    rest, answer = splitter.finish()
    assert splitter.deltas() == [] and answer == read_whole(thinking + call, "hermes", NAMES,
                                                            True, True)
    assert answer.calls == () and shown + rest == answer.content == thinking + call


def test_llama3s_call_streams_once_the_grammar_takes_hold_after_the_python_tag():
    """Its trigger is the { after <|python_tag|>: the marker comes a token before."""
    splitter = CallSplitter("llama3", NAMES)
    assert splitter.feed("<|python_tag|>", False) == "" and splitter.deltas() == []
    news = []
    for piece in ('{"name": "add", ', '"parameters": {"a"', ": 1", "}}"):
        splitter.feed(piece, True)
        news += splitter.deltas()
    assert _joined(news) == [("add", '{"a": 1}')]


def test_a_lone_surrogate_stays_an_escape_that_utf8_can_carry():
    answer = parse_answer('{"name": "add", "arguments": {"s": "\\ud83d!"}}', "generic", NAMES)
    assert answer.calls == (ParsedCall("add", '{"s": "\\ud83d!"}'),)
    answer.calls[0].arguments.encode("utf-8")
    pieces, _ = _streamed('{"s": "\\ud83d!"}', list(range(16)))
    assert "".join(pieces) == '{"s": "\\ud83d!"}'


def test_arguments_nested_by_the_thousand_are_kept_as_text_not_a_crash():
    """A schema that takes any value lets a held call nest past Python's JSON reader (a
    RecursionError escaped Anthropic's and Ollama's routes: a 500), and a client may send
    such arguments back in its history."""
    from justllm.server.anthropic import _tool_use
    from justllm.server.ollama_chat import _call
    from justllm.server.tools.answer import ToolCall
    from justllm.server.tools.request import _arguments

    deep = '{"a": ' + "[" * 5000 + "]" * 5000 + "}"
    call = ToolCall("call_1", "add", deep)
    assert _tool_use(call)["input"] == {"arguments": deep}
    assert _call(call, 0)["function"]["arguments"] == {"arguments": deep}
    assert _tool_use(ToolCall("call_1", "add", deep[:3000]))["input"] == {"arguments": deep[:3000]}
    assert _arguments(deep) == deep


@pytest.mark.parametrize("fmt", ["qwen3_coder", "glm"])
def test_a_thinking_models_xml_call_after_its_thinking_is_a_call_both_ways(fmt):
    """Qwen3.5 and GLM think first (the prompt may open the thinking): the thinking, which
    may name the marker, is reasoning; the held call after it a call, streamed and whole."""
    thinking = "I could use <tool_call> here.</think>\n\n"
    call = HELD[fmt]
    stream = ChoiceText(lstrip=False, fmt=fmt, names=NAMES,
                        thinking=Thinking(("<think>", "</think>"), opened=True))
    thought, shown = stream.feed(thinking, False)
    more, text = stream.feed(call, True)
    news = stream.deltas()
    last, rest, answer = stream.finish()
    whole = ChoiceText(lstrip=False, fmt=fmt, names=NAMES,
                       thinking=Thinking(("<think>", "</think>"), opened=True))
    assert whole.whole(thinking + call, held=True) == ("I could use <tool_call> here.", answer)
    assert thought + more + last == "I could use <tool_call> here."
    assert shown + text + rest == answer.content == "" and len(answer.calls) == 2
    assert _joined(news + stream.deltas()) == [(c.name, c.arguments) for c in answer.calls]


PLAIN = {"get_weather": {"type": "object", "properties": {
    "city": {"type": "string"}, "days": {"type": "integer"}}}}
# a plain string value that names pieces of its closing tag, quotes and line breaks
VALUE = 'say "hi"\n<b></para </arg_val \\ ok\n'
PLAIN_CALLS = {
    "qwen3_coder": f"<tool_call>\n<function=get_weather>\n<parameter=city>\n{VALUE}\n"
                   "</parameter>\n<parameter=days>\n12\n</parameter>\n</function>\n</tool_call>"
                   "<tool_call>\n<function=get_weather>\n<parameter=city></parameter>\n"
                   "</function>\n</tool_call>",  # (an empty value, on no lines of its own)
    "glm": f"<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>{VALUE}</arg_value>\n"
           "<arg_key>days</arg_key>\n<arg_value>12</arg_value>\n</tool_call>",
}


@pytest.mark.parametrize("fmt", sorted(PLAIN_CALLS))
def test_an_xml_plain_string_streams_as_it_is_written_and_every_cut_reads_the_same(fmt):
    """A coding agent sees a file's content as the model writes it: a plain string's value
    goes out a character at a time as JSON, but for what may still be its closing tag; the
    number once it has ended. Cut anywhere, the stream and the whole answer agree."""
    text = PLAIN_CALLS[fmt]
    splitter = CallSplitter(fmt, NAMES, schemas=PLAIN)
    news = []
    for ch in text:
        splitter.feed(ch, True)
        news += splitter.deltas()
    _, answer = splitter.finish()
    assert answer == parse_answer(text, fmt, NAMES, schemas=PLAIN)
    assert json.loads(answer.calls[0].arguments) == {"city": VALUE, "days": 12}
    assert _joined(news + splitter.deltas()) == [(c.name, c.arguments) for c in answer.calls]
    pieces = [d.arguments for d in news if isinstance(d, CallPiece)]
    assert len(pieces) > len(VALUE) // 2 and '12}' not in pieces[:-2], pieces
    for end in range(len(text) + 1):
        cut = text[:end]
        s = CallSplitter(fmt, NAMES, schemas=PLAIN)
        for i in range(0, len(cut), 5):
            s.feed(cut[i:i + 5], True)
        streamed = s.deltas()
        _, got = s.finish()
        assert got == read_whole(cut, fmt, NAMES, True, True, PLAIN), cut
        assert _joined(streamed + s.deltas()) == [(c.name, c.arguments) for c in got.calls]
        if got.cut:
            assert answer.calls[0].arguments.startswith(got.calls[0].arguments), cut
