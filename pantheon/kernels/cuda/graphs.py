"""CUDA-graph residency: per-layer capture bookkeeping, bounded retry, and fallback to direct launches.

A graph slot is one replayable piece of a step (one layer of the batched decode, the single-token SSM path, a
whole per-die segment), named by a key the model chooses and filed under one of the spec's classes. `run`
executes a slot's body either by replaying its captured graph or by launching the kernels directly:

    pending  --(warm-up runs done, capture ok)-->  live
    pending/failed --(capture raised)--> failed (retry after a backoff) --(budget spent)--> gave_up
    live --(replay raised)--> failed
    ineligible: never captured (e.g. a kernel the captured path needs is missing). Not a fault.

A failed or skipped capture always falls back to the direct body, so output stays correct and only speed is
lost; `counters()` is the only place that shows it (the spec's `graphs` object). Warm-up runs happen before a
first capture because the first launch of a numba kernel compiles and loads its module, which cannot happen
inside a capture.

The capture itself goes through a `CaptureLayer` so the bookkeeping is testable without a GPU: `DriverCapture`
drives cuStreamBeginCapture / EndCapture / GraphInstantiate / GraphLaunch through numba's checked driver
wrapper; tests pass a fake. Buffers a graph reads must not move between capture and replay: the model keeps
per-slot static buffers and calls `invalidate` when it reallocates them.
"""

from __future__ import annotations

import contextlib
import enum
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

GRAPH_CLASSES = ("batched_attn", "batched_ssm", "single_ssm", "segment")


class CaptureUnsupported(RuntimeError):
    """This process cannot capture graphs at all (the simulator, or no driver)."""


class CaptureLayer(Protocol):
    def begin(self, stream: Any, body: Callable[[], None]) -> None:
        """Start capturing the work queued on `stream` (`body`, about to run, queues it: a layer that cannot see
        kernel launches, like the tests' replaying fake, keeps it to run at each launch)."""

    def end(self, stream: Any) -> Any:
        """Stop capturing; returns the captured graph (raises when the capture was invalidated)."""

    def instantiate(self, graph: Any, stream: Any) -> Any:
        """An executable graph, uploaded for `stream`."""

    def launch(self, executable: Any, stream: Any) -> None: ...

    def destroy(self, graph: Any, executable: Any) -> None:
        """Free a graph and its executable (either may be None)."""

    def deferred_cleanup(self) -> contextlib.AbstractContextManager[Any]:
        """A context in which no device memory is freed (a free inside a capture invalidates it)."""


class UnsupportedCapture:
    """The capture layer of a process that cannot capture: every slot falls back to direct launches."""

    def __init__(self, reason: str) -> None:
        self.reason = reason

    def begin(self, stream: Any, body: Callable[[], None]) -> None:
        raise CaptureUnsupported(self.reason)

    def end(self, stream: Any) -> Any:
        raise CaptureUnsupported(self.reason)

    def instantiate(self, graph: Any, stream: Any) -> Any:
        raise CaptureUnsupported(self.reason)

    def launch(self, executable: Any, stream: Any) -> None:
        raise CaptureUnsupported(self.reason)

    def destroy(self, graph: Any, executable: Any) -> None:
        pass

    def deferred_cleanup(self) -> contextlib.AbstractContextManager[Any]:
        return contextlib.nullcontext()


class DriverCapture:
    """Stream capture through the CUDA driver API (cuda-bindings via numba's checked `driver` wrapper).

    Thread-local capture mode: other threads' CUDA calls (another model's step) do not invalidate it. Not run in
    this repository's CI (no GPU); bench/gpu_check.py exercises it on hardware."""

    def __init__(self) -> None:
        from cuda.bindings import driver as cu
        from numba import cuda
        from numba.cuda.cudadrv.driver import driver

        self._cu = cu
        self._driver = driver
        self._cuda = cuda

    def begin(self, stream: Any, body: Callable[[], None]) -> None:
        mode = self._cu.CUstreamCaptureMode.CU_STREAM_CAPTURE_MODE_THREAD_LOCAL
        self._driver.cuStreamBeginCapture(stream.handle, mode)

    def end(self, stream: Any) -> Any:
        return self._driver.cuStreamEndCapture(stream.handle)

    def instantiate(self, graph: Any, stream: Any) -> Any:
        executable = self._driver.cuGraphInstantiate(graph, 0)
        self._driver.cuGraphUpload(executable, stream.handle)
        return executable

    def launch(self, executable: Any, stream: Any) -> None:
        self._driver.cuGraphLaunch(executable, stream.handle)

    def destroy(self, graph: Any, executable: Any) -> None:
        if executable is not None:
            self._driver.cuGraphExecDestroy(executable)
        if graph is not None:
            self._driver.cuGraphDestroy(graph)

    def deferred_cleanup(self) -> contextlib.AbstractContextManager[Any]:
        return self._cuda.defer_cleanup()


