"""The ASGI application: routing, JSON in and out, SSE, and the disconnect watch.

A (method, path) pair that is not in the spec's route table is answered 404 `not_found` ("unknown route"),
including a known path with the wrong method: the spec defines routes as method + path.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import trio

from pantheon.buildinfo import build_id
from pantheon.chat import completion as chat_completion
from pantheon.chat.request import ChatRequest, parse_chat_request
from pantheon.chat.structure import required_with_thinking
from pantheon.config import EnvKnobs
from pantheon.errors import ApiError, shutting_down
from pantheon.http import admin_routes, fastsend, session_routes
from pantheon.http.admin_routes import residency
from pantheon.metrics import Metrics, standard_metrics
from pantheon.http.asgi import (
    BASE_HEADERS,
    PARSE_OFF_LOOP_BYTES,
    Receive,
    Send,
    headers_of,
    internal_error,
    parse_json_body,
    read_body,
    send_error,
    send_json,
    sse_data,
    start_sse,
)
from pantheon.sched.registry import ModelInstance, Registry

log = logging.getLogger("pantheon.http")

Handler = Callable[[dict[str, Any], Receive, Send], Awaitable[None]]


def _origin_path(target_path: str) -> str:
    """The route of a request target: an absolute-form target ("http://host:port/v1/models", RFC 9112 3.2.2,
    which a server must accept) is routed by its path, as the origin-form "/v1/models" is."""
    scheme, sep, rest = target_path.partition("://")
    if not sep or scheme.lower() not in ("http", "https"):
        return target_path
    _, slash, path = rest.partition("/")
    return slash + path if slash else "/"


@dataclass
class ServerState:
    registry: Registry
    env: EnvKnobs
    backend: str
    dies_visible: int = 0
    draining: bool = False
    manager: Any = None  # pantheon.sched.manager.ModelManager
    metrics: Metrics = field(default_factory=standard_metrics)
    memory_level: int = 0
    build: str = field(default_factory=build_id)


# The request methods counted by name in pantheon_requests_total; any other is counted as "other".
_METHODS = frozenset({"GET", "HEAD", "POST", "PUT", "PATCH", "DELETE", "OPTIONS"})


# GET routes a HEAD request may not run (their answer never ends).
_NO_HEAD = frozenset({"/session/watch"})


def _without_body(send: Send) -> Send:
    """The response of a GET route for a HEAD request: the same status and headers (content-length included),
    no body bytes (h11 refuses to send any for HEAD)."""

    async def head_send(message: dict[str, Any]) -> None:
        if message["type"] == "http.response.body":
            message = {**message, "body": b""}
        await send(message)

    return head_send


class App:
    def __init__(self, state: ServerState) -> None:
        self.state = state
        self.routes: dict[tuple[str, str], Handler] = {
            ("GET", "/"): self.health,
            ("GET", "/v1/models"): self.models,
            ("POST", "/v1/chat/completions"): self.chat_completions,
            ("POST", "/admin/session/export"): partial(session_routes.export, state.registry),
            ("POST", "/session/restore"): self.restore_session,
            ("POST", "/session/release"): partial(session_routes.release, state.registry),
            ("GET", "/session/estimate"): partial(session_routes.estimate, state.registry),
            ("GET", "/session/watch"): partial(session_routes.watch, state.registry,
                                               state.env.session_watch_grace_ms / 1000.0),
            ("GET", "/admin/models"): partial(admin_routes.models, state.registry),
            ("POST", "/admin/models/load"): self.load_model,
            ("POST", "/admin/models/unload"): partial(admin_routes.unload, state.manager),
            ("GET", "/admin/dies"): partial(admin_routes.dies, state.manager),
            ("GET", "/metrics"): self.metrics,
        }
        self._paths = frozenset(path for _, path in self.routes)
        state.metrics.add_gauges(self._gauges)

    async def __call__(self, scope: dict[str, Any], receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan":
            await self._lifespan(receive, send)
            return
        if scope["type"] != "http":
            return
        method, path = scope["method"].upper(), _origin_path(scope["path"])
        status = 0

        async def counting_send(message: dict[str, Any]) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        counting_send.__wrapped__ = send  # type: ignore[attr-defined]  # fastsend.body_writer looks through it

        handler = self.routes.get((method, path))
        if handler is None and method == "HEAD" and path not in _NO_HEAD:
            handler = self.routes.get(("GET", path))
            if handler is not None:
                counting_send = _without_body(counting_send)
        try:
            if method == "OPTIONS":
                await self.preflight(scope, receive, counting_send)
            elif handler is None:
                raise ApiError(404, "not_found", "unknown route")
            else:
                await handler(scope, receive, counting_send)
        except ApiError as exc:
            await send_error(counting_send, exc)
        except ConnectionAbortedError:
            pass  # the client left before we could answer
        except Exception as exc:  # noqa: BLE001 - one bad request never takes the server down
            await send_error(counting_send, internal_error(exc))
        finally:
            # Labels from fixed sets only: a client sending made-up paths or methods must not grow the series
            # (and the server's memory) without bound.
            known = handler is not None or (method == "OPTIONS" and (path == "*" or path in self._paths))
            route = path if known else "unknown"
            label = method if method in _METHODS else "other"
            self.state.metrics.inc("pantheon_requests_total", route=route, method=label, status=str(status))

    @staticmethod
    async def _lifespan(receive: Receive, send: Send) -> None:
        while True:
            message = await receive()
            if message["type"] == "lifespan.startup":
                await send({"type": "lifespan.startup.complete"})
            elif message["type"] == "lifespan.shutdown":
                await send({"type": "lifespan.shutdown.complete"})
                return

    # -- routes --------------------------------------------------------------------------------------------
    async def preflight(self, scope: dict[str, Any], receive: Receive, send: Send) -> None:
        await send_json(send, 200, {}, {
            "access-control-allow-methods": "GET, POST, OPTIONS",
            "access-control-allow-headers": headers_of(scope).get("access-control-request-headers", "*"),
            "access-control-max-age": "86400",
        })

    async def metrics(self, scope: dict[str, Any], receive: Receive, send: Send) -> None:
        payload = self.state.metrics.render().encode()
        await send({"type": "http.response.start", "status": 200, "headers": [
            (b"content-type", b"text/plain; version=0.0.4; charset=utf-8"), *BASE_HEADERS,
            (b"content-length", str(len(payload)).encode())]})
        await send({"type": "http.response.body", "body": payload, "more_body": False})

    def _gauges(self) -> list[tuple[str, tuple[tuple[str, str], ...], float]]:
        out: list[tuple[str, tuple[tuple[str, str], ...], float]] = [
            ("pantheon_memory_ladder_level", (), float(self.state.memory_level))]
        for inst in self.state.registry.instances:
            labels = (("model", inst.name),)
            s = inst.scheduler
            out += [("pantheon_queue_depth", labels, s.n_waiting), ("pantheon_active_slots", labels, s.n_active),
                    ("pantheon_sessions", labels, len(s.sessions.sessions)),
                    ("pantheon_context_window", labels, s.kv_cap)]
        return out

    async def health(self, scope: dict[str, Any], receive: Receive, send: Send) -> None:
        s = self.state
        # accelerator: whether forward passes really run on a die (any live instance on one), not a probe.
        accelerator = any(i.on_accelerator for i in s.registry.instances)
        await send_json(send, 200, {"service": "pantheon", "status": "ok", "backend": s.backend, "build": s.build,
                                    "accelerator": accelerator, "dies_visible": s.dies_visible})

    def model_entry(self, instance: ModelInstance) -> dict[str, Any]:
        served, sched = instance.served, instance.scheduler
        entry: dict[str, Any] = {
            "id": served.name,
            "object": "model",
            "created": served.created,
            "owned_by": "pantheon",
            "max_sessions": served.options.resolved_max_sessions,
            "max_concurrent": sched.max_concurrent,
        }
        window = sched.kv_cap
        if window:
            entry["context_window"] = window
            entry["context_length"] = window
            entry["max_model_len"] = window
        entry["tool_choice_required_with_thinking"] = required_with_thinking(served, self.state.env)
        entry.update(residency(instance))
        return entry

    async def models(self, scope: dict[str, Any], receive: Receive, send: Send) -> None:
        s = self.state
        seen: set[str] = set()
        data = []
        for instance in s.registry.serving:  # an unloading model takes no new requests: not advertised
            if instance.name not in seen:
                seen.add(instance.name)
                data.append(self.model_entry(instance))
        await send_json(send, 200, {"object": "list", "backend": s.backend, "build": s.build, "data": data})

    def _refuse_if_draining(self) -> None:
        if self.state.draining:
            raise shutting_down()

    async def load_model(self, scope: dict[str, Any], receive: Receive, send: Send) -> None:
        # A model loaded while the server drains would be unloaded again at once, after seconds of work: refused
        # on arrival, and again once its body is read.
        self._refuse_if_draining()
        await admin_routes.load(self.state.manager, scope, receive, send, self._refuse_if_draining)

    async def restore_session(self, scope: dict[str, Any], receive: Receive, send: Send) -> None:
        # A session restored while the server drains could miss the drain's save and be gone with the process.
        self._refuse_if_draining()
        await session_routes.restore(self.state.registry, scope, receive, send, self._refuse_if_draining)

    async def chat_completions(self, scope: dict[str, Any], receive: Receive, send: Send) -> None:
        raw = await read_body(receive)
        header_session = headers_of(scope).get("x-session-id")

        def parse() -> ChatRequest:
            return parse_chat_request(parse_json_body(raw), header_session=header_session)

        request = parse() if len(raw) < PARSE_OFF_LOOP_BYTES else await trio.to_thread.run_sync(parse)
        if self.state.draining:
            raise shutting_down()
        instance = self.state.registry.route_session(request.model, request.session_id)
        with instance.handling():  # an unload of this instance waits for it
            completion = await chat_completion.start_completion(instance, request, self.state.env)
            try:
                if request.stream:
                    await self._stream(completion, receive, send)
                else:
                    await self._respond(completion, receive, send)
            finally:
                for job in completion.jobs:
                    job.cancel()

    async def _respond(self, completion: chat_completion.Completion, receive: Receive, send: Send) -> None:
        result: dict[str, Any] | None = None
        error: Exception | None = None
        async with trio.open_nursery() as nursery:
            nursery.start_soon(_watch_disconnect, receive, nursery.cancel_scope)

            async def produce() -> None:
                nonlocal result, error
                try:
                    result = await chat_completion.complete(completion)
                except Exception as exc:  # re-raised below, outside the nursery's exception group
                    error = _single(exc)
                nursery.cancel_scope.cancel()

            nursery.start_soon(produce)
        if error is not None:
            raise error
        if result is not None:
            with trio.CancelScope(shield=True):
                await send_json(send, 200, result)

    async def _stream(self, completion: chat_completion.Completion, receive: Receive, send: Send) -> None:
        finished = False
        refused: ApiError | None = None
        async with trio.open_nursery() as nursery:
            nursery.start_soon(_watch_disconnect, receive, nursery.cancel_scope)
            try:
                await chat_completion.wait_until_started(completion)
            except ApiError as exc:
                refused = exc  # still before the status line: a proper HTTP error
            else:
                await start_sse(send)
                await self._relay(completion, send)
                finished = True
            nursery.cancel_scope.cancel()
        if refused is not None:
            raise refused
        if finished:
            # Shielded and outside the watcher's scope: hypercorn's end-of-response bookkeeping must run
            # to completion or a Connection: close socket stays open (see reference/libraries.md, 6).
            with trio.CancelScope(shield=True):
                await send({"type": "http.response.body", "body": b"data: [DONE]\n\n", "more_body": False})

    @staticmethod
    async def _relay(completion: chat_completion.Completion, send: Send) -> None:
        write_body = fastsend.body_writer(send)
        now = None
        if write_body is not None:
            now = chat_completion.NowSink(write_body.ready, lambda chunk: write_body.write_now(sse_data(chunk)),
                                          write_body.send_held)

        async def emit(chunk: dict[str, Any]) -> None:
            if write_body is not None:
                await write_body(sse_data(chunk))
            else:
                await send({"type": "http.response.body", "body": sse_data(chunk), "more_body": True})

        try:
            await chat_completion.stream(completion, emit, now)
        except Exception as exc:  # the status is already sent: report in-band, then end the stream
            error = _single(exc)
            api_error = error if isinstance(error, ApiError) else internal_error(error)
            await emit(api_error.body())
        if write_body is not None:
            await write_body.flush()  # before the end of the body, which goes through hypercorn


def _single(exc: BaseException) -> BaseException:
    """Unwrap exception groups that carry a single error (trio nurseries wrap what their tasks raise)."""
    while isinstance(exc, BaseExceptionGroup) and len(exc.exceptions) == 1:
        exc = exc.exceptions[0]
    return exc


async def _watch_disconnect(receive: Receive, scope: trio.CancelScope) -> None:
    """Cancel `scope` when the client goes away. The body has been read, so the next message is a
    disconnect."""
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            scope.cancel()
            return


__all__ = ["App", "ServerState", "BASE_HEADERS"]
