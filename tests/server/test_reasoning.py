"""Reasoning models on every API: the thinking taken apart from the answer (OpenAI's
``reasoning_content``, Ollama's ``thinking``, Anthropic's thinking blocks, the Responses API's
reasoning items), switched off, held to a budget, and sent back in a conversation.

The model is the demo model with a Qwen3-style chat template in its GGUF (it thinks between
``<think>`` tags, its generation prompt opens the thinking unless ``enable_thinking`` is false).
The base model was not trained to think, but a conversation of three answered questions,
each with its thinking, makes it think and then answer in the same shape. The server runs
without its prefix cache, so a greedy answer to the same prompt is the same every time."""

from __future__ import annotations

import base64
import json

import anthropic
import httpx
import openai
import pytest

from justllm.core.reasoning import split_reasoning
from tests.server.conftest import start_server, template_server
from tests.server.test_tokenize import post

TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m.role }}\n"
    "{% if m.role == 'assistant' and m.reasoning_content %}"
    "<think>\n{{ m.reasoning_content }}\n</think>\n\n{% endif %}"
    "{{ m.content }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n"
    "{% if enable_thinking is defined and not enable_thinking %}<think>\n\n</think>\n\n"
    "{% else %}<think>\n{% endif %}{% endif %}")
THINK = ("<think>", "</think>")
SHOTS = [("What is 2+2?", "The user asks a sum. 2+2 is 4.", "4"),
         ("What colour is the sky?", "The sky is blue on a clear day.", "Blue."),
         ("Capital of France?", "France's capital is Paris.", "Paris.")]
ASK = "Capital of Italy?"
CHAT = [m for q, r, a in SHOTS for m in (
    {"role": "user", "content": q},
    {"role": "assistant", "content": a, "reasoning_content": r})] + \
    [{"role": "user", "content": ASK}]
# (the base model writes the turn's end as text: it is a stop string here)
GREEDY = {"temperature": 0, "max_tokens": 40, "stop": ["<|im_end|>"]}


@pytest.fixture(scope="module")
def thinker(model_path, tmp_path_factory):
    s = template_server(model_path, tmp_path_factory.mktemp("think") / "think.gguf",
                        TEMPLATE, "--max-seqs", "4", "--pool-blocks", "256")
    yield s
    assert s.stop() == 0


def chat(server, **body) -> dict:
    r = post(server, "/v1/chat/completions", {"messages": CHAT, **GREEDY, **body})
    assert r.status_code == 200, r.text
    return r.json()


def refused(server, path: str, body: dict, param: str) -> str:
    r = post(server, path, body)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param, r.text
    return r.json()["error"]["message"]


def raw_answer(server, **body) -> str:
    """The answer as the model wrote it (the thinking left in the text)."""
    return chat(server, reasoning_format="none", **body)["choices"][0]["message"]["content"]


def sse_chunks(server, path: str, body: dict) -> list[dict]:
    with httpx.stream("POST", server.url + path, json={**body, "stream": True},
                      timeout=60) as r:
        assert r.status_code == 200
        return [json.loads(line[6:]) for line in r.iter_lines()
                if line.startswith("data: {")]


# ---- OpenAI chat completions ---------------------------------------------------------------

def test_the_thinking_comes_apart_from_the_answer_whole_and_streamed(thinker):
    raw = raw_answer(thinker)
    want = split_reasoning(raw, THINK, opened=True)  # the prompt opened the thinking
    assert want.reasoning and want.content and "</think>" in raw  # it thought, then answered
    whole = chat(thinker)
    message = whole["choices"][0]["message"]
    assert (message["reasoning_content"], message["content"]) == (want.reasoning, want.content)
    # OpenAI's count of them: the thinking's text in tokens
    thought = post(thinker, "/tokenize", {"prompt": want.reasoning, "add_special_tokens": False})
    details = whole["usage"]["completion_tokens_details"]
    assert details == {"reasoning_tokens": thought.json()["count"]}
    assert "completion_tokens_details" not in chat(thinker, reasoning_format="none")["usage"]
    chunks = sse_chunks(thinker, "/v1/chat/completions", {
        "messages": CHAT, **GREEDY, "stream_options": {"include_usage": True}})
    assert chunks[-1]["usage"]["completion_tokens_details"] == details
    deltas = [c["choices"][0]["delta"] for c in chunks if c["choices"]]
    thought = "".join(d.get("reasoning_content") or "" for d in deltas)
    text = "".join(d.get("content") or "" for d in deltas)
    assert (thought, text) == (want.reasoning, want.content)
    kinds = [("r" if d.get("reasoning_content") else "c") for d in deltas
             if d.get("reasoning_content") or d.get("content")]
    assert kinds == sorted(kinds, reverse=True)  # all thinking first, never both in a chunk
    assert not any(d.get("reasoning_content") and d.get("content") for d in deltas)


