"""llguidance Lark grammars for tool calls and JSON answers.

`tool_call_grammar` writes, for a grammar-capable dialect, either a "required" grammar (the output is exactly
one well-formed call, after optional whitespace) or an "auto" grammar (free text in which every call, once
its opener appears, must be well formed; any number of calls). Arguments follow the tool's schema: every
required key (required keys first, then the optional ones, each in schema order), text values free except
for the closing tag (held to their string schema's minLength, maxLength, pattern and common formats where it
sets them: `_xml_text`), integers, numbers and booleans by regex, objects, arrays and non-text enums through
llguidance's `%json`. In the JSON dialect's "auto" grammar only a ```json fence opens a constrained call: a
bare object cannot be told from text at its first byte, so it stays free text (the parser still reads it). Its
arguments object, and every object in it with `properties`, takes only the keys it declares unless its
`additionalProperties` says otherwise (`_closed`), as the XML dialects write only declared parameters.
`minicpm_call_grammar` writes the "required" grammar of MiniCPM's attribute XML, which has no "auto" one.

A serve arms an "auto" grammar lazily (`auto_call_markers`, `LazyGrammarController`): the answer decodes
unconstrained until it writes an opener, then a matcher of the grammar (without the think prelude) reads the
text from the opener on and holds the call; once the call has closed the text is free again. Masking the free
text with the whole-turn grammar shifted every logprob (it refuses tokens that are lone UTF-8 continuation
bytes) and kept the end token out of the think block.

The reasoning block, when the decode has one, comes first and is unconstrained: `think="open"` when the
prompt already opened it (the output starts inside it, up to "</think>"), `think="optional"` when the output
may start with "<think>...</think>".

The end token is allowed only where the grammar is complete, never inside a call: a serve that lets a model
end a call early checks which of `Dialect.closing_texts()` a copy of the matcher accepts, and appends it.

Markers are written as text. That matches vocabularies in which "<tool_call>" or "</think>" is an ordinary
(user-defined) token, as in Qwen GGUFs; where a GGUF marks one as a control token, llguidance treats it as
a special token that text in a grammar can never match.
"""

from __future__ import annotations

from collections.abc import Callable
import json
import re
from typing import Any

from pantheon.chat.tools.arguments import both_schemas, key_schema, resolved_schema, schema_types
from pantheon.chat.tools.base import Dialect, ToolSpec
from pantheon.errors import invalid_request

MODES = ("required", "auto")
THINK = ("none", "open", "optional")

# Whitespace between structural parts, and inside every %json value (llguidance's `whitespace_pattern`), is
# at most 20 characters at a time, as llama.cpp's JSON grammars bound it: unbounded, a sampled run of tabs
# once filled all 200 tokens of a request inside the object and never closed it.
_JSON_OPTIONS = {"lenient": True, "whitespace_pattern": r"[ \t\n\r]{0,20}"}
_COMMON = r"""
WS: /[ \t\r\n]{1,20}/
think_body[lazy]: /(?s:.*)<\/think>/
"""
_PRELUDE = {"none": "", "open": "think_body", "optional": '("<think>" think_body)?'}
# The texts that open a call an "auto" grammar holds, and those that close one, per dialect (`auto_call_markers`).
_AUTO_OPENERS = {"qwen_xml": ("<tool_call>", "<function="), "json": ("```json",)}
_AUTO_CALL_ENDS = {"qwen_xml": ("</tool_call>", "</function>"), "json": ("```",)}
_INT = r"/-?(0|[1-9][0-9]*)/"
_UINT = r"/(0|[1-9][0-9]*)/"
_NUMBER = r"/-?(0|[1-9][0-9]*)(\.[0-9]+)?([eE][+-]?[0-9]+)?/"


