"""The grammar that forces a tool call (``tool_choice`` "required" or a named function).

Two steps, so that llama.cpp's own JSON-schema converter does the hard part: ``call_schema``
is one JSON schema for "a call of one of these functions" (``{"name": <that name>,
"arguments": <its parameters schema>}`` per function, ``anyOf`` them), which the engine turns
into GBNF (``AsyncEngine.json_grammar``, remembered per schema); ``wrap_call_grammar`` then puts that call rule inside
the family's wrapper (``<tool_call>..</tool_call>`` blocks, ``[TOOL_CALLS][..]``, a bare object
or a JSON array), so a call written under it parses with the family's parser and its arguments
validate against the function's schema.
"""

from __future__ import annotations

import re
from typing import Any

from justllm.core.gbnf import GBNF_COMMENT, GBNF_LITERALS
from justllm.errors import InvalidRequestError
from justllm.server.tools.parse import SECTIONS

NO_PARAMETERS: dict[str, Any] = {"type": "object", "properties": {},
                                 "additionalProperties": False}
_CALL_RULE = "justllm-tool-call"
_DEF_KEYS = ("$defs", "definitions")


def arguments_key(fmt: str) -> str:
    """What the family calls a call's arguments."""
    return "parameters" if fmt == "llama3" else "arguments"


def call_schema(functions: list[tuple[str, dict[str, Any] | None]], fmt: str) -> dict[str, Any]:
    """One JSON schema for a call of any of ``functions`` ((name, parameters schema) pairs).
    Definitions (``$defs``) of each parameters schema move to the top, where their
    ``#/$defs/..`` references point once the schema is nested; a parameters schema that
    refers into itself (``#``, ``#/properties/..``) becomes a definition of its own, its
    references pointing there."""
    key = arguments_key(fmt)
    defs: dict[str, dict[str, Any]] = {k: {} for k in _DEF_KEYS}
    alternatives = []
    for i, (name, parameters) in enumerate(functions):
        params = dict(parameters) if parameters else dict(NO_PARAMETERS)
        for k in _DEF_KEYS:
            for def_name, definition in (params.pop(k, None) or {}).items():
                if defs[k].setdefault(def_name, definition) != definition:
                    raise InvalidRequestError(
                        f"tools: two functions define {k}/{def_name} differently; forcing a "
                        "call needs one grammar for all of them", param="tools")
        own = f"{_CALL_RULE}-arguments-{i}"
        moved = _moved_refs(params, f"#/$defs/{own}")
        if moved != params:
            defs["$defs"][own] = moved
            params = {"$ref": f"#/$defs/{own}"}
        alternatives.append({
            "type": "object",
            "properties": {"name": {"const": name}, key: params},
            "required": ["name", key], "additionalProperties": False})
    schema: dict[str, Any] = (alternatives[0] if len(alternatives) == 1
                              else {"anyOf": alternatives})
    for k in _DEF_KEYS:
        if defs[k]:
            schema[k] = defs[k]
    return schema


def _moved_refs(schema: Any, at: str) -> Any:
    """``schema`` with its references into itself (``#``, ``#/properties/..``) pointing where
    it now is, ``at``; those into definitions stay (the definitions move to the top)."""
    if isinstance(schema, list):
        return [_moved_refs(s, at) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: _moved_refs(v, at) for k, v in schema.items()}
    ref = out.get("$ref")
    if isinstance(ref, str) and (ref == "#" or ref.startswith("#/")) and not any(
            ref.startswith(f"#/{k}/") for k in _DEF_KEYS):
        out["$ref"] = at + ref[1:]
    return out


def wrap_call_grammar(call_gbnf: str, fmt: str, parallel: bool) -> str:
    """``call_gbnf`` (GBNF for one call object, its start rule ``root``) inside the family's
    wrapper: one call, or with ``parallel`` one or more."""
    body, n = re.subn(r"(?m)^root ::=", f"{_CALL_RULE} ::=", call_gbnf, count=1)
    if n != 1:
        raise ValueError("the call grammar has no root rule")
    call = _CALL_RULE
    if fmt == "hermes":
        block = f'"<tool_call>\\n" {call} "\\n</tool_call>"'
        root = f"{block} (\"\\n\" {block})*" if parallel else block
    elif fmt == "mistral":
        more = f' ("," " "? {call})*' if parallel else ""
        root = f'"[TOOL_CALLS][" {call}{more} "]"'
    elif fmt == "generic" and parallel:
        root = f'{call} | "[" {call} ("," " "? {call})* "]"'
    else:  # llama3 (one call per turn) and generic without parallel calls
        root = call
    # A transcript's "Assistant:" is followed by the model's own space.
    return f'root ::= " "? ({root})\n{body}'


