"""End to end: sessions over HTTP (spec: the `session_id` request field and "Session routes") — prefix reuse
across turns, key precedence, several conversations under one id, capacity, TTL, watch, export / restore /
release, estimate, and sessions that survive a restart (`--session-dir`).

Every cache claim is proved by `usage.prompt_tokens_details.cached_tokens`, and every resumed turn is
compared with the same request served cold: greedy output must not depend on where the prefix came from.
"""

from __future__ import annotations

import base64
import hashlib
import json
import os
import random
import re
import signal
import socket
import struct
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest

from tests.e2e_util import (
    MODEL,
    Streamer,
    assert_error,
    cached_of,
    chat,
    content_of,
    endless,
    post,
    special_ids,
    start_server,
    streams,
)
from tests.server_process import ServerProcess

pytestmark = pytest.mark.slow

FRANCE = [{"role": "user", "content": "What is the capital of France?"}]
GERMANY = "And what is the capital of Germany?"


def req(messages: list[dict[str, Any]], max_tokens: int = 24, **extra: Any) -> dict[str, Any]:
    return {"messages": messages, "temperature": 0, "max_tokens": max_tokens, **extra}


def follow_up(messages: list[dict[str, Any]], reply: str, question: str = GERMANY) -> list[dict[str, Any]]:
    return [*messages, {"role": "assistant", "content": reply}, {"role": "user", "content": question}]


def export(server: ServerProcess, session_id: str | None, **extra: Any) -> httpx.Response:
    body = {**({"session_id": session_id} if session_id is not None else {}), **extra}
    return httpx.post(server.base_url + "/admin/session/export", json=body, timeout=120)


def restore(server: ServerProcess, body: Any, *, raw: bytes | None = None,
            headers: dict[str, str] | None = None) -> httpx.Response:
    if raw is not None:
        return httpx.post(server.base_url + "/session/restore", content=raw, headers=headers, timeout=120)
    return httpx.post(server.base_url + "/session/restore", json=body, headers=headers, timeout=120)


def release(server: ServerProcess, body: Any, *, headers: dict[str, str] | None = None) -> httpx.Response:
    return httpx.post(server.base_url + "/session/release", json=body, headers=headers, timeout=60)


def exported(server: ServerProcess, session_id: str) -> dict[str, Any]:
    r = export(server, session_id)
    assert r.status_code == 200, r.text
    body = r.json()
    assert set(body) >= {"session_id", "weights_version", "n_tok", "blob_bytes", "blob_b64", "tokens"}, set(body)
    assert body["session_id"] == session_id
    assert body["n_tok"] == len(body["tokens"]) > 0
    assert body["blob_bytes"] == len(base64.b64decode(body["blob_b64"]))
    return body


# -- blob surgery (the format of pantheon/engine/snapshot.py, rebuilt here independently) -------------------

_PREFIX = struct.Struct("<8sII")


def opened(blob: bytes) -> tuple[bytes, int, dict[str, Any], bytes]:
    """A blob's magic, format version, JSON header and payload (tokens then arrays), its checksum dropped."""
    body = blob[:-32]
    magic, version, header_len = _PREFIX.unpack_from(body, 0)
    start = _PREFIX.size + header_len
    return magic, version, json.loads(body[_PREFIX.size:start]), body[start:]


def closed(magic: bytes, version: int, header: dict[str, Any], payload: bytes) -> bytes:
    """The blob of these parts, with a correct checksum (anyone can make one)."""
    header_bytes = json.dumps(header, separators=(",", ":")).encode()
    return sealed(_PREFIX.pack(magic, version, len(header_bytes)) + header_bytes + payload)


def reheader(blob: bytes, edit: Callable[[dict[str, Any]], None]) -> bytes:
    """The same blob with its JSON header changed by `edit`, and a correct checksum."""
    magic, version, header, payload = opened(blob)
    edit(header)
    return closed(magic, version, header, payload)


def sealed(body: bytes) -> bytes:
    """A blob's body with the checksum a restore checks (BLAKE2b-256, unkeyed: anyone can make one)."""
    return body + hashlib.blake2b(body, digest_size=32).digest()


def reweigh(blob: bytes, weights_version: int) -> bytes:
    """The same blob claiming other weights, with a correct checksum."""
    return reheader(blob, lambda header: header.__setitem__("weights_version", weights_version))


def poisoned(blob: bytes, value: float) -> bytes:
    """The same blob with the first value of its first array (a float state) set to `value`, and a correct
    checksum."""
    magic, version, header, payload = opened(blob)
    dtype = np.dtype(header["arrays"][0]["dtype"])
    assert dtype.kind == "f", header["arrays"][0]
    at = 4 * header["n_tokens"]
    payload = payload[:at] + np.array([value], dtype=dtype).tobytes() + payload[at + dtype.itemsize:]
    return closed(magic, version, header, payload)


def widened(blob: bytes, value: float) -> bytes | None:
    """The same float16 state written as float32 (the precision a float32 server exports), with the first value
    of its first array set to `value`, and a correct checksum; None when the blob's state is not float16."""
    magic, version, header, payload = opened(blob)
    if any(np.dtype(spec["dtype"]) != np.float16 for spec in header["arrays"]):
        return None
    at = 4 * header["n_tokens"]
    tokens, arrays = payload[:at], []
    for spec in header["arrays"]:
        count = int(np.prod(spec["shape"]))
        arrays.append(np.frombuffer(payload, np.float16, count, at).astype(np.float32))
        at += 2 * count
        spec["dtype"] = "<f4"
    arrays[0][0] = value
    return closed(magic, version, header, tokens + b"".join(a.tobytes() for a in arrays))


def _first_array(key: str, value: Any) -> Callable[[dict[str, Any]], None]:
    return lambda header: header["arrays"][0].__setitem__(key, value)


def b64(blob: bytes) -> str:
    return base64.b64encode(blob).decode("ascii")


# -- fixtures ----------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def end_ids(default_model_path: Path) -> dict[str, int]:
    return special_ids(default_model_path)


