"""What each thread of a real `pantheon serve` costs per streamed token: CPU time a thread took while N streams
decoded, over the tokens they received, and (with perf or py-spy) where the event loop spends its share.

    .venv/bin/python bench/server_threads.py [--streams 8] [--tokens 256] [--seconds 25] [--perf] [--py-spy PATH]

The server serves the default model (2 threads, --max-concurrent N); after two warm-up rounds, rounds of N
streamed greedy chat completions (`bench.concurrency.run_level`, end tokens forbidden) run for --seconds. Each
thread's user + system time comes from /proc/<pid>/task/<tid>/stat before and after. On the 2-core machines
every microsecond the event loop or the client takes comes out of the decode step's thread team, whose members
show ~1 s of CPU a second because they spin at their barriers. With --perf, `perf record` samples the event loop
thread's CPU meanwhile and its samples are printed by shared object (libpython: its Python; the kernel: its
syscalls). With --py-spy (the path of a py-spy binary), py-spy samples the server (`record --threads --format
raw`) and the event loop thread's frames are printed by the share of its samples that are not an idle wait in
epoll. Those are wall time, not CPU time: a thread waiting for a core counts where it stands, and a socket write
that wakes the client can hand the client the loop's core inside the call (on the 2-core Zen 4 VM, 2026-12-06,
70% of its samples sat in the socket write while perf found 73-75% of the loop's CPU in libpython).
"""

from __future__ import annotations

import argparse
import collections
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import default_model, stat_cpu_s, write_result  # noqa: E402
from bench.concurrency import end_token_ids, run_level  # noqa: E402
from bench.http_ab import ROOT, start  # noqa: E402

_IDLE_FRAME = "get_events"  # trio's epoll wait: the event loop with nothing to do


def thread_cpu_s(pid: int) -> dict[tuple[int, str], float]:
    """(thread id, name) -> user + system CPU seconds so far, for each live thread of process `pid`."""
    times = {}
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            cpu = stat_cpu_s(Path(f"/proc/{pid}/task/{tid}/stat"))
            name = Path(f"/proc/{pid}/task/{tid}/comm").read_text().strip()
        except OSError:  # the thread ended meanwhile
            continue
        times[(int(tid), name)] = cpu
    return times


def busy_frames(raw: str, tid: int, top: int = 25) -> tuple[int, list[tuple[str, float]]]:
    """From py-spy's raw output: thread `tid`'s samples outside the idle epoll wait, and each function's share
    of them (counted once a sample, wherever it sits in the stack)."""
    counts: collections.Counter[str] = collections.Counter()
    busy = 0
    for line in raw.splitlines():
        stack, _, n = line.rpartition(" ")
        if not stack.startswith(f"thread ({tid})") or not n.isdigit():
            continue
        frames = [re.sub(r" \((?:.*/)?([^/:]+):\d+\)$", r" (\1)", f) for f in stack.split(";")[1:]]
        if not frames or _IDLE_FRAME in frames[-1]:
            continue
        busy += int(n)
        for frame in set(frames):
            counts[frame] += int(n)
    return busy, [(frame, c / busy) for frame, c in counts.most_common(top)] if busy else []


def dso_shares(report: str) -> list[tuple[str, float]]:
    """(shared object, share of the samples) from `perf report --stdio --sort dso`'s table, largest first."""
    shares = []
    for line in report.splitlines():
        fields = line.split()
        if len(fields) >= 2 and not line.lstrip().startswith("#") and fields[0].endswith("%"):
            shares.append((" ".join(fields[1:]), float(fields[0][:-1]) / 100.0))
    return sorted(shares, key=lambda item: -item[1])


def thread_rows(before: dict[tuple[int, str], float], after: dict[tuple[int, str], float], tokens: int,
                event_loop: int) -> list[dict[str, object]]:
    """The threads that took at least 10 ms of CPU between the two readings, most first, with their CPU a token."""
    rows = []
    for key in sorted(after, key=lambda k: before.get(k, 0.0) - after[k]):
        spent = after[key] - before.get(key, 0.0)
        if spent >= 0.01:
            rows.append({"tid": key[0], "name": key[1], "event_loop": key[0] == event_loop, "cpu_s": spent,
                         "us_per_token": 1e6 * spent / tokens})
    return rows


def _perf_objects(perf: subprocess.Popen[bytes], data: Path) -> list[tuple[str, float]]:
    """Stop `perf record` and read its samples by shared object."""
    perf.send_signal(signal.SIGINT)
    perf.wait()
    report = subprocess.run(["perf", "report", "-i", str(data), "--stdio", "--sort", "dso"], capture_output=True,
                            text=True).stdout
    return dso_shares(report)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--streams", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=256)
    parser.add_argument("--seconds", type=float, default=25.0)
    parser.add_argument("--perf", action="store_true", help="perf record the event loop thread's CPU meanwhile")
    parser.add_argument("--py-spy", default=None, help="a py-spy binary: sample the server while it decodes")
    args = parser.parse_args()
    server = start(ROOT, {}, args.streams)
    try:
        assert server.proc is not None
        pid = server.proc.pid
        bias = {str(t): -100.0 for t in end_token_ids(default_model())}
        for _ in range(2):
            run_level(server, args.streams, 64, bias)
        with tempfile.TemporaryDirectory() as scratch:
            spy_out = Path(scratch) / "spy.txt"
            spy = None
            if args.py_spy:
                spy = subprocess.Popen([args.py_spy, "record", "--pid", str(pid), "--threads", "--format", "raw",
                                        "--rate", "250", "--nonblocking", "--duration", str(int(args.seconds) + 2),
                                        "-o", str(spy_out)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
                time.sleep(1.0)
            perf_data = Path(scratch) / "loop.perf"
            perf = None
            if args.perf:
                perf = subprocess.Popen(["perf", "record", "-q", "-F", "2000", "-t", str(pid), "-o", str(perf_data)],
                                        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
                time.sleep(1.0)
            before, began, tokens, rates = thread_cpu_s(pid), time.monotonic(), 0, []
            while time.monotonic() - began < args.seconds:
                level = run_level(server, args.streams, args.tokens, bias)
                tokens += level["completion_tokens"]
                rates.append(level["aggregate_decode_tok_s"])
            after, wall = thread_cpu_s(pid), time.monotonic() - began
            print(f"{args.streams} streams, {wall:.1f} s, {tokens} tokens, aggregate decode tok/s per round: "
                  f"{', '.join(f'{r:.0f}' for r in rates)}")
            threads = thread_rows(before, after, tokens, pid)
            for row in threads:
                print(f"  thread {row['tid']} ({row['name']}): {row['cpu_s']:.2f} s of CPU, "
                      f"{row['us_per_token']:.1f} us a token")
            objects = _perf_objects(perf, perf_data) if perf is not None else []
            if objects:
                print(f"event loop (thread {pid}), perf's CPU samples by shared object:")
                for name, share in objects[:8]:
                    print(f"  {100 * share:5.1f}%  {name}")
            frames: list[tuple[str, float]] = []
            if spy is not None:
                spy.wait()
                busy, frames = busy_frames(spy_out.read_text(), pid)  # the event loop runs on the main thread
                print(f"event loop (thread {pid}): {busy} busy samples; share of them in each function:")
                for frame, share in frames:
                    print(f"  {100 * share:5.1f}%  {frame}")
        write_result("server-threads", {"args": vars(args), "wall_s": wall, "tokens": tokens, "rates": rates,
                                        "threads": threads, "event_loop_cpu_by_object": objects,
                                        "event_loop_busy_shares": frames})
    finally:
        server.stop()


if __name__ == "__main__":
    main()
