"""JSON schemas rewritten into the shapes llama-cpp-python's grammar converter reads whole.

The converter (``engine/backend.grammar_from_json_schema``) looks at one keyword of a schema
and passes over the rest: a ``type`` list dropped every keyword beside it (OpenAI's strict
mode writes a nullable field as ``{"type": ["string", "null"], ...}``), ``anyOf`` and ``$ref``
dropped their siblings, and ``allOf`` kept only its parts' ``properties``. These functions
say the same constraints in the shapes it does read: a ``type`` list becomes an ``anyOf`` of
one type each with the siblings, siblings of ``anyOf``/``oneOf`` go into every alternative,
and ``allOf`` parts (a ``$ref`` among them) merge into one schema. Pure: no llama.cpp.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

from justllm.errors import InvalidRequestError

# Keywords that say nothing about which values match.
ANNOTATIONS = frozenset({"description", "title", "default", "examples", "$comment",
                         "deprecated", "readOnly", "writeOnly", "$schema", "$id", "$anchor",
                         "contentMediaType", "contentEncoding"})
CONTAINERS = ("$defs", "definitions")  # name -> schema, reached only through $ref
_MAPS = ("properties", "patternProperties", "dependentSchemas", *CONTAINERS)
_LISTS = ("anyOf", "oneOf", "allOf", "prefixItems")
_ONES = ("items", "additionalProperties", "additionalItems", "not", "if", "then", "else",
         "contains", "propertyNames", "unevaluatedItems", "unevaluatedProperties")
_LOWER = ("minLength", "minItems", "minProperties", "minimum", "exclusiveMinimum")
_UPPER = ("maxLength", "maxItems", "maxProperties", "maximum", "exclusiveMaximum")
_JSON_TYPES = {"string": (str,), "boolean": (bool,), "null": (type(None),),
               "object": (dict,), "array": (list,), "integer": (int,), "number": (int, float)}


def check_valid_schema(schema: Any, param: str = "response_format") -> None:
    """InvalidRequestError for what is no JSON schema (its ``$schema``'s draft, else draft 7,
    whose ``items`` may still be a list): ``required: "ab"`` was read as ["a", "b"],
    ``enum: "abc"`` as its letters, ``minLength: -1`` taken, and ``anyOf: {..}`` answered
    with Python's own words ("'str' object has no attribute 'get'"). jsonschema's metaschemas
    say it, and where (what ``check_schema`` raises, with the draft's validator made once)."""
    from jsonschema import Draft7Validator
    from jsonschema.exceptions import best_match
    from jsonschema.validators import validator_for

    error = best_match(_metaschema_validator(validator_for(schema, default=Draft7Validator))
                       .iter_errors(schema))
    if error is not None:
        where = "".join(f"/{p}" for p in error.path)
        raise InvalidRequestError(f"not a valid JSON schema: at #{where}: {error.message}",
                                  param=param) from None


@functools.cache
def _metaschema_validator(draft: Any) -> Any:
    """The validator of ``draft``'s metaschema, made once per draft (a memo of what is the
    same for every schema): ``check_schema`` made it anew for each check, 9.5 ms a check of
    a tool's 20 enum properties against 2.1 ms with it made once."""
    from jsonschema.validators import validator_for

    meta = validator_for(draft.META_SCHEMA, default=draft)
    return meta(draft.META_SCHEMA, format_checker=draft.FORMAT_CHECKER)


class SchemaConflict(ValueError):
    """Parts of a schema that no value could satisfy together, or that cannot be merged."""


def constrains(schema: dict[str, Any]) -> bool:
    """Whether ``schema`` says anything about the value (more than annotations and
    definitions): ``{}`` and ``{"description": ..}`` match any JSON value."""
    return any(k not in ANNOTATIONS and k not in CONTAINERS for k in schema)


def hoist_refs(schema: Any) -> Any:
    """``schema`` with every ``$ref`` that has siblings turned into an ``allOf`` of the
    reference and the siblings (definitions stay where they are). llama-cpp-python's
    ``resolve_refs`` does not look beside a ``$ref``, so definitions next to one (Pydantic's
    root ``{"$defs": .., "$ref": ..}``) were never resolved, and the converter dropped the
    siblings. Only schema positions are walked (an ``enum``'s values are data)."""
    if isinstance(schema, list):
        return [hoist_refs(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out: dict[str, Any] = {}
    for key, value in schema.items():
        if key == "properties" and isinstance(value, dict) and "$ref" in value:
            raise InvalidRequestError(  # (its resolve_refs takes any "$ref" key for one)
                'a property named "$ref" is not supported by the grammar converter')
        if key in _MAPS and isinstance(value, dict):
            out[key] = {k: hoist_refs(_unbooled(v)) for k, v in value.items()
                        if v is not False or key != "properties"}
        elif key in _LISTS and isinstance(value, list):
            out[key] = [hoist_refs(_unbooled(v)) for v in value
                        if v is not False or key not in ("anyOf", "oneOf")]
        elif key in _LISTS or key in _ONES:
            # (false stays where the converter reads it: additionalProperties, items)
            out[key] = hoist_refs(_unbooled(value))
        else:
            out[key] = value
    ref = out.get("$ref")
    if ref is None or set(out) <= {"$ref"} | ANNOTATIONS:
        return out
    rest = {k: v for k, v in out.items() if k != "$ref" and k not in CONTAINERS
            and k not in ANNOTATIONS}
    hoisted = {k: out[k] for k in CONTAINERS if k in out}
    hoisted["allOf"] = [{"$ref": ref}] + ([rest] if rest else [])
    return hoisted


_ROOT_REFS = ("#", "#/")


def _retargeted(schema: Any, target: str) -> Any:
    """``schema`` with each ``$ref`` to the whole document (``#``) pointing at ``target``;
    only schema positions are walked (an ``enum``'s values are data)."""
    if isinstance(schema, list):
        return [_retargeted(s, target) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out: dict[str, Any] = {}
    for key, value in schema.items():
        if key in _MAPS and isinstance(value, dict):
            out[key] = {k: _retargeted(v, target) for k, v in value.items()}
        elif key in _LISTS or key in _ONES:
            out[key] = _retargeted(value, target)
        elif key == "$ref" and value in _ROOT_REFS:
            out[key] = target
        else:
            out[key] = value
    return out


def root_refs(schema: Any) -> Any:
    """``schema`` with its references to the whole document (``{"$ref": "#"}``, a tree's
    children) made references to a definition holding a copy of it: llama-cpp-python's
    converter resolves ``#/$defs/name`` (recursion too) but not ``#`` ("Unsupported ref").
    The root stays as it was, so its other references (``#/properties/a``) still resolve."""
    if not isinstance(schema, dict):
        return schema
    given = schema.get("$defs")
    defs: dict[str, Any] = given if isinstance(given, dict) else {}
    name = next(n for n in (f"root{i or ''}" for i in range(len(defs) + 1)) if n not in defs)
    target = f"#/$defs/{name}"
    out = _retargeted(schema, target)
    if out == schema:  # (no reference to the root)
        return schema
    body = {k: v for k, v in out.items() if k not in CONTAINERS}
    return {**out, "$defs": {**(out.get("$defs") or {}), name: body}}


def _unbooled(schema: Any) -> Any:
    """A boolean schema as the converter reads one: ``true`` (any value) as a schema that only
    annotates (not ``{}``: it reads an empty ``items`` as none); ``false`` (no value) stays,
    and is left out where that says the same: a property that may not be present, an
    alternative never taken. The converter failed on either ("argument of type 'bool' is not
    iterable")."""
    return {"description": "any value"} if schema is True else schema


def _types(value: Any) -> set[str]:
    return {value} if isinstance(value, str) else set(value)


def is_json_type(value: Any, name: str) -> bool:
    """Whether ``value`` (decoded JSON) is of the JSON type ``name`` (``1.0`` is an integer,
    ``true`` no number)."""
    if isinstance(value, bool):
        return name == "boolean"
    if name == "integer" and isinstance(value, float):
        return value.is_integer()
    return isinstance(value, _JSON_TYPES.get(name, ()))


def _meet_types(a: Any, b: Any) -> str | list[str]:
    """The types both allow ("number" includes "integer")."""
    left, right = _types(a), _types(b)
    both = (left & right) | {"integer" for x, y in ((left, right), (right, left))
                             if "integer" in x and "number" in y}
    if not both:
        raise SchemaConflict(f"allOf: type {a!r} and type {b!r} have no value in common")
    ordered = [t for t in (a if isinstance(a, list) else [a]) if t in both] + sorted(
        both - _types(a))
    return ordered[0] if len(ordered) == 1 else ordered


def merge(a: dict[str, Any], b: dict[str, Any]) -> dict[str, Any]:
    """One schema that asks what ``a`` and ``b`` both ask (an ``allOf`` of the two)."""
    out = _merged(a, b)
    for side in (a, b):  # a part closed to other properties closes the merge to them
        if side.get("additionalProperties") is False and "properties" in out:
            allowed = set(side.get("properties") or {})
            out["properties"] = {k: v for k, v in out["properties"].items() if k in allowed}
            out["additionalProperties"] = False
            missing = [k for k in out.get("required") or [] if k not in allowed]
            if missing:
                raise SchemaConflict(f"allOf: {missing[0]!r} is required, and a part with "
                                     "additionalProperties false does not list it")
    return out


def same(a: Any, b: Any) -> bool:
    """JSON's equality: ``true`` is not ``1`` nor ``false`` ``0`` (Python's ``==`` said they
    were, and an allOf of two enums kept ``1`` where only ``true`` was allowed); ``1`` is
    ``1.0``."""
    if isinstance(a, bool) or isinstance(b, bool):
        return isinstance(a, bool) and isinstance(b, bool) and a == b
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, list) and isinstance(b, list):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    if isinstance(a, (dict, list)) or isinstance(b, (dict, list)):
        return False
    return bool(a == b)


def _among(value: Any, values: list[Any]) -> bool:
    return any(same(value, v) for v in values)


def _merged(a: dict[str, Any], b: dict[str, Any]) -> dict[str, Any]:
    out = dict(a)
    for key, value in b.items():
        if key not in out or same(out[key], value):
            out[key] = value
        elif key in ANNOTATIONS:
            continue
        elif key == "required":
            out[key] = list(dict.fromkeys([*out[key], *value]))
        elif key in ("properties", *CONTAINERS):
            named = dict(out[key])
            for name, sub in value.items():
                if name not in named or same(named[name], sub):
                    named[name] = sub
                elif key == "properties":
                    named[name] = {"allOf": [named[name], sub]}
                else:
                    raise SchemaConflict(f"allOf: two parts define {key}/{name} differently")
            out[key] = named
        elif key in _LOWER and _numbers(out[key], value):
            out[key] = max(out[key], value)
        elif key in _UPPER and _numbers(out[key], value):
            out[key] = min(out[key], value)
        elif key == "type":
            out[key] = _meet_types(out[key], value)
        elif key == "enum":
            out[key] = [x for x in out[key] if _among(x, value)]
            if not out[key]:
                raise SchemaConflict("allOf: two enums have no value in common")
        elif key == "allOf":
            out[key] = [*out[key], *value]
        else:
            raise SchemaConflict(f"allOf: two parts give {key} different values, which this "
                                 "server cannot merge")
    return out


def _numbers(*values: Any) -> bool:
    return all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in values)


Resolve = Callable[[str], dict[str, Any]]


def rewrite(schema: dict[str, Any], resolve: Resolve, depth: int = 0) -> dict[str, Any]:
    """``schema`` (its top level only) in a shape the converter reads whole; ``resolve``
    gives the schema a ``$ref`` points at (an ``allOf`` part may be one)."""
    if depth > 32:
        raise SchemaConflict("allOf nests (or refers back to itself) too deeply to merge")
    if "allOf" in schema:
        merged = {k: v for k, v in schema.items() if k != "allOf"}
        for part in schema["allOf"]:
            if not isinstance(part, dict):
                raise SchemaConflict("an allOf part is not a schema")
            if "$ref" in part:
                part = merge(resolve(part["$ref"]), {k: v for k, v in part.items()
                                                     if k != "$ref"})
            merged = merge(merged, rewrite(part, resolve, depth + 1))
        return rewrite(merged, resolve, depth + 1)
    if "const" in schema and "enum" in schema:  # (the converter took the const, unchecked)
        if not isinstance(schema["enum"], list) or not _among(schema["const"], schema["enum"]):
            raise SchemaConflict("const is not one of the enum's values: no value matches")
        schema = {k: v for k, v in schema.items() if k != "enum"}
    kind = schema.get("type")
    if isinstance(kind, list):
        rest = {k: v for k, v in schema.items() if k != "type"}
        if len(kind) == 1:
            return rewrite({**rest, "type": kind[0]}, resolve, depth + 1)
        if "const" in schema or "enum" in schema:
            return _values_of_types(schema, set(kind))
        if kind:
            return {**{k: rest.pop(k) for k in CONTAINERS if k in rest},
                    "anyOf": [{**rest, "type": t} for t in kind]}
    elif isinstance(kind, str) and ("const" in schema or "enum" in schema):
        return _values_of_types(schema, {kind})
    unions = [k for k in ("anyOf", "oneOf") if k in schema]
    if len(unions) == 2:
        raise SchemaConflict("anyOf beside oneOf in one schema is not supported: put one "
                             "inside an allOf")
    if unions:
        key = unions[0]
        siblings = {k: v for k, v in schema.items() if k != key and k not in ANNOTATIONS
                    and k not in CONTAINERS}
        if siblings:
            def with_siblings(alt: Any) -> Any:
                if not isinstance(alt, dict):
                    return alt
                if "$ref" in alt:
                    alt = merge(resolve(alt["$ref"]), {k: v for k, v in alt.items()
                                                       if k != "$ref"})
                return merge(siblings, alt)

            return {**{k: schema[k] for k in CONTAINERS if k in schema},
                    key: [with_siblings(alt) for alt in schema[key]]}
    if ("minItems" in schema or "maxItems" in schema) and not (
            {"items", "prefixItems"} & schema.keys()) and schema.get("type") == "array":
        # (the converter reads the counts only beside items, and takes {} for none)
        return {**schema, "items": {"description": "any value"}}
    return schema


def _values_of_types(schema: dict[str, Any], kinds: set[str]) -> dict[str, Any]:
    """An ``enum``/``const`` beside a ``type``: only the values of those types."""
    values = [schema["const"]] if "const" in schema else list(schema["enum"])
    kept = [v for v in values if any(is_json_type(v, t) for t in kinds)]
    if not kept:
        raise SchemaConflict(f"no value of the enum (or const) is of type "
                             f"{' or '.join(sorted(kinds))}")
    rest = {k: v for k, v in schema.items() if k not in ("type", "enum", "const")}
    return {**rest, "enum": kept}