def tool_call_grammar(dialect: Dialect, tools: list[ToolSpec], *, mode: str, function: str | None = None,
                      think: str = "none") -> str:
    """A Lark grammar (llguidance dialect) constraining a decode to `dialect`'s calls of `tools`.

    Raises ValueError for a dialect without grammars or an unknown mode/think value, and a 400 ApiError
    when `function` is not among `tools` or "required" has no tool to call.
    """
    if not dialect.grammar_capable:
        raise ValueError(f"the {dialect.name} dialect has no grammar")
    return _call_grammar(_qwen_xml if dialect.name == "qwen_xml" else _json_calls, tools, mode, function, think)


def auto_call_markers(dialect: Dialect) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """(openers, ends) of the calls `dialect`'s "auto" grammar holds: a serve arms the grammar where an opener
    appears and feeds it the text from there; after a call the free text starts past its last end marker. In the
    JSON dialect only the fence opens a held call, as in the grammar (a bare object, or one in <tool_call>, stays
    text the parser reads)."""
    if not dialect.grammar_capable:
        raise ValueError(f"the {dialect.name} dialect has no \"auto\" grammar")
    return _AUTO_OPENERS[dialect.name], _AUTO_CALL_ENDS[dialect.name]


def minicpm_call_grammar(dialect: Dialect, tools: list[ToolSpec], *, function: str | None = None,
                         think: str = "none") -> str:
    """A Lark grammar for a turn that must call (tool_choice "required", or a named function) in MiniCPM's
    attribute XML, the dialect with no "auto" grammar (its free text cannot be told from a call's opening
    before the tag is written out). After the optional reasoning the output is one call to an offered
    function: <function name="NAME">, then its arguments as <param name="KEY">VALUE</param> (required keys
    first, then optional ones, each in schema order, as the Qwen XML grammar has them; typed values as there;
    text values, CDATA included, free up to </param>), then </function>. So the end token is refused before
    the call opens, and inside it wherever no closing text (`Dialect.closing_texts`) completes it."""
    if dialect.name != "minicpm_xml":
        raise ValueError(f"the {dialect.name} dialect has a full call grammar (tool_call_grammar)")
    return _call_grammar(_minicpm_required, tools, "required", function, think)


def _call_grammar(build: Callable[[list[ToolSpec], str, str], str], tools: list[ToolSpec], mode: str,
                  function: str | None, think: str) -> str:
    """The checks both call grammars make, then `build(offered tools, mode, prelude)` and the common rules."""
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, not {mode!r}")
    if think not in THINK:
        raise ValueError(f"think must be one of {THINK}, not {think!r}")
    offered = tools
    if function is not None:
        offered = [t for t in tools if t.name == function]
        if not offered:
            raise invalid_request(f"tool_choice names function {function!r}, which is not in 'tools'")
    if mode == "required" and not offered:
        raise invalid_request("tool_choice 'required' needs at least one tool")
    return build(offered, mode, _PRELUDE[think]) + _COMMON


def json_object_grammar(schema: dict | None, *, think: str = "none") -> str:
    """A Lark grammar for one JSON object (valid for `schema` when given), after an optional think block."""
    if think not in THINK:
        raise ValueError(f"think must be one of {THINK}, not {think!r}")
    target = _json_schema(resolved_schema(schema)) if schema else {"type": "object", "x-guidance": dict(_JSON_OPTIONS)}
    return f"start: {_PRELUDE[think]} WS? answer\nanswer: %json {_dump(target)}\n" + _COMMON


# --- MiniCPM attribute XML ("required" only) ---


