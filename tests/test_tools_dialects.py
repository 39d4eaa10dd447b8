"""The three tool-call dialects: parsing (whole, per character, per random "token"), argument typing,
rendering and its round trip, dialect choice.

Each vector is a model output, the text the client should see, the calls it should get (name and typed
arguments) and the calls that failed (code, function, parameter).
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass, field
from typing import Any

import pytest

from pantheon.chat.tools import (DIALECTS, ArgsDelta, CallEnd, CallError, CallStart, TextDelta, dialect_for,
                                 parse_tools)
from pantheon.chat.tools.arguments import loads_forgiving, schema_types, streams_as_string, type_value
from pantheon.errors import ApiError


def _fn(name: str, props: dict, required: list[str]) -> dict:
    return {"type": "function", "function": {"name": name, "description": f"the {name} tool", "parameters": {
        "$schema": "https://json-schema.org/draft/2020-12/schema", "type": "object", "properties": props,
        "required": required, "additionalProperties": False}}}


RAW_TOOLS = [
    _fn("read", {"path": {"type": "string"},
                 "offset": {"type": "integer", "minimum": -9007199254740991, "maximum": 9007199254740991},
                 "limit": {"type": "integer"}}, ["path"]),
    _fn("write", {"path": {"type": "string"}, "content": {"type": "string"}}, ["path", "content"]),
    _fn("configure", {"name": {"type": "string"}, "retries": {"type": "integer"}, "ratio": {"type": "number"},
                      "verbose": {"type": "boolean"}, "env": {"type": "object"},
                      "tags": {"type": "array", "items": {"type": "string"}},
                      "level": {"type": ["integer", "string"]}, "mode": {"enum": ["fast", "slow"]},
                      "note": {"anyOf": [{"type": "null"}, {"type": "string"}]}}, ["name"]),
]
TOOLS = parse_tools(RAW_TOOLS)
CLOSERS = ("</tool_call>", "</function>", "</parameter>", "</param>", "<![CDATA[", "]]>")


@dataclass
class Case:
    id: str
    dialect: str
    output: str
    text: str
    calls: list[tuple[str, dict]] = field(default_factory=list)
    errors: list[tuple[str, str | None, str | None]] = field(default_factory=list)


def call(name: str, body: str) -> str:
    return f"<tool_call>\n<function={name}>\n{body}</function>\n</tool_call>"


def param(key: str, value: str) -> str:
    return f"<parameter={key}>\n{value}\n</parameter>\n"


HTML = '<html>\n  <body class="a">&amp; \\ ü "q"</body>\n</html>\n'

QWEN = [
    Case("two_calls_after_text", "qwen_xml",
         "I'll read both files.\n\n" + call("read", param("path", "src/a.py")) + "\n"
         + call("read", param("path", "src/b.py") + param("limit", "20")),
         "I'll read both files.", [("read", {"path": "src/a.py"}), ("read", {"path": "src/b.py", "limit": 20})]),
    Case("typed_arguments", "qwen_xml",
         call("configure", param("name", "12345") + param("retries", "3") + param("ratio", "0.25")
              + param("verbose", "True") + param("env", '{"A": "1", "B": 2,}') + param("tags", '["x", "y"]')
              + param("level", "7") + param("mode", "fast") + param("note", "null")),
         "", [("configure", {"name": "12345", "retries": 3, "ratio": 0.25, "verbose": True, "env": {"A": "1", "B": 2},
                             "tags": ["x", "y"], "level": 7, "mode": "fast", "note": None})]),
    Case("union_falls_back_to_string", "qwen_xml",
         call("configure", param("name", "x") + param("level", "high") + param("note", "some words")),
         "", [("configure", {"name": "x", "level": "high", "note": "some words"})]),
    Case("multiline_value_with_markup", "qwen_xml",
         "Writing it.\n" + call("write", param("path", "/tmp/x.html") + param("content", HTML)),
         "Writing it.", [("write", {"path": "/tmp/x.html", "content": HTML})]),
    Case("dropped_tool_call_opener", "qwen_xml",
         "Checking.\n<function=read>\n<parameter=path>\nREADME.md\n</parameter>\n</function>",
         "Checking.", [("read", {"path": "README.md"})]),
    Case("missing_close_at_end", "qwen_xml",
         "<tool_call>\n<function=read>\n<parameter=path>\na\n</parameter>\n</function>", "", [("read", {"path": "a"})]),
    Case("missing_function_close", "qwen_xml",
         "<tool_call>\n<function=read>\n<parameter=path>\na\n</parameter>\n</tool_call>", "",
         [("read", {"path": "a"})]),
    Case("unknown_parameters_kept", "qwen_xml",
         call("read", param("path", "a") + param("encoding", "utf-8") + param("extra", '{"k": [1]}')),
         "", [("read", {"path": "a", "encoding": "utf-8", "extra": {"k": [1]}})]),
    Case("unknown_function_is_not_a_call", "qwen_xml",
         call("delete", param("path", "/")) + "\n" + call("read", param("path", "b")),
         "", [("read", {"path": "b"})], [("unknown_function", "delete", None)]),
    Case("unfinished_call", "qwen_xml",
         "Let me write.\n<tool_call>\n<function=write>\n" + param("path", "out.txt") + "<parameter=content>\nhalf a fi",
         "Let me write.", [], [("unfinished_tool_call", "write", "content")]),
    Case("malformed_call", "qwen_xml", "<tool_call>\nread the file\n</tool_call>\nSorry.", "Sorry.", [],
         [("malformed_tool_call", None, None)]),
    Case("json_inside_tool_call", "qwen_xml",
         '<tool_call>\n{"name": "read", "arguments": {"path": "a.txt", "limit": "5"}}\n</tool_call>',
         "", [("read", {"path": "a.txt", "limit": 5})]),
    Case("text_around_calls", "qwen_xml", "A\n" + call("read", param("path", "x")) + "\nB",
         "A\nB", [("read", {"path": "x"})]),
    Case("near_markup_is_text", "qwen_xml", "Use a < b, <tools> and <function call> here; end <tool",
         "Use a < b, <tools> and <function call> here; end <tool"),
    Case("empty_output", "qwen_xml", "", ""),
]

MINICPM = [
    Case("two_calls_cdata", "minicpm_xml",
         'I will write it.\n<function name="write"><param name="path">notes.md</param><param name="content">'
         '<![CDATA[# Title\n\n<b>bold</b> & more\n]]></param></function>\n'
         '<function name="read"><param name="path">notes.md</param><param name="limit">10</param></function>',
         "I will write it.",
         [("write", {"path": "notes.md", "content": "# Title\n\n<b>bold</b> & more\n"}),
          ("read", {"path": "notes.md", "limit": 10})]),
    Case("typed_arguments", "minicpm_xml",
         '<function name="configure"><param name="name">007</param><param name="retries">3</param>'
         '<param name="ratio">1e-3</param><param name="verbose">false</param>'
         '<param name="env"><![CDATA[{"PATH": "/bin"}]]></param><param name="tags">["a"]</param></function>',
         "", [("configure", {"name": "007", "retries": 3, "ratio": 0.001, "verbose": False, "env": {"PATH": "/bin"},
                             "tags": ["a"]})]),
    Case("cdata_sections_join", "minicpm_xml",
         '<function name="write"><param name="path">p</param><param name="content">\n'
         '  <![CDATA[a]]]]><![CDATA[>b]]>\n</param></function>',
         "", [("write", {"path": "p", "content": "a]]>b"})]),
    Case("unknown_and_unfinished", "minicpm_xml",
         '<function name="rm"><param name="path">/</param></function>Then <function name="write">'
         '<param name="path">x</param><param name="content"><![CDATA[partial',
         "Then", [], [("unknown_function", "rm", None), ("unfinished_tool_call", "write", "content")]),
    Case("malformed_body", "minicpm_xml", '<function name="read"><arg>1</arg></function> ok', "ok", [],
         [("malformed_tool_call", "read", None)]),
    Case("empty_and_unknown_params", "minicpm_xml",
         '<function name="read"><param name="path"/><param name="flag">true</param></function>',
         "", [("read", {"path": "", "flag": True})]),
]

JSON_CASES = [
    Case("fenced", "json",
         'Reading it now.\n```json\n{"name": "read", "arguments": {"path": "a.py", "offset": 10}}\n```',
         "Reading it now.", [("read", {"path": "a.py", "offset": 10})]),
    Case("bare_function_key_string_arguments", "json",
         '{"function": "read", "arguments": "{\\"path\\": \\"b.py\\", \\"limit\\": \\"3\\"}"}\n'
         '{"name": "write", "arguments": {"path": "c", "content": "x"}}',
         "", [("read", {"path": "b.py", "limit": 3}), ("write", {"path": "c", "content": "x"})]),
    Case("lists_and_several_objects", "json",
         '```json\n[{"name": "read", "arguments": {"path": "1"}}, {"name": "read", "arguments": {"path": "2"}}]\n```\n'
         '```json\n{"name": "read", "arguments": {"path": "3"}}\n{"name": "read", "arguments": {"path": "4"}}\n```',
         "", [("read", {"path": p}) for p in "1234"]),
    Case("json_that_is_not_a_call", "json",
         'Here is the config:\n```json\n{"name": "demo", "version": 2}\n```\nand inline {"name": "read"} too.',
         'Here is the config:\n```json\n{"name": "demo", "version": 2}\n```\nand inline {"name": "read"} too.'),
    Case("json_whose_name_is_a_list", "json",  # not a call (and once crashed: a list is unhashable)
         '```json\n{"name": ["read"], "version": 2}\n```', '```json\n{"name": ["read"], "version": 2}\n```'),
    Case("unknown_and_unfinished", "json",
         '```json\n{"name": "delete", "arguments": {}}\n```\n'
         '{"name": "write", "arguments": {"path": "x", "content": "unte',
         "", [], [("unknown_function", "delete", None), ("unfinished_tool_call", "write", None)]),
    Case("invalid_arguments", "json", '{"name": "read", "arguments": "not json"}\nok', "ok", [],
         [("invalid_arguments", "read", None)]),
    Case("python_literal", "json", "{'name': 'read', 'arguments': {'path': 'p', 'limit': 2,}}", "",
         [("read", {"path": "p", "limit": 2})]),
    Case("wrapped_in_tool_call", "json", '<tool_call>\n{"name": "read", "arguments": {"path": "w"}}\n</tool_call>',
         "", [("read", {"path": "w"})]),
]

CASES = QWEN + MINICPM + JSON_CASES


@dataclass
class Parsed:
    text: str
    calls: list[tuple[str, str]]  # (name, arguments JSON text)
    errors: list[tuple[str, str | None, str | None]]


def check_events(events: list, dialect: str) -> Parsed:
    """Collect a parse and check the event stream's own invariants."""
    fragments: dict[int, list[str]] = {}
    calls, errors, text = [], [], []
    for e in events:
        if isinstance(e, TextDelta):
            text.append(e.text)
        elif isinstance(e, CallStart):
            assert e.index not in fragments
            assert e.id.startswith("call_") and len(e.id) == 5 + 24
            fragments[e.index] = []
        elif isinstance(e, ArgsDelta):
            fragments[e.index].append(e.fragment)
        elif isinstance(e, CallEnd):
            assert "".join(fragments[e.index]) == e.arguments
            value = json.loads(e.arguments)
            assert isinstance(value, dict)
            assert e.arguments == json.dumps(value, ensure_ascii=False, separators=(",", ":"))
            calls.append((e.name, e.arguments))
        else:
            assert isinstance(e, CallError)
            errors.append((e.code, e.function, e.parameter))
    joined = "".join(text)
    if dialect != "json":
        for marker in list(DIALECTS[dialect].call_openers()) + list(CLOSERS):
            for t in text:
                assert marker not in t, f"call markup {marker!r} leaked into text {t!r}"
    else:
        assert '"arguments"' not in joined
    return Parsed(joined, calls, errors)


