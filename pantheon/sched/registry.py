"""The live model instances of this process and how a request's `model` routes to one of them."""

from __future__ import annotations

from dataclasses import dataclass

from pantheon.engine.loader import LoadedModel
from pantheon.errors import ApiError
from pantheon.sched.scheduler import Scheduler


@dataclass
class ModelInstance:
    served: LoadedModel
    scheduler: Scheduler

    @property
    def name(self) -> str:
        return self.served.name


class Registry:
    def __init__(self) -> None:
        self.instances: list[ModelInstance] = []

    def add(self, instance: ModelInstance) -> None:
        self.instances.append(instance)

    def names(self) -> list[str]:
        """Served ids in load order, replicas deduplicated."""
        seen: dict[str, None] = {}
        for inst in self.instances:
            seen.setdefault(inst.name, None)
        return list(seen)

    def route(self, model: str | None) -> ModelInstance:
        if not self.instances:
            raise ApiError(503, "no_models_loaded", "no model is loaded")
        if len(self.names()) == 1:
            candidates = self.instances  # one served id: any value (or none) routes to it
        else:
            candidates = [i for i in self.instances if i.name == model]
            if not candidates:
                raise ApiError(404, "model_not_found",
                               f"model {model!r} is not loaded; loaded: {', '.join(self.names())}")
        # Replicas: the one with the most free decode slots.
        return max(candidates, key=lambda i: i.scheduler.max_concurrent - i.scheduler.n_active)

    def find(self, name: str | None) -> ModelInstance | None:
        if name is None or name == "":
            return self.instances[0] if self.instances else None
        for inst in self.instances:
            if inst.name == name:
                return inst
        return None
