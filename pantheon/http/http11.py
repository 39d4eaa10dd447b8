"""HTTP/1.1 and nothing else, as the spec says ("The server speaks HTTP/1.1 over TCP"), from hypercorn's H11Protocol.

hypercorn, left as it is, goes beyond that in three ways a client can trip over:

- `Upgrade: h2c` on a request without a body, or the HTTP/2 preface (`PRI * HTTP/2.0`), switches the connection
  to HTTP/2 (`_check_protocol`), where the spec's `Connection: close` cannot be sent at all (HTTP/2 forbids the
  header) and the 101 answer carries none of the spec's headers. Now both are requests like any other: the
  upgrade header is not acted on (RFC 9110 lets a server ignore it), and `PRI *` is an unknown route.
- `GET` with `Connection: Upgrade` and `Upgrade: websocket` becomes a websocket scope, which the app does not
  serve, and hypercorn then answered a bare 500 on every route. Now the request reaches the app as plain HTTP
  (its upgrade header left out), which answers it as it would without (llama-server ignores the header too).
- Bytes that arrive once a request is whole (a stray CRLF, a pipelined request, anything) were fed to h11,
  which at the spec's `Connection: close` takes any byte as a protocol error, and hypercorn then closed the
  connection: a streamed answer stopped mid-body, without its last chunk or `[DONE]`, and its turn was
  cancelled. Now they are read and dropped: every response closes its connection, so no later request on it
  is ever answered (as before), and a client's close still ends the turn (hypercorn sees it as its own event).

`install()` replaces those three steps of H11Protocol, once.
"""

from __future__ import annotations

from typing import Any

import h11


def _without_websocket_upgrade(request: h11.Request) -> h11.Request:
    """`request` as hypercorn should see it: without its `Upgrade: websocket` header, so that it stays HTTP."""
    headers = [(name, value) for name, value in request.headers
               if not (name == b"upgrade" and value.strip().lower() == b"websocket")]
    if len(headers) == len(request.headers):
        return request
    return h11.Request(method=request.method, target=request.target, headers=headers,
                       http_version=request.http_version)


def _request_is_whole(connection: Any) -> bool:
    """Whether the client's request on this connection has all arrived (h11's view of the peer)."""
    return type(connection) is h11.Connection and connection.their_state in (h11.DONE, h11.MUST_CLOSE)


def install() -> bool:
    """Keep hypercorn's HTTP/1.1 connections HTTP/1.1 (see the module's text). False when this hypercorn lacks
    one of the methods replaced."""
    try:
        from hypercorn.events import RawData
        from hypercorn.protocol.h11 import H11Protocol
    except ImportError:
        return False
    if getattr(H11Protocol, "_pantheon_http11", False):
        return True
    original_handle = getattr(H11Protocol, "handle", None)
    original_create_stream = getattr(H11Protocol, "_create_stream", None)
    if original_handle is None or original_create_stream is None or not hasattr(H11Protocol, "_check_protocol"):
        return False

    async def handle(self: Any, event: Any) -> None:
        if isinstance(event, RawData) and _request_is_whole(self.connection):
            return
        await original_handle(self, event)

    async def check_protocol(self: Any, event: h11.Request) -> None:
        return None

    async def create_stream(self: Any, request: h11.Request) -> None:
        await original_create_stream(self, _without_websocket_upgrade(request))

    H11Protocol.handle = handle  # type: ignore[method-assign]
    H11Protocol._check_protocol = check_protocol  # type: ignore[method-assign]
    H11Protocol._create_stream = create_stream  # type: ignore[method-assign]
    H11Protocol._pantheon_http11 = True  # type: ignore[attr-defined]
    return True
