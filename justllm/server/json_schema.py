"""What a JSON schema asks that the grammar built from it (llama-cpp-python's converter,
``engine/backend.grammar_from_json_schema``) does not enforce.

The converter turns types (a list of them too), ``required``, ``enum``/``const``,
``properties``, ``additionalProperties``, string and array lengths, ``prefixItems``/``items``,
``pattern``, the ``date``/``time``/``date-time``/``uuid`` formats, ``anyOf``/``oneOf`` (not
that only one alternative matches: a strict ``oneOf`` must have alternatives no value can
match twice, told apart by type, value or a required constant property), ``allOf`` and ``$ref`` (with the keywords beside them:
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
from justllm.engine.schema_rewrite import ANNOTATIONS, CONTAINERS, is_json_type, same
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


_TYPES = ("null", "boolean", "object", "array", "string", "integer", "number")


def _values(schema: dict) -> list[Any] | None:
    """The values a schema allows when it lists them (``const``, ``enum``), else None."""
    if "const" in schema:
        return [schema["const"]]
    enum = schema.get("enum")
    return enum if isinstance(enum, list) else None


def _types(schema: dict) -> set[str]:
    """The JSON types a schema's values may have (``number`` includes ``integer``)."""
    values = _values(schema)
    if values is not None:
        return {t for t in _TYPES for v in values if is_json_type(v, t)}
    named = schema.get("type")
    named = [named] if isinstance(named, str) else named
    if not isinstance(named, list):
        return set(_TYPES)
    out = {t for t in named if t in _TYPES}
    return out | {"integer"} if "number" in out else out


def _apart(a: dict, b: dict, within: set[str]) -> bool:
    """Whether no value of the types ``within`` can match both schemas, as far as their
    types, listed values and a required property with listed values (a discriminator) tell;
    False when unsure."""
    va, vb = _values(a), _values(b)
    if va is not None and vb is not None:
        return not any(same(x, y) for x in va for y in vb)
    ta, tb = _types(a) & within, _types(b) & within
    if not ta & tb:
        return True
    if ta | tb != {"object"}:  # (``required`` says nothing of a value that is no object)
        return False
    both = set(a.get("required") or []) & set(b.get("required") or [])
    props_a, props_b = a.get("properties") or {}, b.get("properties") or {}
    return any(isinstance(props_a.get(n), dict) and isinstance(props_b.get(n), dict)
               and _values(props_a[n]) is not None and _values(props_b[n]) is not None
               and _apart(props_a[n], props_b[n], set(_TYPES)) for n in both
               if isinstance(n, str))


def _overlaps(schema: dict, root: Any, seen: dict[int, dict]) -> list[str]:
    """The pairs of a ``oneOf``'s alternatives that one value might match both of (the
    grammar takes any alternative, so "exactly one" is not enforced where they overlap)."""
    alts = schema.get("oneOf")
    if not isinstance(alts, list):
        return []
    views = [_merged(a, root, seen) if isinstance(a, dict) else {} for a in alts]
    within = _types(_merged(schema, root, seen))  # (the type beside the oneOf holds too)
    return [f"oneOf alternatives {i} and {j} may both match"
            for i in range(len(alts)) for j in range(i + 1, len(alts))
            if alts[i] is not False and alts[j] is not False
            and not _apart(views[i], views[j], within)]


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
    out += [f"{path}: {m}" for m in _overlaps(schema, root, seen)]
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