def parse(dialect: str, pieces: list[str], tools: list | None = None) -> Parsed:
    parser = DIALECTS[dialect].parser(TOOLS if tools is None else tools)
    events = []
    for p in pieces:
        events += parser.feed(p)
    events += parser.finish()
    return check_events(events, dialect)


def token_pieces(text: str, seed: int) -> list[str]:
    rng = random.Random(seed)
    pieces, i = [], 0
    while i < len(text):
        n = rng.randint(1, 6)
        pieces.append(text[i:i + n])
        i += n
    return pieces


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{c.dialect}-{c.id}")
def test_vector(case: Case) -> None:
    got = parse(case.dialect, [case.output])
    assert got.text == case.text
    assert [(n, json.loads(a)) for n, a in got.calls] == case.calls
    assert got.errors == case.errors


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{c.dialect}-{c.id}")
def test_streaming_matches_whole(case: Case) -> None:
    whole = parse(case.dialect, [case.output])
    assert parse(case.dialect, list(case.output)) == whole
    for seed in range(5):
        assert parse(case.dialect, token_pieces(case.output, seed)) == whole


@pytest.mark.parametrize("case", [c for c in CASES if not c.errors], ids=lambda c: f"{c.dialect}-{c.id}")
def test_render_assistant_round_trip(case: Case) -> None:
    first = parse(case.dialect, [case.output])
    tool_calls = [{"id": f"call_{i}", "type": "function", "function": {"name": n, "arguments": a}}
                  for i, (n, a) in enumerate(first.calls)]
    rendered = DIALECTS[case.dialect].render_assistant(first.text, tool_calls)
    assert parse(case.dialect, [rendered]) == first


