"""Chat messages -> prompt text, through a Jinja2 chat template.

Which template (``ChatTemplate.resolve``): the ``--chat-template`` choice (a built-in name or a
Jinja file) > the model's own (GGUF metadata) > ``transcript``. A model without a template is
most likely a base model, which has never seen any turn format: it continues a plain
``User:`` / ``Assistant:`` transcript sensibly (the demo Gemma 3 270M answers "The capital of
France is Paris." there, and babbles in Gemma's own turn format), so that is the fallback, with
a ``notice`` the CLI and the server show once.

Rendered in a sandboxed Jinja2 environment, with the helpers HF templates expect
(``raise_exception``, ``strftime_now``, HF's ``tojson``) and the model's BOS/EOS strings.

Tools are rendered as llama.cpp's ``--jinja`` does: a template that renders ``tools`` itself
(found by a probe render) gets them, with the assistant's earlier ``tool_calls`` and the
``tool`` results; its call format (``tool_format``) is read off its markers. Any other template
gets the fallback: ``tool_fallback_text`` in the system message and earlier calls written as
that text asks (see ``ChatTemplate.render``).
"""

from __future__ import annotations

import copy
import datetime
import hashlib
import json
import re
import string
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import Any

import jinja2
from jinja2 import nodes
from jinja2.ext import Extension
from jinja2.parser import Parser
from jinja2.sandbox import SandboxedEnvironment
from jinja2.utils import htmlsafe_json_dumps

from justllm.core.harmony import BUDGET_TAGS, HarmonyReader, is_harmony
from justllm.core.reasoning import THINKING_SWITCH, ReasoningSplitter, opens_thinking, thinking_tags
from justllm.errors import InvalidRequestError

# A system message opens the transcript as its own paragraph (without one, TRANSCRIPT_PREAMBLE
# does); every other message is one "Speaker: text" line. The generation prompt ends with
# "Assistant:" and no space: the model writes the space itself. Measured greedily on the demo
# model (Gemma 3 270M, base): "What is the capital of France?" gets "The capital of France is
# Paris." this way, and "19th century" or a run of digits with a trailing space; "What colour is
# the sky?" gets "Blue." with the preamble and an echo of the question without it.
TRANSCRIPT_PREAMBLE = ("Transcript of a dialog, where the User interacts with an Assistant. The "
                       "Assistant is helpful, honest, and answers the User's questions "
                       "precisely.")
