"""Mistral's newer call form, ``[TOOL_CALLS]name[ARGS]{arguments}`` (Mistral Small 3.2,
Magistral, Devstral: a template that writes ``[ARGS]``), held by a grammar that spells it: a
forced call, and under ``tool_choice: "auto"`` the lazy grammar from ``[TOOL_CALLS]`` on, the
call then streamed as it is written. The demo model with such a template in its GGUF copies
the calls of its history (a city the tool's enum does not offer: the grammar's work shows)."""

from __future__ import annotations

import json

import httpx
import pytest

from justllm.server.tools.grammar import named_args_grammar
from tests.server.conftest import template_server
from tests.server.test_tokenize import post

TEMPLATE = (
    "{{ bos_token }}{% if tools %}[AVAILABLE_TOOLS]{{ tools | tojson }}[/AVAILABLE_TOOLS]"
    "{% endif %}{% for m in messages %}"
    "{% if m.role == 'user' %}[INST]{{ m.content }}[/INST]"
    "{% elif m.role == 'assistant' and m.tool_calls %}{% for c in m.tool_calls %}"
    "[TOOL_CALLS]{{ c.function.name }}[ARGS]{{ c.function.arguments | tojson }}{% endfor %}"
    "{{ eos_token }}{% elif m.role == 'assistant' %}{{ m.content }}{{ eos_token }}"
    "{% elif m.role == 'tool' %}[TOOL_RESULTS]{{ m.content }}[/TOOL_RESULTS]{% endif %}"
    "{% endfor %}")
CITIES = {"type": "object", "properties": {"city": {"type": "string", "enum": ["Rome", "Oslo"]}},
          "required": ["city"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": CITIES}},
         {"type": "function", "function": {"name": "add", "parameters": {
             "type": "object", "properties": {"a": {"type": "integer"}}}}}]


def shots() -> list[dict]:
    out: list[dict] = []
    for k in range(3):
        out += [{"role": "user", "content": "What is the weather in Paris?"},
                {"role": "assistant", "content": None, "tool_calls": [{
                    "id": f"abcdefgh{k}", "type": "function", "function": {
                        "name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
                {"role": "tool", "tool_call_id": f"abcdefgh{k}", "content": "sunny"},
                {"role": "assistant", "content": "Sunny."}]
    return [*out, {"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module")
def mistral(model_path, tmp_path_factory):
    s = template_server(model_path, tmp_path_factory.mktemp("mistral") / "m.gguf", TEMPLATE)
    yield s
    assert s.stop() == 0


def chat(server, **body) -> dict:
    # (one call: the base model goes on with another where the history's tool result stood)
    r = post(server, "/v1/chat/completions", {"messages": shots(), "temperature": 0,
                                              "max_tokens": 40, "parallel_tool_calls": False,
                                              **body})
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]


def test_the_template_writes_the_form_the_model_copies(mistral):
    prompt = post(mistral, "/apply-template", {"messages": shots(), "tools": TOOLS}).json()
    assert '[TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}' in prompt["prompt"]
    free = chat(mistral, tools=TOOLS, tool_choice="none")["message"]["content"]  # (free)
    assert free == '[TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}', free


@pytest.mark.parametrize("choice", ["auto", "required",
                                    {"type": "function", "function": {"name": "get_weather"}}])
def test_a_call_in_the_named_form_is_held_to_its_schema(mistral, choice):
    answer = chat(mistral, tools=TOOLS, tool_choice=choice)
    assert answer["finish_reason"] == "tool_calls", answer
    call = answer["message"]["tool_calls"][0]
    assert call["function"]["name"] == "get_weather" and len(call["id"]) == 9
    assert json.loads(call["function"]["arguments"])["city"] in ("Rome", "Oslo")


def test_an_auto_call_streams_as_it_is_written(mistral):
    whole = chat(mistral, tools=TOOLS)["message"]["tool_calls"][0]["function"]["arguments"]
    body = {"messages": shots(), "tools": TOOLS, "temperature": 0, "max_tokens": 40,
            "parallel_tool_calls": False, "stream": True}
    with httpx.stream("POST", mistral.url + "/v1/chat/completions", json=body,
                      timeout=120) as r:
        chunks = [json.loads(x[6:]) for x in r.iter_lines() if x.startswith("data: {")]
    deltas = [d for c in chunks for d in c["choices"][0]["delta"].get("tool_calls") or []]
    assert deltas[0]["function"] == {"name": "get_weather", "arguments": ""}
    pieces = [d["function"]["arguments"] for d in deltas[1:]]
    assert "".join(pieces) == whole and len(pieces) > 3
    assert not any(c["choices"][0]["delta"].get("content") for c in chunks)


def test_the_named_form_grammar_keeps_each_schemas_rules_apart():
    one = 'root ::= "{" space "}"\nspace ::= " "?'
    gbnf = named_args_grammar([("f", one), ("g-2", one)], parallel=True)
    assert gbnf.splitlines()[:2] == [
        'root ::= " "? justllm-tool-call+',
        'justllm-tool-call ::= "[TOOL_CALLS]" ("f[ARGS]" justllm-tool-call-0-root | '
        '"g-2[ARGS]" justllm-tool-call-1-root)']
    assert "justllm-tool-call-1-space ::= \" \"?" in gbnf
    assert named_args_grammar([("f", one)], parallel=False).startswith(
        'root ::= " "? justllm-tool-call\n')
