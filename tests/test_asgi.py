"""pantheon.http.asgi: reading a request body and its headers, writing SSE events."""

from __future__ import annotations

import json
from typing import Any

import pytest
import trio

from pantheon.errors import ApiError
from pantheon.http.asgi import BODY_STALL_S, MAX_BODY_BYTES, headers_of, parse_json_body, read_body, sse_data


async def test_a_body_sent_in_pieces_is_joined() -> None:
    pieces = iter([{"type": "http.request", "body": b"ab", "more_body": True},
                   {"type": "http.request", "body": b"cd", "more_body": False}])

    async def receive() -> dict[str, Any]:
        return next(pieces)

    assert await read_body(receive) == b"abcd"


async def test_a_stalled_upload_is_given_up_with_408(autojump_clock: trio.abc.Clock) -> None:
    """Headers and a few bytes, then nothing: the request ends with a 408 after BODY_STALL_S instead of holding
    its socket for ever."""
    sent = False

    async def receive() -> dict[str, Any]:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": b"{\"me", "more_body": True}
        await trio.sleep_forever()
        raise AssertionError("unreachable")

    started = trio.current_time()
    with pytest.raises(ApiError) as caught:
        await read_body(receive)
    assert caught.value.status == 408
    assert trio.current_time() - started == pytest.approx(BODY_STALL_S)


async def test_a_body_over_the_limit_is_413() -> None:
    chunk = b"x" * (1 << 20)
    sent = 0

    async def receive() -> dict[str, Any]:
        nonlocal sent
        sent += len(chunk)
        return {"type": "http.request", "body": chunk, "more_body": True}

    with pytest.raises(ApiError) as caught:
        await read_body(receive)
    assert caught.value.status == 413 and caught.value.error_type == "invalid_request_error"
    assert MAX_BODY_BYTES < sent <= MAX_BODY_BYTES + len(chunk)


def test_a_leading_byte_order_mark_is_skipped() -> None:
    assert parse_json_body(b'\xef\xbb\xbf{"a": 1}') == {"a": 1}
    with pytest.raises(ApiError):
        parse_json_body(b"\xef\xbb\xbf")
    with pytest.raises(ApiError):
        parse_json_body(b'{"a": 1}\xef\xbb\xbf')


def test_header_values_read_as_utf8_else_latin1() -> None:
    """A non-ASCII X-Session-Id names the same session as that id in a body (clients send UTF-8); bytes that are
    not UTF-8 are still read, as latin-1."""
    scope = {"headers": [(b"X-Session-Id", "café".encode()), (b"X-Other", b"caf\xe9")]}
    assert headers_of(scope) == {"x-session-id": "café", "x-other": "café"}


def test_an_sse_event_is_one_line_for_clients_that_split_lines_like_python() -> None:
    """U+0085, U+2028 and U+2029 are raw in JSON text but line breaks to str.splitlines() (httpx's iter_lines):
    an event carrying them is written with JSON escapes, and reads back whole."""
    payload = {"delta": {"content": "a\u2028b\x85c\u2029d \u2014 \u201cq\u201d"}}
    event = sse_data(payload)
    lines = event.decode().splitlines()
    assert lines[1:] == [""] and lines[0].startswith("data: ") and event.endswith(b"\n\n")
    assert json.loads(lines[0][len("data: "):]) == payload
