"""One long-lived thread per backend for every forward pass (and the load's warm-up forward).

numba's OpenMP threading layer keeps a team of worker threads per calling thread. With two teams alive,
libgomp sees more threads than cores and stops spinning between parallel regions, so each of a decode step's
~150 regions pays a futex wake-up: measured on this 2-core VM, a step on the thread that ran the warm-up
took 6.2 ms, the same step on any other thread 12-15 ms. `trio.to_thread.run_sync` hands jobs to whichever
cached thread is idle (and lets idle ones expire after 10 s), so the forward passes wandered between threads.
Here they never do: one thread, started on first use, runs them all in submission order.

A job is either one call (`run`) or a stream (`stream`): a call that hands the event loop several results as
it goes (decode steps run back to back, each step's tokens sent out while the next one computes).
"""

from __future__ import annotations

import math
import queue
import threading
from collections.abc import Callable
from typing import Any

import outcome
import trio

# The thread's side of a job: where its outcome goes (called on the forward thread).
_Deliver = Callable[[outcome.Outcome], None]


class _OnValueFailed:
    def __init__(self, error: Exception) -> None:
        self.error = error


class StepStream:
    """The results a `ForwardThread.stream` job emits, in order, on the event loop. `stop` asks the job to end at
    its next chance (the job reads it between steps)."""

    _END = object()

    def __init__(self, on_value: Callable[[Any], None] | None = None) -> None:
        self._send, self._receive = trio.open_memory_channel[outcome.Outcome](math.inf)
        self._on_value = on_value
        self._on_value_failed = False
        self.stop = False
        self.ended = False

    def _put(self, result: outcome.Outcome) -> None:  # event loop, via run_sync_soon
        self._send.send_nowait(result)

    def _take(self, value: Any) -> None:  # event loop, via run_sync_soon: an emitted value, to `on_value`
        if self._on_value_failed:
            return  # the job was asked to stop; what it still emits is dropped
        try:
            self._on_value(value)  # type: ignore[misc]
        except Exception as exc:
            # Never out of a run_sync_soon callback (that would crash the event loop): `next` raises it, in the
            # caller's task. The job is asked to stop, and `close` still waits for it to return.
            self._on_value_failed = True
            self.stop = True
            self._send.send_nowait(outcome.Value(_OnValueFailed(exc)))

    async def next(self) -> Any:
        """The next emitted result; None once the job has returned. The job's exception, if it raised."""
        if self.ended:
            return None
        result = await self._receive.receive()
        if isinstance(result, outcome.Value) and result.value is StepStream._END:
            self.ended = True
            return None
        if isinstance(result, outcome.Value) and isinstance(result.value, _OnValueFailed):
            raise result.value.error
        if isinstance(result, outcome.Error):
            self.ended = True
        return result.unwrap()

    async def close(self) -> None:
        """Stop the job after its current step and wait for it to return, even when cancelled: a forward pass
        writes caches, and the next user of those slots must not start before it has ended. Results not yet
        taken are dropped."""
        self.stop = True
        with trio.CancelScope(shield=True):
            while not self.ended:
                try:
                    await self.next()
                except Exception:  # the job's own failure; the caller has stopped listening
                    pass


class ForwardThread:
    def __init__(self, name: str = "pantheon-forward") -> None:
        self._name = name
        self._jobs: queue.SimpleQueue[tuple[Callable[..., Any], tuple[Any, ...], _Deliver] | None] = \
            queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()

    def _serve(self) -> None:
        while True:
            job = self._jobs.get()
            if job is None:
                return
            fn, args, deliver = job
            try:
                deliver(outcome.capture(fn, *args))
            except trio.RunFinishedError:  # the event loop is gone; nobody is waiting
                pass
            # Not held while the thread waits for the next job: the last job's closures reach its scheduler
            # and model, which an unload must be able to free (the thread outlives every model it served).
            del job, fn, args, deliver

    def _ensure_started(self) -> None:
        with self._lock:
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(target=self._serve, name=self._name, daemon=True)
                self._thread.start()

    def has_queued(self) -> bool:
        """Whether jobs wait behind the running one (a stream ends early for them)."""
        return not self._jobs.empty()

    async def run(self, fn: Callable[..., Any], *args: Any) -> Any:
        """fn(*args) on the forward thread; its result or exception. Not abandoned on cancellation: like
        `trio.to_thread.run_sync`, a cancelled caller still waits for a started forward pass to end, because
        the pass writes the caches its slots own."""
        await trio.lowlevel.checkpoint_if_cancelled()
        self._ensure_started()
        token, task = trio.lowlevel.current_trio_token(), trio.lowlevel.current_task()
        self._jobs.put((fn, args, lambda result: token.run_sync_soon(trio.lowlevel.reschedule, task, result)))
        return await trio.lowlevel.wait_task_rescheduled(lambda _: trio.lowlevel.Abort.FAILED)

    def stream(self, fn: Callable[..., Any], *args: Any, on_value: Callable[[Any], None] | None = None
               ) -> StepStream:
        """Start fn(emit, stream, *args) on the forward thread (from the event loop): each emit(x) hands x to
        `StepStream.next` at once, while fn goes on. The caller must `await stream.close()` when done with it
        (in a finally: it waits for fn to return).

        With `on_value`, each emitted x is given to on_value(x) on the event loop as it arrives, in order, in
        the wake-up that brings it, and `next` only reports the end (or raises what on_value raised): the
        values skip a turn of the caller's task, one scheduling round of the event loop per value."""
        self._ensure_started()
        stream = StepStream(on_value)
        token = trio.lowlevel.current_trio_token()

        def emit(value: Any) -> None:
            if on_value is not None:
                token.run_sync_soon(stream._take, value)
            else:
                token.run_sync_soon(stream._put, outcome.Value(value))

        def finish(result: outcome.Outcome) -> None:
            token.run_sync_soon(stream._put, outcome.Value(StepStream._END) if isinstance(result, outcome.Value)
                                else result)

        self._jobs.put((fn, (emit, stream, *args), finish))
        return stream

    def close(self) -> None:
        """Let the thread end once the jobs already queued are done."""
        with self._lock:
            if self._thread is not None:
                self._jobs.put(None)
                self._thread = None
