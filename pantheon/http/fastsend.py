"""A shorter road for hypercorn's socket writes: what a streamed token costs the event loop.

Every write hypercorn's trio worker makes goes through `TCPServer.protocol_send`: a trio Lock (a scheduling
round of the event loop to take it), a new shielded CancelScope, and `SocketStream.send_all` (another
scheduling round after the send). For a server whose responses are mostly one small SSE chunk per token,
that is most of a token's relay cost: measured on the 2-core test VM, 36 us per chunk with nothing else
running (bench: /tmp script, hypercorn streaming 20000 chunks to a reader process), and ~150 us per token
inside a 1-stream decode, where every step's weights have evicted the loop's code and data from the caches.

`install()` wraps that method: when no other write holds the connection's lock, the bytes go straight to the
socket with one non-blocking write(2), and the call returns without yielding. Whatever the write did not
take (a full socket buffer, a broken connection, anything unexpected) goes down hypercorn's own road, which
waits for the socket, or meets the error and closes the connection as it always does. Only a plain TCP
stream takes the short road (never TLS), and only when the object has the attributes this relies on, so a
hypercorn whose internals moved runs unchanged.
"""

from __future__ import annotations

import os
from typing import Any

import trio

_installed: dict[str, Any] = {}


def _short_road(server: Any, event: Any, raw_data: type) -> Any:
    """The event to hand to hypercorn's own protocol_send, or None when the write took all of it."""
    if type(event) is not raw_data:
        return event
    stream = getattr(server, "stream", None)
    lock = getattr(server, "send_lock", None)
    if type(stream) is not trio.SocketStream or lock is None or lock.locked():
        return event
    data = event.data
    try:
        sent = os.write(stream.socket.fileno(), data)
    except OSError:  # would block, or a broken connection: hypercorn's road waits, or reports it
        return event
    if sent == len(data):
        return None
    return raw_data(data=bytes(data[sent:]))


def install() -> bool:
    """Wrap hypercorn's trio `TCPServer.protocol_send` (once). False when this hypercorn has no such method."""
    if "original" in _installed:
        return True
    try:
        from hypercorn.events import RawData
        from hypercorn.trio.tcp_server import TCPServer
    except ImportError:
        return False
    original = getattr(TCPServer, "protocol_send", None)
    if original is None:
        return False

    async def protocol_send(self: Any, event: Any) -> None:
        rest = _short_road(self, event, RawData)
        if rest is not None:
            await original(self, rest)

    _installed["original"] = original
    TCPServer.protocol_send = protocol_send  # type: ignore[method-assign]
    return True
