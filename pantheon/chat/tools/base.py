"""The contract every tool-call dialect implements, and the machinery their parsers share.

A dialect knows how one family of models writes tool calls: how the offered tools are described in the
prompt, how an earlier turn's calls are replayed, and how to pull calls out of the text the model writes.
Parsing is streaming: the parser is fed decoded text piece by piece and answers with events (text, call
start, argument fragments, call end, call error), keeping only the text it has not consumed yet.
"""

from __future__ import annotations

import functools
import json
import re
import secrets
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any, ClassVar

from pantheon.chat.tools.arguments import key_schema, loads_json, resolved_schema, streams_as_string, type_value
from pantheon.errors import invalid_request


@dataclass(frozen=True)
class ToolSpec:
    name: str
    description: str
    parameters: dict  # JSON schema of the arguments object, as the request sent it (the prompt shows this)

    @functools.cached_property
    def arguments_schema(self) -> dict:
        """`parameters` with its $refs inlined and allOf merged (`resolved_schema`): what the call grammars and
        the argument typing read. Not to be changed: it is resolved once per tool."""
        return resolved_schema(self.parameters)

    def parameter_schema(self, key: str) -> dict | None:
        """The schema of one argument (`key_schema`: its property, the patternProperties that match it, else
        additionalProperties), or None when nothing in the tool's schema describes it."""
        held = key_schema(self.arguments_schema, key)
        return held if isinstance(held, dict) else None


# OpenAI's rule for function names (letters, digits, "_", "-"), plus "." and ":" that namespaced (MCP) tools
# use. Anything else could not round-trip through a dialect's call syntax (`<function=a<b>` ends at the "<").
TOOL_NAME = re.compile(r"[A-Za-z0-9_.:-]+")


def parse_tools(raw: list) -> list[ToolSpec]:
    """OpenAI tool definitions -> ToolSpecs. Raises a 400 ApiError on a malformed definition."""
    if not isinstance(raw, list):
        raise invalid_request("'tools' must be an array")
    specs: list[ToolSpec] = []
    seen: set[str] = set()
    for i, tool in enumerate(raw):
        if not isinstance(tool, dict) or tool.get("type", "function") != "function":
            raise invalid_request(f"tools[{i}] must be an object with \"type\": \"function\"")
        fn = tool.get("function")
        if not isinstance(fn, dict):
            raise invalid_request(f"tools[{i}].function must be an object")
        name = fn.get("name")
        if not isinstance(name, str) or not name.strip():
            raise invalid_request(f"tools[{i}].function.name must be a non-empty string")
        if not TOOL_NAME.fullmatch(name):
            raise invalid_request(f"tools[{i}].function.name {name!r} may only contain letters, digits, "
                                  "'_', '-', '.' and ':'")
        if name in seen:
            raise invalid_request(f"tools[{i}]: function {name!r} is defined twice")
        seen.add(name)
        description = fn.get("description")
        if description is not None and not isinstance(description, str):
            raise invalid_request(f"tools[{i}].function.description must be a string")
        parameters = fn.get("parameters")
        if parameters is None:
            parameters = {"type": "object", "properties": {}}
        if not isinstance(parameters, dict) or parameters.get("type", "object") != "object":
            # A call's arguments are one JSON object (OpenAI refuses any other schema the same way).
            raise invalid_request(f"tools[{i}].function.parameters must be a JSON schema of type \"object\"")
        specs.append(ToolSpec(name=name, description=description or "", parameters=parameters))
    return specs


# --- streaming parse events ---


@dataclass
class TextDelta:
    text: str


@dataclass
class CallStart:
    index: int
    id: str
    name: str


@dataclass
class ArgsDelta:
    index: int
    fragment: str  # a piece of the arguments JSON text; the pieces of one call join to CallEnd.arguments


@dataclass
class CallEnd:
    index: int
    name: str
    arguments: str  # compact JSON text of the arguments object


@dataclass
class CallError:
    """A call that was started but is not a call: unfinished, unknown function, or unparsable.

    `index` is the index its CallStart carried, or None when it failed before one was sent.
    """

    index: int | None
    code: str  # unfinished_tool_call | unknown_function | malformed_tool_call | invalid_arguments
    function: str | None
    parameter: str | None
    message: str


