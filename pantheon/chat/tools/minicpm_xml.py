"""MiniCPM5's attribute XML calls (llama-architecture models whose template adds BOS):

    <function name="NAME"><param name="KEY">VALUE</param>...</function>

A value is raw text, or <![CDATA[...]]> when it spans lines or holds markup (consecutive CDATA sections
join, which is how a value containing "]]>" is written). No grammar models this dialect's free text (its
"auto" turns are never constrained); a turn that must call is (`grammar.minicpm_call_grammar`).
"""

from __future__ import annotations

import json
import re

from pantheon.chat.tools.base import Dialect, ToolCallParser, ToolSpec, call_parts, join_system, json_tool_listing
from pantheon.chat.tools.xml_calls import XmlCallParser

OPEN_FUNCTION = "<function "
CLOSE_FUNCTION = "</function>"
OPEN_PARAM = "<param "
CLOSE_PARAM = "</param>"
OPEN_CDATA = "<![CDATA["
CLOSE_CDATA = "]]>"

_NAME_ATTR = re.compile(r"""\bname\s*=\s*(?:"([^"]*)"|'([^']*)'|([^\s"'/>]+))""")
_MAX_TAG = 512


def _name_attr(attrs: str) -> str | None:
    m = _NAME_ATTR.search(attrs)
    return None if m is None else next(g for g in m.groups() if g is not None).strip()


class MiniCpmXmlParser(XmlCallParser):
    _CALL_STATES = frozenset({"head", "body", "key", "start", "value", "cdata", "cdata_end"})
    _TEXT_MARKERS = (OPEN_FUNCTION, CLOSE_FUNCTION, CLOSE_PARAM)  # stray closers are dropped, not text
    _OPENERS = {OPEN_FUNCTION: "head"}
    _CALL_TAG = '<function name="{}">'
    _OPEN_PARAMETER = OPEN_PARAM
    _CALL_CLOSERS = {CLOSE_FUNCTION: "text"}
    _CLOSE_PARAMETER = CLOSE_PARAM
    _VALUE_ON_OWN_LINE = False
    _SKIP_TO = {CLOSE_FUNCTION: "text"}

    def _in_head(self, final: bool) -> bool:
        tag = self._named_tag("function")
        if tag is None:
            return self._state == "skip"
        self._call_named(tag[1])
        return True

    def _in_key(self, final: bool) -> bool:
        tag = self._named_tag("param")
        if tag is None:
            return self._state == "skip"
        attrs, key = tag
        self._begin_value(key)
        if attrs.rstrip().endswith("/"):  # <param name="k"/>: an empty value
            self._value_closed()
        else:
            self._state = "start"
        return True

    def _named_tag(self, what: str) -> tuple[str, str] | None:
        """(attributes, name attribute) of the <function or <param tag being read, consumed. None while its '>'
        is still to come, or when the tag is malformed: then the call failed and is being skipped."""
        attrs = self._tag_text(f"a <{what} tag is not closed by '>'", _MAX_TAG)
        if attrs is None:
            return None
        name = _name_attr(attrs)
        if name is None:
            self._fail("malformed_tool_call", f"<{what}> has no name attribute")
            self._state = "skip"
            return None
        return attrs, name

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

    def _in_cdata(self, final: bool) -> bool:
        if not self._read_value_until(CLOSE_CDATA, strip_newline=False):
            return False
        self._state = "cdata_end"
        return True

    def _in_cdata_end(self, final: bool) -> bool:
        """After a CDATA section: </param>, or another section continuing the value."""
        marker = self._take_marker(final, (CLOSE_PARAM, OPEN_CDATA))
        if marker is None:
            return False
        if marker == CLOSE_PARAM:
            self._value_closed()
        elif marker == OPEN_CDATA:
            self._state = "cdata"
        else:
            self._fail("malformed_tool_call", f"text after the CDATA section of parameter {self._key!r}")
            self._state = "skip"
        return True


class MiniCpmXml(Dialect):
    name = "minicpm_xml"
    grammar_capable = False

    def parser(self, tools: list[ToolSpec]) -> ToolCallParser:
        return MiniCpmXmlParser(tools)

    def render_system(self, tools: list[ToolSpec], system: str | None) -> str:
        text = (
            "# Tools\n\n"
            "You can call the functions below (each with a JSON Schema of its parameters) when they help.\n\n"
            f"<tools>\n{json_tool_listing(tools)}\n</tools>\n\n"
            "To call a function, write:\n"
            '<function name="function_name"><param name="parameter_name">value</param></function>\n'
            "Use one <param> per argument and one <function> block per call. Put a value that spans lines or "
            "contains < or & inside <![CDATA[ ... ]]>; write objects and arrays as JSON."
        )
        return join_system(system, text)

    def render_call(self, call: dict) -> str:
        name, args, raw = call_parts(call)
        if args is None:
            return f'<function name="{name}">{raw}</function>'
        params = "".join(f'<param name="{k}">{_render_value(v)}</param>' for k, v in args.items())
        return f'<function name="{name}">{params}</function>'

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
