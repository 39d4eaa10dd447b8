"""MiniCPM5's attribute XML calls (llama-architecture models whose template adds BOS):

    <function name="NAME"><param name="KEY">VALUE</param>...</function>

A value is raw text, or <![CDATA[...]]> when it spans lines or holds markup (consecutive CDATA sections
join, which is how a value containing "]]>" is written). No grammar models this dialect.
"""

from __future__ import annotations

import json
import re

from pantheon.chat.tools.base import (Dialect, ToolCallParser, ToolSpec, call_parts, find_first, join_system,
                                      partial_suffix, prompt_schema)

OPEN_FUNCTION = "<function "
CLOSE_FUNCTION = "</function>"
OPEN_PARAM = "<param "
CLOSE_PARAM = "</param>"
OPEN_CDATA = "<![CDATA["
CLOSE_CDATA = "]]>"

_TEXT_MARKERS = (OPEN_FUNCTION, CLOSE_FUNCTION, CLOSE_PARAM)  # stray closers are dropped, not text
_NAME_ATTR = re.compile(r"""\bname\s*=\s*(?:"([^"]*)"|'([^']*)'|([^\s"'/>]+))""")
_MAX_TAG = 512


def _name_attr(attrs: str) -> str | None:
    m = _NAME_ATTR.search(attrs)
    return None if m is None else next(g for g in m.groups() if g is not None).strip()


class MiniCpmXmlParser(ToolCallParser):
    def __init__(self, tools: list[ToolSpec]) -> None:
        super().__init__(tools)
        self._state = "text"

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
        if marker == OPEN_FUNCTION:
            self._open_call()
            self._state = "head"
        return True

    def _tag_attrs(self, what: str) -> str | None:
        """The attributes up to the '>' closing a tag, consumed; None while the '>' is still to come."""
        i = self._buf.find(">")
        if i < 0:
            if len(self._buf) > _MAX_TAG:
                self._fail("malformed_tool_call", f"a <{what} tag is not closed by '>'")
                self._state = "skip"
            return None
        return self._consume(i + 1)[:-1]

    def _in_head(self, final: bool) -> bool:
        attrs = self._tag_attrs("function")
        if attrs is None:
            return self._state == "skip"
        name = _name_attr(attrs)
        if name is None:
            self._fail("malformed_tool_call", "<function> has no name attribute")
            self._state = "skip"
        elif name not in self._tools:
            self._fail("unknown_function", f"the model called {name!r}, which is not an offered tool", function=name)
            self._state = "skip"
        else:
            self._start_call(name)
            self._state = "body"
        return True

    def _in_body(self, final: bool) -> bool:
        rest = self._skip_whitespace()
        if not rest:
            return False
        if rest.startswith(OPEN_PARAM):
            self._consume(len(OPEN_PARAM))
            self._state = "key"
        elif rest.startswith(CLOSE_FUNCTION):
            self._consume(len(CLOSE_FUNCTION))
            self._end_call()
            self._state = "text"
        elif not final and (OPEN_PARAM.startswith(rest) or CLOSE_FUNCTION.startswith(rest)):
            return False
        else:
            self._fail("malformed_tool_call", f"unexpected text inside <function name=\"{self._name}\">")
            self._state = "skip"
        return True

    def _in_key(self, final: bool) -> bool:
        attrs = self._tag_attrs("param")
        if attrs is None:
            return self._state == "skip"
        key = _name_attr(attrs)
        if key is None:
            self._fail("malformed_tool_call", "<param> has no name attribute")
            self._state = "skip"
            return True
        self._begin_value(key)
        if attrs.rstrip().endswith("/"):  # <param name="k"/>: an empty value
            self._end_value()
            self._state = "body"
        else:
            self._state = "start"
        return True

    def _in_start(self, final: bool) -> bool:
        """Raw text or CDATA? Whitespace before a CDATA section is layout, not value."""
        rest = self._buf.lstrip()
        if rest.startswith(OPEN_CDATA):
            self._consume(len(self._buf) - len(rest) + len(OPEN_CDATA))
            self._state = "cdata"
        elif not final and OPEN_CDATA.startswith(rest):
            return False
        else:
            self._state = "value"
        return True

    def _in_value(self, final: bool) -> bool:
        if not self._read_value_until(CLOSE_PARAM, strip_newline=False):
            return False
        self._end_value()
        self._state = "body"
        return True

    def _in_cdata(self, final: bool) -> bool:
        if not self._read_value_until(CLOSE_CDATA, strip_newline=False):
            return False
        self._state = "cdata_end"
        return True

    def _in_cdata_end(self, final: bool) -> bool:
        rest = self._skip_whitespace()
        if rest.startswith(CLOSE_PARAM):
            self._consume(len(CLOSE_PARAM))
            self._end_value()
            self._state = "body"
        elif rest.startswith(OPEN_CDATA):
            self._consume(len(OPEN_CDATA))
            self._state = "cdata"
        elif not final and (CLOSE_PARAM.startswith(rest) or OPEN_CDATA.startswith(rest)):
            return False
        else:
            self._fail("malformed_tool_call", f"text after the CDATA section of parameter {self._key!r}")
            self._state = "skip"
        return True

    def _in_skip(self, final: bool) -> bool:
        i = self._buf.find(CLOSE_FUNCTION)
        if i < 0:
            self._consume(len(self._buf) - partial_suffix(self._buf, (CLOSE_FUNCTION,)))
            return False
        self._consume(i + len(CLOSE_FUNCTION))
        self._state = "text"
        return True

    def _skip_whitespace(self) -> str:
        rest = self._buf.lstrip()
        self._consume(len(self._buf) - len(rest))
        return rest

    def _finish_call(self) -> None:
        if self._state not in ("text", "skip"):
            where = f" in parameter {self._key!r}" if self._key is not None else ""
            self._fail("unfinished_tool_call", f"the output ended inside a tool call{where}")
        self._state = "text"
        self._buf = ""


