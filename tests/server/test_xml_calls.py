"""Qwen3-Coder's XML call form served end to end: the demo model with llama.cpp's
Qwen3-Coder template (``--chat-template``) gets its tools and its history's calls in that
form, copies the calls, and a forced call comes back as ``tool_calls``, whole and streamed as
it is written, its values held to the schema (``days`` may not be the 3 the history shows). GLM's and
DeepSeek V3.1's forms are held and read on the engine (tests/server/test_tools.py); the
parsing of every form, pure, in test_tool_parsers.py; the grammars' shapes here."""

from __future__ import annotations

import json

import httpx
import pytest

from justllm.server.tools.grammar import call_triggers, section_calls_grammar
from justllm.server.tools.xml_grammar import text_without, unheld_keyword, xml_call_grammar
from tests.server.conftest import start_server
from tests.server.test_tokenize import post

TRIP = {"type": "object", "properties": {
    "city": {"type": "string"}, "days": {"type": "integer", "minimum": 1, "maximum": 2}},
    "required": ["city", "days"]}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": TRIP}}]


def shots() -> list[dict]:
    out: list[dict] = []
    for k in range(2):
        out += [{"role": "user", "content": "What is the weather in Paris?"},
                {"role": "assistant", "content": None, "tool_calls": [{
                    "id": f"call_{k}", "type": "function", "function": {
                        "name": "get_weather", "arguments": '{"city": "Paris", "days": 3}'}}]},
                {"role": "tool", "tool_call_id": f"call_{k}", "content": "sunny"},
                {"role": "assistant", "content": "Sunny."}]
    return [*out, {"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module")
def coder(model_path):
    from rich.console import Console

    from justllm.models.convert import get_converter

    template = get_converter(Console(stderr=True)).root / "models/templates/Qwen3-Coder.jinja"
    s = start_server(model_path, "--chat-template", str(template), "--no-prefix-cache")
    yield s
    assert s.stop() == 0


def _body(**extra) -> dict:
    return {"messages": shots(), "tools": TOOLS, "temperature": 0, "max_tokens": 60,
            "parallel_tool_calls": False, **extra}


def _streamed(server, **extra) -> tuple[list[dict], list[dict]]:
    """The chunks of a streamed answer, and the tool-call deltas among them."""
    with httpx.stream("POST", server.url + "/v1/chat/completions",
                      json=_body(stream=True, **extra), timeout=120) as s:
        chunks = [json.loads(x[6:]) for x in s.iter_lines() if x.startswith("data: {")]
    assert not any(c["choices"][0]["delta"].get("content") for c in chunks), chunks
    assert chunks[-1]["choices"][0]["finish_reason"] == "tool_calls"
    deltas = [d for c in chunks for d in c["choices"][0]["delta"].get("tool_calls") or []]
    assert deltas[0]["function"] == {"name": "get_weather", "arguments": ""}
    return chunks, deltas


def _arguments(deltas: list[dict]) -> dict:
    args = json.loads("".join(d["function"]["arguments"] for d in deltas[1:]))
    assert args["city"] == "Paris" and args["days"] in (1, 2), args
    return args


def test_a_forced_call_in_the_xml_form_comes_back_whole_and_streamed(coder):
    prompt = post(coder, "/apply-template", {"messages": shots(), "tools": TOOLS}).json()
    assert ("<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n<parameter=days>"
            "\n3\n</parameter>") in prompt["prompt"]
    r = post(coder, "/v1/chat/completions", _body(tool_choice="required"))
    assert r.status_code == 200, r.text
    answer = r.json()["choices"][0]
    assert answer["finish_reason"] == "tool_calls" and not answer["message"]["content"], answer
    call = answer["message"]["tool_calls"][0]["function"]
    assert call["name"] == "get_weather"
    _, deltas = _streamed(coder, tool_choice="required")
    assert _arguments(deltas) == json.loads(call["arguments"])
    assert len(deltas) > 5  # (as the model wrote them: the city's raw text among them)


def test_a_schema_the_form_cannot_hold_is_refused_forced_and_left_free_under_auto(coder):
    """A parameters schema that says more of the whole object than each value (an anyOf of
    objects here) cannot be held in the XML form: a forced call is a 400 naming it, not one
    that breaks the schema; under auto the call is left free."""
    either = {"type": "function", "function": {"name": "pick", "parameters": {
        "type": "object", "anyOf": [{"required": ["a"]}, {"required": ["b"]}],
        "properties": {"a": {"type": "string"}, "b": {"type": "string"}}}}}
    body = {"messages": [{"role": "user", "content": "Hi"}], "tools": [either], "max_tokens": 1}
    r = post(coder, "/v1/chat/completions", {**body, "tool_choice": "required"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "tools", r.text
    assert "'anyOf'" in r.json()["error"]["message"]
    assert post(coder, "/v1/chat/completions", body).status_code == 200


def test_the_xml_grammar_spells_the_form_and_keeps_a_raw_value_from_its_closing_tag():
    def json_grammar(schema: dict) -> str:
        return f'root ::= "{schema["type"]}" space\nspace ::= " "?'

    gbnf = xml_call_grammar("qwen3_coder", [("get_weather", TRIP), ("noop", None)],
                            json_grammar, parallel=True)
    lines = gbnf.splitlines()
    assert lines[:2] == [
        'root ::= " "? justllm-xml-call ("\\n" justllm-xml-call)*',
        'justllm-xml-call ::= "<tool_call>\\n" ("<function=get_weather>\\n" '
        '("<parameter=city>\\n" justllm-xml-0-0-text-0 "\\n</parameter>\\n") '
        '("<parameter=days>\\n" justllm-xml-0-1-root "\\n</parameter>\\n") "</function>\\n" | '
        '"<function=noop>\\n"  "</function>\\n") "</tool_call>"']
    assert 'justllm-xml-0-1-root ::= "integer" justllm-xml-0-1-space' in lines
    glm = xml_call_grammar("glm", [("f", {"type": "object", "properties": {
        "u": {"enum": ["a", "b"]}}})], json_grammar, parallel=False, compact=True)
    assert glm.splitlines()[:2] == [
        'root ::= " "? justllm-xml-call',
        'justllm-xml-call ::= "<tool_call>" ("f" ("<arg_key>u</arg_key><arg_value>" '
        '("a" | "b") "</arg_value>")?) "</tool_call>"']
    # a required parameter the schema does not name is written too, its value as its
    # additionalProperties say
    extra = xml_call_grammar("glm", [("f", {"type": "object", "required": ["k"],
                                            "additionalProperties": {"type": "integer"}})],
                             json_grammar, parallel=False)
    assert '("<arg_key>k</arg_key>\\n<arg_value>" justllm-xml-0-0-root' in extra
    assert unheld_keyword("glm", {"type": "object", "minProperties": 1}) == "'minProperties'"
    assert unheld_keyword("qwen3_coder", {"properties": {"a>b": {}}}) == "the parameter name 'a>b'"
    assert unheld_keyword("qwen3_coder", TRIP) is None
    # each state of "</ab>" matched so far: the next character goes on, starts over at a
    # "<", or breaks the match; the whole of it never comes
    assert text_without("t", "</ab>") == [
        't-0 ::= ([^<] t-0 | "<" t-1)?',
        't-1 ::= ([^</] t-0 | "<" t-1 | "/" t-2)?',
        't-2 ::= ([^<a] t-0 | "<" t-1 | "a" t-3)?',
        't-3 ::= ([^<b] t-0 | "<" t-1 | "b" t-4)?',
        't-4 ::= ([^<>] t-0 | "<" t-1)?']


def test_the_new_families_lazy_triggers_and_kimis_call_head():
    """Under ``auto`` the grammar takes hold at the call's marker (the server path of
    ``auto`` is hermes', tested in test_tools.py)."""
    for fmt in ("qwen3_coder", "glm"):
        assert call_triggers(fmt, parallel=True) == (r"(<tool_call>)",)
    assert call_triggers("kimi_k2", True) == (r"(<\|tool_calls_section_begin\|>)",)
    assert call_triggers("deepseek_v3_1", True) == ("(<｜tool▁calls▁begin｜>)",)
    kimi = section_calls_grammar("kimi_k2", [("f", 'root ::= "{}"')], parallel=True)
    assert kimi.splitlines()[:2] == [
        'root ::= " "? "<|tool_calls_section_begin|>" justllm-tool-call+ '
        '"<|tool_calls_section_end|>"',
        'justllm-tool-call ::= "<|tool_call_begin|>" ("functions.f:" [0-9] [0-9]? '
        '"<|tool_call_argument_begin|>" justllm-tool-call-0-root) "<|tool_call_end|>"']