TRANSCRIPT_TEMPLATE = (
    "{% set speakers = {'user': 'User', 'assistant': 'Assistant', 'system': 'System',"
    " 'tool': 'Tool'} %}"
    "{% if messages[0]['role'] != 'system' %}" + TRANSCRIPT_PREAMBLE + "{{ '\\n\\n' }}{% endif %}"
    "{% for m in messages %}"
    "{% set text = (m['content'] or '') | trim %}"
    "{% if loop.first and m['role'] == 'system' %}"
    "{{ text }}{{ '\\n\\n' }}"
    "{% else %}"
    "{{ speakers.get(m['role'], m['role'] | capitalize) }}: {{ text }}{{ '\\n' }}"
    "{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}Assistant:{% endif %}"
)
# Gemma has no tool format of its own: tools reach it through the fallback (see render);
# a tool's result is a user turn that says what it is. Gemma has no system turn either: the
# system messages that open the chat go at the top of its first turn (a user turn of their
# own when nothing follows), and a later one is a user turn.
GEMMA_TEMPLATE = (
    "{{ bos_token }}"
    "{% set ns = namespace(sys=[], lead=true) %}"
    "{% for m in messages %}"
    "{% if ns.lead and m['role'] == 'system' %}"
    "{% set ns.sys = ns.sys + [(m['content'] or '') | trim] %}"
    "{% else %}{% set ns.lead = false %}{% endif %}"
    "{% endfor %}"
    "{% set sys = ns.sys | select | join('\n\n') %}"
    "{% set rest = messages[ns.sys | length:] %}"
    "{% if sys and not rest %}<start_of_turn>user\n{{ sys }}<end_of_turn>\n{% endif %}"
    "{% for m in rest %}"
    "{% set role = 'model' if m['role'] == 'assistant' else 'user' %}"
    "<start_of_turn>{{ role }}\n"
    "{% if loop.first and sys %}{{ sys }}\n\n{% endif %}"
    "{% if m['role'] == 'tool' %}Tool result: {% endif %}"
    "{{ (m['content'] or '') | trim }}<end_of_turn>\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}"
)
# ChatML with the Hermes / Qwen 2.5 tool format: the tools as JSON lines inside <tools> in the
# system turn, each call as <tool_call>{"name": ..., "arguments": {...}}</tool_call> in the
# assistant's turn, results as <tool_response> blocks in a user turn (consecutive results
# share one turn). Without tools it renders plain ChatML.
CHATML_TEMPLATE = (
    "{% set first_system = messages[0]['role'] == 'system' %}"
    "{% if tools %}"
    "<|im_start|>system\n"
    "{% if first_system %}{{ messages[0]['content'] }}\n\n{% endif %}"
    "# Tools\n\nYou may call one or more of these functions to help with the user's request. "
    "Their signatures are inside <tools></tools>:\n<tools>\n"
    "{% for t in tools %}{{ t | tojson }}\n{% endfor %}"
    "</tools>\n\nTo call a function, write a JSON object with its name and arguments inside "
    "<tool_call></tool_call> tags, one block per call:\n<tool_call>\n"
    '{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call><|im_end|>\n'
    "{% endif %}"
    "{% for m in messages %}"
    "{% if loop.first and first_system and tools %}"
    "{% elif m['role'] == 'tool' %}"
    "{% if loop.first or loop.previtem['role'] != 'tool' %}<|im_start|>user{% endif %}"
    "{{ '\\n' }}<tool_response>\n{{ m['content'] }}\n</tool_response>"
    "{% if loop.last or loop.nextitem['role'] != 'tool' %}<|im_end|>\n{% endif %}"
    "{% elif m['role'] == 'assistant' and m['tool_calls'] %}"
    "<|im_start|>assistant\n{{ m['content'] or '' }}"
    "{% for c in m['tool_calls'] %}"
    "{% if m['content'] or not loop.first %}{{ '\\n' }}{% endif %}"
    '<tool_call>\n{"name": "{{ c.function.name }}", "arguments": '
    "{{ c.function.arguments | tojson if c.function.arguments is mapping "
    "else c.function.arguments }}}\n</tool_call>"
    "{% endfor %}<|im_end|>\n"
    "{% else %}"
    "<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endif %}"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
# Llama 3.1's JSON tool format: the functions and the call format in the system turn, a call
# as the assistant's whole turn ({"name": ..., "parameters": {...}}), a result as an ipython
# turn. Without tools it renders plain Llama 3.
LLAMA3_TEMPLATE = (
    "{{ bos_token }}"
    "{% set first_system = messages[0]['role'] == 'system' %}"
    "{% if tools %}"
    "<|start_header_id|>system<|end_header_id|>\n\n"
    "{% if first_system %}{{ messages[0]['content'] | trim }}\n\n{% endif %}"
    "You have access to the following functions. To call one, answer with only a JSON object "
    'in the format {"name": function name, "parameters": dictionary of argument name and its '
    "value}. Do not use variables.\n\n"
    "{% for t in tools %}{{ t | tojson }}\n\n{% endfor %}<|eot_id|>"
    "{% endif %}"
    "{% for m in messages %}"
    "{% if loop.first and first_system and tools %}"
    "{% elif m['role'] == 'assistant' and m['tool_calls'] %}"
    "<|start_header_id|>assistant<|end_header_id|>\n\n"
    "{% for c in m['tool_calls'] %}"
    '{% if not loop.first %}{{ "\\n" }}{% endif %}{"name": "{{ c.function.name }}", "parameters": '
    "{{ c.function.arguments | tojson if c.function.arguments is mapping "
    "else c.function.arguments }}}"
    "{% endfor %}<|eot_id|>"
    "{% else %}"
    "<|start_header_id|>{{ 'ipython' if m['role'] == 'tool' else m['role'] }}<|end_header_id|>"
    "\n\n{{ m['content'] | trim }}<|eot_id|>"
    "{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}"
)

# name -> (Jinja source, stop strings a request formatted with it must stop at). A model
# trained on the format ends its turn with an end-of-generation token anyway; the stop strings
# are for a model that was not (a base model given `--chat-template chatml`).
BUILTIN_TEMPLATES: dict[str, tuple[str, tuple[str, ...]]] = {
    "chatml": (CHATML_TEMPLATE, ("<|im_end|>",)),
    "gemma": (GEMMA_TEMPLATE, ("<end_of_turn>",)),
    "llama3": (LLAMA3_TEMPLATE, ("<|eot_id|>",)),
    # Any speaker's new line ends the answer: a base model writes the next turns itself, an
    # invented "Tool:" result after a call among them. The earliest match ends the text:
    # "\n\nUser:" keeps a blank line out of the answer.
    "transcript": (TRANSCRIPT_TEMPLATE, tuple(f"{gap}{who}:" for who in
                                              ("User", "Tool", "Assistant", "System")
                                              for gap in ("\n", "\n\n"))),
}
# A template file gets the stop strings of the turn markers it uses.
_TURN_ENDS = tuple(stop for _, stops in BUILTIN_TEMPLATES.values() for stop in stops
                   if stop.startswith("<"))

NO_TEMPLATE_NOTICE = ("this model has no chat template and looks like a base model: chats are "
                      "sent as a plain 'User:/Assistant:' transcript (choose another with "
                      "--chat-template)")


def _raise(message: str) -> None:
    raise InvalidRequestError(message, param="messages")


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None,
            separators: tuple[str, str] | None = None, sort_keys: bool = False) -> str:
    """``tojson`` as HF's chat templates expect it: keys in their order, no HTML escaping
    (Jinja's own sorts keys and writes ``<`` as ``\\u003c``, which no model was trained on)."""
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                      sort_keys=sort_keys)


