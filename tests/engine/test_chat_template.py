"""Chat templates: the transcript fallback, built-in names, Jinja files, and what the demo model
(a base model without a template) answers through them."""

from __future__ import annotations

from pathlib import Path

import pytest

from justllm.core.sampling_params import SamplingParams
from justllm.engine.chat_template import (
    BUILTIN_TEMPLATES,
    NO_TEMPLATE_NOTICE,
    TRANSCRIPT_PREAMBLE,
    AnswerText,
    ChatTemplate,
    mistral_id,
    template_tool_format,
    tool_fallback_text,
    with_template_stops,
)
from justllm.errors import InvalidRequestError

CHAT = [{"role": "system", "content": "Be brief."},
        {"role": "user", "content": " Hi "},
        {"role": "assistant", "content": "Hello."},
        {"role": "tool", "content": "42"},
        {"role": "user", "content": "What is the capital of France?"}]


def test_transcript_rendering():
    t = ChatTemplate.named("transcript")
    assert t.render(CHAT) == ("Be brief.\n\nUser: Hi\nAssistant: Hello.\nTool: 42\n"
                              "User: What is the capital of France?\nAssistant:")
    # Without a system message the preamble opens it; no generation prompt: no "Assistant:".
    assert t.render([{"role": "user", "content": "Hi"}], add_generation_prompt=False) == (
        TRANSCRIPT_PREAMBLE + "\n\nUser: Hi\n")
    assert t.render([{"role": "user", "content": "Q"}, {"role": "system", "content": "S"}]
                    ).endswith("User: Q\nSystem: S\nAssistant:")
    # Any speaker's line ends an answer: a base model writes the next turns itself.
    assert {"\nUser:", "\n\nUser:", "\nTool:", "\nAssistant:", "\nSystem:"} <= set(t.stop)
    assert t.name == "transcript" and t.notice is None
    with pytest.raises(InvalidRequestError, match="must not be empty"):
        t.render([])


def test_builtin_templates_and_their_stop_strings():
    assert set(BUILTIN_TEMPLATES) == {"chatml", "gemma", "llama3", "transcript"}
    chat = CHAT[:2]
    assert ChatTemplate.named("chatml").render(chat) == (
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\n Hi <|im_end|>\n"
        "<|im_start|>assistant\n")
    # The tokenizer adds BOS: a template that writes it too does not double it.
    gemma = ChatTemplate.named("gemma", bos_token="<bos>")
    assert gemma.render(chat) == ("<start_of_turn>user\nBe brief.\n\nHi<end_of_turn>\n"
                                  "<start_of_turn>model\n")
    llama3 = ChatTemplate.named("llama3", bos_token="<|begin_of_text|>")
    assert llama3.render(chat) == (
        "<|start_header_id|>system<|end_header_id|>\n\nBe brief.<|eot_id|>"
        "<|start_header_id|>user<|end_header_id|>\n\nHi<|eot_id|>"
        "<|start_header_id|>assistant<|end_header_id|>\n\n")
    assert [ChatTemplate.named(n).stop for n in ("chatml", "gemma", "llama3")] == [
        ("<|im_end|>",), ("<end_of_turn>",), ("<|eot_id|>",)]
    assert with_template_stops(("x", "<|im_end|>"), ChatTemplate.named("chatml")) == (
        "x", "<|im_end|>")
    assert with_template_stops(("x",), ChatTemplate.named("gemma")) == ("x", "<end_of_turn>")


def test_gemma_shows_every_system_message():
    """It showed only a first system message, and only before a later turn: a second one, a
    later one and a chat of system messages alone were dropped without a word."""
    gemma = ChatTemplate.named("gemma", bos_token="<bos>")
    sys_a, sys_b = {"role": "system", "content": "A"}, {"role": "system", "content": " B "}
    hi = {"role": "user", "content": "Hi"}
    assert gemma.render([sys_a, sys_b, hi]) == (
        "<start_of_turn>user\nA\n\nB\n\nHi<end_of_turn>\n<start_of_turn>model\n")
    assert gemma.render([sys_a]) == "<start_of_turn>user\nA<end_of_turn>\n<start_of_turn>model\n"
    assert gemma.render([hi, sys_b]) == ("<start_of_turn>user\nHi<end_of_turn>\n"
                                         "<start_of_turn>user\nB<end_of_turn>\n"
                                         "<start_of_turn>model\n")
    assert gemma.render([{"role": "system", "content": ""}, hi]) == (
        "<start_of_turn>user\nHi<end_of_turn>\n<start_of_turn>model\n")