Event = TextDelta | CallStart | ArgsDelta | CallEnd | CallError


def new_call_id() -> str:
    return "call_" + secrets.token_hex(12)


def compact_json(value: Any) -> str:
    return json.dumps(value, ensure_ascii=False, separators=(",", ":"))


def json_string_body(text: str) -> str:
    """`text` escaped as the inside of a JSON string. Escaping is per character, so pieces escape
    to pieces of the whole string's escaping."""
    return json.dumps(text, ensure_ascii=False)[1:-1]


def partial_suffix(text: str, markers: tuple[str, ...]) -> int:
    """Length of the longest tail of `text` that is a proper prefix of one of `markers`."""
    best = 0
    for marker in markers:
        for n in range(min(len(marker) - 1, len(text)), best, -1):
            if text.endswith(marker[:n]):
                best = n
                break
    return best


def find_first(text: str, markers: tuple[str, ...], start: int = 0) -> tuple[int, str] | None:
    """The earliest occurrence of any marker at or after `start` (the longest marker wins a tie)."""
    found: tuple[int, str] | None = None
    for marker in markers:
        i = text.find(marker, start)
        if i >= 0 and (found is None or i < found[0] or (i == found[0] and len(marker) > len(found[1]))):
            found = (i, marker)
    return found


class ToolCallParser(ABC):
    """Incremental parser of one choice's output text.

    Subclasses implement `_step`, one state transition over the unconsumed text in `self._buf`, and
    `_finish_call`, which reports the call the output ended inside of. Whitespace around call markup is
    not text: whitespace before a call is held, whitespace after one dropped, so text on both sides of a call
    keeps one separator and a reply that is only calls has no text at all.
    """

    def __init__(self, tools: list[ToolSpec]) -> None:
        self._tools = {t.name: t for t in tools}
        self._buf = ""
        self._events: list[Event] = []
        self._held_ws = ""
        self._after_call = False
        # Set when the turn's grammar compels a call ("required", a named function): text that ends inside a
        # call opener is then an unfinished call, not prose that mentions markup.
        self.call_forced = False
        self._next_index = 0
        # The call being parsed: its index (once CallStart went out), name and streamed arguments so far.
        self._index: int | None = None
        self._name: str | None = None
        self._args: list[str] = []
        self._keys: set[str] = set()
        # The parameter being read (XML dialects).
        self._key: str | None = None
        self._schema: dict | None = None
        self._skip_value = False
        self._stream_value = False
        self._raw: list[str] = []
        self._scan = 0

    def feed(self, text: str) -> list[Event]:
        self._buf += text
        while self._step(False):
            pass
        return self._take()

    def finish(self) -> list[Event]:
        while self._step(True):
            pass
        self._finish_call()
        if self._held_ws and not self._after_call:
            self._events.append(TextDelta(self._held_ws))
        self._held_ws = ""
        return self._take()

    @abstractmethod
    def _step(self, final: bool) -> bool:
        """Advance over `self._buf`; return False when nothing more can be done without more text."""

    @abstractmethod
    def _finish_call(self) -> None:
        """The output ended: report a call left open as a CallError, flush anything held as text."""

    # --- helpers for subclasses ---

    def _take(self) -> list[Event]:
        events: list[Event] = []
        for e in self._events:
            if isinstance(e, TextDelta) and events and isinstance(events[-1], TextDelta):
                events[-1] = TextDelta(events[-1].text + e.text)
            else:
                events.append(e)
        self._events = []
        return events

    def _consume(self, n: int) -> str:
        head, self._buf = self._buf[:n], self._buf[n:]
        return head

    def _text(self, text: str) -> None:
        if self._after_call:
            text = text.lstrip()
            if not text:
                return
            self._after_call = False
        text = self._held_ws + text
        body = text.rstrip()
        self._held_ws = text[len(body):]
        if body:
            self._events.append(TextDelta(body))

    def _open_call(self) -> None:
        """A call opener was seen. The whitespace held before it stays held: it separates the text before
        the call from text after it, if any comes; otherwise it is dropped."""
        self._after_call = False
        self._index = None
        self._name = None
        self._args = []
        self._keys = set()

    def _start_call(self, name: str) -> None:
        self._index = self._next_index
        self._next_index += 1
        self._name = name
        self._events.append(CallStart(self._index, new_call_id(), name))

    def _emit_args(self, fragment: str) -> None:
        if fragment:
            assert self._index is not None
            self._args.append(fragment)
            self._events.append(ArgsDelta(self._index, fragment))

    def _argument_prefix(self, key: str) -> str:
        """`{"key":` for the first argument of a call, `,"key":` after that."""
        return ("{" if not self._args else ",") + json.dumps(key, ensure_ascii=False) + ":"

    def _begin_value(self, key: str) -> None:
        """A parameter's value starts. Text values are passed on as they arrive; typed ones at the end.
        A parameter written twice keeps its first value (the arguments already streamed can't change)."""
        assert self._name is not None
        self._key = key
        self._schema = self._tools[self._name].parameter_schema(key)
        self._skip_value = key in self._keys
        self._keys.add(key)
        self._stream_value = not self._skip_value and streams_as_string(self._schema)
        self._raw = []
        self._scan = 0
        if self._stream_value:
            self._emit_args(self._argument_prefix(key) + '"')

    def _read_value_until(self, end: str, *, strip_newline: bool) -> bool:
        """Take the value's text up to `end` from the buffer; True (with `end` consumed) once it was seen.
        Text values go on as they arrive, less a tail that could begin `end`; a typed value stays in the
        buffer, which is searched only from where the last search could not have matched."""
        i = self._buf.find(end, self._scan)
        if i < 0:
            if self._stream_value or self._skip_value:
                hold = ("\n" + end, end) if strip_newline else (end,)
                self._value_piece(self._consume(len(self._buf) - partial_suffix(self._buf, hold)))
            else:
                self._scan = max(0, len(self._buf) - len(end) + 1)
            return False
        raw = self._consume(i)
        self._consume(len(end))
        if strip_newline and raw.endswith("\n"):
            raw = raw[:-1]
        self._value_piece(raw)
        self._scan = 0
        return True

    def _value_piece(self, text: str) -> None:
        if self._skip_value or not text:
            return
        if self._stream_value:
            self._emit_args(json_string_body(text))
        else:
            self._raw.append(text)

    def _end_value(self) -> None:
        if self._stream_value:
            self._emit_args('"')
        elif not self._skip_value:
            value = type_value("".join(self._raw), self._schema)
            self._emit_args(self._argument_prefix(self._key) + compact_json(value))
        self._key = None
        self._raw = []

    def _end_call(self) -> None:
        """The XML call closed: close the arguments object streamed so far."""
        self._emit_args("{}" if not self._args else "}")
        self._end_call_with("".join(self._args))

    def _emit_whole_call(self, name: str, arguments: dict) -> None:
        """A call read in one piece (JSON): start, all its arguments, end."""
        self._start_call(name)
        self._emit_args(compact_json(arguments))
        self._end_call_with("".join(self._args))

    def _end_call_with(self, arguments: str) -> None:
        assert self._index is not None and self._name is not None
        self._events.append(CallEnd(self._index, self._name, arguments))
        self._close()

    def _fail(self, code: str, message: str, *, function: str | None = None) -> None:
        self._events.append(CallError(self._index, code, function if function is not None else self._name,
                                      self._key, message))
        self._close()

    def _close(self) -> None:
        self._index = None
        self._name = None
        self._args = []
        self._keys = set()
        self._key = None
        self._raw = []
        self._after_call = True


