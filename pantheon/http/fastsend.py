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

`body_writer` goes one step further for a streamed HTTP/1.1 response, where every token is a body chunk: the
chunk is framed here (size line, data, CRLF: what h11's chunked writer writes) and goes to the socket the same
way, skipping hypercorn's ASGI send, its protocol layer and h11's event processing (none of which keeps any
state for a body chunk). Measured inside a 1-stream decode on the 2-core VM: 46 us from the app's send to the
write(2), of a ~335 us relay per token. Any state it does not expect (the response not yet in its body, the
stream closed, another write holding the lock) sends through hypercorn as before.

`install()` also makes a connection's close wait for another task's write in flight: hypercorn sends the EOF
without the send lock, so a pipelined request (which makes h11 close a `Connection: close` connection) could
cut off the answer to the request before it.

And it gives hypercorn's waiting writes a deadline (`send_or_give_up`): hypercorn shields its `send_all` from
cancellation and sets no timeout, so a client that stopped reading (its socket buffers full) held its handler
for ever, and with it a model's unload and the server's shutdown past its drain deadline. A peer that takes no
piece of a write for WRITE_STALL_S is now gone: its connection is closed, as a broken one is.
"""

from __future__ import annotations

import os
from typing import Any

import h11
import trio

_installed: dict[str, Any] = {}
_CLOSE_WAIT_S = 5.0  # how long a connection's close waits for another task's write in flight
# A peer that takes no piece of a response for this long is given up (as asgi.BODY_STALL_S for a request body);
# a piece is at most _WRITE_PIECE bytes, so a live client slower than ~2 KB/s is given up too.
WRITE_STALL_S = 30.0
_WRITE_PIECE = 1 << 16


def _write_some(server: Any, data: bytes) -> int:
    """Bytes of data the connection's socket takes at once: 0 when it would block or the connection broke
    (hypercorn's road then waits for the socket, or meets the error and reports it)."""
    try:
        return os.write(server.stream.socket.fileno(), data)
    except OSError:
        return 0


def _short_road(server: Any, event: Any, raw_data: type) -> Any:
    """The event to hand to hypercorn's own protocol_send, or None when the write took all of it."""
    if type(event) is not raw_data:
        return event
    stream = getattr(server, "stream", None)
    lock = getattr(server, "send_lock", None)
    if type(stream) is not trio.SocketStream or lock is None or lock.locked():
        return event
    data = event.data
    sent = _write_some(server, data)
    if sent == 0:
        return event
    if sent == len(data):
        return None
    return raw_data(data=bytes(data[sent:]))


async def send_or_give_up(server: Any, event: Any) -> None:
    """hypercorn's `protocol_send` (the original: `install()` keeps it), except that raw bytes for a plain TCP
    stream are written piece by piece, each with WRITE_STALL_S to go (still under the connection's send lock and
    shielded from cancellation, as hypercorn writes): a peer that takes no piece in that time is closed and
    reported gone (`Closed`), as a broken connection is, and the app's later sends to it are dropped."""
    raw_data, closed = _installed["events"]
    stream = getattr(server, "stream", None)
    lock = getattr(server, "send_lock", None)
    if type(event) is not raw_data or type(stream) is not trio.SocketStream or lock is None:
        await _installed["original"](server, event)
        return
    data = memoryview(event.data)
    async with lock:
        try:
            for start in range(0, len(data), _WRITE_PIECE):
                with trio.CancelScope(shield=True, deadline=trio.current_time() + WRITE_STALL_S) as piece:
                    await stream.send_all(data[start:start + _WRITE_PIECE])
                if piece.cancelled_caught:  # the stream is in no known state after a cancelled send: closed
                    await stream.aclose()
                    await server.protocol.handle(closed())
                    return
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            await server.protocol.handle(closed())


class BodyWriter:
    """Sends the body chunks of one chunked HTTP/1.1 response; `await writer(body)` in place of an ASGI
    `http.response.body` message with more_body=True. Only for the task that sends that response (and
    `write_now` from the event loop's callbacks while that task waits)."""

    def __init__(self, send: Any, http_stream: Any, connection: h11.Connection, server: Any, raw_data: type) -> None:
        self._send = send
        self._http_stream = http_stream
        self._connection = connection
        self._server = server
        self._raw_data = raw_data
        self._backlog = b""  # framed bytes the socket did not take at once, sent before anything else
        self._held = b""  # framed chunks write_now queued, for send_held's one write

    def ready(self) -> bool:
        """Whether `write_now` may send now: the response is in its body, with no other write holding the
        socket and nothing left over from an earlier write_now."""
        return (not self._backlog and self._connection.our_state is h11.SEND_BODY and not self._http_stream.closed
                and not self._server.send_lock.locked())

    def write_now(self, body: bytes) -> None:
        """Queue body as the next chunk (after `ready()`, or after another write_now), for `send_held` to write
        without waiting, along with the chunks queued after it: several tokens of one wake-up cost one
        write(2). Chunks left then are sent first by the next `await writer(...)` or `flush()`."""
        if not body:
            return  # an empty chunk would end the body
        self._held += b"%x\r\n%b\r\n" % (len(body), body)

    def send_held(self) -> None:
        """Write the chunks `write_now` queued, in one non-blocking write: what the socket does not take at once
        waits for the next `await writer(...)` or `flush()`. Behind a backlog (write_now called past `ready()`)
        they join it, in order."""
        if self._held:
            held, self._held = self._held, b""
            if self._backlog:
                self._backlog += held
            else:
                self._backlog = held[_write_some(self._server, held):]

    async def flush(self) -> None:
        """Send what `write_now` queued or the socket left, on hypercorn's road for the latter (before any
        other write of this response)."""
        self.send_held()
        if self._backlog:
            rest, self._backlog = self._backlog, b""
            await send_or_give_up(self._server, self._raw_data(data=rest))

    async def __call__(self, body: bytes) -> None:
        await self.flush()
        if not body or not self.ready():
            await self._send({"type": "http.response.body", "body": body, "more_body": True})
            return
        self.write_now(body)
        await self.flush()


def body_writer(send: Any) -> BodyWriter | None:
    """A `BodyWriter` for the response that `send` (hypercorn's ASGI send, or a wrapper of it that sets
    `__wrapped__`) has started, or None when it cannot take the short road: not hypercorn's HTTP/1.1 stream,
    TLS, a body that is not chunked (an HTTP/1.0 client), or `install()` not run."""
    if "original" not in _installed:
        return None
    try:
        from hypercorn.events import RawData
        from hypercorn.protocol.http_stream import ASGIHTTPState, HTTPStream
    except ImportError:
        return None
    http_stream = getattr(getattr(send, "__wrapped__", send), "__self__", None)
    if type(http_stream) is not HTTPStream or http_stream.state is not ASGIHTTPState.RESPONSE:
        return None
    protocol = getattr(getattr(http_stream, "send", None), "__self__", None)  # hypercorn's H11Protocol
    connection = getattr(protocol, "connection", None)
    server = getattr(getattr(protocol, "send", None), "__self__", None)  # hypercorn's TCPServer
    if type(connection) is not h11.Connection or connection.our_state is not h11.SEND_BODY:
        return None
    # h11 frames a body without a content-length in chunks for an HTTP/1.1 peer; anything else (an HTTP/1.0
    # peer's close-delimited body) is left to it.
    if type(getattr(connection, "_writer", None)).__name__ != "ChunkedWriter":
        return None
    if type(getattr(server, "stream", None)) is not trio.SocketStream or getattr(server, "send_lock", None) is None:
        return None
    return BodyWriter(send, http_stream, connection, server, RawData)


def install() -> bool:
    """Wrap hypercorn's trio `TCPServer.protocol_send` (once). False when this hypercorn has no such method."""
    if "original" in _installed:
        return True
    try:
        from hypercorn.events import Closed, RawData
        from hypercorn.trio.tcp_server import TCPServer
    except ImportError:
        return False
    original = getattr(TCPServer, "protocol_send", None)
    original_close = getattr(TCPServer, "_close", None)
    if original is None or original_close is None:
        return False

    async def protocol_send(self: Any, event: Any) -> None:
        rest = _short_road(self, event, RawData)
        if rest is None:
            return
        try:
            await send_or_give_up(self, rest)
        except trio.BusyResourceError:
            # The connection's close (its EOF, sent by another task) won the race: the peer is gone for this
            # response, as when hypercorn meets a broken or closed stream.
            await self.protocol.handle(Closed())

    async def close(self: Any) -> None:
        # hypercorn sends the EOF without the send lock: when a pipelined request closes the connection while
        # the answer to the one before is still being written, the EOF cut it off (or the write failed, a 500
        # in the log). An in-flight write by another task finishes first (bounded: a peer that stopped reading
        # does not hold the close forever); the EOF then follows it with no checkpoint in between.
        lock = getattr(self, "send_lock", None)
        if lock is not None and lock.locked() and lock.statistics().owner is not trio.lowlevel.current_task():
            with trio.CancelScope(shield=True), trio.move_on_after(_CLOSE_WAIT_S):
                async with lock:
                    pass
        await original_close(self)

    _installed["original"] = original
    _installed["events"] = (RawData, Closed)
    TCPServer.protocol_send = protocol_send  # type: ignore[method-assign]
    TCPServer._close = close  # type: ignore[method-assign]
    return True