def test_a_declared_argument_name_with_a_bracket_is_read_whole() -> None:
    """`<parameter=x>y>` (what a grammar writes for an argument named "x>y") names "x>y", not "x": the tag's
    first '>' would cut a declared name short. Undeclared names still end at the first '>'."""
    tools = parse_tools([_fn("cmp", {"x>y": {"type": "integer"}, "x>y>z": {"type": "string"},
                                     "x": {"type": "string"}}, ["x>y"])])
    output = call("cmp", param("x>y", "-1") + param("x>y>z", "deep") + param("x", "a>b") + param("u>v", "1"))
    whole = parse("qwen_xml", [output], tools)
    assert [(n, json.loads(a)) for n, a in whole.calls] == [("cmp", {"x>y": -1, "x>y>z": "deep", "x": "a>b", "u": "v>\n1"})]
    assert parse("qwen_xml", list(output), tools) == whole
    for seed in range(5):
        assert parse("qwen_xml", token_pieces(output, seed), tools) == whole


@pytest.mark.parametrize("dialect", sorted(DIALECTS))
def test_replayed_arguments_that_are_not_json_render_as_they_are(dialect: str) -> None:
    raw = "{'path': oops"
    out = DIALECTS[dialect].render_assistant("", [{"id": "call_1", "type": "function",
                                                   "function": {"name": "read", "arguments": raw}}])
    assert raw in out
    assert DIALECTS[dialect].render_assistant("hi", []) == "hi"