class _Generation(Extension):
    """HF's ``{% generation %}...{% endgeneration %}`` (it marks the assistant's tokens for
    training masks, LFM2.5's and Laguna's templates use it): the body rendered as it is. Without
    it such a template did not even compile."""

    tags = {"generation"}

    def parse(self, parser: Parser) -> nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

    @staticmethod
    def _body(caller: Any) -> str:
        return str(caller())


def _environment() -> SandboxedEnvironment:
    # Undefined as in HF transformers and llama.cpp's minja: templates test optional message
    # keys (``message.tool_calls``) by truth value, which a strict Undefined refuses.
    # Sandboxed, but a template may change its own lists and dicts (Kimi K2's queues its call
    # ids with ``ids.append(..)`` and takes them with ``ids.pop(0)``, as llama.cpp's engine
    # allows: an immutable sandbox refused every history with a call): it renders a deep copy
    # of the variables (``_variables``), so what it changes is its own.
    env = SandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                               extensions=["jinja2.ext.loopcontrols", _Generation])
    env.globals["raise_exception"] = _raise
    env.globals["strftime_now"] = lambda fmt: datetime.datetime.now().strftime(fmt)
    env.filters["tojson"] = _tojson
    return env


def _variables(values: dict[str, Any]) -> dict[str, Any]:
    """A template's variables, its own to change (see ``_environment``): the caller's messages
    stay as they were, and so does the next render's probe chat."""
    return copy.deepcopy(values)


def template_globals() -> frozenset[str]:
    """The names a template sees besides its variables (``raise_exception``, ``range``...): a
    client's extra variables may not hide them."""
    return frozenset(_environment().globals)


def template_tool_format(source: str) -> str | None:
    """The tool-call format a template's own markers name (``generic`` when it names none):
    ``hermes``, ``mistral``, ``llama3``, ``qwen3_coder``, ``glm``, ``kimi_k2``,
    ``deepseek_v3_1`` or ``generic``; the server has a parser for each. ``qwen3_coder``:
    ``<tool_call>`` around ``<function=NAME>`` with ``<parameter=KEY>`` values (Qwen3-Coder,
    Qwen3.5, Nemotron 3 Nano, Step 3.5); ``glm``: ``<tool_call>NAME`` with
    ``<arg_key>``/``<arg_value>`` pairs (GLM 4.5 to 4.7, Ling 3.0, Laguna); ``kimi_k2``: a
    section of ``<|tool_call_begin|>functions.NAME:0<|tool_call_argument_begin|>{..}`` calls;
    ``deepseek_v3_1``: a section of ``<｜tool▁call▁begin｜>NAME<｜tool▁sep｜>{..}`` calls (its
    template renders no tools: ``render`` describes them). None for the XML forms the server cannot read (Seed-OSS's ``<seed:tool_call>``)
    and for Functionary's Llama 3 based formats (v3.1's ``<function=NAME>{..}</function>``,
    v3.2's ``>>>NAME`` recipients): their Llama 3 headers and ``<|python_tag|>`` read as
    ``llama3``, whose parser never found the calls the model writes."""
    if "<|tool_calls_section_begin|>" in source and "<|tool_call_begin|>" in source:
        return "kimi_k2"
    if "<｜tool▁calls▁begin｜>" in source and "<｜tool▁sep｜>" in source and "```json" not in source:
        return "deepseek_v3_1"  # (R1's put a type before the separator, JSON in a fence)
    if "<tool_call>" in source and "<function=" in source and "<parameter=" in source:
        return "qwen3_coder"
    if "<tool_call>" in source and "<arg_key>" in source:
        return "glm"
    if any(marker in source for marker in ("<parameter=", "<arg_key>", "<function=", ">>>all")):
        return None
    if "<tool_call>" in source:
        return "hermes"
    if "[TOOL_CALLS]" in source:
        return "mistral"
    if "<|python_tag|>" in source or ("<|start_header_id|>" in source and "parameters" in source):
        return "llama3"
    return "generic"


def tool_fallback_text(tools: list[dict[str, Any]], parallel: bool = True) -> str:
    """The system paragraph that tells a model whose template has no tool format (a base model
    on ``transcript``, ``gemma``, or a template that ignores ``tools``) which functions exist
    and the exact JSON a call must be: the server's ``generic`` parser reads that JSON."""
    lines = [_tojson({k: v for k, v in t.get("function", t).items() if k != "strict"})
             for t in tools]
    several = (" To call several functions at once, answer with a JSON array of such objects."
               if parallel else " Call at most one function per answer.")
    return ("You can call functions. These are the functions, one JSON object each:\n"
            + "\n".join(lines) + "\n\nTo call a function, answer with only a JSON object in "
            'exactly this form, and nothing else: {"name": "<function name>", "arguments": '
            "{<the arguments, as a JSON object>}}." + several + " A function's result comes "
            "back in a message from the tool; then answer the user.")