def _minicpm_required(tools: list[ToolSpec], mode: str, prelude: str) -> str:
    close_param, close_call = _lit("</param>"), _lit("</function>")
    rules = [f"start: {prelude} WS? call", "call: " + " | ".join(f"f_{i}" for i in range(len(tools))),
             r"param_text[lazy]: /(?s:.*)<\/param>/"]
    for i, tool in enumerate(tools):
        parts = [_lit(f'<function name="{tool.name}">')]
        for j, (key, schema, required) in enumerate(_arguments_in_order(tool)):
            value = _xml_value(schema, f"v_{i}_{j}", rules)
            opener = _lit(f'<param name="{key}">')
            if value is None:  # free text up to </param>, or text held to the schema's string constraints
                value = _xml_text(schema, f"t_{i}_{j}", "</param>", rules) or "param_text"
            else:
                value = f"{value} {close_param}"
            rules.append(f"p_{i}_{j}: WS? {opener} {value}")
            parts.append(f"p_{i}_{j}" + ("" if required else "?"))
        rules.append(f"f_{i}: " + " ".join(parts) + f" WS? {close_call}")
    return "\n".join(rules) + "\n"


# --- Qwen3-Coder XML ---


def _qwen_xml(tools: list[ToolSpec], mode: str, prelude: str) -> str:
    rules: list[str] = []
    functions = " | ".join(_qwen_function(i, t, rules) for i, t in enumerate(tools))
    if mode == "required":
        head = [
            f"start: {prelude} WS? call",
            r'call: "<tool_call>\n<function=" fn "</function>\n</tool_call>"',
        ]
    else:
        openers = "|".join(_AUTO_OPENERS["qwen_xml"])
        head = [
            f"start: {prelude} (before_call call | before_bare_call bare_call)* TAIL" if tools else
            f"start: {prelude} TAIL",
            r"before_call[lazy]: /(?s:.*)<tool_call>/",
            r"before_bare_call[lazy]: /(?s:.*)<function=/",
            r'call: "\n<function=" fn "</function>\n</tool_call>"',
            r'bare_call: fn "</function>"',
            rf"TAIL: /(?s:.*)/ & ~/(?s:.*)({openers})(?s:.*)/",
        ]
    if tools:
        head.append(f"fn: {functions}")
    head.append(r"text_value[lazy]: /(?s:.*)<\/parameter>/")
    return "\n".join(head + rules) + "\n"


def _qwen_function(i: int, tool: ToolSpec, rules: list[str]) -> str:
    """Add the rules of one function's call body; return the rule's name."""
    parts = [_lit(f"{tool.name}>\n")]
    for j, (key, schema, required) in enumerate(_arguments_in_order(tool)):
        value = _xml_value(schema, f"v_{i}_{j}", rules)
        opener = _lit(f"<parameter={key}>\n")
        if value is None:  # free text, or text held to the schema's string constraints: ends with the closing tag
            text = _xml_text(schema, f"t_{i}_{j}", "</parameter>", rules, newline=True) or "text_value"
            rules.append(f'p_{i}_{j}: {opener} {text} "\\n"')
        else:
            rules.append(f'p_{i}_{j}: {opener} {value} "\\n</parameter>\\n"')
        parts.append(f"p_{i}_{j}" + ("" if required else "?"))
    rules.append(f"fn_{i}: " + " ".join(parts))
    return f"fn_{i}"


def _arguments_in_order(tool: ToolSpec) -> list[tuple[str, dict, bool]]:
    """(name, schema, required) of a tool's arguments in the order its calls' grammars take them: the required
    ones first (declared ones in schema order, then any the schema requires without declaring), then the
    optional ones in schema order. Each is typed by `key_schema`: a key that only `required` and a
    patternProperties regex declare takes the pattern's schema."""
    params = tool.arguments_schema
    props = params.get("properties") if isinstance(params.get("properties"), dict) else {}
    required = params.get("required") if isinstance(params.get("required"), list) else []
    required = [k for k in props if k in required] + [k for k in required if isinstance(k, str) and k not in props]
    return [(key, _as_dict(key_schema(params, key)), key in required)
            for key in required + [k for k in props if k not in required]]


def _as_dict(schema: Any) -> dict:
    """A schema for the grammars' readers: a boolean one (or none) reads as any value."""
    return schema if isinstance(schema, dict) else {}