LONE_SURROGATE_CALLS = {
    "qwen_xml": '<tool_call>\n<function=configure>\n<parameter=name>\nx\n</parameter>\n<parameter=env>\n'
                '{"k": "\\ud800"}\n</parameter>\n</function>\n</tool_call>',
    "minicpm_xml": '<function name="configure"><param name="name">x</param><param name="env">{"k": "\\udc00"}'
                   '</param></function>',
    "json": '{"name": "configure", "arguments": {"name": "x", "env": {"k": "\\ud83d"}}}',
}


@pytest.mark.parametrize("dialect", sorted(DIALECTS))
def test_a_lone_surrogate_escape_never_reaches_the_arguments(dialect: str) -> None:
    """JSON's grammar allows "\\ud800", but no UTF-8 text holds the lone surrogate it decodes to: arguments
    holding one (written by the model, or replayed by a client) are read as not JSON, never decoded into a string
    the response's encoder or the tokenizer then fails on (a 500)."""
    import orjson

    parser = DIALECTS[dialect].parser(TOOLS)
    events = list(parser.feed(LONE_SURROGATE_CALLS[dialect])) + list(parser.finish())
    for event in events:
        orjson.dumps(vars(event))  # raises on a surrogate
    assert any(isinstance(e, (CallEnd, CallError)) for e in events), events
    replayed = DIALECTS[dialect].render_assistant("", [{"id": "call_1", "type": "function", "function": {
        "name": "configure", "arguments": '{"name": "x", "env": {"k": "\\ud800"}}'}}])
    replayed.encode("utf-8")  # raises on a surrogate
    assert "\\ud800" in replayed
    assert json.loads('"\\ud83d\\ude00"') == loads_forgiving('"\\ud83d\\ude00"')  # a pair is a character


