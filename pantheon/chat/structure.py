"""What constrains a request's output: tool calls (which dialect, which tools, whether a grammar compels the
call) and response_format (JSON). Decided per request; the grammar becomes a GrammarController per choice.

Which requests are grammar-constrained (PANTHEON_TOOL_GRAMMAR):
  unset -> tool_choice "required" only; "1" -> every request with tools ("auto" masks once a call opener
  appears: its grammar is lazy, armed at the opener by a `LazyGrammarController`; "required" and a named
  function compel a call from the first token); "0" -> none. A named function without "1" behaves like "auto".
  MiniCPM's attribute dialect has no "auto" grammar, only one for a turn that must call.
Before any tool-call grammar is built, the tools' parameters are checked (`_check_enforceable`): one that is
not a JSON schema, or that no arguments meet, is a 400 in every dialect. Tools win over response_format.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import jsonschema
import llguidance

from pantheon.chat.request import ChatRequest
from pantheon.chat.tools import (Dialect, ToolSpec, dialect_for, json_object_grammar, minicpm_call_grammar,
                                 parse_tools, tool_call_grammar)
from pantheon.chat.tools.arguments import key_schema, schema_types, value_has_type
from pantheon.chat.tools.grammar import auto_call_markers
from pantheon.config import EnvKnobs
from pantheon.engine.constraints import GrammarController, LazyGrammarController
from pantheon.engine.loader import LoadedModel
from pantheon.errors import ApiError, invalid_request


# Ways to finish an open JSON value (string, array of strings, object ...) before a call's closing text.
JSON_VALUE_CLOSERS = ('"', "]", '"]', "}", '"}', "]}", '"]}', "}]", '"}]', "\n]", "\n}")


@dataclass
class Structure:
    dialect: Dialect
    tools: list[ToolSpec] = field(default_factory=list)
    grammar: str | None = None
    response_format_status: str | None = None
    json_constrained: bool = False  # a response_format JSON grammar is armed (for "not_enforced")
    call_forced: bool = False  # a tool-call grammar compels a call ("required" or a named function)
    lazy: bool = False  # an "auto" tool-call grammar: armed once the answer writes a call opener
    # `grammar` compiled once (None without a grammar or a grammar tokenizer); each choice decodes with a copy.
    matcher: Any = None


def model_dialect(served: LoadedModel) -> Dialect:
    source = None if served.template.is_fallback else served.template.source
    return dialect_for(served.name, served.architecture, source)


def required_with_thinking(served: LoadedModel, env: EnvKnobs) -> bool:
    """`tool_choice_required_with_thinking` on /v1/models."""
    return model_dialect(served).grammar_capable and env.tool_grammar is not False


def offered_tools(served: LoadedModel, request: ChatRequest) -> tuple[Dialect, list[ToolSpec]]:
    dialect = model_dialect(served)
    tools = parse_tools(request.tools) if request.tools else []
    if request.tool_choice == "none":
        return dialect, []
    for tool in tools:
        # Resolved now, while building the prompt (`completion.start_completion`), rather than when a call is first
        # parsed: parameters nested past the resolver's recursion are then the request's error, not the stream's.
        tool.arguments_schema  # noqa: B018 - a cached property: the point is computing it here
    return dialect, tools


def _named_function(tool_choice: Any, enforced: bool) -> str | None:
    """The function a named tool_choice names. Only an enforced one (PANTHEON_TOOL_GRAMMAR=1) is read; any other
    object behaves like "auto", whatever its shape or name (spec)."""
    if isinstance(tool_choice, dict):
        if not enforced:
            return None
        function = tool_choice.get("function")
        name = function.get("name") if isinstance(function, dict) else None
        if not isinstance(name, str) or not name:
            raise invalid_request("tool_choice: a named choice needs function.name")
        return name
    if tool_choice not in ("auto", "required", "none"):
        raise invalid_request("tool_choice must be \"none\", \"auto\", \"required\" or a named function")
    return None


def _admits_no_value(schema: Any, *, an_object: bool = False) -> bool:
    """Whether a schema (already through `resolved_schema`) is one that no value meets on its face: `false`, an
    empty `enum` (as an allOf of enums or consts with no value in common merges to), an `enum` or `const` whose
    values are none of its `type`, `not` of everything, an empty `type` list (an allOf whose members share no
    type), an object that requires a key its schema forbids or holds to a schema of this kind (or an `allOf`
    holding one of these). `an_object`: the value is an object whatever the schema says (a call's arguments);
    otherwise a schema's `required` binds only where it admits objects alone. Bounds that cross (minimum >
    maximum) llguidance refuses itself."""
    if schema is False:
        return True
    if not isinstance(schema, dict):
        return False
    if isinstance(schema.get("enum"), list) and not any(value_has_type(v, schema.get("type")) for v in schema["enum"]):
        return True
    if "const" in schema and not value_has_type(schema["const"], schema.get("type")):
        return True
    if "not" in schema and (schema["not"] is True or schema["not"] == {}):
        return True
    if schema.get("type") == []:
        return True
    if (an_object or schema_types(schema) == ["object"]) and _required_key_no_value_meets(schema) is not None:
        return True
    parts = schema.get("allOf")
    return isinstance(parts, list) and any(_admits_no_value(part, an_object=an_object) for part in parts)


def _required_key_no_value_meets(schema: dict) -> str | None:
    """A key an object schema requires whose value no value meets (`key_schema`: its property, the
    patternProperties that match it, else additionalProperties, hold it to a schema of that kind). A key that a
    pattern Python cannot read might match is not judged."""
    required = schema.get("required")
    for key in required if isinstance(required, list) else ():
        if isinstance(key, str) and _admits_no_value(key_schema(schema, key)):
            return key
    return None


def _check_enforceable(tools: list[ToolSpec]) -> None:
    """Raise a 400 for a tool whose parameters a call grammar cannot enforce: not a JSON schema, or one that no
    arguments meet (a grammar would have to write something there that the schema then refuses). Every dialect's
    grammar is checked here, before it is built."""
    for tool in tools:
        try:
            jsonschema.validators.validator_for(tool.parameters).check_schema(tool.parameters)
        except jsonschema.SchemaError as exc:
            raise invalid_request(f"tools: function {tool.name!r} parameters are not a valid JSON schema: "
                                  f"{exc.message}") from None
        why = _why_no_arguments_meet(tool.arguments_schema)
        if why is not None:
            raise invalid_request(f"tools: function {tool.name!r} {why}: it cannot be enforced")


def _why_no_arguments_meet(schema: dict) -> str | None:
    """What makes a tool's arguments schema (`ToolSpec.arguments_schema`) one that no arguments meet, or None."""
    props = schema.get("properties")
    for key in (props if isinstance(props, dict) else ()):
        if _admits_no_value(key_schema(schema, key)):
            return f"parameter {key!r} has a schema no value meets"
    key = _required_key_no_value_meets(schema)
    if key is not None:  # not a declared one: those were judged above
        return f"requires parameter {key!r}, which its patternProperties or additionalProperties forbid"
    if _admits_no_value(schema, an_object=True):
        return "parameters have a schema no arguments meet"
    return None


