"""Helpers shared by the end-to-end scheduler and session tests: start servers, chat, stream, assert errors.

Black-box: everything goes over HTTP against a real `pantheon serve` subprocess (tests/server_process.py).
"""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import orjson

from tests.server_process import ServerProcess

MODEL = "SmolLM2-135M-Instruct"
TIMEOUT = 300.0
LONG_STORY = "Write a long story about a dragon and a knight."


def start_server(model_path: Path, log_dir: Path, *args: str, env: dict[str, str] | None = None,
                 name: str = MODEL) -> ServerProcess:
    log_dir.mkdir(parents=True, exist_ok=True)
    return ServerProcess(["--model", f"{model_path}:{name}", *args], env=env,
                         log_path=log_dir / "serve.log").start()


def chat_url(server: ServerProcess) -> str:
    return server.base_url + "/v1/chat/completions"


def post(server: ServerProcess, body: Any, *, headers: dict[str, str] | None = None,
         timeout: float = TIMEOUT) -> httpx.Response:
    return httpx.post(chat_url(server), json=body, headers=headers, timeout=timeout)


def chat(server: ServerProcess, body: dict[str, Any], *, headers: dict[str, str] | None = None) -> dict[str, Any]:
    r = post(server, body, headers=headers)
    assert r.status_code == 200, (r.status_code, r.text)
    return r.json()


def content_of(body: dict[str, Any]) -> str:
    return body["choices"][0]["message"]["content"]


def cached_of(body: dict[str, Any]) -> int:
    return body["usage"]["prompt_tokens_details"]["cached_tokens"]


def models_entry(server: ServerProcess) -> dict[str, Any]:
    r = httpx.get(server.base_url + "/v1/models", timeout=30)
    assert r.status_code == 200, r.text
    (entry,) = r.json()["data"]
    return entry


def assert_error(r: httpx.Response, status: int, error_type: str) -> dict[str, Any]:
    assert r.status_code == status, (r.status_code, r.text)
    body = r.json()
    assert set(body) == {"error"}, body
    error = body["error"]
    assert error["type"] == error_type, body
    assert error["code"] is None, body
    assert isinstance(error["message"], str) and error["message"], body
    assert r.headers.get("access-control-allow-origin") == "*"
    return error


def retry_after_seconds(r: httpx.Response) -> int:
    raw = r.headers.get("retry-after")
    assert raw is not None, f"no Retry-After on {r.status_code}: {dict(r.headers)}"
    assert raw.strip().isdigit(), f"Retry-After {raw!r} is not an integer number of seconds"
    return int(raw)


