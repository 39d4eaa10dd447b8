"""Typing argument values from the tool's JSON schema.

XML dialects write every value as text; the schema says what it is. A "string" parameter stays text even
when it looks like a number; "integer", "number", "boolean", "null", "object" and "array" are parsed,
forgivingly (Python literals such as True/None, single quotes and trailing commas are read too). With
several types (a type list, anyOf/oneOf, an enum of mixed values) the first type that parses wins. A
value whose schema names no type (or an undeclared parameter) is read as JSON when it parses, else kept
as text. Annotations such as `$schema`, `description` or bounds are not checked: this reads, it does not
validate.
"""

from __future__ import annotations

import ast
import copy
import json
import math
import re
from typing import Any

_PY_TYPES: list[tuple[type, str]] = [(bool, "boolean"), (int, "integer"), (float, "number"), (str, "string"),
                                     (dict, "object"), (list, "array"), (type(None), "null")]
_INT = re.compile(r"[+-]?\d+")
_INTEGRAL_FLOAT = re.compile(r"[+-]?\d+\.0*")
_FLOAT = re.compile(r"[+-]?(?:\d+\.?\d*|\.\d+)(?:[eE][+-]?\d+)?")


# Nested $refs followed at most this deep: a recursive schema (a tree of nodes) is cut off there, its deepest
# references left as "any value".
_REF_DEPTH = 8


def resolved_schema(schema: Any) -> dict:
    """A tool's parameters schema with its local `$ref`s inlined ("#/$defs/X", "#/definitions/X", any JSON
    pointer into the schema, "#" itself) and each `allOf` of objects merged into its parent (properties and
    required keys joined, types intersected; another keyword the parent lacks taken from the first member that
    has it), so that the call grammars and the argument typing see the keys and types that Pydantic-, zod- and
    MCP-style schemas declare through them. `$schema`, `$id`, `$defs` and `definitions` are dropped; a reference
    that resolves to nothing (or a remote one) becomes "any value"."""
    if not isinstance(schema, dict):
        return {}
    out = _resolve(schema, schema, 0)
    return out if isinstance(out, dict) else {}


def _pointer(root: dict, ref: str) -> Any:
    """What the local reference `ref` points at in root, or None."""
    if ref == "#":
        return root
    if not ref.startswith("#/"):
        return None
    node: Any = root
    for part in ref[2:].split("/"):
        part = part.replace("~1", "/").replace("~0", "~")
        if isinstance(node, dict) and part in node:
            node = node[part]
        elif isinstance(node, list) and part.isdigit() and int(part) < len(node):
            node = node[int(part)]
        else:
            return None
    return node


def _resolve(node: Any, root: dict, depth: int) -> Any:
    if isinstance(node, list):
        return [_resolve(v, root, depth) for v in node]
    if not isinstance(node, dict):
        return node
    ref = node.get("$ref")
    if isinstance(ref, str):
        rest = {k: v for k, v in node.items() if k != "$ref"}
        target = _pointer(root, ref) if depth < _REF_DEPTH else None
        if isinstance(target, dict):
            merged = copy.deepcopy(target)
            merged.update(rest)  # siblings of $ref (a description, a default) stay
            return _resolve(merged, root, depth + 1)
        node = rest
    out = {k: _resolve(v, root, depth) for k, v in node.items() if k not in ("$schema", "$defs", "definitions", "$id")}
    members = out.get("allOf")
    if isinstance(members, list) and members and all(isinstance(m, dict) for m in members):
        del out["allOf"]
        for member in members:
            out = _merged(out, member)
    return out