def test_a_system_message_a_template_leaves_out_goes_into_a_user_turn():
    """Many models' own templates show a system message only where it opens the chat, and
    Mistral Nemo's only beside the last user message (a tool loop's second turn, ending with
    a tool result, lost it): that was a 400. The text left out goes to the top of the next
    user turn (one of its own where none follows), as for a template without a system role;
    the ones shown stay; a template that shows no user turn either is a 400."""
    first_only = ChatTemplate.resolve(None, (
        "{% for m in messages %}{% if m['role'] != 'system' or loop.first %}"
        "{{ m['role'] }}: {{ m['content'] }}\n{% endif %}{% endfor %}"))
    chat = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    assert first_only.render(chat) == "system: Be brief.\nuser: Hi\n"
    assert first_only.render([*chat, {"role": "system", "content": "Never in French."}]) == (
        "system: Be brief.\nuser: Hi\nuser: Never in French.\n")
    nemo_like = ChatTemplate.resolve(None, (
        "{% set sys = messages[0]['content'] if messages[0]['role'] == 'system' else '' %}"
        "{% for m in messages %}{% if m['role'] == 'user' %}[INST]{% if loop.last and sys %}"
        "{{ sys }}\n\n{% endif %}{{ m['content'] }}[/INST]{% elif m['role'] == 'assistant' %}"
        "{{ m['content'] }}{% endif %}{% endfor %}"))
    turns = [*chat, {"role": "assistant", "content": "Hello."}]
    assert nemo_like.render([*turns, {"role": "user", "content": "Bye"}]) == (
        "[INST]Hi[/INST]Hello.[INST]Be brief.\n\nBye[/INST]")
    assert nemo_like.render(turns, add_generation_prompt=False) == (
        "[INST]Be brief.\n\nHi[/INST]Hello.")
    first_message = ChatTemplate.resolve(None, "{{ messages[0]['content'] }}")
    with pytest.raises(InvalidRequestError, match="leaves this system message out") as e:
        first_message.render([chat[1], {"role": "system", "content": "Never in French."}])
    assert e.value.param == "messages[1]"
    # a template that writes messages through tojson shows them JSON-escaped: shown
    as_json = ChatTemplate.resolve(None, "{% for m in messages %}{{ m | tojson }}{% endfor %}")
    said = 'Say "<b>hi</b>" & go,\nit\'s été.'
    assert "\\n" in as_json.render([{"role": "system", "content": said}, chat[1]])


def test_resolution_order_and_the_notice():
    own = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    model = ChatTemplate.resolve(None, own)
    assert (model.name, model.stop, model.notice) == ("model", (), None)
    assert ChatTemplate.resolve("chatml", own).name == "chatml"  # the choice wins
    fallback = ChatTemplate.resolve(None, None)
    assert fallback.name == "transcript" and fallback.notice == NO_TEMPLATE_NOTICE
    assert "no chat template" in fallback.notice and "--chat-template" in fallback.notice
    assert ChatTemplate.resolve("transcript", None).notice is None  # chosen: nothing to say


def test_jinja_file_and_bad_choices(tmp_path):
    f = tmp_path / "qa.jinja"
    f.write_text("{% for m in messages %}Q: {{ m['content'] }}<|im_end|>\n{% endfor %}A:")
    t = ChatTemplate.named(str(f))
    assert t.render([{"role": "user", "content": "Hi"}]) == "Q: Hi<|im_end|>\nA:"
    assert t.name == str(f) and t.stop == ("<|im_end|>",)  # the turn markers it uses
    with pytest.raises(ValueError, match="neither a built-in template .chatml, gemma, llama3, "
                                         "transcript. nor a Jinja file"):
        ChatTemplate.named("bogus")
    with pytest.raises(ValueError, match="neither"):
        ChatTemplate.named(str(tmp_path / "missing.jinja"))
    bad = tmp_path / "bad.jinja"
    bad.write_text("{% for m in messages %}")
    with pytest.raises(ValueError, match="bad.jinja is not a valid Jinja template"):
        ChatTemplate.named(str(bad))
    # any text is Jinja: a file that never writes the messages served every request with the
    # user's words left out
    text = tmp_path / "notes.txt"
    text.write_text("hello")
    with pytest.raises(ValueError, match="notes.txt.: the template leaves the user's message "
                                         "out of the prompt"):
        ChatTemplate.named(str(text))


