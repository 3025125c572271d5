"""gpt-oss's harmony format on every API: the analysis channel is the thinking, the final
channel the answer, a message addressed to ``functions.NAME`` a tool call.

The model is the demo model with a harmony chat template in its GGUF (gpt-oss's shape, cut
down: its turns, channels and calls, a developer message naming the tools). The base model
was not trained on the format, but three answered questions, each with its analysis, make it
answer in the same shape; in the real model's vocabulary ``<|return|>`` and ``<|call|>`` end
generation, here they are text, so they are stop strings. (The tests' model has none of the
format's special tokens: llama.cpp renders gpt-oss's ``<|channel|>``, ``<|message|>``,
``<|start|>`` and ``<|constrain|>`` as text, and leaves ``<|end|>`` out, which the reading
allows for: a body also ends at the next header.)"""

from __future__ import annotations

import json

import anthropic
import httpx
import openai
import pytest

from justllm.core.harmony import HarmonyReader
from tests.server.conftest import template_server
from tests.server.test_reasoning import CHAT  # (three answered questions, their thinking)
from tests.server.test_tokenize import post

TEMPLATE = (
    "{% if tools %}<|start|>developer<|message|># Tools\nnamespace functions {\n"
    "{% for t in tools %}// {{ t.function.description }}\ntype {{ t.function.name }} = "
    "(_: {{ t.function.parameters | tojson }}) => any;\n{% endfor %}}<|end|>{% endif %}"
    "{% for m in messages %}"
    "{% if m.role == 'assistant' %}"
    "{% if m.thinking %}<|start|>assistant<|channel|>analysis<|message|>{{ m.thinking }}"
    "<|end|>{% endif %}"
    "{% if m.tool_calls %}{% for c in m.tool_calls %}<|start|>assistant<|channel|>commentary"
    " to=functions.{{ c.function.name }} <|constrain|>json<|message|>"
    "{{ c.function.arguments | tojson }}<|call|>{% endfor %}"
    "{% else %}<|start|>assistant<|channel|>final<|message|>{{ m.content }}<|end|>{% endif %}"
    "{% elif m.role == 'tool' %}<|start|>functions.lookup to=assistant<|channel|>commentary"
    "<|message|>{{ m.content }}<|end|>"
    "{% else %}<|start|>{{ m.role }}<|message|>{{ m.content }}<|end|>{% endif %}"
    "{% endfor %}{% if add_generation_prompt %}<|start|>assistant{% endif %}")
