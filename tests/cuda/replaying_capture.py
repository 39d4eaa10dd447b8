"""A capture layer for the simulator, which cannot capture kernel launches: it keeps the body it was handed at
capture and runs that same body again at each replay. A body that bound anything of the step it was captured in
(a host array, a buffer made for that step, a position) replays that step's values, and the logits go wrong."""

from __future__ import annotations

import contextlib
from typing import Any


class ReplayingCapture:
    def __init__(self) -> None:
        self.bodies: dict[int, Any] = {}
        self.fresh: set[int] = set()
        self.captures = 0
        self.replays = 0
        self._body: Any = None

    def begin(self, stream: Any, body: Any) -> None:
        self._body = body

    def end(self, stream: Any) -> int:
        self.captures += 1
        self.bodies[self.captures] = self._body
        return self.captures

    def instantiate(self, graph: int, stream: Any) -> int:
        self.fresh.add(graph)
        return graph

    def launch(self, executable: int, stream: Any) -> None:
        if executable in self.fresh:  # the body already ran while "captured" (the simulator cannot hold it back)
            self.fresh.discard(executable)
            return
        self.replays += 1
        self.bodies[executable]()

    def destroy(self, graph: Any, executable: Any) -> None:
        self.bodies.pop(graph, None)

    def deferred_cleanup(self) -> contextlib.AbstractContextManager[Any]:
        return contextlib.nullcontext()