@pytest.fixture(scope="module")
def server(default_model_path: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    s = start_server(default_model_path, tmp_path_factory.mktemp("sessions"), "--max-sessions", "8",
                     "--ctx-cap", "2048")
    yield s
    s.stop()


@pytest.fixture(scope="module")
def cold(server: ServerProcess) -> dict[str, Any]:
    """The France conversation served cold, turn by turn (no session id, `cache_prompt: false`): the reference
    every resumed turn must equal."""
    first = chat(server, req(FRANCE, cache_prompt=False))
    second_messages = follow_up(FRANCE, content_of(first))
    second = chat(server, req(second_messages, cache_prompt=False))
    assert cached_of(first) == cached_of(second) == 0
    return {"first": first, "second": second, "second_messages": second_messages}


def test_a_stateless_conversation_resumes_from_its_last_turn_and_equals_cold(server: ServerProcess,
                                                                              cold: dict[str, Any]) -> None:
    """Without a session id, a client that resends the whole conversation each turn resumes from what its
    previous turn left in a free slot (llama.cpp's `cache_prompt`, on by default), with the same tokens."""
    first = chat(server, req(FRANCE))
    assert content_of(first) == content_of(cold["first"])
    second = chat(server, req(cold["second_messages"]))
    assert cached_of(second) >= first["usage"]["prompt_tokens"], second["usage"]
    assert second["choices"][0]["message"] == cold["second"]["choices"][0]["message"]
    again = chat(server, req(cold["second_messages"], cache_prompt=False))
    assert cached_of(again) == 0
    assert again["choices"][0]["message"] == cold["second"]["choices"][0]["message"]


def test_a_new_session_starts_from_the_prefix_another_session_holds(server: ServerProcess) -> None:
    """opencode's sessions open with the same long system prompt: a new id's first turn copies that prefix from
    another session's slot (the model copies a slot's prefix), with the tokens of a cold turn."""
    system = {"role": "system", "content": " ".join([AGENT_SYSTEM] * 8)}
    a, b = new_id("oc"), new_id("oc")
    first = chat(server, req([system, *FRANCE], session_id=a, cache_prompt=False))
    assert cached_of(first) == 0
    spain = [system, {"role": "user", "content": "What is the capital of Spain?"}]
    warm = chat(server, req(spain, session_id=b))
    assert 2 * cached_of(warm) >= warm["usage"]["prompt_tokens"], warm["usage"]
    assert cached_of(warm) < first["usage"]["prompt_tokens"]
    assert warm["choices"][0]["message"] == chat(server, req(spain, cache_prompt=False))["choices"][0]["message"]
    # The source session is untouched: its next turn resumes its own conversation.
    second = chat(server, req(follow_up([system, *FRANCE], content_of(first)), session_id=a))
    assert cached_of(second) >= first["usage"]["prompt_tokens"], second["usage"]
    for sid in (a, b):
        assert release(server, {"session_id": sid}).status_code == 200


_ids = iter(range(10**6))


def new_id(prefix: str = "s") -> str:
    return f"{prefix}-{next(_ids)}-{random.getrandbits(32):08x}"


# -- prefix reuse --------------------------------------------------------------------------------------------

def test_second_turn_reuses_the_first_and_equals_cold(server: ServerProcess, cold: dict[str, Any]) -> None:
    sid = new_id()
    first = chat(server, req(FRANCE, session_id=sid, cache_prompt=False))  # cold: nothing copied from others
    assert cached_of(first) == 0
    assert content_of(first) == content_of(cold["first"])
    second = chat(server, req(cold["second_messages"], session_id=sid))
    # Covers the whole first turn: its prompt and the reply it generated.
    assert cached_of(second) >= first["usage"]["prompt_tokens"], (first["usage"], second["usage"])
    assert cached_of(second) == first["usage"]["kv_used"], (first["usage"], second["usage"])
    assert cached_of(second) < second["usage"]["prompt_tokens"]
    assert content_of(second) == content_of(cold["second"])
    assert "session_conflict" not in second["usage"]
    assert release(server, {"session_id": sid}).status_code == 200


def test_resending_turn_one_starts_from_a_copy_and_keeps_both_conversations(server: ServerProcess,
                                                                             cold: dict[str, Any]) -> None:
    """Turn 1, turn 2, then turn 1 again under the same id: the re-send is a second conversation that starts
    from a copy of the prefix it shares with the first (cached, and the same greedy answer as cold), later
    re-sends resume it, and turn 2 still resumes the first conversation."""
    sid = new_id()
    first = chat(server, req(FRANCE, session_id=sid))
    second = chat(server, req(cold["second_messages"], session_id=sid))
    for _ in range(2):
        again = chat(server, req(FRANCE, session_id=sid))
        assert content_of(again) == content_of(cold["first"])
        assert cached_of(again) == first["usage"]["prompt_tokens"] - 1, again["usage"]  # all but one token
        assert "session_conflict" not in again["usage"]
    resumed = chat(server, req(cold["second_messages"], session_id=sid))
    assert cached_of(resumed) == second["usage"]["prompt_tokens"] - 1, resumed["usage"]
    assert content_of(resumed) == content_of(cold["second"])
    assert release(server, {"session_id": sid}).status_code == 200


KEYS = ["session_id", "prompt_cache_key", "promptCacheKey", "header"]


def keyed(body: dict[str, Any], keys: dict[str, str]) -> tuple[dict[str, Any], dict[str, str]]:
    body = dict(body)
    headers = {}
    for key, value in keys.items():
        if key == "header":
            headers["X-Session-Id"] = value
        else:
            body[key] = value
    return body, headers


@pytest.mark.parametrize("winner,loser", [(KEYS[i], KEYS[i + 1]) for i in range(3)], ids=lambda k: k)
def test_session_key_precedence(server: ServerProcess, winner: str, loser: str) -> None:
    """Order: session_id, prompt_cache_key, promptCacheKey, then X-Session-Id (each adjacent pair here; the
    test below sends all four). The key that wins is the one whose session the turn resumes."""
    # cache_prompt false: a new id starts cold instead of copying the probe's prefix from another session's slot,
    # and a live id still resumes its own conversation.
    probe = req(FRANCE, max_tokens=2, cache_prompt=False)
    seeded, fresh1, fresh2 = new_id("seed"), new_id("fresh"), new_id("fresh")
    assert cached_of(chat(server, {**probe, "session_id": seeded})) == 0
    # The winner names the seeded session, the loser a fresh one: the turn resumes (winner used).
    body, headers = keyed(probe, {winner: seeded, loser: fresh1})
    assert cached_of(chat(server, body, headers=headers)) > 0, f"{loser} won over {winner}"
    # The loser names the seeded session, the winner a fresh one: the turn is cold (loser ignored).
    body, headers = keyed(probe, {winner: fresh2, loser: seeded})
    assert cached_of(chat(server, body, headers=headers)) == 0, f"{loser} won over {winner}"
    for sid in (seeded, fresh1, fresh2):
        assert release(server, {"session_id": sid}).status_code == 200


def test_all_four_keys_session_id_wins(server: ServerProcess) -> None:
    probe = req(FRANCE, max_tokens=2)
    seeded, others = new_id("seed"), [new_id("fresh") for _ in range(3)]
    chat(server, {**probe, "session_id": seeded})
    body, headers = keyed(probe, dict(zip(KEYS, [seeded, *others])))
    assert cached_of(chat(server, body, headers=headers)) > 0
    for sid in (seeded, *others):
        release(server, {"session_id": sid})


# -- several conversations under one id ----------------------------------------------------------------------

AGENT_SYSTEM = ("You are opencode, an interactive CLI coding agent. Answer briefly and precisely. "
                "Use the tools you are given when you need to read or change files.")
TITLE_SYSTEM = "You are a title generator. You output ONLY a thread title of at most six words."


def _two_conversations(server: ServerProcess, main1: list[dict[str, Any]], title1: list[dict[str, Any]],
                       concurrent: bool) -> None:
    sid = new_id("oc")
    results: dict[str, dict[str, Any]] = {}
    if concurrent:  # opencode sends its title request in parallel with the first main turn
        threads = [threading.Thread(target=lambda k=k, m=m: results.__setitem__(k, chat(
            server, req(m, 16), headers={"X-Session-Id": sid}))) for k, m in (("main", main1), ("title", title1))]
        for t in threads:
            t.start()
        for t in threads:
            t.join(300)
    else:
        results["main"] = chat(server, req(main1, 16), headers={"X-Session-Id": sid})
        results["title"] = chat(server, req(title1, 16), headers={"X-Session-Id": sid})
    assert set(results) == {"main", "title"}
    main2 = follow_up(main1, content_of(results["main"]))
    title2 = follow_up(title1, content_of(results["title"]), "Make it shorter.")
    # Interleaved: main, title, main again.
    m2 = chat(server, req(main2, 16), headers={"X-Session-Id": sid})
    t2 = chat(server, req(title2, 16), headers={"X-Session-Id": sid})
    main3 = follow_up(main2, content_of(m2), "And of Italy?")
    m3 = chat(server, req(main3, 16), headers={"X-Session-Id": sid})
    for name, turn, prev in (("main", m2, results["main"]), ("title", t2, results["title"]), ("main", m3, m2)):
        assert cached_of(turn) >= prev["usage"]["prompt_tokens"], (name, prev["usage"], turn["usage"])
        assert "session_conflict" not in turn["usage"], (name, turn["usage"])
    for messages, turn in ((main2, m2), (title2, t2), (main3, m3)):
        assert content_of(turn) == content_of(chat(server, req(messages, 16)))
    assert release(server, {"session_id": sid}).status_code == 200


def test_title_and_main_conversations_under_one_id_each_resume(server: ServerProcess) -> None:
    main1 = [{"role": "system", "content": AGENT_SYSTEM}, *FRANCE]
    title1 = [{"role": "system", "content": TITLE_SYSTEM},
              {"role": "user", "content": "Generate a title for this conversation:"}, *FRANCE]
    _two_conversations(server, main1, title1, concurrent=True)


def test_two_conversations_sharing_the_default_system_prompt_each_resume(server: ServerProcess) -> None:
    """No system message: the template's default system prompt is a prefix both conversations share. That
    does not make the title prompt a continuation of the main conversation."""
    title1 = [{"role": "user", "content": "Generate a title for this conversation:"}, *FRANCE]
    _two_conversations(server, FRANCE, title1, concurrent=False)


# -- capacity, release, TTL ----------------------------------------------------------------------------------

def test_session_capacity_and_release(default_model_path: Path, tmp_path: Path) -> None:
    s = start_server(default_model_path, tmp_path, "--max-sessions", "1")
    try:
        # cache_prompt false: a new (or released) id starts cold rather than from a copy of a stateless turn's
        # prefix; a live id resumes its own conversation all the same.
        probe = req(FRANCE, max_tokens=2, cache_prompt=False)
        chat(s, {**probe, "session_id": "A"})
        r = post(s, {**probe, "session_id": "B"})
        error = assert_error(r, 429, "model_at_session_capacity")
        assert r.headers.get("retry-after") == "30", dict(r.headers)
        assert re.search(r"prefill", error["message"], re.I) and re.search(r"\d+(\.\d+)?\s*s\b", error["message"]), \
            error["message"]
        # Over capacity too: the header key and a restore into a new id.
        assert_error(post(s, probe, headers={"X-Session-Id": "B"}), 429, "model_at_session_capacity")
        blob = exported(s, "A")
        assert_error(restore(s, {"session_id": "B", "blob": blob["blob_b64"], "tokens": blob["tokens"]}), 429,
                     "model_at_session_capacity")
        # The live id and stateless requests are still served.
        assert cached_of(chat(s, {**probe, "session_id": "A"})) > 0
        chat(s, probe)
        # Release: unknown ids and repeats are fine (idempotent); the body shape is the spec's.
        for sid in ("B", "never-seen", "A", "A"):
            r = release(s, {"session_id": sid})
            assert r.status_code == 200, r.text
            assert r.json() == {"released": True, "session_id": sid}
        assert chat(s, {**probe, "session_id": "B"})["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
        # Release through the header, then a third id fits.
        r = release(s, {"session_id": ""}, headers={"X-Session-Id": "B"})  # an empty body id is an absent one
        assert r.status_code == 200 and r.json()["session_id"] == "B", r.text
        chat(s, {**probe, "session_id": "C"})
        # The released A starts cold again.
        release(s, {"session_id": "C"})
        assert cached_of(chat(s, {**probe, "session_id": "A"})) == 0
        # Errors.
        assert_error(release(s, {}), 400, "invalid_request_error")
        r = httpx.post(s.base_url + "/session/release", content=b"{not json", timeout=30)
        assert_error(r, 400, "invalid_request_error")
        assert_error(release(s, {"session_id": "A", "name": "no-such-model"}), 404, "model_not_found")
    finally:
        s.stop()


def test_idle_sessions_are_reaped_after_the_ttl(default_model_path: Path, tmp_path: Path) -> None:
    s = start_server(default_model_path, tmp_path, "--max-sessions", "1",
                     env={"PN_SESSION_IDLE_TTL_MS": "1000"})
    try:
        probe = req(FRANCE, max_tokens=2, cache_prompt=False)  # see test_session_capacity_and_release
        assert cached_of(chat(s, {**probe, "session_id": "old"})) == 0
        assert cached_of(chat(s, {**probe, "session_id": "old"})) > 0  # within the TTL: resumes
        time.sleep(2.5)
        # The old id expired: a new id is accepted under --max-sessions 1.
        assert cached_of(chat(s, {**probe, "session_id": "new"})) == 0
        time.sleep(2.5)
        assert_error(export(s, "old"), 404, "session_not_found")
        # The old id's next turn starts cold.
        assert cached_of(chat(s, {**probe, "session_id": "old"})) == 0
    finally:
        s.stop()


# -- export / restore ----------------------------------------------------------------------------------------

def test_export_release_restore_continue_equals_uninterrupted(server: ServerProcess, cold: dict[str, Any]) -> None:
    straight, moved = new_id("straight"), new_id("moved")
    # Uninterrupted.
    s1 = chat(server, req(FRANCE, session_id=straight))
    s2 = chat(server, req(cold["second_messages"], session_id=straight))
    # Interrupted: export, release, restore, continue.
    m1 = chat(server, req(FRANCE, session_id=moved))
    assert content_of(m1) == content_of(s1)
    snap = exported(server, moved)
    assert snap["n_tok"] == m1["usage"]["kv_used"]
    r = release(server, {"session_id": moved})
    assert r.status_code == 200
    assert_error(export(server, moved), 404, "session_not_found")
    r = restore(server, {"session_id": moved, "blob": snap["blob_b64"], "tokens": snap["tokens"]})
    assert r.status_code == 200, r.text
    assert r.json() == {"restored": True, "session_id": moved, "n_tok": snap["n_tok"]}
    # The restored state is bit for bit the exported one.
    again = exported(server, moved)
    assert again["tokens"] == snap["tokens"] and again["blob_b64"] == snap["blob_b64"]
    m2 = chat(server, req(cold["second_messages"], session_id=moved))
    assert cached_of(m2) == snap["n_tok"], (m2["usage"], snap["n_tok"])
    assert cached_of(m2) == cached_of(s2)
    assert content_of(m2) == content_of(s2) == content_of(cold["second"])
    for sid in (straight, moved):
        release(server, {"session_id": sid})


def test_restore_through_the_header_into_a_new_id(server: ServerProcess, cold: dict[str, Any]) -> None:
    src, dst = new_id("src"), new_id("dst")
    chat(server, req(FRANCE, session_id=src))
    snap = exported(server, src)
    # Wrapped at 76 columns, as the `base64` tool writes it: the line breaks are not part of the blob.
    wrapped = "\n".join(snap["blob_b64"][i:i + 76] for i in range(0, len(snap["blob_b64"]), 76))
    r = restore(server, {"blob": wrapped, "tokens": snap["tokens"]}, headers={"X-Session-Id": dst})
    assert r.status_code == 200, r.text
    assert r.json()["session_id"] == dst
    turn = chat(server, req(cold["second_messages"], session_id=dst))
    assert cached_of(turn) == snap["n_tok"]
    assert content_of(turn) == content_of(cold["second"])
    for sid in (src, dst):
        release(server, {"session_id": sid})


def _rejections(snap: dict[str, Any]) -> list[tuple[str, dict[str, Any] | bytes, int, str]]:
    """(label, request body or raw bytes, status, type) for every kind of bad restore."""
    blob = base64.b64decode(snap["blob_b64"])
    tokens = snap["tokens"]
    good = {"blob": snap["blob_b64"], "tokens": tokens}
    cases: list[tuple[str, dict[str, Any] | bytes, int, str]] = [
        ("not-base64", {**good, "blob": "this is not base64!!"}, 400, "bad_session_blob"),
        ("base64-garbage", {**good, "blob": b64(b"\x00" * 1000)}, 400, "bad_session_blob"),
        ("empty-blob", {**good, "blob": ""}, 400, "bad_session_blob"),
        ("wrong-token", {**good, "tokens": [*tokens[:-1], (tokens[-1] + 1) % 1000]}, 400, "bad_session_blob"),
        ("tokens-shorter", {**good, "tokens": tokens[:-1]}, 400, "bad_session_blob"),
        ("tokens-longer", {**good, "tokens": [*tokens, tokens[-1]]}, 400, "bad_session_blob"),
        ("tokens-empty", {**good, "tokens": []}, 400, "bad_session_blob"),
        ("other-weights", {**good, "blob": b64(reweigh(blob, snap["weights_version"] ^ 1))}, 409,
         "weights_version_mismatch"),
        ("missing-blob", {"tokens": tokens}, 400, "invalid_request_error"),
        ("missing-tokens", {"blob": snap["blob_b64"]}, 400, "invalid_request_error"),
        ("empty-object", {}, 400, "invalid_request_error"),
        ("malformed-json", b'{"blob": ', 400, "invalid_request_error"),
        ("empty-body", b"", 400, "invalid_request_error"),
        ("not-an-object", b"[1, 2, 3]", 400, "invalid_request_error"),
    ]
    # Headers forged with a valid checksum: the checksum proves nothing about who wrote the blob.
    forged = {"object-dtype": _first_array("dtype", "|O"), "void-dtype": _first_array("dtype", "|V0"),
              "huge-shape": _first_array("shape", [2**40, 2**40, 2**40]), "overflow-shape": _first_array(
                  "shape", [2**62, 4]), "float-shape": _first_array("shape", [1.5]),
              "arrays-not-a-list": lambda header: header.__setitem__("arrays", 5),
              "array-not-an-object": lambda header: header.__setitem__("arrays", [7]),
              "checkpoint-past-the-end": lambda header: header.__setitem__("checkpoints", [10**9]),
              "checkpoints-not-a-list": lambda header: header.__setitem__("checkpoints", 3),
              "checkpoint-without-its-arrays": lambda header: header.__setitem__("checkpoints", [1]),
              "anchor-negative": lambda header: header.__setitem__("anchor", -1),
              "anchor-not-an-integer": lambda header: header.__setitem__("anchor", "5")}
    for label, edit in forged.items():
        cases.append((f"forged-{label}", {**good, "blob": b64(reheader(blob, edit))}, 400, "bad_session_blob"))
    # A state value made NaN or inf (its turns would sample from NaN logits, and fail the rows batched with them).
    for value in (float("nan"), float("inf"), float("-inf")):
        cases.append((f"forged-state-{value}", {**good, "blob": b64(poisoned(blob, value))}, 400, "bad_session_blob"))
    # Finite as float32, but past float16's range: the float16 state it is converted into would hold an inf.
    if (past_float16 := widened(blob, 1e6)) is not None:
        cases.append(("forged-state-past-float16", {**good, "blob": b64(past_float16)}, 400, "bad_session_blob"))
    for cut in (0, 10, 16, len(blob) // 2, len(blob) - 33, len(blob) - 1):
        cases.append((f"truncated-{cut}", {**good, "blob": b64(blob[:cut])}, 400, "bad_session_blob"))
    rng = random.Random(1234)
    positions = [0, 8, 12, 20, len(blob) - 1, len(blob) - 32] + [rng.randrange(len(blob)) for _ in range(24)]
    for pos in positions:
        flipped = bytearray(blob)
        flipped[pos] ^= 1 << rng.randrange(8)
        cases.append((f"bitflip-{pos}", {**good, "blob": b64(bytes(flipped))}, 400, "bad_session_blob"))
    return cases


def test_every_rejected_restore_leaves_the_server_and_the_session_unchanged(server: ServerProcess,
                                                                           cold: dict[str, Any]) -> None:
    live, fresh = new_id("live"), new_id("fresh")
    chat(server, req(FRANCE, session_id=live))
    snap = exported(server, live)
    failures = []
    cases = _rejections(snap)
    for i, (label, body, status, error_type) in enumerate(cases):
        # Every case into the live session; every third one into a new id as well.
        for target in (live, fresh) if i % 3 == 0 else (live,):
            if isinstance(body, bytes):
                r = restore(server, None, raw=body, headers={"X-Session-Id": target})
            else:
                r = restore(server, {**body, "session_id": target})
            got = (r.status_code, r.json().get("error", {}).get("type") if r.status_code != 200 else "restored")
            if got != (status, error_type):
                failures.append((label, "live" if target == live else "new id", got, r.text[:200]))
        if i % 6 == 5 or i == len(cases) - 1:
            # The live session is untouched, the new id was not created, the server still serves.
            after = exported(server, live)
            assert after["tokens"] == snap["tokens"] and after["blob_b64"] == snap["blob_b64"], label
            assert export(server, fresh).status_code == 404, label
            assert chat(server, req(FRANCE, max_tokens=2))["choices"][0]["message"]["content"]
    assert not failures, failures
    # And the session still resumes as if nothing happened.
    turn = chat(server, req(cold["second_messages"], session_id=live))
    assert cached_of(turn) == snap["n_tok"]
    assert content_of(turn) == content_of(cold["second"])
    release(server, {"session_id": live})


def test_blob_from_other_weights_is_409(tmp_path: Path) -> None:
    """Two models of the same geometry with different weights (random tiny llamas, seeds 0 and 1): a blob
    exported from one is refused by the other with 409 weights_version_mismatch, and accepted by itself.

    weights_version hashes the tensor table, each tensor's first and last 64 bytes and one 64-byte sample per
    MiB (pantheon/engine/loader.py); it does not read whole tensors, so a single edited byte elsewhere inside
    a tensor is not detected (docs/ARCHITECTURE.md)."""
    from tests.tiny_models import write_tiny_llama

    mine = write_tiny_llama(tmp_path / "mine.gguf", seed=0)
    theirs = write_tiny_llama(tmp_path / "theirs.gguf", seed=1)
    env = {"PANTHEON_HOME": str(tmp_path / "home")}
    a = start_server(mine, tmp_path / "log-a", "--max-sessions", "2", env=env)
    b = start_server(theirs, tmp_path / "log-b", "--max-sessions", "2", env=env)
    try:
        sid = new_id("other")
        chat(b, req(FRANCE, max_tokens=4, session_id=sid))
        snap = exported(b, sid)
        r = restore(a, {"session_id": sid, "blob": snap["blob_b64"], "tokens": snap["tokens"]})
        assert_error(r, 409, "weights_version_mismatch")
        chat(a, req(FRANCE, max_tokens=4, session_id=sid))
        own = exported(a, sid)
        release(a, {"session_id": sid})
        r = restore(a, {"session_id": sid, "blob": own["blob_b64"], "tokens": own["tokens"]})
        assert r.status_code == 200, r.text
    finally:
        a.stop()
        b.stop()


def test_blob_restores_across_kv_precisions(tmp_path: Path) -> None:
    """The same weights served with a float32 KV cache (PANTHEON_CPU_INT8=0) and a float16 one (the default):
    a blob exported from either restores into the other, converted to its precision, and the session goes on
    from the restored tokens."""
    from tests.tiny_models import write_tiny_llama

    model = write_tiny_llama(tmp_path / "tiny.gguf", seed=0)
    home = {"PANTHEON_HOME": str(tmp_path / "home")}
    f32 = start_server(model, tmp_path / "log-f32", "--max-sessions", "2", env={**home, "PANTHEON_CPU_INT8": "0"})
    f16 = start_server(model, tmp_path / "log-f16", "--max-sessions", "2", env=home)
    try:
        for source, target in ((f32, f16), (f16, f32)):
            sid = new_id("precision")
            chat(source, req(FRANCE, max_tokens=4, session_id=sid))
            snap = exported(source, sid)
            r = restore(target, {"session_id": sid, "blob": snap["blob_b64"], "tokens": snap["tokens"]})
            assert r.status_code == 200, r.text
            again = exported(target, sid)
            assert again["tokens"] == snap["tokens"] and again["blob_b64"] != snap["blob_b64"]  # converted
            turn = chat(target, req(FRANCE, max_tokens=4, session_id=sid))
            assert cached_of(turn) > 0
            release(target, {"session_id": sid})
    finally:
        f32.stop()
        f16.stop()


def test_a_session_past_the_body_limit_of_other_routes_restores(tmp_path: Path) -> None:
    """A long session's export is larger than the 64 MiB other routes accept (here ~70 MB of float32 KV, ~94 MB
    as base64): its restore is taken all the same (the limit of /session/restore follows the largest blob a
    loaded model can export), and the session goes on from it."""
    from pantheon.http.asgi import MAX_BODY_BYTES
    from tests.tiny_models import write_tiny_llama

    # 16 layers x 4 kv heads x 128 dims x (k, v) x 4 bytes: 64 KiB of float32 cache a token.
    model = write_tiny_llama(tmp_path / "wide.gguf", n_layers=16, d=512, heads=4, kv_heads=4, ffn=64, ctx=2048,
                             qtype=gguf_f16())
    server = start_server(model, tmp_path / "log", "--max-sessions", "1", "--ctx-cap", "2048",
                          env={"PANTHEON_HOME": str(tmp_path / "home"), "PANTHEON_CPU_INT8": "0"})
    try:
        sid = new_id("long")
        long_prompt = [{"role": "user", "content": " ".join(f"w{i % 97}" for i in range(400))}]
        first = chat(server, req(long_prompt, max_tokens=2, session_id=sid))
        snap = exported(server, sid)
        body = json.dumps({"session_id": sid, "blob": snap["blob_b64"], "tokens": snap["tokens"]}).encode()
        assert len(body) > MAX_BODY_BYTES, (len(body), first["usage"])
        assert release(server, {"session_id": sid}).status_code == 200
        r = restore(server, None, raw=body, headers={"content-type": "application/json"})
        assert r.status_code == 200, r.text[:300]
        turn = chat(server, req(follow_up(long_prompt, content_of(first), "Go on."), max_tokens=2, session_id=sid))
        assert cached_of(turn) == snap["n_tok"]
    finally:
        server.stop()


def gguf_f16() -> Any:
    import gguf

    return gguf.GGMLQuantizationType.F16


def test_export_errors(server: ServerProcess, end_ids: dict[str, int]) -> None:
    assert_error(export(server, "no-such-session"), 404, "session_not_found")
    assert_error(export(server, None), 400, "invalid_request_error")
    # Export reads the body only: the header does not name a session here.
    sid = new_id("hdr")
    chat(server, req(FRANCE, max_tokens=2, session_id=sid))
    r = httpx.post(server.base_url + "/admin/session/export", json={}, headers={"X-Session-Id": sid}, timeout=60)
    assert_error(r, 400, "invalid_request_error")
    r = httpx.post(server.base_url + "/admin/session/export", content=b"", timeout=60)
    assert_error(r, 400, "invalid_request_error")
    assert_error(export(server, sid, name="no-such-model"), 404, "model_not_found")
    # A turn in flight on the session: 429 session_busy, then fine once it is over.
    s = Streamer(server, {**endless(end_ids, 4000), "session_id": sid}).start()
    with streams(s):
        s.wait_token()
        assert_error(export(server, sid), 429, "session_busy")
    deadline = time.monotonic() + 30
    while export(server, sid).status_code == 429 and time.monotonic() < deadline:
        time.sleep(0.2)
    exported(server, sid)
    release(server, {"session_id": sid})
    # The same during a session's first turn (it has no tokens yet, but it is not unknown).
    s = Streamer(server, {**endless(end_ids, 4000), "session_id": sid + "-first"}).start()
    with streams(s):
        s.wait_token()
        assert_error(export(server, sid + "-first"), 429, "session_busy")


# -- estimate ------------------------------------------------------------------------------------------------

def estimate(server: ServerProcess, query: str) -> httpx.Response:
    return httpx.get(server.base_url + "/session/estimate?" + query, timeout=30)


def test_estimate_arithmetic(server: ServerProcess) -> None:
    r = estimate(server, "tokens=4096")
    assert r.status_code == 200, r.text
    e = r.json()
    assert set(e) == {"model", "tokens", "prefill_tok_per_s", "cold_reprefill_s", "warm_restore_s",
                      "blob_bytes_est"}, e
    assert e["model"] == MODEL and e["tokens"] == 4096
    assert e["blob_bytes_est"] == 4096 * 16384
    assert e["warm_restore_s"] == pytest.approx(4096 * 16384 / 12.5e6, abs=1e-3)
    assert e["prefill_tok_per_s"] > 0
    # The response rounds: seconds to 3 decimals, the rate to 2.
    assert e["cold_reprefill_s"] == pytest.approx(4096 / e["prefill_tok_per_s"], rel=1e-3, abs=1e-3)

    e = estimate(server, f"tokens=100&name={MODEL}&blob_bytes=5000000&upload_bps=2000000").json()
    assert e["model"] == MODEL and e["blob_bytes_est"] == 5_000_000
    assert e["warm_restore_s"] == pytest.approx(2.5, abs=1e-3)
    assert e["cold_reprefill_s"] == pytest.approx(100 / e["prefill_tok_per_s"], rel=1e-3, abs=1e-3)
    e = estimate(server, "tokens=1000&upload_bps=1000000").json()
    assert e["warm_restore_s"] == pytest.approx(1000 * 16384 / 1e6, abs=1e-3)
    e = estimate(server, "tokens=1000000000000000&blob_bytes=1e15&upload_bps=1").json()  # every bound at once
    assert e["warm_restore_s"] == 1e15 and e["blob_bytes_est"] == 10**15
    assert estimate(server, "tokens=" + "0" * 5000 + "7").json()["tokens"] == 7  # leading zeros are no digits

    r = estimate(server, "tokens=10&name=no-such-model")
    assert r.status_code == 200, r.text
    assert r.json()["model"] == ""
    for query in ("", "tokens=0", "tokens=-3", "name=" + MODEL, "tokens=abc", "tokens=99999999999999999999999",
                  "tokens=" + "9" * 4301, "tokens=1" + "0" * 5000,  # past int()'s 4300 digits: still a 400
                  "tokens=100&blob_bytes=1e300", "tokens=100&blob_bytes=inf", "tokens=100&upload_bps=nan",
                  "tokens=100&upload_bps=inf", "tokens=1_000", "tokens=%2B7", "tokens=%2010", "tokens=1.5",
                  # an upload rate under a byte a second: the restore's seconds past a float (inf, JSON null)
                  "tokens=1000000000000000&blob_bytes=1e15&upload_bps=1e-300", "tokens=100&upload_bps=0.5"):
        assert_error(estimate(server, query), 400, "invalid_request_error")


# -- watch ---------------------------------------------------------------------------------------------------

class Watch:
    """A raw `GET /session/watch` connection: open reads the headers and the first comment; close hangs up."""

    def __init__(self, server: ServerProcess, query: str, headers: str = "") -> None:
        self.sock = socket.create_connection(("127.0.0.1", server.port), timeout=30)
        self.sock.sendall(f"GET /session/watch?{query} HTTP/1.1\r\nHost: x\r\n{headers}\r\n".encode())
        data = b""
        while True:
            if b"\r\n\r\n" in data and data.startswith(b"HTTP/1.1 200") and b"watch established" in data:
                break  # held open: read only what the server sent first
            chunk = self.sock.recv(65536)
            if not chunk:
                break  # an error response: the server closes after it
            data += chunk
        self.head, _, self.body = data.partition(b"\r\n\r\n")
        self.status = int(self.head.split(b" ", 2)[1])

    def close(self) -> None:
        self.sock.close()


def _body_text(chunked: bytes) -> bytes:
    """The first chunk's data of a chunked body (or the body itself)."""
    first, _, rest = chunked.partition(b"\r\n")
    try:
        int(first, 16)
        return rest
    except ValueError:
        return chunked


def test_watch_holds_a_session_and_releases_it_after_the_grace(default_model_path: Path, tmp_path: Path) -> None:
    # TTL 3 s, grace 0.8 s: a release within ~2 s of closing the watch is the grace, not the TTL.
    s = start_server(default_model_path, tmp_path, env={"PN_SESSION_IDLE_TTL_MS": "3000",
                                                        "PN_SESSION_WATCH_GRACE_MS": "800"})
    try:
        probe = req(FRANCE, max_tokens=2)
        chat(s, {**probe, "session_id": "w"})
        w = Watch(s, "session_id=w")
        assert w.status == 200, w.head
        assert b"text/event-stream" in w.head.lower(), w.head
        assert _body_text(w.body).startswith(b": watch established"), w.body
        time.sleep(4.5)  # past the TTL, held
        exported(s, "w")
        w.close()
        time.sleep(0.2)
        exported(s, "w")  # within the grace
        time.sleep(1.8)
        assert_error(export(s, "w"), 404, "session_not_found")

        # A new watch arriving within the grace keeps the session.
        chat(s, {**probe, "session_id": "w"})
        w1 = Watch(s, "session_id=w")
        assert w1.status == 200
        w1.close()
        time.sleep(0.2)
        w2 = Watch(s, "", headers="X-Session-Id: w\r\n")  # the header names the session too
        assert w2.status == 200, w2.head
        time.sleep(4.0)  # past the first grace and past the TTL
        exported(s, "w")
        assert cached_of(chat(s, {**probe, "session_id": "w"})) > 0
        w2.close()
        time.sleep(2.0)
        assert_error(export(s, "w"), 404, "session_not_found")

        for query, status, error_type in (("", 400, "invalid_request_error"),
                                          ("session_id=w&name=no-such-model", 404, "model_not_found")):
            w = Watch(s, query)
            body = _body_text(w.body)
            w.close()
            assert w.status == status, w.head
            assert json.loads(body[: body.rindex(b"}") + 1])["error"]["type"] == error_type, body
    finally:
        s.stop()


def test_a_grace_that_ends_during_a_turn_releases_the_session_after_it(default_model_path: Path,
                                                                       tmp_path: Path) -> None:
    """The grace is up while a turn of the session runs: the session goes once the turn has ended (it stayed
    until the idle timeout, 12 h by default)."""
    s = start_server(default_model_path, tmp_path, env={"PN_SESSION_WATCH_GRACE_MS": "300"})
    try:
        chat(s, req(FRANCE, max_tokens=2, session_id="g"))
        w = Watch(s, "session_id=g")
        assert w.status == 200, w.head
        w.close()
        began = time.monotonic()
        # Every end token forbidden: hundreds of tokens (until the repetition detector ends it, ~300), well past
        # the grace on any machine these tests run on.
        body = chat(s, req([{"role": "user", "content": "Tell me a long story."}], max_tokens=400, session_id="g",
                           logit_bias={str(t): -100 for t in (0, 1, 2)}))
        took = time.monotonic() - began
        assert took > 0.6, (body["usage"], took)
        time.sleep(1.0)
        assert_error(export(s, "g"), 404, "session_not_found")  # it went right after the turn
    finally:
        s.stop()


def test_a_watch_ends_when_its_model_is_unloaded(default_model_path: Path, tmp_path: Path) -> None:
    """The session a watch holds goes with its model: the watch stream says so and ends, instead of hanging."""
    s = start_server(default_model_path, tmp_path)
    try:
        chat(s, req(FRANCE, max_tokens=2, session_id="u"))
        w = Watch(s, "session_id=u")
        assert w.status == 200, w.head
        r = httpx.post(s.base_url + "/admin/models/unload", json={"name": MODEL}, timeout=120)
        assert r.status_code == 200, r.text
        w.sock.settimeout(10)
        rest = b""
        while chunk := w.sock.recv(65536):  # the server ends the response (and closes): no timeout here
            rest += chunk
        w.close()
        assert b"model unloaded" in rest and rest.endswith(b"0\r\n\r\n"), rest
        assert httpx.get(s.base_url + "/", timeout=10).status_code == 200  # and the server is fine
    finally:
        s.stop()


def test_a_watch_ends_properly_when_the_server_stops(default_model_path: Path, tmp_path: Path) -> None:
    """At shutdown (after the drain) an open watch gets a last comment and the end of its response, so that a
    client can tell a stopping server from a network fault."""
    s = start_server(default_model_path, tmp_path)
    try:
        chat(s, req(FRANCE, max_tokens=2, session_id="v"))
        w = Watch(s, "session_id=v")
        assert w.status == 200, w.head
        s.signal(signal.SIGTERM)
        w.sock.settimeout(20)
        rest = b""
        while chunk := w.sock.recv(65536):
            rest += chunk
        w.close()
        assert b"server shutting down" in rest and rest.endswith(b"0\r\n\r\n"), rest
        assert s.wait(30) == 0
    finally:
        s.stop()


# -- restart with --session-dir ------------------------------------------------------------------------------

def test_sessions_survive_a_restart(default_model_path: Path, tmp_path: Path) -> None:
    session_dir = tmp_path / "sessions"
    first_server = start_server(default_model_path, tmp_path / "one", "--session-dir", str(session_dir))
    try:
        first = chat(first_server, req(FRANCE, session_id="kept"))
        first_server.signal(signal.SIGTERM)
        assert first_server.wait(120) == 0, first_server.log_tail()
    finally:
        first_server.stop()
    saved = list(session_dir.rglob("*.pnsess"))
    assert len(saved) == 1, list(session_dir.rglob("*"))
    # Next to it: a corrupt file, a file whose name is no session id, a blob from other weights, and entries
    # under session ids that are no regular file (a folder, a dangling link, a FIFO, whose read would wait).
    folder = saved[0].parent
    blob = saved[0].read_bytes()

    def named(session_id: bytes) -> Path:
        return folder / (base64.urlsafe_b64encode(session_id).decode() + ".pnsess")

    corrupt = named(b"corrupt")
    corrupt.write_bytes(blob[: len(blob) // 3])
    badname = folder / "!!!.pnsess"
    badname.write_bytes(blob)
    weights_version = json.loads(blob[16:16 + struct.unpack_from("<I", blob, 12)[0]])["weights_version"]
    other = named(b"other-weights")
    other.write_bytes(reweigh(blob, weights_version ^ 1))
    named(b"a-folder").mkdir()
    named(b"a-link").symlink_to(folder / "nowhere")
    os.mkfifo(named(b"a-fifo"))
    odd = [named(n).name for n in (b"a-folder", b"a-link", b"a-fifo", b"other-weights")]

    second_server = start_server(default_model_path, tmp_path / "two", "--session-dir", str(session_dir))
    try:
        second_messages = follow_up(FRANCE, content_of(first))
        resumed = chat(second_server, req(second_messages, session_id="kept"))
        assert cached_of(resumed) == first["usage"]["kv_used"], (first["usage"], resumed["usage"])
        # Equal to the uninterrupted run (on this server, under another id) and to cold.
        chat(second_server, req(FRANCE, session_id="straight"))
        straight = chat(second_server, req(second_messages, session_id="straight"))
        assert cached_of(straight) == cached_of(resumed)
        assert content_of(resumed) == content_of(straight) == content_of(chat(second_server, req(second_messages)))
        for name in ("corrupt", "other-weights", "a-folder", "a-link", "a-fifo"):
            assert_error(export(second_server, name), 404, "session_not_found")
        files = sorted(p.name for p in folder.iterdir())
        assert not corrupt.exists() and corrupt.with_name(corrupt.name + ".rejected").exists(), files
        # A file whose name decodes to no session id is rejected too (not loaded under some other id).
        assert not badname.exists() and badname.with_name(badname.name + ".rejected").exists(), \
            (files, second_server.log_tail())
        # One this server cannot take now (other weights: they may be served again) and the entries that are no
        # regular file are skipped and kept; a shutdown leaves them too (it removes only what it restored).
        second_server.signal(signal.SIGTERM)
        assert second_server.wait(120) == 0, second_server.log_tail()
        assert set(odd) <= {p.name for p in folder.iterdir()}, (odd, files)
        assert other.read_bytes() == reweigh(blob, weights_version ^ 1)
    finally:
        second_server.stop()


def test_a_shutdown_removes_only_the_session_files_it_restored(default_model_path: Path, tmp_path: Path) -> None:
    """Two servers may share one --session-dir: a shutdown removes the files of sessions it restored and no
    longer holds (released here), never a file it did not restore (another server's, written while it ran)."""
    session_dir = tmp_path / "sessions"
    first = start_server(default_model_path, tmp_path / "one", "--session-dir", str(session_dir))
    try:
        for session_id in ("kept", "released"):
            chat(first, req(FRANCE, session_id=session_id))
        first.signal(signal.SIGTERM)
        assert first.wait(120) == 0, first.log_tail()
    finally:
        first.stop()
    (folder,) = {p.parent for p in session_dir.rglob("*.pnsess")}
    second = start_server(default_model_path, tmp_path / "two", "--session-dir", str(session_dir))
    try:
        assert release(second, {"session_id": "released"}).status_code == 200
        foreign = folder / (base64.urlsafe_b64encode(b"another-servers").decode() + ".pnsess")
        foreign.write_bytes((folder / (base64.urlsafe_b64encode(b"kept").decode() + ".pnsess")).read_bytes())
        second.signal(signal.SIGTERM)
        assert second.wait(120) == 0, second.log_tail()
    finally:
        second.stop()
    names = {p.name for p in folder.iterdir()}
    assert names == {base64.urlsafe_b64encode(n).decode() + ".pnsess" for n in (b"kept", b"another-servers")}, names


def test_an_unwritable_session_dir_stops_the_start(default_model_path: Path, tmp_path: Path) -> None:
    """Found at start, not as every session lost at the next shutdown."""
    not_a_dir = tmp_path / "file"
    not_a_dir.write_text("x")
    done = subprocess.run([sys.executable, "-m", "pantheon", "serve", "--model", str(default_model_path),
                           "--port", "0", "--session-dir", str(not_a_dir / "sessions")],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 1 and "--session-dir" in done.stderr, (done.returncode, done.stderr[-2000:])


def test_an_unload_saves_the_sessions_a_later_load_restores(default_model_path: Path, tmp_path: Path) -> None:
    """With --session-dir a model loaded at run time restores its sessions as one loaded at start does, and an
    unload saves them first, as a shutdown does: unload and load again keep a conversation's cache."""
    server = start_server(default_model_path, tmp_path / "log", "--session-dir", str(tmp_path / "sessions"))
    spec = {"path": str(default_model_path), "name": "second"}
    try:
        assert httpx.post(server.base_url + "/admin/models/load", json=spec, timeout=300).status_code == 200
        first = chat(server, req(FRANCE, session_id="s2", model="second"))
        before = export(server, "s2", name="second").json()
        r = httpx.post(server.base_url + "/admin/models/unload", json={"name": "second"}, timeout=300)
        assert r.status_code == 200, r.text
        assert httpx.post(server.base_url + "/admin/models/load", json=spec, timeout=300).status_code == 200
        after = export(server, "s2", name="second")
        assert after.status_code == 200, after.text
        assert after.json()["tokens"] == before["tokens"] and after.json()["n_tok"] == first["usage"]["kv_used"]
    finally:
        server.stop()


def test_a_restore_whose_body_ends_during_the_drain_is_refused(default_model_path: Path, tmp_path: Path) -> None:
    """The drain's check on arrival is not enough for a body still on its way: a restore that ends after the
    drain began is refused (503 server_shutting_down), never answered 200 and then lost with the process."""
    server = start_server(default_model_path, tmp_path / "log", "--session-dir", str(tmp_path / "sessions"))
    try:
        chat(server, req(FRANCE, session_id="r1"))
        snap = exported(server, "r1")
        body = json.dumps({"session_id": "r2", "blob": snap["blob_b64"], "tokens": snap["tokens"]}).encode()
        sock = socket.create_connection(("127.0.0.1", server.port), timeout=60)
        sock.sendall(b"POST /session/restore HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body[: len(body) // 2])
        time.sleep(0.5)
        server.signal(signal.SIGTERM)
        time.sleep(0.5)
        sock.sendall(body[len(body) // 2:])
        answer = b""
        while chunk := sock.recv(65536):
            answer += chunk
        sock.close()
        assert answer.startswith(b"HTTP/1.1 503") and b"server_shutting_down" in answer, answer[:300]
        assert server.wait(120) == 0, server.log_tail()
    finally:
        server.stop()
