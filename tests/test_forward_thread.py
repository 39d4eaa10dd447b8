"""pantheon.sched.forward_thread: every job on one thread, results and exceptions back to the caller."""

from __future__ import annotations

import threading
import time

import pytest
import trio

from pantheon.sched.forward_thread import ForwardThread


async def test_every_job_runs_on_the_same_thread_in_order() -> None:
    forward = ForwardThread()
    seen: list[tuple[int, int]] = []

    def job(i: int) -> int:
        seen.append((i, threading.get_ident()))
        return i * i

    assert [await forward.run(job, i) for i in range(5)] == [0, 1, 4, 9, 16]
    async with trio.open_nursery() as nursery:  # concurrent callers: still one thread
        for i in range(5, 10):
            nursery.start_soon(forward.run, job, i)
    assert len({ident for _, ident in seen}) == 1
    assert seen[0][1] != threading.get_ident()
    forward.close()


async def test_an_exception_reaches_the_caller_and_the_thread_goes_on() -> None:
    forward = ForwardThread()

    def fail() -> None:
        raise ValueError("bad step")

    with pytest.raises(ValueError, match="bad step"):
        await forward.run(fail)
    assert await forward.run(lambda: 7) == 7
    forward.close()


async def test_a_cancelled_caller_waits_for_its_started_job() -> None:
    """A forward pass writes caches: the caller's cancellation cannot abandon it half done."""
    forward = ForwardThread()
    done: list[bool] = []

    def slow() -> str:
        time.sleep(0.3)
        done.append(True)
        return "result"

    start = time.monotonic()
    with trio.move_on_after(0.05) as scope:
        await forward.run(slow)
        await trio.sleep(0)  # the cancellation lands here, once the job is over
    assert scope.cancelled_caught and done and time.monotonic() - start >= 0.3
    assert await forward.run(lambda: "after") == "after"
    forward.close()


async def test_close_then_run_starts_a_new_thread() -> None:
    forward = ForwardThread()
    first = await forward.run(threading.current_thread)
    forward.close()
    first.join(5)
    assert not first.is_alive()
    second = await forward.run(threading.current_thread)
    assert second is not first and second.is_alive()
    forward.close()