def _merged(schema: dict, member: dict) -> dict:
    """`schema` with an allOf `member` merged in, so that what the grammars read of the one schema is what a
    value must meet for both: properties and required keys joined (a property both declare merged the same way),
    types intersected (`_common_types`), any other keyword kept from `schema` when it has it, else taken."""
    out = dict(schema)
    for key, value in member.items():
        if key == "properties" and isinstance(value, dict):
            props = out.get("properties")
            have = props if isinstance(props, dict) else {}
            out["properties"] = {**have, **{k: _both(have[k], v) if k in have else v for k, v in value.items()}}
        elif key == "required" and isinstance(value, list):
            have = out.get("required") if isinstance(out.get("required"), list) else []
            out["required"] = have + [k for k in value if k not in have]
        elif key == "type" and "type" in out:
            out["type"] = _common_types(out["type"], value)
        elif key not in out:
            out[key] = value
    return out


def _both(first: Any, second: Any) -> Any:
    """One schema for a value that must meet two (boolean schemas included)."""
    if first is False or second is False:
        return False
    if first is True:
        return second
    if isinstance(first, dict) and isinstance(second, dict):
        return _merged(first, second)
    return first


def _type_names(declared: Any) -> list[str] | None:
    if isinstance(declared, str):
        return [declared]
    if isinstance(declared, list):
        return [t for t in declared if isinstance(t, str)]
    return None


def _common_types(first: Any, second: Any) -> Any:
    """The `type` a value meeting both `type` keywords has ("integer" being a kind of "number"): one name, a list,
    or an empty list when no type is in both (a schema no value meets; the metaschema never allows one as sent).
    Taking the first, as the other keywords are, would let a grammar write a value the second refuses."""
    left, right = _type_names(first), _type_names(second)
    if left is None or right is None:
        return first if right is None else second
    common: list[str] = []
    for t in left:
        if t in right or (t == "integer" and "number" in right):
            meet = t
        elif t == "number" and "integer" in right:
            meet = "integer"
        else:
            continue
        if meet not in common:
            common.append(meet)
    return common[0] if len(common) == 1 else common


def schema_types(schema: Any) -> list[str]:
    """The JSON types a schema admits, in preference order; [] when it does not say."""
    if not isinstance(schema, dict):
        return []
    declared = schema.get("type")
    if isinstance(declared, str):
        return [declared]
    if isinstance(declared, list):
        return [t for t in declared if isinstance(t, str)]
    for key in ("anyOf", "oneOf"):
        subs = schema.get(key)
        if isinstance(subs, list):
            types: list[str] = []
            for sub in subs:
                types += [t for t in schema_types(sub) if t not in types]
            return types
    if isinstance(schema.get("allOf"), list):
        for sub in schema["allOf"]:
            if types := schema_types(sub):
                return types
    if isinstance(schema.get("enum"), list):
        types = []
        for value in schema["enum"]:
            t = _type_of(value)
            if t not in types:
                types.append(t)
        return types
    if "const" in schema:
        return [_type_of(schema["const"])]
    if "properties" in schema:
        return ["object"]
    if "items" in schema:
        return ["array"]
    return []


def streams_as_string(schema: Any) -> bool:
    """True when the value is text whatever it looks like, so it can be passed on as it arrives."""
    types = schema_types(schema)
    return bool(types) and types[0] == "string"


def type_value(raw: str, schema: Any) -> Any:
    """An XML-dialect value (text) -> the Python value the schema asks for."""
    types = schema_types(schema)
    if not types:
        parsed = _loads(raw.strip())
        return raw if parsed is _FAIL else parsed
    for t in types:
        value = _as_type(raw, t)
        if value is not _FAIL:
            return value
    return raw


def type_json_value(value: Any, schema: Any) -> Any:
    """A JSON-dialect value: already typed, except a string where the schema wants something else, or a
    number or boolean where it wants a string."""
    types = schema_types(schema)
    if not types:
        return value
    if isinstance(value, str):
        return value if "string" in types else type_value(value, schema)
    if isinstance(value, (bool, int, float)) and types[0] == "string" and _type_of(value) not in types:
        return json.dumps(value)
    return value


def type_arguments(arguments: dict, parameters: Any) -> dict:
    """Type each top-level argument of a JSON-dialect call from the tool's parameters schema."""
    props = parameters.get("properties") if isinstance(parameters, dict) else None
    if not isinstance(props, dict):
        return arguments
    return {k: type_json_value(v, props.get(k)) for k, v in arguments.items()}


