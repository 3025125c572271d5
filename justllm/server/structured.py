"""Structured output as llama-server and vLLM take it, besides OpenAI's ``response_format``.

Clients written for those servers constrain answers with their own fields, on
``/v1/completions`` too (where OpenAI has no ``response_format``):

- llama-server: ``grammar`` (GBNF) and ``json_schema`` (a JSON schema);
- vLLM: ``structured_outputs`` with one of ``json`` (a schema, or its JSON text),
  ``json_object``, ``choice`` (the answer is one of these strings) or ``grammar`` (GBNF, which
  vLLM's default xgrammar backend reads too), and the same as the older top-level
  ``guided_json``, ``guided_choice``, ``guided_grammar``.

Each becomes a GBNF grammar for the engine's grammar sampler, the answer ending once it is
complete; a regular expression (``regex``, ``guided_regex``) is matched by the whole answer,
as vLLM's (engine/json_regex.py translates it). At most one constraint per request, counting
``response_format`` and tools.
"""

from __future__ import annotations

import json
from typing import Any

from justllm.engine.async_engine import (
    JSON_OBJECT_GRAMMAR,
    MAX_GRAMMAR_ALTERNATIVES,
    AsyncEngine,
    grammar_limits,
    schema_grammar,
)
from justllm.errors import InvalidRequestError

_VLLM = ("json", "json_object", "choice", "grammar", "regex")
_LEGACY = (("guided_json", "json"), ("guided_choice", "choice"), ("guided_grammar", "grammar"),
           ("guided_regex", "regex"))


def requested(req: Any) -> tuple[str, str, Any] | None:
    """(the field's name as a ``param``, its kind, its value) of the one structured-output
    field ``req`` sets, or None; 400 when it sets several."""
    found: list[tuple[str, str, Any]] = []
    if req.grammar is not None:
        found.append(("grammar", "grammar", req.grammar))
    if req.json_schema is not None:
        found.append(("json_schema", "json", req.json_schema))
    outputs = req.structured_outputs
    if outputs is not None:
        given = [(f"structured_outputs.{kind}", kind, getattr(outputs, kind)) for kind in _VLLM
                 if getattr(outputs, kind) not in (None, False)]
        if len(given) != 1:
            raise InvalidRequestError("structured_outputs: give exactly one of "
                                      f"{', '.join(_VLLM)}", param="structured_outputs")
        found += given
    found += [(name, kind, getattr(req, name)) for name, kind in _LEGACY
              if getattr(req, name) is not None]
    if len(found) > 1:
        raise InvalidRequestError(f"{found[0][0]} and {found[1][0]}: give one way to constrain "
                                  "the answer", param=found[1][0])
    return found[0] if found else None


def structured_grammar(aengine: AsyncEngine | None, req: Any) -> tuple[str, str] | None:
    """(GBNF, the field it came from) for ``req``'s structured-output field, or None.
    Without ``aengine`` (router mode, before a load) all but llama.cpp's parse of a client's
    grammar is checked."""
    found = requested(req)
    if found is None:
        return None
    param, kind, value = found
    if kind == "regex":
        if not isinstance(value, str):
            raise InvalidRequestError(f"{param}: a regular expression is a string",
                                      param=param)
        try:
            return AsyncEngine.regex_grammar(value), param
        except InvalidRequestError as e:
            raise InvalidRequestError(f"{param}: {e}", param=param) from None
    if kind == "grammar":
        if aengine is not None:
            aengine.check_grammar(value, param)  # the limits, then llama.cpp's parse
        else:
            grammar_limits(value, param)
        return value, param
    if kind == "json_object":
        return JSON_OBJECT_GRAMMAR, param
    if kind == "choice":
        if not value or not all(isinstance(c, str) and c for c in value):
            raise InvalidRequestError(f"{param}: a non-empty list of non-empty strings",
                                      param=param)
        if len(value) > MAX_GRAMMAR_ALTERNATIVES:  # each a live alternative: see grammar_limits
            raise InvalidRequestError(f"{param}: {len(value)} choices; at most "
                                      f"{MAX_GRAMMAR_ALTERNATIVES}", param=param)
        return "root ::= " + " | ".join(gbnf_literal(c) for c in dict.fromkeys(value)), param
    schema = value
    if isinstance(schema, str):  # vLLM takes the schema as JSON text too
        try:
            schema = json.loads(schema)
        except json.JSONDecodeError as e:
            raise InvalidRequestError(f"{param}: not a JSON schema (its text is not JSON: "
                                      f"{e.msg})", param=param) from None
    if not isinstance(schema, dict):
        raise InvalidRequestError(f"{param}: a JSON schema is an object", param=param)
    try:
        return (aengine.json_grammar(schema) if aengine is not None
                else schema_grammar(schema)), param
    except InvalidRequestError as e:
        raise InvalidRequestError(f"{param}: {e}", param=param) from None


def gbnf_literal(text: str) -> str:
    """``text`` as a GBNF string literal (quotes, backslashes and control characters
    escaped)."""
    out = []
    for ch in text:
        if ch in '"\\':
            out.append("\\" + ch)
        elif ch == "\n":
            out.append("\\n")
        elif ch == "\r":
            out.append("\\r")
        elif ch == "\t":
            out.append("\\t")
        elif ord(ch) < 0x20 or ord(ch) == 0x7F:
            out.append(f"\\x{ord(ch):02x}")
        else:
            out.append(ch)
    return '"' + "".join(out) + '"'
