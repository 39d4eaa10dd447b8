"""End to end, black-box over HTTP: the client API of /v1/chat/completions against the spec
(/work/shared/spec/pantheon-api.md) — headers, error bodies, routing, every sampling parameter's effect,
content forms, streaming, disconnects.

Runs on the shared `smollm_server` (SmolLM2-135M-Instruct) plus three extra servers started here: one with
`--ctx-cap 64` (context_over_budget), one serving the same GGUF under two names (model routing) and one with
`--max-concurrent 1` (a disconnect must free its slot). Every parameter test asserts the parameter's real
effect on the output, mostly by comparison with one greedy baseline run.
"""

from __future__ import annotations

import re
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import orjson
import pytest

from tests.e2e_util import endless, raw_chat_request
from tests.server_process import ServerProcess

pytestmark = pytest.mark.slow

TIMEOUT = 300.0
MODEL = "SmolLM2-135M-Instruct"
JAPAN = "What is the capital of Japan?"
# SmolLM2 answers this greedily with a short sentence ending in EOS ("The capital of Japan is Tokyo.", 7 tokens)
# in both cpu arithmetics, float32 and int8 activations, each token ahead of the runner-up by ~0.9 nats or more
# (the closest step is the final ".") and the EOS by ~3, so a last-bit change in a kernel does not move it.
# ("What is the capital of France?" is no such prompt: int8 answers it with an endless list.)
BASE = {"messages": [{"role": "user", "content": JAPAN}], "temperature": 0, "max_tokens": 16}
# A prompt whose greedy answer repeats a token within a dozen tokens ("A cat is a majestic creature with a ..."),
# the repeat ahead of the best new token by only ~0.4 nats in both cpu arithmetics (float32 and int8
# activations), so a penalty of 2 changes the answer whatever the last bits of the kernels.
REPEAT = {"messages": [{"role": "user", "content": "Describe a cat."}], "temperature": 0, "max_tokens": 12}
POEM = {"messages": [{"role": "user", "content": "Write a short poem about the sea."}], "temperature": 1.0,
        "max_tokens": 8}
LONG = {"messages": [{"role": "user", "content": "Write a long story about a dragon and a knight."}],
        "temperature": 0}


# -- helpers -----------------------------------------------------------------------------------------------

def chat_url(server: ServerProcess) -> str:
    return server.base_url + "/v1/chat/completions"


def post(server: ServerProcess, body: Any, **kwargs: Any) -> httpx.Response:
    return httpx.post(chat_url(server), json=body, timeout=TIMEOUT, **kwargs)


def chat(server: ServerProcess, **body: Any) -> dict[str, Any]:
    r = post(server, body)
    assert r.status_code == 200, r.text
    return r.json()


def content_of(body: dict[str, Any], i: int = 0) -> str:
    return body["choices"][i]["message"]["content"]


def stream_raw(server: ServerProcess, body: dict[str, Any]) -> tuple[httpx.Response, list[str]]:
    """All `data:` payloads of a streamed completion, raw, in order (the last one should be [DONE])."""
    payloads = []
    with httpx.stream("POST", chat_url(server), json={**body, "stream": True}, timeout=TIMEOUT) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if line.startswith("data: "):
                payloads.append(line[len("data: "):])
            else:
                assert line == "" or line.startswith(":"), f"unexpected SSE line {line!r}"
    return r, payloads


def stream_events(server: ServerProcess, body: dict[str, Any]) -> list[dict[str, Any]]:
    r, payloads = stream_raw(server, body)
    assert payloads and payloads[-1] == "[DONE]", payloads[-3:]
    assert payloads.count("[DONE]") == 1
    return [orjson.loads(p) for p in payloads[:-1]]


