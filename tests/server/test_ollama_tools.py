"""Tool calling on Ollama's ``/api/chat`` through the real ``ollama`` client (and raw httpx for
justllm's ``tool_choice`` extension, which the client cannot send) against a real server on
the demo model: a base model, so a call it must make is forced with a named or required
``tool_choice`` (the grammar of ``/v1/chat/completions``), and ``auto`` is checked for a valid
answer only. The history's translation is checked with no model at all."""

from __future__ import annotations

import json

import httpx
import jsonschema
import msgspec
import ollama
import pytest

from justllm.errors import InvalidRequestError
from justllm.server.ollama_chat import OllamaMessage, chat_messages
from tests.gateway.test_gateway import RUNNER_FLAGS, start_gateway, stop, wait_gone
from tests.server.test_ollama import ollama_error
from tests.server.test_tools import SCHEMAS, TOOLS

ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
CALL = {"function": {"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}}


@pytest.fixture(scope="module")
def client(server):
    return ollama.Client(host=server.url, timeout=120)


def chat(server, **body) -> httpx.Response:
    body = {"model": server.model, "messages": ASK, "tools": TOOLS, "stream": False,
            "options": {"temperature": 0, "num_predict": 48}, **body}
    return httpx.post(server.url + "/api/chat", json=body, timeout=120)


def assert_valid_call(call) -> dict:
    args = call.function.arguments
    assert isinstance(args, dict)
    jsonschema.validate(args, SCHEMAS[call.function.name])
    return args


# ---- the history, with no model -----------------------------------------------------------

def messages(*raw: dict) -> list[OllamaMessage]:
    return msgspec.convert(list(raw), list[OllamaMessage])


def test_a_tool_message_answers_the_oldest_open_call_of_its_tool():
    add = {"function": {"name": "add", "arguments": {"a": 1, "b": 2}}}
    out = chat_messages(messages(
        ASK[0], {"role": "assistant", "tool_calls": [CALL, add]},
        {"role": "tool", "content": "3", "tool_name": "add"},
        {"role": "tool", "content": "sunny"},
        {"role": "assistant", "tool_calls": [{**CALL, "id": "call_x"}]},
        {"role": "tool", "content": "rain", "tool_call_id": "call_x"}), "m")
    calls = out[1].tool_calls or []
    assert [c.function.name for c in calls] == ["get_weather", "add"]
    assert json.loads(calls[0].function.arguments) == CALL["function"]["arguments"]
    assert [(m.tool_call_id, m.name) for m in out[2:4]] == [
        (calls[1].id, "add"), (calls[0].id, "get_weather")]
    assert all(len(c.id) == 9 and c.id.isalnum() for c in calls)  # as Mistral templates want
    assert (out[5].tool_call_id, out[5].name) == ("call_x", "get_weather")
    # The same history, the same ids (the same prompt, so its prefix is cached).
    assert chat_messages(messages(ASK[0], {"role": "assistant", "tool_calls": [CALL]}), "m"
                         )[1].tool_calls == out[1].tool_calls[:1]


@pytest.mark.parametrize(("raw", "param"), [
    ({"role": "user", "content": "x", "tool_calls": [CALL]}, "messages[0].tool_calls"),
    ({"role": "user", "content": "x", "tool_name": "add"}, "messages[0].tool_name"),
    ({"role": "assistant", "content": "x", "tool_call_id": "c"}, "messages[0].tool_call_id"),
])
def test_tool_fields_on_the_wrong_role_are_refused(raw, param):
    with pytest.raises(InvalidRequestError) as e:
        chat_messages(messages(raw), "m")
    assert e.value.param == param


# ---- the served answer --------------------------------------------------------------------

def test_a_forced_call_comes_back_with_arguments_as_an_object(server):
    r = chat(server, tool_choice={"type": "function", "function": {"name": "get_weather"}})
    assert r.status_code == 200, r.text
    raw = r.json()
    assert isinstance(raw["message"]["tool_calls"][0]["function"]["arguments"], dict)
    answer = ollama.ChatResponse.model_validate(raw)
    assert answer.done is True and answer.done_reason == "stop"
    assert answer.message.role == "assistant" and answer.message.content == ""
    calls = answer.message.tool_calls or []
    assert calls and all(c.function.name == "get_weather" for c in calls)
    for call in calls:
        assert_valid_call(call)
    assert answer.prompt_eval_count > 10 and answer.eval_count > 5
    assert answer.total_duration > 0 and answer.load_duration == 0
    assert 0 < answer.prompt_eval_duration and 0 < answer.eval_duration
    assert answer.prompt_eval_duration + answer.eval_duration <= answer.total_duration


def test_a_call_cut_off_by_num_predict_keeps_what_is_complete_of_its_arguments(server):
    forced = {"type": "function", "function": {"name": "get_weather"}}
    whole = chat(server, tool_choice=forced).json()
    args = whole["message"]["tool_calls"][0]["function"]["arguments"]
    assert list(args) == ["city", "unit"], whole
    for limit in range(whole["eval_count"] - 1, 3, -1):  # until the unit is cut off
        answers, reasons = [], []
        for stream in (False, True):
            r = chat(server, tool_choice=forced, stream=stream, options={
                "temperature": 0, "num_predict": limit})
            last = [json.loads(x) for x in r.text.splitlines()] if stream else [r.json()]
            calls = [c for x in last for c in x["message"].get("tool_calls") or []]
            assert len(calls) == 1, r.text
            answers.append(calls[0]["function"]["arguments"])
            reasons.append(last[-1]["done_reason"])
        if reasons == ["length", "length"] and "unit" not in answers[0]:
            break
    # (an object: what is complete of it, the city unless that was cut off too; the same
    # streamed)
    assert reasons == ["length", "length"], reasons
    assert answers[0] == answers[1] and set(answers[0]) <= {"city"}, answers


def test_a_forced_call_streams_as_one_line_per_call_then_done(server):
    body = {"model": server.model, "messages": ASK, "tools": TOOLS, "tool_choice": "required",
            "options": {"temperature": 0, "num_predict": 48}}
    with httpx.stream("POST", server.url + "/api/chat", json=body, timeout=120) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("application/x-ndjson")
        lines = [ollama.ChatResponse.model_validate_json(x) for x in r.iter_lines() if x]
    *parts, last = lines
    assert last.done is True and last.done_reason == "stop" and last.message.content == ""
    assert not last.message.tool_calls and last.eval_count > 5
    assert 0 < last.prompt_eval_duration and 0 < last.eval_duration < last.total_duration
    assert parts and all(p.done is False for p in parts)
    calls = [c for p in parts for c in p.message.tool_calls or []]
    assert calls and all(p.message.content == "" for p in parts if p.message.tool_calls)
    for call in calls:
        assert_valid_call(call)


def test_auto_through_the_client_gives_a_valid_answer(client, server):
    """A base model rarely calls on its own: whatever it writes, the answer is well formed."""
    options = {"temperature": 0, "num_predict": 16}
    r = client.chat(model=server.model, messages=ASK, tools=TOOLS, options=options)
    assert r.done is True and r.done_reason in ("stop", "length")
    for call in r.message.tool_calls or []:
        assert_valid_call(call)
    parts = list(client.chat(model=server.model, messages=ASK, tools=TOOLS, options=options,
                             stream=True))
    assert parts[-1].done is True and all(not p.done for p in parts[:-1])
    for call in (c for p in parts for c in p.message.tool_calls or []):
        assert_valid_call(call)


def test_a_call_and_its_result_in_the_history_reach_the_prompt(client, server):
    def prompt_tokens(arguments: dict, result: str) -> int:
        history = [*ASK, {"role": "assistant", "content": "", "tool_calls": [
            {"function": {"name": "get_weather", "arguments": arguments}}]},
            {"role": "tool", "content": result, "tool_name": "get_weather"}]
        r = client.chat(model=server.model, messages=history, tools=TOOLS,
                        options={"temperature": 0, "num_predict": 1})
        assert r.done is True
        return r.prompt_eval_count

    args = CALL["function"]["arguments"]
    short = prompt_tokens(args, "sunny")
    # an assistant's null content (an OpenAI-style history) is "", as Ollama reads it (a 400)
    def raw(content: str | None) -> httpx.Response:
        return httpx.post(server.url + "/api/chat", json={
            "model": server.model, "tools": TOOLS, "stream": False,
            "options": {"temperature": 0, "num_predict": 1}, "messages": [
                *ASK, {"role": "assistant", "content": content, "tool_calls": [
                    {"function": {"name": "get_weather", "arguments": args}}]},
                {"role": "tool", "content": "sunny", "tool_name": "get_weather"}]},
            timeout=120)

    nulled, empty = raw(None), raw("")
    assert nulled.status_code == 200, nulled.text
    assert nulled.json()["prompt_eval_count"] == empty.json()["prompt_eval_count"]
    assert prompt_tokens(args, "sunny, 23 degrees, a light breeze from the west") > short
    assert prompt_tokens({**args, "city": "Paris, the capital of France"}, "sunny") > short


def test_a_tool_without_its_type_is_a_function_as_ollama_reads_it(server):
    untyped = [{k: v for k, v in t.items() if k != "type"} for t in TOOLS]  # (it was a 400)
    counts = [chat(server, tools=tools, options={"temperature": 0, "num_predict": 1})
              for tools in (untyped, TOOLS)]
    assert [r.status_code for r in counts] == [200, 200], counts[0].text
    assert counts[0].json()["prompt_eval_count"] == counts[1].json()["prompt_eval_count"]


def test_tool_choice_none_is_the_plain_chat(server):
    r = chat(server, tool_choice="none", options={"temperature": 0, "num_predict": 4})
    assert r.status_code == 200, r.text
    body = r.json()
    assert "tool_calls" not in body["message"] and body["eval_count"] >= 1
    assert body["eval_duration"] >= 0  # the plain path's timings


def test_bad_tool_input_is_a_4xx_in_ollamas_shape(client, server):
    def tool(name: str) -> dict:
        return {"type": "function", "function": {"name": name, "parameters": {
            "type": "object", "properties": {}}}}

    for tools, says in [([tool("bad name!")], "tools[0].function.name"),
                        ([tool("f"), tool("f")], "tools[1].function.name")]:
        ollama_error(lambda t=tools: client.chat(model=server.model, messages=ASK, tools=t),
                     400, says)
    forced = chat(server, format="json", tool_choice="required")  # (justllm's extension)
    assert forced.status_code == 400 and "format" in forced.json()["error"], forced.text
    bad = chat(server, format="yaml")
    assert bad.status_code == 400, bad.text
    assert bad.json()["error"] == "format: invalid value 'yaml'; expected \"json\" or a JSON schema"
    ollama_error(lambda: client.chat(model=server.model, messages=ASK, tools=TOOLS,
                                     logprobs=True), 400, "logprobs")
    ollama_error(lambda: client.chat(model=server.model, tools=TOOLS, messages=[
        {"role": "user", "content": "hi", "tool_calls": [CALL]}]), 400,
        "messages[0].tool_calls")
    named = {"type": "function", "function": {"name": "nope"}}
    for body, says in [({"tool_choice": named}, "nope"),
                       ({"tool_choice": "required", "tools": None}, "tool_choice"),
                       ({"tools": [{"type": "function", "function": {
                           "name": "f", "parameters": {"type": "array"}}}]},
                        "tools[0].function.parameters"),
                       ({"messages": [{"role": "assistant", "tool_calls": [
                           {"function": {"name": "f", "arguments": "{}"}}]}]}, "arguments"),
                       ({"options": {"repeat_last_n": 8}}, "options.repeat_last_n")]:
        r = chat(server, **body)
        assert r.status_code == 400, (body, r.text)
        assert set(r.json()) == {"error"} and says in r.json()["error"], r.json()


def test_format_with_tools_is_a_call_or_an_answer_in_the_format(server):
    """Ollama takes format and tools together (it was a 400): the answer is a valid call, or
    content in the format."""
    answer = {"type": "object", "properties": {"answer": {"type": "string", "maxLength": 30}},
              "required": ["answer"]}
    shots = [m for q, a in (("Say hi.", "Hi!"), ("Say bye.", "Bye!")) for m in (
        {"role": "user", "content": q},
        {"role": "assistant", "content": json.dumps({"answer": a})})]
    r = chat(server, messages=[*shots, {"role": "user", "content": "Say hello."}],
             format=answer)
    assert r.status_code == 200, r.text
    said = r.json()["message"]
    assert "tool_calls" not in said
    jsonschema.validate(json.loads(said["content"]), answer)


def test_a_forced_call_through_the_router(tmp_path, model_path):
    gw = start_gateway(tmp_path, {"alpha": {"source": model_path, "chat-template": "gemma",
                                            **RUNNER_FLAGS}})
    try:
        r = httpx.post(gw.url + "/api/chat", timeout=120, json={
            "model": "alpha:latest", "messages": ASK, "tools": TOOLS, "stream": False,
            "tool_choice": {"type": "function", "function": {"name": "add"}},
            "options": {"temperature": 0, "num_predict": 64}})
        assert r.status_code == 200, r.text
        calls = ollama.ChatResponse.model_validate(r.json()).message.tool_calls or []
        assert calls and all(c.function.name == "add" for c in calls)
        for call in calls:
            assert_valid_call(call)
        pids = gw.runner_pids()
    finally:
        rc, out = stop(gw)
    assert rc == 0, out
    wait_gone(pids)
