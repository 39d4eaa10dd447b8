"""Answers to requests hypercorn refuses before they reach the app, in the spec's error format.

A request h11 cannot parse (a garbled request line, no Host header, a bad Content-Length, headers too large)
is answered by hypercorn's `H11Protocol._send_error_response` with an empty body and none of the headers every
response must carry. `install()` replaces that method: the same status, with `Access-Control-Allow-Origin: *`,
`Connection: close` and a `{"error": {...}}` body of type `invalid_request_error`.
"""

from __future__ import annotations

from typing import Any

import h11
import orjson

from pantheon.errors import ApiError
from pantheon.http.asgi import BASE_HEADERS

_MESSAGES = {
    400: "malformed HTTP request",
    408: "the request did not arrive in time",
    413: "request too large",
    431: "request header fields too large",
}


def error_response(status: int) -> tuple[list[tuple[bytes, bytes]], bytes]:
    """The headers and body of the answer to a request refused at the protocol level with `status`."""
    payload = orjson.dumps(ApiError(status, "invalid_request_error",
                                    _MESSAGES.get(status, "the HTTP request could not be handled")).body())
    headers = [(b"content-type", b"application/json"), (b"content-length", b"%d" % len(payload)), *BASE_HEADERS]
    return headers, payload


def install() -> bool:
    """Replace hypercorn's `H11Protocol._send_error_response` (once). False when this hypercorn has none."""
    try:
        from hypercorn.protocol.h11 import H11Protocol
    except ImportError:
        return False
    if getattr(H11Protocol, "_pantheon_errors", False):
        return True
    if getattr(H11Protocol, "_send_error_response", None) is None:
        return False

    async def send_error_response(self: Any, status_code: int) -> None:
        headers, payload = error_response(status_code)
        await self._send_h11_event(h11.Response(status_code=status_code,
                                                headers=[*headers, *self.config.response_headers("h11")]))
        await self._send_h11_event(h11.Data(data=payload))
        await self._send_h11_event(h11.EndOfMessage())

    H11Protocol._send_error_response = send_error_response  # type: ignore[method-assign]
    H11Protocol._pantheon_errors = True  # type: ignore[attr-defined]
    return True
