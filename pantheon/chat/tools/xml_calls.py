"""What the XML dialects (qwen_xml, minicpm_xml) parse alike: the text around calls, a call's body of
parameters, a parameter's value, and the text of a failed call, which is dropped.

A dialect names its markup in the class tables of `XmlCallParser` and adds its own states: those between a
call opener and the body, and those that read a parameter's name and the start of its value.
"""

from __future__ import annotations

from typing import ClassVar

from pantheon.chat.tools.base import StateParser, find_first, partial_suffix


class XmlCallParser(StateParser):
    # Markers that matter in text: the call openers, and stray closers, which are dropped rather than shown.
    _TEXT_MARKERS: ClassVar[tuple[str, ...]]
    _OPENERS: ClassVar[dict[str, str]]  # call opener -> the state that reads what follows it
    _CALL_TAG: ClassVar[str]  # the call's opening tag as written, "{}" standing for the name (for messages)
    _OPEN_PARAMETER: ClassVar[str]  # in a call's body, opens a parameter: the dialect's "key" state follows
    _CALL_CLOSERS: ClassVar[dict[str, str]]  # in a call's body, closes the call -> the state after it
    _CLOSE_PARAMETER: ClassVar[str]  # ends a raw value
    _VALUE_ON_OWN_LINE: ClassVar[bool]  # a newline before _CLOSE_PARAMETER is layout, not value
    _SKIP_TO: ClassVar[dict[str, str]]  # a failed call's text is dropped through one of these -> the next state

    def _in_text(self, final: bool) -> bool:
        hit = find_first(self._buf, self._TEXT_MARKERS)
        if hit is None:
            keep = 0 if final else partial_suffix(self._buf, self._TEXT_MARKERS)
            opener = partial_suffix(self._buf, tuple(self._OPENERS)) if final and self.call_forced else 0
            if opener:
                # A forced call (its grammar allows nothing else) cut short inside its opener ("<tool_ca" at
                # max_tokens): the start of a call, not answer text.
                self._text(self._consume(len(self._buf) - opener))
                self._consume(opener)
                self._fail("unfinished_tool_call", "the output ended inside a tool call opener")
                return False
            if len(self._buf) > keep:
                self._text(self._consume(len(self._buf) - keep))
            return False
        i, marker = hit
        self._text(self._consume(i))
        self._consume(len(marker))
        if marker in self._OPENERS:
            self._open_call()
            self._state = self._OPENERS[marker]
        return True

    def _in_body(self, final: bool) -> bool:
        """Inside a call: parameters, then the call's closer."""
        rest = self._skip_whitespace()
        if not rest:
            return False
        marker = self._take_marker(final, (self._OPEN_PARAMETER, *self._CALL_CLOSERS))
        if marker is None:
            return False
        if marker == self._OPEN_PARAMETER:
            self._state = "key"
        elif marker:
            self._end_call()
            self._state = self._CALL_CLOSERS[marker]
        else:
            self._fail("malformed_tool_call", f"unexpected text inside {self._CALL_TAG.format(self._name)}")
            self._state = "skip"
        return True

    def _in_value(self, final: bool) -> bool:
        if not self._read_value_until(self._CLOSE_PARAMETER, strip_newline=self._VALUE_ON_OWN_LINE):
            return False
        self._value_closed()
        return True

    def _in_skip(self, final: bool) -> bool:
        """A failed call: drop its text up to the end of the call."""
        closer = self._skip_past(tuple(self._SKIP_TO))
        if closer is None:
            return False
        self._state = self._SKIP_TO[closer]
        return True

    # --- helpers for the dialects' own states ---

    def _skip_whitespace(self) -> str:
        rest = self._buf.lstrip()
        self._consume(len(self._buf) - len(rest))
        return rest

    def _take_marker(self, final: bool, markers: tuple[str, ...]) -> str | None:
        """Past whitespace, the one of `markers` the buffer starts with, consumed. None while the buffer could
        still grow into one, or, at the end of the output, when it stops inside one (max_tokens cut the tag:
        the call is unfinished, not malformed); "" when it is none of them."""
        rest = self._skip_whitespace()
        for marker in markers:
            if rest.startswith(marker):
                self._consume(len(marker))
                return marker
        if any(marker.startswith(rest) for marker in markers):
            return None
        return ""

    def _tag_text(self, message: str, limit: int, *, one_line: bool = False) -> str | None:
        """The rest of a tag up to its closing '>', consumed. None while the '>' is still to come, or when the
        tag ran past `limit` characters (or a line end, with `one_line`) without it: then the call failed as
        malformed and is being skipped, which the caller tells by the state."""
        i = self._buf.find(">")
        if i < 0:
            if len(self._buf) > limit or (one_line and "\n" in self._buf):
                self._fail("malformed_tool_call", message)
                self._state = "skip"
            return None
        return self._consume(i + 1)[:-1]

    def _call_named(self, name: str) -> None:
        """The call's function name was read: start the call, or fail it when no such tool was offered."""
        if name not in self._tools:
            self._fail("unknown_function", f"the model called {name!r}, which is not an offered tool", function=name)
            self._state = "skip"
        else:
            self._start_call(name)
            self._state = "body"

    def _value_closed(self) -> None:
        self._end_value()
        self._state = "body"