def default_capture_layer() -> Any:
    """DriverCapture on hardware; UnsupportedCapture under the simulator or without cuda-bindings."""
    try:
        from pantheon.kernels.cuda.launch import SIMULATOR
    except ImportError:
        return UnsupportedCapture("numba-cuda is not installed")
    if SIMULATOR:
        return UnsupportedCapture("the CUDA simulator has no streams to capture")
    try:
        return DriverCapture()
    except ImportError as exc:
        return UnsupportedCapture(f"cuda-bindings unavailable: {exc}")


class SlotState(enum.Enum):
    PENDING = "pending"
    LIVE = "live"
    FAILED = "failed"
    GAVE_UP = "gave_up"
    INELIGIBLE = "ineligible"


@dataclass(frozen=True)
class RetryPolicy:
    warmup_runs: int = 1  # direct runs before the first capture (compiles and loads the kernels)
    max_attempts: int = 4  # failed captures before a slot gives up
    backoff_s: float = 1.0  # wait after the first failure; doubles per further failure
    backoff_max_s: float = 60.0


@dataclass
class GraphSlot:
    key: Any
    graph_class: str
    state: SlotState = SlotState.PENDING
    runs: int = 0  # lifetime; a slot counts in `total` once it has run
    warm_runs: int = 0  # direct runs since the slot last became pending
    attempts: int = 0  # failed captures since the last success
    retry_at: float = 0.0
    graph: Any = None
    executable: Any = None
    reason: str = ""
    last_error: str = ""


@dataclass
class _Totals:
    captures: int = 0
    capture_failures: int = 0
    replays: int = 0
    direct_runs: int = 0


