"""How much of a decode step waits on its layers' weights coming from memory: the default model's in-process decode
(`bench.batched`) with its real matrices, and with every layer's matrices replaced by the first layer's (the same
shapes, types and arithmetic, 1/30 of the bytes for SmolLM2: they stay in the caches), taking turns run by run in one
process (`bench.step_ab.compare`).

    .venv/bin/python bench/weights_in_cache.py [--levels 1,8] [--rounds 6] [--tokens 96] [--threads 2]

The cached runs' tokens mean nothing (every layer computes with layer 0's weights); only their speed counts. The
output matrix stays the real one (30 MB of Q8_0 for the default model: its rows are the vocabulary). A level whose
step is bound by its weights' bytes speeds up by about its share of the step's weight traffic; one bound by its
arithmetic hardly moves. That is what the 8 / 1 streams ratio of issue #9 rests on: on the 2-core Zen 4 VM
(2026-12-06, 6 rounds, `2026-12-06-weights-in-cache-zen4.json`) batch 1 went 303.1 -> 468.4 tok/s (x1.55 per
round, 1.45-1.60), batch 8 1250.6 -> 1293.7 (x1.03, 1.01-1.07): the single stream waits on memory, eight streams
on the int8 dot products (`bench/int8_ceiling.py`), so the ratio moves with the machine's memory bandwidth against
its arithmetic. Writes bench/results/<date>-weights-in-cache.json.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

REAL, CACHED = "real", "cached"


class LayerSwap:
    """Puts a decode plan's (`decode_layers.DecodePlan`) layer matrices back and forth between the real ones and
    layer 0's for every layer. The plan's typed lists are changed in place: the compiled step reads them on every
    call, so the next step runs on what they hold."""

    def __init__(self, plan: Any) -> None:
        self.lists = plan.weights
        self.real = [list(column) for column in self.lists]

    def use(self, name: str) -> None:
        for column, real in zip(self.lists, self.real):
            for li in range(len(real)):
                column[li] = real[0] if name == CACHED else real[li]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--levels", default="1,8")
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--tokens", type=int, default=96, help="decode steps a run")
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()

    from bench.batched import PantheonBatched
    from bench.common import default_model, write_result
    from bench.step_ab import compare

    engine = PantheonBatched(default_model(), args.threads)
    plan = engine.model._decode_plan
    if plan is None:
        raise SystemExit("this model's decode step is not the compiled one (no int8 kernels on this CPU?)")
    levels = [int(v) for v in args.levels.split(",")]
    rates = compare(engine, levels, args.rounds, args.tokens, (REAL, CACHED), LayerSwap(plan).use)
    rows = []
    for n in levels:
        real, cached = rates[(REAL, n)], rates[(CACHED, n)]
        rows.append({"batch": n, "real_tok_s": real, "cached_tok_s": cached,
                     "cached_over_real": statistics.median(c / r for r, c in zip(real, cached))})
    out = write_result("weights-in-cache", {"args": vars(args), "levels": rows})
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