@pytest.mark.parametrize("dialect", ["qwen_xml", "minicpm_xml"])
def test_text_values_stream_before_the_parameter_ends(dialect: str) -> None:
    if dialect == "qwen_xml":
        head = "<tool_call>\n<function=write>\n<parameter=path>\na\n</parameter>\n<parameter=content>\n"
    else:
        head = '<function name="write"><param name="path">a</param><param name="content"><![CDATA['
    parser = DIALECTS[dialect].parser(TOOLS)
    events = parser.feed(head)
    assert [e.name for e in events if isinstance(e, CallStart)] == ["write"]
    streamed = ""
    for _ in range(50):
        streamed += "".join(e.fragment for e in parser.feed("line \"x\"\n") if isinstance(e, ArgsDelta))
    assert streamed.count('line \\"x\\"') >= 49  # all but the held-back tail already went out


def test_text_streams_while_it_arrives() -> None:
    parser = DIALECTS["qwen_xml"].parser(TOOLS)
    assert parser.feed("Hello there") == [TextDelta("Hello there")]
    assert parser.feed(" <tool") == []  # could open a call: held
    assert parser.feed("s> are") == [TextDelta(" <tools> are")]


@pytest.mark.parametrize("dialect", ["qwen_xml", "minicpm_xml"])
@pytest.mark.parametrize("cut", [1, 5])
def test_a_forced_call_cut_inside_its_opener_is_an_unfinished_call(dialect: str, cut: int) -> None:
    """Prose may end in "<tool" (it stays text, above); a turn whose grammar compels a call may not: the end of
    the output inside the opener is an unfinished call."""
    d = DIALECTS[dialect]
    opener = d.call_openers()[0]
    for forced, text_expected in ((False, True), (True, False)):
        parser = d.parser(TOOLS)
        parser.call_forced = forced
        events = parser.feed(opener[:cut]) + parser.finish()
        texts = [e.text for e in events if isinstance(e, TextDelta)]
        errors = [e.code for e in events if isinstance(e, CallError)]
        assert (texts, errors) == (([opener[:cut]], []) if text_expected else ([], ["unfinished_tool_call"])), events


@pytest.mark.parametrize("output", ["`", "``", "```", "```json", "```json\n{\n  \"", '```json\n{"na', "{", '{"',
                                    '{\n  "function', "<tool_ca", "<tool_call>"])