class StateParser(ToolCallParser):
    """A parser written as a state machine: `_state` names the method, `_in_<state>`, that takes the next step.

    Every dialect starts in "text"; `_CALL_STATES` are the states in which the output ending leaves a call
    unfinished (the others are text, or a failed call being dropped).
    """

    _CALL_STATES: ClassVar[frozenset[str]]

    def __init__(self, tools: list[ToolSpec]) -> None:
        super().__init__(tools)
        self._state = "text"

    def _step(self, final: bool) -> bool:
        return getattr(self, "_in_" + self._state)(final)

    def _finish_call(self) -> None:
        if self._state in self._CALL_STATES:
            where = f" in parameter {self._key!r}" if self._key is not None else ""
            self._fail("unfinished_tool_call", f"the output ended inside a tool call{where}",
                       function=self._unfinished_function())
        self._state = "text"
        self._buf = ""

    def _unfinished_function(self) -> str | None:
        """The function an unfinished call names; None stands for the one its CallStart named (if any)."""
        return None

    def _skip_past(self, closers: tuple[str, ...]) -> str | None:
        """Drop text through the first of `closers` and return it; None when none is in the buffer yet (all
        of it is dropped but a tail that could begin one)."""
        hit = find_first(self._buf, closers)
        if hit is None:
            self._consume(len(self._buf) - partial_suffix(self._buf, closers))
            return None
        i, closer = hit
        self._consume(i + len(closer))
        return closer


