"""Tool-call and JSON grammars, checked with llguidance matchers over the default model's vocabulary.

No model runs: each sample text is tokenized and fed to a matcher built from the generated grammar, which
must accept it (consumed, accepting), or reject it (a token refused). Samples the grammar accepts are also
parsed by the dialect's parser, which must find exactly the one call.
"""

from __future__ import annotations

import dataclasses
import json
import statistics
import time
from pathlib import Path

import llguidance
import llguidance.numpy as llnp
import numpy as np
import pytest

from pantheon.chat import structure
from pantheon.chat.request import parse_chat_request
from pantheon.chat.tools import DIALECTS, CallEnd, CallError, Dialect, parse_tools
from pantheon.chat.tools.grammar import minicpm_call_grammar, json_object_grammar, tool_call_grammar
from pantheon.config import read_env
from pantheon.engine.constraints import grammar_tokenizer
from pantheon.errors import ApiError
from pantheon.io.gguf_file import open_gguf
from pantheon.io.tokenizer import Tokenizer

SCHEMA_URL = "https://json-schema.org/draft/2020-12/schema"
BIG = 9007199254740991


def _tool(name: str, props: dict, required: list[str]) -> dict:
    return {"type": "function", "function": {"name": name, "description": f"{name}: see the docs {{like this}}",
                                             "parameters": {"$schema": SCHEMA_URL, "type": "object",
                                                            "properties": props, "required": required,
                                                            "additionalProperties": False}}}


def _int(**extra: object) -> dict:
    return {"type": "integer", "minimum": -BIG, "maximum": BIG, **extra}


# Shaped like what opencode sends: ten tools, draft 2020-12 schemas, JS-safe integer bounds, enums, arrays
# of objects.
OPENCODE_LIKE = parse_tools([
    _tool("bash", {"command": {"type": "string"}, "timeout": {"type": "number"}, "description": {"type": "string"}},
          ["command", "description"]),
    _tool("read", {"filePath": {"type": "string"}, "offset": _int(), "limit": _int()}, ["filePath"]),
    _tool("write", {"content": {"type": "string"}, "filePath": {"type": "string"}}, ["content", "filePath"]),
    _tool("edit", {"filePath": {"type": "string"}, "oldString": {"type": "string"}, "newString": {"type": "string"},
                   "replaceAll": {"type": "boolean"}}, ["filePath", "oldString", "newString"]),
    _tool("glob", {"pattern": {"type": "string"}, "path": {"type": "string"}}, ["pattern"]),
    _tool("grep", {"pattern": {"type": "string"}, "path": {"type": "string"}, "include": {"type": "string"}},
          ["pattern"]),
    _tool("list", {"path": {"type": "string"}, "ignore": {"type": "array", "items": {"type": "string"}}}, []),
    _tool("webfetch", {"url": {"type": "string", "format": "uri"},
                       "format": {"type": "string", "enum": ["text", "markdown", "html"]},
                       "timeout": {"type": "number", "minimum": 0}}, ["url", "format"]),
    _tool("todowrite", {"todos": {"type": "array", "items": {
        "type": "object", "properties": {
            "content": {"type": "string"}, "status": {"type": "string", "enum": ["pending", "in_progress", "done"]},
            "priority": {"type": "string", "enum": ["high", "medium", "low"]}, "id": {"type": "string"}},
        "required": ["content", "status", "priority", "id"], "additionalProperties": False}}}, ["todos"]),
    _tool("task", {"description": {"type": "string"}, "prompt": {"type": "string"},
                   "subagent_type": {"type": "string"}, "count": _int(minimum=1)},
          ["description", "prompt", "subagent_type"]),
])
QWEN = DIALECTS["qwen_xml"]
JSON = DIALECTS["json"]


