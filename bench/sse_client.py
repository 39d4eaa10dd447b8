"""A lean client for streamed chat completions: N requests at once from one thread, raw HTTP/1.1 over
non-blocking sockets and one epoll loop, recording when each content chunk arrived.

Why not httpx: the benchmarks run the clients on the machine that serves. With eight httpx streams on eight
threads, the client process took ~420 us of CPU per token (line iteration, the GIL passed between eight
threads on every chunk): 12% of this 2-core machine at 8 streams, taken from the server being measured. This
loop parses only what the figures need (the chunked framing, the SSE events, one orjson.loads per event).
"""

from __future__ import annotations

import select
import socket
import time
from dataclasses import dataclass, field
from typing import Any

import orjson


@dataclass
class StreamResult:
    sent: float = 0.0  # time.monotonic() just before the request went out
    times: list[float] = field(default_factory=list)  # arrival of each chunk with non-empty content
    completion_tokens: int | None = None  # from the usage chunk, when the request asked for one
    end: float = 0.0
    error: str | None = None


class _Stream:
    """One response's parser: status line and headers, then the chunked body, then the SSE events."""

    def __init__(self, result: StreamResult) -> None:
        self.result = result
        self.buf = b""
        self.headers_done = False
        self.chunked = False
        self.status = 0
        self.raw = b""  # the body as received, kept for an error message
        self.events = b""  # de-chunked body not yet split into events
        self.done = False

    def feed(self, data: bytes, now: float) -> None:
        self.buf += data
        if not self.headers_done:
            end = self.buf.find(b"\r\n\r\n")
            if end < 0:
                return
            head, self.buf = self.buf[:end].decode("latin-1"), self.buf[end + 4:]
            lines = head.split("\r\n")
            self.status = int(lines[0].split(" ", 2)[1])
            self.chunked = any(ln.lower().replace(" ", "") == "transfer-encoding:chunked" for ln in lines[1:])
            self.headers_done = True
        if self.status != 200 or not self.chunked:
            self.raw, self.buf = self.raw + self.buf, b""
            return
        while not self.done:
            eol = self.buf.find(b"\r\n")
            if eol < 0:
                return
            size = int(self.buf[:eol].split(b";", 1)[0], 16)
            if size == 0:
                self.done = True
                return
            if len(self.buf) < eol + 2 + size + 2:
                return
            self.events += self.buf[eol + 2:eol + 2 + size]
            self.buf = self.buf[eol + 2 + size + 2:]
            self._split_events(now)

    def _split_events(self, now: float) -> None:
        while True:
            end = self.events.find(b"\n\n")
            if end < 0:
                return
            event, self.events = self.events[:end], self.events[end + 2:]
            if not event.startswith(b"data: {"):
                continue
            body = orjson.loads(event[6:])
            usage = body.get("usage")
            if usage:
                self.result.completion_tokens = usage["completion_tokens"]
            for choice in body["choices"]:
                if choice["delta"].get("content"):
                    self.result.times.append(now)

    def close(self, now: float) -> None:
        self.result.end = now
        if self.status != 200:
            self.result.error = f"{self.status} {self.raw[:200]!r}"
        elif not self.done:
            self.result.error = "the stream ended before its last chunk"


def stream_chat_completions(host: str, port: int, bodies: list[dict[str, Any]], timeout_s: float = 600.0
                            ) -> list[StreamResult]:
    """POST every body to /v1/chat/completions at (nearly) the same moment and read the streams to their end."""
    results = [StreamResult() for _ in bodies]
    socks: dict[int, tuple[socket.socket, _Stream]] = {}
    poller = select.epoll()
    try:
        for body, result in zip(bodies, results):
            sock = socket.create_connection((host, port))
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            socks[sock.fileno()] = (sock, _Stream(result))
        requests = []
        for body in bodies:
            payload = orjson.dumps(body)
            requests.append(b"POST /v1/chat/completions HTTP/1.1\r\nHost: %s:%d\r\nContent-Type: application/json\r\n"
                            b"Content-Length: %d\r\n\r\n%s" % (host.encode(), port, len(payload), payload))
        for (sock, stream), request in zip(socks.values(), requests):
            stream.result.sent = time.monotonic()
            sock.sendall(request)
            sock.setblocking(False)
            poller.register(sock.fileno(), select.EPOLLIN)
        deadline = time.monotonic() + timeout_s
        while socks:
            events = poller.poll(max(0.0, deadline - time.monotonic()))
            if not events:
                raise TimeoutError(f"{len(socks)} stream(s) still open after {timeout_s:.0f} s")
            now = time.monotonic()
            for fd, _ in events:
                sock, stream = socks[fd]
                try:
                    data = sock.recv(1 << 16)
                except BlockingIOError:
                    continue
                if data:
                    stream.feed(data, now)
                if not data or stream.done:
                    stream.close(now)
                    poller.unregister(fd)
                    sock.close()
                    del socks[fd]
    finally:
        poller.close()
        for sock, _ in socks.values():
            sock.close()
    return results
