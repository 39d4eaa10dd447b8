"""Qwen3-Coder's XML calls, the default dialect:

    <tool_call>
    <function=NAME>
    <parameter=KEY>
    VALUE
    </parameter>
    </function>
    </tool_call>

Values are raw text (no escaping, any number of lines), typed afterwards from the tool's schema. The parser
forgives the slips models make: a call whose <tool_call> opener was dropped (a bare <function= after prose),
a missing </tool_call> once </function> closed, a missing </function> before </tool_call>, and a Qwen3-style
JSON object inside <tool_call> instead of the XML body.
"""

from __future__ import annotations

import json

from pantheon.chat.tools.base import (Dialect, ToolCallParser, ToolSpec, call_parts, find_first, join_system,
                                      partial_suffix, prompt_schema)
from pantheon.chat.tools.json_calls import JsonValueScanner, emit_json_calls

OPEN_CALL = "<tool_call>"
CLOSE_CALL = "</tool_call>"
OPEN_FUNCTION = "<function="
CLOSE_FUNCTION = "</function>"
OPEN_PARAMETER = "<parameter="
CLOSE_PARAMETER = "</parameter>"

_TEXT_MARKERS = (OPEN_CALL, OPEN_FUNCTION, CLOSE_CALL, CLOSE_FUNCTION, CLOSE_PARAMETER)  # stray closers: dropped
_MAX_NAME = 256


class QwenXmlParser(ToolCallParser):
    def __init__(self, tools: list[ToolSpec]) -> None:
        super().__init__(tools)
        self._state = "text"
        self._json: JsonValueScanner | None = None  # a JSON body inside <tool_call>

    def _step(self, final: bool) -> bool:
        return getattr(self, "_in_" + self._state)(final)

    def _in_text(self, final: bool) -> bool:
        hit = find_first(self._buf, _TEXT_MARKERS)
        if hit is None:
            keep = 0 if final else partial_suffix(self._buf, _TEXT_MARKERS)
            if len(self._buf) > keep:
                self._text(self._consume(len(self._buf) - keep))
            return False
        i, marker = hit
        self._text(self._consume(i))
        self._consume(len(marker))
        if marker in (OPEN_CALL, OPEN_FUNCTION):
            self._open_call()
            self._state = "head" if marker == OPEN_CALL else "name"
        return True

    def _in_head(self, final: bool) -> bool:
        """After <tool_call>: <function=NAME> (or a JSON object) follows."""
        rest = self._skip_whitespace()
        if not rest:
            return False
        if rest.startswith(OPEN_FUNCTION):
            self._consume(len(OPEN_FUNCTION))
            self._state = "name"
        elif rest.startswith(("{", "[")):
            self._json = JsonValueScanner()
            self._state = "json"
        elif rest.startswith(CLOSE_CALL):
            self._consume(len(CLOSE_CALL))
            self._fail("malformed_tool_call", "an empty <tool_call> block")
            self._state = "text"
        elif not final and (OPEN_FUNCTION.startswith(rest) or CLOSE_CALL.startswith(rest)):
            return False
        else:
            self._fail("malformed_tool_call", "<tool_call> is not followed by <function=NAME>")
            self._state = "skip"
        return True

    def _in_name(self, final: bool) -> bool:
        i = self._buf.find(">")
        if i < 0:
            if len(self._buf) > _MAX_NAME or "\n" in self._buf:
                self._fail("malformed_tool_call", "<function= is not closed by '>'")
                self._state = "skip"
                return True
            return False
        name = self._consume(i + 1)[:-1].strip().strip("\"'")
        if name not in self._tools:
            self._fail("unknown_function", f"the model called {name!r}, which is not an offered tool", function=name)
            self._state = "skip"
            return True
        self._start_call(name)
        self._state = "body"
        return True

    def _in_body(self, final: bool) -> bool:
        """Inside <function=...>: parameters, then </function>."""
        rest = self._skip_whitespace()
        if not rest:
            return False
        if rest.startswith(OPEN_PARAMETER):
            self._consume(len(OPEN_PARAMETER))
            self._state = "key"
        elif rest.startswith(CLOSE_FUNCTION):
            self._consume(len(CLOSE_FUNCTION))
            self._end_call()
            self._state = "after"
        elif rest.startswith(CLOSE_CALL):  # </function> was dropped; the call is plainly over
            self._consume(len(CLOSE_CALL))
            self._end_call()
            self._state = "text"
        elif not final and any(m.startswith(rest) for m in (OPEN_PARAMETER, CLOSE_FUNCTION, CLOSE_CALL)):
            return False
        else:
            self._fail("malformed_tool_call", f"unexpected text inside <function={self._name}>")
            self._state = "skip"
        return True

    def _in_key(self, final: bool) -> bool:
        i = self._buf.find(">")
        if i < 0:
            if len(self._buf) > _MAX_NAME or "\n" in self._buf:
                self._fail("malformed_tool_call", "<parameter= is not closed by '>'")
                self._state = "skip"
                return True
            return False
        self._begin_value(self._consume(i + 1)[:-1].strip().strip("\"'"))
        self._state = "newline"
        return True

    def _in_newline(self, final: bool) -> bool:
        """The value starts on the line after <parameter=KEY>; that one newline is not part of it."""
        if not self._buf:
            return False
        if self._buf[0] == "\n":
            self._consume(1)
        self._state = "value"
        return True

    def _in_value(self, final: bool) -> bool:
        if not self._read_value_until(CLOSE_PARAMETER, strip_newline=True):
            return False
        self._end_value()
        self._state = "body"
        return True

    def _in_after(self, final: bool) -> bool:
        """After </function>: </tool_call>, which a model may leave out."""
        rest = self._skip_whitespace()
        if rest.startswith(CLOSE_CALL):
            self._consume(len(CLOSE_CALL))
        elif not final and CLOSE_CALL.startswith(rest):
            return False
        self._state = "text"
        return True

    def _in_skip(self, final: bool) -> bool:
        """A failed call: drop its text up to the end of the call."""
        hit = find_first(self._buf, (CLOSE_FUNCTION, CLOSE_CALL))
        if hit is None:
            self._consume(len(self._buf) - partial_suffix(self._buf, (CLOSE_FUNCTION, CLOSE_CALL)))
            return False
        i, marker = hit
        self._consume(i + len(marker))
        self._state = "after" if marker == CLOSE_FUNCTION else "text"
        return True

    def _in_json(self, final: bool) -> bool:
        assert self._json is not None
        self._consume(self._json.feed(self._buf))
        if not self._json.done:
            return False
        emit_json_calls(self, self._json.text)
        self._json = None
        self._state = "after"
        return True

    def _skip_whitespace(self) -> str:
        rest = self._buf.lstrip()
        self._consume(len(self._buf) - len(rest))
        return rest

    def _finish_call(self) -> None:
        if self._state in ("head", "name", "body", "key", "newline", "value", "json"):
            where = f" in parameter {self._key!r}" if self._key is not None else ""
            self._fail("unfinished_tool_call", f"the output ended inside a tool call{where}")
        self._state = "text"
        self._buf = ""