@pytest.mark.parametrize("streamed", [False, True])
def test_a_forced_json_call_cut_inside_its_opener_is_an_unfinished_call(output: str, streamed: bool) -> None:
    """A JSON-dialect turn whose grammar compels a call, cut by max_tokens before the call's head is complete
    ("```json\n{\n  \"" at max_tokens 6): the output is the start of the call, reported as an unfinished one with
    no content, as the XML dialects report it (it came back as content, without tool_call_error)."""
    for forced in (False, True):
        parser = DIALECTS["json"].parser(TOOLS)
        parser.call_forced = forced
        pieces = list(output) if streamed else [output]
        events = [e for piece in pieces for e in parser.feed(piece)] + parser.finish()
        text = "".join(e.text for e in events if isinstance(e, TextDelta))
        errors = [e.code for e in events if isinstance(e, CallError)]
        if forced:
            assert (text, errors) == ("", ["unfinished_tool_call"]), events
        elif output != "<tool_call>":  # unforced, a head cut short is text (an opened <tool_call> is a call)
            assert (text, errors) == (output, []), events


def test_a_forced_json_call_keeps_the_calls_it_finished() -> None:
    """Forced or not, a complete call stands, and a turn cut in the closing fence after it has no text."""
    call = '```json\n{"name": "read", "arguments": {"path": "a"}}\n``'
    for forced in (False, True):
        parser = DIALECTS["json"].parser(TOOLS)
        parser.call_forced = forced
        events = parser.feed(call) + parser.finish()
        assert [type(e) for e in events if not isinstance(e, (CallStart, ArgsDelta))] == [CallEnd], events


@pytest.mark.parametrize(("output", "calls", "error"), [
    ("<tool_call>\n<function=read>\n<parameter=path>\nabc\n</parameter>\n</function>\n</tool_ca", 1, None),
    ("<tool_call>\n<function=read>\n<parameter=path>\nabc\n</parameter>\n</func", 0, "unfinished_tool_call"),
    ("<tool_call>\n<function=read>\n<param", 0, "unfinished_tool_call"),
    ("<tool_call>\n<function", 0, "unfinished_tool_call"),
])
def test_an_output_cut_inside_a_tag_is_unfinished_not_malformed(output: str, calls: int, error: str | None) -> None:
    """max_tokens can end the output in the middle of any tag: inside the call that is an unfinished call; in
    the closer after a complete call the call stands, and the stub of the closer is not text."""
    parser = DIALECTS["qwen_xml"].parser(TOOLS)
    events = parser.feed(output) + parser.finish()
    assert [e for e in events if isinstance(e, TextDelta)] == []
    assert sum(isinstance(e, CallEnd) for e in events) == calls
    assert [e.code for e in events if isinstance(e, CallError)] == ([error] if error else [])


CLOSABLE = {
    "qwen_xml": ["<tool_call>\n<function=read>\n", "<tool_call>\n<function=read>\n<parameter=path>\nabc",
                 "<tool_call>\n<function=read>\n<parameter=path>\nabc\n</parameter>\n",
                 "<tool_call>\n<function=read>\n<parameter=path>\nabc\n</parameter>\n</function>"],
    "minicpm_xml": ['<function name="read">', '<function name="read"><param name="path">abc',
                    '<function name="read"><param name="path"><![CDATA[abc',
                    '<function name="read"><param name="path">abc</param>'],
    "json": ['{"name": "read", "arguments": {"path": "abc"', '{"name": "read", "arguments": {"path": "abc"}',
             '```json\n{"name": "read", "arguments": {"path": "abc"}}'],
}


@pytest.mark.parametrize("dialect", sorted(CLOSABLE))
def test_closing_texts_close_a_call_stopped_inside(dialect: str) -> None:
    d = DIALECTS[dialect]
    for prefix in CLOSABLE[dialect]:
        results = [parse(dialect, [prefix + closing]) for closing in d.closing_texts()]
        assert any(len(r.calls) == 1 and not r.errors for r in results), prefix


def test_call_openers_open_calls() -> None:
    assert DIALECTS["qwen_xml"].call_openers() == ["<tool_call>", "<function="]
    for d in DIALECTS.values():
        assert d.call_openers() and d.closing_texts()
    assert [d.grammar_capable for d in DIALECTS.values()] == [True, False, True]


# --- rendering the prompt side ---


