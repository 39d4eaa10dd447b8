"""Micro-benchmark of pantheon.kernels.cpu.quant.matmul on SmolLM2-135M shapes.

For each weight and batch size it prints ms per call and GB/s of weight bytes read (quantized bytes / time), next to
numpy float32 `x @ W.T` on a pre-dequantized copy of the same weight (the BLAS ceiling; its GB/s counts its float32
bytes). Weights come from the real model file when it exists (tensors of block 0 and token_embd), else are random.

    .venv/bin/python bench/kernels_matmul.py                    # real Q4_1 / Q8_0 tensors, default thread count
    .venv/bin/python bench/kernels_matmul.py --threads 1
    .venv/bin/python bench/kernels_matmul.py --types Q4_K,Q6_K  # random weights of other types, same shapes
    .venv/bin/python bench/kernels_matmul.py --int8             # int8 activations (Q4_1 / Q8_0: the default path)
    NUMBA_NUM_THREADS=1 OPENBLAS_NUM_THREADS=1 .venv/bin/python bench/kernels_matmul.py --cpu-time   # on a busy box
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from pathlib import Path

import numba
import numpy as np
from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

from pantheon.kernels.cpu import quant
from pantheon.kernels.reference import quant as reference

MODEL = Path.home() / ".cache/pantheon/SmolLM2-135M-Instruct.Q4_1.gguf"
# (name in the GGUF file, rows N, cols K)
SHAPES = [
    ("blk.0.attn_q.weight", 576, 576),
    ("blk.0.ffn_gate.weight", 1536, 576),
    ("blk.0.ffn_down.weight", 576, 1536),
    ("token_embd.weight", 49152, 576),
]
BATCHES = (1, 8, 64, 512)


CLOCK = time.perf_counter


def time_call(fn, min_seconds: float = 0.2, repeats: int = 5) -> float:
    """Median seconds per call over `repeats` runs of enough calls to last min_seconds / repeats each."""
    fn()
    start = CLOCK()
    fn()
    once = max(CLOCK() - start, 1e-6)
    calls = max(1, int(min_seconds / repeats / once))
    samples = []
    for _ in range(repeats):
        start = CLOCK()
        for _ in range(calls):
            fn()
        samples.append((CLOCK() - start) / calls)
    return statistics.median(samples)


def load_weights(types: list[int] | None, rng: np.random.Generator) -> list[tuple[str, quant.QWeight]]:
    weights = []
    if types is None and MODEL.exists():
        from gguf import GGUFReader

        tensors = {t.name: t for t in GGUFReader(MODEL).tensors}
        for name, rows, cols in SHAPES:
            t = tensors[name]
            weights.append((name, quant.prepare_weight(t.data, int(t.tensor_type), rows, cols)))
        return weights
    for qtype in types or [quant.Q4_1]:
        for name, rows, cols in SHAPES:
            qt = quant.Q8_0 if name == "token_embd.weight" and types is None else qtype
            if cols % GGML_QUANT_SIZES[GGMLQuantizationType(qt)][0]:
                continue
            raw = reference.random_weight_bytes(qt, rows, cols, rng)
            weights.append((name, quant.prepare_weight(raw, qt, rows, cols)))
    return weights


def bench_matmul(weights, batches, rng, int8: bool = False) -> None:
    print(
        f"{'tensor':24s} {'type':5s} {'N x K':>11s} {'B':>4s} {'ms':>8s} {'GB/s':>7s} "
        f"{'np ms':>8s} {'np GB/s':>7s} {'np/ours':>7s}"
    )
    for name, w in weights:
        dense = reference.dequantize(w.qtype, w.data)
        for batch in batches:
            x = rng.standard_normal((batch, w.cols)).astype(np.float32)
            out = np.empty((batch, w.rows), dtype=np.float32)
            dense_out = np.empty_like(out)
            t_ours = time_call(lambda: quant.matmul(w, x, out, int8=int8))
            t_np = time_call(lambda: np.matmul(x, dense.T, out=dense_out))
            err = np.linalg.norm(out - dense_out) / max(np.linalg.norm(dense_out), 1e-30)
            # int8 activations round each value to 8 bits: ~0.5-1% from the exact product
            assert err < (0.02 if int8 else 1e-4), f"{name} B={batch}: relative error {err:.2e}"
            print(
                f"{name:24s} {GGMLQuantizationType(w.qtype).name:5s} {w.rows:5d}x{w.cols:<5d} {batch:4d} "
                f"{t_ours * 1e3:8.3f} {w.nbytes / t_ours / 1e9:7.2f} "
                f"{t_np * 1e3:8.3f} {dense.nbytes / t_np / 1e9:7.2f} "
                f"{t_np / t_ours:7.2f}",
                flush=True,
            )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads", type=int, default=None, help="numba threads (default: numba's)")
    parser.add_argument("--types", default=None, help="comma-separated ggml type names: random weights of these types")
    parser.add_argument("--batches", default=",".join(map(str, BATCHES)))
    parser.add_argument("--int8", action="store_true", help="int8 activations (the server's default for Q4_1/Q8_0)")
    parser.add_argument(
        "--cpu-time",
        action="store_true",
        help="time with this thread's CPU clock: steady on a busy machine, only meaningful with NUMBA_NUM_THREADS=1 "
        "OPENBLAS_NUM_THREADS=1",
    )
    args = parser.parse_args()
    if args.cpu_time:
        global CLOCK
        CLOCK = time.thread_time
    if args.threads:
        numba.set_num_threads(args.threads)
    rng = np.random.default_rng(0)
    types = [int(GGMLQuantizationType[t.strip()]) for t in args.types.split(",")] if args.types else None
    weights = load_weights(types, rng)
    print(
        f"numba {numba.__version__}, {numba.get_num_threads()} threads ({numba.config.THREADING_LAYER}), "
        f"numpy {np.__version__}, OPENBLAS_NUM_THREADS={os.environ.get('OPENBLAS_NUM_THREADS', 'unset')}, "
        f"clock={'thread CPU' if args.cpu_time else 'wall'}"
    )
    bench_matmul(weights, [int(b) for b in args.batches.split(",")], rng, int8=args.int8)


if __name__ == "__main__":
    main()
