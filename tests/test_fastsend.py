"""pantheon.http.fastsend: hypercorn's socket writes take one write(2) when they can, and hypercorn's own road
for whatever that write did not take, with the bytes intact and in order; `body_writer` frames a chunked
response's body chunks itself, the same way."""

from __future__ import annotations

import hashlib
import socket
from functools import partial
from typing import Any

import pytest
import trio
from hypercorn.config import Config
from hypercorn.events import RawData
from hypercorn.trio import serve

from pantheon.http import fastsend


class _Server:
    """What `_short_road` reads of hypercorn's TCPServer."""

    def __init__(self, stream: Any) -> None:
        self.stream = stream
        self.send_lock = trio.Lock()


def _stream_pair() -> tuple[trio.SocketStream, socket.socket]:
    a, b = socket.socketpair()
    return trio.SocketStream(trio.socket.from_stdlib_socket(a)), b


def _lifespan_or(handler: Any) -> Any:
    async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] == "lifespan":
            while True:
                message = await receive()
                if message["type"] == "lifespan.startup":
                    await send({"type": "lifespan.startup.complete"})
                else:
                    await send({"type": "lifespan.shutdown.complete"})
                    return
        await handler(send)
    return app


async def _serve_once(app: Any, request: bytes, done: Any, wait_s: float = 0.0) -> bytes:
    """The raw response to one request (read until `done(raw)`), from hypercorn serving app on a free port."""
    config = Config()
    config.bind = ["127.0.0.1:0"]
    config.accesslog = None
    shutdown = trio.Event()
    raw = b""
    async with trio.open_nursery() as nursery:
        binds = await nursery.start(partial(serve, app, config, shutdown_trigger=shutdown.wait))
        port = int(binds[0].rsplit(":", 1)[1])
        client = await trio.open_tcp_stream("127.0.0.1", port)
        await client.send_all(request)
        await trio.sleep(wait_s)
        with trio.fail_after(60):
            while not done(raw):
                data = await client.receive_some(1 << 20)
                if not data:
                    break
                raw += data
        await client.aclose()
        shutdown.set()
    return raw


def _unchunked(body: bytes) -> bytes:
    decoded, at = b"", 0
    while True:
        eol = body.index(b"\r\n", at)
        size = int(body[at:eol], 16)
        if size == 0:
            return decoded
        decoded += body[eol + 2:eol + 2 + size]
        assert body[eol + 2 + size:eol + 4 + size] == b"\r\n"
        at = eol + 2 + size + 2


async def test_a_write_the_socket_takes_whole_never_reaches_hypercorn() -> None:
    stream, peer = _stream_pair()
    with peer:
        assert fastsend._short_road(_Server(stream), RawData(data=b"data: 1\n\n"), RawData) is None
        assert peer.recv(100) == b"data: 1\n\n"
    await stream.aclose()


async def test_a_held_lock_or_another_stream_type_leaves_the_write_to_hypercorn() -> None:
    stream, peer = _stream_pair()
    with peer:
        server = _Server(stream)
        event = RawData(data=b"x")
        async with server.send_lock:  # another write is waiting for the socket: keep the order
            assert fastsend._short_road(server, event, RawData) is event
        assert fastsend._short_road(_Server(object()), event, RawData) is event  # e.g. TLS
        peer.setblocking(False)
        try:
            peer.recv(10)
            raise AssertionError("nothing should have been written")
        except BlockingIOError:
            pass
    await stream.aclose()


async def test_a_full_socket_leaves_the_rest_and_a_broken_one_leaves_all() -> None:
    stream, peer = _stream_pair()
    stream.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)
    big = bytes(range(256)) * 4096  # 1 MiB: more than the socket buffers hold
    rest = fastsend._short_road(_Server(stream), RawData(data=big), RawData)
    assert isinstance(rest, RawData) and 0 < len(rest.data) < len(big)
    assert big.endswith(rest.data)
    peer.close()
    event = RawData(data=b"after close")
    # Depending on timing the first write may still land in a buffer; one of the next ones fails.
    results = [fastsend._short_road(_Server(stream), event, RawData) for _ in range(3)]
    assert event in results
    await stream.aclose()