def deepseek_tool_text(tools: list[dict[str, Any]], parallel: bool = True) -> str:
    """DeepSeek V3.1's tools as its model card has them described in the system prompt (its
    template writes the calls and their results, not the tools)."""
    parts = ["## Tools\nYou have access to the following tools:"]
    for t in tools:
        fn = t.get("function", t)
        parts.append(f"### {fn.get('name')}\nDescription: {fn.get('description') or ''}\n\n"
                     f"Parameters: {_tojson(fn.get('parameters') or {})}")
    more = "{{additional_tool_calls}}" if parallel else ""
    parts.append("IMPORTANT: ALWAYS adhere to this exact format for tool use:\n"
                 "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>tool_call_name<｜tool▁sep｜>"
                 f"tool_call_arguments<｜tool▁call▁end｜>{more}<｜tool▁calls▁end｜>\n\nWhere:\n\n"
                 "- `tool_call_name` must be an exact match to one of the available tools\n"
                 "- `tool_call_arguments` must be valid JSON that strictly follows the tool's "
                 "Parameters Schema\n" + ("- For multiple tool calls, chain them directly without "
                                          "separators or spaces" if parallel else
                                          "- Call at most one tool per answer"))
    return "\n\n".join(parts)


def _call_text(calls: list[dict[str, Any]]) -> str:
    """Earlier calls written the way ``tool_fallback_text`` asks the model to write them."""
    objs = []
    for c in calls:
        fn = c.get("function", c)
        objs.append({"name": fn.get("name"), "arguments": fn.get("arguments")})
    return _tojson(objs[0] if len(objs) == 1 else objs)


