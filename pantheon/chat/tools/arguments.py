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
from fractions import Fraction
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
    pointer into the schema, "#" itself) and each `allOf` of objects merged into its parent (`_merged`: properties
    and required keys joined, types, bounds and enums intersected; another keyword the parent lacks taken from the
    first member that has it), so that the call grammars and the argument typing see the keys and types that
    Pydantic-, zod- and MCP-style schemas declare through them. `$schema`, `$id`, `$defs` and `definitions` are
    dropped; a reference that resolves to nothing (or a remote one) becomes "any value"."""
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
    types intersected (`_common_types`), each bound the tighter of the two (`_tighter`), `enum` / `const` the
    values both allow (`_merge_values`), an enum left with the values of the merged type; any other keyword kept
    from `schema` when it has it, else taken (a second `pattern` or `format` is not enforced)."""
    if _draft4_bounds(schema) or _draft4_bounds(member):
        schema, member = _draft6_bounds(schema), _draft6_bounds(member)
    out = dict(schema)
    for key, value in member.items():
        if key == "properties" and isinstance(value, dict):
            props = out.get("properties")
            have = props if isinstance(props, dict) else {}
            out["properties"] = {**have, **{k: both_schemas(have[k], v) if k in have else v
                                            for k, v in value.items()}}
        elif key == "required" and isinstance(value, list):
            have = out.get("required") if isinstance(out.get("required"), list) else []
            out["required"] = have + [k for k in value if k not in have]
        elif key == "type" and "type" in out:
            out["type"] = _common_types(out["type"], value)
        elif key in _LOWER_BOUNDS or key in _UPPER_BOUNDS or key == "multipleOf":
            out[key] = _tighter(key, out[key], value) if key in out else value
        elif key not in out and key not in ("enum", "const"):
            out[key] = value
    _merge_values(out, schema, member)
    if isinstance(out.get("enum"), list) and _type_names(out.get("type")) is not None:
        out["enum"] = [v for v in out["enum"] if value_has_type(v, out["type"])]
    return out


# Bounds whose tighter value is the larger (a lower bound) or the smaller (an upper bound); each holds only
# values of one kind (numbers, strings, arrays, objects), so the tightest of each is what a value meets for both.
_LOWER_BOUNDS = ("minimum", "exclusiveMinimum", "minLength", "minItems", "minProperties", "minContains")
_UPPER_BOUNDS = ("maximum", "exclusiveMaximum", "maxLength", "maxItems", "maxProperties", "maxContains")


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _tighter(key: str, first: Any, second: Any) -> Any:
    """The bound `key` a value meeting both `first` and `second` meets; `first` where either is not a number.
    Two `multipleOf`s make their least common multiple (exact for the decimals a schema writes: 0.5 and 0.3
    make 1.5)."""
    if not (_is_number(first) and _is_number(second)):
        return first
    if key == "multipleOf":
        return _common_multiple(first, second)
    return max(first, second) if key in _LOWER_BOUNDS else min(first, second)


def _common_multiple(first: float, second: float) -> Any:
    if first <= 0 or second <= 0 or not (math.isfinite(first) and math.isfinite(second)):
        return first
    a, b = Fraction(repr(first)), Fraction(repr(second))  # repr: the decimal the schema wrote
    lcm = Fraction(math.lcm(a.numerator, b.numerator), math.gcd(a.denominator, b.denominator))
    return int(lcm) if lcm.denominator == 1 else float(lcm)


def _draft4_bounds(schema: dict) -> bool:
    return isinstance(schema.get("exclusiveMinimum"), bool) or isinstance(schema.get("exclusiveMaximum"), bool)


def _draft6_bounds(schema: dict) -> dict:
    """A schema's draft-4 bounds (`exclusiveMinimum: true` beside `minimum`) as draft-6 ones (`exclusiveMinimum`:
    the number), so that the bounds of two schemas written either way can be compared keyword by keyword."""
    out = dict(schema)
    for exclusive, inclusive in (("exclusiveMinimum", "minimum"), ("exclusiveMaximum", "maximum")):
        if not isinstance(out.get(exclusive), bool):
            continue
        if out.pop(exclusive) and _is_number(out.get(inclusive)):
            out[exclusive] = out.pop(inclusive)
    return out


