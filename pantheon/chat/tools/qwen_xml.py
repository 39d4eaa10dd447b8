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

from pantheon.chat.tools.base import Dialect, ToolCallParser, ToolSpec, call_parts, join_system, prompt_schema
from pantheon.chat.tools.json_calls import JsonValueScanner, emit_json_calls
from pantheon.chat.tools.xml_calls import XmlCallParser

OPEN_CALL = "<tool_call>"
CLOSE_CALL = "</tool_call>"
OPEN_FUNCTION = "<function="
CLOSE_FUNCTION = "</function>"
OPEN_PARAMETER = "<parameter="
CLOSE_PARAMETER = "</parameter>"

_MAX_NAME = 256


class QwenXmlParser(XmlCallParser):
    _CALL_STATES = frozenset({"head", "name", "body", "key", "newline", "value", "json"})
    _TEXT_MARKERS = (OPEN_CALL, OPEN_FUNCTION, CLOSE_CALL, CLOSE_FUNCTION, CLOSE_PARAMETER)  # stray closers: dropped
    _OPENERS = {OPEN_CALL: "head", OPEN_FUNCTION: "name"}  # a bare <function= after prose: <tool_call> was dropped
    _CALL_TAG = "<function={}>"
    _OPEN_PARAMETER = OPEN_PARAMETER
    _CALL_CLOSERS = {
        CLOSE_FUNCTION: "after",
        CLOSE_CALL: "text",  # </function> was dropped; the call is plainly over
    }
    _CLOSE_PARAMETER = CLOSE_PARAMETER
    _VALUE_ON_OWN_LINE = True
    _SKIP_TO = {CLOSE_FUNCTION: "after", CLOSE_CALL: "text"}

    def __init__(self, tools: list[ToolSpec]) -> None:
        super().__init__(tools)
        self._json: JsonValueScanner | None = None  # a JSON body inside <tool_call>
        # Per tool, its declared argument names that contain '>' (`_declared_key_with_bracket`).
        self._bracket_keys = {t.name: [k for k in t.arguments_schema.get("properties", {}) if ">" in k]
                              if isinstance(t.arguments_schema.get("properties"), dict) else [] for t in tools}

    def _in_head(self, final: bool) -> bool:
        """After <tool_call>: <function=NAME> (or a JSON object) follows."""
        rest = self._skip_whitespace()
        if not rest:
            return False
        if rest.startswith(("{", "[")):
            self._json = JsonValueScanner()
            self._state = "json"
            return True
        marker = self._take_marker(final, (OPEN_FUNCTION, CLOSE_CALL))
        if marker is None:
            return False
        if marker == OPEN_FUNCTION:
            self._state = "name"
        elif marker == CLOSE_CALL:
            self._fail("malformed_tool_call", "an empty <tool_call> block")
            self._state = "text"
        else:
            self._fail("malformed_tool_call", "<tool_call> is not followed by <function=NAME>")
            self._state = "skip"
        return True

    def _in_name(self, final: bool) -> bool:
        name = self._tag_name(OPEN_FUNCTION)
        if name is None:
            return self._state == "skip"
        self._call_named(name)
        return True

    def _in_key(self, final: bool) -> bool:
        declared = self._declared_key_with_bracket(final)
        if declared is False:
            return False  # the buffer may still become one of those names: wait for more text
        key = declared if declared is not None else self._tag_name(OPEN_PARAMETER)
        if key is None:
            return self._state == "skip"
        self._begin_value(key)
        self._state = "newline"
        return True

    def _declared_key_with_bracket(self, final: bool) -> str | None | bool:
        """A declared argument name that itself contains '>' (`<parameter=x>y>`, as a grammar writes it), read
        with its closing '>': the tag's first '>' would cut it short. The longest such name the text starts
        with; None when none does; False while the text so far could still become one."""
        assert self._name is not None
        names = self._bracket_keys[self._name]
        matched = max((k for k in names if self._buf.startswith(k + ">")), key=len, default=None)
        if not final and any(len(k) > len(matched or "") and (k + ">").startswith(self._buf) for k in names):
            return False
        if matched is not None:
            self._consume(len(matched) + 1)
        return matched

    def _tag_name(self, opener: str) -> str | None:
        """The NAME of `<function=NAME>` or `<parameter=NAME>` (quotes forgiven), read through the '>'. None while
        the '>' is still to come, or when the line ended first: then the call failed and is being skipped."""
        text = self._tag_text(f"{opener} is not closed by '>'", _MAX_NAME, one_line=True)
        return None if text is None else text.strip().strip("\"'")

    def _in_newline(self, final: bool) -> bool:
        """The value starts on the line after <parameter=KEY>; that one newline is not part of it."""
        if not self._buf:
            return False
        if self._buf[0] == "\n":
            self._consume(1)
        self._state = "value"
        return True

    def _in_after(self, final: bool) -> bool:
        """After </function>: </tool_call>, which a model may leave out."""
        if self._take_marker(final, (CLOSE_CALL,)) is None:
            return False
        self._state = "text"
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

    def render_call(self, call: dict) -> str:
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