def test_thinking_switched_off(thinker):
    off = {"chat_template_kwargs": {"enable_thinking": False}}
    prompt = post(thinker, "/apply-template", {"messages": CHAT, **off}).json()["prompt"]
    assert prompt.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    message = chat(thinker, **off)["choices"][0]["message"]
    assert "reasoning_content" not in message  # the answer does not open a thinking
    assert chat(thinker, reasoning_effort="none")["choices"][0]["message"] == message
    assert "cannot take a reasoning effort" in refused(
        thinker, "/v1/chat/completions", {"messages": CHAT, "reasoning_effort": "low"},
        "reasoning_effort")


def test_a_thinking_budget_forces_the_end_of_the_thinking(thinker):
    free = chat(thinker, reasoning_format="none", logprobs=True)["choices"][0]
    first = "".join(t["token"] for t in free["logprobs"]["content"][:2])
    raw = raw_answer(thinker, reasoning_budget_tokens=2)
    # (the text holds the whole thinking, the start tag the prompt ended with included, as
    # llama-server writes it) two tokens of thinking, then the end
    assert raw.startswith("<think>\n" + first + "\n</think>\n\n")
    message = chat(thinker, thinking_budget_tokens=2)["choices"][0]["message"]
    assert message["reasoning_content"] == first.strip() and message["content"]
    assert "reasoning_content" not in chat(thinker, reasoning_budget_tokens=0)[
        "choices"][0]["message"]  # none at all
    # llama-server's reasoning_budget_message: forced right before the end tag
    raw = raw_answer(thinker, reasoning_budget_tokens=2,
                     reasoning_budget_message=" Enough thinking.")
    assert raw.startswith("<think>\n" + first + " Enough thinking.\n</think>\n\n")
    message = chat(thinker, reasoning_budget_tokens=2,
                   reasoning_budget_message=" Enough thinking.")["choices"][0]["message"]
    assert message["reasoning_content"] == (first + " Enough thinking.").strip()
    assert message["content"]


def test_the_servers_reasoning_flags(model_path, thinker, tmp_path):
    s = template_server(model_path, tmp_path / "think.gguf", TEMPLATE, "--max-seqs", "2",
                        "--pool-blocks", "128", "--reasoning-budget", "0",
                        "--reasoning-format", "none", "--reasoning-budget-message", "Skip.")
    try:
        raw = chat(s)["choices"][0]["message"]["content"]  # the thinking left in the text
        assert raw.startswith("<think>\nSkip.\n</think>\n\n")  # and ended at once
        assert raw == raw_answer(thinker, reasoning_budget_tokens=0,
                                 reasoning_budget_message="Skip.")
        assert chat(s, reasoning_budget_message="")["choices"][0]["message"][
            "content"] == raw_answer(thinker, reasoning_budget_tokens=0)  # a request's own
        message = chat(s, reasoning_format="auto", reasoning_budget_tokens=-1)[
            "choices"][0]["message"]  # a request chooses for itself
        assert message == chat(thinker)["choices"][0]["message"]
        said = ollama(s, "/api/chat", messages=OLLAMA_CHAT)["message"]  # Ollama's too
        assert "thinking" not in said and said["content"].startswith("Skip.\n</think>\n\n")
        assert "have no effect here" not in s.output()
    finally:
        assert s.stop() == 0
    # on a model that does not think the flags mean nothing: said so at load, not silently
    plain = start_server(model_path, "--max-seqs", "1", "--pool-blocks", "32",
                         "--reasoning-budget", "5")
    try:
        assert "--reasoning-budget and --reasoning-budget-message have no effect here: this " \
               "model does not think" in plain.output()
    finally:
        assert plain.stop() == 0