@dataclass
class ChatTemplate:
    """A compiled template and what goes with it.

    ``stop``: strings a request rendered with this template must stop at (callers add them to
    the request's own). ``name``: the built-in name, the file path, or "model" (the GGUF's
    own). ``notice``: set when the model has no template and ``transcript`` was chosen for it.
    ``tool_use``: the model's template for requests with tools, where its GGUF has one apart
    (``tokenizer.chat_template.tool_use``: Hermes 2 Pro's and Hermes 3's, Command R's; their
    default template is plain ChatML), used for them as llama.cpp uses it.
    """

    source: str
    bos_token: str = ""
    eos_token: str = ""
    stop: tuple[str, ...] = ()
    name: str = "model"
    notice: str | None = None
    tool_use: "ChatTemplate | None" = None

    _tool_probes: dict[str, bool] = field(default_factory=dict, init=False, repr=False,
                                          compare=False)

    def __post_init__(self) -> None:
        try:
            self._template = _environment().from_string(self.source)
        except jinja2.TemplateSyntaxError as e:
            where = "the model's chat template" if self.name == "model" else self.name
            raise ValueError(f"{where} is not a valid Jinja template: {e.message} "
                             f"(line {e.lineno})") from None

    def _renders(self, messages: list[dict[str, Any]], **extra: Any) -> str | None:
        try:
            return self._template.render(_variables({
                **extra, "messages": messages, "add_generation_prompt": True,
                "bos_token": self.bos_token, "eos_token": self.eos_token}))
        except Exception:  # a template may refuse the probe chat: it then has no such support
            return None

    def _probe(self, what: str) -> bool:
        """Whether the template renders ``tools`` (``"tools"``), a tool's result
        (``"tool_role"``) or a system message (``"system_role"``: Gemma 2's refuses one) itself,
        found once by rendering a probe chat, as llama.cpp's minja finds a template's
        capabilities."""
        known = self._tool_probes.get(what)
        if known is None:
            chat = [{"role": "user", "content": "Hi"}]
            if what == "system_role":
                result = self._renders([{"role": "system", "content": _PROBE_NAME}, *chat])
                known = result is not None and _PROBE_NAME in result
            elif what == "tools":
                with_tool = self._renders(chat, tools=[_PROBE_TOOL])
                known = (with_tool is not None and _PROBE_NAME in with_tool
                         and with_tool != self._renders(chat, tools=None))
            elif what == "tools_list":  # (Hermes' and Command R+'s tool_use templates
                # loop over tools, None without any: every request without tools failed)
                known = (self._renders(chat, tools=None) is None
                         and self._renders(chat, tools=[]) is not None)
            elif what == "json_calls":
                asked = [{"role": "user", "content": _MARK}]
                result = self._renders([*asked, {"role": "assistant", "content": "", "tool_calls": [
                    {"id": "call_1", "type": "function", "function": {
                        "name": _PROBE_NAME, "arguments": {"x": "y"}}}]}],
                    tools=[_PROBE_TOOL])
                # (a template that does not write the call back, or fails to, tells nothing)
                tail = result.rpartition(_MARK)[2] if result is not None else ""
                known = _PROBE_NAME not in tail or bool(re.search(
                    rf'"name"\s*:\s*"{_PROBE_NAME}"', tail))
            else:
                result = self._renders([*chat, {"role": "assistant", "content": "Ok"},
                                        {"role": "tool", "content": _PROBE_NAME}])
                known = result is not None and _PROBE_NAME in result
            self._tool_probes[what] = known
        return known

    @property
    def native_tools(self) -> bool:
        """True when the template renders ``tools`` itself (Hermes/Qwen, Llama 3.1, Mistral
        and the ``chatml`` and ``llama3`` built-ins) in a format the server reads, or writes
        DeepSeek V3.1's calls (whose tools ``render`` describes in its own words); otherwise
        ``render`` adds the fallback. A template with no marker the server knows (``generic``)
        is read only when it writes a call as JSON with its ``"name"`` (Granite's, Nemotron's):
        Command R's ``tool_name``, Gemma 4's ``call:NAME{..}``,
        LFM2's ``[NAME(x=..)]`` or DeepSeek V3.2's XML came back as text."""
        fmt = template_tool_format(self.source)
        if fmt == "deepseek_v3_1":  # (its template writes calls, not tools: see render)
            return True
        return fmt is not None and self._probe("tools") and (
            fmt != "generic" or self.harmony or self._probe("json_calls"))

    @property
    def _with_tools(self) -> "ChatTemplate":
        """The template a request with tools is rendered with: ``tool_use`` where it renders
        them, else this one."""
        if self.tool_use is not None and self.tool_use.native_tools:
            return self.tool_use
        return self

    @property
    def tool_format(self) -> str:
        """The tool-call format a model prompted through this template writes: its family's
        when the template (``tool_use`` where there is one) renders tools, else ``generic``
        (what the fallback text asks for)."""
        t = self._with_tools
        return (template_tool_format(t.source) or "generic") if t.native_tools else "generic"

    @property
    def compact_tool_calls(self) -> bool:
        """Whether the model writes GLM's calls without line breaks between their tags (GLM
        4.7's ``<arg_key>k</arg_key><arg_value>``), as its template writes them."""
        return self.tool_format == "glm" and "</arg_key><arg_value>" in self._with_tools.source

    @property
    def names_call_arguments(self) -> bool:
        """Whether the model writes Mistral's newer calls, ``[TOOL_CALLS]name[ARGS]{..}``
        (its template writes ``[ARGS]``), not the older ``[TOOL_CALLS][{..}]`` list."""
        return self.tool_format == "mistral" and "[ARGS]" in self._with_tools.source

    @cached_property
    def thinking_tags(self) -> tuple[str, str] | None:
        """The tags the model thinks between (``<think>``, ``</think>``), when the template
        writes a known pair: a reasoning model's (core/reasoning.py). Read once: every chat
        request asks, several times."""
        return thinking_tags(self.source)

    @cached_property
    def harmony(self) -> bool:
        """Whether the model answers in OpenAI's harmony format (gpt-oss: core/harmony.py):
        its thinking is the analysis channel, its calls are addressed messages."""
        return is_harmony(self.source)

    @property
    def thinks(self) -> bool:
        """Whether the model writes thinking that the server takes apart (tags or harmony)."""
        return self.thinking_tags is not None or self.harmony

    @property
    def budget_tags(self) -> tuple[str, str] | None:
        """Where a thinking budget counts: between the thinking tags, or in a harmony model's
        analysis (core/harmony.py)."""
        return BUDGET_TAGS if self.harmony else self.thinking_tags

    def thinking_reader(self, prompt: str) -> ReasoningSplitter | HarmonyReader | None:
        """What takes an answer to ``prompt`` apart into thinking and content (None: the model
        does not think)."""
        if self.harmony:
            return HarmonyReader()
        tags = self.thinking_tags
        return ReasoningSplitter(tags, opens_thinking(prompt, tags)) if tags else None

    @cached_property
    def thinking_switch(self) -> bool:
        """Whether the template turns thinking on and off by ``enable_thinking`` (Qwen3's)."""
        return THINKING_SWITCH in self.source

    @classmethod
    def named(cls, choice: str, *, bos_token: str = "", eos_token: str = "") -> "ChatTemplate":
        """A ``--chat-template`` value: a built-in name, else a path to a Jinja file."""
        if choice in BUILTIN_TEMPLATES:
            source, stop = BUILTIN_TEMPLATES[choice]
            return cls(source, bos_token, eos_token, stop, choice)
        path = Path(choice).expanduser()
        if not path.is_file():
            raise ValueError(f"--chat-template {choice!r} is neither a built-in template "
                             f"({', '.join(BUILTIN_TEMPLATES)}) nor a Jinja file")
        try:
            source = path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as e:
            raise ValueError(f"cannot read the chat template {choice}: {e}") from None
        stop = tuple(s for s in _TURN_ENDS if s in source)
        template = cls(source, bos_token, eos_token, stop, choice)
        shown = template._renders([{"role": "user", "content": _PROBE_NAME}])
        if shown is not None and _PROBE_NAME not in shown.lower():  # (| upper is showing it)
            # (any file is Jinja: one that never writes the messages served every request
            # with the user's words left out; a template that fails the probe fails a request
            # with a 400 of its own)
            raise ValueError(f"--chat-template {choice!r}: the template leaves the user's "
                             "message out of the prompt (rendering a one-message chat did "
                             "not show it); is it a chat template?")
        return template

    @classmethod
    def resolve(cls, choice: str | None, model_source: str | None, *, bos_token: str = "",
                eos_token: str = "", model_tool_use: str | None = None) -> "ChatTemplate":
        """The template to use: ``choice`` > the model's own (``model_source``, with its
        ``model_tool_use`` for requests with tools) > transcript."""
        if choice:
            return cls.named(choice, bos_token=bos_token, eos_token=eos_token)
        if model_source:
            tool_use = cls(model_tool_use, bos_token, eos_token) if model_tool_use else None
            return cls(model_source, bos_token, eos_token, tool_use=tool_use)
        source, stop = BUILTIN_TEMPLATES["transcript"]
        return cls(source, bos_token, eos_token, stop, "transcript", NO_TEMPLATE_NOTICE)

    @classmethod
    def from_backend(cls, backend: Any, choice: str | None = None) -> "ChatTemplate":
        return cls.resolve(choice, backend.chat_template(), bos_token=backend.special_text("bos"),
                           model_tool_use=backend.chat_template("tool_use"),
                           eos_token=backend.special_text("eos"))

    def render(self, messages: list[dict[str, Any]], /, *, add_generation_prompt: bool = True,
               tools: list[dict[str, Any]] | None = None, parallel_tool_calls: bool = True,
               continue_final: bool = False, **extra: Any) -> str:
        """The prompt for ``messages``, as HF's ``apply_chat_template`` and llama.cpp's
        ``--jinja`` render it: ``tools`` in OpenAI's shape (``{"type": "function", "function":
        {...}}``), an assistant's earlier calls as ``tool_calls`` (arguments parsed),
        results as ``tool`` messages. A template without a tool format of its own gets the
        fallback instead (``tool_fallback_text``, earlier calls written in that format);
        ``parallel_tool_calls`` only words that text.

        ``continue_final``: the last message is the assistant's, and the prompt ends where its
        text does, so the model goes on with it (a "prefill", as HF's
        ``continue_final_message``): the turn is rendered with a marker after the text and cut
        at the marker, which works whatever the template writes around a turn."""
        if not messages:
            raise InvalidRequestError("messages must not be empty", param="messages")
        if tools and self._with_tools is not self:
            return self._with_tools.render(
                messages, add_generation_prompt=add_generation_prompt, tools=tools,
                parallel_tool_calls=parallel_tool_calls, continue_final=continue_final, **extra)
        if continue_final:
            last = messages[-1]
            if last.get("role") != "assistant" or last.get("tool_calls"):
                raise InvalidRequestError("continuing the final message needs an assistant "
                                          "message without tool calls last", param="messages")
            marked = [*messages[:-1], {**last, "content": (last.get("content") or "") + _MARK}]
            text = self.render(marked, add_generation_prompt=False, tools=tools,
                               parallel_tool_calls=parallel_tool_calls, **extra)
            if text.count(_MARK) != 1:
                raise InvalidRequestError(
                    "this chat template does not write the assistant's message as it is, so "
                    "it cannot be continued", param="messages")
            return text[:text.index(_MARK)]
        if self.harmony:
            messages = [_harmony_message(m) for m in messages]
        if self.native_tools and self.tool_format == "mistral":
            messages = _mistral_ids(messages)
        if self.native_tools and self.tool_format == "kimi_k2":
            messages = _kimi_ids(messages)
        if (tools and self.native_tools and self.tool_format == "deepseek_v3_1"
                and not self._probe("tools")):  # DeepSeek V3.1's renders calls, not tools
            messages = _with_system_text(messages, deepseek_tool_text(tools, parallel_tool_calls),
                                         self._probe("system_role"))
        if not self.native_tools and (tools or any(
                m.get("tool_calls") or m.get("role") == "tool" for m in messages)):
            messages = self._with_fallback(messages, tools, parallel_tool_calls)
            tools = None
        if (any(m.get("role") == "system" for m in messages)
                and not self._probe("system_role")):
            messages = _systems_in_user_turns(messages)
        if tools is None and self._probe("tools_list"):
            tools = []
        text = self._render_messages(messages, add_generation_prompt, tools, extra)
        left_out = _systems_left_out(messages, text)
        if left_out:  # (Mistral Nemo's shows its system message beside the last user message
            # only: a chat ending with a tool result lost it, every second turn of a tool loop
            # was a 400; many show only one that opens the chat) the text in the next user
            # turn, as a template without a system role gets it
            moved = _systems_in_user_turns(messages, only=set(left_out))
            text = self._render_messages(moved, add_generation_prompt, tools, extra)
            _check_systems_shown(messages, text)
        # The tokenizer adds BOS itself; a template that writes it too would double it.
        if self.bos_token and text.startswith(self.bos_token):
            text = text[len(self.bos_token):]
        return text


    def _render_messages(self, messages: list[dict[str, Any]], add_generation_prompt: bool,
                         tools: list[dict[str, Any]] | None, extra: dict[str, Any]) -> str:
        """The template run over ``messages`` as they now stand; its failures the request's."""
        try:
            # The variables as one mapping: a client's chat_template_kwargs may name anything
            # (even ``self``), and jinja2's render takes keywords beside its own ``self``.
            return self._template.render(_variables({
                **extra, "messages": messages, "add_generation_prompt": add_generation_prompt,
                "bos_token": self.bos_token, "eos_token": self.eos_token, "tools": tools}))
        except InvalidRequestError:
            raise
        except Exception as e:  # the template's own code failing on this input
            # A template is a program over the request's values: a TemplateError, or Python's
            # own error from an operation it applies to them (``"Date: " + 5``), is the
            # request's problem, not the server's.
            kind = "" if isinstance(e, jinja2.TemplateError) else f"{type(e).__name__}: "
            raise InvalidRequestError(f"the chat template failed on these messages: {kind}{e}",
                                      param="messages") from e

    def _with_fallback(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None,
                       parallel: bool) -> list[dict[str, Any]]:
        """``messages`` for a template that knows no tools: the fallback text in the system
        message, earlier calls as JSON in the assistant's content, and results as user
        messages ("Result of NAME: ...") unless the template renders tool messages itself."""
        names: dict[str, str] = {}
        out = []
        for m in messages:
            calls = m.get("tool_calls")
            if calls:
                names.update({c.get("id", ""): c["function"]["name"] for c in calls})
                text = _call_text(calls)
                m = {k: v for k, v in m.items() if k != "tool_calls"}
                m["content"] = f"{m['content']}\n{text}" if m.get("content") else text
            elif m.get("role") == "tool" and not self._probe("tool_role"):
                name = m.get("name") or names.get(m.get("tool_call_id") or "", "the function")
                m = {"role": "user", "content": f"Result of {name}: {m.get('content') or ''}"}
            out.append(m)
        if tools:
            out = _with_system_text(out, tool_fallback_text(tools, parallel),
                                    self._probe("system_role"))
        return out


