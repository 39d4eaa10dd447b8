"""A/B of the packed weights on huge pages (`quant.pack_on_huge_pages`, what a load does) against the same bytes
as separate arrays (what it did before), in one process, taking turns run by run.

    .venv/bin/python bench/huge_pages_ab.py [--rounds 10] [--tokens 96] [--levels 1,8]

The model loads as the server loads it; then every packed matrix of its decode plan is also copied into an array
of its own (numpy's allocation: 4 KiB pages below 4 MB), and before each run of `bench.batched`'s in-process
decoder the plan is pointed at one set or the other, the order alternating from round to round. Runs a second
apart in one process see the same machine (these VMs change speed by 10-25% between processes), so the per-round
ratio huge / separate is what this reports. Prints the huge-page bytes the process holds (AnonHugePages): 0 means
the kernel gave none (transparent huge pages off), and the two sets are then alike.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def huge_page_kb() -> int:
    for line in open("/proc/self/smaps_rollup"):
        if line.startswith("AnonHugePages:"):
            return int(line.split()[1])
    return 0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=10)
    ap.add_argument("--tokens", type=int, default=96, help="decode steps a run")
    ap.add_argument("--levels", default="1,8")
    args = ap.parse_args()

    from numba.typed import List

    from bench.batched import PantheonBatched
    from bench.common import default_model
    from bench.step_ab import compare

    engine = PantheonBatched(default_model(), 2)
    plan = engine.model._decode_plan
    if plan is None or plan.ends is None:
        raise SystemExit("the default model's plan does not cover the whole step")
    sets = {"huge": (plan.weights, plan.ends.out_packed)}

    def separate(a: np.ndarray) -> np.ndarray:
        copy = np.array(a)
        copy.flags.writeable = False
        return copy

    lists = []
    for matrices in plan.weights:
        copies = List()
        for a in matrices:
            copies.append(separate(a))
        lists.append(copies)
    sets["separate"] = (tuple(lists), separate(plan.ends.out_packed))
    print(f"AnonHugePages: {huge_page_kb() / 1024:.0f} MiB")

    def use(name: str) -> None:
        plan.weights, plan.ends.out_packed = sets[name]

    compare(engine, [int(v) for v in args.levels.split(",")], args.rounds, args.tokens, ("separate", "huge"), use)


if __name__ == "__main__":
    main()