def test_an_answer_held_to_a_format_does_not_think(thinker):
    message = chat(thinker, response_format={"type": "json_object"}, max_tokens=12)[
        "choices"][0]["message"]
    assert "reasoning_content" not in message and message["content"].lstrip().startswith("{")
    json_body = {"messages": CHAT, "response_format": {"type": "json_object"}}
    refused(thinker, "/v1/chat/completions", {**json_body, "reasoning_budget_tokens": 5},
            "reasoning_budget_tokens")
    assert "cannot hold its thinking" in refused(
        thinker, "/v1/chat/completions",
        {**json_body, "chat_template_kwargs": {"enable_thinking": True}}, "chat_template_kwargs")


def test_a_constraint_on_a_model_that_cannot_stop_thinking_names_each_apis_field(
        model_path, thinker, tmp_path):
    """A template that always opens the thinking (DeepSeek-R1's: no enable_thinking): each
    API's 400 named chat_template_kwargs and told the client to send it, which none of them
    has and which the template ignores; it names the request's own constraint now."""
    always = TEMPLATE.replace("{% if enable_thinking is defined and not enable_thinking %}"
                              "<think>\n\n</think>\n\n{% else %}<think>\n{% endif %}",
                              "<think>\n")
    s = template_server(model_path, tmp_path / "always.gguf", always, "--max-seqs", "2",
                        "--pool-blocks", "64")
    try:
        json_object = {"type": "json_object"}
        tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
        for path, body, param in (
                ("/v1/chat/completions", {"messages": CHAT, "response_format": json_object},
                 "response_format"),
                ("/v1/chat/completions", {"messages": CHAT, "tools": [tool],
                                          "tool_choice": "required"}, "tool_choice"),
                ("/v1/chat/completions", {"messages": CHAT, "guided_regex": "[ab]+"},
                 "guided_regex"),
                ("/v1/responses", {"input": ASK, "text": {"format": json_object}},
                 "text.format")):
            said = refused(s, path, {"model": s.model, **body}, param)
            assert "no switch" in said and "chat_template_kwargs" not in said, said
        said = anthropic_refused(s, {"max_tokens": 8, "messages": CHAT[-1:], "output_config": {
            "format": {"type": "json_schema", "schema": {"type": "object"}}}})
        assert said.startswith("output_config.format: ") and "no switch" in said, said
        said = anthropic_refused(s, {"max_tokens": 8, "messages": CHAT[-1:], "tools": [{
            "name": "f", "input_schema": {"type": "object"}}], "tool_choice": {"type": "any"}})
        assert said.startswith("tool_choice: ") and "no switch" in said, said
        r = post(s, "/api/chat", {"model": s.model, "messages": OLLAMA_CHAT, "format": "json",
                                  "think": False, "stream": False})
        assert r.status_code == 400 and "no switch" in r.json()["error"], r.text
    finally:
        assert s.stop() == 0


def anthropic_refused(server, body: dict) -> str:
    """The message of a 400 in Anthropic's shape (which names no param)."""
    r = post(server, "/v1/messages", {"model": server.model, **body})
    assert r.status_code == 400 and r.json()["type"] == "error", r.text
    return r.json()["error"]["message"]


@pytest.mark.parametrize("body, param", [
    ({"reasoning_format": "deepseek-legacy"}, "reasoning_format"),
    ({"reasoning_budget_tokens": 2, "thinking_budget_tokens": 3}, "thinking_budget_tokens"),
    ({"reasoning_budget_tokens": -2}, "reasoning_budget_tokens"),
    ({"reasoning_budget_message": "Stop."}, "reasoning_budget_message"),  # no budget
    ({"reasoning_budget_tokens": -1, "reasoning_budget_message": "Stop."},
     "reasoning_budget_message"),
    ({"reasoning_budget_tokens": 2, "reasoning_budget_message": 5}, "reasoning_budget_message"),
    ({"messages": [{"role": "user", "content": "Hi", "reasoning_content": "hm"}]},
     "messages[0].reasoning_content"),
    ({"messages": [{"role": "assistant", "content": "A", "reasoning_content": "hm",
                    "reasoning": "ho"}, {"role": "user", "content": "Hi"}]},
     "messages[0].reasoning"),
])
def test_bad_reasoning_fields(thinker, body, param):
    refused(thinker, "/v1/chat/completions", {"messages": CHAT, **body}, param)


