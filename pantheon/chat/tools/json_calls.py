"""JSON calls (served names starting "ornith"): an object naming the function and its arguments,

    ```json
    {"name": "NAME", "arguments": {...}}
    ```

in a fenced block, or bare at the start of a line, or inside <tool_call>. "function" may stand for "name",
"parameters" for "arguments", the arguments may arrive as a JSON string holding the object, and one block
may hold several objects or a list of them. A fenced or bare object that does not look like a call (say,
JSON the user asked for) is text. Calls are emitted whole, when their object closes.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

from pantheon.chat.tools.arguments import loads_forgiving, type_arguments
from pantheon.chat.tools.base import (Dialect, StateParser, ToolCallParser, ToolSpec, call_parts, find_first,
                                      join_system, json_tool_listing, partial_suffix)

FENCE = "```"
OPEN_WRAPPER = "<tool_call>"
CLOSE_WRAPPER = "</tool_call>"

_TRIGGERS = (FENCE, OPEN_WRAPPER, "{")
_NAME_KEY = ("alt", ('"name"', '"function"', "'name'", "'function'"))
# Heads that open a call, as (kind, options) steps; "mark" is where the JSON value starts.
_HEADS: dict[str, list[tuple[str, tuple[str, ...]]]] = {
    FENCE: [("lit", (FENCE,)), ("opt", ("json", "JSON")), ("ws", ()), ("mark", ()), ("opt", ("[",)), ("ws", ()),
            ("lit", ("{",)), ("ws", ()), _NAME_KEY, ("ws", ()), ("lit", (":",))],
    OPEN_WRAPPER: [("lit", (OPEN_WRAPPER,)), ("ws", ()), ("mark", ()), ("lit", ("{", "["))],
    "{": [("mark", ()), ("lit", ("{",)), ("ws", ()), _NAME_KEY, ("ws", ()), ("lit", (":",))],
}
_CLOSERS = {FENCE: FENCE, OPEN_WRAPPER: CLOSE_WRAPPER, "{": None}
_NAME_IN_TEXT = re.compile(r"""["'](?:name|function)["']\s*:\s*["']([^"']*)""")


def _match_head(text: str, steps: list[tuple[str, tuple[str, ...]]]) -> tuple[str, int]:
    """("yes", where the value starts) | ("maybe", 0) when `text` ends too soon to tell | ("no", 0)."""
    i = 0
    mark = 0
    for kind, options in steps:
        if kind == "mark":
            mark = i
            continue
        if kind == "ws":
            while i < len(text) and text[i] in " \t\r\n":
                i += 1
            continue
        rest = text[i:]
        for option in options:
            if rest.startswith(option):
                i += len(option)
                break
            if option.startswith(rest):
                return "maybe", 0
        else:
            if kind != "opt":
                return "no", 0
    return "yes", mark


class JsonValueScanner:
    """Finds the end of one JSON object or array fed in pieces (strings and nesting tracked, never rescanned)."""

    _SPECIAL = re.compile(r"[\"'\\{}\[\]]")

    def __init__(self) -> None:
        self._parts: list[str] = []
        self._depth = 0
        self._quote: str | None = None
        self._escape = False
        self.done = False

    @property
    def text(self) -> str:
        return "".join(self._parts)

    def feed(self, text: str) -> int:
        """Scan `text`; return how much of it belongs to the value (all of it until the value closes)."""
        pos = 0
        if self._escape and text:
            self._escape = False
            pos = 1
        while True:
            m = self._SPECIAL.search(text, pos)
            if m is None:
                self._parts.append(text)
                return len(text)
            ch, pos = m.group(), m.end()
            if self._quote is not None:
                if ch == "\\":
                    if pos < len(text):
                        pos += 1
                    else:
                        self._escape = True
                elif ch == self._quote:
                    self._quote = None
            elif ch in "\"'":
                self._quote = ch
            elif ch in "{[":
                self._depth += 1
            elif ch in "}]":
                self._depth -= 1
                if self._depth <= 0:
                    self.done = True
                    self._parts.append(text[:pos])
                    return pos


@dataclass(frozen=True)
class _Problem:
    code: str
    function: str | None
    message: str


def read_call(item: Any, tools: dict[str, ToolSpec]) -> tuple[str, dict] | _Problem:
    """One call object -> (name, typed arguments), or what is wrong with it."""
    if not isinstance(item, dict):
        return _Problem("malformed_tool_call", None, "a call must be a JSON object")
    name = item.get("name", item.get("function"))
    args = item["arguments"] if "arguments" in item else item.get("parameters", {})
    if isinstance(name, dict):  # {"function": {"name": ..., "arguments": ...}}, as OpenAI writes it
        args = name.get("arguments", name.get("parameters", args))
        name = name.get("name")
    if not isinstance(name, str):
        return _Problem("malformed_tool_call", None, "the call names no function")
    if name not in tools:
        return _Problem("unknown_function", name, f"the model called {name!r}, which is not an offered tool")
    if isinstance(args, str):
        try:
            args = loads_forgiving(args) if args.strip() else {}
        except ValueError:
            return _Problem("invalid_arguments", name, "the arguments string is not JSON")
    if args is None:
        args = {}
    if not isinstance(args, dict):
        return _Problem("invalid_arguments", name, "the arguments are not a JSON object")
    return name, type_arguments(args, tools[name].arguments_schema)


def emit_json_value(parser: ToolCallParser, value: Any) -> None:
    """Emit the calls of one parsed object (or list of objects) through `parser`."""
    for item in value if isinstance(value, list) else [value]:
        found = read_call(item, parser._tools)
        if isinstance(found, _Problem):
            parser._fail(found.code, found.message, function=found.function)
        else:
            parser._emit_whole_call(*found)


def emit_json_calls(parser: ToolCallParser, text: str) -> None:
    """Emit the calls of one JSON value's text (an unparsable one is a malformed call)."""
    try:
        value = loads_forgiving(text)
    except ValueError:
        parser._fail("malformed_tool_call", "the call is not valid JSON", function=_function_named_in(text))
        return
    emit_json_value(parser, value)


def _function_named_in(text: str) -> str | None:
    """The function a call's JSON text names, found by pattern (the text does not parse, or not yet)."""
    match = _NAME_IN_TEXT.search(text)
    return match.group(1) if match else None


def _looks_like_call(value: Any, tools: dict[str, ToolSpec]) -> bool:
    if isinstance(value, list):
        return any(_looks_like_call(v, tools) for v in value)
    if not isinstance(value, dict):
        return False
    name = value.get("name", value.get("function"))
    # A name of any JSON type may come from the model: only a string can name a tool (a list is unhashable).
    named_tool = isinstance(name, str) and name in tools
    return isinstance(name, dict) or named_tool or "arguments" in value or "parameters" in value


class JsonCallParser(StateParser):
    _CALL_STATES = frozenset({"value"})

    def __init__(self, tools: list[ToolSpec]) -> None:
        super().__init__(tools)
        self._line_start = True  # the text passed on so far ends at the start of a line
        self._scanner = JsonValueScanner()
        self._head = ""  # the text between the trigger and the value, given back if it is not a call
        self._closer: str | None = None
        self._calls_in_block = 0

    def _in_text(self, final: bool) -> bool:
        buf = self._buf
        pos = 0
        while (hit := find_first(buf, _TRIGGERS, pos)) is not None:
            i, trigger = hit
            pos = i + 1
            if trigger == "{" and not self._at_line_start(i):
                continue
            verdict, value_at = _match_head(buf[i:], _HEADS[trigger])
            if verdict == "maybe" and final and self.call_forced:
                return self._cut_in_opener(i)
            if verdict == "no" or (verdict == "maybe" and final):
                continue
            self._pass_text(self._consume(i))
            if verdict == "maybe":
                return False
            self._open_call()
            self._head = self._consume(value_at)
            self._closer = _CLOSERS[trigger]
            self._calls_in_block = 0
            self._scanner = JsonValueScanner()
            self._state = "value"
            return True
        if final and self.call_forced and (opener := partial_suffix(buf, (FENCE, OPEN_WRAPPER))):
            return self._cut_in_opener(len(buf) - opener)
        keep = 0 if final else partial_suffix(buf, (FENCE, OPEN_WRAPPER))
        self._pass_text(self._consume(len(buf) - keep))
        return False

    def _cut_in_opener(self, start: int) -> bool:
        """The output ended inside a call's head (max_tokens cut it at "```", or at "```json", a line break, "{"
        and the first quote of "name") on a turn whose grammar compels a call: what the grammar forced to be a
        call is an unfinished call, not answer text, as in the XML dialects."""
        self._pass_text(self._consume(start))
        self._consume(len(self._buf))
        self._fail("unfinished_tool_call", "the output ended inside a tool call opener")
        return False

    def _in_value(self, final: bool) -> bool:
        self._consume(self._scanner.feed(self._buf))
        if not self._scanner.done:
            return False
        text = self._scanner.text
        try:
            value = loads_forgiving(text)
        except ValueError:
            emit_json_calls(self, text)
        else:
            if self._calls_in_block == 0 and self._closer != CLOSE_WRAPPER and not _looks_like_call(value, self._tools):
                self._pass_text(self._head + text)  # JSON, but not a call
                self._state = "text"
                return True
            emit_json_value(self, value)
        self._calls_in_block += 1
        self._line_start = True
        self._state = "tail" if self._closer else "text"
        return True

    def _in_tail(self, final: bool) -> bool:
        """Inside a fence or <tool_call> after a value: more values, then the closer."""
        assert self._closer is not None
        rest = self._buf.lstrip(" \t\r\n,")
        self._consume(len(self._buf) - len(rest))
        if not rest:
            return False
        if rest.startswith(self._closer):
            self._consume(len(self._closer))
            self._state = "text"
        elif rest[0] in "{[":
            self._head = ""
            self._scanner = JsonValueScanner()
            self._state = "value"
        elif not final and self._closer.startswith(rest):
            return False
        else:
            self._state = "skip"
        return True

    def _in_skip(self, final: bool) -> bool:
        assert self._closer is not None
        if self._skip_past((self._closer,)) is None:
            return False
        self._state = "text"
        return True

    def _at_line_start(self, i: int) -> bool:
        j = self._buf.rfind("\n", 0, i)
        if self._buf[j + 1:i].strip(" \t"):
            return False
        return j >= 0 or self._line_start

    def _pass_text(self, text: str) -> None:
        if not text:
            return
        j = text.rfind("\n")
        self._line_start = (j >= 0 or self._line_start) and not text[j + 1:].strip(" \t")
        self._text(text)

    def _unfinished_function(self) -> str | None:
        return _function_named_in(self._scanner.text)


class JsonCalls(Dialect):
    name = "json"
    grammar_capable = True

    def parser(self, tools: list[ToolSpec]) -> ToolCallParser:
        return JsonCallParser(tools)

    def render_system(self, tools: list[ToolSpec], system: str | None) -> str:
        text = (
            "# Tools\n\n"
            "You can call the functions below when they help with the request. Each is a JSON object giving "
            "its name, what it does, and a JSON Schema of its arguments.\n\n"
            f"<tools>\n{json_tool_listing(tools)}\n</tools>\n\n"
            "To call a function, write one JSON object per call in a json code block:\n\n"
            '```json\n{"name": "function_name", "arguments": {"parameter_name": "value"}}\n```\n\n'
            "Any words for the user come before the calls. When no function fits, answer normally."
        )
        return join_system(system, text)

    def render_call(self, call: dict) -> str:
        name, args, raw = call_parts(call)
        arguments = json.dumps(args, ensure_ascii=False) if args is not None else raw
        head = f'{{"name": {json.dumps(name, ensure_ascii=False)}, "arguments": '
        return f"{FENCE}json\n{head}{arguments}}}\n{FENCE}"

    def closing_texts(self) -> list[str]:
        return ["}\n```", "}}\n```", "\n```", "}", "}}"]

    def call_openers(self) -> list[str]:
        return [f"{FENCE}json", '{"name"', '{"function"', OPEN_WRAPPER]