def _with_system_text(messages: list[dict[str, Any]], text: str, system_role: bool
                      ) -> list[dict[str, Any]]:
    """``messages`` with ``text`` after the first system message's (or as one; at the top of
    the first user message for a template without a system ``role``)."""
    out = list(messages)
    user = next((i for i, m in enumerate(out) if m.get("role") == "user"), None)
    if out[0]["role"] == "system":
        first = out[0].get("content")
        out[0] = {**out[0], "content": f"{first}\n\n{text}" if first else text}
    elif user is not None and not system_role:
        # (a template without a system role, as Gemma 2's, refused every request with
        # tools; llama.cpp's templates put a system message into the first user turn)
        said = out[user].get("content")
        out[user] = {**out[user], "content": f"{text}\n\n{said}" if said else text}
    else:
        out.insert(0, {"role": "system", "content": text})
    return out


def _systems_in_user_turns(messages: list[dict[str, Any]], only: set[int] | None = None
                           ) -> list[dict[str, Any]]:
    """``messages`` for a template without a system role (Gemma 2's raises "System role not
    supported", some drop the message): each system message's text at the top of the next
    user message (a user message of its own where none follows), as llama.cpp's templates
    polyfill it. Every chat with a system message was a 400. ``only``: the indices of the
    system messages to move (those the template left out), the others kept as they are."""
    out: list[dict[str, Any]] = []
    pending: list[str] = []
    for i, m in enumerate(messages):
        if m.get("role") == "system" and (only is None or i in only):
            if m.get("content"):
                pending.append(m["content"])
            continue
        if pending and m.get("role") == "user" and isinstance(m.get("content") or "", str):
            m = {**m, "content": "\n\n".join([*pending, m["content"]] if m.get("content")
                                                else pending)}
            pending = []
        out.append(m)
    if pending:
        out.append({"role": "user", "content": "\n\n".join(pending)})
    return out