def test_a_model_that_does_not_think(server):
    refused(server, "/v1/chat/completions", {"messages": CHAT, "reasoning_budget_tokens": 5},
            "reasoning_budget_tokens")
    r = post(server, "/v1/chat/completions", {"messages": CHAT[:1], "max_tokens": 3,
                                              "reasoning_format": "deepseek",
                                              "reasoning_effort": "none"})  # (it never thinks)
    assert "reasoning_content" not in r.json()["choices"][0]["message"]


def test_the_history_keeps_its_thinking(thinker):
    prompt = post(thinker, "/apply-template", {"messages": CHAT}).json()["prompt"]
    assert "<|im_start|>assistant\n<think>\nThe sky is blue on a clear day.\n</think>\n\n" \
           "Blue.<|im_end|>" in prompt
    renamed = [{k.replace("reasoning_content", "reasoning"): v for k, v in m.items()}
               for m in CHAT]  # vLLM's newer name
    assert post(thinker, "/apply-template", {"messages": renamed}).json()["prompt"] == prompt


def test_a_call_after_the_thinking_is_held_to_the_tools_schema_and_streamed(thinker):
    """tool_choice "auto" on a model that thinks: the thinking is free (it was the reason
    such models were left without the lazy grammar), the call the model starts after it is
    held to the tool's schema (it copies Paris, which the enum does not offer), and so it
    streams as it is written."""
    cities = {"type": "object", "properties": {"city": {"type": "string",
                                                        "enum": ["Rome", "Oslo"]}},
              "required": ["city"], "additionalProperties": False}
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": cities}}]
    call = '{"name": "get_weather", "arguments": {"city": "Paris"}}'
    shots = [m for q in ("Weather in Paris?", "Is it raining in Paris?") for m in (
        {"role": "user", "content": q},
        {"role": "assistant", "content": call,
         "reasoning_content": "The user asks about Paris. I call get_weather."})]
    body = {"messages": [*shots, {"role": "user", "content": "Weather in Paris now?"}],
            "tools": tools, "max_tokens": 60}
    free = chat(thinker, **body, tool_choice="none")["choices"][0]
    assert '"Paris"' in free["message"]["content"], free  # what it writes when free
    choice = chat(thinker, **body)["choices"][0]
    assert choice["finish_reason"] == "tool_calls", choice
    assert choice["message"]["reasoning_content"], choice
    arguments = choice["message"]["tool_calls"][0]["function"]["arguments"]
    assert json.loads(arguments)["city"] in ("Rome", "Oslo")
    chunks = sse_chunks(thinker, "/v1/chat/completions", {**GREEDY, **body})
    pieces = [d["function"].get("arguments") for c in chunks if c["choices"]
              for d in c["choices"][0]["delta"].get("tool_calls") or []]
    assert "".join(p or "" for p in pieces) == arguments and len(pieces) > 3
    # a thinking budget still holds beside the lazy grammar (it holds only the call after)
    budgeted = chat(thinker, **body, reasoning_budget_tokens=2)["choices"][0]
    assert len(budgeted["message"]["reasoning_content"]) < len(
        choice["message"]["reasoning_content"]), budgeted


# ---- Ollama ---------------------------------------------------------------------------------

OLLAMA_CHAT = [{"role": m["role"], "content": m["content"],
                **({"thinking": m["reasoning_content"]} if "reasoning_content" in m else {})}
               for m in CHAT]


OLLAMA_OPTIONS = {"temperature": 0, "num_predict": 40, "stop": ["<|im_end|>"]}


def ollama(server, path: str, **body) -> dict:
    r = post(server, path, {"model": server.model, "stream": False,
                            "options": OLLAMA_OPTIONS, **body})
    assert r.status_code == 200, r.text
    return r.json()


