"""What another process's CPU costs the in-process decode: runs with a burner process beside them against runs
without, taking turns in one process.

    .venv/bin/python bench/interference.py [--burst-us 1200] [--period-ms 30] [--rounds 6] [--tokens 128]
                                           [--levels 1,8]

The burner (this file with `--burn`) spins for --burst-us, sleeps out the rest of --period-ms, and again: about
what the server's event loop does at 8 streams (a burst of a few tokens' delivery every stream interval) and
what a client on the same machine does. The decoder is `bench.batched`'s, on the default model with 2 threads;
`bench.step_ab.compare` alternates the two setups run by run. Printed per level: the rates, the per-round ratio
busy / quiet, and that loss over the burner's share of one core (its CPU time over the runs' wall time, from
/proc, which counts in 10 ms ticks: at a 4% share, runs of a few seconds each, or the share is coarse). A loss
equal to the share means the burst cost the step its own length: while the burner holds a core, the member it
displaced is missing at the next barrier and the other member waits there, so the whole team stops
(two cores' worth of time for one core's burst). A loss of half the share would be a team that goes on without
the displaced member.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from bench.common import stat_cpu_s  # noqa: E402  (light: the burner process imports this file too)

QUIET, BUSY = "quiet", "busy"


def burn(burst_s: float, period_s: float, seconds: float) -> None:
    """Spin for burst_s, sleep out the rest of period_s, until `seconds` have passed."""
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        started = time.perf_counter()
        while time.perf_counter() - started < burst_s:
            pass
        time.sleep(max(0.0, period_s - (time.perf_counter() - started)))


class Burner:
    """Starts and stops the burner process; counts its CPU time and the wall time it ran."""

    def __init__(self, burst_us: float, period_ms: float) -> None:
        self.args = [sys.executable, __file__, "--burn", "--burst-us", str(burst_us), "--period-ms", str(period_ms)]
        self.proc: subprocess.Popen[bytes] | None = None
        self.started = 0.0
        self.cpu_at_start = 0.0
        self.cpu_s = 0.0
        self.wall_s = 0.0

    def switch(self, name: str) -> None:
        if name == BUSY and self.proc is None:
            self.proc = subprocess.Popen(self.args)
            time.sleep(0.2)  # past the interpreter's start, which is not counted, before the decode starts
            self.cpu_at_start = stat_cpu_s(Path(f"/proc/{self.proc.pid}/stat"))
            self.started = time.monotonic()
        elif name == QUIET and self.proc is not None:
            self.cpu_s += stat_cpu_s(Path(f"/proc/{self.proc.pid}/stat")) - self.cpu_at_start
            self.wall_s += time.monotonic() - self.started
            self.proc.kill()
            self.proc.wait()
            self.proc = None

    @property
    def share(self) -> float:
        """The burner's CPU time over the wall time it ran: its share of one core."""
        return self.cpu_s / self.wall_s if self.wall_s else 0.0


def loss_over_share(quiet: list[float], busy: list[float], share: float) -> tuple[float, float]:
    """(median per-round loss 1 - busy / quiet, that loss over the burner's share of a core)."""
    loss = statistics.median(1.0 - b / q for q, b in zip(quiet, busy))
    return loss, (loss / share if share else float("nan"))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--burst-us", type=float, default=1200.0)
    ap.add_argument("--period-ms", type=float, default=30.0)
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--tokens", type=int, default=128, help="decode steps a run")
    ap.add_argument("--levels", default="1,8")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--burn", action="store_true", help="be the burner (for 10 minutes at most)")
    args = ap.parse_args()
    if args.burn:
        burn(args.burst_us / 1e6, args.period_ms / 1e3, 600.0)
        return

    from bench.batched import PantheonBatched
    from bench.common import default_model, write_result
    from bench.step_ab import compare

    burner = Burner(args.burst_us, args.period_ms)
    levels = [int(v) for v in args.levels.split(",")]
    try:
        # compare switches before every run, its warm-ups too: BUSY starts the burner, QUIET ends it (and the
        # finally one still running after the last run).
        rates = compare(PantheonBatched(default_model(), args.threads), levels, args.rounds, args.tokens,
                        (QUIET, BUSY), burner.switch)
    finally:
        burner.switch(QUIET)
    rows = []
    for n in levels:
        loss, ratio = loss_over_share(rates[(QUIET, n)], rates[(BUSY, n)], burner.share)
        rows.append({"batch": n, "quiet_tok_s": rates[(QUIET, n)], "busy_tok_s": rates[(BUSY, n)], "loss": loss,
                     "loss_over_share": ratio})
        print(f"batch {n}: loss {loss:.1%} with the burner at {burner.share:.1%} of a core: {ratio:.2f}x its share")
    out = write_result("interference", {"args": vars(args), "burner_share": burner.share, "levels": rows})
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