async def test_a_served_stream_arrives_intact_through_a_slow_reader(monkeypatch: Any) -> None:
    """Many small chunks then a few large ones to a client that waits before reading: some writes go whole,
    some in part and finish on hypercorn's road, and the client sees every byte in order."""
    assert fastsend.install()
    roads: list[str] = []
    short_road = fastsend._short_road

    def counted(server: Any, event: Any, raw_data: type) -> Any:
        rest = short_road(server, event, raw_data)
        roads.append("whole" if rest is None else "part" if rest is not event else "hypercorn")
        return rest

    monkeypatch.setattr(fastsend, "_short_road", counted)
    chunks = [b"data: %d\n\n" % i for i in range(2000)] + [bytes([i % 251]) * 2_000_000 for i in range(6)]
    expected = hashlib.sha256(b"".join(chunks)).hexdigest()

    async def handler(send: Any) -> None:
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"text/plain")]})
        for chunk in chunks:
            await send({"type": "http.response.body", "body": chunk, "more_body": True})
        await send({"type": "http.response.body", "body": b"", "more_body": False})

    # The server's writes fill the socket buffers while the client waits; the end of the chunked body may
    # arrive split over two reads: test what has arrived, not the last read.
    raw = await _serve_once(_lifespan_or(handler), b"GET / HTTP/1.1\r\nHost: x\r\n\r\n",
                            lambda r: r.endswith(b"\r\n0\r\n\r\n"), wait_s=0.5)
    assert hashlib.sha256(_unchunked(raw.split(b"\r\n\r\n", 1)[1])).hexdigest() == expected
    assert roads.count("whole") >= 2000 and "part" in roads and "hypercorn" in roads


async def test_a_body_writer_frames_chunks_as_h11_does_through_a_slow_reader(monkeypatch: Any) -> None:
    """Small chunks, then large ones to a client that waits before reading: the writer's own framing and
    writes, their rest on hypercorn's road, and the end of the body through hypercorn, arrive as one intact,
    correctly chunked body."""
    assert fastsend.install()
    roads: list[str] = []
    original = fastsend._installed["original"]

    async def counted_original(server: Any, event: Any) -> None:
        roads.append("rest")
        await original(server, event)

    monkeypatch.setitem(fastsend._installed, "original", counted_original)
    chunks = [b"data: %d\n\n" % i for i in range(2000)] + [bytes([i % 251]) * 2_000_000 for i in range(6)]
    writers: list[Any] = []

    async def handler(send: Any) -> None:
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"text/plain")]})
        writer = fastsend.body_writer(send)
        writers.append(writer)
        for chunk in chunks:
            await writer(chunk)
        await send({"type": "http.response.body", "body": b"", "more_body": False})

    raw = await _serve_once(_lifespan_or(handler), b"GET / HTTP/1.1\r\nHost: x\r\n\r\n",
                            lambda r: r.endswith(b"\r\n0\r\n\r\n"), wait_s=0.5)
    assert isinstance(writers[0], fastsend.BodyWriter)
    head, body = raw.split(b"\r\n\r\n", 1)
    assert b"transfer-encoding: chunked" in head.lower()
    assert hashlib.sha256(_unchunked(body)).hexdigest() == hashlib.sha256(b"".join(chunks)).hexdigest()
    assert "rest" in roads  # the large chunks did not all fit at once


async def test_no_body_writer_before_the_body_or_for_an_http_1_0_peer_or_another_send() -> None:
    """HTTP/1.0 bodies are not chunked (h11 ends them by closing the connection): the writer must not frame."""
    assert fastsend.install()
    seen: list[Any] = []

    async def handler(send: Any) -> None:
        seen.append(fastsend.body_writer(send))  # before http.response.start
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"text/plain")]})
        seen.append(fastsend.body_writer(send))
        await send({"type": "http.response.body", "body": b"plain", "more_body": False})

    raw = await _serve_once(_lifespan_or(handler), b"GET / HTTP/1.0\r\n\r\n", lambda r: False)
    assert seen == [None, None]
    assert raw.endswith(b"\r\n\r\nplain")

    async def not_hypercorn(message: Any) -> None:
        pass

    assert fastsend.body_writer(not_hypercorn) is None


async def test_a_body_writer_sends_through_hypercorn_while_another_write_holds_the_lock() -> None:
    assert fastsend.install()
    order: list[str] = []

    async def handler(send: Any) -> None:
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"text/plain")]})
        writer = fastsend.body_writer(send)
        assert writer is not None
        lock = writer._server.send_lock
        async def hold(task_status: Any) -> None:  # as another write waiting for the socket would
            async with lock:
                task_status.started()
                await trio.sleep(0.2)
                order.append("released")

        async with trio.open_nursery() as nursery:
            await nursery.start(hold)
            await writer(b"after the lock")  # must wait for the lock: hypercorn's road
            order.append("written")
        await send({"type": "http.response.body", "body": b"", "more_body": False})

    raw = await _serve_once(_lifespan_or(handler), b"GET / HTTP/1.1\r\nHost: x\r\n\r\n",
                            lambda r: r.endswith(b"\r\n0\r\n\r\n"))
    assert order == ["released", "written"]
    assert _unchunked(raw.split(b"\r\n\r\n", 1)[1]) == b"after the lock"


