"""End to end: the batch scheduler's contract over HTTP (spec: chat completion errors 429/503, "Concurrency and
connection model") — batch-invariant greedy output, the FIFO queue and its limits, the legacy single-user
path, the memory-pressure ladder, the drain on SIGTERM and health latency under load.

The 30 s queue timeout has no knob on the public surface (QUEUE_TIMEOUT_S is a constant), so it is tested
twice: over HTTP with the real 30 s, and at the unit level with the constant shrunk around a fake model.
"""

from __future__ import annotations

import os
import signal
import socket
import statistics
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import httpx
import numpy as np
import orjson
import pytest
import trio

from tests.e2e_util import (
    MODEL,
    Streamer,
    active_slots,
    raw_chat_request,
    wait_queue_depth,
    assert_error,
    chat,
    chat_url,
    content_of,
    endless,
    health_latency,
    models_entry,
    post,
    retry_after_seconds,
    special_ids,
    start_server,
    streams,
)
from tests.server_process import ServerProcess

pytestmark = pytest.mark.slow

PROMPTS = [
    "What is the capital of France?",
    "Name three colours of the rainbow.",
    "Write one sentence about cats.",
    "What is 2 + 2?",
    "Give me a tip for learning Python.",
    "Describe the sea in a few words.",
    "Why is the sky blue?",
    "Say hello in Spanish.",
]


def greedy(prompt: str, max_tokens: int = 40) -> dict[str, Any]:
    return {"messages": [{"role": "user", "content": prompt}], "temperature": 0, "max_tokens": max_tokens}


# -- fixtures ----------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def end_ids(default_model_path: Path) -> dict[str, int]:
    return special_ids(default_model_path)