# A GBNF text's pieces: literals and character classes (GBNF_LITERALS), repetition counts and
# comments (whose words are not rule names), then words (rule names: llama.cpp's letters,
# digits and '-'), then anything else.
_GBNF_PIECE = re.compile(GBNF_LITERALS.pattern + r"|\{[0-9, ]*\}|" + GBNF_COMMENT
                         + r"|([A-Za-z0-9-]+)|.", re.S)


def prefixed_rules(gbnf: str, prefix: str) -> str:
    """``gbnf`` with every rule name (defined or referred to) given ``prefix``, so that it can
    sit beside another grammar's rules (two JSON-schema grammars both define ``space``,
    ``string``, ... each its own way)."""
    return _GBNF_PIECE.sub(lambda m: prefix + m[1] if m[1] else m[0], gbnf)


def call_or_answer_grammar(calls_gbnf: str, answer_gbnf: str) -> str:
    """``tool_choice: "auto"`` with a response format: the answer is the calls
    (``wrap_call_grammar``'s grammar) or an answer in the format (its grammar, rule ``root``),
    as OpenAI's API takes both; held from the first token, so no lazy trigger."""
    calls, n = re.subn(r"(?m)^root ::=", f"{_CALL_RULE}s ::=", calls_gbnf, count=1)
    if n != 1:
        raise ValueError("the calls grammar has no root rule")
    answer = prefixed_rules(answer_gbnf, f"{_CALL_RULE}-answer-")
    # (the calls' grammar lets the model write the space a transcript's "Assistant:" is
    # followed by; an answer without it had only the calls to choose from after that space)
    return f'root ::= {_CALL_RULE}s | " "? {_CALL_RULE}-answer-root\n{calls}\n{answer}'


def named_args_grammar(functions: list[tuple[str, str]], parallel: bool) -> str:
    """Mistral's newer call form, ``[TOOL_CALLS]name[ARGS]{arguments}`` per call (Mistral
    Small 3.2, Magistral, Devstral: a template that writes ``[ARGS]``): ``functions`` are
    (name, GBNF of its parameters schema, rule ``root``) pairs; one call, or with
    ``parallel`` one or more. Each schema's rules are prefixed apart (``prefixed_rules``)."""
    alternatives, rules = [], []
    for i, (name, gbnf) in enumerate(functions):
        prefix = f"{_CALL_RULE}-{i}-"
        rules.append(prefixed_rules(gbnf, prefix))
        alternatives.append(f'"{name}[ARGS]" {prefix}root')  # (names: letters, digits, _ -)
    repeat = "+" if parallel else ""
    return "\n".join([f'root ::= " "? {_CALL_RULE}{repeat}',
                      f'{_CALL_RULE} ::= "[TOOL_CALLS]" ({" | ".join(alternatives)})',
                      *rules])


def section_calls_grammar(fmt: str, functions: list[tuple[str, str]], parallel: bool) -> str:
    """The calls of a family that writes them in a section of special tokens (``SECTIONS``:
    Kimi K2's, DeepSeek V3.1's), each function's arguments from its ``functions`` GBNF
    ((name, GBNF of its parameters schema, rule ``root``) pairs); one call, or with
    ``parallel`` one or more. Kimi K2 names a call by its id, ``functions.NAME:INDEX``."""
    section = SECTIONS[fmt]
    alternatives, rules = [], []
    for i, (name, gbnf) in enumerate(functions):
        prefix = f"{_CALL_RULE}-{i}-"
        rules.append(prefixed_rules(gbnf, prefix))
        named = (f'"functions.{name}:" [0-9] [0-9]?' if fmt == "kimi_k2" else f'"{name}"')
        alternatives.append(f'{named} "{section.args}" {prefix}root')
    repeat = "+" if parallel else ""
    return "\n".join([
        f'root ::= " "? "{section.begin}" {_CALL_RULE}{repeat} "{section.close}"',
        f'{_CALL_RULE} ::= "{section.call}" ({" | ".join(alternatives)}) "{section.end}"',
        *rules])


def call_triggers(fmt: str, parallel: bool) -> tuple[str, ...]:
    """Where a call begins in a free answer (``tool_choice: "auto"``): the lazy grammar's
    triggers (regular expressions; the grammar holds the answer from where the first group
    begins), or () for a family whose calls are left free."""
    if fmt in ("hermes", "qwen3_coder", "glm"):
        return (r"(<tool_call>)",)
    if fmt in SECTIONS:
        return (f"({re.escape(SECTIONS[fmt].begin)})",)
    if fmt == "mistral":  # (both of its forms begin with [TOOL_CALLS])
        return (r"(\[TOOL_CALLS\])",)
    if fmt == "llama3":  # (the grammar is the call object: it begins after the python tag)
        return (r"<\|python_tag\|>\s*(\{)", r'^\s*(\{)\s*"name"')
    if fmt == "generic":  # a call is the whole answer: only at its start
        return (r'^\s*(\{)\s*"name"',) + ((r'^\s*(\[)\s*\{\s*"name"',) if parallel else ())
    return ()