def test_a_template_failing_on_a_requests_values_is_a_400_whatever_it_raises():
    """A template is a program over the request's values: Python's own errors from it (Llama
    3.1's ``"Today Date: " + date_string`` given a number) are the request's fault (they were
    a 500), as is a name jinja2's own ``render`` takes (``self``: a TypeError)."""
    t = ChatTemplate('{{ "Today Date: " + date_string }}{% for m in messages %}'
                     '{{ m["content"] }}{% endfor %}')
    hi = [{"role": "user", "content": "Hi"}]
    assert t.render(hi, date_string="1 Dec", self="!") == "Today Date: 1 DecHi"
    with pytest.raises(InvalidRequestError, match="the chat template failed on these messages: "
                                                  "TypeError: can only concatenate str"):
        t.render(hi, date_string=5)
    with pytest.raises(InvalidRequestError, match="failed on these messages: ZeroDivisionError"
                       ) as e:
        ChatTemplate("{{ 1 // 0 }}").render(hi)
    assert e.value.param == "messages"


TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "Weather <now>.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}]
CALLED = [{"role": "user", "content": "Weather in Paris?"},
          {"role": "assistant", "content": "", "tool_calls": [
              {"id": "call_1", "type": "function",
               "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]},
          {"role": "tool", "tool_call_id": "call_1", "content": "18C"}]
TOOLS_JSON = ('{"type": "function", "function": {"name": "get_weather", "description": '
              '"Weather <now>.", "parameters": {"type": "object", "properties": {"city": '
              '{"type": "string"}}}}}')  # HF's tojson: keys in order, "<" as it is


def test_builtins_know_their_tool_format():
    formats = {n: (ChatTemplate.named(n).native_tools, ChatTemplate.named(n).tool_format)
               for n in BUILTIN_TEMPLATES}
    assert formats == {"chatml": (True, "hermes"), "llama3": (True, "llama3"),
                       "gemma": (False, "generic"), "transcript": (False, "generic")}


def test_chatml_renders_tools_hermes_style():
    text = ChatTemplate.named("chatml").render([{"role": "system", "content": "Be brief."},
                                                *CALLED], tools=TOOLS)
    assert text.startswith("<|im_start|>system\nBe brief.\n\n# Tools\n")
    assert f"<tools>\n{TOOLS_JSON}\n</tools>" in text
    assert text.endswith(
        "<|im_start|>user\nWeather in Paris?<|im_end|>\n"
        '<|im_start|>assistant\n<tool_call>\n{"name": "get_weather", "arguments": '
        '{"city": "Paris"}}\n</tool_call><|im_end|>\n'
        "<|im_start|>user\n<tool_response>\n18C\n</tool_response><|im_end|>\n"
        "<|im_start|>assistant\n")
    assert text.count("Be brief.") == 1  # the system message went into the tools turn


def test_llama3_renders_tools_in_the_json_format():
    text = ChatTemplate.named("llama3").render(CALLED, tools=TOOLS)
    assert text.startswith("<|start_header_id|>system<|end_header_id|>\n\nYou have access to")
    assert '{"name": function name, "parameters": dictionary' in text and TOOLS_JSON in text
    assert text.endswith(
        "<|start_header_id|>assistant<|end_header_id|>\n\n"
        '{"name": "get_weather", "parameters": {"city": "Paris"}}<|eot_id|>'
        "<|start_header_id|>ipython<|end_header_id|>\n\n18C<|eot_id|>"
        "<|start_header_id|>assistant<|end_header_id|>\n\n")


def test_fallback_for_templates_without_tools():
    fallback = tool_fallback_text(TOOLS)
    assert '{"name": "get_weather", "description": "Weather <now>.", "parameters"' in fallback
    assert '{"name": "<function name>", "arguments": {' in fallback and "JSON array" in fallback
    assert "at most one" in tool_fallback_text(TOOLS, parallel=False)
    transcript = ChatTemplate.named("transcript")
    assert transcript.render(CALLED, tools=TOOLS) == (
        fallback + "\n\nUser: Weather in Paris?\n"
        'Assistant: {"name": "get_weather", "arguments": {"city": "Paris"}}\n'
        "Tool: 18C\nAssistant:")
    # A model template that ignores tools: the same text, as a system message of its own...
    plain = ChatTemplate("{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n"
                         "{% endfor %}")
    assert not plain.native_tools and plain.tool_format == "generic"
    assert plain.render(CALLED[:1], tools=TOOLS) == (
        f"system: {fallback}\nuser: Weather in Paris?\n")
    # ...and one that drops tool messages gets each result as a user message.
    chat_only = ChatTemplate("{% for m in messages if m['role'] in ('user', 'assistant') %}"
                             "{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}")
    assert chat_only.render(CALLED).endswith("user: Result of get_weather: 18C\n")
    # Without tools nothing changes.
    assert plain.render(CALLED[:1]) == "user: Weather in Paris?\n"
    # A template with no system role (Gemma 2's refuses one; this one drops it): the text
    # goes into the first user turn (every request with tools was a 400)
    for source in ("{% for m in messages %}{% if m['role'] == 'system' %}"
                   "{{ raise_exception('System role not supported') }}{% endif %}"
                   "{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}",
                   "{% for m in messages if m['role'] != 'system' %}{{ m['role'] }}: "
                   "{{ m['content'] }}\n{% endfor %}"):
        no_system = ChatTemplate(source)
        assert no_system.render(CALLED[:1], tools=TOOLS) == (
            f"user: {fallback}\n\nWeather in Paris?\n")


def test_mistral_templates_get_other_clients_call_ids_as_nine_letters_and_digits():
    """Mistral's templates refuse an id that is not 9 letters and digits: a history from
    another client (OpenAI's call_..., Anthropic's toolu_...) was a 400."""
    source = ("{% if tools %}[AVAILABLE_TOOLS]{{ tools | tojson }}{% endif %}"
              "{% for m in messages %}"
              "{% if m.tool_calls %}{% for c in m.tool_calls %}"
              "{% if c.id | length != 9 %}{{ raise_exception('Tool call IDs should be "
              "alphanumeric strings with length 9!') }}{% endif %}"
              "[TOOL_CALLS]{{ c.id }}{% endfor %}"
              "{% elif m.role == 'tool' %}[TOOL_RESULTS]{{ m.tool_call_id }}"
              "{% else %}[INST]{{ m.content }}{% endif %}{% endfor %}")
    mistral = ChatTemplate(source)
    assert mistral.tool_format == "mistral"
    long_id = "call_" + "x" * 24
    chat = [{"role": "user", "content": "Hi"},
            {"role": "assistant", "content": None, "tool_calls": [
                {"id": long_id, "type": "function",
                 "function": {"name": "get_weather", "arguments": {"city": "Paris"}}},
                {"id": "abcdefgh1", "type": "function",
                 "function": {"name": "get_weather", "arguments": {"city": "Rome"}}}]},
            {"role": "tool", "tool_call_id": long_id, "content": "18C"},
            {"role": "tool", "tool_call_id": "abcdefgh1", "content": "20C"}]
    short = mistral_id(long_id)
    assert len(short) == 9 and short.isalnum() and mistral_id(long_id) == short
    assert mistral.render(chat, tools=TOOLS).endswith(
        f"[TOOL_CALLS]{short}[TOOL_CALLS]abcdefgh1[TOOL_RESULTS]{short}[TOOL_RESULTS]abcdefgh1")


def test_a_model_templates_tool_format_comes_from_its_markers():
    assert template_tool_format("{% if tools %}<tool_call>{% endif %}") == "hermes"
    # XML calls (Qwen3-Coder's, GLM's) read as Hermes': a JSON grammar then forced them
    coder = ("{% if tools %}{% for t in tools %}{{ t['function']['name'] }}{% endfor %}"
             "<tool_call>\n<function=NAME>\n<parameter=KEY>{% endif %}"
             "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}")
    assert template_tool_format(coder) == "qwen3_coder"
    assert template_tool_format("<tool_call>{{ name }}<arg_key>k</arg_key>") == "glm"
    # Functionary's (v3.1: <function=NAME>{..}</function>; v3.2: >>>NAME) read as llama3's
    assert template_tool_format("<|start_header_id|><|python_tag|>{{ '<function=' + name + "
                                "'>' + args + '</function>' }}") is None
    assert template_tool_format("<|start_header_id|>{{ '>>>all\\n' + content }}parameters"
                                ) is None
    # an XML form the server does not read (Seed-OSS's) gets the fallback
    seed = coder.replace("<tool_call>", "<seed:tool_call>")
    assert template_tool_format(seed) is None
    xml = ChatTemplate(seed)
    assert not xml.native_tools and xml.tool_format == "generic"
    rendered = xml.render([{"role": "user", "content": "Hi"}], tools=TOOLS)
    assert rendered.startswith(f"system: {tool_fallback_text(TOOLS)}") and "<seed:" not in rendered
    assert template_tool_format("[AVAILABLE_TOOLS]{{ tools }}[TOOL_CALLS]") == "mistral"
    assert template_tool_format("<|start_header_id|>...<|python_tag|>") == "llama3"
    assert template_tool_format("<|start_header_id|>{\"parameters\": ...}") == "llama3"
    assert template_tool_format("{{ messages }}") == "generic"
    mistral = ChatTemplate("{% if tools %}[AVAILABLE_TOOLS]{{ tools | tojson }}"
                           "[/AVAILABLE_TOOLS]{% endif %}{% for m in messages %}[INST]"
                           "{{ m['content'] }}[/INST]{% endfor %}{# [TOOL_CALLS] #}")
    assert (mistral.native_tools, mistral.tool_format) == (True, "mistral")
    assert mistral.render([{"role": "user", "content": "Hi"}], tools=TOOLS) == (
        f"[AVAILABLE_TOOLS][{TOOLS_JSON}][/AVAILABLE_TOOLS][INST]Hi[/INST]")


# Every template llama.cpp ships (its models/templates, in the converter's tree) and the
# format it is read in: the XML forms are native, no other template's format moved.
LLAMA_CPP_FORMATS = {
    "qwen3_coder": {"NVIDIA-Nemotron-3-Nano-30B-A3B-BF16", "Qwen3-Coder", "Qwen3.5-4B",
                    "StepFun3.5-Flash"},
    "glm": {"GLM-4.6", "GLM-4.7-Flash", "Spark2.5", "inclusionai-ling-3.0-flash",
            "poolside-Laguna-S-2.1", "poolside-Laguna-XS-2.1", "poolside-Laguna-XS.2"},
    "kimi_k2": {"moonshotai-Kimi-K2", "Kimi-K2-Instruct", "Kimi-K2-Thinking"},
    "deepseek_v3_1": {"deepseek-ai-DeepSeek-V3.1"},
    "hermes": {"Bielik-11B-v3.0-Instruct", "MiMo-VL", "MiniMax-M3",
               "NousResearch-Hermes-2-Pro-Llama-3-8B-tool_use",
               "NousResearch-Hermes-3-Llama-3.1-8B-tool_use", "Qwen-QwQ-32B",
               "Qwen-Qwen2.5-7B-Instruct", "Qwen-Qwen3-0.6B", "Reka-Edge",
               "ibm-granite-granite-4.0", "ibm-granite-granite-4.1", "unsloth-Apriel-1.5"},
    "mistral": {"Mistral-Small-3.2-24B-Instruct-2506", "mistralai-Ministral-3-14B-Reasoning-2512",
                "mistralai-Mistral-Nemo-Instruct-2407", "unsloth-mistral-Devstral-Small-2507"},
    "llama3": {"meta-llama-Llama-3.1-8B-Instruct", "meta-llama-Llama-3.2-3B-Instruct",
               "meta-llama-Llama-3.3-70B-Instruct"},
    None: {"ByteDance-Seed-OSS", "meetkai-functionary-medium-v3.1",
           "meetkai-functionary-medium-v3.2"},
}


@pytest.fixture(scope="module")
def llama_cpp_templates() -> dict[str, str]:
    from rich.console import Console

    from justllm.models.convert import get_converter

    folder = get_converter(Console(stderr=True)).root / "models" / "templates"
    return {p.stem: p.read_text(encoding="utf-8") for p in folder.glob("*.jinja")}


def test_llama_cpps_templates_keep_their_formats_and_the_xml_forms_are_native(
        llama_cpp_templates):
    assert len(llama_cpp_templates) > 60
    for name, source in llama_cpp_templates.items():
        expected = next((f for f, names in LLAMA_CPP_FORMATS.items() if name in names),
                        "generic")
        assert template_tool_format(source) == expected, name
        if expected in ("qwen3_coder", "glm", "kimi_k2", "deepseek_v3_1"):  # native
            t = ChatTemplate(source)
            assert (t.native_tools, t.tool_format) == (True, expected), name
            assert t.compact_tool_calls == (name in ("GLM-4.7-Flash", "Spark2.5")), name


def test_the_native_forms_render_tools_and_calls_their_own_way(llama_cpp_templates):
    qwen = ChatTemplate(llama_cpp_templates["Qwen3.5-4B"]).render(CALLED, tools=TOOLS)
    assert "<tools>" in qwen and tool_fallback_text(TOOLS) not in qwen
    assert ("<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n"
            "</function>\n</tool_call>") in qwen
    glm = ChatTemplate(llama_cpp_templates["GLM-4.6"]).render(CALLED, tools=TOOLS)
    assert "<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>Paris</arg_value>" in glm
    kimi = ChatTemplate(llama_cpp_templates["Kimi-K2-Thinking"]).render(CALLED, tools=TOOLS)
    assert tool_fallback_text(TOOLS) not in kimi and (
        '<|tool_call_begin|>functions.get_weather:0<|tool_call_argument_begin|>{"city": "Paris"}'
        "<|tool_call_end|>") in kimi
    # Kimi K2's first template writes a result with its tool_call_id: the client's call_1
    # named a call the prompt never showed
    first = ChatTemplate(llama_cpp_templates["moonshotai-Kimi-K2"]).render(CALLED, tools=TOOLS)
    assert "## Return of functions.get_weather:0" in first and "call_1" not in first
    # DeepSeek V3.1's writes calls and results, not tools: they are described in the system
    # prompt as its model card does
    deepseek = ChatTemplate(llama_cpp_templates["deepseek-ai-DeepSeek-V3.1"])
    shown = deepseek.render([{"role": "system", "content": "Be brief."}, *CALLED], tools=TOOLS)
    assert shown.startswith("Be brief.\n\n## Tools\nYou have access to the following tools:"
                            "\n\n### get_weather\nDescription: Weather <now>.")
    assert ('<｜tool▁call▁begin｜>get_weather<｜tool▁sep｜>{"city": "Paris"}<｜tool▁call▁end｜>'
            "<｜tool▁calls▁end｜><｜end▁of▁sentence｜><｜tool▁output▁begin｜>18C") in shown
    assert "## Tools" not in deepseek.render(CALLED)


def test_a_template_of_no_known_format_is_read_only_if_it_writes_calls_as_json_names():
    """A template that renders tools itself but names no marker the server reads was taken
    as ``generic``: Command R's, Kimi K2's, Gemma 4's, DeepSeek V3.2's calls came back as
    text. Its calls as it writes them in the history decide: JSON with their "name" is read
    (Granite 3.3's, MiniMax M1's), anything else gets the fallback; a template that does not
    write them back tells nothing, and keeps its own."""
    head = ("{% for t in tools or [] %}{{ t['function']['name'] }} {% endfor %}"
            "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}"
            "{% for c in m.get('tool_calls') or [] %}CALLS{% endfor %}\n{% endfor %}")
    command_r = head.replace("CALLS", "<|START_ACTION|>[{\"tool_name\": \"{{ c['function']"
                                      "['name'] }}\", \"parameters\": {}}]<|END_ACTION|>")
    granite = head.replace("CALLS", "<|tool_call|>[{{ {'name': c['function']['name'], "
                                    "'arguments': c['function']['arguments']} | tojson }}]")
    silent = head.replace("CALLS", "")
    chat = [{"role": "user", "content": "Hi"}]
    for source, native in ((command_r, False), (granite, True), (silent, True)):
        t = ChatTemplate(source)
        assert (t.native_tools, t.tool_format) == (native, "generic"), source
        rendered = t.render(chat, tools=TOOLS)
        assert (tool_fallback_text(TOOLS) in rendered) is not native, rendered


def test_a_template_that_loops_over_tools_renders_a_chat_without_any():
    """Hermes' and Command R+'s tool_use templates, given as --chat-template, loop over
    ``tools``: every request without tools failed ("'NoneType' object is not iterable"), as
    in HF. They get an empty list; a template that reads None as none still gets None."""
    loops = ChatTemplate("{% for t in tools %}{{ t['function']['name'] }} {% endfor %}"
                         "{% for m in messages %}{{ m['content'] }}{% endfor %}")
    chat = [{"role": "user", "content": "Hi"}]
    assert loops.render(chat) == "Hi"
    assert loops.render(chat, tools=TOOLS) == "".join(
        t["function"]["name"] + " " for t in TOOLS) + "Hi"
    tells = ChatTemplate("{{ 'none' if tools is none else 'list' }}")
    assert tells.render(chat) == "none"


def test_answer_text_drops_leading_and_trailing_blanks():
    a = AnswerText()
    assert [a.feed(p) for p in (" ", " The", " capital", " is", " Paris.", "\n", "\n")] == [
        "", "The", " capital", " is", " Paris.", "", ""]
    b = AnswerText()
    assert [b.feed(p) for p in ("\n", "a", "\n\n", "b")] == ["", "a", "", "\n\nb"]


def _answer(engine, prompt: str, params: SamplingParams) -> tuple[str, str | None]:
    rid = engine.add_request(prompt, params)
    text, finish = [], None
    while finish is None:
        for out in engine.step():
            assert out.error is None, out.error
            if out.request_id == rid:
                text.append(out.text)
                finish = out.finish_reason if out.finished else None
    return "".join(text), finish


def test_demo_model_answers_through_the_transcript(engine):
    t = ChatTemplate.from_backend(engine.backend)
    assert t.name == "transcript" and t.notice == NO_TEMPLATE_NOTICE  # a base model
    params = SamplingParams(max_tokens=24, temperature=0.0, stop=t.stop)
    for question, expected in (("What is the capital of France?", "Paris"),
                               ("What is 2+2?", "4"), ("What colour is the sky?", "lue")):
        text, finish = _answer(engine, t.render([{"role": "user", "content": question}]), params)
        assert expected in text and finish == "stop", (question, text)
        assert "User:" not in text and not text.endswith("\n"), (question, text)


@pytest.mark.parametrize("name", ["transcript", "gemma", "chatml", "llama3"])
def test_continuing_the_final_message_ends_the_prompt_inside_it(name):
    t = ChatTemplate.named(name)
    chat = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello, I am"}]
    prompt = t.render(chat, continue_final=True)
    closed = t.render(chat, add_generation_prompt=False)
    assert prompt.endswith("Hello, I am") and closed.startswith(prompt) and closed != prompt


def test_a_final_message_that_cannot_be_continued_is_a_400():
    t = ChatTemplate("{% for m in messages %}{{ m['content'] | upper }}{% endfor %}")
    with pytest.raises(InvalidRequestError, match="cannot be continued"):
        t.render([{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Yo"}],
                 continue_final=True)
    with pytest.raises(InvalidRequestError, match="an assistant message without tool calls"):
        ChatTemplate.named("chatml").render([{"role": "user", "content": "Hi"}],
                                            continue_final=True)


def test_what_takes_an_answer_apart_and_a_harmony_history():
    """A harmony template (gpt-oss's) is read by core/harmony.py, a tagged one by
    core/reasoning.py, and an assistant's thinking goes to a harmony template as ``thinking``
    (its calls' text left out: gpt-oss's template refuses both)."""
    from justllm.core.harmony import HarmonyReader
    from justllm.core.reasoning import ReasoningSplitter

    harmony = ChatTemplate(
        "{% for m in messages %}<|start|>{{ m.role }}{% if m.thinking %}<|channel|>analysis"
        "<|message|>{{ m.thinking }}<|end|>{% endif %}<|channel|>final<|message|>"
        "{{ m.content }}<|end|>{% endfor %}<|start|>assistant")
    assert harmony.harmony and harmony.thinks and harmony.thinking_tags is None
    assert isinstance(harmony.thinking_reader("x"), HarmonyReader)
    tagged = ChatTemplate("{% for m in messages %}{{ m.content }}<think></think>{% endfor %}")
    assert not tagged.harmony and tagged.thinks
    assert isinstance(tagged.thinking_reader("x"), ReasoningSplitter)
    assert ChatTemplate("{{ messages[0].content }}").thinking_reader("x") is None
    prompt = harmony.render([{"role": "user", "content": "Hi"},
                             {"role": "assistant", "content": "Hello.",
                              "reasoning_content": "Greet back."}])
    assert "<|start|>assistant<|channel|>analysis<|message|>Greet back.<|end|>" in prompt
    call = {"role": "assistant", "content": "x", "reasoning_content": "Look it up.",
            "tool_calls": [{"id": "c", "type": "function",
                            "function": {"name": "f", "arguments": {}}}]}
    rendered = harmony.render([{"role": "user", "content": "Hi"}, call])
    # (this template has no tools of its own: the fallback writes the call as the text)
    assert ('<|channel|>analysis<|message|>Look it up.<|end|><|channel|>final<|message|>{"name": '
            '"f", "arguments": {}}<|end|>') in rendered


def test_hf_generation_blocks_render_their_body():
    """HF's ``{% generation %}`` (LFM2.5's and Laguna's templates mark the assistant's turn
    with it): such a template failed to compile ("unknown tag 'generation'")."""
    t = ChatTemplate("{% for m in messages %}<{{ m['role'] }}>"
                     "{% if m['role'] == 'assistant' %}{% generation %}{{ m['content'] }}"
                     "{% endgeneration %}{% else %}{{ m['content'] }}{% endif %}"
                     "</{{ m['role'] }}>{% endfor %}")
    chat = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello."}]
    assert t.render(chat) == "<user>Hi</user><assistant>Hello.</assistant>"
    assert t.render([*chat[:1], {"role": "assistant", "content": "Hel"}],
                    continue_final=True) == "<user>Hi</user><assistant>Hel"


def test_a_template_may_change_its_own_lists_but_not_the_callers():
    """Kimi K2's template queues call ids (``ids.append``, ``ids.pop(0)``), as llama.cpp's
    engine allows: an immutable sandbox made every history with a call a 400. What a template
    changes is a copy: the caller's messages stay as they were."""
    kimi_like = ChatTemplate(
        "{% for t in tools or [] %}{{ t.function.name }}\n{% endfor %}"
        "{% set q = namespace(ids=[]) %}{% for m in messages %}"
        "{% if m.tool_calls %}{% for c in m.tool_calls %}"
        "{% set _ = q.ids.append('functions.' + c.function.name) %}{% endfor %}"
        "{% elif m.role == 'tool' %}[{{ q.ids.pop(0) }}] {{ m.content }}\n"
        "{% else %}{{ m.role }}: {{ m.content }}\n{% endif %}{% endfor %}"
        "{% set _ = messages.append({'role': 'user'}) %}{% set _ = messages[0].update(x=1) %}")
    chat = [{"role": "user", "content": "Weather in Paris?"},
            {"role": "assistant", "content": "", "tool_calls": [
                {"id": "call_1", "type": "function",
                 "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]},
            {"role": "tool", "tool_call_id": "call_1", "content": "18C"}]
    before = [dict(m) for m in chat]
    assert kimi_like.render(chat, tools=TOOLS) == (
        "get_weather\nuser: Weather in Paris?\n[functions.get_weather] 18C\n")
    assert chat == before
    # still a sandbox
    with pytest.raises(InvalidRequestError, match="unsafe"):
        ChatTemplate("{{ messages.__class__.__mro__ }}").render(chat[:1])


def test_a_template_without_a_system_role_gets_the_system_text_in_the_user_turn():
    """Gemma 2's template raises "System role not supported": every chat with a system
    message was a 400. Its text goes at the top of the next user turn, as llama.cpp does."""
    gemma2_like = ChatTemplate(
        "{% for m in messages %}{% if m['role'] == 'system' %}"
        "{{ raise_exception('System role not supported') }}{% endif %}"
        "<{{ m['role'] }}>{{ m['content'] }}\n{% endfor %}")
    chat = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
            {"role": "assistant", "content": "Hello."},
            {"role": "system", "content": "Answer in French."},
            {"role": "user", "content": "Capital of Italy?"}]
    assert gemma2_like.render(chat) == ("<user>Be brief.\n\nHi\n<assistant>Hello.\n"
                                        "<user>Answer in French.\n\nCapital of Italy?\n")
    assert gemma2_like.render(chat[:1]) == "<user>Be brief.\n"
    # a template that shows a system message keeps it its own
    assert ChatTemplate("{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}\n"
                        "{% endfor %}").render(chat[:2]) == "<system>Be brief.\n<user>Hi\n"


HERMES_TOOL_USE = (  # as Hermes 2 Pro's tool_use template: it iterates tools, None or not
    "<|im_start|>system\n<tools>{% for t in tools %}{{ t | tojson }}{% endfor %}</tools>"
    "<|im_end|>\n{% for m in messages %}<|im_start|>{{ m['role'] }}\n"
    "{% for c in m.tool_calls or [] %}<tool_call>\n{\"name\": \"{{ c.function.name }}\", "
    "\"arguments\": {{ c.function.arguments | tojson }}}\n</tool_call>{% endfor %}"
    "{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
CHATML_ONLY = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>"
               "\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def test_a_models_tool_use_template_renders_the_requests_with_tools(model_path, tmp_path):
    """Hermes 2 Pro's and Hermes 3's GGUFs keep their tool template apart
    (``tokenizer.chat_template.tool_use``; the default is plain ChatML): it was never read, so
    their tools went through the fallback's JSON, not the <tool_call> they were trained on."""
    from justllm.engine.backend import BackendConfig, LlamaBackend
    from justllm.models.draft import _read  # (gguf's own reader: 17 s on this vocabulary)
    from tests.models.ggufs import with_metadata

    path = with_metadata(Path(model_path), tmp_path / "hermes.gguf", lambda w, arch: (
        w.add_chat_template([{"name": "default", "template": CHATML_ONLY},
                             {"name": "tool_use", "template": HERMES_TOOL_USE}])))
    assert _read(path).get_field("tokenizer.chat_template.tool_use") is not None
    with LlamaBackend(BackendConfig(model_path=str(path), n_ctx=64, n_seq_max=1)) as b:
        t = ChatTemplate.from_backend(b)
    chat = [{"role": "user", "content": "Weather in Paris?"}]
    assert t.tool_format == "hermes"
    assert t.render(chat) == "<|im_start|>user\nWeather in Paris?<|im_end|>\n<|im_start|>assistant\n"
    with_tools = t.render(chat, tools=TOOLS)
    assert with_tools.startswith(f"<|im_start|>system\n<tools>{TOOLS_JSON}</tools>")
    assert "You can call functions" not in with_tools
    # a choice of template leaves the model's out, its tool_use one too
    assert ChatTemplate.resolve("chatml", CHATML_ONLY, model_tool_use=HERMES_TOOL_USE
                                ).tool_use is None
    # a model without one: its own template, with the fallback
    plain = ChatTemplate.resolve(None, CHATML_ONLY)
    assert plain.tool_format == "generic" and "You can call functions" in plain.render(
        chat, tools=TOOLS)
