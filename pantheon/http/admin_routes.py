"""Operator routes: load/unload models at runtime, list live instances, die status."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from pantheon.config import MAX_MODEL_DIES, ModelOptions, default_model_name, model_file_path
from pantheon.errors import ApiError, invalid_request
from pantheon.http.asgi import Receive, Send, parse_json_body, read_body, send_json
from pantheon.sched.manager import ModelManager, load_failed
from pantheon.sched.registry import ModelInstance, Registry


def _optional_int(body: dict[str, Any], key: str) -> int:
    value = body.get(key)
    if value is None:
        return 0
    if isinstance(value, bool) or not isinstance(value, int):
        raise invalid_request(f"'{key}' must be an integer")
    if value < 0:
        raise invalid_request(f"'{key}' must not be negative")
    return value


def load_options(body: Any) -> ModelOptions:
    """The same per-model options as the serve command line, from a POST /admin/models/load body."""
    if not isinstance(body, dict):
        raise invalid_request("request body must be a JSON object")
    path = body.get("path")
    if not isinstance(path, str) or not path:
        raise invalid_request("'path' is required")
    if path.endswith("/"):  # a directory's name (Path() would drop the slash and find the file)
        raise load_failed(404, f"model file not found: {path} (a path ending in '/' names a directory)")
    file_path = model_file_path(path)
    name = body.get("name")
    if name is None or name == "":
        name = default_model_name(file_path)
    elif not isinstance(name, str):
        raise invalid_request("'name' must be a string")
    dies = body.get("dies")
    if dies is None:
        dies = []
    if not isinstance(dies, list) or not all(isinstance(d, int) and not isinstance(d, bool) for d in dies):
        raise invalid_request("'dies' must be an array of integers")
    if len(dies) > MAX_MODEL_DIES:
        raise invalid_request(f"too many dies: {len(dies)} (at most {MAX_MODEL_DIES})")
    quantize = body.get("quantize", False)
    if not isinstance(quantize, bool):
        raise invalid_request("'quantize' must be a boolean")
    return ModelOptions(path=file_path, name=name, ctx_cap=_optional_int(body, "ctx_cap"),
                        max_sessions=_optional_int(body, "max_sessions"),
                        max_concurrent=_optional_int(body, "max_concurrent"),
                        reasoning_budget=_optional_int(body, "reasoning_budget"), dies=tuple(dies),
                        quantize=quantize)


def residency(instance: ModelInstance, *, operator: bool = False) -> dict[str, Any]:
    """`graphs` and `attention` objects, present only where the backend has them: graph slots exist (cuda)
    and the forward has reached an attention layer on a die. The cpu backend has neither."""
    out: dict[str, Any] = {}
    graphs = getattr(instance.backend, "graphs", None)
    if graphs is not None:
        summary = graphs.counters() if operator else graphs.summary()
        if summary is not None:
            out["graphs"] = summary
    attention = getattr(instance.backend, "attention_residency", None)
    if instance.on_accelerator and attention is not None:
        counters = attention.counters(operator)
        if counters is not None:  # omitted until the forward has reached an attention layer
            out["attention"] = counters
    return out


def instance_row(instance: ModelInstance) -> dict[str, Any]:
    served, sched = instance.served, instance.scheduler
    return {
        "id": served.name,
        "object": "model",
        "path": str(served.options.path),
        "dies": list(instance.dies),
        "vram_bytes": 0 if not instance.dies else instance.weights_bytes + instance.state_bytes,
        "max_sessions": served.options.resolved_max_sessions,
        "max_concurrent": sched.max_concurrent,
        "max_concurrent_configured": sched.max_concurrent_configured,
        "context_window": sched.kv_cap,
        "context_window_configured": sched.ctx_window_configured,
        **residency(instance, operator=True),
    }


async def models(registry: Registry, scope: dict[str, Any], receive: Receive, send: Send) -> None:
    await send_json(send, 200, {"object": "list", "data": [instance_row(i) for i in registry.instances]})


async def load(manager: ModelManager, scope: dict[str, Any], receive: Receive, send: Send,
               refuse_now: Callable[[], None] = lambda: None) -> None:
    """`refuse_now()` raises when the server no longer takes loads (it drains), asked again once the body is
    read: a load whose body arrived during the drain is refused like one that came then."""
    options = load_options(parse_json_body(await read_body(receive)))
    refuse_now()
    instance = await manager.load(options)
    await send_json(send, 200, instance_row(instance))


async def unload(manager: ModelManager, scope: dict[str, Any], receive: Receive, send: Send) -> None:
    body = parse_json_body(await read_body(receive))
    if not isinstance(body, dict):
        raise invalid_request("request body must be a JSON object")
    name = body.get("name")
    if not isinstance(name, str) or not name:
        raise invalid_request("'name' is required")
    await manager.unload(name)
    await send_json(send, 200, {"unloaded": name})


async def dies(manager: ModelManager, scope: dict[str, Any], receive: Receive, send: Send) -> None:
    rows = manager.die_rows()
    await send_json(send, 200, {"object": "list", "n_dies": len(rows), "data": rows})


__all__ = ["ApiError", "dies", "instance_row", "load", "load_options", "models", "unload"]