# (and having answered, the base model goes on with the user's next turn)
GREEDY = {"temperature": 0, "max_tokens": 80, "stop": ["<|return|>", "<|call|>", "<|start|>user"]}
TOOLS = [{"type": "function", "function": {
    "name": "lookup", "description": "Look a city's population up.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                   "required": ["city"]}}}]
# (the same tool, its schema ruling out the Lima the model writes)
ENUM_TOOLS = [{"type": "function", "function": {
    **TOOLS[0]["function"], "parameters": {
        "type": "object", "properties": {"city": {"enum": ["Rome", "Oslo"]}},
        "required": ["city"]}}}]


def _call(i: int, city: str) -> dict:
    return {"id": f"call_{i}", "type": "function",
            "function": {"name": "lookup", "arguments": f'{{"city": "{city}"}}'}}


TOOL_SHOTS = [("Population of Paris?", "Paris", "2.1 million", "About 2.1 million."),
              ("Population of Rome?", "Rome", "2.8 million", "About 2.8 million."),
              ("Population of Oslo?", "Oslo", "0.7 million", "About 0.7 million.")]
TOOL_CHAT = [m for i, (q, city, result, a) in enumerate(TOOL_SHOTS) for m in (
    {"role": "user", "content": q},
    {"role": "assistant", "content": None, "tool_calls": [_call(i, city)],
     "reasoning_content": f"I should look {city} up."},
    {"role": "tool", "tool_call_id": f"call_{i}", "content": result},
    {"role": "assistant", "content": a})] + [{"role": "user", "content": "Population of Lima?"}]


@pytest.fixture(scope="module")
def oss(model_path, tmp_path_factory):
    s = template_server(model_path, tmp_path_factory.mktemp("oss") / "oss.gguf", TEMPLATE,
                        "--max-seqs", "4", "--pool-blocks", "256")
    yield s
    assert s.stop() == 0


def chat(server, **body) -> dict:
    r = post(server, "/v1/chat/completions", {"messages": CHAT, **GREEDY, **body})
    assert r.status_code == 200, r.text
    return r.json()


def written(server, messages: list[dict], tools: list | None = None) -> str:
    """What the model writes to the chat's prompt (greedy, through /v1/completions)."""
    prompt = post(server, "/apply-template", {"messages": messages, "tools": tools}).json()
    r = post(server, "/v1/completions", {"prompt": prompt["prompt"], **GREEDY})
    return r.json()["choices"][0]["text"]


def streamed(server, body: dict) -> list[dict]:
    with httpx.stream("POST", server.url + "/v1/chat/completions",
                      json={**GREEDY, **body, "stream": True}, timeout=60) as r:
        assert r.status_code == 200
        return [json.loads(line[6:])["choices"][0] for line in r.iter_lines()
                if line.startswith("data: {")]


def test_the_analysis_channel_is_the_thinking(oss):
    raw = written(oss, CHAT)
    assert raw.startswith("<|channel|>analysis<|message|>")  # the model took up the format
    reader = HarmonyReader()
    reader.feed(raw)
    reader.finish()
    want = reader.reading
    assert want.thinking and want.content and not want.calls
    message = chat(oss)["choices"][0]["message"]
    assert (message["reasoning_content"], message["content"]) == (want.thinking, want.content)
    deltas = [c["delta"] for c in streamed(oss, {"messages": CHAT})]
    assert "".join(d.get("reasoning_content") or "" for d in deltas) == want.thinking
    assert "".join(d.get("content") or "" for d in deltas) == want.content
    assert not any("<|" in (d.get("content") or "") for d in deltas)
    # left in the text, in its channel's markers (as llama-server writes it)
    kept = chat(oss, reasoning_format="none")["choices"][0]["message"]
    assert kept["content"] == ("<|channel|>analysis<|message|>" + want.thinking + "<|end|>"
                               + want.content)
    assert "reasoning_content" not in kept


def test_a_message_to_a_function_is_a_tool_call(oss):
    raw = written(oss, TOOL_CHAT, TOOLS)
    assert "to=functions.lookup" in raw
    body = {"messages": TOOL_CHAT, "tools": TOOLS}
    choice = chat(oss, **body)["choices"][0]
    assert choice["finish_reason"] == "tool_calls"
    message = choice["message"]
    assert message["reasoning_content"] == "I should look Lima up."
    assert message["content"] is None
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"]))
            for c in message["tool_calls"]] == [("lookup", {"city": "Lima"})]
    chunks = streamed(oss, body)
    calls = [c for ch in chunks for c in ch["delta"].get("tool_calls") or []]
    assert calls[0]["function"]["name"] == "lookup"
    assert "".join(c["function"].get("arguments") or "" for c in calls) == \
        message["tool_calls"][0]["function"]["arguments"]
    assert chunks[-1]["finish_reason"] == "tool_calls"
    # tools the request does not let the model call: the addressed message is no answer
    off = chat(oss, **body, tool_choice="none")["choices"][0]["message"]
    assert "tool_calls" not in off and not off["content"]
    assert off["reasoning_content"] == "I should look Lima up."


def test_an_answer_held_to_a_format_keeps_its_messages(oss):
    """As llama.cpp's gpt-oss grammar holds it: the model thinks in its analysis as it would
    unheld, then the grammar holds the message asked for: a call, or the final message's
    body in the format (the base model, left free, looks Lima up and answers in prose)."""
    free = chat(oss, messages=TOOL_CHAT, tools=TOOLS)["choices"][0]["message"]
    for choice in ("required", {"type": "function", "function": {"name": "lookup"}}):
        forced = chat(oss, messages=TOOL_CHAT, tools=ENUM_TOOLS,
                      tool_choice=choice)["choices"][0]
        assert forced["finish_reason"] == "tool_calls", choice
        assert forced["message"]["reasoning_content"] == free["reasoning_content"]
        call = forced["message"]["tool_calls"][0]["function"]
        assert call["name"] == "lookup" and json.loads(call["arguments"]) in (
            {"city": "Rome"}, {"city": "Oslo"})
    want = chat(oss)["choices"][0]["message"]
    schema = {"type": "object", "properties": {"colour": {"enum": ["red", "green"]}},
              "required": ["colour"]}
    fmt = {"type": "json_schema", "json_schema": {"name": "c", "schema": schema}}
    held = chat(oss, response_format=fmt)["choices"][0]
    assert held["finish_reason"] == "stop"
    assert held["message"]["reasoning_content"] == want["reasoning_content"]
    assert json.loads(held["message"]["content"])["colour"] in ("red", "green")
    kept = chat(oss, response_format=fmt, reasoning_format="none")["choices"][0]["message"]
    thinking = "<|channel|>analysis<|message|>" + want["reasoning_content"] + "<|end|>"
    assert kept["content"] == thinking + held["message"]["content"]
    picked = chat(oss, guided_choice=["yes", "no"])["choices"][0]["message"]
    assert picked["content"] in ("yes", "no") and picked["reasoning_content"]
    # a call or an answer in the format (tools beside a response format): this model calls
    either = chat(oss, messages=TOOL_CHAT, tools=TOOLS,
                  response_format={"type": "json_object"})["choices"][0]
    assert either["finish_reason"] == "tool_calls"
    assert either["message"]["reasoning_content"] == free["reasoning_content"]


def test_ollamas_format_holds_the_final_message_too(oss):
    """Ollama's plain chat path (no tools) holds a gpt-oss answer as the other APIs do: the
    analysis free, the final message's body in the format."""
    want = chat(oss)["choices"][0]["message"]
    history = [{"role": m["role"], "content": m["content"],
                **({"thinking": m["reasoning_content"]} if "reasoning_content" in m else {})}
               for m in CHAT]
    schema = {"type": "object", "properties": {"colour": {"enum": ["red", "green"]}},
              "required": ["colour"]}
    r = post(oss, "/api/chat", {"model": oss.model, "stream": False, "messages": history,
                                "format": schema, "options": {
                                    "temperature": 0, "num_predict": 80,
                                    "stop": GREEDY["stop"], "repeat_penalty": 1.0}})
    said = r.json()["message"]
    assert said["thinking"] == want["reasoning_content"]
    assert json.loads(said["content"])["colour"] in ("red", "green")


def test_a_call_is_held_to_its_schema_and_streams_as_written(oss):
    """Under tool_choice "auto" the grammar takes hold at the message to a function (the
    model would write Lima; the schema allows Rome or Oslo), and the call streams: it opens
    at its recipient, its arguments come a token's worth at a time; cut off inside them, the
    call stands as far as it came, streamed and whole alike."""
    body = {"messages": TOOL_CHAT, "tools": ENUM_TOOLS, "cache_prompt": False}
    r = post(oss, "/v1/chat/completions", {**GREEDY, **body})
    whole = r.json()
    call = whole["choices"][0]["message"]["tool_calls"][0]["function"]
    assert json.loads(call["arguments"]) in ({"city": "Rome"}, {"city": "Oslo"})
    chunks = streamed(oss, body)
    calls = [c for ch in chunks for c in ch["delta"].get("tool_calls") or []]
    assert calls[0]["function"]["name"] == "lookup"
    pieces = [c["function"].get("arguments") for c in calls if c["function"].get("arguments")]
    assert len(pieces) > 3 and "".join(pieces) == call["arguments"]
    # (a thinking budget counts the analysis; the grammar still takes hold at the call)
    budgeted = chat(oss, **body, reasoning_budget_tokens=100)["choices"][0]["message"]
    assert budgeted["tool_calls"][0]["function"]["arguments"] == call["arguments"]
    n = whole["usage"]["completion_tokens"]
    for limit in (n - 4, n - 2):  # (inside the arguments: they take 7 tokens)
        cut = post(oss, "/v1/chat/completions", {**GREEDY, **body, "max_tokens": limit})
        choice = cut.json()["choices"][0]
        assert choice["finish_reason"] == "length", limit
        args = choice["message"]["tool_calls"][0]["function"]["arguments"]
        assert call["arguments"].startswith(args) and args != call["arguments"]
        chunks = streamed(oss, {**body, "max_tokens": limit})
        assert chunks[-1]["finish_reason"] == "length"
        assert "".join(c["function"].get("arguments") or "" for ch in chunks
                       for c in ch["delta"].get("tool_calls") or []) == args


def test_the_history_goes_back_in_its_channels(oss):
    prompt = post(oss, "/apply-template", {"messages": CHAT}).json()["prompt"]
    assert ("<|start|>assistant<|channel|>analysis<|message|>The sky is blue on a clear day."
            "<|end|><|start|>assistant<|channel|>final<|message|>Blue.<|end|>") in prompt
    tools = post(oss, "/apply-template", {"messages": TOOL_CHAT, "tools": TOOLS}).json()
    assert ("<|channel|>analysis<|message|>I should look Rome up.<|end|><|start|>assistant"
            "<|channel|>commentary to=functions.lookup") in tools["prompt"]


def test_a_thinking_budget_ends_the_analysis(oss):
    free = chat(oss)["choices"][0]["message"]
    spent = chat(oss, reasoning_budget_tokens=2)["choices"][0]["message"]
    assert spent["reasoning_content"] and spent["content"]
    assert free["reasoning_content"].startswith(spent["reasoning_content"])
    assert len(spent["reasoning_content"]) < len(free["reasoning_content"])
    raw = chat(oss, reasoning_budget_tokens=2, reasoning_format="none",
               reasoning_budget_message=" Enough.")["choices"][0]["message"]["content"]
    # (the message right before the analysis's end, then the final channel's header)
    assert raw.startswith("<|channel|>analysis<|message|>" + spent["reasoning_content"]
                          + " Enough.<|end|>")
    none = chat(oss, reasoning_budget_tokens=0)["choices"][0]["message"]
    assert "reasoning_content" not in none and none["content"]


def test_switches_a_harmony_model_does_not_have(oss):
    r = post(oss, "/v1/chat/completions", {"messages": CHAT, "reasoning_effort": "none"})
    assert r.status_code == 400 and "switch its thinking off" in r.json()["error"]["message"]


def test_anthropic_streams_a_held_calls_input(oss):
    """``eager_input_streaming``: a held call's input comes as it is written (it was a 400
    here while gpt-oss's calls came whole)."""
    tool = {"name": "lookup", "description": "Look a city's population up.",
            "input_schema": ENUM_TOOLS[0]["function"]["parameters"],
            "eager_input_streaming": True}
    client = anthropic.Anthropic(base_url=oss.url, api_key="unused", max_retries=0)
    history: list[dict] = []
    for q, city, result, a in TOOL_SHOTS:
        history += [
            {"role": "user", "content": q},
            {"role": "assistant", "content": [
                {"type": "thinking", "thinking": f"I should look {city} up.", "signature": ""},
                {"type": "tool_use", "id": city, "name": "lookup", "input": {"city": city}}]},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": city,
                                          "content": result}]},
            {"role": "assistant", "content": a}]
    with client.messages.stream(
            model=oss.model, max_tokens=2000, stop_sequences=GREEDY["stop"], tools=[tool],
            thinking={"type": "enabled", "budget_tokens": 1024}, extra_body={"temperature": 0},
            messages=[*history, {"role": "user", "content": "Population of Lima?"}]) as stream:
        pieces = [e.delta.partial_json for e in stream if e.type == "content_block_delta"
                  and e.delta.type == "input_json_delta"]
        message = stream.get_final_message()
    use = [b for b in message.content if b.type == "tool_use"]
    assert use, message
    assert use[0].name == "lookup" and use[0].input in ({"city": "Rome"}, {"city": "Oslo"})
    assert len(pieces) > 3 and json.loads("".join(pieces)) == use[0].input
    assert message.stop_reason == "tool_use"