def _tool_grammar(dialect: Dialect, tools: list[ToolSpec], request: ChatRequest, env: EnvKnobs,
                  think_mode: str) -> tuple[str | None, bool]:
    """The tool-call grammar of this request (None: decoded unconstrained), and whether it compels a call."""
    named = _named_function(request.tool_choice, enforced=env.tool_grammar is True)
    if request.tool_choice == "required" and not tools:
        raise invalid_request("tool_choice \"required\" needs at least one tool in 'tools'")
    if named is not None and named not in {t.name for t in tools}:
        raise invalid_request(f"tool_choice names function {named!r}, which is not among the offered tools")
    if not tools or env.tool_grammar is False:
        return None, False
    must_call = request.tool_choice == "required" or named is not None
    # No grammar models MiniCPM's free text ("auto"); a turn that must call still gets one for its call, so that
    # it cannot end before the call (spec: "every dialect"). By default only "required" is constrained.
    if not must_call and (not dialect.grammar_capable or env.tool_grammar is None):
        return None, False
    # The arguments' schemas become the grammar: one that is not a JSON schema, or that no arguments meet, is the
    # request's error, not a reason to decode unconstrained.
    _check_enforceable(tools)
    if not dialect.grammar_capable:
        return minicpm_call_grammar(dialect, tools, function=named, think=think_mode), True
    if env.tool_grammar is None:
        return tool_call_grammar(dialect, tools, mode="required", think=think_mode), True
    if named is not None:
        return tool_call_grammar(dialect, tools, mode="required", function=named, think=think_mode), True
    if request.tool_choice == "required":
        return tool_call_grammar(dialect, tools, mode="required", think=think_mode), True
    # "auto": armed at a call opener (`grammar_controller`), never in the think block, which is no part of it.
    return tool_call_grammar(dialect, tools, mode="auto"), False


