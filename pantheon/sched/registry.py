"""The live model instances of this process and how a request's `model` routes to one of them."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import trio

from pantheon.engine.loader import LoadedModel
from pantheon.errors import ApiError
from pantheon.sched.scheduler import Scheduler


@dataclass(eq=False)
class ModelInstance:
    served: LoadedModel
    scheduler: Scheduler
    dies: tuple[int, ...] = ()
    unloading: bool = False
    # Cancels this instance's scheduler task (and its watch timers) when it is unloaded.
    cancel_scope: trio.CancelScope = field(default_factory=trio.CancelScope)
    stopped: trio.Event = field(default_factory=trio.Event)  # set when that task has returned
    weights_bytes: int = 0
    state_bytes: int = 0
    backend: Any = None  # the backend its forward passes run on
    # Requests routed here and not answered yet (`handling`): an unload waits for them as for the scheduler's
    # jobs, since one may still be rendering its prompt, not yet a job the scheduler knows of.
    requests: int = 0
    # Files of --session-dir this instance restored at its load: the ones its save may remove when their session
    # is gone (a file it never restored, another server's in a shared folder, one it could not take, is kept).
    session_files: set[str] = field(default_factory=set)

    @contextlib.contextmanager
    def handling(self) -> Iterator[None]:
        """Around a request's work on this instance, from the moment it was routed here."""
        self.requests += 1
        try:
            yield
        finally:
            self.requests -= 1

    @property
    def busy(self) -> bool:
        return self.requests > 0 or not self.scheduler.idle

    @property
    def on_accelerator(self) -> bool:
        return bool(getattr(self.backend, "accelerator", False))

    @property
    def name(self) -> str:
        return self.served.name


class Registry:
    def __init__(self) -> None:
        self.instances: list[ModelInstance] = []

    def add(self, instance: ModelInstance) -> None:
        self.instances.append(instance)

    def remove(self, instance: ModelInstance) -> None:
        if instance in self.instances:
            self.instances.remove(instance)

    @property
    def serving(self) -> list[ModelInstance]:
        """Instances that take new requests (an unloading one only finishes what it has)."""
        return [i for i in self.instances if not i.unloading]

    def names(self) -> list[str]:
        """Served ids in load order, replicas deduplicated."""
        seen: dict[str, None] = {}
        for inst in self.serving:
            seen.setdefault(inst.name, None)
        return list(seen)

    def route(self, model: str | None) -> ModelInstance:
        serving = self.serving
        if not serving:
            raise ApiError(503, "no_models_loaded", "no model is loaded")
        if model is not None and model not in self.names() and any(i.name == model for i in self.instances):
            # It names a model being unloaded: not answered by whichever model stays.
            raise ApiError(404, "model_not_found", f"model {model!r} is being unloaded; loaded: "
                                                   f"{', '.join(self.names())}")
        if len(self.names()) == 1:
            candidates = serving  # one served id: any value (or none) routes to it
        else:
            candidates = [i for i in serving if i.name == model]
            if not candidates:
                asked = "no model was named" if model is None else f"model {model!r} is not loaded"
                raise ApiError(404, "model_not_found", f"{asked}; loaded: {', '.join(self.names())}")
        return self.pick(candidates)

    @staticmethod
    def pick(candidates: list[ModelInstance], session_key: str | None = None) -> ModelInstance:
        """Replicas: the one holding the session's cache, else the one with the most free decode slots."""
        if session_key is not None:
            for inst in candidates:
                if inst.scheduler.sessions.get(session_key) is not None:
                    return inst
        return max(candidates, key=lambda i: i.scheduler.max_concurrent - i.scheduler.n_active - i.scheduler.n_waiting)

    def route_session(self, model: str | None, session_key: str | None) -> ModelInstance:
        first = self.route(model)
        if session_key is None:
            return first
        candidates = [i for i in self.serving if i.name == first.name]
        return self.pick(candidates, session_key)

    def find(self, name: str | None) -> ModelInstance | None:
        """Session routes: `name` selects the model; absent -> the default (first) model."""
        serving = self.serving
        if name is None or name == "":
            return serving[0] if serving else None
        for inst in serving:
            if inst.name == name:
                return inst
        return None

    def find_all(self, name: str) -> list[ModelInstance]:
        return [i for i in self.instances if i.name == name]