def _merge_values(out: dict, schema: dict, member: dict) -> None:
    """Set `out`'s `enum` / `const` to the values both `schema` and `member` allow: a `const` stays one while both
    allow its value; values neither allows make an empty `enum`, the schema no value meets."""
    theirs = _allowed_values(member)
    if theirs is None:
        return
    mine = _allowed_values(schema)
    common = theirs if mine is None else [v for v in mine if any(_same_json(v, w) for w in theirs)]
    out.pop("enum", None)
    out.pop("const", None)
    if common and ("const" in schema or "const" in member):
        out["const"] = common[0]
    else:
        out["enum"] = common


def _allowed_values(schema: dict) -> list | None:
    """The values a schema's `enum` and `const` allow; None when it has neither."""
    values = list(schema["enum"]) if isinstance(schema.get("enum"), list) else None
    if "const" in schema:
        const = schema["const"]
        values = [const] if values is None else [v for v in values if _same_json(v, const)]
    return values


def _same_json(first: Any, second: Any) -> bool:
    """JSON equality, as `enum` and `const` compare: 1 and 1.0 are one number, true is not 1."""
    if isinstance(first, bool) or isinstance(second, bool):
        return isinstance(first, bool) and isinstance(second, bool) and first == second
    if _is_number(first) or _is_number(second):
        return _is_number(first) and _is_number(second) and first == second
    if isinstance(first, list) and isinstance(second, list):
        return len(first) == len(second) and all(_same_json(a, b) for a, b in zip(first, second))
    if isinstance(first, dict) and isinstance(second, dict):
        return first.keys() == second.keys() and all(_same_json(v, second[k]) for k, v in first.items())
    return type(first) is type(second) and first == second


def value_has_type(value: Any, declared: Any) -> bool:
    """Whether a JSON value is of one of the types a `type` keyword names (an integral number is an "integer",
    every integer a "number"); True when the keyword names none it can read."""
    names = _type_names(declared)
    if names is None:
        return True
    kind = _type_of(value)
    if kind == "number" and float(value).is_integer():
        kind = "integer"
    return kind in names or (kind == "integer" and "number" in names)


def both_schemas(first: Any, second: Any) -> Any:
    """One schema for a value that must meet two (boolean schemas included)."""
    if first is False or second is False:
        return False
    if first is True:
        return second
    if isinstance(first, dict) and isinstance(second, dict):
        return _merged(first, second)
    return first


def key_schema(schema: Any, key: str) -> Any:
    """The schema the value at `key` of an object held to `schema` meets: its `properties` entry merged with
    the schema of every `patternProperties` regex that matches the key (JSON schema applies them all), else its
    `additionalProperties`; None when nothing holds the key, or a regex Python cannot read might. So that a
    key declared only through `required` and a pattern (`"^q$": {"type": "integer"}`) is typed as the pattern
    says, not written as text."""
    if not isinstance(schema, dict):
        return None
    props = schema.get("properties") if isinstance(schema.get("properties"), dict) else {}
    patterns = schema.get("patternProperties") if isinstance(schema.get("patternProperties"), dict) else {}
    held = [props[key]] if key in props else []
    unsure = False
    for pattern, sub in patterns.items():
        hit = _pattern_matches(pattern, key)
        unsure = unsure or hit is None
        if hit:
            held.append(sub)
    if not held:
        return None if unsure else schema.get("additionalProperties")
    out = held[0]
    for sub in held[1:]:
        out = both_schemas(out, sub)
    return out


def _pattern_matches(pattern: Any, key: str) -> bool | None:
    """Whether a `patternProperties` regex (ECMA 262, a search) matches `key`, read as Python's regex; None
    where Python cannot read it."""
    try:
        return re.search(pattern, key) is not None
    except (re.error, TypeError):
        return None


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
    declared = _type_names(schema.get("type"))
    if declared is not None:
        return declared
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
    if not isinstance(parameters, dict):
        return arguments
    return {k: type_json_value(v, key_schema(parameters, k)) for k, v in arguments.items()}


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
