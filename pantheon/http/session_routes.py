"""Session routes: export, restore, release, estimate, watch (spec: "Session routes")."""

from __future__ import annotations

import base64
import binascii
import urllib.parse
from collections.abc import Callable
from typing import Any

import trio

from pantheon.errors import ApiError, invalid_request
from pantheon.http.asgi import (MAX_BODY_BYTES, Receive, Send, headers_of, parse_json_body, read_body, send_json,
                                start_sse)
from pantheon.sched import session_ops
from pantheon.sched.registry import ModelInstance, Registry

DEFAULT_BLOB_BYTES_PER_TOKEN = 16 * 1024
DEFAULT_UPLOAD_BPS = 12.5e6
MAX_WATCHES = 256


def _instance(registry: Registry, name: Any) -> ModelInstance:
    if name is not None and not isinstance(name, str):
        raise invalid_request("'name' must be a string")
    instance = registry.find(name)
    if instance is None:
        # The session routes' one model error (their tables list no 503): with nothing loaded, no name finds one.
        # Nothing serving (none loaded, or the only one unloading): the same words whatever the name asked.
        asked = "no model is loaded" if not registry.serving else f"model {name!r} is not loaded"
        raise ApiError(404, "model_not_found", asked)
    return instance


async def _json_object(receive: Receive, limit: int = MAX_BODY_BYTES) -> dict[str, Any]:
    body = parse_json_body(await read_body(receive, limit))
    if not isinstance(body, dict):
        raise invalid_request("request body must be a JSON object")
    return body


def _session_id(body: dict[str, Any], scope: dict[str, Any] | None) -> str:
    session_id = body.get("session_id")
    if (session_id is None or session_id == "") and scope is not None:  # an empty id is an absent one, as in chat
        session_id = headers_of(scope).get("x-session-id")
    if not isinstance(session_id, str) or not session_id:
        raise invalid_request("'session_id' is required")
    return session_id


async def export(registry: Registry, scope: dict[str, Any], receive: Receive, send: Send) -> None:
    body = await _json_object(receive)
    session_id = _session_id(body, None)  # export reads the body only
    instance = _instance(registry, body.get("name"))
    with instance.handling():  # an unload waits for it (the state it reads goes with the instance)
        exported = await session_ops.export_session(instance.scheduler, session_id)
    await send_json(send, 200, {
        "session_id": session_id,
        "weights_version": exported.weights_version,
        "n_tok": len(exported.tokens),
        "blob_bytes": len(exported.blob),
        "blob_b64": base64.b64encode(exported.blob).decode("ascii"),
        "tokens": exported.tokens,
    })