@pytest.mark.parametrize("dialect", sorted(DIALECTS))
def test_render_system_lists_every_tool_after_the_system_text(dialect: str) -> None:
    text = DIALECTS[dialect].render_system(TOOLS, "You are a coding agent.")
    assert text.startswith("You are a coding agent.\n\n")
    for t in TOOLS:
        assert t.name in text
    assert "$schema" not in text and "9007199254740991" not in text
    assert DIALECTS[dialect].render_system(TOOLS, None).startswith("# Tools")


def test_render_system_qwen_idiom() -> None:
    text = DIALECTS["qwen_xml"].render_system(TOOLS[:1], None)
    assert "<tools>\n<function>\n<name>read</name>" in text
    assert "<parameter>\n<name>path</name>\n<type>string</type>" in text
    assert '<required>["path"]</required>' in text


@pytest.mark.parametrize("dialect", sorted(DIALECTS))
def test_tool_results_are_wrapped_user_turns(dialect: str) -> None:
    role, content = DIALECTS[dialect].render_tool_result("42 lines", "call_1", "read")
    assert role == "user"
    assert content == "<tool_response>\n42 lines\n</tool_response>"


# --- tool definitions and dialect choice ---


def test_parse_tools() -> None:
    specs = parse_tools(RAW_TOOLS)
    assert [s.name for s in specs] == ["read", "write", "configure"]
    assert specs[0].description == "the read tool"
    assert specs[0].parameter_schema("limit") == {"type": "integer"}
    assert parse_tools([{"type": "function", "function": {"name": "x"}}])[0].parameters["type"] == "object"


@pytest.mark.parametrize("raw", [
    [{"type": "function"}],
    [{"type": "function", "function": {"description": "no name"}}],
    [{"type": "code_interpreter", "function": {"name": "x"}}],
    [{"type": "function", "function": {"name": "x", "parameters": "nope"}}],
    [{"type": "function", "function": {"name": ""}}],
    ["read"],
    [{"type": "function", "function": {"name": "x"}}, {"type": "function", "function": {"name": "x"}}],
])
def test_malformed_tool_definitions_are_400(raw: list) -> None:
    with pytest.raises(ApiError) as info:
        parse_tools(raw)
    assert info.value.status == 400 and info.value.error_type == "invalid_request_error"


@pytest.mark.parametrize(("name", "arch", "template", "expected"), [
    ("ornith-7b", "qwen3", None, "json"),
    ("Ornith", "llama", "{{ bos_token }}", "json"),
    ("minicpm5", "llama", "{{- bos_token }}{% for m in messages %}{{ m.content }}{% endfor %}", "minicpm_xml"),
    ("m", "llama", "{{ bos_token + messages[0].content }}", "minicpm_xml"),
    ("m", "llama", "{% if bos_token %}x{% endif %}", "qwen_xml"),
    ("m", "llama", None, "qwen_xml"),
    ("qwen3-coder", "qwen3moe", "{{ bos_token }}", "qwen_xml"),
    ("SmolLM2", "llama", "{% for m in messages %}<|im_start|>{{ m.role }}{% endfor %}", "qwen_xml"),
])
def test_dialect_for(name: str, arch: str, template: str | None, expected: str) -> None:
    assert dialect_for(name, arch, template).name == expected


# --- argument typing ---


@pytest.mark.parametrize(("raw", "schema", "expected"), [
    ("123", {"type": "string"}, "123"),
    (" 42 ", {"type": "integer"}, 42),
    ("-7", {"type": "integer"}, -7),
    ("5.0", {"type": "integer"}, 5),
    ("2.5", {"type": "number"}, 2.5),
    ("10", {"type": "number"}, 10),
    ("True", {"type": "boolean"}, True),
    ("false", {"type": "boolean"}, False),
    ("{'a': True, 'b': None,}", {"type": "object"}, {"a": True, "b": None}),
    ('[1, "two", false]', {"type": "array"}, [1, "two", False]),
    ("12", {"type": ["integer", "string"]}, 12),
    ("twelve", {"type": ["integer", "string"]}, "twelve"),
    ("3", {"anyOf": [{"type": "string"}, {"type": "integer"}]}, "3"),
    ("null", {"anyOf": [{"type": "null"}, {"type": "string"}]}, None),
    ("slow", {"enum": ["fast", "slow"]}, "slow"),
    ("2", {"enum": [1, 2]}, 2),
    ("not a number", {"type": "integer"}, "not a number"),
    ("nan", {"type": "number"}, "nan"),
    ('{"k": 1}', None, {"k": 1}),
    ("plain words", {}, "plain words"),
    ("17", {"description": "no type"}, 17),
])
def test_type_value(raw: str, schema: Any, expected: Any) -> None:
    value = type_value(raw, schema)
    assert value == expected and type(value) is type(expected)


