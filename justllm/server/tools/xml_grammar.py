"""The grammar that forces a call in an XML form (``parse.py``: ``qwen3_coder``, ``glm``),
written as the family's template writes one, so the model keeps the form it was trained on.

A parameter's value is held to its schema: a plain string (``raw_text_value``) is raw text
that cannot contain the tag that closes it (or one of its enum's values), any other value is
JSON for its schema (llama.cpp's converter, ``json_grammar``: the parameters schema's
definitions go with it). The schema's required parameters come in its order, each optional
one may (a parameter the schema does not name is never written, but a required one). A
parameters schema that says more of the whole object (an ``anyOf`` of objects,
``minProperties``...) cannot be held this way: ``unheld_keyword`` names what.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from justllm.errors import InvalidRequestError
from justllm.server.tools.grammar import prefixed_rules
from justllm.server.tools.parse import raw_text_value

_RULE = "justllm-xml"
_DEF_KEYS = ("$defs", "definitions")
# What a parameters schema may say that a call in an XML form is held to: its parameters (each
# value apart), which are required, and words that constrain nothing.
_HELD_KEYS = frozenset({"type", "properties", "required", "additionalProperties", "title",
                        "description", "$defs", "definitions", "$schema", "$id", "$comment",
                        "examples", "default"})
# What a parameter's name may not hold in each form (it would end the tag it stands in).
_NAME_BREAKS = {"qwen3_coder": (">", "\n"), "glm": ("<",)}


def unheld_keyword(fmt: str, parameters: dict[str, Any] | None) -> str | None:
    """What in a function's ``parameters`` schema a call in ``fmt``'s XML form cannot be held
    to by a grammar (None: nothing)."""
    params = parameters or {}
    extra = sorted(set(params) - _HELD_KEYS)
    if extra:
        return f"'{extra[0]}'"
    for key in [*(params.get("properties") or {}), *(params.get("required") or ())]:
        if any(ch in key for ch in _NAME_BREAKS[fmt]):
            return f"the parameter name {key!r}"
    return None


def gbnf_literal(text: str) -> str:
    """``text`` as a GBNF string literal."""
    escaped = (text.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")
               .replace("\r", "\\r").replace("\t", "\\t"))
    return f'"{escaped}"'


def _class_char(ch: str) -> str:
    return "\\" + ch if ch in "\\]^-[" else ch


def text_without(rule: str, closing: str) -> list[str]:
    """GBNF rules (``rule`` the start) for any text in which ``closing`` never appears: the
    states of matching it so far, a character that breaks the match going back to the start
    (``closing`` begins with its only ``<``, so a ``<`` starts a match again)."""
    assert closing.startswith("<") and "<" not in closing[1:]
    rules = []
    for k in range(len(closing)):
        alternatives = [f"[^<{_class_char(closing[k])}] {rule}-0" if k else f"[^<] {rule}-0",
                        f'"<" {rule}-1']
        if 0 < k < len(closing) - 1:
            alternatives.append(f"{gbnf_literal(closing[k])} {rule}-{k + 1}")
        rules.append(f"{rule}-{k} ::= ({' | '.join(alternatives)})?")
    return rules


def _value(prefix: str, schema: Any, defs: dict[str, Any], closing: str,
           json_grammar: Callable[[dict[str, Any]], str]) -> tuple[str, list[str]]:
    """A parameter's value: (the GBNF that writes it, the rules it needs)."""
    if raw_text_value(schema):
        choices = schema.get("enum", [schema["const"]] if "const" in schema else None)
        if choices is not None:
            return "(" + " | ".join(gbnf_literal(c) for c in choices) + ")", []
        return f"{prefix}text-0", text_without(f"{prefix}text", closing)
    value = schema if isinstance(schema, dict) else {}
    gbnf = json_grammar({**value, **{k: v for k, v in defs.items() if k not in value}})
    return f"{prefix}root", [prefixed_rules(gbnf, prefix)]


def xml_call_grammar(fmt: str, functions: list[tuple[str, dict[str, Any] | None]],
                     json_grammar: Callable[[dict[str, Any]], str], parallel: bool,
                     compact: bool = False) -> str:
    """A call of one of ``functions`` ((name, parameters schema) pairs) in ``fmt``'s form; one
    call, or with ``parallel`` one or more. ``json_grammar``: GBNF (rule ``root``) for a JSON
    schema. ``compact``: GLM's tags without line breaks between them (GLM 4.7's)."""
    alternatives, rules = [], []
    sep = "" if compact else "\n"
    for i, (name, parameters) in enumerate(functions):
        unheld = unheld_keyword(fmt, parameters)
        if unheld is not None:
            raise InvalidRequestError(
                f"tools: the parameters of '{name}' use {unheld}, which a call in this model's "
                f"form ({fmt}: each value apart) cannot be held to; such a call can only be "
                "left free (tool_choice 'auto', no response_format)", param="tools")
        params = parameters or {}
        defs = {k: params[k] for k in _DEF_KEYS if k in params}
        required = set(params.get("required") or ())
        named = dict(params.get("properties") or {})
        more = params.get("additionalProperties")
        for key in [k for k in params.get("required") or () if k not in named]:
            named[key] = more if isinstance(more, dict) else {}  # (required, but not named)
        parts = []
        for j, (key, schema) in enumerate(named.items()):
            prefix = f"{_RULE}-{i}-{j}-"
            if fmt == "qwen3_coder":
                value, needed = _value(prefix, schema, defs, "</parameter>", json_grammar)
                part = (f"{gbnf_literal(f'<parameter={key}>' + chr(10))} {value} "
                        f"{gbnf_literal(chr(10) + '</parameter>' + chr(10))}")
            else:
                value, needed = _value(prefix, schema, defs, "</arg_value>", json_grammar)
                part = (f"{gbnf_literal(f'<arg_key>{key}</arg_key>{sep}<arg_value>')} {value} "
                        f"{gbnf_literal('</arg_value>' + sep)}")
            rules += needed
            parts.append(f"({part})" if key in required else f"({part})?")
        body = " ".join(parts)
        if fmt == "qwen3_coder":
            alternatives.append(f"{gbnf_literal(f'<function={name}>' + chr(10))} {body} "
                                f"{gbnf_literal('</function>' + chr(10))}")
        else:
            alternatives.append(f"{gbnf_literal(name + sep)} {body}")
    opening = "<tool_call>\n" if fmt == "qwen3_coder" else "<tool_call>"
    call = f"{_RULE}-call"
    root = f'{call} ("\\n" {call})*' if parallel else call
    return "\n".join([f'root ::= " "? {root}',
                      f"{call} ::= {gbnf_literal(opening)} ({' | '.join(alternatives)}) "
                      f"{gbnf_literal('</tool_call>')}", *rules])