def loads_forgiving(text: str) -> Any:
    """JSON, or the JSON-like Python literal a model sometimes writes instead. Raises ValueError."""
    value = _loads(text)
    if value is _FAIL:
        raise ValueError("not JSON")
    return value


# --- internals ---

_FAIL = object()


def _type_of(value: Any) -> str:
    for py, name in _PY_TYPES:
        if isinstance(value, py):
            return name
    return "string"


def _as_type(raw: str, t: str) -> Any:
    if t == "string":
        return raw
    s = raw.strip()
    if t == "integer":
        if _INT.fullmatch(s):
            return int(s)
        if _INTEGRAL_FLOAT.fullmatch(s):
            return int(s.split(".")[0])
        return _FAIL
    if t == "number":
        if _INT.fullmatch(s):
            return int(s)
        if _FLOAT.fullmatch(s):
            f = float(s)
            return f if math.isfinite(f) else _FAIL
        return _FAIL
    if t == "boolean":
        low = s.lower()
        return True if low == "true" else False if low == "false" else _FAIL
    if t == "null":
        return None if s in ("null", "None") else _FAIL
    if t in ("object", "array"):
        value = _loads(s)
        if isinstance(value, dict if t == "object" else list):
            return value
        return _FAIL
    return _FAIL


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


def loads_json(text: str) -> Any:
    """JSON text as `json.loads` reads it, refusing (ValueError) NaN / Infinity and a lone surrogate escape
    ("\\ud800"): JSON's grammar allows one, but no UTF-8 text holds it, so the tokenizer and the response's
    encoder would fail on it (a 500) far from here."""
    value = json.loads(text, parse_constant=_reject_constant)
    if "\\u" in text and _holds_surrogate(value):
        raise ValueError("a lone surrogate escape is no character")
    return value


_SURROGATE = re.compile("[\ud800-\udfff]")


def _holds_surrogate(value: Any) -> bool:
    """Whether a parsed JSON value has a surrogate code point in a string (a pair's escapes read as one
    character, so any left is a lone one)."""
    if isinstance(value, str):
        return _SURROGATE.search(value) is not None
    if isinstance(value, dict):
        return any(_holds_surrogate(k) or _holds_surrogate(v) for k, v in value.items())
    if isinstance(value, list):
        return any(_holds_surrogate(v) for v in value)
    return False


def _loads(s: str) -> Any:
    try:
        return loads_json(s)
    except ValueError:
        pass
    except RecursionError:
        return _FAIL
    if not s or s[0] not in "[{":
        return _FAIL
    try:
        value = _literal(ast.parse(s, mode="eval").body)
    except (SyntaxError, ValueError, TypeError, RecursionError, MemoryError):
        return _FAIL
    return _FAIL if _holds_surrogate(value) else value


_NAMES = {"true": True, "false": False, "null": None, "True": True, "False": False, "None": None}


def _literal(node: ast.AST) -> Any:
    """A Python-literal expression, also reading JSON's true/false/null, into plain JSON values."""
    if isinstance(node, ast.Constant) and isinstance(node.value, (str, int, float, bool, type(None))):
        if isinstance(node.value, float) and not math.isfinite(node.value):
            raise ValueError("non-finite number")
        return node.value
    if isinstance(node, ast.Name) and node.id in _NAMES:
        return _NAMES[node.id]
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)):
        value = _literal(node.operand)
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ValueError("sign on a non-number")
        return -value if isinstance(node.op, ast.USub) else value
    if isinstance(node, (ast.List, ast.Tuple)):
        return [_literal(e) for e in node.elts]
    if isinstance(node, ast.Dict):
        out = {}
        for k, v in zip(node.keys, node.values):
            if k is None:
                raise ValueError("dict unpacking")
            key = _literal(k)
            if not isinstance(key, str):
                raise ValueError("non-string key")
            out[key] = _literal(v)
        return out
    raise ValueError(f"not a literal: {type(node).__name__}")
