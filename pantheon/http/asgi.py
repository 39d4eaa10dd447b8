"""Small ASGI helpers: read a body, send JSON, send an error. The one place errors become responses."""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable, Mapping
from typing import Any

import orjson
import trio

from pantheon.errors import ApiError

log = logging.getLogger("pantheon.http")

Receive = Callable[[], Awaitable[dict[str, Any]]]
Send = Callable[[dict[str, Any]], Awaitable[None]]

MAX_BODY_BYTES = 64 * 1024 * 1024
# A request body that stops arriving for this long is given up (408).
BODY_STALL_S = 30.0
# Bodies from this size on are parsed on a worker thread: 20 MB of JSON (600k tiny messages) took the event loop
# 3-4 s to parse into a request, with every stream stalled meanwhile.
PARSE_OFF_LOOP_BYTES = 1 << 20

# Every response carries these (spec: "Every response carries Access-Control-Allow-Origin: * and
# Connection: close").
BASE_HEADERS: list[tuple[bytes, bytes]] = [
    (b"access-control-allow-origin", b"*"),
    (b"connection", b"close"),
]


def _header_text(value: bytes) -> str:
    """A header value as text: UTF-8, what clients send a non-ASCII session id as (so that "café" in the
    X-Session-Id header is the session "café" of a body's session_id), else latin-1, HTTP's own reading."""
    try:
        return value.decode("utf-8")
    except UnicodeDecodeError:
        return value.decode("latin-1")


def headers_of(scope: Mapping[str, Any]) -> dict[str, str]:
    return {k.decode("latin-1").lower(): _header_text(v) for k, v in scope.get("headers", [])}


async def read_body(receive: Receive, limit: int = MAX_BODY_BYTES) -> bytes:
    """The whole request body, refused (413) past `limit` bytes. A client that stops sending it for BODY_STALL_S
    gets a 408 (and its connection closed): a stalled upload must not hold a socket for ever."""
    chunks: list[bytes] = []
    size = 0
    while True:
        with trio.move_on_after(BODY_STALL_S) as stalled:
            message = await receive()
        if stalled.cancelled_caught:
            raise ApiError(408, "invalid_request_error", f"no request body data for {BODY_STALL_S:.0f} s")
        if message["type"] == "http.disconnect":
            raise ConnectionAbortedError("client disconnected while sending the body")
        chunk = message.get("body", b"")
        size += len(chunk)
        if size > limit:
            raise ApiError(413, "invalid_request_error", f"request body exceeds {limit} bytes")
        chunks.append(chunk)
        if not message.get("more_body", False):
            return b"".join(chunks)


def parse_json_body(raw: bytes) -> Any:
    if raw.startswith(b"\xef\xbb\xbf"):
        raw = raw[3:]  # a UTF-8 byte order mark some editors and Windows tools write (llama-server skips it too)
    if not raw.strip():
        raise ApiError(400, "invalid_request_error", "request body is empty")
    try:
        return orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        raise ApiError(400, "invalid_request_error", f"malformed JSON: {exc}") from None


def _header_list(extra: Mapping[str, str] | None, content_type: bytes) -> list[tuple[bytes, bytes]]:
    headers = [(b"content-type", content_type), *BASE_HEADERS]
    for k, v in (extra or {}).items():
        headers.append((k.lower().encode("latin-1"), str(v).encode("latin-1")))
    return headers


async def send_json(send: Send, status: int, body: Any, headers: Mapping[str, str] | None = None) -> None:
    payload = orjson.dumps(body)
    hdrs = _header_list(headers, b"application/json")
    hdrs.append((b"content-length", str(len(payload)).encode()))
    await send({"type": "http.response.start", "status": status, "headers": hdrs})
    await send({"type": "http.response.body", "body": payload, "more_body": False})


async def send_error(send: Send, error: ApiError) -> None:
    await send_json(send, error.status, error.body(), error.headers)


def internal_error(exc: BaseException) -> ApiError:
    log.exception("unhandled error while serving a request", exc_info=exc)
    return ApiError(500, "server_error", f"internal error: {type(exc).__name__}")


async def start_sse(send: Send, headers: Mapping[str, str] | None = None) -> None:
    hdrs = _header_list(headers, b"text/event-stream")
    hdrs.append((b"cache-control", b"no-cache"))
    await send({"type": "http.response.start", "status": 200, "headers": hdrs})


# Characters that Python's str.splitlines() breaks a line at (httpx's iter_lines, and the clients built on it),
# which JSON text may carry raw, though SSE ends a line only at CR or LF: written as JSON escapes, so that a
# client reading the stream line by line never gets half an event (a 135M model's sampled U+2028 did that).
_LINE_BREAKERS = ((b"\xc2\x85", b"\\u0085"), (b"\xe2\x80\xa8", b"\\u2028"), (b"\xe2\x80\xa9", b"\\u2029"))


def sse_data(payload: Any) -> bytes:
    data = orjson.dumps(payload)
    if b"\xc2\x85" in data or b"\xe2\x80" in data:
        for raw, escaped in _LINE_BREAKERS:
            data = data.replace(raw, escaped)
    return b"data: " + data + b"\n\n"