def _response_format(request: ChatRequest, lltok: Any, think_mode: str
                     ) -> tuple[str | None, Any, str | None]:
    """(grammar, its compiled matcher (None without a grammar tokenizer), response_format_status) for
    response_format."""
    rf = request.response_format
    if rf is None:
        return None, None, None
    kind = rf.get("type")
    if kind == "text":
        return None, None, "applied"  # plain text: nothing to constrain
    if kind not in ("json_object", "json_schema"):
        return None, None, "ignored_unknown_type"
    status = "applied"
    if kind == "json_schema":
        # The schema's shape is enforced where it can be; a schema that is missing, not a valid JSON schema, or
        # beyond the grammar engine is downgraded to the plain JSON constraint ("schema_downgraded").
        spec = rf.get("json_schema")
        schema = spec.get("schema") if isinstance(spec, dict) else None
        if isinstance(schema, dict) and _valid_schema(schema):
            grammar = json_object_grammar(schema, think=think_mode)
            matcher, error = _compile(lltok, grammar) if lltok is not None else (None, None)
            if error is None:
                return grammar, matcher, status
        status = "schema_downgraded"
    plain = json_object_grammar(None, think=think_mode)
    if lltok is None:
        return plain, None, status
    matcher, error = _compile(lltok, plain)
    if error is not None:
        raise ApiError(500, "server_error", f"response_format grammar failed: {error}")
    return plain, matcher, status


def _valid_schema(schema: dict) -> bool:
    try:
        jsonschema.validators.validator_for(schema).check_schema(schema)
    except (jsonschema.SchemaError, RecursionError):  # nested too deeply to check is not usable either
        return False
    return True


def _compile(lltok: Any, grammar: str) -> tuple[Any, str | None]:
    """(the grammar's matcher, None), or (None, why it does not compile)."""
    try:
        matcher = llguidance.LLMatcher(lltok, llguidance.LLMatcher.grammar_from_lark(grammar), log_level=0)
    except Exception as exc:  # noqa: BLE001 - the engine reports unsupported features as plain errors
        return None, str(exc)
    return (None, matcher.get_error()) if matcher.is_error() else (matcher, None)


def plan(served: LoadedModel, request: ChatRequest, env: EnvKnobs, dialect: Dialect, tools: list[ToolSpec],
         think_mode: str) -> Structure:
    structure = Structure(dialect=dialect, tools=tools)
    lltok = served.lltokenizer
    structure.grammar, structure.call_forced = _tool_grammar(dialect, tools, request, env, think_mode)
    structure.lazy = structure.grammar is not None and not structure.call_forced
    if structure.grammar is not None and lltok is not None:
        # A schema that passes the metaschema but cannot be enforced (unsatisfiable bounds, a construct the
        # grammar engine lacks): refused, as an invalid one is, rather than decoded unconstrained.
        structure.matcher, error = _compile(lltok, structure.grammar)
        if error is not None:
            raise invalid_request(f"the tools' parameter schemas cannot be enforced by the grammar: {error}")
    if request.response_format is not None:
        if tools:  # tools offered (not turned off by tool_choice "none") win
            structure.response_format_status = "ignored_tools_present"
        else:
            grammar, matcher, structure.response_format_status = _response_format(request, lltok, think_mode)
            if grammar is not None:
                structure.grammar, structure.matcher, structure.json_constrained = grammar, matcher, True
    return structure


def grammar_controller(served: LoadedModel, structure: Structure, *, think: bool = False, opens_think: bool = False
                       ) -> GrammarController | LazyGrammarController | None:
    """A fresh controller for one choice (matchers are stateful). `think`, `opens_think`: the prompt's (the output
    may carry a think block; the prompt opened it), which a lazy "auto" grammar skips as the answer's splitter
    does."""
    if structure.matcher is None:
        return None
    tokenizer = served.tokenizer
    if structure.json_constrained:
        return GrammarController(structure.matcher.deep_copy(), vocab_size=served.model.vocab_size,
                                 eos_id=tokenizer.eos_id)
    texts = structure.dialect.closing_texts()
    closers = [tokenizer.encode(c) for c in texts]
    last_resort = [tokenizer.encode(p + c) for p in JSON_VALUE_CLOSERS for c in texts]

    def call() -> GrammarController:
        return GrammarController(structure.matcher.deep_copy(), vocab_size=served.model.vocab_size,
                                 eos_id=tokenizer.eos_id, closers=closers, last_resort_closers=last_resort)

    if not structure.lazy:
        return call()
    openers, ends = auto_call_markers(structure.dialect)
    return LazyGrammarController(call, served.lltokenizer.tokenize_bytes, tokenizer.token_bytes, openers=openers,
                                 call_ends=ends, think=think, opens_think=opens_think)