def test_ollama_think(thinker):
    raw = ollama(thinker, "/api/chat", messages=OLLAMA_CHAT, think=False)["message"]
    # think: false switches thinking off in the template: no thinking to take apart
    assert "thinking" not in raw
    on = ollama(thinker, "/api/chat", messages=OLLAMA_CHAT)["message"]  # default: on
    assert on == ollama(thinker, "/api/chat", messages=OLLAMA_CHAT, think=True)["message"]
    kept = chat(thinker, reasoning_format="none", repeat_penalty=1.1, top_k=40, top_p=0.9)
    want = split_reasoning(kept["choices"][0]["message"]["content"], THINK, opened=True)
    assert (on["thinking"], on["content"]) == (want.reasoning, want.content)
    with httpx.stream("POST", thinker.url + "/api/chat", json={
            "model": thinker.model, "messages": OLLAMA_CHAT,
            "options": OLLAMA_OPTIONS}, timeout=60) as r:
        lines = [json.loads(line) for line in r.iter_lines() if line]
    assert "".join(x["message"].get("thinking", "") for x in lines) == on["thinking"]
    assert "".join(x["message"]["content"] for x in lines) == on["content"]
    # /api/generate reads a raw prompt's thinking too (here the chat's prompt, written out)
    prompt = post(thinker, "/apply-template", {"messages": CHAT}).json()["prompt"]
    generated = ollama(thinker, "/api/generate", prompt=prompt, raw=True)
    assert (generated["thinking"], generated["response"]) == (on["thinking"], on["content"])
    show = post(thinker, "/api/show", {"model": thinker.model}).json()
    assert "thinking" in show["capabilities"]
    r = post(thinker, "/api/chat", {"model": thinker.model, "messages": OLLAMA_CHAT,
                                    "think": "high"})
    assert r.status_code == 400 and "no thinking levels" in r.json()["error"]
    # found by an audit: a level with a raw prompt went unread (no template reads it)
    r = post(thinker, "/api/generate", {"model": thinker.model, "prompt": prompt, "raw": True,
                                        "think": "high"})
    assert r.status_code == 400 and "goes through the chat template" in r.json()["error"]


def test_ollama_format_switches_the_thinking_off_unless_asked(thinker):
    """As on the other APIs, an answer held to a format has the thinking switched off when the
    request did not choose (it was a 400 telling an Ollama client to send chat_template_kwargs,
    which /api refuses); think: true with a format is a 400 saying what to send."""
    for path, body in (("/api/chat", {"messages": OLLAMA_CHAT}),
                       ("/api/generate", {"prompt": "What colour is the sky?"})):
        said = ollama(thinker, path, format="json", **body)
        answer = said["message"] if path == "/api/chat" else said
        assert "thinking" not in answer, said
        r = post(thinker, path, {"model": thinker.model, "format": "json", "think": True,
                                 "stream": False, **body})
        assert r.status_code == 400 and "send think: false" in r.json()["error"], r.text


def test_ollama_think_on_a_model_that_does_not_think(server):
    show = post(server, "/api/show", {"model": server.model}).json()
    assert "thinking" not in show["capabilities"]
    r = post(server, "/api/chat", {"model": server.model, "messages": OLLAMA_CHAT[:1],
                                   "think": True})
    assert r.status_code == 400 and "does not support thinking" in r.json()["error"]
    r = post(server, "/api/chat", {"model": server.model, "messages": OLLAMA_CHAT[:2]})
    assert r.status_code == 400 and "does not support thinking" in r.json()["error"]


# ---- Anthropic -----------------------------------------------------------------------------

ANTHROPIC_CHAT = [{"role": m["role"], "content": (
    [{"type": "thinking", "thinking": m["reasoning_content"], "signature": ""},
     {"type": "text", "text": m["content"]}] if "reasoning_content" in m else m["content"])}
    for m in CHAT]


def test_anthropic_thinking_blocks(thinker):
    client = anthropic.Anthropic(base_url=thinker.url, api_key="unused", max_retries=0)
    on = {"type": "enabled", "budget_tokens": 1024}
    kw = dict(model=thinker.model, max_tokens=2000, messages=ANTHROPIC_CHAT,
              stop_sequences=["<|im_end|>"], extra_body={"temperature": 0})
    message = client.messages.create(thinking=on, **kw)
    want = chat(thinker, max_tokens=2000)["choices"][0]["message"]
    assert [b.type for b in message.content] == ["thinking", "text"]
    assert message.content[0].thinking == want["reasoning_content"]
    assert message.content[1].text == want["content"]
    with client.messages.stream(thinking=on, **kw) as stream:
        events = [e.type for e in stream]
        streamed = stream.get_final_message()
    assert [b.type for b in streamed.content] == ["thinking", "text"]
    assert streamed.content[0].thinking == message.content[0].thinking
    assert streamed.content[1].text == message.content[1].text
    assert "content_block_start" in events
    off = client.messages.create(**kw)  # Anthropic's default: no thinking
    assert [b.type for b in off.content] == ["text"]
    # the history's thinking blocks are rendered as the chat's reasoning_content is
    counted = client.messages.count_tokens(model=thinker.model, messages=ANTHROPIC_CHAT,
                                           thinking=on)
    assert counted.input_tokens == chat(thinker)["usage"]["prompt_tokens"]


