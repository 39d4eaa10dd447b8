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


async def test_a_stream_hands_over_each_result_as_it_is_emitted() -> None:
    forward = ForwardThread()
    gate = threading.Event()

    def job(emit, stream, n: int) -> None:
        emit("first")
        assert gate.wait(10)  # the caller has the first result while the job still runs
        for i in range(n):
            emit(i)

    stream = forward.stream(job, 3)
    try:
        with trio.fail_after(10):
            assert await stream.next() == "first"
            gate.set()
            assert [await stream.next() for _ in range(4)] == [0, 1, 2, None]
            assert await stream.next() is None
    finally:
        await stream.close()
    forward.close()


async def test_a_stream_job_that_raises_ends_the_stream_with_its_error() -> None:
    forward = ForwardThread()

    def job(emit, stream) -> None:
        emit(1)
        raise ValueError("bad step")

    stream = forward.stream(job)
    with trio.fail_after(10):
        assert await stream.next() == 1
        with pytest.raises(ValueError, match="bad step"):
            await stream.next()
        assert await stream.next() is None
    await stream.close()
    assert await forward.run(lambda: "after") == "after"
    forward.close()


async def test_a_stream_with_on_value_hands_each_value_over_on_the_event_loop_in_order() -> None:
    forward = ForwardThread()
    loop_thread = threading.get_ident()
    taken: list[tuple[int, bool]] = []

    def job(emit, stream, n: int) -> None:
        for i in range(n):
            emit(i)
            time.sleep(0.002)

    stream = forward.stream(job, 5, on_value=lambda v: taken.append((v, threading.get_ident() == loop_thread)))
    try:
        with trio.fail_after(10):
            assert await stream.next() is None  # values never come out of next(): only the end does
    finally:
        await stream.close()
    assert taken == [(i, True) for i in range(5)]
    forward.close()


async def test_an_on_value_that_raises_stops_the_job_and_next_raises_it() -> None:
    """The error surfaces in the caller's task (not in the event loop's callback), the job is asked to stop,
    later values are dropped, and close() still waits for the job to return."""
    forward = ForwardThread()
    taken: list[int] = []
    returned = threading.Event()

    def job(emit, stream) -> None:
        i = 0
        while not stream.stop:
            emit(i)
            i += 1
            time.sleep(0.005)
        time.sleep(0.1)
        emit(-1)
        returned.set()

    def on_value(v: int) -> None:
        if v == 3:
            raise KeyError("bad value")
        taken.append(v)

    stream = forward.stream(job, on_value=on_value)
    with trio.fail_after(10):
        with pytest.raises(KeyError, match="bad value"):
            await stream.next()
        assert stream.stop
        await stream.close()
    assert returned.is_set() and stream.ended and taken == [0, 1, 2]
    assert await forward.run(lambda: "after") == "after"
    forward.close()


async def test_closing_a_stream_stops_the_job_and_waits_for_it_even_when_cancelled() -> None:
    """close() sets `stop` (the job ends at its next check) and, shielded, waits until the job has returned."""
    forward = ForwardThread()
    steps: list[int] = []

    def job(emit, stream) -> None:
        while not stream.stop:
            time.sleep(0.02)
            steps.append(len(steps))
            emit(len(steps))
        time.sleep(0.2)  # the last step still running when close() is called
        steps.append(-1)

    stream = forward.stream(job)
    with trio.move_on_after(0.1) as scope:
        try:
            await trio.sleep_forever()
        finally:
            await stream.close()
    assert scope.cancelled_caught and steps[-1] == -1 and stream.ended
    assert await forward.run(lambda: "after") == "after"
    forward.close()


async def test_the_thread_lets_go_of_a_finished_jobs_arguments() -> None:
    """The thread outlives every model it serves: it held its last job (a stream's closures, which reach the
    scheduler and the model) while it waited for the next one, so an unloaded model stayed in memory."""
    import gc
    import weakref

    class Rows:  # no reference cycles: freed by reference counting alone, once nothing holds it
        pass

    thread = ForwardThread()
    rows = Rows()
    gone = weakref.ref(rows)
    assert await thread.run(lambda r: 7, rows) == 7
    stream = thread.stream(lambda emit, stream, r: emit(1), rows)
    assert await stream.next() == 1
    await stream.close()
    del rows, stream
    gc.disable()
    try:
        with trio.fail_after(5):
            while gone() is not None:  # the thread drops them right after delivering the outcome
                await trio.sleep(0.01)
    finally:
        gc.enable()
    thread.close()