def test_ollama_anthropic_and_responses_read_the_channels(oss):
    want = chat(oss)["choices"][0]["message"]
    history = [{"role": m["role"], "content": m["content"],
                **({"thinking": m["reasoning_content"]} if "reasoning_content" in m else {})}
               for m in CHAT]
    r = post(oss, "/api/chat", {"model": oss.model, "stream": False, "messages": history,
                                "options": {"temperature": 0, "num_predict": 80,
                                            "stop": GREEDY["stop"],
                                            # (Ollama's default is 1.1: the chat's has none)
                                            "repeat_penalty": 1.0}})
    said = r.json()["message"]
    assert (said["thinking"], said["content"]) == (want["reasoning_content"], want["content"])
    show = post(oss, "/api/show", {"model": oss.model}).json()
    assert "thinking" in show["capabilities"]
    client = anthropic.Anthropic(base_url=oss.url, api_key="unused", max_retries=0)
    message = client.messages.create(
        model=oss.model, max_tokens=2000, stop_sequences=GREEDY["stop"],
        thinking={"type": "enabled", "budget_tokens": 1024}, extra_body={"temperature": 0},
        messages=[{"role": m["role"], "content": (
            [{"type": "thinking", "thinking": m["reasoning_content"], "signature": ""},
             {"type": "text", "text": m["content"]}] if "reasoning_content" in m
            else m["content"])} for m in CHAT])
    assert [b.type for b in message.content] == ["thinking", "text"]
    assert message.content[0].thinking == want["reasoning_content"]
    assert message.content[1].text == want["content"]
    client = openai.OpenAI(base_url=oss.url + "/v1", api_key="unused", max_retries=0)
    resp = client.responses.create(
        model=oss.model, temperature=0, max_output_tokens=80,
        input=[item for m in CHAT for item in (
            [{"type": "reasoning", "summary": [], "content": [
                {"type": "reasoning_text", "text": m["reasoning_content"]}]},
             {"role": "assistant", "content": m["content"]}] if "reasoning_content" in m
            else [{"role": "user", "content": m["content"]}])])
    assert [o.type for o in resp.output] == ["reasoning", "message"]
    assert resp.output[0].content[0].text == want["reasoning_content"]
    # (no stop strings on this API: the base model goes on past its answer, into text that
    # the reading ends at, another role's turn)
    assert resp.output[1].content[0].text == want["content"]