@dataclass
class GraphResidency:
    """Every graph slot of one model instance and the counters the spec's `graphs` object reports."""

    capture: Any
    policy: RetryPolicy = field(default_factory=RetryPolicy)
    clock: Callable[[], float] = time.monotonic
    slots: dict[Any, GraphSlot] = field(default_factory=dict)
    totals: _Totals = field(default_factory=_Totals)

    def slot(self, key: Any, graph_class: str) -> GraphSlot:
        if graph_class not in GRAPH_CLASSES:
            raise ValueError(f"unknown graph class {graph_class!r} (one of {', '.join(GRAPH_CLASSES)})")
        existing = self.slots.get(key)
        if existing is None:
            existing = self.slots[key] = GraphSlot(key, graph_class)
        return existing

    def mark_ineligible(self, key: Any, graph_class: str, reason: str) -> None:
        """This slot never captures (it still counts in `total` once it runs)."""
        slot = self.slot(key, graph_class)
        self._drop_graph(slot)
        slot.state, slot.reason = SlotState.INELIGIBLE, reason

    def mark_eligible(self, key: Any, reason: str) -> None:
        """A slot made ineligible for `reason` may capture again (after warm-up), now that the reason is gone."""
        slot = self.slots.get(key)
        if slot is not None and slot.state is SlotState.INELIGIBLE and slot.reason == reason:
            slot.state, slot.reason, slot.warm_runs = SlotState.PENDING, "", 0

    def invalidate(self, key: Any = None) -> None:
        """Forget captured graphs (all, or one slot's; a slot not made yet has none) because buffers they read
        moved; they are captured again after warm-up. Failure history is kept."""
        if key is None:
            chosen = list(self.slots.values())
        else:
            chosen = [self.slots[key]] if key in self.slots else []
        for slot in chosen:
            if slot.state is SlotState.LIVE:
                self._drop_graph(slot)
                slot.state, slot.warm_runs = SlotState.PENDING, 0

    def run(self, key: Any, graph_class: str, body: Callable[[], None], stream: Any) -> bool:
        """Do the slot's work: replay its graph, or capture it now if due, or launch `body` directly.

        Returns True when the work ran from a graph. `body` queues the kernels on `stream`; it must only launch
        onto `stream` with device arrays allocated before (see pantheon docs on capture rules)."""
        slot = self.slot(key, graph_class)
        slot.runs += 1
        slot.warm_runs += 1
        if slot.state is SlotState.LIVE:
            try:
                self.capture.launch(slot.executable, stream)
                self.totals.replays += 1
                return True
            except Exception as exc:  # the replay failed: back to direct launches, capture again later
                self._drop_graph(slot)
                self._record_failure(slot, exc)
        elif self._capture_due(slot):
            if self._try_capture(slot, body, stream):
                return True
        body()
        self.totals.direct_runs += 1
        return False

    def _capture_due(self, slot: GraphSlot) -> bool:
        if slot.state is SlotState.PENDING:
            return slot.warm_runs > self.policy.warmup_runs
        return slot.state is SlotState.FAILED and self.clock() >= slot.retry_at

    def _try_capture(self, slot: GraphSlot, body: Callable[[], None], stream: Any) -> bool:
        graph = executable = None
        try:
            with self.capture.deferred_cleanup():
                self.capture.begin(stream, body)
                try:
                    body()
                finally:
                    # Always end the capture, or the stream stays in capture mode; a capture that the body
                    # broke raises here and is thrown away.
                    graph = self.capture.end(stream)
            executable = self.capture.instantiate(graph, stream)
            self.capture.launch(executable, stream)  # the captured work has not run yet: run it now
        except CaptureUnsupported as exc:
            self._safe_destroy(graph, executable)
            self.mark_ineligible(slot.key, slot.graph_class, str(exc))
            return False
        except Exception as exc:
            self._safe_destroy(graph, executable)
            self._record_failure(slot, exc)
            return False
        slot.graph, slot.executable = graph, executable
        slot.state, slot.attempts, slot.last_error = SlotState.LIVE, 0, ""
        self.totals.captures += 1
        self.totals.replays += 1
        return True

    def _record_failure(self, slot: GraphSlot, exc: BaseException) -> None:
        self.totals.capture_failures += 1
        slot.attempts += 1
        slot.last_error = f"{type(exc).__name__}: {exc}"
        if slot.attempts >= self.policy.max_attempts:
            slot.state = SlotState.GAVE_UP
        else:
            slot.state = SlotState.FAILED
            delay = min(self.policy.backoff_max_s, self.policy.backoff_s * 2 ** (slot.attempts - 1))
            slot.retry_at = self.clock() + delay

    def _drop_graph(self, slot: GraphSlot) -> None:
        self._safe_destroy(slot.graph, slot.executable)
        slot.graph = slot.executable = None

    def _safe_destroy(self, graph: Any, executable: Any) -> None:
        if graph is None and executable is None:
            return
        try:
            self.capture.destroy(graph, executable)
        except Exception:
            pass  # freeing a broken graph can fail too; nothing else to do with it

    # -- reporting -----------------------------------------------------------------------------------------
    def _counts(self, slots: list[GraphSlot]) -> dict[str, int]:
        exercised = [s for s in slots if s.runs > 0]
        states = [s.state for s in exercised]
        return {
            "live": states.count(SlotState.LIVE),
            "total": len(exercised),
            "failed": states.count(SlotState.FAILED) + states.count(SlotState.GAVE_UP),
            "ineligible": states.count(SlotState.INELIGIBLE),
            "pending": states.count(SlotState.PENDING),
        }

    def summary(self) -> dict[str, int] | None:
        """The `/v1/models` `graphs` object (gave_up only when non-zero); None when no slot has run yet."""
        slots = list(self.slots.values())
        counts = self._counts(slots)
        if counts["total"] == 0:
            return None
        gave_up = sum(1 for s in slots if s.runs > 0 and s.state is SlotState.GAVE_UP)
        if gave_up:
            counts["gave_up"] = gave_up
        return counts

    def counters(self) -> dict[str, Any] | None:
        """The operator `graphs` object of `/admin/models`: the summary plus gave_up, the lifetime capture
        counters and one object per class the model has exercised. None when no slot has run yet."""
        slots = list(self.slots.values())
        counts = self._counts(slots)
        if counts["total"] == 0:
            return None
        result: dict[str, Any] = dict(counts)
        result["gave_up"] = sum(1 for s in slots if s.runs > 0 and s.state is SlotState.GAVE_UP)
        result["captures"] = self.totals.captures
        result["capture_failures"] = self.totals.capture_failures
        for graph_class in GRAPH_CLASSES:
            per_class = self._counts([s for s in slots if s.graph_class == graph_class])
            if per_class["total"]:
                result[graph_class] = per_class
        return result


__all__ = ["GRAPH_CLASSES", "CaptureLayer", "CaptureUnsupported", "DriverCapture", "GraphResidency", "GraphSlot",
           "RetryPolicy", "SlotState", "UnsupportedCapture", "default_capture_layer"]