def restore_body_limit(registry: Registry) -> int:
    """The largest restore body a loaded model can be sent: a blob for a session that fills its whole window, in
    base64 (4 bytes per 3), and its token list (at most 12 bytes a token as JSON), plus 1 MiB; never less than
    any other route's limit. The blob is taken as twice the model's state for one slot (a float32 blob restores
    into a float16 cache; a hybrid model's blob may carry a recurrent-state checkpoint) plus 16 bytes a token.
    A session a model can export is one it can be sent back."""
    largest = 0
    for instance in registry.instances:
        ctx = instance.served.ctx_cap
        blob = 2 * instance.served.model.state_bytes(1, ctx) + 16 * ctx
        largest = max(largest, -(-blob // 3) * 4 + 12 * ctx)
    return max(MAX_BODY_BYTES, largest + (1 << 20))


async def restore(registry: Registry, scope: dict[str, Any], receive: Receive, send: Send,
                  refuse_now: Callable[[], None] = lambda: None) -> None:
    """`refuse_now()` raises when the server no longer takes restores (it drains): asked again once the body,
    which may take seconds to arrive, is read, and with no wait between it and the instance's `handling`, which
    a drain waits for, so that a restore is refused or saved with the others, never answered and then lost."""
    body = await _json_object(receive, restore_body_limit(registry))
    session_id = _session_id(body, scope)
    blob_b64, tokens = body.get("blob"), body.get("tokens")
    if blob_b64 is None or tokens is None:
        raise invalid_request("'blob' and 'tokens' are required")
    if not isinstance(tokens, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in tokens):
        raise invalid_request("'tokens' must be an array of integers")
    instance = _instance(registry, body.get("name"))
    if not isinstance(blob_b64, str):
        raise ApiError(400, "bad_session_blob", "'blob' must be a base64 string")
    try:
        # Line breaks and blanks are dropped first: `base64` tools wrap their output at 76 columns.
        blob = base64.b64decode("".join(blob_b64.split()), validate=True)
    except (binascii.Error, ValueError):
        raise ApiError(400, "bad_session_blob", "'blob' is not valid base64") from None
    refuse_now()
    with instance.handling():
        n_tok = await session_ops.restore_session(instance.scheduler, session_id, blob, tokens)
    await send_json(send, 200, {"restored": True, "session_id": session_id, "n_tok": n_tok})


async def release(registry: Registry, scope: dict[str, Any], receive: Receive, send: Send) -> None:
    body = await _json_object(receive)
    session_id = _session_id(body, scope)
    instance = _instance(registry, body.get("name"))
    instance.scheduler.sessions.release(session_id)  # idempotent: unknown ids are fine
    await send_json(send, 200, {"released": True, "session_id": session_id})


def _query(scope: dict[str, Any]) -> dict[str, str]:
    raw = scope.get("query_string", b"").decode("latin-1")
    return {k: v[-1] for k, v in urllib.parse.parse_qs(raw, keep_blank_values=True).items()}


# Bounds on the numbers /session/estimate takes: the estimates it returns (integers, seconds) stay finite and
# fit JSON's 64-bit integers; no real session comes near them. The upload rate has a floor as well, one byte a
# second: a blob over 1e-300 bytes a second would take longer than a float holds (JSON's null, not a number).
_MAX_QUERY_NUMBER = 1e15
_MIN_UPLOAD_BPS = 1.0


def _positive_number(query: dict[str, str], key: str, low: float = 0.0) -> float | None:
    """query[key] as a number in (0, _MAX_QUERY_NUMBER], or at least `low` when that is above 0; None when absent."""
    if key not in query:
        return None
    try:
        value = float(query[key])
    except ValueError:
        raise invalid_request(f"'{key}' must be a number") from None
    if not (0 < value <= _MAX_QUERY_NUMBER and value >= low):  # also refuses inf and nan
        floor = f"from {low:g}" if low > 0 else "a positive number"
        raise invalid_request(f"'{key}' must be {floor} up to {_MAX_QUERY_NUMBER:.0e}")
    return value


async def estimate(registry: Registry, scope: dict[str, Any], receive: Receive, send: Send) -> None:
    query = _query(scope)
    if "tokens" not in query:
        raise invalid_request("'tokens' is required")
    raw_tokens = query["tokens"]
    # Digits only: Python's int() would also take "1_000", "+7" and surrounding blanks.
    if not (raw_tokens.isascii() and raw_tokens.isdigit()):
        raise invalid_request("'tokens' must be a positive integer")
    # int() refuses text past 4300 digits (a ValueError): more than 19 significant digits is out of range anyway.
    significant = raw_tokens.lstrip("0")
    tokens = int(significant) if 0 < len(significant) <= 19 else 0
    if not 0 < tokens <= _MAX_QUERY_NUMBER:  # the reply's JSON integers must fit in 64 bits
        raise invalid_request(f"'tokens' must be a positive integer up to {_MAX_QUERY_NUMBER:.0e}")
    blob_bytes = _positive_number(query, "blob_bytes")
    upload_bps = _positive_number(query, "upload_bps", _MIN_UPLOAD_BPS) or DEFAULT_UPLOAD_BPS
    instance = registry.find(query.get("name")) if registry.instances else None
    if instance is not None:
        rate = instance.scheduler.prefill_tok_per_s or instance.scheduler.reprefill_estimate_fallback()
        model = instance.name
    else:
        from pantheon.sched.scheduler import FALLBACK_PREFILL_TOK_S

        rate, model = FALLBACK_PREFILL_TOK_S, ""
    blob_est = int(blob_bytes) if blob_bytes is not None else tokens * DEFAULT_BLOB_BYTES_PER_TOKEN
    await send_json(send, 200, {
        "model": model,
        "tokens": tokens,
        "prefill_tok_per_s": round(rate, 2),
        "cold_reprefill_s": round(tokens / rate, 3),
        "warm_restore_s": round(blob_est / upload_bps, 3),
        "blob_bytes_est": blob_est,
    })


async def watch(registry: Registry, grace_s: float, scope: dict[str, Any], receive: Receive, send: Send) -> None:
    query = _query(scope)
    session_id = query.get("session_id") or headers_of(scope).get("x-session-id")
    if not session_id:
        raise invalid_request("'session_id' is required")
    instance = _instance(registry, query.get("name"))
    scheduler = instance.scheduler
    table = scheduler.sessions
    if sum(table.watches.values()) >= MAX_WATCHES or scheduler.watch_nursery is None:
        raise ApiError(503, "watch_unavailable", "the watch table is full" if scheduler.watch_nursery
                       else "the watch manager is not running")
    table.hold(session_id)
    try:
        await start_sse(send)
        await send({"type": "http.response.body", "body": b": watch established\n\n", "more_body": True})
        async with trio.open_nursery() as nursery:
            async def until(event: Any) -> None:
                await event.wait()
                nursery.cancel_scope.cancel()

            async def client_gone() -> None:
                while (await receive())["type"] != "http.disconnect":
                    pass
                nursery.cancel_scope.cancel()

            nursery.start_soon(client_gone)
            nursery.start_soon(until, scheduler.closed)  # the model was unloaded: its sessions are gone
            nursery.start_soon(until, scheduler.stopping)  # the server stops (after its drain)
        if scheduler.closed.is_set():
            await send({"type": "http.response.body", "body": b": session released: model unloaded\n\n",
                        "more_body": False})
        elif scheduler.stopping.is_set():
            await send({"type": "http.response.body", "body": b": server shutting down\n\n", "more_body": False})
    finally:
        with trio.CancelScope(shield=True):
            if table.unhold(session_id) == 0 and not scheduler.closed.is_set():
                table.touch(session_id)
                scheduler.start_watch_grace(session_id, grace_s)