def health_latency(server: ServerProcess) -> float:
    """Seconds for one `GET /` over a fresh TCP connection (the server closes it after the response)."""
    started = time.perf_counter()
    with socket.create_connection(("127.0.0.1", server.port), timeout=30) as sock:
        sock.sendall(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
        data = b""
        while b"\r\n\r\n" not in data or not data.rstrip().endswith(b"}"):
            chunk = sock.recv(65536)
            if not chunk:
                break
            data += chunk
    elapsed = time.perf_counter() - started
    assert data.startswith(b"HTTP/1.1 200"), data[:200]
    return elapsed


def special_ids(model_path: Path) -> dict[str, int]:
    """Token ids of the end tokens, read straight from the GGUF (not through the server)."""
    import gguf

    reader = gguf.GGUFReader(str(model_path))
    f = reader.fields["tokenizer.ggml.tokens"]
    wanted = {"<|im_end|>", "<|endoftext|>"}
    out = {}
    for token_id, i in enumerate(f.data):
        text = bytes(f.parts[i]).decode("utf-8", "replace")
        if text in wanted:
            out[text] = token_id
        if len(out) == len(wanted):
            break
    return out


def endless(end_ids: dict[str, int], max_tokens: int, seed: int = 1) -> dict[str, Any]:
    """A request that cannot end by itself before max_tokens: end tokens forbidden, sampled with a frequency
    penalty so it does not fall into a loop (a loop would be stopped as repetition_loop). Temperature alone
    is not enough: at 0.8 every seed of SmolLM2 loops within 600-2800 tokens, in either cpu arithmetic; with
    the penalty, seeds 0-3 and 7 each ran the full 8000 tokens (int8 arithmetic)."""
    return {"messages": [{"role": "user", "content": LONG_STORY}], "temperature": 0.8, "seed": seed,
            "frequency_penalty": 0.5, "max_tokens": max_tokens,
            "logit_bias": {str(t): -100 for t in end_ids.values()}}


@dataclass
class StreamResult:
    status: int | None = None
    headers: dict[str, str] = field(default_factory=dict)
    opened_at: float | None = None  # response headers received
    first_token_at: float | None = None
    ended_at: float | None = None
    content: str = ""
    n_content_chunks: int = 0
    token_times: list[float] = field(default_factory=list)
    finish_reason: str | None = None
    usage: dict[str, Any] | None = None
    errors: list[dict[str, Any]] = field(default_factory=list)
    done: bool = False
    body: bytes = b""
    exception: BaseException | None = None


class Streamer:
    """One streamed completion read in a background thread, with timestamps; `close()` hangs up."""

    def __init__(self, server: ServerProcess, body: dict[str, Any], *, headers: dict[str, str] | None = None,
                 timeout: float = TIMEOUT) -> None:
        self.server, self.body, self.headers, self.timeout = server, body, headers, timeout
        self.result = StreamResult()
        self.opened = threading.Event()
        self.got_token = threading.Event()
        self.finished = threading.Event()
        self._client = httpx.Client(timeout=timeout)
        self._response: httpx.Response | None = None
        self._closing = False
        self.thread = threading.Thread(target=self._run, daemon=True)

    def start(self) -> "Streamer":
        self.thread.start()
        return self

    def _run(self) -> None:
        res = self.result
        try:
            with self._client.stream("POST", chat_url(self.server), json={**self.body, "stream": True},
                                     headers=self.headers) as r:
                self._response = r
                res.status = r.status_code
                res.headers = dict(r.headers)
                res.opened_at = time.monotonic()
                if r.status_code != 200:
                    res.body = r.read()
                    self.opened.set()
                    return
                self.opened.set()
                for line in r.iter_lines():
                    if not line.startswith("data: "):
                        continue
                    payload = line[len("data: "):]
                    if payload == "[DONE]":
                        res.done = True
                        continue
                    event = orjson.loads(payload)
                    if "error" in event:
                        res.errors.append(event["error"])
                        continue
                    if event.get("usage"):
                        res.usage = event["usage"]
                    for choice in event.get("choices", []):
                        text = choice["delta"].get("content")
                        if text:
                            now = time.monotonic()
                            res.content += text
                            res.n_content_chunks += 1
                            res.token_times.append(now)
                            if res.first_token_at is None:
                                res.first_token_at = now
                                self.got_token.set()
                        if choice.get("finish_reason"):
                            res.finish_reason = choice["finish_reason"]
        except BaseException as exc:  # noqa: BLE001 - reported to the test, never raised in the thread
            if not self._closing:
                res.exception = exc
        finally:
            res.ended_at = time.monotonic()
            self.opened.set()
            self.finished.set()

    def wait_token(self, timeout: float = 120.0) -> None:
        deadline = time.monotonic() + timeout
        while not self.got_token.wait(0.05):
            assert not self.finished.is_set(), f"stream ended without a token: {self.result}"
            assert time.monotonic() < deadline, f"no token within {timeout} s: {self.result}"

    def wait(self, timeout: float = TIMEOUT) -> StreamResult:
        assert self.finished.wait(timeout), f"stream did not finish within {timeout} s"
        return self.result

    def close(self) -> None:
        """Hang up mid-stream (the server must notice and free the slot / leave the queue). The socket is
        shut down under the reading thread, so the hang-up happens now even while that thread is blocked.
        Before the response headers (a stream still queued) httpx exposes no socket, and closing the client does
        not wake the blocked thread: the request then ends only when the server answers it. A test that hangs
        up a queued request sends it on a raw socket instead."""
        self._closing = True
        response = self._response
        if response is not None:
            stream = response.extensions.get("network_stream")
            sock = stream.get_extra_info("socket") if stream is not None else None
            if sock is not None:
                try:
                    sock.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass
        if not self.finished.wait(10):
            self._client.close()
            self.finished.wait(30)
        self._client.close()


@contextmanager
def streams(*streamers: Streamer) -> Iterator[tuple[Streamer, ...]]:
    try:
        yield streamers
    finally:
        for s in streamers:
            if not s.finished.is_set():
                s.close()


def raw_chat_request(body: dict[str, Any]) -> bytes:
    """A whole POST /v1/chat/completions as bytes, for a raw socket (a client that never reads, or hangs up
    before any answer: httpx would have no socket to hold)."""
    payload = orjson.dumps(body)
    return (b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b"Content-Length: %d\r\n\r\n%b" % (len(payload), payload))


def _gauge(server: ServerProcess, name: str) -> int:
    """A gauge of /metrics, summed over models."""
    text = httpx.get(server.base_url + "/metrics", timeout=30).text
    return sum(int(float(line.rsplit(" ", 1)[1])) for line in text.splitlines() if line.startswith(name + "{"))


def queue_depth(server: ServerProcess) -> int:
    """Jobs waiting for a decode slot, summed over models (from /metrics)."""
    return _gauge(server, "pantheon_queue_depth")


def active_slots(server: ServerProcess) -> int:
    """Turns running (admitted, prefilling or decoding), summed over models (from /metrics)."""
    return _gauge(server, "pantheon_active_slots")


def wait_queue_depth(server: ServerProcess, n: int, timeout: float = 30.0) -> None:
    """Wait until exactly n jobs are queued. A queued stream sends no status line until it is admitted (so
    that a refusal while queued is still an HTTP error), so the queue is observed here instead."""
    deadline = time.monotonic() + timeout
    while queue_depth(server) != n:
        if time.monotonic() > deadline:
            raise AssertionError(f"queue depth did not reach {n} within {timeout} s (now {queue_depth(server)})")
        time.sleep(0.05)
