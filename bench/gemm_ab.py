"""A/B of two versions of `kernels/cpu/int8dot.py`'s gemm in one process: the kernels alone, then the decode step.

    .venv/bin/python bench/gemm_ab.py OLD_FILE [--rounds 7] [--step-rounds 8] [--batches 1,4,8,9,16]
    git show HEAD~1:pantheon/kernels/cpu/int8dot.py > /tmp/old_int8dot.py
    .venv/bin/python bench/gemm_ab.py /tmp/old_int8dot.py

OLD_FILE is imported as a module of its own (the rest of the package shared) beside the checkout's int8dot.
First the kernels: each version's `_gemm_groups` (what a compiled matmul's gemm runs for a chunk of weight
groups) on a random 1536 x 576 Q4_1 and Q8_0 matrix that stays in the caches, one thread, for each batch size,
the two taking turns round by round: GMAC/s and the per-round ratio NEW / OLD, and whether both gave the same
bits. Each version packs the matrix and quantizes the input its own way (`pack_weight`, `quantize_rows` of the
kind its kernels read: `xs_kind`, so OLD_FILE must be of stop 60 or later). Then (unless --step-rounds 0) the
default model's decode step, its gemm address (`DecodePlan.gemm_address`) routed to one version or the other
before each run of `bench.batched`'s decoder (`bench.step_ab.compare`), at batch 1 and 8 on 2 threads: the model's
weights are packed once, by the checkout, so this part runs only where both versions pack alike (checked on the
kernels' matrices). Only changes to the gemm's module can be compared this way; the old file's kernels compile
into the same on-disk cache under its own path.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import numba  # noqa: E402
import numpy as np  # noqa: E402

ROWS, COLS = 1536, 576
_Q4_1, _Q8_0 = 3, 8  # ggml type ids


def _looper(gemm_groups: Any) -> Any:
    """A compiled loop calling `gemm_groups` over every group of the matrix `reps` times."""

    @numba.njit(nogil=True)
    def run(reps, qtype, packed, xq, xd, xs, out):  # type: ignore[no-untyped-def]
        for _ in range(reps):
            gemm_groups(qtype, packed, xq, xd, xs, out, 0, packed.shape[0], 0)

    return run


def _operands(module: Any, gtype: int, packed: np.ndarray, x: np.ndarray) -> tuple[Any, ...]:
    """(qtype, packed, xq, xd, xs): a weight `module` (a version of int8dot) packed and an input it quantizes
    for it."""
    qtype = np.int32(module.kernel_qtype(gtype))
    return (qtype, packed, *module.quantize_rows(x, module.xs_kind(qtype, module.OFFSET_Q8_0)))


def kernel_ab(old: Any, new: Any, batches: list[int], rounds: int) -> tuple[list[dict[str, Any]], bool]:
    """Per weight type and batch size: both modules' `_gemm_groups` on the same matrix and input, each packed and
    quantized by its own module. Also whether the two pack the matrices alike."""
    import gguf

    rng = np.random.default_rng(0)
    runs = {"old": _looper(old._gemm_groups), "new": _looper(new._gemm_groups)}
    modules = {"old": old, "new": new}
    rows, same_packing = [], True
    for name, gtype in (("Q4_1", _Q4_1), ("Q8_0", _Q8_0)):
        raw = gguf.quants.quantize(rng.standard_normal((ROWS, COLS)).astype(np.float32),
                                   gguf.GGMLQuantizationType(gtype)).reshape(ROWS, -1)
        packed = {k: modules[k].pack_weight(gtype, raw) for k in runs}
        same_packing &= bool(np.array_equal(packed["old"], packed["new"]))
        for batch in batches:
            x = rng.standard_normal((batch, COLS)).astype(np.float32)
            operands = {k: _operands(modules[k], gtype, packed[k], x) for k in runs}
            outs = {k: np.zeros((batch, ROWS), np.float32) for k in runs}
            for k, run in runs.items():
                run(1, *operands[k], outs[k])
            same = bool(np.array_equal(outs["old"], outs["new"]))
            reps = max(20, 1600 // batch)
            rates: dict[str, list[float]] = {k: [] for k in runs}
            for r in range(rounds):
                for k in (("old", "new") if r % 2 == 0 else ("new", "old")):
                    start = time.perf_counter()
                    runs[k](reps, *operands[k], outs[k])
                    rates[k].append(reps * ROWS * COLS * batch / (time.perf_counter() - start) / 1e9)
            ratios = [b / a for a, b in zip(rates["old"], rates["new"])]
            row = {"type": name, "batch": batch, "same_bits": same, "old": statistics.median(rates["old"]),
                   "new": statistics.median(rates["new"]), "ratio": statistics.median(ratios)}
            rows.append(row)
            print(f"{name} batch {batch:2d}: old {row['old']:.1f} new {row['new']:.1f} GMAC/s a thread, new / old "
                  f"per round median {row['ratio']:.3f} ({min(ratios):.3f}-{max(ratios):.3f}), same bits {same}",
                  flush=True)
    return rows, same_packing


def step_ab(old: Any, new: Any, rounds: int) -> None:
    """The default model's decode step with each version's gemm (`bench.step_ab.compare`)."""
    from bench.batched import PantheonBatched
    from bench.common import default_model
    from bench.step_ab import compare
    from pantheon.kernels.cpu import decode_layers

    addresses = {"old": old.gemm_address(), "new": new.gemm_address()}
    original = decode_layers.DecodePlan.gemm_address

    def route(name: str) -> None:
        decode_layers.DecodePlan.gemm_address = lambda self, address=addresses[name]: address  # type: ignore

    try:
        compare(PantheonBatched(default_model(), 2), [1, 8], rounds, 96, ("old", "new"), route)
    finally:
        decode_layers.DecodePlan.gemm_address = original  # type: ignore[method-assign]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("old", type=Path, help="another version of pantheon/kernels/cpu/int8dot.py")
    ap.add_argument("--rounds", type=int, default=7, help="kernel rounds per type and batch size")
    ap.add_argument("--step-rounds", type=int, default=8, help="decode-step rounds (0: kernels only)")
    ap.add_argument("--batches", default="1,4,8,9,16")
    args = ap.parse_args()

    from bench.step_ab import load_copy
    from pantheon.kernels.cpu import int8dot

    old = load_copy(args.old, "int8dot_old")
    _, same_packing = kernel_ab(old, int8dot, [int(b) for b in args.batches.split(",")], args.rounds)
    if args.step_rounds and not same_packing:
        print("no decode-step A/B: the two versions pack the weights differently (compare checkouts with "
              "bench/batch_ab.py)")
    elif args.step_rounds:
        step_ab(old, int8dot, args.step_rounds)


if __name__ == "__main__":
    main()
