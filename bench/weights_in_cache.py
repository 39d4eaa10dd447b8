"""How much of a decode step waits on its weights coming from memory: the default model's in-process decode
(`bench.batched`) with its real matrices, and with some of them swapped for ones that stay in the caches (the same
shapes, types and arithmetic), taking turns run by run in one process (`bench.step_ab.compare`).

    .venv/bin/python bench/weights_in_cache.py [--cached layers|output] [--levels 1,8] [--rounds 6] [--tokens 96]
                                               [--threads 2]

`--cached layers` (the default): every layer reads the first layer's matrices (1/30 of the bytes for SmolLM2);
the output matrix stays the real one. `--cached output`: the layers stay real and the output matrix (30 MB of Q8_0
for the default model, its rows the vocabulary) is read through an alias of the same size whose pages all map one
612 KiB buffer holding its first 612 KiB (`aliased_like`): the same addresses and arithmetic, one buffer's bytes.
The cached runs' tokens mean nothing; only their speed counts. A level whose step is bound by those weights' bytes
speeds up by about their share of the step's weight traffic; one bound by its arithmetic hardly moves. That is
what the 8 / 1 streams ratio of issue #9 rests on: on the 2-core Zen 4 VM (2026-12-06, 6 rounds,
`2026-12-06-weights-in-cache-zen4.json`) the layers in cache took batch 1 from 303.1 to 468.4 tok/s (x1.55 per
round, 1.45-1.60), batch 8 from 1250.6 to 1293.7 (x1.03, 1.01-1.07): the single stream waits on memory, eight
streams on the int8 dot products (`bench/int8_ceiling.py`), so the ratio moves with the machine's memory bandwidth
against its arithmetic. Writes bench/results/<date>-weights-in-cache.json (`--cached output`:
<date>-output-in-cache.json).
"""

from __future__ import annotations

import argparse
import ctypes
import dataclasses
import math
import mmap
import os
import statistics
import sys
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

REAL, CACHED = "real", "cached"
# The output alias's one buffer, at least: stays in L2 (1 MiB a core on the test VMs). For SmolLM2's Q8_0 output
# matrix (packed rows of 4896 bytes; 5472 before 2026-12-07, 700416 bytes then) it takes 626688 bytes.
ALIAS_AT_LEAST = 256 * 1024

_libc = ctypes.CDLL(None, use_errno=True)
_libc.mmap.restype = ctypes.c_void_p
_libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
_MAP_FIXED, _PROT_NONE = 0x10, 0  # Linux; the mmap module exports neither


def alias_bytes_for(real: np.ndarray, at_least: int) -> int:
    """The smallest size >= at_least that is whole pages and whole rows of `real` (a packed matrix's rows are
    groups of output rows with their scales: an alias that cut one would hand the kernel quantized values as
    scales)."""
    unit = math.lcm(mmap.PAGESIZE, real.strides[0])
    return -(-at_least // unit) * unit


def aliased_like(real: np.ndarray, alias_bytes: int) -> np.ndarray:
    """A C-contiguous array of `real`'s shape and dtype whose virtual pages, `alias_bytes` (whole pages and whole
    rows of real: `alias_bytes_for`) at a time, all map one shared buffer holding real's first `alias_bytes` bytes
    (Linux: a memfd mapped again and again over one reserved range). A kernel reading it walks the same addresses
    as over `real` but its bytes come from that one buffer, which stays in the caches. Never unmapped: a bench
    keeps it to the end."""
    if not real.flags.c_contiguous or alias_bytes % mmap.PAGESIZE or alias_bytes % real.strides[0]:
        raise ValueError("the alias takes whole pages and whole rows of a C-contiguous array")
    total = -(-real.nbytes // alias_bytes) * alias_bytes
    fd = os.memfd_create("pantheon-alias")
    try:
        os.ftruncate(fd, alias_bytes)
        base = _libc.mmap(None, total, _PROT_NONE, mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS, -1, 0)
        if base in (None, ctypes.c_void_p(-1).value):
            raise OSError(ctypes.get_errno(), "mmap of the alias's range failed")
        for offset in range(0, total, alias_bytes):
            got = _libc.mmap(base + offset, alias_bytes, mmap.PROT_READ | mmap.PROT_WRITE,
                             mmap.MAP_SHARED | _MAP_FIXED, fd, 0)
            if got != base + offset:
                raise OSError(ctypes.get_errno(), "mmap of the alias's buffer failed")
    finally:
        os.close(fd)  # the mappings keep the buffer
    flat = np.frombuffer((ctypes.c_uint8 * total).from_address(base), dtype=np.uint8)
    first = real.reshape(-1).view(np.uint8)[:alias_bytes]
    flat[:first.size] = first  # every alias of the buffer sees it
    return flat[:real.nbytes].view(real.dtype).reshape(real.shape)


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


class OutputSwap:
    """Puts a decode plan's output matrix (`DecodePlan.ends`) back and forth between the real one and its alias
    (`aliased_like`). The compiled step's arguments are read from the plan on every call (`step_args`)."""

    def __init__(self, plan: Any, alias_at_least: int = ALIAS_AT_LEAST) -> None:
        self.plan = plan
        real = plan.ends.out_packed
        self.alias_bytes = alias_bytes_for(real, alias_at_least)
        alias = aliased_like(real, self.alias_bytes)
        self.ends = {REAL: plan.ends, CACHED: dataclasses.replace(plan.ends, out_packed=alias)}

    def use(self, name: str) -> None:
        self.plan.ends = self.ends[name]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--cached", choices=("layers", "output"), default="layers",
                    help="which weights stay in the caches in the cached runs")
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
    if args.cached == "output" and plan.ends is None:
        raise SystemExit("this model's output matrix is not read by the compiled step")
    swap = LayerSwap(plan) if args.cached == "layers" else OutputSwap(plan)
    rates = compare(engine, levels, args.rounds, args.tokens, (REAL, CACHED), swap.use)
    rows = []
    for n in levels:
        real, cached = rates[(REAL, n)], rates[(CACHED, n)]
        rows.append({"batch": n, "real_tok_s": real, "cached_tok_s": cached,
                     "cached_over_real": statistics.median(c / r for r, c in zip(real, cached))})
    out = write_result("weights-in-cache" if args.cached == "layers" else "output-in-cache", {"args": vars(args), "levels": rows})
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
