"""bench/server_threads.py's readers: a thread's CPU time from /proc, an event loop's busy samples from py-spy's raw
output, and perf's samples by shared object."""

from __future__ import annotations

import os
import threading
import time

from bench.server_threads import busy_frames, dso_shares, thread_cpu_s, thread_rows


def test_thread_cpu_counts_what_a_thread_spends() -> None:
    main = threading.get_native_id()
    before = thread_cpu_s(os.getpid())
    deadline = time.thread_time() + 0.2
    while time.thread_time() < deadline:  # 0.2 s of this thread's CPU
        pass
    after = thread_cpu_s(os.getpid())
    (key,) = [k for k in after if k[0] == main]
    assert 0.15 <= after[key] - before[key] <= 1.0


def test_busy_frames_leave_out_the_idle_wait_and_other_threads() -> None:
    raw = "\n".join([
        "thread (7): MainThread;run (trio/_core/_run.py:2400);get_events (trio/_core/_io_epoll.py:243) 50",
        "thread (7): MainThread;run (trio/_core/_run.py:2400);_flush (pantheon/sched/scheduler.py:370);"
        "_write_some (pantheon/http/fastsend.py:45) 30",
        "thread (7): MainThread;run (trio/_core/_run.py:2400);_deliver (pantheon/sched/scheduler.py:640) 10",
        "thread (8): pantheon-forward;decode_step (pantheon/kernels/cpu/decode_layers.py:683) 90",
    ])
    busy, frames = busy_frames(raw, 7)
    assert busy == 40
    shares = dict(frames)
    assert shares["run (_run.py)"] == 1.0
    assert shares["_write_some (fastsend.py)"] == 0.75
    assert shares["_deliver (scheduler.py)"] == 0.25
    assert not any("get_events" in f or "decode_step" in f for f in shares)


def test_dso_shares_read_perfs_table() -> None:
    report = """# Samples: 715  of event 'cpu-clock:ppp'
#
# Overhead  Shared Object
# ........  ..................
#
     4.48%  libc.so.6
    74.83%  libpython3.11.so.1.0
    15.94%  [kernel.kallsyms]
     0.56%  [JIT] tid 25626
"""
    shares = dso_shares(report)
    assert [name for name, _ in shares] == ["libpython3.11.so.1.0", "[kernel.kallsyms]", "libc.so.6", "[JIT] tid 25626"]
    assert [round(share, 4) for _, share in shares] == [0.7483, 0.1594, 0.0448, 0.0056]


def test_thread_rows_keep_the_busy_threads_most_first() -> None:
    before = {(1, "loop"): 1.0, (2, "team"): 5.0, (3, "idle"): 0.5}
    after = {(1, "loop"): 1.5, (2, "team"): 9.0, (3, "idle"): 0.505, (4, "new"): 0.2}
    rows = thread_rows(before, after, tokens=1000, event_loop=1)
    assert [(r["tid"], r["event_loop"]) for r in rows] == [(2, False), (1, True), (4, False)]
    assert [round(r["us_per_token"], 6) for r in rows] == [4000.0, 500.0, 200.0]