def choice_chunks(events: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [e for e in events if e["choices"]]


def streamed_content(events: list[dict[str, Any]], index: int = 0) -> str:
    return "".join(c["delta"].get("content") or "" for e in events for c in e["choices"] if c["index"] == index)


def assert_error(r: httpx.Response, status: int, error_type: str, *, extra: set[str] = frozenset()) -> dict:
    assert r.status_code == status, (r.status_code, r.text)
    assert r.headers["content-type"].startswith("application/json")
    body = r.json()
    assert set(body) == {"error"}, body
    error = body["error"]
    assert set(error) == {"message", "type", "code"} | set(extra), error
    assert isinstance(error["message"], str) and error["message"]
    assert error["type"] == error_type
    assert error["code"] is None
    assert_common_headers(r)
    return error


def assert_common_headers(r: httpx.Response) -> None:
    assert r.headers.get("access-control-allow-origin") == "*", dict(r.headers)
    assert r.headers.get("connection", "").lower() == "close", dict(r.headers)


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable-character map, which byte-level BPE vocabularies are spelled in."""
    bs = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {b: chr(c) for b, c in zip(bs, cs)}


# -- fixtures ----------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def vocab(default_model_path: Path) -> dict[bytes, int]:
    """Token bytes -> token id, read straight from the GGUF (not through the server's tokenizer)."""
    import gguf

    reader = gguf.GGUFReader(str(default_model_path))
    field = reader.fields["tokenizer.ggml.tokens"]
    byte_of = {c: b for b, c in _bytes_to_unicode().items()}
    out: dict[bytes, int] = {}
    for token_id, i in enumerate(field.data):
        spelled = bytes(field.parts[i]).decode("utf-8")
        if all(ch in byte_of for ch in spelled):
            out.setdefault(bytes(byte_of[ch] for ch in spelled), token_id)
    return out


@pytest.fixture(scope="module")
def baseline(smollm_server: ServerProcess) -> dict[str, Any]:
    """The greedy answer to JAPAN, with logprobs (5 alternatives) — the reference most tests compare to."""
    r = post(smollm_server, {**BASE, "logprobs": True, "top_logprobs": 5})
    assert r.status_code == 200, r.text
    body = r.json()
    body["_headers"] = dict(r.headers)
    choice = body["choices"][0]
    assert choice["finish_reason"] == "stop", body  # the answer ends by itself well within max_tokens
    # The end token it ends on is a completion token (llama-server and vLLM count it) with no logprobs entry
    # (it has no text), and it is not kept: the session holds the prompt and the answer's tokens.
    usage = body["usage"]
    assert len(choice["logprobs"]["content"]) == usage["completion_tokens"] - 1 >= 5
    assert usage["kv_used"] == usage["prompt_tokens"] + usage["completion_tokens"] - 1
    return body


@pytest.fixture(scope="module")
def repeat_baseline(smollm_server: ServerProcess) -> str:
    body = chat(smollm_server, **REPEAT, logprobs=True)
    tokens = [e["token"] for e in body["choices"][0]["logprobs"]["content"]]
    assert len(set(tokens)) < len(tokens), tokens  # the greedy answer repeats a token: penalties have a hold
    return content_of(body)


@pytest.fixture(scope="module")
def ctx64_server(default_model_path: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    log = tmp_path_factory.mktemp("ctx64") / "serve.log"
    server = ServerProcess(["--model", f"{default_model_path}:{MODEL}", "--ctx-cap", "64"], log_path=log).start()
    yield server
    server.stop()


@pytest.fixture(scope="module")
def two_model_server(default_model_path: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    log = tmp_path_factory.mktemp("two") / "serve.log"
    server = ServerProcess(["--model", f"{default_model_path}:a", "--model", f"{default_model_path}:b",
                            "--max-sessions", "2"], log_path=log).start()
    yield server
    server.stop()


@pytest.fixture(scope="module")
def single_slot_server(default_model_path: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    log = tmp_path_factory.mktemp("one") / "serve.log"
    server = ServerProcess(["--model", f"{default_model_path}:{MODEL}", "--max-concurrent", "1"],
                           log_path=log).start()
    yield server
    server.stop()


# -- headers on every response kind ------------------------------------------------------------------------

def test_cors_and_connection_close_on_json_and_sse(smollm_server: ServerProcess, baseline: dict) -> None:
    for r in (httpx.get(smollm_server.base_url + "/"), httpx.get(smollm_server.base_url + "/v1/models")):
        assert r.status_code == 200
        assert_common_headers(r)
    headers = baseline["_headers"]
    assert headers["access-control-allow-origin"] == "*" and headers["connection"].lower() == "close"
    r, payloads = stream_raw(smollm_server, {**BASE, "max_tokens": 1})
    assert r.headers["content-type"].startswith("text/event-stream")
    assert_common_headers(r)
    assert payloads[-1] == "[DONE]"


def test_unknown_route_is_404_not_found(smollm_server: ServerProcess) -> None:
    for method, path in [("GET", "/nope"), ("POST", "/v1/completions"), ("GET", "/v1/chat/completions/x")]:
        r = httpx.request(method, smollm_server.base_url + path, timeout=30)
        error = assert_error(r, 404, "not_found")
        assert error["message"] == "unknown route"


@pytest.mark.parametrize("method,path", [("GET", "/v1/chat/completions"), ("POST", "/v1/models"),
                                         ("POST", "/"), ("DELETE", "/v1/models"), ("PUT", "/v1/chat/completions")])
def test_known_path_with_wrong_method_is_404_not_found(smollm_server: ServerProcess, method: str, path: str) -> None:
    r = httpx.request(method, smollm_server.base_url + path, content=orjson.dumps(BASE), timeout=30)
    error = assert_error(r, 404, "not_found")
    assert error["message"] == "unknown route"


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/models", "/", "/any/path/at/all"])
def test_options_preflight_on_any_path(smollm_server: ServerProcess, path: str) -> None:
    r = httpx.request("OPTIONS", smollm_server.base_url + path, timeout=30,
                      headers={"Origin": "http://example.com", "Access-Control-Request-Method": "POST",
                               "Access-Control-Request-Headers": "content-type, authorization"})
    assert r.status_code == 200
    assert r.json() == {}
    assert_common_headers(r)


@pytest.mark.parametrize("path", ["/", "/v1/models", "/admin/models"])
def test_head_on_a_get_route_is_its_headers_without_the_body(smollm_server: ServerProcess, path: str) -> None:
    """HEAD answers as GET does, without the body (health checkers use it; llama-server and vLLM answer it)."""
    get = httpx.get(smollm_server.base_url + path, timeout=30)
    head = httpx.head(smollm_server.base_url + path, timeout=30)
    assert head.status_code == 200 and head.content == b""
    assert_common_headers(head)
    assert head.headers["content-type"] == get.headers["content-type"]
    assert int(head.headers["content-length"]) > 0
    assert httpx.head(smollm_server.base_url + "/v1/chat/completions", timeout=30).status_code == 404


def _exchange(port: int, request: bytes, then: bytes | None = None) -> bytes:
    """Everything the server answers on one raw connection to `request` (and, once the answer has begun, to
    `then` sent on the same connection), read until it closes."""
    with socket.create_connection(("127.0.0.1", port), timeout=60) as sock:
        sock.sendall(request)
        answer = b""
        if then is not None:
            answer = sock.recv(65536)
            sock.sendall(then)
        while data := sock.recv(65536):
            answer += data
    return answer


def _head_and_body(answer: bytes) -> tuple[str, dict[str, str], bytes]:
    head, _, body = answer.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    return lines[0], {k.lower(): v.strip() for k, v in (line.split(":", 1) for line in lines[1:])}, body


_WEBSOCKET = b"Connection: Upgrade\r\nUpgrade: websocket\r\nSec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\n" \
             b"Sec-WebSocket-Version: 13\r\n"
_H2C = b"Connection: Upgrade, HTTP2-Settings\r\nUpgrade: h2c\r\nHTTP2-Settings: AAMAAABkAARAAAAAAAIAAAAA\r\n"


@pytest.mark.parametrize("raw,status", [
    (b"GET /v1/models HTTP/1.1\r\nHost: x\r\n" + _WEBSOCKET + b"\r\n", 200),
    (b"GET /nope HTTP/1.1\r\nHost: x\r\n" + _WEBSOCKET + b"\r\n", 404),
    (b"GET /v1/models HTTP/1.1\r\nHost: x\r\n" + _H2C + b"\r\n", 200),
    (b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n\x00\x00\x00\x04\x00\x00\x00\x00\x00", 404),
    # The absolute form of a target, which RFC 9112 3.2.2 says a server must accept, routes by its path.
    (b"GET http://127.0.0.1/v1/models HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n", 200),
    (b"GET HTTPS://example.com:8080/v1/models?x=1 HTTP/1.1\r\nHost: example.com\r\n\r\n", 200),
    (b"GET http://127.0.0.1/nope HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n", 404),
], ids=["websocket-upgrade", "websocket-upgrade-unknown-route", "h2c-upgrade", "http2-preface", "absolute-form",
        "absolute-form-https-port-query", "absolute-form-unknown-route"])
def test_the_server_speaks_http11_only(smollm_server: ServerProcess, raw: bytes, status: int) -> None:
    """Spec: "The server speaks HTTP/1.1 over TCP." Requests asking for a websocket or HTTP/2 are answered as
    HTTP/1.1 requests, with the headers every response carries (hypercorn upgraded h2c and the HTTP/2 preface to
    HTTP/2, where `Connection: close` cannot be sent, and answered a websocket upgrade with a bare 500)."""
    status_line, headers, body = _head_and_body(_exchange(smollm_server.port, raw))
    assert status_line.startswith(f"HTTP/1.1 {status}"), status_line
    assert headers["access-control-allow-origin"] == "*" and headers["connection"].lower() == "close"
    assert "upgrade" not in headers
    parsed = orjson.loads(body)
    assert parsed["object"] == "list" if status == 200 else parsed["error"]["type"] == "not_found"


def test_bytes_sent_during_a_stream_do_not_cut_it_off(smollm_server: ServerProcess, vocab: dict[bytes, int]
                                                       ) -> None:
    """A client that sends anything while its answer streams (a stray CRLF, a pipelined request) gets the whole
    stream: h11 took those bytes as a protocol error at `Connection: close`, and hypercorn closed the connection
    mid-body, without the last chunk or [DONE]. The extra request is not answered: the connection closes."""
    body = orjson.dumps({**_endless(vocab, 24), "stream": True})
    request = (b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
               b"Content-Length: %d\r\n\r\n%b" % (len(body), body))
    answer = _exchange(smollm_server.port, request, then=b"\r\nGET / HTTP/1.1\r\nHost: x\r\n\r\nnonsense")
    status_line, _, rest = _head_and_body(answer)
    assert status_line.startswith("HTTP/1.1 200"), status_line
    assert rest.endswith(b"data: [DONE]\n\n\r\n0\r\n\r\n")
    assert b'"finish_reason":"length"' in rest and rest.count(b"HTTP/1.1") == 0


@pytest.mark.parametrize("raw,status", [
    (b"BLAH\r\n\r\n", 400),
    (b"GET / HTTP/1.1\r\n\r\n", 400),  # no Host
    (b"POST /session/release HTTP/1.1\r\nHost: x\r\nContent-Length: abc\r\n\r\n{}", 400),
    (b"GET / HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * 200_000 + b"\r\n\r\n", 431),
], ids=["garbled", "no-host", "bad-content-length", "huge-header"])
def test_requests_refused_by_the_http_layer_get_the_spec_error_format(smollm_server: ServerProcess, raw: bytes,
                                                                       status: int) -> None:
    """Requests h11 cannot parse never reach the app: they are still answered with the headers every response
    carries and the spec's error body."""
    with socket.create_connection(("127.0.0.1", smollm_server.port), timeout=30) as sock:
        sock.sendall(raw)
        answer = b""
        while data := sock.recv(65536):
            answer += data
    head, _, body = answer.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    assert lines[0].startswith(f"HTTP/1.1 {status}"), lines[0]
    headers = {k.lower(): v.strip() for k, v in (line.split(":", 1) for line in lines[1:])}
    assert headers["access-control-allow-origin"] == "*" and headers["connection"].lower() == "close"
    assert orjson.loads(body)["error"]["type"] == "invalid_request_error"
    assert httpx.get(smollm_server.base_url + "/", timeout=30).status_code == 200


# -- 400 invalid_request_error -----------------------------------------------------------------------------

MSGS = [{"role": "user", "content": "hi"}]
BAD_BODIES: list[tuple[str, bytes]] = [
    ("empty body", b""),
    ("whitespace body", b"  \n "),
    ("malformed json", b'{"messages": [{"role": "user", "content": "hi"}'),
    ("not json at all", b"hello"),
    ("array body", b"[1, 2]"),
    ("string body", b'"hello"'),
    ("number body", b"42"),
    ("null body", b"null"),
    ("messages missing", orjson.dumps({"model": MODEL})),
    ("messages empty", orjson.dumps({"messages": []})),
    ("messages an object", orjson.dumps({"messages": {"role": "user", "content": "hi"}})),
    ("messages a string", orjson.dumps({"messages": "hi"})),
    ("message not an object", orjson.dumps({"messages": ["hi"]})),
    ("temperature a string", orjson.dumps({"messages": MSGS, "temperature": "hot"})),
    ("stream a string", orjson.dumps({"messages": MSGS, "stream": "yes"})),
    ("max_tokens a string", orjson.dumps({"messages": MSGS, "max_tokens": "lots"})),
    ("top_p a string", orjson.dumps({"messages": MSGS, "top_p": "high"})),
    ("n a string", orjson.dumps({"messages": MSGS, "n": "two"})),
    ("logprobs a string", orjson.dumps({"messages": MSGS, "logprobs": "yes"})),
    ("stop a number", orjson.dumps({"messages": MSGS, "stop": 5})),
]


@pytest.mark.parametrize("raw", [b for _, b in BAD_BODIES], ids=[name for name, _ in BAD_BODIES])
def test_bad_request_is_400_invalid_request_error(smollm_server: ServerProcess, raw: bytes) -> None:
    r = httpx.post(chat_url(smollm_server), content=raw, headers={"content-type": "application/json"}, timeout=30)
    assert_error(r, 400, "invalid_request_error")


def test_openai_client_sees_400_as_bad_request(smollm_server: ServerProcess) -> None:
    client = openai.OpenAI(base_url=smollm_server.base_url + "/v1", api_key="unused", max_retries=0)
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model=MODEL, messages=[])
    assert info.value.status_code == 400
    assert info.value.body["type"] == "invalid_request_error"  # type: ignore[index]


# -- 422 context_over_budget -------------------------------------------------------------------------------

OVERLONG = {"messages": [{"role": "user", "content": "apple banana cherry " * 40}], "temperature": 0,
            "max_tokens": 4}


def test_ctx_cap_is_advertised_and_reported(ctx64_server: ServerProcess) -> None:
    (entry,) = httpx.get(ctx64_server.base_url + "/v1/models").json()["data"]
    assert entry["context_window"] == 64
    body = chat(ctx64_server, **{**BASE, "max_tokens": 4})
    assert body["usage"]["kv_cap"] == 64
    assert body["usage"]["kv_used"] <= 64


def test_prompt_over_window_is_422_with_numbers_in_message(ctx64_server: ServerProcess) -> None:
    r = post(ctx64_server, OVERLONG)
    error = assert_error(r, 422, "context_over_budget")  # exactly message/type/code: no extra fields here
    numbers = [int(n) for n in re.findall(r"\d+", error["message"])]
    assert 64 in numbers, error["message"]  # kv_cap
    assert any(n > 64 for n in numbers), error["message"]  # kv_used: the prompt's size


def test_streamed_prompt_over_window_carries_kv_fields(ctx64_server: ServerProcess) -> None:
    plain = post(ctx64_server, OVERLONG).json()["error"]["message"]
    with httpx.stream("POST", chat_url(ctx64_server), json={**OVERLONG, "stream": True}, timeout=TIMEOUT) as r:
        raw = r.read()
    assert_common_headers(r)
    if r.status_code == 200:  # reported in-band as the terminal event of an opened stream
        assert r.headers["content-type"].startswith("text/event-stream")
        events = [orjson.loads(line[6:]) for line in raw.decode().splitlines()
                  if line.startswith("data: ") and line != "data: [DONE]"]
        errors = [e for e in events if "error" in e]
        assert len(errors) == 1 and errors[0] is events[-1], events
        body = errors[0]
    else:
        assert r.status_code == 422, raw
        body = orjson.loads(raw)
    assert set(body) == {"error"}
    error = body["error"]
    assert set(error) == {"message", "type", "code", "kv_used", "kv_cap"}, error
    assert error["type"] == "context_over_budget" and error["code"] is None
    for key in ("kv_used", "kv_cap"):
        assert isinstance(error[key], int) and not isinstance(error[key], bool)
    assert error["kv_cap"] == 64 and error["kv_used"] > 64
    assert str(error["kv_used"]) in plain  # the same numbers the non-streamed message carries


def test_kv_used_of_a_prompt_over_the_window_is_its_token_count(ctx64_server: ServerProcess) -> None:
    """Prompts that do not fit and are not huge are counted exactly: 3000 words report some 3000 tokens, not
    the lower bound from the text's length alone (94 here: a client trimming by kv_used - kv_cap would have cut
    30 tokens of some 2950)."""
    used = []
    for words in (80, 500, 3000):
        body = {"messages": [{"role": "user", "content": "word " * words}], "max_tokens": 4, "stream": True}
        with httpx.stream("POST", chat_url(ctx64_server), json=body, timeout=TIMEOUT) as r:
            error = orjson.loads(r.read())["error"]
        assert r.status_code == 422 and error["type"] == "context_over_budget", error
        assert words < error["kv_used"] < words + 64, (words, error)
        assert f"prompt is {error['kv_used']} tokens" in error["message"], error  # a count, not "at least"
        used.append(error["kv_used"])
    assert used == sorted(used), used


# 400k messages: the chat template renders every one of them (jinja, ~2 s on a Zen 3 with nothing else
# running) before the rendered prompt's length refuses it; 5.05 s was seen there with a stream decoding.
@pytest.mark.parametrize(("messages", "limit_s"), [([{"role": "user", "content": "word " * 1_600_000}], 5.0),
                                                   ([{"role": "user", "content": "word"}] * 400_000, 10.0)],
                         ids=["one-8MB-message", "400k-messages"])
def test_a_multi_megabyte_prompt_is_refused_at_once_while_streams_go_on(smollm_server: ServerProcess,
                                                                        vocab: dict[bytes, int],
                                                                        messages: list[dict[str, str]],
                                                                        limit_s: float) -> None:
    """A prompt whose length alone shows it cannot fit is refused before it is encoded (encoding 8 MB took
    ~10 s of the event loop, with every stream frozen), a big body is parsed off the event loop (400k small
    messages took it 3-4 s), and streams being decoded meanwhile keep flowing."""
    gaps: list[float] = []

    def watch() -> None:
        body = {**_endless(vocab, 120), "stream": True}
        with httpx.stream("POST", chat_url(smollm_server), json=body, timeout=TIMEOUT) as r:
            last = None
            for line in r.iter_lines():
                if line.startswith("data: {"):
                    now = time.monotonic()
                    if last is not None:
                        gaps.append(now - last)
                    last = now

    streamer = threading.Thread(target=watch)
    streamer.start()
    while not gaps and streamer.is_alive():
        time.sleep(0.01)
    started = time.monotonic()
    r = post(smollm_server, {"messages": messages, "max_tokens": 4})
    refused_in = time.monotonic() - started
    streamer.join()
    error = assert_error(r, 422, "context_over_budget")
    assert "at least" in error["message"] and "maximum context length is" in error["message"], error
    assert refused_in < limit_s, refused_in
    assert len(gaps) > 50 and max(gaps) < 2.0, (len(gaps), max(gaps, default=None))


def test_huge_max_tokens_is_accepted_and_decode_stops_at_the_window(ctx64_server: ServerProcess) -> None:
    body = chat(ctx64_server, **{**LONG, "max_tokens": 10**9})
    usage = body["usage"]
    assert body["choices"][0]["finish_reason"] == "length"
    assert usage["completion_tokens"] > 0
    assert usage["kv_used"] <= usage["kv_cap"] == 64
    assert usage["total_tokens"] <= 64 + 1  # the last sampled token need not be in the KV


# -- model routing -----------------------------------------------------------------------------------------

def test_two_models_are_listed_and_routed_by_name(two_model_server: ServerProcess) -> None:
    body = httpx.get(two_model_server.base_url + "/v1/models").json()
    assert sorted(m["id"] for m in body["data"]) == ["a", "b"]
    for name in ("a", "b", "b", "a"):
        reply = chat(two_model_server, **{**BASE, "model": name, "max_tokens": 2})
        assert reply["model"] == name


@pytest.mark.parametrize("model", ["c", "A", "a ", ""])
def test_unknown_model_is_404_model_not_found(two_model_server: ServerProcess, model: str) -> None:
    assert_error(post(two_model_server, {**BASE, "model": model}), 404, "model_not_found")


def test_absent_model_with_several_loaded_is_404(two_model_server: ServerProcess) -> None:
    assert_error(post(two_model_server, BASE), 404, "model_not_found")


def test_openai_client_sees_404_model_not_found(two_model_server: ServerProcess) -> None:
    client = openai.OpenAI(base_url=two_model_server.base_url + "/v1", api_key="unused", max_retries=0)
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="nope", messages=BASE["messages"], max_tokens=2)


def test_one_model_takes_any_model_value_or_none(smollm_server: ServerProcess, baseline: dict) -> None:
    want = content_of(baseline)
    for extra in ({}, {"model": "no-such-model"}, {"model": MODEL}):
        body = chat(smollm_server, **BASE, **extra)
        assert body["model"] == MODEL
        assert content_of(body) == want


# -- sampling parameters -----------------------------------------------------------------------------------

def test_seeded_sampling_is_reproducible(smollm_server: ServerProcess) -> None:
    first = content_of(chat(smollm_server, **POEM, seed=42))
    again = content_of(chat(smollm_server, **POEM, seed=42))
    assert first == again
    # Different seeds usually differ: with n=3, choice i samples with seed 1000 + i.
    body = chat(smollm_server, **POEM, seed=1000, n=3)
    others = {content_of(body, i) for i in range(3)} | {first}
    assert len(others) > 1, others


def test_n_choices_use_seed_plus_index(smollm_server: ServerProcess) -> None:
    body = chat(smollm_server, **POEM, seed=7, n=2)
    single = chat(smollm_server, **POEM, seed=8)
    assert content_of(body, 1) == content_of(single)


def _spanning_stop(tokens: list[str]) -> tuple[str, int]:
    """A stop string that starts inside one token and ends inside a later one; and where it starts."""
    offset = 0
    for k in range(1, len(tokens) - 2):
        offset += len(tokens[k - 1])
        a, b = tokens[k], tokens[k + 1]
        if len(a) >= 3 and len(b) >= 2:
            return a[-2:] + b + tokens[k + 2][:1], offset + len(a) - 2
    raise AssertionError(f"no two multi-character tokens in a row: {tokens}")


def test_stop_string_cuts_and_is_not_returned(smollm_server: ServerProcess, baseline: dict) -> None:
    text = content_of(baseline)
    tokens = [e["token"] for e in baseline["choices"][0]["logprobs"]["content"]]
    assert "".join(tokens) == text
    stop, at = _spanning_stop(tokens)  # e.g. "al of " across " capital", " of", " Japan"
    assert text.find(stop) == at > 0
    body = chat(smollm_server, **BASE, stop=stop)
    assert content_of(body) == text[:at]
    assert stop not in content_of(body)
    assert body["choices"][0]["finish_reason"] == "stop"


def test_logprobs_stop_before_the_stop_string(smollm_server: ServerProcess, baseline: dict) -> None:
    """The stop string's tokens are not in logprobs (llama-server trims them too), including the token the stop
    string begins inside (here two characters before its end): the entries are those of the tokens whose whole
    text is in the returned content, streamed or not."""
    entries = baseline["choices"][0]["logprobs"]["content"]
    tokens = [e["token"] for e in entries]
    stop, at = _spanning_stop(tokens)
    ends = [sum(len(t) for t in tokens[:i + 1]) for i in range(len(tokens))]
    expected = [e["token"] for e, end in zip(entries, ends) if end <= at]
    begun = [t for t, end in zip(tokens, ends) if end - len(t) < at]  # tokens the returned text starts in
    assert begun[:-1] == expected and at < ends[len(expected)]  # the stop begins inside the token left out
    body = chat(smollm_server, **BASE, stop=stop, logprobs=True)
    assert [e["token"] for e in body["choices"][0]["logprobs"]["content"]] == expected
    events = stream_events(smollm_server, {**BASE, "stop": [stop], "logprobs": True})
    streamed = [e["token"] for chunk in choice_chunks(events) for choice in chunk["choices"]
                for e in (choice.get("logprobs") or {}).get("content", [])]
    assert streamed == expected


def test_a_trailing_assistant_message_is_continued(smollm_server: ServerProcess) -> None:
    """As llama-server does: the last message, when it is the assistant's, is the start of the reply. The model
    continues it (greedy SmolLM2 counts on) and the reply holds only what follows it, streamed or not."""
    ask = {"role": "user", "content": "Count from 1 to 10, comma separated."}
    plain = chat(smollm_server, messages=[ask], temperature=0, max_tokens=8)
    body = {"messages": [ask, {"role": "assistant", "content": "1, 2, 3,"}], "temperature": 0, "max_tokens": 8}
    continued = chat(smollm_server, **body)
    assert content_of(continued).lstrip().startswith("4"), content_of(continued)
    extra = continued["usage"]["prompt_tokens"] - plain["usage"]["prompt_tokens"]
    assert 1 <= extra <= 8  # the prefill's tokens, and no end-of-turn and new turn after them
    streamed = "".join(choice["delta"].get("content") or "" for chunk in choice_chunks(
        stream_events(smollm_server, {**body, "stream": True})) for choice in chunk["choices"])
    assert streamed == content_of(continued)
    # Alone, too: the prompt is the empty conversation's generation prompt and the prefill (SmolLM2's template
    # writes its default system turn only before a first message), not a closed turn after a system prompt.
    lone = chat(smollm_server, messages=[{"role": "assistant", "content": "1, 2, 3,"}], temperature=0, max_tokens=4)
    assert lone["usage"]["prompt_tokens"] <= 12, lone["usage"]


def test_stop_array_first_match_wins(smollm_server: ServerProcess, baseline: dict) -> None:
    text = content_of(baseline)
    words = text.split(" ")
    early, late = " " + words[2], " " + words[4]  # e.g. " of" and " is"
    body = chat(smollm_server, **BASE, stop=["zzz-never-zzz", late, early])
    assert content_of(body) == text[: text.find(early)]
    assert body["choices"][0]["finish_reason"] == "stop"


def test_stop_string_in_stream_never_leaks(smollm_server: ServerProcess, baseline: dict) -> None:
    text = content_of(baseline)
    tokens = [e["token"] for e in baseline["choices"][0]["logprobs"]["content"]]
    stop, at = _spanning_stop(tokens)
    events = stream_events(smollm_server, {**BASE, "stop": [stop]})
    assert streamed_content(events) == text[:at]
    assert choice_chunks(events)[-1]["choices"][0]["finish_reason"] == "stop"


def test_a_stop_string_ends_the_turn_at_its_token(smollm_server: ServerProcess, baseline: dict) -> None:
    """The turn ends with the token that completes the stop string, streamed or not: no step runs after it, so
    the session's KV holds the prompt and every completion token but the last (sampled, never fed). A
    non-streamed turn used to read its tokens through the events channel, behind the scheduler, which ran 1-5
    more steps before it saw the stop: their tokens sat in the KV, not counted in completion_tokens, and
    kv_used differed from run to run."""
    tokens = [e["token"] for e in baseline["choices"][0]["logprobs"]["content"]]
    stop, _ = _spanning_stop(tokens)
    for _ in range(3):
        usage = chat(smollm_server, **BASE, stop=stop)["usage"]
        assert usage["kv_used"] == usage["prompt_tokens"] + usage["completion_tokens"] - 1, usage
    events = stream_events(smollm_server, {**BASE, "stop": [stop], "stream_options": {"include_usage": True}})
    assert events[-1]["usage"] == {**usage, "prompt_tokens_details": events[-1]["usage"]["prompt_tokens_details"]}
    # n = 2 (greedy: the same tokens twice), whole and streamed: usage sums both choices' tokens, kv_used is the
    # first choice's.
    for two in (chat(smollm_server, **BASE, stop=stop, n=2)["usage"],
                stream_events(smollm_server, {**BASE, "stop": [stop], "n": 2,
                                              "stream_options": {"include_usage": True}})[-1]["usage"]):
        assert two["completion_tokens"] == 2 * usage["completion_tokens"], two
        assert two["kv_used"] == usage["kv_used"], two


def test_stop_string_prefix_at_the_end_is_released(smollm_server: ServerProcess, baseline: dict) -> None:
    """The answer ends in a proper prefix of the stop string: held back while it might match, then returned."""
    text = content_of(baseline)
    stop = text[-6:] + "!?"  # e.g. "Tokyo.!?": never matches, but the answer's tail is its prefix
    body = chat(smollm_server, **BASE, stop=stop)
    assert content_of(body) == text
    assert body["choices"][0]["finish_reason"] == "stop"
    events = stream_events(smollm_server, {**BASE, "stop": [stop]})
    assert streamed_content(events) == text


def test_stop_string_at_the_very_start_gives_empty_content(smollm_server: ServerProcess, baseline: dict) -> None:
    text = content_of(baseline)
    body = chat(smollm_server, **BASE, stop=[text[:2]])
    assert content_of(body) == ""
    assert body["choices"][0]["finish_reason"] == "stop"


def test_logit_bias_plus_100_forces_a_token(smollm_server: ServerProcess, vocab: dict[bytes, int]) -> None:
    cat = vocab[b" cat"]
    body = chat(smollm_server, **{**BASE, "max_tokens": 4}, logit_bias={str(cat): 100}, logprobs=True)
    entries = body["choices"][0]["logprobs"]["content"]
    assert len(entries) == 4 and all(bytes(e["bytes"]) == b" cat" for e in entries), entries
    assert content_of(body) == " cat" * 4
    assert body["choices"][0]["finish_reason"] == "length"


def test_a_forced_control_token_has_no_text_in_the_logprobs_either(smollm_server: ServerProcess) -> None:
    """<|im_start|> (id 1) forced by a bias: no content, and its logprob entries spell it as llama-server does
    (special=false): token "" and no bytes, so the entries' bytes add up to the content."""
    body = chat(smollm_server, **{**BASE, "max_tokens": 3}, logit_bias={"1": 100}, logprobs=True, top_logprobs=2)
    entries = body["choices"][0]["logprobs"]["content"]
    assert content_of(body) == "" and len(entries) == 3, body
    assert all(e["token"] == "" and e["bytes"] == [] for e in entries), entries
    assert all(alt["bytes"] == [] for e in entries for alt in e["top_logprobs"] if alt["token"] == ""), entries


def test_logit_bias_minus_100_forbids_the_greedy_token(smollm_server: ServerProcess, baseline: dict,
                                                        vocab: dict[bytes, int]) -> None:
    first = bytes(baseline["choices"][0]["logprobs"]["content"][0]["bytes"])
    body = chat(smollm_server, **{**BASE, "max_tokens": 2}, logit_bias={str(vocab[first]): -100}, logprobs=True)
    assert bytes(body["choices"][0]["logprobs"]["content"][0]["bytes"]) != first
    # The second-best alternative of the baseline is what greedy takes instead.
    runner_up = baseline["choices"][0]["logprobs"]["content"][0]["top_logprobs"][1]
    assert body["choices"][0]["logprobs"]["content"][0]["bytes"] == runner_up["bytes"]


def test_logit_bias_bad_entries_are_skipped(smollm_server: ServerProcess, baseline: dict,
                                            vocab: dict[bytes, int]) -> None:
    first = bytes(baseline["choices"][0]["logprobs"]["content"][0]["bytes"])
    # The last key: digits past int()'s 4300-digit limit (it was a 500).
    bias = {"cat": 100, str(vocab[first]): "lots", "not-a-number": -100, "9" * 5000: 100}
    body = chat(smollm_server, **BASE, logit_bias=bias)
    assert content_of(body) == content_of(baseline)


def _assert_logprob_entry(entry: dict[str, Any]) -> None:
    assert isinstance(entry["token"], str)
    assert isinstance(entry["logprob"], float) and entry["logprob"] <= 0.0
    assert isinstance(entry["bytes"], list) and all(isinstance(b, int) and 0 <= b < 256 for b in entry["bytes"])
    assert bytes(entry["bytes"]).decode("utf-8", errors="replace") == entry["token"]


def test_logprobs_shape_and_greedy_top1(baseline: dict) -> None:
    choice = baseline["choices"][0]
    entries = choice["logprobs"]["content"]
    assert len(entries) == baseline["usage"]["completion_tokens"] - 1  # all but the end token
    assert b"".join(bytes(e["bytes"]) for e in entries).decode() == choice["message"]["content"]
    for entry in entries:
        _assert_logprob_entry(entry)
        alts = entry["top_logprobs"]
        assert len(alts) == 5
        for alt in alts:
            _assert_logprob_entry(alt)
        values = [a["logprob"] for a in alts]
        assert values == sorted(values, reverse=True)
        assert len({tuple(a["bytes"]) for a in alts}) == 5  # five different tokens
        # Greedy: the chosen token is the most likely one.
        assert alts[0]["bytes"] == entry["bytes"]
        assert alts[0]["logprob"] == pytest.approx(entry["logprob"], abs=1e-6)


def test_top_logprobs_is_clamped_to_20(smollm_server: ServerProcess) -> None:
    body = chat(smollm_server, **{**BASE, "max_tokens": 2}, logprobs=True, top_logprobs=50)
    for entry in body["choices"][0]["logprobs"]["content"]:
        assert len(entry["top_logprobs"]) == 20
        values = [a["logprob"] for a in entry["top_logprobs"]]
        assert values == sorted(values, reverse=True)


def test_negative_top_logprobs_is_clamped_to_0(smollm_server: ServerProcess) -> None:
    body = chat(smollm_server, **{**BASE, "max_tokens": 1}, logprobs=True, top_logprobs=-3)
    (entry,) = body["choices"][0]["logprobs"]["content"]
    _assert_logprob_entry(entry)
    assert entry.get("top_logprobs") in ([], None)


def test_no_logprobs_unless_asked(smollm_server: ServerProcess) -> None:
    body = chat(smollm_server, **{**BASE, "max_tokens": 2}, top_logprobs=3)
    assert body["choices"][0].get("logprobs") is None


def test_n_choices_and_usage_counts_prompt_once(smollm_server: ServerProcess, baseline: dict) -> None:
    body = chat(smollm_server, **{**BASE, "max_tokens": 4}, n=3, logprobs=True)
    assert [c["index"] for c in body["choices"]] == [0, 1, 2]
    assert "n_status" not in body
    want = content_of(baseline)
    per_choice = []
    for choice in body["choices"]:
        assert want.startswith(choice["message"]["content"])  # greedy: every choice is the same answer
        per_choice.append(len(choice["logprobs"]["content"]))
    usage = body["usage"]
    assert usage["prompt_tokens"] == baseline["usage"]["prompt_tokens"]
    assert usage["completion_tokens"] == sum(per_choice) == 12
    assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]


def test_n_above_8_is_capped(smollm_server: ServerProcess, baseline: dict) -> None:
    body = chat(smollm_server, **{**BASE, "max_tokens": 1}, n=20)
    assert [c["index"] for c in body["choices"]] == list(range(8))
    assert body["n_status"] == "capped_to_8"
    assert body["usage"]["prompt_tokens"] == baseline["usage"]["prompt_tokens"]
    assert body["usage"]["completion_tokens"] == 8


def test_small_max_tokens_ends_with_length(smollm_server: ServerProcess, baseline: dict) -> None:
    body = chat(smollm_server, **{**BASE, "max_tokens": 3}, logprobs=True)
    choice = body["choices"][0]
    assert choice["finish_reason"] == "length"
    assert body["usage"]["completion_tokens"] == 3 == len(choice["logprobs"]["content"])
    assert content_of(baseline).startswith(choice["message"]["content"])


def test_max_completion_tokens_alias(smollm_server: ServerProcess) -> None:
    body = {k: v for k, v in BASE.items() if k != "max_tokens"}
    alias = chat(smollm_server, **body, max_completion_tokens=2)
    assert alias["usage"]["completion_tokens"] == 2 and alias["choices"][0]["finish_reason"] == "length"
    both = chat(smollm_server, **body, max_tokens=3, max_completion_tokens=1)  # max_tokens wins
    assert both["usage"]["completion_tokens"] == 3 and both["choices"][0]["finish_reason"] == "length"


def test_usage_arithmetic(smollm_server: ServerProcess, baseline: dict) -> None:
    usage = baseline["usage"]
    assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]
    assert isinstance(usage["prompt_tokens_details"]["cached_tokens"], int)
    assert 0 <= usage["prompt_tokens_details"]["cached_tokens"] <= usage["prompt_tokens"]
    assert isinstance(usage["kv_used"], int)
    assert usage["prompt_tokens"] <= usage["kv_used"] <= usage["total_tokens"]
    (entry,) = httpx.get(smollm_server.base_url + "/v1/models").json()["data"]
    assert usage["kv_cap"] == entry["context_window"]


def test_usage_after_a_stop_string_cut(smollm_server: ServerProcess, baseline: dict) -> None:
    """A turn ended by a stop string still reports the KV it holds: every generated token but the last was
    fed back, so kv_used >= prompt + completion - 1 (as for a turn that ends by itself)."""
    text = content_of(baseline)
    body = chat(smollm_server, **BASE, stop=text.split(" ")[4])  # e.g. "is": cut after a few tokens
    usage = body["usage"]
    assert usage["completion_tokens"] >= 3
    assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]
    assert usage["kv_used"] >= usage["prompt_tokens"] + usage["completion_tokens"] - 1, usage


def test_cached_tokens_reported_when_a_stop_string_ends_the_turn(two_model_server: ServerProcess) -> None:
    """Two identical two-turn sessions (one per served name, same weights): the second turn reuses the same
    prefix whether or not a stop string ends it, so it reports the same cached_tokens."""
    turn1 = {**BASE, "messages": [{"role": "user", "content": JAPAN}]}
    cached = {}
    for model, stop in (("a", None), ("b", "Berlin")):
        session = f"e2e-api-stop-{model}-{time.monotonic_ns()}"
        first = chat(two_model_server, **turn1, model=model, session_id=session)
        messages = [*turn1["messages"], {"role": "assistant", "content": content_of(first)},
                    {"role": "user", "content": "And of Germany?"}]
        second = chat(two_model_server, **{**BASE, "messages": messages}, model=model, session_id=session,
                      **({"stop": stop} if stop else {}))
        cached[model] = second["usage"]["prompt_tokens_details"]["cached_tokens"]
        if stop:
            assert second["choices"][0]["finish_reason"] == "stop" and stop not in content_of(second)
        httpx.post(two_model_server.base_url + "/session/release", json={"name": model, "session_id": session},
                   timeout=30)
    assert cached["a"] > 0  # the prefix cache works at all
    assert cached["b"] == cached["a"], cached


def test_frequency_and_presence_penalties_change_a_repetitive_answer(smollm_server: ServerProcess,
                                                                     repeat_baseline: str) -> None:
    freq = content_of(chat(smollm_server, **REPEAT, frequency_penalty=2))
    assert freq != repeat_baseline
    pres = content_of(chat(smollm_server, **REPEAT, presence_penalty=2))
    assert pres != repeat_baseline


def test_repeat_penalty_changes_a_repetitive_answer(smollm_server: ServerProcess, repeat_baseline: str) -> None:
    """llama.cpp's repeat_penalty and vLLM's repetition_penalty (the same scaling here); 1 is off."""
    assert content_of(chat(smollm_server, **REPEAT, repeat_penalty=1.0)) == repeat_baseline
    penalized = content_of(chat(smollm_server, **REPEAT, repeat_penalty=2.0))
    assert penalized != repeat_baseline
    assert content_of(chat(smollm_server, **REPEAT, repetition_penalty=2.0)) == penalized
    assert content_of(chat(smollm_server, **REPEAT, repeat_penalty=2.0, repeat_last_n=0)) == repeat_baseline
    # A window past any reply is the whole reply (2**63 ended the server: no deque holds it).
    assert (content_of(chat(smollm_server, **REPEAT, repeat_penalty=2.0, repeat_last_n=2**63))
            == content_of(chat(smollm_server, **REPEAT, repeat_penalty=2.0, repeat_last_n=-1)))


def test_ignore_eos_decodes_to_max_tokens(smollm_server: ServerProcess, baseline: dict[str, Any]) -> None:
    """ignore_eos (llama.cpp, vLLM) never draws an end token: the answer that ended by itself runs on to
    max_tokens. Under a grammar (which ends its text with one) it does not apply: the turn still ends."""
    body = chat(smollm_server, **BASE, ignore_eos=True)
    assert body["choices"][0]["finish_reason"] == "length" and body["usage"]["completion_tokens"] == 16, body
    assert content_of(body).startswith(content_of(baseline)), body
    streamed = post(smollm_server, {**BASE, "ignore_eos": True, "stream": True}).text
    assert '"finish_reason":"length"' in streamed.replace(" ", ""), streamed
    constrained = chat(smollm_server, **{**BASE, "max_tokens": 64}, ignore_eos=True,
                       response_format={"type": "json_object"})
    assert constrained["choices"][0]["finish_reason"] in ("stop", "length"), constrained


def test_penalties_are_clamped_to_2(smollm_server: ServerProcess, repeat_baseline: str) -> None:
    strong = content_of(chat(smollm_server, **REPEAT, frequency_penalty=2))
    clamped = content_of(chat(smollm_server, **REPEAT, frequency_penalty=50))
    assert clamped == strong


# -- content forms -----------------------------------------------------------------------------------------

def test_text_parts_are_joined_by_newlines(smollm_server: ServerProcess) -> None:
    # The spec's table reads non-string content as empty; the project joins {"type":"text"} parts instead, as
    # llama-server does for a string template (a newline between parts), because opencode sends them when files
    # are attached (reference/clients.md). A trailing assistant message continued is its parts with nothing
    # between, as llama-server appends them.
    parts = [{"type": "text", "text": "What is the capital"}, {"type": "image_url", "image_url": {"url": "x"}},
             {"type": "text", "text": "of Japan?"}]
    joined = chat(smollm_server, **{**BASE, "messages": [{"role": "user", "content": parts}]})
    def asking(text: str) -> dict:
        return chat(smollm_server, **{**BASE, "messages": [{"role": "user", "content": text}]})

    as_text, run_on = asking("What is the capital\nof Japan?"), asking("What is the capitalof Japan?")
    assert joined["usage"]["prompt_tokens"] == as_text["usage"]["prompt_tokens"] != run_on["usage"]["prompt_tokens"]
    assert content_of(joined) == content_of(as_text)
    ask = {"role": "user", "content": "Count from 1 to 10, comma separated."}
    prefill = [{"type": "text", "text": "1, 2,"}, {"type": "text", "text": " 3,"}]
    continued = chat(smollm_server, messages=[ask, {"role": "assistant", "content": prefill}], temperature=0,
                     max_tokens=6)
    same = chat(smollm_server, messages=[ask, {"role": "assistant", "content": "1, 2, 3,"}], temperature=0,
                max_tokens=6)
    assert continued["usage"] == same["usage"] and content_of(continued) == content_of(same)


def test_message_without_role_is_user(smollm_server: ServerProcess, baseline: dict) -> None:
    body = chat(smollm_server, **{**BASE, "messages": [{"content": JAPAN}]})
    assert body["usage"]["prompt_tokens"] == baseline["usage"]["prompt_tokens"]
    assert content_of(body) == content_of(baseline)


@pytest.mark.parametrize("field", ["reasoning_content", "reasoning"])
def test_assistant_turn_with_reasoning_is_accepted(smollm_server: ServerProcess, field: str) -> None:
    messages = [{"role": "user", "content": "Hi!"},
                {"role": "assistant", "content": "Hello! How can I help?", field: "The user greets me."},
                {"role": "user", "content": JAPAN}]
    body = chat(smollm_server, messages=messages, temperature=0, max_tokens=3)
    assert body["choices"][0]["message"]["content"]
    assert body["usage"]["prompt_tokens"] > 40  # the whole conversation was rendered


def test_unknown_fields_are_ignored(smollm_server: ServerProcess, baseline: dict) -> None:
    body = chat(smollm_server, **BASE, user="someone", metadata={"k": "v"}, parallel_tool_calls=True,
                foo_bar=[1, 2, {"x": None}], store=False, frequency_penalty=0, presence_penalty=0)
    assert content_of(body) == content_of(baseline)


# -- streaming ---------------------------------------------------------------------------------------------

def test_stream_chunks_shape_and_content(smollm_server: ServerProcess, baseline: dict) -> None:
    events = stream_events(smollm_server, BASE)
    assert all(e["object"] == "chat.completion.chunk" for e in events)
    assert len({e["id"] for e in events}) == 1 and events[0]["id"].startswith("chatcmpl-")
    assert all(e["model"] == MODEL for e in events)
    chunks = choice_chunks(events)
    assert chunks == events  # no usage chunk unless asked
    assert all(e.get("usage") is None for e in events)
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant"}  # the spec's first chunk, nothing else
    assert sum("role" in e["choices"][0]["delta"] for e in chunks) == 1
    assert streamed_content(events) == content_of(baseline)
    last = chunks[-1]["choices"][0]
    assert last["delta"] == {} and last["finish_reason"] == "stop"
    assert all(e["choices"][0]["finish_reason"] is None for e in chunks[:-1])


def test_stream_include_usage(smollm_server: ServerProcess, baseline: dict) -> None:
    events = stream_events(smollm_server, {**BASE, "stream_options": {"include_usage": True}})
    last = events[-1]
    assert last["choices"] == []
    usage = last["usage"]
    for key in ("prompt_tokens", "completion_tokens", "total_tokens"):
        assert usage[key] == baseline["usage"][key]
    assert "prompt_tokens_details" in usage and usage["kv_cap"] == baseline["usage"]["kv_cap"]
    assert [e for e in events if not e["choices"]] == [last]
    assert events[-2]["choices"][0]["finish_reason"] == "stop"
    assert streamed_content(events) == content_of(baseline)


def test_stream_n2_choices_come_one_after_another(smollm_server: ServerProcess, baseline: dict) -> None:
    events = stream_events(smollm_server, {**BASE, "n": 2, "max_tokens": 3,
                                           "stream_options": {"include_usage": True}})
    usage = events[-1]["usage"]
    assert events[-1]["choices"] == []
    assert usage["prompt_tokens"] == baseline["usage"]["prompt_tokens"]  # the prompt counted once
    assert usage["completion_tokens"] == 6  # summed over the choices
    indices = [e["choices"][0]["index"] for e in choice_chunks(events)]
    assert all(len(e["choices"]) == 1 for e in choice_chunks(events))
    assert set(indices) == {0, 1}
    assert indices == sorted(indices), indices
    for i in (0, 1):
        mine = [e["choices"][0] for e in choice_chunks(events) if e["choices"][0]["index"] == i]
        assert mine[0]["delta"]["role"] == "assistant"
        assert mine[-1]["delta"] == {} and mine[-1]["finish_reason"] == "length"
        assert streamed_content(events, i) == "".join(
            e["token"] for e in baseline["choices"][0]["logprobs"]["content"][:3])


def test_stream_logprobs_ride_content_chunks(smollm_server: ServerProcess, baseline: dict) -> None:
    events = stream_events(smollm_server, {**BASE, "logprobs": True, "top_logprobs": 2})
    entries = []
    for e in choice_chunks(events):
        choice = e["choices"][0]
        lp = choice.get("logprobs")
        if lp:
            assert choice["delta"].get("content"), choice  # logprobs only on chunks that carry content
            assert "".join(x["token"] for x in lp["content"]) == choice["delta"]["content"]
            entries.extend(lp["content"])
    want = baseline["choices"][0]["logprobs"]["content"]
    assert [e["token"] for e in entries] == [e["token"] for e in want]
    for got, ref in zip(entries, want):
        _assert_logprob_entry(got)
        assert len(got["top_logprobs"]) == 2
        assert got["logprob"] == pytest.approx(ref["logprob"], abs=1e-4)


def test_openai_client_stream_with_usage_and_logprobs(smollm_server: ServerProcess, baseline: dict) -> None:
    client = openai.OpenAI(base_url=smollm_server.base_url + "/v1", api_key="unused", max_retries=0)
    stream = client.chat.completions.create(model=MODEL, messages=BASE["messages"], temperature=0, max_tokens=16,
                                            stream=True, stream_options={"include_usage": True},
                                            logprobs=True, top_logprobs=1)
    pieces, tokens, usage, finish = [], [], None, None
    for chunk in stream:
        if chunk.usage is not None:
            assert chunk.choices == []
            usage = chunk.usage
            continue
        choice = chunk.choices[0]
        pieces.append(choice.delta.content or "")
        if choice.logprobs and choice.logprobs.content:
            tokens.extend(t.token for t in choice.logprobs.content)
        finish = choice.finish_reason or finish
    assert "".join(pieces) == content_of(baseline)
    assert tokens == [e["token"] for e in baseline["choices"][0]["logprobs"]["content"]]
    assert finish == "stop"
    assert usage is not None and usage.completion_tokens == baseline["usage"]["completion_tokens"]
    assert usage.total_tokens == usage.prompt_tokens + usage.completion_tokens


def test_openai_client_n_and_logprobs(smollm_server: ServerProcess, baseline: dict) -> None:
    client = openai.OpenAI(base_url=smollm_server.base_url + "/v1", api_key="unused", max_retries=0)
    reply = client.chat.completions.create(model=MODEL, messages=BASE["messages"], temperature=0, max_tokens=2, n=2,
                                           logprobs=True, top_logprobs=3)
    assert [c.index for c in reply.choices] == [0, 1]
    for c in reply.choices:
        assert c.finish_reason == "length"
        assert [t.token for t in c.logprobs.content] == [e["token"] for e in
                                                         baseline["choices"][0]["logprobs"]["content"][:2]]
        assert all(len(t.top_logprobs) == 3 for t in c.logprobs.content)
    assert reply.usage.completion_tokens == 4


# -- disconnects and connection handling ------------------------------------------------------------------

def _endless(vocab: dict[bytes, int], max_tokens: int) -> dict[str, Any]:
    """e2e_util.endless with the end tokens' ids taken from the vocabulary fixture."""
    return endless({t: vocab[t.encode()] for t in ("<|im_end|>", "<|endoftext|>")}, max_tokens)


def _content_lines(lines: Iterator[str], count: int) -> int:
    got = 0
    for line in lines:
        if line.startswith("data: {") and orjson.loads(line[6:])["choices"][0]["delta"].get("content"):
            got += 1
            if got == count:
                break
    return got


def test_stream_disconnect_frees_the_slot(single_slot_server: ServerProcess, vocab: dict[bytes, int]) -> None:
    (entry,) = httpx.get(single_slot_server.base_url + "/v1/models").json()["data"]
    assert entry["max_concurrent"] == 1
    with httpx.stream("POST", chat_url(single_slot_server), json={**_endless(vocab, 8000), "stream": True},
                      timeout=TIMEOUT) as r:
        assert r.status_code == 200
        lines = r.iter_lines()
        assert _content_lines(lines, 2) == 2
        # Control: while this stream holds the only slot, another request is not served: it queues (batched
        # path), or is refused at once with 429 server_busy (single-user path) or, under host memory
        # pressure, 503 server_memory_constrained.
        try:
            busy = httpx.post(chat_url(single_slot_server), json={**BASE, "max_tokens": 4}, timeout=3)
        except httpx.ReadTimeout:
            pass
        else:
            if busy.status_code == 200:  # served beside the stream: show what the stream did meanwhile
                after = [line for _, line in zip(range(6), lines) if line]
                pytest.fail(f"a second request was served while --max-concurrent 1 was busy: {busy.text}; "
                            f"the stream went on with {after}")
            assert busy.status_code in (429, 503), (busy.status_code, busy.text)
            assert_error(busy, busy.status_code, {429: "server_busy", 503: "server_memory_constrained"}[
                busy.status_code])
    # Leaving the `with` closed the connection mid-stream: the slot must come free for the next request.
    started = time.monotonic()
    r = httpx.post(chat_url(single_slot_server), json={**BASE, "max_tokens": 4}, timeout=60)
    assert r.status_code == 200, r.text  # a leaked slot would queue this for 30 s, then 429 server_busy
    assert r.json()["usage"]["completion_tokens"] == 4
    assert time.monotonic() - started < 60


def test_non_stream_disconnect_frees_the_slot(single_slot_server: ServerProcess, vocab: dict[bytes, int]) -> None:
    with socket.create_connection(("127.0.0.1", single_slot_server.port), timeout=30) as sock:
        sock.sendall(raw_chat_request(_endless(vocab, 8000)))
        time.sleep(3)  # generation is under way; now hang up without reading
    started = time.monotonic()
    r = httpx.post(chat_url(single_slot_server), json={**BASE, "max_tokens": 4}, timeout=60)
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] == 4
    assert time.monotonic() - started < 60


def _response_complete(data: bytes) -> bool:
    head, sep, body = data.partition(b"\r\n\r\n")
    if not sep:
        return False
    match = re.search(rb"(?im)^content-length:\s*(\d+)", head)
    if match:
        return len(body) >= int(match.group(1))
    return body.endswith(b"\r\n0\r\n\r\n") or body == b"0\r\n\r\n"  # chunked: the last chunk


def _raw_exchange(server: ServerProcess, request: bytes) -> tuple[bytes, float]:
    """Send one raw HTTP/1.1 request; read until the server closes. Returns (response, seconds from the
    response being complete to the close)."""
    with socket.create_connection(("127.0.0.1", server.port), timeout=30) as sock:
        sock.sendall(request)
        data, complete_at = b"", None
        while True:
            chunk = sock.recv(65536)
            if not chunk:
                break
            data += chunk
            if complete_at is None and _response_complete(data):
                complete_at = time.monotonic()
        assert complete_at is not None, data[-200:]
        return data, time.monotonic() - complete_at


@pytest.mark.parametrize("stream", [False, True])
def test_server_closes_the_connection_after_the_response(smollm_server: ServerProcess, stream: bool) -> None:
    """Connection: close is honoured: the socket closes right after the response, SSE included (a response
    left open would only be closed by an idle timeout, seconds later)."""
    payload = orjson.dumps({**BASE, "max_tokens": 2, "stream": stream})
    data, linger = _raw_exchange(smollm_server, b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n"
                                 b"Content-Length: " + str(len(payload)).encode() + b"\r\n\r\n" + payload)
    assert data.startswith(b"HTTP/1.1 200")
    assert (b"data: [DONE]" in data) == stream
    assert linger < 4.0, linger


@pytest.mark.parametrize("max_tokens", [0, -5])
def test_zero_or_negative_max_tokens_is_accepted(smollm_server: ServerProcess, max_tokens: int) -> None:
    """Means 512: accepted, and the stream runs past the first tokens (read a few, then hang up)."""
    pieces = []
    with httpx.stream("POST", chat_url(smollm_server), json={**LONG, "max_tokens": max_tokens, "stream": True},
                      timeout=TIMEOUT) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: {"):
                event = orjson.loads(line[6:])
                assert event["choices"][0]["finish_reason"] is None, event
                if event["choices"][0]["delta"].get("content"):
                    pieces.append(event["choices"][0]["delta"]["content"])
                    if len(pieces) == 3:
                        break
    assert len(pieces) == 3
