"""One long-lived thread per backend for every forward pass (and the load's warm-up forward).

numba's OpenMP threading layer keeps a team of worker threads per calling thread. With two teams alive,
libgomp sees more threads than cores and stops spinning between parallel regions, so each of a decode step's
~150 regions pays a futex wake-up: measured on this 2-core VM, a step on the thread that ran the warm-up
took 6.2 ms, the same step on any other thread 12-15 ms. `trio.to_thread.run_sync` hands jobs to whichever
cached thread is idle (and lets idle ones expire after 10 s), so the forward passes wandered between threads.
Here they never do: one thread, started on first use, runs them all in submission order.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable
from typing import Any

import outcome
import trio


class ForwardThread:
    def __init__(self, name: str = "pantheon-forward") -> None:
        self._name = name
        self._jobs: queue.SimpleQueue[tuple[Callable[..., Any], tuple[Any, ...], trio.lowlevel.TrioToken,
                                            trio.lowlevel.Task] | None] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()

    def _serve(self) -> None:
        while True:
            job = self._jobs.get()
            if job is None:
                return
            fn, args, token, task = job
            result = outcome.capture(fn, *args)
            try:
                token.run_sync_soon(trio.lowlevel.reschedule, task, result)
            except trio.RunFinishedError:  # the event loop is gone; nobody is waiting
                pass

    def _ensure_started(self) -> None:
        with self._lock:
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(target=self._serve, name=self._name, daemon=True)
                self._thread.start()

    async def run(self, fn: Callable[..., Any], *args: Any) -> Any:
        """fn(*args) on the forward thread; its result or exception. Not abandoned on cancellation: like
        `trio.to_thread.run_sync`, a cancelled caller still waits for a started forward pass to end, because
        the pass writes the caches its slots own."""
        await trio.lowlevel.checkpoint_if_cancelled()
        self._ensure_started()
        self._jobs.put((fn, args, trio.lowlevel.current_trio_token(), trio.lowlevel.current_task()))
        return await trio.lowlevel.wait_task_rescheduled(lambda _: trio.lowlevel.Abort.FAILED)

    def close(self) -> None:
        """Let the thread end once the jobs already queued are done."""
        with self._lock:
            if self._thread is not None:
                self._jobs.put(None)
                self._thread = None
