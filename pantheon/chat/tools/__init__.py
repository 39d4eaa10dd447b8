"""Tool calling: the dialects models write calls in, one module each, behind one contract (base.Dialect).

    dialect = dialect_for(served_name, architecture, chat_template)
    system = dialect.render_system(parse_tools(request_tools), system_text)
    parser = dialect.parser(tools)
    events = parser.feed(text_piece) ... + parser.finish()

Grammars that constrain a decode to these formats (llguidance Lark text) are in `grammar.py`.
"""

from __future__ import annotations

import re

from pantheon.chat.tools.base import (ArgsDelta, CallEnd, CallError, CallStart, Dialect, Event, TextDelta,
                                      ToolCallParser, ToolSpec, parse_tools)
from pantheon.chat.tools.grammar import json_object_grammar, minicpm_call_grammar, tool_call_grammar
from pantheon.chat.tools.json_calls import JsonCalls
from pantheon.chat.tools.minicpm_xml import MiniCpmXml
from pantheon.chat.tools.qwen_xml import QwenXml

__all__ = [
    "ArgsDelta", "CallEnd", "CallError", "CallStart", "Dialect", "Event", "TextDelta", "ToolCallParser",
    "ToolSpec", "parse_tools", "dialect_for", "DIALECTS", "tool_call_grammar", "minicpm_call_grammar",
    "json_object_grammar",
]

DIALECTS: dict[str, Dialect] = {d.name: d for d in (QwenXml(), MiniCpmXml(), JsonCalls())}

# `bos_token` inside an output expression ({{ ... }}), i.e. the template writes the BOS text itself.
_EMITS_BOS = re.compile(r"\{\{[^}]*\bbos_token\b[^}]*\}\}")


def template_adds_bos(chat_template: str | None) -> bool:
    return bool(chat_template) and _EMITS_BOS.search(chat_template) is not None


def dialect_for(model_name: str, architecture: str, chat_template: str | None) -> Dialect:
    """The dialect a served model writes calls in: names starting "ornith" use JSON; llama-architecture
    models whose template writes BOS (MiniCPM5) use MiniCPM's attribute XML; everything else Qwen3-Coder XML."""
    if model_name.lower().startswith("ornith"):
        return DIALECTS["json"]
    if architecture == "llama" and template_adds_bos(chat_template):
        return DIALECTS["minicpm_xml"]
    return DIALECTS["qwen_xml"]