class QwenXml(Dialect):
    name = "qwen_xml"
    grammar_capable = True

    def parser(self, tools: list[ToolSpec]) -> ToolCallParser:
        return QwenXmlParser(tools)

    def render_system(self, tools: list[ToolSpec], system: str | None) -> str:
        listing = "\n".join(_render_tool(t) for t in tools)
        text = (
            "# Tools\n\n"
            "You can call the functions listed below when they help with the request.\n\n"
            f"<tools>\n{listing}\n</tools>\n\n"
            "To call a function, write the call in exactly this layout:\n\n"
            "<tool_call>\n<function=function_name>\n<parameter=parameter_name>\nvalue\n</parameter>\n"
            "<parameter=other_parameter>\na value may\nspan several lines\n</parameter>\n</function>\n"
            "</tool_call>\n\n"
            "Rules:\n"
            "- A call is one <tool_call> block holding one <function=...> block; write one block per call.\n"
            "- Give every required parameter. Write values as plain text, objects and arrays as JSON.\n"
            "- Any words for the user come before the first call; nothing follows the last one.\n"
            "- When no function fits, answer normally and do not mention them."
        )
        return join_system(system, text)

    def render_assistant(self, content: str, tool_calls: list[dict]) -> str:
        calls = "\n".join(_render_call(c) for c in tool_calls)
        if not calls:
            return content
        return f"{content}\n\n{calls}" if content and content.strip() else calls

    def closing_texts(self) -> list[str]:
        return [
            "\n</parameter>\n</function>\n</tool_call>",  # inside a value
            "</parameter>\n</function>\n</tool_call>",
            "</function>\n</tool_call>",  # after a complete parameter, or right after the name
            "\n</function>\n</tool_call>",
            "\n</tool_call>",  # after </function>
            "</tool_call>",
        ]

    def call_openers(self) -> list[str]:
        return [OPEN_CALL, OPEN_FUNCTION]


def _render_tool(tool: ToolSpec) -> str:
    params = prompt_schema(tool.parameters)
    lines = ["<function>", f"<name>{tool.name}</name>"]
    if tool.description:
        lines.append(f"<description>{tool.description.strip()}</description>")
    lines.append("<parameters>")
    props = params.get("properties") if isinstance(params.get("properties"), dict) else {}
    for key, schema in props.items():
        schema = schema if isinstance(schema, dict) else {}
        lines += ["<parameter>", f"<name>{key}</name>"]
        if "type" in schema:
            t = schema["type"]
            lines.append(f"<type>{t if isinstance(t, str) else json.dumps(t)}</type>")
        if isinstance(schema.get("description"), str):
            lines.append(f"<description>{schema['description'].strip()}</description>")
        for k, v in schema.items():
            if k not in ("type", "description"):
                lines.append(f"<{k}>{json.dumps(v, ensure_ascii=False)}</{k}>")
        lines.append("</parameter>")
    if params.get("required"):
        lines.append(f"<required>{json.dumps(params['required'], ensure_ascii=False)}</required>")
    lines += ["</parameters>", "</function>"]
    return "\n".join(lines)


def _render_call(call: dict) -> str:
    name, args, raw = call_parts(call)
    lines = [OPEN_CALL, f"{OPEN_FUNCTION}{name}>"]
    if args is None:
        lines.append(raw)
    else:
        for key, value in args.items():
            text = value if isinstance(value, str) else json.dumps(value, ensure_ascii=False)
            lines += [f"{OPEN_PARAMETER}{key}>", text, CLOSE_PARAMETER]
    lines += [CLOSE_FUNCTION, CLOSE_CALL]
    return "\n".join(lines)