def _xml_value(schema: dict, name: str, rules: list[str]) -> str | None:
    """The grammar of a typed XML value; None for free text (which runs up to the closing tag)."""
    if isinstance(schema.get("enum"), list) and schema["enum"]:
        return "(" + " | ".join(_lit(v if isinstance(v, str) else json.dumps(v)) for v in schema["enum"]) + ")"
    if "const" in schema:
        v = schema["const"]
        return _lit(v if isinstance(v, str) else json.dumps(v))
    types = schema_types(schema)
    if not types or "string" in types:
        return None
    scalars = {"integer": _int_regex(schema), "number": _NUMBER, "boolean": '("true" | "false")', "null": '"null"'}
    bounded = any(k in schema for k in ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum", "multipleOf"))
    if all(t in scalars for t in types) and not bounded:  # bounds: llguidance's %json enforces them
        return "(" + " | ".join(scalars[t] for t in types) + ")" if len(types) > 1 else scalars[types[0]]
    rules.append(f"{name}: %json {_dump(_json_schema(schema))}")
    return name


# Regexes of the string formats an XML text value is held to (RFC 3339 dates and times, RFC 4122 UUIDs, dotted
# IPv4, a plain address); a format not named here leaves the text free, as llguidance's lenient %json leaves one
# it does not know.
_DATE = r"[0-9]{4}-(0[1-9]|1[0-2])-(0[1-9]|[12][0-9]|3[01])"
_TIME = r"([01][0-9]|2[0-3]):[0-5][0-9]:([0-5][0-9]|60)(\.[0-9]+)?([Zz]|[+-]([01][0-9]|2[0-3]):[0-5][0-9])"
_OCTET = r"(25[0-5]|2[0-4][0-9]|1[0-9][0-9]|[1-9]?[0-9])"
_FORMATS = {
    "date": _DATE,
    "time": _TIME,
    "date-time": f"{_DATE}[Tt ]{_TIME}",
    "uuid": r"[0-9a-fA-F]{8}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{12}",
    "ipv4": rf"({_OCTET}\.){{3}}{_OCTET}",
    "email": r"[A-Za-z0-9._%+-]+@[A-Za-z0-9-]+(\.[A-Za-z0-9-]+)+",
}


def _xml_text(schema: dict, name: str, close: str, rules: list[str], *, newline: bool = False) -> str | None:
    """The rule of a text value held to its string schema's `minLength`, `maxLength`, `pattern` and `format`,
    its closing tag `close` included (after a line break with `newline`), as the free text's rule has it; None
    when the schema sets none of them or admits other types. An XML value is the string itself, unquoted and
    unescaped, so the constraints apply to the text as written: one lexeme, the intersection of their regexes
    and of "no closing tag inside" (the parsers end the value at the first one)."""
    if schema_types(schema) != ["string"]:
        return None
    parts = []
    low, high = _count(schema.get("minLength")), _count(schema.get("maxLength"))
    if low or high is not None:
        parts.append(f"/(?s:.{{{low or 0},{'' if high is None else high}}})/")
    pattern = schema.get("pattern")
    if isinstance(pattern, str) and pattern:
        parts.append(f"/{_regex_literal(_search(pattern))}/")
    if schema.get("format") in _FORMATS:
        parts.append(f"/{_regex_literal(_FORMATS[schema['format']])}/")
    if not parts:
        return None
    tag = _regex_literal(re.escape(close))
    parts.append(f"~/(?s:.*){tag}(?s:.*)/")
    line_break = r"\n" if newline else ""
    rules.append(f"{name}[lazy]: ({' & '.join(parts)}) /{line_break}{tag}/")
    return name


def _count(value: Any) -> int | None:
    """A length bound: a non-negative integer (1.0 reads as 1), else None."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0 or not float(value).is_integer():
        return None
    return int(value)


def _search(pattern: str) -> str:
    """A JSON schema `pattern` (a search: it may match anywhere in the string unless anchored) as a regex the
    whole text must match: a leading ^ and a trailing unescaped $ are the anchors they are; an end without
    one is left open."""
    start = pattern.startswith("^")
    body = pattern[1:] if start else pattern
    end = False
    if body.endswith("$"):
        backslashes = len(body) - 1 - len(body[:-1].rstrip("\\"))
        if backslashes % 2 == 0:
            end, body = True, body[:-1]
    return ("" if start else "(?s:.*)") + f"(?:{body})" + ("" if end else "(?s:.*)")


def _regex_literal(regex: str) -> str:
    """`regex` inside a Lark /.../ literal: its slashes escaped, its line breaks written as escapes."""
    out, escaped = [], False
    for ch in regex:
        if ch == "/" and not escaped:
            out.append("\\/")
        elif ch == "\n":
            out.append("\\n")
        elif ch == "\r":
            out.append("\\r")
        else:
            out.append(ch)
        escaped = ch == "\\" and not escaped
    return "".join(out)


def _int_regex(schema: dict) -> str:
    low = schema.get("minimum", schema.get("exclusiveMinimum"))
    return _UINT if isinstance(low, (int, float)) and not isinstance(low, bool) and low >= 0 else _INT


# --- JSON calls ---


def _json_calls(tools: list[ToolSpec], mode: str, prelude: str) -> str:
    shapes = []
    for key in ("name", "function"):
        for t in tools:
            shapes.append({
                "type": "object",
                "properties": {key: {"const": t.name}, "arguments": _json_schema(_closed_arguments(t), root=False)},
                "required": [key, "arguments"],
                "additionalProperties": False,
            })
    call = f"call_object: %json {_dump({'anyOf': shapes, 'x-guidance': dict(_JSON_OPTIONS)})}" if tools else ""
    if mode == "required":
        lines = [f"start: {prelude} WS? (call_object | fenced_call)",
                 'fenced_call: "```json" WS? call_object WS? "```"', call]
    elif tools:
        lines = [f"start: {prelude} (before_call fenced_call)* TAIL",
                 r"before_call[lazy]: /(?s:.*)```json/",
                 'fenced_call: WS? call_object WS? "```"',
                 r"TAIL: /(?s:.*)/ & ~/(?s:.*)```json(?s:.*)/", call]
    else:
        lines = [f"start: {prelude} TAIL", r"TAIL: /(?s:.*)/ & ~/(?s:.*)```json(?s:.*)/"]
    return "\n".join(lines) + "\n"


# An object schema declares its keys (and is closed to the others) through these; other keywords there say
# nothing about which keys it has.
_KEY_KEYWORDS = ("properties", "required", "additionalProperties", "patternProperties", "unevaluatedProperties",
                 "propertyNames", "minProperties", "maxProperties", "dependentRequired", "dependentSchemas")
# Subschemas that hold the same value as the schema they sit in (in a list, one each, in a map of keys), and
# subschemas that hold values inside it. `if` and `not` are conditions, not constraints: they are left as sent
# (closed, they would change which values they match).
_SAME_VALUE = ("allOf", "anyOf", "oneOf")
_SAME_VALUE_ONE = ("then", "else")
_SAME_VALUE_MAPS = ("dependentSchemas",)
_INNER_MAPS = ("properties", "patternProperties")
_INNER_ONE = ("items", "additionalItems", "additionalProperties", "contains", "unevaluatedItems")


def _closed_arguments(tool: ToolSpec) -> dict:
    """The arguments schema of a JSON-dialect call with its objects closed (`_closed`): the arguments object
    always, as the XML dialects write only declared parameters (a tool without parameters is called with {})."""
    out = _closed(tool.arguments_schema, "always")
    out.setdefault("type", "object")
    return out


def _closed(schema: Any, close: str = "declared") -> Any:
    """A schema whose objects take the keys it declares and no others, as llama.cpp's schema-to-grammar and
    vLLM's xgrammar read one without `additionalProperties` (llguidance lets the model add any key there, and it
    wrote the tool's schema itself into the arguments). `close`: "always" closes this object, "declared" only
    when it has `properties` (`{"type": "object"}` alone stays a free-form object), "never" leaves it open (a
    member of a combinator beside the keys of the object it combines into: closed, it would refuse those keys).

    A closed object's keys are its properties, its required keys and those its allOf / anyOf / oneOf / then /
    else / dependentSchemas members declare (each added as a property of any value, which the member still holds
    to its own schema), so that no value the schema admitted with only those keys is refused. An object that says
    itself which other keys it takes (`additionalProperties`, `unevaluatedProperties: true`), or whose
    minProperties its keys cannot meet, is left as it is; one with `unevaluatedProperties` false (or a schema),
    which llguidance ignores, is closed over the same keys in any case, the keyword becoming the
    `additionalProperties` it means there. Patterns that name only keys it already has are folded into them
    (`_fold_literal_patterns`)."""
    if not isinstance(schema, dict):
        return schema
    out = dict(schema)
    for key in _INNER_MAPS:
        if isinstance(out.get(key), dict):
            out[key] = {k: _closed(v) for k, v in out[key].items()}
    for key in _INNER_ONE:
        if isinstance(out.get(key), dict):
            out[key] = _closed(out[key])
    for key in ("prefixItems", "items"):
        if isinstance(out.get(key), list):
            out[key] = [_closed(v) for v in out[key]]
    closing = close == "always" or (close == "declared" and "properties" in out)
    closing = closing and "additionalProperties" not in out and "unevaluatedProperties" not in out
    keys = _declared_keys(out)
    low = out.get("minProperties")
    if closing and isinstance(low, (int, float)) and low > len(keys) and "patternProperties" not in out:
        closing = False
    others: Any = False  # what the keys the object does not declare take, once it is closed
    if "additionalProperties" not in out and out.get("unevaluatedProperties", True) not in (True, {}):
        closing, others = True, _closed(out.pop("unevaluatedProperties"))
    # Members stand alone only beside a schema that says nothing of keys: `{"anyOf": [object A, object B]}`.
    alone = close != "never" and not closing and not any(k in out for k in _KEY_KEYWORDS)
    member_close = "declared" if alone else "never"
    for key in _SAME_VALUE:
        if isinstance(out.get(key), list):
            out[key] = [_closed(v, member_close) for v in out[key]]
    for key in _SAME_VALUE_ONE:
        if isinstance(out.get(key), dict):
            out[key] = _closed(out[key], member_close)
    for key in _SAME_VALUE_MAPS:
        if isinstance(out.get(key), dict):
            out[key] = {k: _closed(v, member_close) for k, v in out[key].items()}
    if closing:
        props = out.get("properties") if isinstance(out.get("properties"), dict) else {}
        out["properties"] = {**props, **{k: {} for k in keys if k not in props}}
        out["additionalProperties"] = others
    return _fold_literal_patterns(out)


def _fold_literal_patterns(schema: dict) -> dict:
    """`schema` with each patternProperties regex that names only keys the object already has (its properties
    and required keys: `"^q$"` beside a required "q") folded into those keys' properties and dropped. llguidance
    writes an object's keys in order, then lets any key a pattern (or additionalProperties) admits follow: one
    that admits none but the keys already written still lets ", " follow the last of them, and then nothing can
    (a dead end, where seeds ended the turn inside the call). Folded, the keys keep the pattern's schema."""
    patterns = schema.get("patternProperties")
    if not isinstance(patterns, dict) or not patterns:
        return schema
    props = dict(schema["properties"]) if isinstance(schema.get("properties"), dict) else {}
    required = schema.get("required") if isinstance(schema.get("required"), list) else []
    named = set(props) | {k for k in required if isinstance(k, str)}
    kept = {}
    for pattern, sub in patterns.items():
        keys = _literal_keys(pattern)
        if keys is None or not set(keys) <= named:
            kept[pattern] = sub
            continue
        for key in keys:
            props[key] = both_schemas(props.get(key, True), sub)
    if len(kept) == len(patterns):
        return schema
    out = {**schema, "properties": props, "patternProperties": kept}
    if not kept:
        del out["patternProperties"]
    return out


# Regex syntax in a pattern; anything else stands for itself, as does punctuation escaped with a backslash.
_REGEX_SYNTAX = frozenset("\\^$.|?*+()[]{}")


def _literal_keys(pattern: Any) -> list[str] | None:
    """The keys a patternProperties regex matches when it names a few literally: `^name$`, `^(a|b)$`, `^(?:a|b)$`
    (punctuation escaped or not); None for any other regex, which may match keys no one declared."""
    if not isinstance(pattern, str) or not pattern.startswith("^"):
        return None
    tokens: list[tuple[bool, str]] = []  # (is syntax, character)
    i = 1
    while i < len(pattern):
        ch = pattern[i]
        if ch == "\\":
            if i + 1 >= len(pattern) or pattern[i + 1].isalnum() or pattern[i + 1] == "_":
                return None  # \d, \w, \u0041 ... : a class or an escape read here as no key
            tokens.append((False, pattern[i + 1]))
            i += 2
            continue
        tokens.append((ch in _REGEX_SYNTAX, ch))
        i += 1
    if not tokens or tokens[-1] != (True, "$"):
        return None
    body, grouped = tokens[:-1], False
    for opener in ([(True, "("), (True, "?"), (False, ":")], [(True, "(")]):
        if body[:len(opener)] == opener and body[-1:] == [(True, ")")]:
            body, grouped = body[len(opener):-1], True
            break
    keys, current = [], ""
    for syntax, ch in body + [(True, "|")]:
        if syntax and ch == "|":
            keys.append(current)
            current = ""
        elif syntax:
            return None
        else:
            current += ch
    if len(keys) > 1 and not grouped:
        return None  # "^a|b$" is "^a" or "b$", no group around the choice
    return keys


def _declared_keys(schema: dict) -> list[str]:
    """The keys an object schema names: its properties, required and dependentRequired keys, and those of its
    members that hold the same value (allOf / anyOf / oneOf / then / else / dependentSchemas), in that order."""
    keys: list[str] = []

    def add(names: Any) -> None:
        for name in names if isinstance(names, (list, dict)) else ():
            if isinstance(name, str) and name not in keys:
                keys.append(name)

    add(schema.get("properties"))
    add(schema.get("required"))
    dependent = schema.get("dependentRequired")
    if isinstance(dependent, dict):
        add(dependent)
        for names in dependent.values():
            add(names)
    members = [m for k in _SAME_VALUE if isinstance(schema.get(k), list) for m in schema[k]]
    members += [schema[k] for k in _SAME_VALUE_ONE if k in schema]
    members += [m for k in _SAME_VALUE_MAPS if isinstance(schema.get(k), dict) for m in schema[k].values()]
    for member in members:
        if isinstance(member, dict):
            add(_declared_keys(member))
    return keys


# --- helpers ---


def _lit(text: str) -> str:
    """A Lark string literal."""
    return json.dumps(text, ensure_ascii=False)


def _dump(schema: Any) -> str:
    return json.dumps(schema, ensure_ascii=False, separators=(",", ":"))


def _json_schema(schema: dict, *, root: bool = True) -> dict:
    """A schema already through `resolved_schema` (a tool's `arguments_schema` or a part of it) made ready for
    %json: a copy, typed "object" where it has properties, lenient about keywords llguidance lacks (ignored
    rather than failing the grammar) at the root."""
    out = dict(schema)
    if "properties" in out and "type" not in out:
        out["type"] = "object"
    if root:
        out["x-guidance"] = dict(_JSON_OPTIONS)
    return out