_MISTRAL_ID = re.compile(r"[A-Za-z0-9]{9}")
_BASE62 = string.digits + string.ascii_letters


def mistral_id(call_id: str) -> str:
    """``call_id`` as Mistral's templates take one (9 letters and digits: they refuse any
    other, so another client's ``call_…`` or ``toolu_…`` history was a 400), the same for the
    same id, as vLLM shortens them."""
    if _MISTRAL_ID.fullmatch(call_id):
        return call_id
    n = int.from_bytes(hashlib.sha256(call_id.encode()).digest()[:8], "big")
    return "".join(_BASE62[(n // 62 ** i) % 62] for i in range(9))


def _mistral_ids(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """``messages`` with their calls' and results' ids as ``mistral_id`` makes them."""
    out = []
    for m in messages:
        if m.get("tool_calls"):
            m = {**m, "tool_calls": [{**c, "id": mistral_id(c["id"])}
                                     if isinstance(c.get("id"), str) else c
                                     for c in m["tool_calls"]]}
        if isinstance(m.get("tool_call_id"), str):
            m = {**m, "tool_call_id": mistral_id(m["tool_call_id"])}
        out.append(m)
    return out


def _kimi_ids(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """``messages`` with their calls' ids as Kimi K2 writes them, ``functions.NAME:INDEX`` (the
    call's place in its message), and each result's the same as its call's: Kimi K2's
    template writes a call with that id and its result with the result's ``tool_call_id``,
    so a client's ``call_…`` named a call the prompt never showed."""
    ids: dict[str, str] = {}
    out = []
    for m in messages:
        if m.get("tool_calls"):
            calls = []
            for k, c in enumerate(m["tool_calls"]):
                own = f"functions.{c.get('function', {}).get('name', '')}:{k}"
                if isinstance(c.get("id"), str):
                    ids[c["id"]] = own
                calls.append({**c, "id": own})
            m = {**m, "tool_calls": calls}
        if isinstance(m.get("tool_call_id"), str):
            m = {**m, "tool_call_id": ids.get(m["tool_call_id"], m["tool_call_id"])}
        out.append(m)
    return out


def _systems_left_out(messages: list[dict[str, Any]], text: str) -> list[int]:
    """The indices of the system messages whose text the prompt ``text`` leaves out."""
    out = []
    for i, m in enumerate(messages):
        content = m.get("content")
        if m.get("role") != "system" or not isinstance(content, str) or not content.strip():
            continue
        said = content.strip()  # as it is, or JSON-escaped by a template's tojson
        forms = (said, json.dumps(said, ensure_ascii=False)[1:-1], json.dumps(said)[1:-1],
                 str(htmlsafe_json_dumps(said))[1:-1])
        if not any(form in text for form in forms):
            out.append(i)
    return out


def _check_systems_shown(messages: list[dict[str, Any]], text: str) -> None:
    """400 when the prompt still leaves out a system message's text (moved into a user turn,
    where a template shows every user message's): a request's instructions must be followed
    or refused, never dropped (a developer message is a system one by now)."""
    for i in _systems_left_out(messages, text):
        raise InvalidRequestError(
            f"messages[{i}]: this chat template leaves this system message out of the prompt, "
            "even in a user turn", param=f"messages[{i}]")


def _harmony_message(m: dict[str, Any]) -> dict[str, Any]:
    """An assistant's thinking as a harmony template reads it (``thinking``, as llama.cpp
    passes it to gpt-oss's); with calls, the thinking stands for the text (the template
    refuses both)."""
    thought = m.get("reasoning_content")
    if m.get("role") != "assistant" or not thought or "thinking" in m:
        return m
    m = {**m, "thinking": thought}
    if m.get("tool_calls"):
        m.pop("content", None)
    return m


_PROBE_NAME = "justllm_probe_7f3a"
_MARK = "<<justllm-continue-7f3a>>"  # where a continued assistant message ends
_PROBE_TOOL = {"type": "function", "function": {
    "name": _PROBE_NAME, "description": "A probe.",
    "parameters": {"type": "object", "properties": {"x": {"type": "string"}}, "required": ["x"]}}}


def with_template_stops(stop: tuple[str, ...], template: ChatTemplate) -> tuple[str, ...]:
    """A request's stop strings followed by the template's (each once)."""
    return stop + tuple(s for s in template.stop if s not in stop)


class AnswerText:
    """A chat answer streamed without its leading and trailing blanks: after a transcript's
    "Assistant:" the model writes the separating space itself, and the line break before the
    next "User:" is not part of the answer. Blanks inside the answer are held back until
    more text follows them."""

    def __init__(self) -> None:
        self._begun = False
        self._held = ""

    def feed(self, piece: str) -> str:
        """The part of the answer that is safe to show now."""
        text = self._held + piece
        if not self._begun:
            text = text.lstrip()
            self._begun = bool(text)
        shown = text.rstrip()
        self._held = text[len(shown):]
        return shown