# ---- Responses -----------------------------------------------------------------------------

RESPONSES_INPUT = [item for m in CHAT for item in (
    [{"type": "reasoning", "summary": [], "content": [
        {"type": "reasoning_text", "text": m["reasoning_content"]}]},
     {"role": "assistant", "content": m["content"]}] if "reasoning_content" in m
    else [{"role": "user", "content": m["content"]}])]


def test_responses_reasoning_items(thinker):
    client = openai.OpenAI(base_url=thinker.url + "/v1", api_key="unused", max_retries=0)
    want = chat(thinker, stop=None)  # (the Responses API has no stop strings)
    resp = client.responses.create(model=thinker.model, input=RESPONSES_INPUT, temperature=0,
                                   max_output_tokens=40, reasoning={"summary": "auto"})
    assert [o.type for o in resp.output] == ["reasoning", "message"]
    assert resp.output[0].content[0].text == want["choices"][0]["message"]["reasoning_content"]
    assert resp.output[1].content[0].text == want["choices"][0]["message"]["content"]
    assert resp.usage.input_tokens == want["usage"]["prompt_tokens"]
    assert 0 < resp.usage.output_tokens_details.reasoning_tokens < resp.usage.output_tokens
    stream = client.responses.create(model=thinker.model, input=RESPONSES_INPUT,
                                     temperature=0, max_output_tokens=40, stream=True)
    events = list(stream)
    deltas = "".join(e.delta for e in events if e.type == "response.reasoning_text.delta")
    assert deltas == resp.output[0].content[0].text
    final = events[-1].response
    assert [o.type for o in final.output] == ["reasoning", "message"]
    # Continued: the stored reasoning item goes back into the prompt, as sent whole.
    more = client.responses.create(model=thinker.model, previous_response_id=resp.id,
                                   input="Capital of Spain?", temperature=0,
                                   max_output_tokens=40)
    whole = RESPONSES_INPUT + [o.model_dump(exclude_none=True) for o in resp.output] + [
        {"role": "user", "content": "Capital of Spain?"}]
    again = client.responses.input_tokens.count(model=thinker.model, input=whole)
    assert more.usage.input_tokens == again.input_tokens
    assert [o.type for o in more.output] == ["reasoning", "message"]


def test_a_stateless_client_sends_the_reasoning_back_opaque(thinker):
    """Codex's way (``store: false`` with ``include: ["reasoning.encrypted_content"]``): the
    reasoning item carries the thinking as ``encrypted_content`` (base64 behind a marker, not
    encrypted), and an item sent back with only that reads as the thinking itself."""
    client = openai.OpenAI(base_url=thinker.url + "/v1", api_key="unused", max_retries=0)
    resp = client.responses.create(model=thinker.model, input=RESPONSES_INPUT, temperature=0,
                                   max_output_tokens=40, store=False,
                                   include=["reasoning.encrypted_content"])
    item = resp.output[0]
    assert item.type == "reasoning" and item.encrypted_content.startswith("justllm-reasoning:")
    events = list(client.responses.create(
        model=thinker.model, input=RESPONSES_INPUT, temperature=0, max_output_tokens=40,
        store=False, include=["reasoning.encrypted_content"], stream=True))
    done = [e.item for e in events if e.type == "response.output_item.done"]
    assert done[0].encrypted_content == item.encrypted_content
    assert events[-1].response.output[0].encrypted_content == item.encrypted_content
    opaque = [{"type": "reasoning", "summary": [], "encrypted_content": item.encrypted_content}
              if i.get("type") == "reasoning" and i["content"][0]["text"] == CHAT[1][
                  "reasoning_content"] else i for i in RESPONSES_INPUT]
    count = client.responses.input_tokens.count
    assert count(model=thinker.model, input=opaque).input_tokens != count(
        model=thinker.model, input=RESPONSES_INPUT).input_tokens  # (another thinking there)
    back = [{"type": "reasoning", "summary": [], "encrypted_content":
             "justllm-reasoning:" + base64.b64encode(i["content"][0]["text"].encode()).decode()}
            if i.get("type") == "reasoning" else i for i in RESPONSES_INPUT]
    assert count(model=thinker.model, input=back).input_tokens == count(
        model=thinker.model, input=RESPONSES_INPUT).input_tokens