class Dialect(ABC):
    """One tool-call dialect: prompt rendering, call parsing, and the texts a grammar or a serve needs."""

    name: ClassVar[str]
    grammar_capable: ClassVar[bool]

    @abstractmethod
    def parser(self, tools: list[ToolSpec]) -> ToolCallParser: ...

    @abstractmethod
    def render_system(self, tools: list[ToolSpec], system: str | None) -> str:
        """The offered tools in the model's idiom, after the leading system message's text (if any)."""

    def render_assistant(self, content: str, tool_calls: list[dict]) -> str:
        """An earlier assistant turn as the raw text the model would have written: content, then the calls.
        Arguments that are not valid JSON are written as they are."""
        calls = "\n".join(self.render_call(call) for call in tool_calls)
        if not calls:
            return content
        return f"{content}\n\n{calls}" if content and content.strip() else calls

    @abstractmethod
    def render_call(self, call: dict) -> str:
        """One OpenAI tool_calls entry as the text the model writes for it (never empty)."""

    def render_tool_result(self, content: str, tool_call_id: str | None, name: str | None) -> tuple[str, str]:
        """(role, content) of a tool result for the chat template. Results are user turns wrapped in
        <tool_response>; consecutive results joined with a newline read as one turn of several results."""
        return "user", f"<tool_response>\n{content}\n</tool_response>"

    @abstractmethod
    def closing_texts(self) -> list[str]:
        """Texts that close a call the model stopped inside of, each valid from some place in a call."""

    @abstractmethod
    def call_openers(self) -> list[str]:
        """Strings that open a call."""

    def __repr__(self) -> str:
        return f"<Dialect {self.name}>"


# --- shared rendering helpers ---

_SAFE_INT = 9007199254740991  # 2**53 - 1: the bound JS clients put on every integer; it says nothing


def prompt_schema(schema: Any) -> Any:
    """A tool schema trimmed for the prompt: no `$schema`, no bounds that only say "any JS-safe integer"."""
    if isinstance(schema, dict):
        out = {}
        for k, v in schema.items():
            if k == "$schema":
                continue
            if k in ("minimum", "maximum") and isinstance(v, int) and abs(v) == _SAFE_INT:
                continue
            out[k] = prompt_schema(v)
        return out
    if isinstance(schema, list):
        return [prompt_schema(v) for v in schema]
    return schema


def call_parts(call: dict) -> tuple[str, Any, str]:
    """(name, arguments as a dict when they parse to one else None, the raw arguments text) of an
    OpenAI tool_calls entry."""
    fn = call.get("function") if isinstance(call.get("function"), dict) else call
    name = fn.get("name") if isinstance(fn.get("name"), str) else ""
    raw = fn.get("arguments")
    if isinstance(raw, dict):
        return name, raw, compact_json(raw)
    if raw is None:
        return name, {}, "{}"
    if not isinstance(raw, str):
        return name, None, compact_json(raw)
    try:
        value = loads_json(raw) if raw.strip() else {}
    except (ValueError, RecursionError):  # nested past the parser's recursion: as unparseable as malformed
        return name, None, raw
    return name, value if isinstance(value, dict) else None, raw


def json_tool_listing(tools: list[ToolSpec]) -> str:
    """The offered tools as JSON objects (name, description, parameters schema), one a line."""
    return "\n".join(
        json.dumps({"name": t.name, "description": t.description, "parameters": prompt_schema(t.parameters)},
                   ensure_ascii=False)
        for t in tools
    )


def join_system(system: str | None, tools_text: str) -> str:
    return f"{system.rstrip()}\n\n{tools_text}" if system and system.strip() else tools_text