class MiniCpmXml(Dialect):
    name = "minicpm_xml"
    grammar_capable = False

    def parser(self, tools: list[ToolSpec]) -> ToolCallParser:
        return MiniCpmXmlParser(tools)

    def render_system(self, tools: list[ToolSpec], system: str | None) -> str:
        listing = "\n".join(
            json.dumps({"name": t.name, "description": t.description, "parameters": prompt_schema(t.parameters)},
                       ensure_ascii=False)
            for t in tools
        )
        text = (
            "# Tools\n\n"
            "You can call the functions below (each with a JSON Schema of its parameters) when they help.\n\n"
            f"<tools>\n{listing}\n</tools>\n\n"
            "To call a function, write:\n"
            '<function name="function_name"><param name="parameter_name">value</param></function>\n'
            "Use one <param> per argument and one <function> block per call. Put a value that spans lines or "
            "contains < or & inside <![CDATA[ ... ]]>; write objects and arrays as JSON."
        )
        return join_system(system, text)

    def render_assistant(self, content: str, tool_calls: list[dict]) -> str:
        calls = "\n".join(_render_call(c) for c in tool_calls)
        if not calls:
            return content
        return f"{content}\n\n{calls}" if content and content.strip() else calls

    def closing_texts(self) -> list[str]:
        return [CLOSE_FUNCTION, CLOSE_PARAM + CLOSE_FUNCTION, CLOSE_CDATA + CLOSE_PARAM + CLOSE_FUNCTION]

    def call_openers(self) -> list[str]:
        return [OPEN_FUNCTION]


def _render_value(value: object) -> str:
    if not isinstance(value, str):
        return json.dumps(value, ensure_ascii=False)
    if any(c in value for c in "\n<&") or value != value.strip():
        return OPEN_CDATA + value.replace(CLOSE_CDATA, "]]" + CLOSE_CDATA + OPEN_CDATA + ">") + CLOSE_CDATA
    return value


def _render_call(call: dict) -> str:
    name, args, raw = call_parts(call)
    if args is None:
        return f'<function name="{name}">{raw}</function>'
    params = "".join(f'<param name="{k}">{_render_value(v)}</param>' for k, v in args.items())
    return f'<function name="{name}">{params}</function>'