class Vocab:
    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer
        self.ll = grammar_tokenizer(tokenizer)

    def matcher(self, grammar: str) -> llguidance.LLMatcher:
        m = llguidance.LLMatcher(self.ll, grammar, log_level=0)
        assert not m.is_error(), m.get_error()
        return m

    def run(self, grammar: str, text: str) -> str:
        """'accept', 'incomplete' (every token taken, more needed) or 'reject'."""
        m = self.matcher(grammar)
        ids = self.tokenizer.encode(text, parse_special=False)
        if m.validate_tokens(ids) < len(ids):
            return "reject"
        assert m.consume_tokens(ids)
        return "accept" if m.is_accepting() else "incomplete"

    def closing_texts_after(self, grammar: str, text: str, dialect: Dialect) -> list[str]:
        """The dialect's closing texts that take a matcher which has read `text` (and is not complete there) to
        the grammar's end: what a serve may append when the model ends its turn at that point."""
        m = self.matcher(grammar)
        assert m.consume_tokens(self.tokenizer.encode(text, parse_special=False))
        assert not m.is_accepting()
        closed = []
        for closing in dialect.closing_texts():
            trial = m.deep_copy()
            ids = self.tokenizer.encode(closing, parse_special=False)
            if trial.validate_tokens(ids) == len(ids) and trial.consume_tokens(ids) and trial.is_accepting():
                closed.append(closing)
        return closed

    def eos_allowed(self, grammar: str, text: str) -> bool:
        m = self.matcher(grammar)
        assert m.consume_tokens(self.tokenizer.encode(text, parse_special=False))
        mask = np.frombuffer(m.compute_bitmask(), dtype=np.uint8)
        eos = self.tokenizer.eos_id
        return bool(mask[eos // 8] >> (eos % 8) & 1)


@pytest.fixture(scope="module")
def vocab(default_model_path: Path) -> Vocab:
    gguf = open_gguf(default_model_path, read_env().cache_dir)
    return Vocab(Tokenizer.from_gguf_metadata(gguf.metadata))


def xml_call(name: str, params: list[tuple[str, str]]) -> str:
    body = "".join(f"<parameter={k}>\n{v}\n</parameter>\n" for k, v in params)
    return f"<tool_call>\n<function={name}>\n{body}</function>\n</tool_call>"


READ = xml_call("read", [("filePath", "src/main.py"), ("offset", "10")])
EDIT = xml_call("edit", [("filePath", "a.py"), ("oldString", "x = 1\n  </param>\ny"), ("newString", "x = 2"),
                         ("replaceAll", "true")])
TODO = xml_call("todowrite", [("todos", '[{"content": "fix it", "status": "pending", "priority": "high", "id": "1"}]')])
FETCH = xml_call("webfetch", [("url", "https://example.com"), ("format", "markdown"), ("timeout", "2.5")])


def parsed_calls(dialect_name: str, text: str) -> list:
    parser = DIALECTS[dialect_name].parser(OPENCODE_LIKE)
    events = parser.feed(text) + parser.finish()
    return [e for e in events if isinstance(e, (CallEnd, CallError))]


# --- Qwen3-Coder XML, required ---


@pytest.mark.parametrize("text", [READ, EDIT, TODO, FETCH, "\n\n" + READ,
                                  xml_call("list", []), xml_call("read", [("filePath", "12")])])
def test_qwen_required_accepts_well_formed_calls(vocab: Vocab, text: str) -> None:
    grammar = tool_call_grammar(QWEN, OPENCODE_LIKE, mode="required")
    assert vocab.run(grammar, text) == "accept"
    found = parsed_calls("qwen_xml", text)
    assert len(found) == 1 and isinstance(found[0], CallEnd)


@pytest.mark.parametrize(("name", "text"), [
    ("prose", "I will read the file.\n" + READ),
    ("prose_only", "Hello there"),
    ("missing_required", xml_call("read", [("offset", "10")])),
    ("required_after_optional", xml_call("edit", [("filePath", "a"), ("replaceAll", "true"), ("oldString", "x"),
                                                   ("newString", "y")])),
    ("integer_not_a_number", xml_call("read", [("filePath", "a"), ("offset", "ten")])),
    ("boolean_word", xml_call("edit", [("filePath", "a"), ("oldString", "x"), ("newString", "y"),
                                       ("replaceAll", "yes")])),
    ("enum_value", xml_call("webfetch", [("url", "u"), ("format", "pdf")])),
    ("array_not_json", xml_call("todowrite", [("todos", "fix it")])),
    ("array_item_missing_key", xml_call("todowrite", [("todos", '[{"content": "x"}]')])),
    ("unknown_function", xml_call("delete", [("filePath", "a")])),
    ("unknown_parameter", xml_call("read", [("filePath", "a"), ("encoding", "utf-8")])),
    ("negative_with_minimum", xml_call("task", [("description", "d"), ("prompt", "p"), ("subagent_type", "s"),
                                                ("count", "-1")])),
])
def test_qwen_required_rejects(vocab: Vocab, name: str, text: str) -> None:
    grammar = tool_call_grammar(QWEN, OPENCODE_LIKE, mode="required")
    assert vocab.run(grammar, text) == "reject"


# Shaped like Pydantic / zod-to-json-schema / MCP output: a nested object through $defs (recursive), a
# top-level allOf of two objects, a JSON-pointer reference to a sibling property.
REF_TOOLS = parse_tools([
    {"type": "function", "function": {"name": "tree", "parameters": {
        "type": "object", "properties": {"node": {"$ref": "#/$defs/Node", "description": "the root"}},
        "required": ["node"],
        "$defs": {"Node": {"type": "object", "properties": {
            "v": {"type": "integer"}, "kids": {"type": "array", "items": {"$ref": "#/$defs/Node"}}},
            "required": ["v"]}}}}},
    {"type": "function", "function": {"name": "both", "parameters": {"allOf": [
        {"type": "object", "properties": {"a": {"type": "string"}}, "required": ["a"]},
        {"properties": {"b": {"type": "integer"}, "c": {"$ref": "#/allOf/1/properties/b"}}, "required": ["b"]}]}}},
])


def test_resolved_schema_inlines_refs_and_merges_all_of() -> None:
    tree, both = REF_TOOLS
    node = tree.parameter_schema("node")
    assert node is not None and node["type"] == "object" and node["required"] == ["v"]
    assert node["description"] == "the root"  # a sibling of $ref stays
    assert node["properties"]["kids"]["items"]["properties"]["v"] == {"type": "integer"}
    assert "$defs" not in tree.arguments_schema and "$defs" in tree.parameters  # the prompt keeps the original
    assert both.arguments_schema["required"] == ["a", "b"]
    assert both.parameter_schema("b") == {"type": "integer"} and both.parameter_schema("c") == {"type": "integer"}
    assert both.arguments_schema["type"] == "object" and "allOf" not in both.arguments_schema
    dangling = parse_tools([{"type": "function", "function": {"name": "d", "parameters": {
        "type": "object", "properties": {"x": {"$ref": "#/nope"}, "y": {"$ref": "https://example.com/s.json"}}}}}])
    assert dangling[0].parameter_schema("x") == {} and dangling[0].parameter_schema("y") == {}


@pytest.mark.parametrize(("dialect", "accepted", "rejected"), [
    (QWEN, [xml_call("tree", [("node", '{"v": 1, "kids": [{"v": 2}]}')]),
            xml_call("both", [("a", "hi"), ("b", "3")])],
     [xml_call("tree", [("node", "a node")]), xml_call("tree", [("node", '{"kids": []}')]),
      xml_call("both", [("a", "hi")]), xml_call("both", [("b", "3")]), xml_call("both", [("a", "x"), ("b", "y")])]),
    (JSON, ['{"name": "tree", "arguments": {"node": {"v": 1, "kids": [{"v": 2}]}}}',
            '{"name": "both", "arguments": {"a": "hi", "b": 3}}'],
     ['{"name": "tree", "arguments": {"node": "a node"}}', '{"name": "both", "arguments": {}}',
      '{"name": "both", "arguments": {"a": "hi"}}']),
])
def test_required_grammars_follow_refs_and_all_of(vocab: Vocab, dialect: Dialect, accepted: list[str],
                                                  rejected: list[str]) -> None:
    """A required call's arguments are typed and complete through $ref and allOf: seen over HTTP, an object
    argument behind a $ref came back as free text, and an allOf schema's call as {} without its required keys."""
    grammar = tool_call_grammar(dialect, REF_TOOLS, mode="required")
    for text in accepted:
        assert vocab.run(grammar, text) == "accept", text
    for text in rejected:
        assert vocab.run(grammar, text) == "reject", text
    parser = dialect.parser(REF_TOOLS)
    events = parser.feed(accepted[0]) + parser.finish()
    ends = [e for e in events if isinstance(e, CallEnd)]
    assert len(ends) == 1


def test_qwen_required_with_think(vocab: Vocab) -> None:
    optional = tool_call_grammar(QWEN, OPENCODE_LIKE, mode="required", think="optional")
    assert vocab.run(optional, "<think>\nThe user wants main.py; <tool_call> later.\n</think>\n\n" + READ) == "accept"
    assert vocab.run(optional, READ) == "accept"
    assert vocab.run(optional, "<think>\nhm\n</think>\nSure! " + READ) == "reject"
    opened = tool_call_grammar(QWEN, OPENCODE_LIKE, mode="required", think="open")
    assert vocab.run(opened, "I should read it.\n</think>\n\n" + READ) == "accept"
    assert vocab.run(opened, READ) == "incomplete"  # still inside the reasoning: only </think> ends it


def test_qwen_required_named_function(vocab: Vocab) -> None:
    grammar = tool_call_grammar(QWEN, OPENCODE_LIKE, mode="required", function="edit")
    assert vocab.run(grammar, EDIT) == "accept"
    assert vocab.run(grammar, READ) == "reject"
    with pytest.raises(ApiError) as info:
        tool_call_grammar(QWEN, OPENCODE_LIKE, mode="required", function="nope")
    assert info.value.status == 400


def test_end_token_only_where_the_call_is_complete(vocab: Vocab) -> None:
    required = tool_call_grammar(QWEN, OPENCODE_LIKE, mode="required", think="open")
    assert not vocab.eos_allowed(required, "")
    assert not vocab.eos_allowed(required, "thinking</think>\n")
    assert not vocab.eos_allowed(required, "x</think>\n" + READ[:40])
    assert vocab.eos_allowed(required, "x</think>\n" + READ)
    auto = tool_call_grammar(QWEN, OPENCODE_LIKE, mode="auto")
    assert vocab.eos_allowed(auto, "Just text")
    assert not vocab.eos_allowed(auto, "Text " + READ[:40])
    assert vocab.eos_allowed(auto, "Text " + READ)


def test_closing_texts_complete_a_truncated_required_call(vocab: Vocab) -> None:
    """What a serve does when the model ends inside a call: find a closing text the matcher takes to the end."""
    grammar = tool_call_grammar(QWEN, OPENCODE_LIKE, mode="required")
    cut_points = [READ.index("<parameter=offset>"), READ.index("10") + 2, READ.index("</function>"),
                  EDIT.index("x = 2") + 3]
    for text, cut in zip([READ, READ, READ, EDIT], cut_points):
        assert vocab.closing_texts_after(grammar, text[:cut], QWEN), text[:cut]


# --- Qwen3-Coder XML, auto ---


@pytest.mark.parametrize("text", [
    "Just an answer, with <b>markup</b> and a < b.",
    "Let me look.\n\n" + READ,
    "First " + READ + "\nthen " + EDIT + "\nDone.",
    "Bare opener:\n<function=read>\n<parameter=filePath>\nx\n</parameter>\n</function>\nok",
    "",
])
def test_qwen_auto_accepts_text_and_calls(vocab: Vocab, text: str) -> None:
    assert vocab.run(tool_call_grammar(QWEN, OPENCODE_LIKE, mode="auto"), text) == "accept"


@pytest.mark.parametrize("text", [
    "Let me look. <tool_call>\nI will read the file",
    "Let me look. <tool_call>\n<function=delete>\n",
    "Text " + xml_call("read", [("offset", "1")]),
    "Text <function=read>\n<parameter=filePath>\nx\n</parameter>\n<parameter=limit>\nmany\n",
])
def test_qwen_auto_rejects_a_malformed_call_after_an_opener(vocab: Vocab, text: str) -> None:
    assert vocab.run(tool_call_grammar(QWEN, OPENCODE_LIKE, mode="auto"), text) == "reject"


def test_qwen_auto_after_open_think(vocab: Vocab) -> None:
    grammar = tool_call_grammar(QWEN, OPENCODE_LIKE, mode="auto", think="open")
    assert vocab.run(grammar, "Maybe <tool_call> garbage here.</think>\nAnswer " + READ) == "accept"
    assert vocab.run(grammar, "ok</think>\n<tool_call>\nbad") == "reject"


# --- JSON calls ---

JSON_READ = '{"name": "read", "arguments": {"filePath": "a.py", "limit": 20}}'


@pytest.mark.parametrize("text", [
    JSON_READ, "\n" + JSON_READ, "```json\n" + JSON_READ + "\n```",
    '{"function": "todowrite", "arguments": {"todos": [{"content": "c", "status": "done", "priority": "low", "id": "1"}]}}',
])
def test_json_required_accepts(vocab: Vocab, text: str) -> None:
    grammar = tool_call_grammar(JSON, OPENCODE_LIKE, mode="required")
    assert vocab.run(grammar, text) == "accept"
    found = parsed_calls("json", text.strip())
    assert len(found) == 1 and isinstance(found[0], CallEnd)


@pytest.mark.parametrize("text", [
    "Sure: " + JSON_READ,
    '{"name": "read", "arguments": {"limit": 20}}',
    '{"name": "read", "arguments": {"filePath": "a.py", "limit": "20"}}',
    '{"name": "delete", "arguments": {}}',
    '{"name": "read", "arguments": {"filePath": "a.py", "mode": 1}}',
])
def test_json_required_rejects(vocab: Vocab, text: str) -> None:
    assert vocab.run(tool_call_grammar(JSON, OPENCODE_LIKE, mode="required"), text) == "reject"


def test_json_auto_and_think(vocab: Vocab) -> None:
    auto = tool_call_grammar(JSON, OPENCODE_LIKE, mode="auto", think="optional")
    assert vocab.run(auto, "No call needed, {braces} are fine.") == "accept"
    assert vocab.run(auto, "<think>plan</think>Reading.\n```json\n" + JSON_READ + "\n```\nDone") == "accept"
    assert vocab.run(auto, 'Reading.\n```json\n{"name": "read", "arguments": {}}') == "reject"
    required = tool_call_grammar(JSON, OPENCODE_LIKE, mode="required", think="open")
    assert vocab.run(required, "plan</think>\n\n" + JSON_READ) == "accept"


# --- JSON calls: the arguments take the keys their schema declares ---

# Objects without additionalProperties, as tools send them: llguidance alone let the model add keys (it wrote the
# tool's schema itself into a call's arguments). Keys that only a combinator's member or `required` names count as
# declared, so that closing an object never refuses every value.
CLOSED = parse_tools([
    {"type": "function", "function": {"name": "ping", "parameters": {"type": "object", "properties": {}}}},
    {"type": "function", "function": {"name": "bare"}},  # no parameters at all
    {"type": "function", "function": {"name": "level", "parameters": {"type": "object", "properties": {
        "level": {"type": "integer", "enum": [1, 2, 3]},
        "opts": {"type": "object", "properties": {"fast": {"type": "boolean"}}},
        "meta": {"type": "object"},  # no properties: a free-form object
        "tags": {"type": "object", "properties": {}, "additionalProperties": {"type": "string"}}},
        "required": ["level"]}}},
    {"type": "function", "function": {"name": "shape", "parameters": {
        "type": "object", "properties": {"kind": {"type": "string"}},
        "anyOf": [{"properties": {"r": {"type": "number"}}, "required": ["r"]},
                  {"properties": {"w": {"type": "number"}}, "required": ["w"]}]}}},
    {"type": "function", "function": {"name": "merged", "parameters": {"allOf": [
        {"type": "object", "properties": {"a": {"type": "string"}}, "required": ["a"]},
        {"properties": {"b": {"type": "integer"}}}]}}},
    {"type": "function", "function": {"name": "needs", "parameters": {
        "type": "object", "properties": {"a": {"type": "string"}}, "required": ["q"]}}},
])


def _json_call(name: str, arguments: str) -> str:
    return f'{{"name": "{name}", "arguments": {arguments}}}'


@pytest.mark.parametrize(("name", "accepted", "rejected"), [
    ("ping", ["{}"], ['{"type": "object", "properties": {}}', '{"parameter_name": "value"}']),
    ("bare", ["{}"], ['{"type": "object"}', '"{}"']),
    ("level", ['{"level": 1}', '{"level": 2, "opts": {"fast": true}, "meta": {"any": [1]}, "tags": {"x": "y"}}'],
     ['{"level": 1, "type": "object", "properties": {}}', '{"level": 1, "opts": {"fast": true, "slow": false}}',
      '{"level": 1, "tags": {"x": 1}}']),
    ("shape", ['{"kind": "circle", "r": 2}', '{"w": 1}'], ['{"kind": "c", "r": 2, "h": 1}', '{"kind": "c"}']),
    ("merged", ['{"a": "x", "b": 2}', '{"a": "x"}'], ['{"a": "x", "c": 1}', '{"b": 2}']),
    ("needs", ['{"q": 1}', '{"a": "y", "q": "x"}'], ['{"q": 1, "z": 2}', '{"a": "y"}']),
])
def test_json_required_arguments_take_only_declared_keys(vocab: Vocab, name: str, accepted: list[str],
                                                        rejected: list[str]) -> None:
    """A JSON call's arguments object, and every object in it with `properties`, takes only the keys its schema
    declares unless additionalProperties says otherwise, as llama.cpp's and vLLM's grammars read such a schema
    and as the XML dialects write only declared parameters. A tool without parameters is called with {}."""
    grammar = tool_call_grammar(JSON, CLOSED, mode="required", function=name)
    for arguments in accepted:
        assert vocab.run(grammar, _json_call(name, arguments)) == "accept", arguments
    for arguments in rejected:
        assert vocab.run(grammar, _json_call(name, arguments)) == "reject", arguments
    auto = tool_call_grammar(JSON, CLOSED, mode="auto")
    assert vocab.run(auto, f"```json\n{_json_call(name, accepted[0])}\n```") == "accept"
    assert vocab.run(auto, f"```json\n{_json_call(name, rejected[0])}\n```") == "reject"


def test_a_json_call_without_parameters_can_only_close(vocab: Vocab) -> None:
    """A tool without parameters: after `"arguments": {` only `}` may follow, so the forced call finishes (free,
    the 135M model wrote keys into it until max_tokens ran out)."""
    grammar = tool_call_grammar(JSON, CLOSED, mode="required", function="bare")
    assert vocab.run(grammar, '{"name": "bare", "arguments": {"') == "reject"
    assert vocab.run(grammar, '{"name": "bare", "arguments": { }') == "incomplete"
    assert not vocab.eos_allowed(grammar, '{"name": "bare", "arguments": {')
    assert vocab.closing_texts_after(grammar, '{"name": "bare", "arguments": {', JSON)[:1] == ["}}"]


# --- MiniCPM attribute XML: the call a turn must make ---

MINICPM = DIALECTS["minicpm_xml"]
MINICPM_READ = '<function name="read"><param name="filePath">src/main.py</param><param name="offset">10</param></function>'
MINICPM_WRITE = ('<function name="write">\n<param name="content"><![CDATA[x = 1\n<b>\n]]></param>\n'
                 '<param name="filePath">a.py</param>\n</function>')


@pytest.mark.parametrize("text", [MINICPM_READ, MINICPM_WRITE, "\n" + MINICPM_READ, '<function name="list"></function>',
                                  '<function name="read"><param name="filePath">x</param></function>',
                                  '<function name="todowrite"><param name="todos">[{"content": "a", "status": '
                                  '"done", "priority": "low", "id": "1"}]</param></function>'])
def test_minicpm_required_accepts_a_call(vocab: Vocab, text: str) -> None:
    assert vocab.run(minicpm_call_grammar(MINICPM, OPENCODE_LIKE), text) == "accept"
    parser = MINICPM.parser(OPENCODE_LIKE)
    found = [e for e in parser.feed(text) + parser.finish() if isinstance(e, (CallEnd, CallError))]
    assert len(found) == 1 and isinstance(found[0], CallEnd)


@pytest.mark.parametrize("text", ["Sure. " + MINICPM_READ, "Hello!", '<function name="delete"></function>',
                                  '<function name="read"><param name="encoding">x</param></function>',
                                  '<function name="read"><param name="offset">10</param></function>',
                                  '<function name="read"><param name="filePath">a</param><param name="offset">ten'
                                  '</param></function>', MINICPM_READ + " and more"])
def test_minicpm_required_rejects(vocab: Vocab, text: str) -> None:
    assert vocab.run(minicpm_call_grammar(MINICPM, OPENCODE_LIKE), text) == "reject"


def test_minicpm_required_ends_only_where_a_closing_text_completes_the_call(vocab: Vocab) -> None:
    """The end token is refused before the call opens; inside it, the serve's closing texts complete it
    wherever the end token is allowed (in a value: </param></function>; between params: </function>)."""
    grammar = minicpm_call_grammar(MINICPM, OPENCODE_LIKE, think="optional")
    assert not vocab.eos_allowed(grammar, "")
    assert not vocab.eos_allowed(grammar, "<think>I will read it.</think>\n")
    assert vocab.eos_allowed(grammar, MINICPM_READ)
    for cut in (MINICPM_READ.index("src/") + 3, MINICPM_READ.index('<param name="offset">'),
                MINICPM_READ.index("</function>")):
        closed = vocab.closing_texts_after(grammar, MINICPM_READ[:cut], MINICPM)
        assert closed[:1] == (["</param></function>"] if cut < MINICPM_READ.index("</param>") else ["</function>"])


def test_minicpm_required_named_function(vocab: Vocab) -> None:
    grammar = minicpm_call_grammar(MINICPM, OPENCODE_LIKE, function="write")
    assert vocab.run(grammar, MINICPM_WRITE) == "accept"
    assert vocab.run(grammar, MINICPM_READ) == "reject"
    with pytest.raises(ApiError):
        minicpm_call_grammar(MINICPM, OPENCODE_LIKE, function="nope")
    with pytest.raises(ValueError):
        minicpm_call_grammar(QWEN, OPENCODE_LIKE)


STRING_LIMITS = [  # (string schema, values that meet it, values that do not)
    ({"maxLength": 3}, ["abc", "", "a\nb"], ["abcd"]),
    ({"minLength": 2, "maxLength": 3.0}, ["ab", "xyz"], ["a", "long"]),
    ({"pattern": "^[0-9]{3}$"}, ["123"], ["12a", "1234"]),
    ({"pattern": "ab"}, ["ab", "xxabyy"], ["xxa"]),  # a search, as JSON schema reads it
    ({"pattern": "^https?://"}, ["https://x.org/a/b"], ["ftp://x"]),
    ({"pattern": "[0-9]$", "maxLength": 4}, ["ab1"], ["ab1x", "abcd1"]),
    ({"format": "uuid"}, ["123e4567-e89b-12d3-a456-426614174000"], ["not-a-uuid"]),
    ({"format": "date"}, ["2024-02-29"], ["2024-13-01", "yesterday"]),
    ({"format": "date-time"}, ["2024-01-02T03:04:05.5+01:00"], ["2024-01-02 noon"]),
    ({"format": "uri"}, ["anything at all"], []),  # a format without a regex here stays free text
]


def _one_string_tool(schema: dict) -> list:
    return parse_tools([_tool("w", {"c": {"type": "string", **schema}}, ["c"])])


@pytest.mark.parametrize(("schema", "good", "bad"), STRING_LIMITS)
def test_xml_text_values_meet_their_string_constraints(vocab: Vocab, schema: dict, good: list[str],
                                                       bad: list[str]) -> None:
    """An XML value is the string itself, so minLength / maxLength / pattern / format hold its text as written,
    in both XML dialects' grammars, and the parsers read back exactly that string."""
    tools = _one_string_tool(schema)
    qwen, minicpm = tool_call_grammar(QWEN, tools, mode="required"), minicpm_call_grammar(MINICPM, tools)
    for value in good + bad:
        expected = "accept" if value in good else "reject"
        assert vocab.run(qwen, xml_call("w", [("c", value)])) == expected, (schema, value)
        assert vocab.run(minicpm, f'<function name="w"><param name="c">{value}</param></function>') == expected
    for value in good:
        parser = QWEN.parser(tools)
        ends = [e for e in parser.feed(xml_call("w", [("c", value)])) + parser.finish() if isinstance(e, CallEnd)]
        assert [json.loads(e.arguments) for e in ends] == [{"c": value}]


def test_grammar_arguments_are_checked() -> None:
    with pytest.raises(ValueError):
        tool_call_grammar(DIALECTS["minicpm_xml"], OPENCODE_LIKE, mode="required")
    with pytest.raises(ValueError):
        tool_call_grammar(QWEN, OPENCODE_LIKE, mode="sometimes")
    with pytest.raises(ValueError):
        tool_call_grammar(QWEN, OPENCODE_LIKE, mode="auto", think="maybe")
    with pytest.raises(ApiError):
        tool_call_grammar(QWEN, [], mode="required")


def test_auto_without_tools_is_free_text(vocab: Vocab) -> None:
    for dialect in (QWEN, JSON):
        assert vocab.run(tool_call_grammar(dialect, [], mode="auto"), "anything at all") == "accept"


# --- which tool schemas a call grammar can enforce (structure) ---

ALL_DIALECTS = ("qwen_xml", "minicpm_xml", "json")


def _params(argument: object) -> dict:
    return {"type": "object", "properties": {"x": argument}, "required": ["x"]}


# Parameters no arguments meet, or that are no JSON schema: refused alike in every dialect once a grammar is armed.
UNENFORCEABLE = [
    _params({"enum": []}), _params({"not": {}}), _params(False),
    _params({"type": "integer", "minimum": 5, "maximum": 1}),  # llguidance refuses it when the grammar compiles
    {"type": "object", "properties": {"a": {"type": "string"}}, "required": "a"},  # not a JSON schema
    # An allOf whose members share no type (merged, the first member's type used to win, and {"x": "x"} came back).
    _params({"allOf": [{"type": "string"}, {"type": "integer"}]}),
    _params({"allOf": [{"type": ["string", "null"]}, {"$ref": "#/$defs/n"}]}) | {"$defs": {"n": {"type": "number"}}},
    {"type": "object", "allOf": [{"type": "string"}]},
    # A required key that additionalProperties forbids (the call could never be finished).
    {"type": "object", "properties": {"a": {"type": "string"}}, "required": ["q"], "additionalProperties": False},
    {"type": "object", "required": ["q"], "additionalProperties": {"not": {}}},
    _params({"type": "object", "properties": {}, "required": ["q"], "additionalProperties": False}),
    _params({"type": "object", "properties": {"y": {"allOf": [{"type": "boolean"}, {"type": "array"}]}},
             "required": ["y"]}),
    # An allOf whose members allow no value in common (merged, the first member's const or enum used to win: 200),
    # and an enum or const none of whose values has the schema's type.
    _params({"allOf": [{"const": "x"}, {"const": "y"}]}),
    _params({"allOf": [{"enum": ["red", "green"]}, {"enum": ["blue", "black"]}]}),
    _params({"allOf": [{"type": "string"}, {"enum": [1, 2]}]}),
    _params({"type": "string", "enum": [1, 2]}), _params({"type": "string", "const": 1}),
    _params({"allOf": [{"type": "integer", "minimum": 500}, {"maximum": 100}]}),  # crossed once merged
    _params({"allOf": [{"type": "string", "minLength": 5}, {"maxLength": 2}]}),
    # A required key a pattern holds to a schema no value meets.
    {"type": "object", "patternProperties": {"^q$": False}, "required": ["q"]},
    {"type": "object", "properties": {"q": {"type": "string"}}, "patternProperties": {"^q": {"type": "integer"}},
     "required": ["q"]},
]
# Look-alikes that some value meets: they stay enforceable.
ENFORCEABLE = [
    _params({"allOf": [{"type": "number"}, {"type": "integer"}]}),
    _params({"allOf": [{"type": ["string", "null"]}, {"type": "string", "maxLength": 3}]}),
    {"type": "object", "properties": {"a": {}}, "required": ["a"], "additionalProperties": False},
    {"type": "object", "patternProperties": {"^q": {"type": "string"}}, "required": ["q1"],
     "additionalProperties": False},
    {"type": "object", "required": ["q"], "additionalProperties": {"type": "string"}},
    # null meets it: `required` holds objects only
    {"type": "object", "properties": {"x": {"type": ["object", "null"], "required": ["q"],
                                            "additionalProperties": False}}},
    # allOfs whose members have values in common, and enums with a value of the schema's type.
    _params({"allOf": [{"const": "x"}, {"enum": ["x", "y"]}]}),
    _params({"allOf": [{"enum": [1, 2]}, {"enum": [2.0, 3]}]}),  # 2 and 2.0 are one number
    _params({"allOf": [{"type": "number"}, {"enum": [1, "a"]}]}),
    _params({"type": "integer", "enum": [1.0]}), _params({"type": ["string", "integer"], "enum": [1]}),
    _params({"allOf": [{"type": "integer", "minimum": 0, "maximum": 1000}, {"minimum": 500, "maximum": 510}]}),
    _params({"allOf": [{"type": "integer", "minimum": 5}, {"maximum": 5}]}),
    _params({"allOf": [{"type": "string", "minLength": 2}, {"maxLength": 2}]}),
    _params({"allOf": [{"type": "number", "multipleOf": 0.5}, {"multipleOf": 0.3}]}),
    {"$schema": "http://json-schema.org/draft-04/schema#", "type": "object", "required": ["x"], "properties": {
        "x": {"allOf": [{"type": "integer", "minimum": 5, "exclusiveMinimum": True}, {"maximum": 6}]}}},
    # A required key that only a pattern declares, typed by it; a key both a property and a pattern hold.
    {"type": "object", "properties": {"a": {"type": "string"}}, "patternProperties": {"^q$": {"type": "integer"}},
     "required": ["q"]},
    {"type": "object", "properties": {"q": {"type": "string"}}, "patternProperties": {"^q": {"maxLength": 3}},
     "required": ["q"]},
    {"type": "object", "allOf": [{"properties": {"a": {"type": "integer"}}}], "unevaluatedProperties": False,
     "required": ["a"]},
]


def _tool_grammar(dialect: str, parameters: dict, **request: object) -> str | None:
    """The tool-call grammar a request with one tool of these parameters gets, on `dialect`, where the grammar is
    armed: PANTHEON_TOOL_GRAMMAR unset and tool_choice "required", or =1 and a named function."""
    grammar = request.pop("grammar", None)
    tools = [{"type": "function", "function": {"name": "t", "parameters": parameters}}]
    body = {"messages": [{"role": "user", "content": "call it"}], "tools": tools, **request}
    env = dataclasses.replace(read_env(), tool_grammar=grammar)
    built, _ = structure._tool_grammar(DIALECTS[dialect], parse_tools(tools), parse_chat_request(body), env, "none")
    return built


def _refusal(vocab: Vocab, dialect: str, parameters: dict, **request: object) -> str | None:
    """Why a request with this tool is a 400, as `structure.plan` decides it (the check before a grammar is built,
    then the grammar failing to compile), or None when it is not."""
    try:
        grammar = _tool_grammar(dialect, parameters, **request)
    except ApiError as exc:
        assert exc.status == 400 and exc.error_type == "invalid_request_error"
        return str(exc)
    assert grammar is not None
    return structure._compile(vocab.ll, grammar)[1]


@pytest.mark.parametrize("dialect", ALL_DIALECTS)
@pytest.mark.parametrize("parameters", UNENFORCEABLE)
def test_every_dialect_refuses_parameters_no_call_meets(vocab: Vocab, dialect: str, parameters: dict) -> None:
    """One check for every dialect: MiniCPM's call grammar used to skip it (an empty enum gave a 200 with a call
    its schema refuses), and an allOf without a common type or a required key that additionalProperties: false
    forbids went through on all of them. Refused by the check, or else by the grammar failing to compile (as
    `structure.plan` does it), with a "required" turn or an enforced named function."""
    assert _refusal(vocab, dialect, parameters, tool_choice="required") is not None
    named = {"type": "function", "function": {"name": "t"}}
    assert _refusal(vocab, dialect, parameters, tool_choice=named, grammar=True) is not None
    # Without a grammar the schema is only shown to the model.
    assert _tool_grammar(dialect, parameters, tool_choice="auto") is None


@pytest.mark.parametrize("dialect", ALL_DIALECTS)
@pytest.mark.parametrize("parameters", ENFORCEABLE)
def test_parameters_some_call_meets_stay_enforceable(vocab: Vocab, dialect: str, parameters: dict) -> None:
    assert _refusal(vocab, dialect, parameters, tool_choice="required") is None


def test_an_all_of_merges_to_the_types_its_members_share(vocab: Vocab) -> None:
    """Merged, an allOf's types intersect: a number that must also be an integer is an integer (the first
    member's "number" used to win, and the grammar let 1.5 through)."""
    tools = parse_tools([_tool("n", {"k": {"allOf": [{"type": "number"}, {"type": "integer"}]},
                                     "s": {"allOf": [{"type": ["string", "null"]}, {"type": ["null", "integer"]}]}},
                               ["k"])])
    assert tools[0].parameter_schema("k")["type"] == "integer"
    assert tools[0].parameter_schema("s")["type"] == "null"
    grammar = tool_call_grammar(QWEN, tools, mode="required")
    assert vocab.run(grammar, xml_call("n", [("k", "2")])) == "accept"
    assert vocab.run(grammar, xml_call("n", [("k", "1.5")])) == "reject"
    contradiction = parse_tools([_tool("c", {"x": {"allOf": [{"type": "string"}, {"type": "integer"}]}}, ["x"])])
    assert contradiction[0].parameter_schema("x")["type"] == []


# An allOf's members each narrow the value: merged, the tightest of each bound and the values their enums share
# hold it (the first member's used to win: "function_a" for a maxLength of 2, "red" for an enum without it).
TIGHT = parse_tools([
    _tool("short", {"x": {"allOf": [{"type": "string", "maxLength": 10}, {"type": "string", "maxLength": 2}]}}, ["x"]),
    _tool("color", {"x": {"allOf": [{"enum": ["red", "green", "blue"]}, {"enum": ["blue", "black"]}]}}, ["x"]),
    _tool("level", {"x": {"allOf": [{"type": "integer", "minimum": 0, "maximum": 1000},
                                    {"minimum": 500, "maximum": 510}]}}, ["x"]),
    _tool("step", {"x": {"allOf": [{"type": "number", "multipleOf": 0.5}, {"multipleOf": 0.3}]}}, ["x"]),
    _tool("typed", {"x": {"allOf": [{"type": "integer"}, {"enum": [1, 2.5, "a", 3]}]}}, ["x"]),
])


def _one_argument_call(dialect: str, name: str, key: str, value: str) -> str:
    """A call of `name` with one argument whose JSON text is `value`, as `dialect` writes it (a string bare in the
    XML dialects)."""
    if dialect == "json":
        return f'{{"name": "{name}", "arguments": {{"{key}": {value}}}}}'
    loaded = json.loads(value)
    text = loaded if isinstance(loaded, str) else value
    if dialect == "qwen_xml":
        return xml_call(name, [(key, text)])
    return f'<function name="{name}"><param name="{key}">{text}</param></function>'


def _required_grammar(dialect: str, tools: list) -> str:
    if dialect == "minicpm_xml":
        return minicpm_call_grammar(MINICPM, tools)
    return tool_call_grammar(DIALECTS[dialect], tools, mode="required")


@pytest.mark.parametrize("dialect", ALL_DIALECTS)
@pytest.mark.parametrize(("name", "accepted", "rejected"), [
    ("short", ['"ab"', '"a"'], ['"function_a"', '"abc"']),
    ("color", ['"blue"'], ['"red"', '"black"']),
    ("level", ["505", "500", "510"], ["200", "2", "1000", "511"]),
    ("step", ["3", "1.5", "0"], ["0.5", "0.3", "1", "2"]),
    ("typed", ["1", "3"], ["2.5", '"a"', "2"]),
])
def test_an_all_of_holds_the_value_to_every_members_bounds(vocab: Vocab, dialect: str, name: str,
                                                           accepted: list[str], rejected: list[str]) -> None:
    grammar = _required_grammar(dialect, [t for t in TIGHT if t.name == name])
    for value in accepted:
        assert vocab.run(grammar, _one_argument_call(dialect, name, "x", value)) == "accept", value
    for value in rejected:
        assert vocab.run(grammar, _one_argument_call(dialect, name, "x", value)) == "reject", value


def test_an_all_of_merges_bounds_enums_and_consts() -> None:
    """The merged schema itself: each bound the tighter one (a draft-4 exclusive bound compared as the number it
    is), two multipleOf their least common multiple, enums and consts the values they share."""
    def merged(*members: dict) -> dict:
        return parse_tools([_tool("m", {"x": {"allOf": list(members)}}, ["x"])])[0].parameter_schema("x")

    assert merged({"minimum": 0, "maximum": 1000, "minLength": 1}, {"minimum": 500, "maximum": 510, "minLength": 3}) \
        == {"minimum": 500, "maximum": 510, "minLength": 3}
    assert merged({"exclusiveMinimum": 1, "maxItems": 4, "minProperties": 2}, {"exclusiveMinimum": 0, "maxItems": 2,
                                                                              "minProperties": 1}) \
        == {"exclusiveMinimum": 1, "maxItems": 2, "minProperties": 2}
    assert merged({"minimum": 5, "exclusiveMinimum": True}, {"minimum": 3}) == {"exclusiveMinimum": 5, "minimum": 3}
    assert merged({"multipleOf": 4}, {"multipleOf": 6}) == {"multipleOf": 12}
    assert merged({"multipleOf": 0.5}, {"multipleOf": 0.3}) == {"multipleOf": 1.5}
    assert merged({"enum": ["red", "green", "blue"]}, {"enum": ["blue", "black"]}) == {"enum": ["blue"]}
    assert merged({"const": "x"}, {"enum": ["y", "x"]}) == {"const": "x"}
    assert merged({"const": "x"}, {"const": "y"}) == {"enum": []}
    assert merged({"enum": [1, True, None]}, {"enum": [1.0, None]}) == {"enum": [1, None]}  # true is not 1
    assert merged({"type": "string"}, {"enum": [1, 2]}) == {"type": "string", "enum": []}


# --- patternProperties and unevaluatedProperties ---

# A key declared only by `required` and a pattern: the JSON grammar let ", " follow it, then nothing (half the seeds
# ended the turn inside the call), and the XML grammars wrote it as text where the pattern wants an integer.
PATTERNED = parse_tools([
    {"type": "function", "function": {"name": "do_it", "parameters": {
        "type": "object", "properties": {"a": {"type": "string"}}, "patternProperties": {"^q$": {"type": "integer"}},
        "required": ["q"]}}},
    {"type": "function", "function": {"name": "own", "parameters": {
        "type": "object", "properties": {"a": {"type": "string"}},
        "patternProperties": {"^(?:q|r)$": {"type": "integer"}}, "required": ["q", "r"],
        "additionalProperties": False}}},
    {"type": "function", "function": {"name": "bare", "parameters": {
        "type": "object", "patternProperties": {"^q$": {"type": "integer"}}, "required": ["q"],
        "additionalProperties": False}}},
    {"type": "function", "function": {"name": "prefix", "parameters": {
        "type": "object", "patternProperties": {"^q": {"type": "integer"}}, "required": ["q"],
        "additionalProperties": False}}},
])


@pytest.mark.parametrize(("name", "head", "accepted", "rejected"), [
    ("do_it", '{"a": "value" ,"q": \n-1', ['{"q": 1}', '{"a": "v", "q": -1}'],
     ['{"q": "x"}', '{"q": 1, "z": 2}']),
    ("own", '{"q": 1, "r": 2', ['{"q": 1, "r": 2}', '{"a": "", "q": 1, "r": 2}'],
     ['{"q": 1}', '{"q": 1, "r": "x"}']),
    ("bare", '{"q": 1', ['{"q": 1}'], ['{"q": 1.5}', '{"q": 1, "a": 2}']),
])
def test_a_key_only_a_pattern_declares_has_no_dead_end_in_json(vocab: Vocab, name: str, head: str,
                                                               accepted: list[str], rejected: list[str]) -> None:
    """After the last key a JSON call can only close its arguments: llguidance let ", " follow a key that a
    pattern naming no other key holds, and then allowed nothing but blanks."""
    grammar = tool_call_grammar(JSON, PATTERNED, mode="required", function=name)
    last_key = f'{{"name": "{name}", "arguments": {head}'
    assert vocab.run(grammar, last_key + ",") == "reject"
    assert vocab.run(grammar, last_key + " ,") == "reject"
    assert vocab.run(grammar, last_key + "}}") == "accept"
    for arguments in accepted:
        assert vocab.run(grammar, _json_call(name, arguments)) == "accept", arguments
    for arguments in rejected:
        assert vocab.run(grammar, _json_call(name, arguments)) == "reject", arguments


def test_a_pattern_that_admits_more_keys_still_admits_them(vocab: Vocab) -> None:
    grammar = tool_call_grammar(JSON, PATTERNED, mode="required", function="prefix")
    assert vocab.run(grammar, _json_call("prefix", '{"q": 1, "q2": 2}')) == "accept"
    assert vocab.run(grammar, _json_call("prefix", '{"q": 1, "z": 2}')) == "reject"


@pytest.mark.parametrize("dialect", ["qwen_xml", "minicpm_xml"])
def test_xml_grammars_type_a_key_only_a_pattern_declares(vocab: Vocab, dialect: str) -> None:
    """A required key declared only through patternProperties is typed by the pattern's schema (it was free text,
    and the model wrote "\n\n" where an integer was due)."""
    tools = PATTERNED[:1]
    grammar = _required_grammar(dialect, tools)
    assert vocab.run(grammar, _one_argument_call(dialect, "do_it", "q", "5")) == "accept"
    for text in ("x", "\n\n", "1.5"):
        assert vocab.run(grammar, _one_argument_call(dialect, "do_it", "q", json.dumps(text))) == "reject", text
    parser = DIALECTS[dialect].parser(tools)
    events = parser.feed(_one_argument_call(dialect, "do_it", "q", "5")) + parser.finish()
    assert [json.loads(e.arguments) for e in events if isinstance(e, CallEnd)] == [{"q": 5}]


UNEVALUATED = parse_tools([
    {"type": "function", "function": {"name": "merged", "parameters": {
        "type": "object", "allOf": [{"properties": {"a": {"type": "integer"}}}], "unevaluatedProperties": False,
        "required": ["a"]}}},
    {"type": "function", "function": {"name": "shape", "parameters": {
        "type": "object", "properties": {"kind": {"type": "string"}, "box": {
            "type": "object", "anyOf": [{"properties": {"r": {"type": "number"}}}, {"properties": {"w": {}}}],
            "unevaluatedProperties": False}}}}},
    {"type": "function", "function": {"name": "typed", "parameters": {
        "type": "object", "properties": {"a": {"type": "string"}}, "unevaluatedProperties": {"type": "integer"}}}},
])


@pytest.mark.parametrize(("name", "accepted", "rejected"), [
    ("merged", ['{"a": 1}'], ['{"a": 1, "b": "feller"}', '{"a": "x"}']),
    ("shape", ['{"box": {"r": 1}}', '{"kind": "c", "box": {"w": 2}}'], ['{"box": {"r": 1, "h": 2}}']),
    ("typed", ['{"a": "x", "b": 2}', '{"b": 1}'], ['{"b": "x"}']),
])
def test_json_unevaluated_properties_close_the_object(vocab: Vocab, name: str, accepted: list[str],
                                                      rejected: list[str]) -> None:
    """unevaluatedProperties, which llguidance ignores, becomes the additionalProperties it means over the keys the
    object and its members declare: false closes the object ({"a": 1, "b": "feller"} came back), a schema holds the
    other keys to it."""
    grammar = tool_call_grammar(JSON, UNEVALUATED, mode="required", function=name)
    for arguments in accepted:
        assert vocab.run(grammar, _json_call(name, arguments)) == "accept", arguments
    for arguments in rejected:
        assert vocab.run(grammar, _json_call(name, arguments)) == "reject", arguments


# --- response_format ---

PERSON = {"$schema": SCHEMA_URL, "type": "object", "properties": {"name": {"type": "string"}, "age": _int(minimum=0)},
          "required": ["name", "age"], "additionalProperties": False}


def test_json_object_grammar(vocab: Vocab) -> None:
    free = json_object_grammar(None)
    assert vocab.run(free, '{"anything": [1, 2, {"x": null}]}') == "accept"
    assert vocab.run(free, "[1, 2]") == "reject"
    assert vocab.run(free, "Here you go: {}") == "reject"
    person = json_object_grammar(PERSON)
    assert vocab.run(person, '{"name": "Ada", "age": 36}') == "accept"
    assert vocab.run(person, '{"name": "Ada"}') == "reject"
    assert vocab.run(person, '{"name": "Ada", "age": "36"}') == "reject"
    assert vocab.run(person, '{"name": "Ada", "age": -1}') == "reject"
    thinking = json_object_grammar(PERSON, think="optional")
    assert vocab.run(thinking, '<think>easy</think>\n{"name": "Ada", "age": 36}') == "accept"
    assert vocab.run(thinking, '{"name": "Ada", "age": 36}') == "accept"
    # Whitespace is bounded (20 characters at a time, as llama.cpp's JSON grammars bound it): a sampled run of
    # tabs inside the object once filled all 200 tokens of a request.
    assert vocab.run(person, '\n\t  {"name": "Ada", "age": 36}') == "accept"
    assert vocab.run(person, "\t" * 20 + '{"name": "Ada", "age": 36}') == "accept"
    assert vocab.run(person, "\t" * 21 + '{"name": "Ada", "age": 36}') == "reject"
    assert vocab.run(person, '{\n  "name": "Ada",\n  "age": 36\n}') == "accept"  # and inside the object
    assert vocab.run(person, '{"name": "Ada",' + " " * 21 + '"age": 36}') == "reject"
    assert vocab.run(free, '{"a":' + "\t" * 21 + "1}") == "reject"
    refs = {"type": "object", "$defs": {"P": PERSON}, "properties": {"who": {"$ref": "#/$defs/P"}}, "required": ["who"]}
    assert vocab.run(json_object_grammar(refs), '{"who": {"name": "Ada", "age": 36}}') == "accept"
    assert vocab.run(json_object_grammar(refs), '{"who": {"name": "Ada"}}') == "reject"


# --- mask cost ---


def test_mask_computation_cost(vocab: Vocab, capsys: pytest.CaptureFixture[str]) -> None:
    """Walk a long call (a file write) token by token, computing every mask; report the cost."""
    content = "\n".join(f"    line {i}: value = compute({i}, 'x') # <tag> & more" for i in range(60))
    text = "Writing the file.\n\n" + xml_call("write", [("content", content), ("filePath", "src/out.py")])
    rows = []
    for mode in ("required", "auto"):
        grammar = tool_call_grammar(QWEN, OPENCODE_LIKE, mode=mode)
        started = time.perf_counter()
        m = vocab.matcher(grammar)
        compile_ms = (time.perf_counter() - started) * 1e3
        mask = llnp.allocate_token_bitmask(1, vocab.ll.vocab_size)
        ids = vocab.tokenizer.encode(text if mode == "auto" else text.split("\n\n", 1)[1], parse_special=False)
        times = []
        for t in ids:
            started = time.perf_counter()
            llnp.fill_next_token_bitmask(m, mask)
            times.append((time.perf_counter() - started) * 1e3)
            assert m.consume_token(t), m.get_error()
        assert m.is_accepting()
        times.sort()
        rows.append(f"{mode}: compile {compile_ms:.1f} ms, {len(times)} masks, mean {statistics.mean(times):.3f} ms, "
                    f"p50 {times[len(times) // 2]:.3f} ms, p99 {times[int(len(times) * 0.99)]:.3f} ms, "
                    f"max {times[-1]:.3f} ms")
    with capsys.disabled():
        print("\nmask cost (10 opencode-like tools, 49k vocab):\n  " + "\n  ".join(rows))


@pytest.fixture(scope="module")
def qwen_vocab() -> Vocab:
    """The Qwen3.5 fixture's vocabulary: "<think>", "</think>", "<tool_call>" and "</tool_call>" are single
    user-defined tokens (not control tokens), as in Qwen's GGUFs."""
    path = Path(__file__).parent / "fixtures" / "qwen35" / "qwen35.gguf"
    return Vocab(Tokenizer.from_gguf_metadata(open_gguf(path, read_env().cache_dir).metadata))


def test_qwen_marker_tokens_match_the_grammars_text_markers(qwen_vocab: Vocab) -> None:
    """llguidance takes added tokens that look like "<...>" as special unless told otherwise; the grammars write
    the markers as text, so the vocabulary handed to it marks only control tokens special. Then the model's
    own marker tokens are what a "required" call and the end of a think block accept."""
    tok = qwen_vocab.tokenizer
    call_open, think_end = tok.encode("<tool_call>")[0], tok.encode("</think>")[0]
    assert tok.encode("<tool_call>") == [call_open] and tok.encode("</think>") == [think_end]
    assert not qwen_vocab.ll.is_special_token(call_open) and qwen_vocab.ll.is_special_token(tok.eos_id)
    xml = DIALECTS["qwen_xml"]
    tools = parse_tools([_tool("get_time", {"tz": {"type": "string"}}, ["tz"])])
    required = qwen_vocab.matcher(tool_call_grammar(xml, tools, mode="required"))
    assert required.consume_token(call_open), required.get_error()
    thinking = qwen_vocab.matcher(tool_call_grammar(xml, tools, mode="required", think="open"))
    assert thinking.consume_tokens(tok.encode("let me see")) and thinking.consume_token(think_end)
    assert thinking.consume_tokens(tok.encode("\n")) and thinking.consume_token(call_open), thinking.get_error()
    text = "<tool_call>\n<function=get_time>\n<parameter=tz>\nUTC\n</parameter>\n</function>\n</tool_call>"
    assert qwen_vocab.run(tool_call_grammar(xml, tools, mode="required"), text) == "accept"
    answer = qwen_vocab.matcher(json_object_grammar(None, think="open"))
    assert answer.consume_token(think_end) and answer.consume_tokens(tok.encode('{"a": 1}')), answer.get_error()
    assert answer.is_accepting()