async def test_write_now_keeps_what_the_socket_did_not_take_for_flush() -> None:
    """write_now never waits: past a full socket buffer its chunks queue up in order, and flush sends them."""
    assert fastsend.install()
    chunks = [b"data: %d\n\n" % i for i in range(100)] + [bytes([i % 251]) * 1_000_000 for i in range(4)] + \
        [b"data: tail %d\n\n" % i for i in range(100)]
    states: list[bool] = []

    async def handler(send: Any) -> None:
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"text/plain")]})
        writer = fastsend.body_writer(send)
        assert writer is not None and writer.ready()
        for chunk in chunks:
            writer.write_now(chunk)
        writer.send_held()
        states.append(writer.ready())  # a backlog: not ready until flushed
        await writer.flush()
        states.append(writer.ready())
        await send({"type": "http.response.body", "body": b"", "more_body": False})

    raw = await _serve_once(_lifespan_or(handler), b"GET / HTTP/1.1\r\nHost: x\r\n\r\n",
                            lambda r: r.endswith(b"\r\n0\r\n\r\n"), wait_s=0.3)
    assert states == [False, True]
    assert _unchunked(raw.split(b"\r\n\r\n", 1)[1]) == b"".join(chunks)


async def test_write_now_holds_its_chunks_for_one_write(monkeypatch: pytest.MonkeyPatch) -> None:
    """The chunks of one wake-up's tokens go out in one write(2), at send_held, not one write each; an awaited
    write sends what is held first."""
    assert fastsend.install()
    writes: list[bytes] = []
    real_write = fastsend._write_some

    def counting_write(server: Any, data: bytes) -> int:
        writes.append(bytes(data))
        return real_write(server, data)

    monkeypatch.setattr(fastsend, "_write_some", counting_write)
    seen: list[int] = []

    async def handler(send: Any) -> None:
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"text/plain")]})
        writer = fastsend.body_writer(send)
        assert writer is not None
        writes.clear()  # the status line and headers went first
        for chunk in (b"data: 1\n\n", b"data: 2\n\n", b"data: 3\n\n"):
            writer.write_now(chunk)
        seen.append(len(writes))
        writer.send_held()
        seen.append(len(writes))
        writer.write_now(b"data: 4\n\n")
        await writer(b"data: 5\n\n")
        await send({"type": "http.response.body", "body": b"", "more_body": False})

    raw = await _serve_once(_lifespan_or(handler), b"GET / HTTP/1.1\r\nHost: x\r\n\r\n",
                            lambda r: r.endswith(b"\r\n0\r\n\r\n"))
    assert seen == [0, 1]
    assert writes[0] == b"9\r\ndata: 1\n\n\r\n9\r\ndata: 2\n\n\r\n9\r\ndata: 3\n\n\r\n"
    assert writes[1] == b"9\r\ndata: 4\n\n\r\n"  # held, sent before the awaited chunk
    assert _unchunked(raw.split(b"\r\n\r\n", 1)[1]) == b"".join(b"data: %d\n\n" % i for i in range(1, 6))


async def test_a_pipelined_request_that_closes_the_connection_does_not_cut_the_answer_before_it() -> None:
    """Two requests in one write to a server that answers with `Connection: close`: the second one makes
    hypercorn close the connection, which used to race the first answer's last write (its EOF sent without
    the send lock): the answer was cut off, or its write failed with BusyResourceError. Now every connection
    gets the first answer whole, and the app's sends never fail."""
    assert fastsend.install()
    failures: list[BaseException] = []
    payload = b'{"status":"ok"}'

    async def handler(send: Any) -> None:
        try:
            await send({"type": "http.response.start", "status": 200, "headers": [
                (b"content-type", b"application/json"), (b"content-length", b"%d" % len(payload)),
                (b"connection", b"close")]})
            await send({"type": "http.response.body", "body": payload, "more_body": False})
        except BaseException as exc:
            failures.append(exc)
            raise

    config = Config()
    config.bind = ["127.0.0.1:0"]
    config.accesslog = None
    shutdown = trio.Event()
    answers = []
    async with trio.open_nursery() as nursery:
        binds = await nursery.start(partial(serve, _lifespan_or(handler), config, shutdown_trigger=shutdown.wait))
        port = int(binds[0].rsplit(":", 1)[1])
        for _ in range(30):
            client = await trio.open_tcp_stream("127.0.0.1", port)
            await client.send_all(b"GET / HTTP/1.1\r\nHost: x\r\n\r\nGET /b HTTP/1.1\r\nHost: x\r\n\r\n")
            raw = b""
            with trio.fail_after(30):
                while data := await client.receive_some(1 << 16):
                    raw += data
            await client.aclose()
            answers.append(raw)
        shutdown.set()
    assert not failures, failures
    for raw in answers:
        assert raw.count(b"HTTP/1.1 200") == 1 and raw.endswith(b"\r\n\r\n" + payload), raw
