"""What a JSON schema asks that the grammar built from it (llama-cpp-python's converter,
``engine/backend.grammar_from_json_schema``) does not enforce.

The converter turns types (a list of them too), ``required``, ``enum``/``const``,
``properties``, ``additionalProperties``, string and array lengths, ``prefixItems``/``items``,
``pattern``, the ``date``/``time``/``date-time``/``uuid`` formats, ``anyOf``/``oneOf`` (not
that only one alternative matches), ``allOf`` and ``$ref`` (with the keywords beside them:
engine/schema_rewrite.py) into grammar rules (and ours adds a plain integer's bounds,
engine/int_range.py), and passes over the rest, and over what stands beside an ``enum`` or
``const`` but its ``type`` (the values are written as listed). A
``strict`` schema (OpenAI's promise that the output follows it exactly) that uses any of the
rest is refused, naming what and where; without ``strict`` the schema is followed as far as
the grammar goes (the README says which keywords).
"""

from __future__ import annotations

import re
from typing import Any

from justllm.engine.int_range import BOUNDS, bounded_integer
from justllm.engine.schema_rewrite import ANNOTATIONS, CONTAINERS
from justllm.errors import InvalidRequestError

_UNENFORCED = ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum", "multipleOf",
               "uniqueItems", "minProperties", "maxProperties", "not", "if", "then", "else",
               "patternProperties", "propertyNames", "dependentRequired", "dependentSchemas",
               "dependencies", "contains", "minContains", "maxContains",
               "unevaluatedProperties", "unevaluatedItems")
_FORMATS = re.compile(r"date|time|date-time|uuid[1-5]?")
_NAMED = ("properties", "$defs", "definitions")  # name -> schema
_LISTED = ("anyOf", "oneOf", "allOf", "prefixItems")  # [schema, ...]
_ONE = ("items", "additionalProperties")  # a schema (or, for old-draft items, a list)


def _beside(schema: dict) -> list[str]:
    """The keywords of one value's schema that the grammar drops for another beside them:
    all but ``type`` beside an ``enum``/``const`` (the values are written as listed), string
    lengths beside a ``pattern`` or ``format``, a ``format`` beside a ``pattern``."""
    out = []
    fixed = [k for k in ("enum", "const") if k in schema]
    if fixed:
        out += [f"{k} beside {fixed[0]}" for k in schema
                if k not in (*fixed, "type", "$ref", "allOf", *_UNENFORCED)
                and k not in ANNOTATIONS and k not in CONTAINERS]
    if ("pattern" in schema or "format" in schema) and ("minLength" in schema
                                                        or "maxLength" in schema):
        out.append(f"minLength/maxLength beside {'pattern' if 'pattern' in schema else 'format'}")
    if "pattern" in schema and "format" in schema:  # (the pattern alone was followed)
        out.append("format beside pattern")
    return out


def _resolve(root: Any, ref: str) -> Any:
    """The schema a local ``$ref`` (``#``, ``#/$defs/name``) names in ``root``, or None."""
    if not ref.startswith("#"):
        return None
    node = root
    for part in [p for p in ref[1:].split("/") if p]:
        part = part.replace("~1", "/").replace("~0", "~")
        if not isinstance(node, dict) or part not in node:
            return None
        node = node[part]
    return node


def _parts(schema: dict, root: Any) -> list[dict]:
    """What engine/schema_rewrite.py merges into a value's schema: its ``$ref``'s target and
    its ``allOf`` parts."""
    ref = schema.get("$ref")
    parts = [_resolve(root, ref)] if isinstance(ref, str) else []
    all_of = schema.get("allOf")
    parts += all_of if isinstance(all_of, list) else []
    return [p for p in parts if isinstance(p, dict)]


def _merged(schema: dict, root: Any, seen: dict[int, dict]) -> dict:
    """The keywords that apply to a value together: its schema's own, its ``$ref``'s and its
    ``allOf`` parts' (theirs in turn). ``seen``: each schema's view, made once (parts named
    again and again were followed each time: ``allOf`` of k ``$ref``s to the root took k^8
    calls, a minute of a worker at k=6); a part that leads back to itself adds nothing."""
    key = id(schema)
    if key in seen:
        return seen[key]
    out = seen[key] = dict(schema)  # (in place while its parts are merged: cycles end here)
    for part in _parts(schema, root):
        for k, v in _merged(part, root, seen).items():
            out.setdefault(k, v)
    return out


def unenforced(schema: Any, path: str = "#", root: Any = None,
               seen: dict[int, dict] | None = None) -> list[str]:
    """Where ``schema`` uses what the grammar does not enforce: ``"PATH: keyword"`` each."""
    if not isinstance(schema, dict):
        return []
    root = schema if root is None else root
    seen = {} if seen is None else seen
    skip = BOUNDS if bounded_integer(schema) else ()  # the grammar spells the range
    out = [f"{path}: {k}" for k in _UNENFORCED if k in schema and k not in skip]
    own = _beside(schema)
    out += [f"{path}: {m}" for m in own]
    parts = _parts(schema, root)
    if parts:  # what only meets once they are merged (each part is checked where it is)
        theirs = {m for p in parts for m in _beside(_merged(p, root, seen))}
        out += [f"{path}: {m}" for m in _beside(_merged(schema, root, seen))
                if m not in own and m not in theirs]
    fmt = schema.get("format")
    if fmt is not None and not _FORMATS.fullmatch(str(fmt)):
        out.append(f"{path}: format {fmt!r}")
    required = schema.get("required")
    if isinstance(required, list):  # the converter requires only the properties it has
        named = schema.get("properties") or {}
        out += [f"{path}: required {name!r} (not in properties)" for name in required
                if isinstance(name, str) and name not in named]
    for key in _NAMED:
        for name, sub in (schema.get(key) or {}).items():
            out += unenforced(sub, f"{path}/{key}/{name}", root, seen)
    for key in _LISTED:
        for i, sub in enumerate(schema.get(key) or []):
            out += unenforced(sub, f"{path}/{key}/{i}", root, seen)
    for key in _ONE:
        sub = schema.get(key)
        if isinstance(sub, list):  # an old draft's items: one schema per position
            for i, one in enumerate(sub):
                out += unenforced(one, f"{path}/{key}/{i}", root, seen)
        else:
            out += unenforced(sub, f"{path}/{key}", root, seen)
    return out


def check_strict(schema: Any, param: str) -> None:
    """400 naming ``param`` when a strict ``schema`` asks what the grammar cannot enforce."""
    found = unenforced(schema)
    if found:
        more = f" and {len(found) - 3} more" if len(found) > 3 else ""
        raise InvalidRequestError(
            f"{param}: strict is true, but the output grammar cannot enforce "
            f"{'; '.join(found[:3])}{more} (send strict: false to have the rest of the schema "
            "followed)", param=param)