def test_schema_helpers() -> None:
    assert schema_types({"$schema": "x", "type": "object", "properties": {}}) == ["object"]
    assert schema_types({"properties": {}}) == ["object"]
    assert schema_types({"oneOf": [{"type": "integer"}, {"type": "null"}]}) == ["integer", "null"]
    assert streams_as_string({"type": "string"}) and streams_as_string({"enum": ["a"]})
    assert not streams_as_string({"type": ["integer", "string"]}) and not streams_as_string(None)
    assert loads_forgiving("[1, 2,]") == [1, 2]
    with pytest.raises(ValueError):
        loads_forgiving("__import__('os')")


class _ByteTokens:
    """A vocabulary of the 256 bytes, one token each: enough for ChoiceOutput's decoder."""

    def token_bytes(self, token_id: int) -> bytes:
        return bytes([token_id])

    def is_hidden(self, token_id: int) -> bool:
        return False


@pytest.mark.parametrize("max_calls,expected", [(None, ["read", "write"]), (1, ["read"])])
def test_parallel_tool_calls_false_keeps_the_first_call(max_calls: int | None, expected: list[str]) -> None:
    """`parallel_tool_calls: false` (llama-server honours it): the first call is returned and streamed, later
    ones are dropped, in both the choice and its deltas."""
    from pantheon.chat.output import ChoiceOutput
    from pantheon.engine.sampling import SampledToken

    text = "ok " + call("read", param("path", "a.txt")) + "\n" + call("write", param("path", "b") + param("content", "x"))
    out = ChoiceOutput(_ByteTokens(), stops=[], think=False, prompt_opens_think=False, want_logprobs=False,  # type: ignore[arg-type]
                       tool_parser=DIALECTS["qwen_xml"].parser(TOOLS), max_calls=max_calls)
    streamed = []
    for b in text.encode():
        streamed += out.push(SampledToken(b)).tool_calls
    streamed += out.finish().tool_calls
    assert [c["function"]["name"] for c in out.tool_calls] == expected
    assert [d["name"] for d in streamed if "name" in d] == expected


def test_the_stream_sends_a_choices_content_before_its_calls() -> None:
    """spec (streaming): content deltas, then tool-call chunks, then the closing chunk. Prose the model writes
    after a call stays in the content (as in the non-streamed message) and still goes out before the call."""
    from pantheon.chat.output import ChoiceOutput
    from pantheon.engine.sampling import SampledToken

    text = "Let me look. " + call("read", param("path", "a.txt")) + "\nThat should do."
    out = ChoiceOutput(_ByteTokens(), stops=[], think=False, prompt_opens_think=False, want_logprobs=False,  # type: ignore[arg-type]
                       tool_parser=DIALECTS["qwen_xml"].parser(TOOLS))
    order = []
    for b in text.encode():
        delta = out.push(SampledToken(b))
        order += ["content"] * bool(delta.content) + ["call"] * bool(delta.tool_calls)
    last = out.finish()
    order += ["content"] * bool(last.content) + ["call"] * bool(last.tool_calls)
    assert "call" in order and "content" not in order[order.index("call"):], order
    assert out.content.startswith("Let me look.") and out.content.rstrip().endswith("That should do.")
    assert [c["function"]["name"] for c in out.tool_calls] == ["read"]