@pytest.fixture(scope="module")
def eight_server(default_model_path: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    server = start_server(default_model_path, tmp_path_factory.mktemp("eight"), "--max-concurrent", "8",
                          "--ctx-cap", "2048")
    yield server
    server.stop()


@pytest.fixture(scope="module")
def two_slot_server(default_model_path: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    """--max-concurrent 2 and a queue of depth 1."""
    server = start_server(default_model_path, tmp_path_factory.mktemp("two"), "--max-concurrent", "2",
                          env={"BS_QUEUE_DEPTH": "1"})
    yield server
    server.stop()


@pytest.fixture(scope="module")
def one_slot_server(default_model_path: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    """--max-concurrent 1 and a queue of depth 1."""
    server = start_server(default_model_path, tmp_path_factory.mktemp("one"), "--max-concurrent", "1",
                          env={"BS_QUEUE_DEPTH": "1"})
    yield server
    server.stop()


# -- batch invariance ----------------------------------------------------------------------------------------

def test_eight_concurrent_greedy_streams_equal_each_alone(eight_server: ServerProcess,
                                                         end_ids: dict[str, int]) -> None:
    assert models_entry(eight_server)["max_concurrent"] == 8
    # End tokens forbidden (still greedy): every answer runs its full 32 tokens, so the eight overlap.
    bodies = [{**greedy(p, 32), "logit_bias": {str(t): -100 for t in end_ids.values()}} for p in PROMPTS]
    alone = [content_of(chat(eight_server, b)) for b in bodies]
    assert len(set(alone)) == len(PROMPTS), alone  # different prompts, different answers
    with streams(*[Streamer(eight_server, b) for b in bodies]) as ss:
        for s in ss:
            s.start()
        results = [s.wait() for s in ss]
    for prompt, want, got in zip(PROMPTS, alone, results):
        assert got.status == 200 and got.done and got.exception is None, got
        assert got.content == want, (prompt, want, got.content)
    # They really ran together: every stream had its first token before any stream ended.
    assert max(r.first_token_at for r in results) < min(r.ended_at for r in results), \
        [(r.first_token_at, r.ended_at) for r in results]


# -- queue: wait, refuse with 429, time out -----------------------------------------------------------------

def test_third_request_queues_and_fourth_gets_429(two_slot_server: ServerProcess, end_ids: dict[str, int]) -> None:
    server = two_slot_server
    assert models_entry(server)["max_concurrent"] == 2
    a = Streamer(server, endless(end_ids, 40, seed=1)).start()
    b = Streamer(server, endless(end_ids, 40, seed=2)).start()
    with streams(a, b):
        a.wait_token()
        b.wait_token()
        # Both slots decode: the third request is accepted into the queue (it waits; no status line yet).
        c = Streamer(server, greedy(PROMPTS[0], 8)).start()
        with streams(c):
            wait_queue_depth(server, 1)
            # The queue (depth 1) is full: a fourth request is refused at once, streaming or not.
            started = time.monotonic()
            r = post(server, greedy(PROMPTS[1], 4), timeout=30)
            assert time.monotonic() - started < 10
            assert_error(r, 429, "server_busy")
            assert retry_after_seconds(r) >= 1
            with httpx.stream("POST", chat_url(server), json={**greedy(PROMPTS[1], 4), "stream": True},
                              timeout=30) as rs:
                rs.read()
                assert_error(rs, 429, "server_busy")
                assert retry_after_seconds(rs) >= 1
            ra, rb, rc = a.wait(), b.wait(), c.wait()
    assert ra.finish_reason == rb.finish_reason == "length", (ra, rb)
    assert rc.done and rc.finish_reason in ("stop", "length") and rc.content, rc
    # The third one waited: its first token came only after one of the first two had finished.
    assert rc.first_token_at >= min(ra.ended_at, rb.ended_at) - 0.05, (rc.first_token_at, ra.ended_at, rb.ended_at)


def test_queue_wait_times_out_after_30_s_with_429(default_model_path: Path, tmp_path: Path,
                                                 end_ids: dict[str, int]) -> None:
    """The real 30 s timeout over HTTP (no knob shrinks it), a streamed and a plain request waiting together."""
    server = start_server(default_model_path, tmp_path, "--max-concurrent", "1", env={"BS_QUEUE_DEPTH": "2"})
    try:
        holder = Streamer(server, endless(end_ids, 8000)).start()
        with streams(holder):
            holder.wait_token()
            started = time.monotonic()
            plain: dict[str, Any] = {}
            waiter = threading.Thread(target=lambda: plain.update(
                r=post(server, greedy(PROMPTS[0], 4), timeout=120), at=time.monotonic()))
            waiter.start()
            queued = Streamer(server, greedy(PROMPTS[1], 4), timeout=120).start()
            res = queued.wait(120)
            waiter.join(120)
            assert not holder.finished.is_set(), holder.result  # the slot stayed taken all along
        r = plain["r"]
        assert 28 <= plain["at"] - started <= 60, plain["at"] - started
        assert_error(r, 429, "server_busy")
        assert retry_after_seconds(r) >= 1
        # Streaming: a request that never got a slot must not look like a successful empty completion.
        assert 28 <= res.ended_at - started <= 60, (res.ended_at - started, res)
        assert res.status == 429, ("a queue timeout on a streamed request came back as "
                                   f"{res.status}, content {res.content!r}, finish {res.finish_reason!r}, "
                                   f"errors {res.errors}")
        assert orjson.loads(res.body)["error"]["type"] == "server_busy"
        assert res.headers.get("retry-after", "").isdigit()
    finally:
        server.stop()


@pytest.mark.parametrize("stream", [True, False], ids=["queued-stream", "queued-plain"])
def test_queued_client_that_disconnects_leaves_the_queue_at_once(one_slot_server: ServerProcess,
                                                                 end_ids: dict[str, int], stream: bool) -> None:
    server = one_slot_server
    holder = Streamer(server, endless(end_ids, 8000)).start()
    with streams(holder):
        holder.wait_token()
        # B queues (depth 1): a long request that would hold the slot ~minutes if it were ever admitted. Sent on
        # a raw socket: a queued stream has no response headers yet, so an httpx client would have no socket to
        # hang up.
        sock = socket.create_connection(("127.0.0.1", server.port), timeout=30)
        sock.sendall(raw_chat_request({**endless(end_ids, 4000, seed=3), "stream": stream}))
        wait_queue_depth(server, 1)
        # Control: the queue is full now.
        assert_error(post(server, greedy(PROMPTS[1], 4), timeout=30), 429, "server_busy")
        # B hangs up: its queue place frees at once (within a decode step or two; the queue timeout would
        # take 30 s), so C is queued instead of refused.
        hung_up = time.monotonic()
        sock.close()
        wait_queue_depth(server, 0, timeout=10)
        freed = time.monotonic() - hung_up
        assert freed < 10, f"the queue place was freed {freed:.1f} s after the hang-up"
        c = Streamer(server, greedy(PROMPTS[0], 8)).start()
        with streams(c):
            wait_queue_depth(server, 1)  # queued, not refused
            print(f"\nqueue place freed {freed:.2f} s after the hang-up")
            # The holder leaves: C gets the slot right away, it does not wait for B's 4000 tokens.
            released = time.monotonic()
            holder.close()
            rc = c.wait(120)
            assert rc.done and rc.content, rc
            assert rc.first_token_at - released < 20, rc.first_token_at - released


# -- legacy path ---------------------------------------------------------------------------------------------

def test_legacy_path_serves_one_at_a_time(default_model_path: Path, tmp_path: Path,
                                          end_ids: dict[str, int]) -> None:
    server = start_server(default_model_path, tmp_path, "--max-concurrent", "4",
                          env={"QWEN35_BATCH_SLOTS": "0"})
    try:
        assert models_entry(server)["max_concurrent"] == 1
        holder = Streamer(server, endless(end_ids, 8000)).start()
        with streams(holder):
            holder.wait_token()
            for stream in (False, True):
                started = time.monotonic()
                with httpx.stream("POST", chat_url(server), json={**greedy(PROMPTS[0], 4), "stream": stream},
                                  timeout=30) as r:
                    r.read()
                assert time.monotonic() - started < 5, "the legacy path must refuse at once, not queue"
                assert_error(r, 429, "server_busy")
        # The client is gone: once the server has noticed (at its next decode step), the model serves again.
        deadline = time.monotonic() + 10
        while (r := post(server, greedy(PROMPTS[0], 4), timeout=60)).status_code == 429 \
                and time.monotonic() < deadline:
            time.sleep(0.2)
        assert r.status_code == 200, r.text
        # n > 1 on one generation at a time: the request's choices decode one after another (spec: each a full
        # separate decode), greedy ones alike; above the cap, 8 of them.
        body = post(server, {**greedy(PROMPTS[0], 3), "n": 3}, timeout=60).json()
        assert [c["index"] for c in body["choices"]] == [0, 1, 2] and "n_status" not in body, body
        assert len({c["message"]["content"] for c in body["choices"]}) == 1, body
        assert body["usage"]["completion_tokens"] == 9, body
        body = post(server, {**greedy(PROMPTS[0], 2), "n": 12}, timeout=60).json()
        assert len(body["choices"]) == 8 and body["n_status"] == "capped_to_8", body
        # Another client is still refused while a request's later choices wait for its earlier ones.
        many = Streamer(server, {**endless(end_ids, 400), "n": 2}).start()
        with streams(many):
            many.wait_token()
            assert_error(post(server, greedy(PROMPTS[0], 4), timeout=30), 429, "server_busy")
    finally:
        server.stop()


# -- memory-pressure ladder ----------------------------------------------------------------------------------

TOTAL_KB = 16_000_000


def write_meminfo(path: Path, available_pct: float) -> None:
    avail = int(TOTAL_KB * available_pct / 100)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(f"MemTotal:       {TOTAL_KB} kB\nMemFree:        {avail} kB\nMemAvailable:   {avail} kB\n")
    tmp.replace(path)


def wait_for_entry(server: ServerProcess, key: str, value: int, timeout: float = 10.0) -> dict[str, Any]:
    deadline = time.monotonic() + timeout
    while True:
        entry = models_entry(server)
        if entry.get(key) == value or time.monotonic() > deadline:
            assert entry.get(key) == value, (key, value, entry)
            return entry
        time.sleep(0.1)


def test_memory_ladder_clamps_and_recovers(default_model_path: Path, tmp_path: Path,
                                           end_ids: dict[str, int]) -> None:
    meminfo = tmp_path / "meminfo"
    write_meminfo(meminfo, 50)
    server = start_server(default_model_path, tmp_path, "--max-concurrent", "4", "--ctx-cap", "1024",
                          env={"PN_MEMINFO_PATH": str(meminfo), "PN_MEM_POLL_MS": "100", "BS_QUEUE_DEPTH": "1"})
    # ~600 prompt tokens: fits the configured 1024-token window, not a halved one.
    long_prompt = {"messages": [{"role": "user", "content": "word " * 600}], "temperature": 0, "max_tokens": 1}
    small = greedy(PROMPTS[0], 2)
    try:
        entry = models_entry(server)
        assert (entry["max_concurrent"], entry["context_window"]) == (4, 1024)
        assert chat(server, small)["usage"]["kv_cap"] == 1024

        write_meminfo(meminfo, 10)  # elevated: decode slots halved
        entry = wait_for_entry(server, "max_concurrent", 2)
        assert entry["context_window"] == 1024
        assert chat(server, small)["usage"]["kv_cap"] == 1024

        write_meminfo(meminfo, 6)  # high: the window halved too
        entry = wait_for_entry(server, "context_window", 512)
        assert entry["max_concurrent"] <= 2
        assert chat(server, small)["usage"]["kv_cap"] == 512
        error = assert_error(post(server, long_prompt), 422, "context_over_budget")
        assert "512" in error["message"], error

        # Critical (spec: 503 server_memory_constrained when "the queue is full under critical pressure").
        write_meminfo(meminfo, 2)
        time.sleep(1.0)
        entry = models_entry(server)
        assert entry["context_window"] == 512 and entry["max_concurrent"] >= 1
        holders = [Streamer(server, endless(end_ids, 8000, seed=i)).start() for i in range(entry["max_concurrent"])]
        with streams(*holders):
            for h in holders:
                h.wait_token()
            queued = Streamer(server, greedy(PROMPTS[1], 2)).start()  # the queue (depth 1) takes one
            with streams(queued):
                wait_queue_depth(server, 1)
                r = post(server, small, timeout=30)
                assert all(not h.finished.is_set() for h in holders)  # the slots were all taken throughout
                assert_error(r, 503, "server_memory_constrained")

        write_meminfo(meminfo, 50)  # recovery restores the configured numbers
        entry = wait_for_entry(server, "max_concurrent", 4)
        assert entry["context_window"] == 1024
        body = chat(server, long_prompt)
        assert body["usage"]["kv_cap"] == 1024 and body["usage"]["prompt_tokens"] > 512
    finally:
        server.stop()


def test_a_queued_prompt_the_window_no_longer_fits_is_refused_when_its_turn_comes(default_model_path: Path,
                                                                                  tmp_path: Path,
                                                                                  end_ids: dict[str, int]) -> None:
    """The ladder halves the window while a prompt waits in the queue: when a slot frees it is refused with 422
    context_over_budget, as it would have been when it came, streamed or not (it ran past the window: 200 with
    one token and kv_used over kv_cap)."""
    meminfo = tmp_path / "meminfo"
    write_meminfo(meminfo, 50)
    server = start_server(default_model_path, tmp_path, "--max-concurrent", "1", "--ctx-cap", "1024",
                          env={"PN_MEMINFO_PATH": str(meminfo), "PN_MEM_POLL_MS": "100"})
    long_prompt = {"messages": [{"role": "user", "content": "word " * 600}], "temperature": 0, "max_tokens": 4}
    try:
        for stream in (False, True):
            write_meminfo(meminfo, 50)
            wait_for_entry(server, "context_window", 1024)
            holder = Streamer(server, endless(end_ids, 8000)).start()
            with streams(holder):
                holder.wait_token()
                answer: dict[str, httpx.Response] = {}
                body = {**long_prompt, "stream": stream}

                def send() -> None:
                    with httpx.stream("POST", chat_url(server), json=body, timeout=120) as r:
                        r.read()
                        answer["r"] = r

                sender = threading.Thread(target=send, daemon=True)
                sender.start()
                wait_queue_depth(server, 1)
                write_meminfo(meminfo, 6)  # high: the window halved
                wait_for_entry(server, "context_window", 512)
                holder.close()  # the slot frees: the queued prompt's turn
                sender.join(60)
            error = assert_error(answer["r"], 422, "context_over_budget")
            assert "kv_cap=512" in error["message"], error
            # As at submit: the fields ride the error object of a streamed request only (spec: non-streaming
            # puts kv_used/kv_cap in the message text).
            fields = {k: error[k] for k in ("kv_used", "kv_cap") if k in error}
            assert fields == ({"kv_used": error.get("kv_used"), "kv_cap": 512} if stream else {}), error
    finally:
        server.stop()


# -- drain ---------------------------------------------------------------------------------------------------

def test_sigterm_drains_in_flight_streams_and_exits_0(default_model_path: Path, tmp_path: Path,
                                                      end_ids: dict[str, int]) -> None:
    server = start_server(default_model_path, tmp_path, "--max-concurrent", "2", "--drain-timeout", "300")
    try:
        # Long enough (several seconds) to be still decoding when the 503s below are checked: 40 tokens once
        # finished, drained and exited within the 0.3 s wait.
        body = {**endless(end_ids, 600), "stream_options": {"include_usage": True}}
        a = Streamer(server, body).start()
        b = Streamer(server, {**body, "seed": 7}).start()
        with streams(a, b):
            a.wait_token()
            b.wait_token()
            server.signal(signal.SIGTERM)
            time.sleep(0.3)
            for stream in (False, True):
                with httpx.stream("POST", chat_url(server), json={**greedy(PROMPTS[0], 4), "stream": stream},
                                  timeout=30) as r:
                    r.read()
                assert_error(r, 503, "server_shutting_down")
                assert r.headers.get("retry-after") == "1", dict(r.headers)
            # Nor are models loaded while draining: one would be unloaded again at once.
            r = httpx.post(server.base_url + "/admin/models/load", json={"path": str(default_model_path),
                                                                         "name": "late"}, timeout=30)
            assert_error(r, 503, "server_shutting_down")
            # Nor sessions restored: one would be gone when the process exits (refused before the blob is read).
            r = httpx.post(server.base_url + "/session/restore", json={"session_id": "late", "blob": "AAAA",
                                                                       "tokens": [1, 2]}, timeout=30)
            assert_error(r, 503, "server_shutting_down")
            ra, rb = a.wait(300), b.wait(300)
        for res in (ra, rb):
            assert res.exception is None and res.done, res
            assert res.finish_reason == "length", res
            assert res.usage and res.usage["completion_tokens"] == 600, res.usage
        assert server.wait(60) == 0, server.log_tail()
    finally:
        server.stop()


def test_streams_still_running_at_the_drain_deadline_end_cleanly(default_model_path: Path, tmp_path: Path,
                                                                 end_ids: dict[str, int]) -> None:
    """At the deadline a running stream ends as a stop would (finish_reason "stop", usage, [DONE]), not cut off
    mid-stream; a queued turn gets 503 server_shutting_down; the server exits 0."""
    server = start_server(default_model_path, tmp_path, "--max-concurrent", "1", "--drain-timeout", "1")
    try:
        body = {**endless(end_ids, 8000), "stream_options": {"include_usage": True}}
        running = Streamer(server, body).start()
        with streams(running):
            running.wait_token()
            queued = Streamer(server, {**body, "seed": 3}).start()
            with streams(queued):
                wait_queue_depth(server, 1)
                server.signal(signal.SIGTERM)
                res, refused = running.wait(60), queued.wait(60)
        assert res.exception is None and res.done, res
        assert res.finish_reason == "stop" and 0 < res.usage["completion_tokens"] < 8000, res
        assert refused.status == 503 and b"server_shutting_down" in refused.body, refused
        assert server.wait(60) == 0, server.log_tail()
    finally:
        server.stop()


def test_an_answer_the_drain_deadline_cut_before_its_first_token_is_503(default_model_path: Path,
                                                                          tmp_path: Path) -> None:
    """A non-streamed turn still prefilling its prompt at the deadline gets 503 server_shutting_down (the
    turn failed, as a queued one does), not a 200 with empty content and finish_reason "stop" that looks like
    the model's whole answer."""
    server = start_server(default_model_path, tmp_path, "--max-concurrent", "1", "--drain-timeout", "0")
    try:
        # ~4000 prompt tokens: seconds of prefill on 2 cores, so the deadline (at once) comes before a token.
        body = {"messages": [{"role": "user", "content": "word " * 4000}], "max_tokens": 8, "temperature": 0}
        answer: dict[str, httpx.Response] = {}
        sender = threading.Thread(target=lambda: answer.setdefault("r", post(server, body)), daemon=True)
        sender.start()
        deadline = time.monotonic() + 30
        while active_slots(server) != 1:
            assert time.monotonic() < deadline, "the turn never started"
            time.sleep(0.02)
        server.signal(signal.SIGTERM)
        sender.join(60)
        assert_error(answer["r"], 503, "server_shutting_down")
        assert server.wait(60) == 0, server.log_tail()
    finally:
        server.stop()


def test_a_client_that_stops_reading_holds_neither_an_unload_nor_the_shutdown(default_model_path: Path,
                                                                              tmp_path: Path,
                                                                              end_ids: dict[str, int]) -> None:
    """A streamed answer of some megabytes (8 choices, 20 alternatives a token) to a client with a 2 KiB
    receive buffer that never reads: the server's writes stall, and after fastsend.WRITE_STALL_S (30 s) the
    connection is given up, so the model's unload (which waits for the requests in hand) answers and a SIGTERM
    exits at once. hypercorn's own writes have no deadline: the unload waited until the client closed."""
    server = start_server(default_model_path, tmp_path)
    try:
        body = {**endless(end_ids, 128), "n": 8, "logprobs": True, "top_logprobs": 20, "stream": True}
        stuck = socket.socket()
        stuck.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 2048)
        stuck.connect(("127.0.0.1", server.port))
        stuck.sendall(raw_chat_request(body))
        try:
            time.sleep(5)  # the turn decodes (8 x 128 tokens) and its writes fill the buffers
            started = time.monotonic()
            r = httpx.post(server.base_url + "/admin/models/unload", json={"name": MODEL}, timeout=120)
            assert r.status_code == 200, r.text
            assert time.monotonic() - started < 45, time.monotonic() - started
            server.signal(signal.SIGTERM)
            assert server.wait(20) == 0, server.log_tail()
        finally:
            stuck.close()
    finally:
        server.stop()


def test_second_signal_exits_at_once(default_model_path: Path, tmp_path: Path, end_ids: dict[str, int]) -> None:
    server = start_server(default_model_path, tmp_path)
    try:
        holder = Streamer(server, endless(end_ids, 8000)).start()
        with streams(holder):
            holder.wait_token()
            server.signal(signal.SIGTERM)
            time.sleep(0.5)
            assert server.proc is not None and server.proc.poll() is None  # draining: still up
            sent = time.monotonic()
            server.signal(signal.SIGTERM)
            server.wait(10)
            assert time.monotonic() - sent < 5
    finally:
        server.stop()


# -- health under load ---------------------------------------------------------------------------------------

def test_health_answers_fast_while_eight_streams_decode(eight_server: ServerProcess,
                                                        end_ids: dict[str, int]) -> None:
    idle = [health_latency(eight_server) for _ in range(10)]
    ss = [Streamer(eight_server, endless(end_ids, 600, seed=i)).start() for i in range(8)]
    latencies = []
    with streams(*ss):
        for s in ss:
            s.wait_token()
        counts = [s.result.n_content_chunks for s in ss]
        for _ in range(20):
            latencies.append(health_latency(eight_server))
            time.sleep(0.05)
        # All eight were decoding while we probed.
        assert all(s.result.ended_at is None for s in ss), [s.result for s in ss if s.result.ended_at]
        progress = [s.result.n_content_chunks - c for s, c in zip(ss, counts)]
        assert sum(progress) > 0, progress
    med = statistics.median(latencies)
    print(f"\nGET / latency: idle median {statistics.median(idle) * 1000:.1f} ms; while 8 streams decode: median "
          f"{med * 1000:.1f} ms, p90 {sorted(latencies)[17] * 1000:.1f} ms, max {max(latencies) * 1000:.1f} ms "
          f"(load average {os.getloadavg()[0]:.1f}); tokens streamed meanwhile per stream: {progress}")
    assert med < 0.100, [round(x * 1000, 1) for x in latencies]


# -- unit level: the queue timeout with a fake model ---------------------------------------------------------

class FakeModel:
    """Just enough model for the scheduler: a state, a forward that takes a little time, logits."""

    vocab_size = 1000

    def __init__(self) -> None:
        self.rng = np.random.default_rng(0)

    def new_state(self, n_slots: int, ctx_cap: int) -> object:
        return object()

    def forward(self, state: object, rows: list[Any]) -> np.ndarray:
        time.sleep(0.005)
        n = sum(1 for r in rows if r.logits != "none")
        logits = np.zeros((n, self.vocab_size), np.float32)
        logits[np.arange(n), self.rng.integers(0, self.vocab_size, n)] = 10.0  # random tokens: never loops
        return logits


async def test_queue_timeout_unit(monkeypatch: pytest.MonkeyPatch) -> None:
    from pantheon.engine.sampling import SamplingParams
    from pantheon.sched import scheduler as scheduler_mod
    from pantheon.sched.jobs import ErrorEvent, GenerationJob, TokenEvent

    monkeypatch.setattr(scheduler_mod, "QUEUE_TIMEOUT_S", 0.5)
    served = SimpleNamespace(name="fake", model=FakeModel(), ctx_cap=1 << 20)
    sched = scheduler_mod.Scheduler(served, max_sessions=1, max_concurrent=1, queue_depth=4)

    def job(max_tokens: int) -> GenerationJob:
        return GenerationJob(prompt=[1, 2, 3], sampling=SamplingParams(temperature=0), max_tokens=max_tokens,
                             stop_ids=frozenset())

    async with trio.open_nursery() as nursery:
        await nursery.start(sched.run)
        holder = job(10**7)
        holder_events = sched.submit(holder)
        with trio.fail_after(10):
            assert isinstance(await holder_events.receive(), TokenEvent)
        queued = job(4)
        started = time.monotonic()
        events = sched.submit(queued)
        with trio.fail_after(10):
            event = await events.receive()
        waited = time.monotonic() - started
        assert isinstance(event, ErrorEvent), event
        assert (event.error.status, event.error.error_type) == (429, "server_busy")
        assert int(event.error.headers["Retry-After"]) >= 1
        assert 0.5 <= waited < 3.0, waited
        with trio.fail_after(5):  # and the channel ends there
            with pytest.raises(trio.EndOfChannel):
                await events.receive()
        assert sched.n_waiting == 0 and sched.n_active == 1
        # A waiter whose slot frees in time is admitted, not timed out.
        late = job(4)
        late_events = sched.submit(late)
        await trio.sleep(0.2)
        holder.cancel()
        with trio.fail_after(10):
            assert isinstance(await late_events.receive(), TokenEvent)
        nursery.cancel_scope.cancel()


async def test_a_choice_that_times_out_in_the_queue_is_left_out_with_n_status(monkeypatch: pytest.MonkeyPatch
                                                                              ) -> None:
    """n > 1 with one decode slot: choice 0 decodes while choice 1 waits past the queue timeout. The answer has
    the one choice that ran and n_status "partial_slot_unavailable" (fewer choices than asked for), not an
    empty choice that looks like a finished one."""
    from pantheon.chat import completion as completion_mod
    from pantheon.chat.prompt import Prompt
    from pantheon.chat.request import parse_chat_request
    from pantheon.engine.sampling import SamplingParams
    from pantheon.sched import scheduler as scheduler_mod
    from pantheon.sched.jobs import GenerationJob

    class Letters:  # every token is the letter "a"
        def token_bytes(self, token_id: int) -> bytes:
            return b"a"

        def is_hidden(self, token_id: int) -> bool:
            return False

    monkeypatch.setattr(scheduler_mod, "QUEUE_TIMEOUT_S", 0.5)
    served = SimpleNamespace(name="fake", model=FakeModel(), ctx_cap=1 << 20, tokenizer=Letters())
    sched = scheduler_mod.Scheduler(served, max_sessions=1, max_concurrent=1, queue_depth=4)
    instance = SimpleNamespace(served=served, scheduler=sched, name="fake")
    request = parse_chat_request({"messages": [{"role": "user", "content": "hi"}], "n": 2, "max_tokens": 300})
    prompt = Prompt(text="hi", tokens=[1, 2, 3], think=False, opens_think=False)
    completion = completion_mod.Completion(instance, request, prompt)  # type: ignore[arg-type]
    async with trio.open_nursery() as nursery:
        await nursery.start(sched.run)
        for i in range(2):  # choice 0 takes ~1.5 s (300 steps of 5 ms), choice 1 times out after 0.5 s
            job = GenerationJob(prompt=prompt.tokens, sampling=SamplingParams(temperature=0), max_tokens=300,
                                stop_ids=frozenset())
            completion.jobs.append(job)
            completion.channels.append(sched.submit(job))
            completion.grammars.append(None)
        with trio.fail_after(30):
            body = await completion_mod.complete(completion)
        nursery.cancel_scope.cancel()
    assert [c["index"] for c in body["choices"]] == [0] and body["n_status"] == "partial_slot_unavailable"
    assert body["choices"][0]["finish_reason"] == "length"
    assert body["usage"]["completion_tokens"] == 300


async def test_only_the_latest_watch_grace_releases_a_session() -> None:
    """spec (GET /session/watch): when the last watch closes, the session is released after the grace "unless
    a new watch for it arrives first". A watch that comes and goes within the grace starts a grace of its own,
    and the first one must not release the session when it runs out."""
    from pantheon.sched import scheduler as scheduler_mod

    served = SimpleNamespace(name="fake", model=FakeModel(), ctx_cap=1 << 20)
    sched = scheduler_mod.Scheduler(served, max_sessions=2, max_concurrent=1, queue_depth=4)
    async with trio.open_nursery() as nursery:
        await nursery.start(sched.run)
        slot = sched.sessions.install("g", [1, 2, 3])
        assert slot is not None
        sched.sessions.finish(slot)
        for _ in range(2):  # two watches, the second opened within the first one's grace
            sched.sessions.hold("g")
            await trio.sleep(0.1)
            sched.sessions.unhold("g")
            sched.start_watch_grace("g", 0.5)
        await trio.sleep(0.45)  # the first grace is over, the second is not
        assert sched.sessions.get("g") is not None
        await trio.sleep(0.4)
        assert sched.sessions.get("g") is None
        nursery.cancel_scope.cancel()


class RecordingModel(FakeModel):
    """FakeModel that records every step's rows as (prompt length so far, tokens in the row)."""

    def __init__(self) -> None:
        super().__init__()
        self.steps: list[list[int]] = []

    def forward(self, state: object, rows: list[Any]) -> np.ndarray:
        self.steps.append([len(r.tokens) for r in rows])
        return super().forward(state, rows)


@pytest.mark.parametrize(("rewindable", "expected"), [(True, [[100, 100, 40], [30]]),
                                                      (False, [[100], [100], [40], [30]])])
async def test_prompts_that_arrive_together_share_prefill_steps(rewindable: bool, expected: list[list[int]]) -> None:
    """Queued prompts are prefilled together, in FIFO order, up to prefill_chunk tokens a step (a prompt
    that does not fit waits for the next prefill step); a recurrent model prefills one prompt a step."""
    from pantheon.engine.sampling import SamplingParams
    from pantheon.sched import scheduler as scheduler_mod
    from pantheon.sched.jobs import FinishEvent, GenerationJob

    model = RecordingModel()
    model.supports_prefix_rewind = rewindable
    served = SimpleNamespace(name="fake", model=model, ctx_cap=4096)
    sched = scheduler_mod.Scheduler(served, max_sessions=1, max_concurrent=4, queue_depth=4, prefill_chunk=256)
    if not rewindable:
        model.snapshot_slot = lambda state, slot: None
    channels = [sched.submit(GenerationJob(prompt=list(range(1, n + 1)), sampling=SamplingParams(temperature=0),
                                           max_tokens=3, stop_ids=frozenset()))
                for n in (100, 100, 40, 30)]
    async with trio.open_nursery() as nursery:
        await nursery.start(sched.run)
        for channel in channels:
            with trio.fail_after(10):
                async for event in channel:
                    if isinstance(event, FinishEvent):
                        break
        nursery.cancel_scope.cancel()
    assert [step for step in model.steps if max(step) > 1] == expected


class FirstStepGatedModel(RecordingModel):
    """RecordingModel whose first step waits until the test sets `release`."""

    def __init__(self) -> None:
        super().__init__()
        self.release = threading.Event()

    def forward(self, state: object, rows: list[Any]) -> np.ndarray:
        if not self.steps:
            assert self.release.wait(10)
        return super().forward(state, rows)


async def test_a_short_prompt_does_not_wait_for_a_long_prefill() -> None:
    """A prompt admitted while a long one prefills gets the next prefill step (prompts take turns, least
    recently served first), not the step after the long prompt's last chunk."""
    from pantheon.engine.sampling import SamplingParams
    from pantheon.sched import scheduler as scheduler_mod
    from pantheon.sched.jobs import FinishEvent, GenerationJob

    model = FirstStepGatedModel()
    served = SimpleNamespace(name="fake", model=model, ctx_cap=4096)
    sched = scheduler_mod.Scheduler(served, max_sessions=1, max_concurrent=4, queue_depth=4, prefill_chunk=256)

    def job(n: int) -> GenerationJob:
        return GenerationJob(prompt=list(range(1, n + 1)), sampling=SamplingParams(temperature=0), max_tokens=3,
                             stop_ids=frozenset())

    finished: list[str] = []

    async def consume(name: str, channel: Any) -> None:
        with trio.fail_after(10):
            async for event in channel:
                if isinstance(event, FinishEvent):
                    finished.append(name)
                    return

    async with trio.open_nursery() as nursery:
        await nursery.start(sched.run)
        nursery.start_soon(consume, "long", sched.submit(job(1000)))
        while not sched.n_active:  # the long prompt is admitted; its first chunk waits on `release`
            await trio.sleep(0.01)
        nursery.start_soon(consume, "short", sched.submit(job(5)))
        await trio.sleep(0.05)
        model.release.set()
        while len(finished) < 2:
            await trio.sleep(0.01)
        nursery.cancel_scope.cancel()
    prefill_steps = [step for step in model.steps if max(step) > 1]
    assert prefill_steps == [[256], [5], [256], [256], [232]]
    assert finished == ["short", "long"]


class CopyingModel(FirstStepGatedModel):
    """FirstStepGatedModel that copies slot prefixes (llama models do): records each copy."""

    supports_prefix_copy = True

    def __init__(self) -> None:
        super().__init__()
        self.copies: list[tuple[int, int, int]] = []

    def copy_prefix(self, state: object, source: int, dest: int, n: int) -> None:
        self.copies.append((source, dest, n))


async def test_a_turn_cancelled_before_its_prefix_copy_leaves_no_cache_behind() -> None:
    """A stateless turn starting from a copy of a session's prefix, cancelled before its first step ran the copy:
    its slot must not keep the tokens the copy promised (a later turn would resume from state never written),
    and the source is unpinned. The same turn left to run copies, then keeps its tokens as an anonymous cache."""
    from pantheon.engine.sampling import SamplingParams
    from pantheon.sched import scheduler as scheduler_mod
    from pantheon.sched.jobs import FinishEvent, GenerationJob

    model = CopyingModel()
    served = SimpleNamespace(name="fake", model=model, ctx_cap=4096)
    sched = scheduler_mod.Scheduler(served, max_sessions=2, max_concurrent=4, queue_depth=4, prefill_chunk=256)
    system = list(range(1, 201))

    def job(prompt: list[int], session: str | None = None) -> GenerationJob:
        return GenerationJob(prompt=prompt, sampling=SamplingParams(temperature=0), max_tokens=2,
                             stop_ids=frozenset(), session_key=session)

    async def finish(channel: Any) -> None:
        with trio.fail_after(10):
            async for event in channel:
                if isinstance(event, FinishEvent):
                    return

    async with trio.open_nursery() as nursery:
        await nursery.start(sched.run)
        model.release.set()
        await finish(sched.submit(job(system + [900], "s")))  # the session's slot now holds the prefix
        source = sched.sessions.get("s").slots[0]  # type: ignore[union-attr]
        model.release.clear()
        model.steps.clear()
        # Admitted together; the blocker's chunk fills the first step, which waits on `release`.
        blocker = sched.submit(job(list(range(1000, 1300))))
        copier_job = job(system + [901])
        copier = sched.submit(copier_job)
        with trio.fail_after(10):
            while sched.n_active < 2:
                await trio.sleep(0.01)
        assert source.pins == 1
        slot = next(s for s in sched.sessions.slots if s.busy and s.tokens == system)  # promised, not copied
        copier_job.cancel()
        model.release.set()
        with trio.fail_after(10):
            async for _ in copier:
                pass
        assert slot.tokens == [] and source.pins == 0 and model.copies == []
        await finish(blocker)
        # Not cancelled: the copy runs in its first step and the tokens stay, an anonymous cache.
        copier_job = job(system + [902])
        await finish(sched.submit(copier_job))
        assert [c[0] for c in model.copies] == [source.index] and source.pins == 0
        assert any(s.session is None and s.tokens[:201] == system + [902] for s in sched.sessions.slots)
        nursery.cancel_scope.cancel()


class GatedModel(FakeModel):
    """FakeModel whose second step waits for the test: `entered` is set when that step begins, and the step
    returns only once `release` is set."""

    def __init__(self) -> None:
        super().__init__()
        self.steps = 0
        self.entered, self.release = threading.Event(), threading.Event()

    def forward(self, state: object, rows: list[Any]) -> np.ndarray:
        self.steps += 1
        if self.steps == 2:
            self.entered.set()
            assert self.release.wait(10)
        return super().forward(state, rows)


async def test_a_job_cancelled_while_its_step_runs_keeps_only_what_came_before() -> None:
    """The scheduler starts the next decode step before the consumers have read the last tokens, so a stop
    string can cancel a job in the middle of a step: that step's token is neither sent nor counted in the
    slot's history (usage.kv_used), exactly as if the cancel had come before the step."""
    from pantheon.engine.sampling import SamplingParams
    from pantheon.sched import scheduler as scheduler_mod
    from pantheon.sched.jobs import FinishEvent, GenerationJob, TokenEvent

    model = GatedModel()
    served = SimpleNamespace(name="fake", model=model, ctx_cap=4096)
    sched = scheduler_mod.Scheduler(served, max_sessions=1, max_concurrent=1, queue_depth=4)
    job = GenerationJob(prompt=[1, 2, 3, 4, 5], sampling=SamplingParams(temperature=0), max_tokens=100,
                        stop_ids=frozenset())
    events = sched.submit(job)
    async with trio.open_nursery() as nursery:
        await nursery.start(sched.run)
        with trio.fail_after(10):
            assert isinstance(await events.receive(), TokenEvent)  # from the prefill step
            # The decode step started without waiting for this consumer.
            assert await trio.to_thread.run_sync(model.entered.wait, 10)
            job.cancel()  # as a stop string in the first token would
            model.release.set()
            rest = [event async for event in events]
        nursery.cancel_scope.cancel()
    assert len(rest) == 1 and isinstance(rest[0], FinishEvent), rest
    assert rest[0].usage.kv_used == 5 and rest[0].usage.completion_tokens == 1, rest[0].usage
    assert model.steps == 2


async def test_a_recurrent_model_feeds_no_token_past_a_cancel_its_consumer_makes_on_reading_it() -> None:
    """A recurrent state cannot drop a fed token, so the scheduler lets the consumers read a step's tokens before
    it plans the next: a consumer that cancels on reading a token (a stop string in it) always ends the turn
    before that token is fed, and the usage is the same every time (kv_used = prompt + completion - 1). trio runs
    ready tasks in random order, so a single yield left this to chance (kv_used 7 or 8 across identical turns)."""
    from pantheon.sched.jobs import FinishEvent, TokenEvent

    model = FakeModel()
    model.supports_prefix_rewind = False
    model.snapshot_slot = lambda state, slot: None
    sched = fake_scheduler(model, max_concurrent=1)
    usages = []
    async with trio.open_nursery() as nursery:
        await nursery.start(sched.run)
        for _ in range(24):
            job = fake_job(100)
            events = sched.submit(job)
            seen = 0
            with trio.fail_after(10):
                async for event in events:
                    if isinstance(event, TokenEvent):
                        seen += 1
                        if seen == 3:
                            job.cancel()
                    elif isinstance(event, FinishEvent):
                        usages.append((event.usage.completion_tokens, event.usage.kv_used))
        nursery.cancel_scope.cancel()
    assert usages == [(3, 5 + 3 - 1)] * 24, usages


class CountingModel(FakeModel):
    """FakeModel that counts its forward passes and the decode rows of each."""

    def __init__(self, fail_at: int | None = None) -> None:
        super().__init__()
        self.steps = 0
        self.decode_rows: list[int] = []
        self.fail_at = fail_at

    def forward(self, state: object, rows: list[Any]) -> np.ndarray:
        self.steps += 1
        if self.steps == self.fail_at:
            raise RuntimeError("a kernel failed")
        if all(len(r.tokens) == 1 for r in rows):
            self.decode_rows.append(len(rows))
        return super().forward(state, rows)


def fake_scheduler(model: FakeModel, **limits: int) -> Any:
    from pantheon.sched import scheduler as scheduler_mod

    served = SimpleNamespace(name="fake", model=model, ctx_cap=4096)
    return scheduler_mod.Scheduler(served, max_sessions=1, queue_depth=4, **{"max_concurrent": 4, **limits})


def fake_job(max_tokens: int) -> Any:
    from pantheon.engine.sampling import SamplingParams
    from pantheon.sched.jobs import GenerationJob

    return GenerationJob(prompt=[1, 2, 3, 4, 5], sampling=SamplingParams(temperature=0), max_tokens=max_tokens,
                         stop_ids=frozenset())


async def test_decode_steps_go_on_while_the_event_loop_is_busy() -> None:
    """Decode steps run back to back on the forward thread: they do not wait for the event loop to plan each
    one, and they stop exactly where the turn ends (no step computed past max_tokens)."""
    from pantheon.sched.jobs import FinishEvent, TokenEvent

    model = CountingModel()
    sched = fake_scheduler(model)
    events = sched.submit(fake_job(40))
    async with trio.open_nursery() as nursery:
        await nursery.start(sched.run)
        with trio.fail_after(10):
            assert isinstance(await events.receive(), TokenEvent)  # from the prefill step
            before = model.steps
            time.sleep(0.1)  # blocks the event loop: no task, the scheduler's included, runs meanwhile
            during = model.steps - before
            rest = [event async for event in events]
        nursery.cancel_scope.cancel()
    assert during >= 5, during  # 5 ms steps: a loop-driven scheduler would have made at most one
    tokens = [e for e in rest if isinstance(e, TokenEvent)]
    assert len(tokens) == 39 and isinstance(rest[-1], FinishEvent) and rest[-1].reason == "length"
    assert rest[-1].usage.completion_tokens == 40 and rest[-1].usage.kv_used == 5 + 39
    assert model.steps == 40  # the prefill and 39 decode steps, none wasted


async def test_a_run_drops_the_rows_whose_turn_ended_and_goes_on_with_the_rest() -> None:
    """Two jobs decode together; the shorter one leaves the batch after its last token, the other goes on in
    the same run of steps; both usages are exact."""
    from pantheon.sched.jobs import FinishEvent, TokenEvent

    model = CountingModel()
    sched = fake_scheduler(model)
    short, long = sched.submit(fake_job(3)), sched.submit(fake_job(12))
    async with trio.open_nursery() as nursery:
        await nursery.start(sched.run)
        with trio.fail_after(10):
            got = {name: [event async for event in channel] for name, channel in (("short", short), ("long", long))}
        nursery.cancel_scope.cancel()
    for name, n in (("short", 3), ("long", 12)):
        events = got[name]
        assert sum(isinstance(e, TokenEvent) for e in events) == n and isinstance(events[-1], FinishEvent)
        assert events[-1].usage.completion_tokens == n and events[-1].usage.kv_used == 5 + n - 1
    assert model.decode_rows == [2, 2] + [1] * 9, model.decode_rows


async def test_a_failed_decode_step_fails_its_jobs_and_the_scheduler_goes_on() -> None:
    from pantheon.sched.jobs import ErrorEvent, FinishEvent, TokenEvent

    model = CountingModel(fail_at=4)  # the third decode step of the first job
    sched = fake_scheduler(model)
    events = sched.submit(fake_job(20))
    async with trio.open_nursery() as nursery:
        await nursery.start(sched.run)
        with trio.fail_after(10):
            got = [event async for event in events]
            assert [type(e) for e in got] == [TokenEvent] * 3 + [ErrorEvent], got
            assert (got[-1].error.status, got[-1].error.error_type) == (500, "server_error")
            after = [event async for event in sched.submit(fake_job(4))]
        nursery.cancel_scope.cancel()
    assert sum(isinstance(e, TokenEvent) for e in after) == 4 and isinstance(after[-1], FinishEvent)


class PreparedModel(FakeModel):
    """FakeModel with `prepare_forward`: records, at the end of each step's (slow) preparation, how many steps
    had computed and how many tokens the event loop had received by then."""

    def __init__(self) -> None:
        super().__init__()
        self.computed = 0
        self.received = 0
        self.at_prepare: list[tuple[int, int]] = []

    def prepare_forward(self, state: object, rows: list[Any]) -> Any:
        time.sleep(0.02)  # time enough for the event loop to take anything already handed over
        self.at_prepare.append((self.computed, self.received))

        def compute() -> np.ndarray:
            logits = FakeModel.forward(self, state, rows)
            self.computed += 1
            return logits

        return compute


async def test_a_run_hands_each_step_over_once_the_next_step_is_prepared() -> None:
    """Within a decode run, a step's token reaches the event loop after the next step's inputs are built (as
    its compute starts), never while the forward thread still prepares them; the run's last token and the
    prefill's go out at once."""
    from pantheon.sched.jobs import FinishEvent, TokenEvent

    model = PreparedModel()
    sched = fake_scheduler(model)
    events = sched.submit(fake_job(6))
    got = []
    async with trio.open_nursery() as nursery:
        await nursery.start(sched.run)
        with trio.fail_after(10):
            async for event in events:
                got.append(event)
                model.received += isinstance(event, TokenEvent)
        nursery.cancel_scope.cancel()
    assert sum(isinstance(e, TokenEvent) for e in got) == 6 and isinstance(got[-1], FinishEvent)
    # The prefill step, then the run's first decode step (the prefill's token already out), then every later
    # step prepared with the previous step's token still held back.
    assert [computed - received for computed, received in model.at_prepare] == [0, 0, 1, 1, 1, 1], model.at_prepare


async def _taken_groups(interval_s: float, n_tokens: int) -> list[int]:
    """Decode one job of n_tokens on a 5 ms-a-step model whose consumer takes every token at once (`on_token`);
    the sizes of the groups of tokens that `on_flush` closed, in order. Checks that every token was taken once,
    in order, each group flushed once, and the turn finished."""
    from pantheon.sched.jobs import FinishEvent

    model = CountingModel()
    sched = fake_scheduler(model)
    sched.stream_interval_s = interval_s
    job = fake_job(n_tokens)
    log: list[str] = []
    job.on_token = lambda sampled: log.append("token") or True
    job.on_flush = lambda: log.append("flush")
    events = sched.submit(job)
    async with trio.open_nursery() as nursery:
        await nursery.start(sched.run)
        with trio.fail_after(10):
            rest = [event async for event in events]
        nursery.cancel_scope.cancel()
    assert len(rest) == 1 and isinstance(rest[0], FinishEvent) and rest[0].usage.completion_tokens == n_tokens
    assert log.count("token") == n_tokens and log[-1] == "flush"
    groups = [len(part) for part in "".join("t" if e == "token" else "|" for e in log).split("|")[:-1]]
    assert all(groups), log  # no flush without tokens before it
    return groups


async def test_a_run_hands_its_steps_over_together_at_most_every_stream_interval() -> None:
    """With a stream interval, a decode run hands several steps to the event loop in one wake-up, and the
    consumer flushes once for all of them; the prefill's token and the run's first step still go out alone,
    at once. Without one, every step goes out on its own."""
    assert await _taken_groups(0.0, 30) == [1] * 30
    groups = await _taken_groups(0.05, 30)
    assert groups[:2] == [1, 1] and sum(groups) == 30, groups
    assert max(groups) >= 3 and len(groups) <= 12, groups  # 5 ms steps, 50 ms apart: ~10 steps a group
