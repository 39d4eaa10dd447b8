"""How far batched decode can go on this CPU: the int8 multiply ceiling against the measured decode steps.

At batch 8 a decode step of the default model is compute-bound on a 2-core AVX2 machine: every token needs
its ~135 M multiply-adds, and the int8 kernels (kernels/cpu/int8dot.py) spend one `vpmaddubsw` (AVX2, 32
products) or `vpdpbusd` (VNNI) per 32 of them, plus the adds that widen and sum the products. This bench
measures, on this machine and in one run:

1. the ceiling: independent chains of the dot instruction and the add that accumulates its result (AVX2:
   `vpmaddubsw` + `vpaddw`, the pair the Q4_1 kernel issues per 32 products; VNNI: `vpdpbusd`) on one
   thread, nothing else in the loop: GMAC/s a thread (times the threads for the machine);
2. with VNNI, the ceiling of the Q4_1 kernel's own instruction mix (`block_work`): per weight block and
   activation row its eight dot instructions (the activation piece a broadcast operand) and the float work
   around them (a conversion, the product of the block scales, an fma, and the m term's fma), the weights
   unpacked from nibbles, everything in L1: what the per-block scaling leaves of item 1, whatever the
   kernel's loads and loop structure; and the same loop with parts of that float work left out
   (`FLOAT_WORK`, wrong values), which shows what each part costs;
3. the int8 matmul kernel itself at batch 8 (Q4_1, 1536 x 576, the same shape as in the decode step's
   gate|up halves) on one thread, called in a compiled loop (`int8dot._gemm_groups`; the activations quantized
   once, outside), on one matrix that stays in the caches and on copies of it that do not (read from memory
   as in a decode step), and on two threads at once, each on its own copies: what the kernel's loads, loop
   and memory traffic leave of item 2;
4. decode steps of the default model at batch 1 and 8 (2 threads by default, ~100 tokens of context), and
   the 8-stream / 1-stream ratio the ceiling allows: 8 x step(1) / (8 tokens' multiply-adds at the
   ceiling), an upper bound that counts no attention, no norms, no memory traffic.

Until 2026-12-05 item 3 timed `int8dot.matmul` called from Python, one call per product: its dispatch,
the activations' quantization and the parallel region's start were ~10% of a call at this size, and the
kernel read as 123-131 GMAC/s a thread instead of 140-145 (Zen 4 VM).

    .venv/bin/python bench/int8_ceiling.py [--threads 2] [--rounds 5]
"""

from __future__ import annotations

import argparse
import functools
import statistics
import sys
import time
from pathlib import Path

import numba
import numpy as np
from llvmlite import ir
from numba import types
from numba.extending import intrinsic

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from bench.batched import PantheonBatched  # noqa: E402
from bench.common import default_model, prompt_tokens, write_result  # noqa: E402
from pantheon.kernels.cpu import int8dot  # noqa: E402
from pantheon.kernels.cpu.llvm_ir import call, counted_loop, fma, splat  # noqa: E402

CHAINS = 8  # independent accumulators: enough to cover the instruction's latency
_i8, _i16, _i32, _i64 = ir.IntType(8), ir.IntType(16), ir.IntType(32), ir.IntType(64)
_f32 = ir.FloatType()
_v16i16 = ir.VectorType(_i16, 16)


def _dot_loop(isa: str, lanes: int):  # type: ignore[no-untyped-def]
    """An intrinsic (iterations) -> int64: CHAINS dot instructions an iteration into CHAINS accumulators, on
    vectors of `lanes` 32-bit lanes (16: 512-bit, VNNI only). The activation operand moves by one byte add an
    iteration so that LLVM cannot hoist the dots out of the loop."""
    v_bytes, v_words = ir.VectorType(_i8, 4 * lanes), ir.VectorType(_i32, lanes)

    @intrinsic
    def dot_loop(typingctx, iterations):  # type: ignore[no-untyped-def]
        def codegen(context, builder, signature, args):  # type: ignore[no-untyped-def]
            weights = [ir.Constant(v_bytes, [(3 * k + j) % 15 + 1 for j in range(4 * lanes)]) for k in range(CHAINS)]
            acc_type = v_words if isa == "vnni" else _v16i16

            def body(i, carried):  # type: ignore[no-untyped-def]
                x, accs = carried[0], carried[1:]
                new = []
                for w, acc in zip(weights, accs):
                    if isa == "vnni":
                        new.append(call(builder, f"llvm.x86.avx512.vpdpbusd.{32 * lanes}", v_words,
                                        [acc, builder.bitcast(w, v_words), builder.bitcast(x, v_words)]))
                    else:
                        new.append(builder.add(acc, call(builder, "llvm.x86.avx2.pmadd.ub.sw", _v16i16, [w, x])))
                return [builder.add(x, ir.Constant(v_bytes, [1] * (4 * lanes))), *new]

            starts = [ir.Constant(v_bytes, [1] * (4 * lanes))] + [ir.Constant(acc_type, None)] * CHAINS
            new = counted_loop(builder, args[0], starts, body)[1:]
            total = new[0]
            for value in new[1:]:
                total = builder.add(total, value)
            return builder.sext(builder.extract_element(total, ir.Constant(_i32, 0)), _i64)

        return types.int64(iterations), codegen

    return dot_loop


def ceiling(iterations: int = 20_000_000) -> float:
    """GMAC/s of the dot instruction + its add on one thread (best of 3). The machine's ceiling is this times
    the threads: the 2 vCPUs here are separate cores (the same kernel runs as fast on both at once). On the
    vector width the kernels use: 512 bits where int8dot.INT8_WIDE."""
    lanes = 16 if int8dot.INT8_WIDE else 8
    dot_loop = _dot_loop(int8dot.INT8_ISA or "avx2", lanes)

    @numba.njit(nogil=True)
    def one(n):  # type: ignore[no-untyped-def]
        return dot_loop(n)

    one(1000)
    best = 0.0
    for _ in range(3):
        start = time.perf_counter()
        one(iterations)
        best = max(best, iterations * CHAINS * 4.0 * lanes / (time.perf_counter() - start) / 1e9)
    return best


# The float work per block and activation row in `_block_work_loop`: "all" is the kernel's; the others leave parts
# of it out (wrong values, timing only), to show what the kernel's rate pays for it.
FLOAT_WORK = {
    "all": "the kernel's: conversion, d_w * d_x, fma, the m term's fma",
    "no_m_term": "without the m term's fma",
    "no_scales_product": "without d_w * d_x (the sum times d_w)",
    "convert_fma": "a conversion and one fma",
    "convert_add": "a conversion and an add",
    "none": "the integer sums added as they are",
}


def _block_work_loop(lanes: int, float_work: str = "all"):  # type: ignore[no-untyped-def]
    """An intrinsic (iterations, nibbles, xq, scales) -> float32: the Q4_1 kernel's arithmetic per weight block
    (`int8dot._row_block` and its m terms) on `lanes`-lane vectors, 8 activation rows, every operand in L1.
    Per block: 4 nibble vectors loaded and unpacked (and, shift) into the 8 weight vectors and the block's d and
    m scales (lanes of float32); per activation row, 8 `vpdpbusd` with the row's 4-byte pieces as broadcast
    operands, then `float_work` (`FLOAT_WORK`; the kernel's: one conversion of the integer sum, d_w * d_x, an fma
    into the row's accumulator, and the m term's fma, m_w * s_x, into the same). Iteration i reads block i % 8 of
    the operands (LLVM cannot hoist the loads)."""
    if float_work not in FLOAT_WORK:
        raise ValueError(f"float_work {float_work!r}: one of {', '.join(FLOAT_WORK)}")
    v_bytes, v_words, v_f32 = ir.VectorType(_i8, 4 * lanes), ir.VectorType(_i32, lanes), ir.VectorType(_f32, lanes)
    rows = 8

    @intrinsic
    def block_work(typingctx, iterations, nibbles, xq, scales):  # type: ignore[no-untyped-def]
        def codegen(context, builder, signature, args):  # type: ignore[no-untyped-def]
            w, x, d = (context.make_array(t)(context, builder, v) for t, v in zip(signature.args[1:], args[1:]))
            wp, xp = (builder.bitcast(a.data, _i8.as_pointer()) for a in (w, x))
            dp = builder.bitcast(d.data, _f32.as_pointer())

            def load(ptr, offset, ty):  # type: ignore[no-untyped-def]
                return builder.load(builder.bitcast(builder.gep(ptr, [offset]), ty.as_pointer()), align=1)

            def k(value: int) -> ir.Constant:
                return ir.Constant(_i64, value)

            def body(i, accs):  # type: ignore[no-untyped-def]
                block = builder.and_(i, k(7))
                w_base = builder.mul(block, k(16 * lanes))  # 4 nibble vectors of 4 * lanes bytes a block
                s_base = builder.mul(block, k(2 * lanes + 2 * rows))  # d_w, m_w (lanes each), d_x, s_x (rows each)
                packed = [load(wp, builder.add(w_base, k(4 * lanes * t)), v_bytes) for t in range(4)]
                weights = [builder.and_(v, ir.Constant(v_bytes, [15] * 4 * lanes)) for v in packed]
                weights += [builder.lshr(v, ir.Constant(v_bytes, [4] * 4 * lanes)) for v in packed]
                d_w = load(dp, s_base, v_f32)
                m_w = load(dp, builder.add(s_base, k(lanes)), v_f32)
                new = []
                for r, acc in enumerate(accs):
                    sums = ir.Constant(v_words, None)
                    for u in range(8):
                        piece = load(xp, builder.add(builder.mul(block, k(32 * rows)), k(32 * r + 4 * u)), _i32)
                        sums = call(builder, f"llvm.x86.avx512.vpdpbusd.{32 * lanes}", v_words,
                                    [sums, builder.bitcast(weights[u], v_words),
                                     builder.bitcast(splat(builder, piece, lanes), v_words)])
                    if float_work in ("all", "no_m_term"):
                        d_x = builder.load(builder.gep(dp, [builder.add(s_base, k(2 * lanes + r))]))
                        acc = fma(builder, builder.sitofp(sums, v_f32), builder.fmul(d_w, splat(builder, d_x, lanes)),
                                  acc)
                    elif float_work in ("no_scales_product", "convert_fma"):
                        acc = fma(builder, builder.sitofp(sums, v_f32), d_w, acc)
                    elif float_work == "convert_add":
                        acc = builder.fadd(acc, builder.sitofp(sums, v_f32))
                    else:
                        acc = builder.fadd(acc, builder.bitcast(sums, v_f32))
                    if float_work in ("all", "no_scales_product"):
                        s_x = builder.load(builder.gep(dp, [builder.add(s_base, k(2 * lanes + rows + r))]))
                        acc = fma(builder, m_w, splat(builder, s_x, lanes), acc)
                    new.append(acc)
                return new

            new = counted_loop(builder, args[0], [ir.Constant(v_f32, None)] * rows, body)
            total = new[0]
            for value in new[1:]:
                total = builder.fadd(total, value)
            return builder.extract_element(total, ir.Constant(_i32, 0))

        return types.float32(iterations, nibbles, xq, scales), codegen

    return block_work


@functools.cache
def _block_work_runner(lanes: int, float_work: str):  # type: ignore[no-untyped-def]
    """`_block_work_loop` in a compiled function, made once per variant: every round reuses it."""
    block_work = _block_work_loop(lanes, float_work)

    @numba.njit(nogil=True)
    def run(n, nibbles, xq, scales):  # type: ignore[no-untyped-def]
        return block_work(n, nibbles, xq, scales)

    return run


def block_work_ceiling(iterations: int = 1_000_000, float_work: str = "all") -> float | None:
    """GMAC/s of `_block_work_loop` on one thread (best of 3), on the kernels' vector width; None without VNNI
    (the AVX2 kernel's instruction mix is another)."""
    if int8dot.INT8_ISA != "vnni":
        return None
    lanes = 16 if int8dot.INT8_WIDE else 8
    run = _block_work_runner(lanes, float_work)
    rng = np.random.default_rng(0)
    nibbles = rng.integers(0, 256, 8 * 16 * lanes, dtype=np.uint8)
    xq = rng.integers(-127, 128, 8 * 32 * 8, dtype=np.int8)
    scales = rng.random(8 * (2 * lanes + 16), dtype=np.float32)
    run(100, nibbles, xq, scales)
    best = 0.0
    for _ in range(3):
        start = time.perf_counter()
        run(iterations, nibbles, xq, scales)
        best = max(best, iterations * 8 * 32 * lanes / (time.perf_counter() - start) / 1e9)
    return best


@numba.njit(nogil=True, parallel=True)
def _gemm_loop(calls, qtype, mats, xq, xd, xs, outs):  # type: ignore[no-untyped-def]
    """Each thread t (as many as outs has rows) calls the serial gemm `calls` times, on mats[t], mats[t + T],
    ... in turn (T threads): with one matrix per thread it stays in the caches, with many it is read from
    memory."""
    n_threads = outs.shape[0]
    for t in numba.prange(n_threads):
        for c in range(calls):
            packed = mats[(c * n_threads + t) % len(mats)]
            int8dot._gemm_groups(qtype, packed, xq, xd, xs, outs[t], 0, packed.shape[0], 0)


def kernel_rates(rows: int = 1536, cols: int = 576, batch: int = 8, threads: int = 2,
                 memory_bytes: float = 96e6) -> dict[str, float]:
    """GMAC/s a thread of the int8 matmul kernel on a Q4_1 matrix, `batch` activation rows, best of 5: in cache
    on one thread, from memory on one thread, from memory on `threads` threads at once (copies of the matrix
    filling `memory_bytes`, more than the L3 of these machines)."""
    import gguf
    from numba.typed import List

    rng = np.random.default_rng(0)
    raw = gguf.quants.quantize(rng.standard_normal((rows, cols)).astype(np.float32), gguf.GGMLQuantizationType.Q4_1)
    packed = int8dot.pack_weight(int8dot.Q4_1, raw.reshape(rows, -1))
    xq, xd, xs = int8dot.quantize_rows(rng.standard_normal((batch, cols)).astype(np.float32))
    qtype = np.int32(int8dot.Q4_1)
    copies = List([packed.copy() for _ in range(max(2 * threads, int(memory_bytes // packed.nbytes)))])
    previous = numba.get_num_threads()
    rates = {}
    try:
        for name, mats, n in (("in_cache_one_thread", List([packed]), 1), ("from_memory_one_thread", copies, 1),
                              (f"from_memory_{threads}_threads", copies, threads)):
            numba.set_num_threads(n)
            outs = np.empty((n, batch, rows), np.float32)
            calls = max(2 * len(mats) // n, 200)
            _gemm_loop(2, qtype, mats, xq, xd, xs, outs)
            best = 0.0
            for _ in range(5):
                start = time.perf_counter()
                _gemm_loop(calls, qtype, mats, xq, xd, xs, outs)
                best = max(best, calls * rows * cols * batch / (time.perf_counter() - start) / 1e9)
            rates[name] = best
    finally:
        numba.set_num_threads(previous)
    return rates


def decode_steps(threads: int, context: int = 100, steps: int = 100) -> tuple[float, float, float]:
    """(seconds of a decode step at batch 1, at batch 8, multiply-adds per token) on the default model, each
    sequence after `context` prompt tokens (`bench/batched.py`'s decode)."""
    decoder = PantheonBatched(default_model(), threads)
    prompt = prompt_tokens(decoder.served.tokenizer, context)
    step1, step8 = (n / decoder.run([prompt] * n, steps)["decode_tok_s"] for n in (1, 8))
    return step1, step8, _macs_per_token(decoder.model)


def _macs_per_token(model) -> float:  # type: ignore[no-untyped-def]
    """Multiply-adds of one token through the weight matrices (the layers' and the output's)."""
    total = 0
    for blk in model.blocks:  # the separate matrices have the stacked ones' shapes
        for w in (blk.wq, blk.wk, blk.wv, blk.wo, blk.w_gate, blk.w_up, blk.w_down):
            total += w.rows * w.cols
    total += model.output.rows * model.output.cols
    return float(total)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    if int8dot.INT8_ISA is None:
        sys.exit("this CPU has neither AVX2 nor VNNI: the int8 kernels do not run here")
    # The VM's speed swings by up to ~25% within minutes, the dot chains' own rate too (2026-12-05, Zen 4: 235
    # and 178 GMAC/s a thread in runs a few minutes apart): the figures are taken in rounds, each round all of
    # them back to back, and the ratios are the medians of each round's own.
    rounds = []
    for _ in range(args.rounds):
        rounds.append({"ceiling": ceiling(), "block_work": block_work_ceiling(), **kernel_rates(threads=args.threads),
                       **{f"block_work_{name}": block_work_ceiling(float_work=name) for name in FLOAT_WORK
                          if name != "all"}})
    one = statistics.median(r["ceiling"] for r in rounds)
    team = one * args.threads
    kernel = statistics.median(r["in_cache_one_thread"] for r in rounds)
    step1, step8, macs = decode_steps(args.threads)
    floor8 = 8 * macs / (team * 1e9)
    in_cache8 = 8 * macs / (kernel * args.threads * 1e9)
    width = " on 512-bit vectors" if int8dot.INT8_WIDE else ""
    print(f"instruction set: {int8dot.INT8_ISA}{width}; threads {args.threads}")
    ceilings = " ".join(f"{r['ceiling']:.0f}" for r in rounds)
    print(f"ceiling (dot + add chains): {one:.1f} GMAC/s a thread, {team:.1f} for {args.threads} (median; by round "
          f"{ceilings}); each figure below as a fraction of its own round's")
    labels = {"block_work": "the Q4_1 kernel's instruction mix, operands in L1",
              "in_cache_one_thread": "Q4_1 1536 x 576 kernel, batch 8, in cache, one thread",
              "from_memory_one_thread": "the same from memory, one thread",
              f"from_memory_{args.threads}_threads": f"the same from memory, {args.threads} threads at once"}
    for key, label in labels.items():
        if rounds[0][key] is None:
            continue
        rates = [r[key] for r in rounds]
        of_ceiling = statistics.median(r[key] / r["ceiling"] for r in rounds)
        of_mix = (f", {statistics.median(r[key] / r['block_work'] for r in rounds):.2f} of the mix"
                  if key != "block_work" and rounds[0]["block_work"] is not None else "")
        shown = " ".join(f"{v:.0f}" for v in rates)
        print(f"{label}: {shown} GMAC/s a thread by round ({of_ceiling:.2f} of the ceiling{of_mix})")
    if rounds[0]["block_work"] is not None:
        # What the mix's float work costs it: the same loop with parts of that work left out (wrong values).
        print("the mix with less float work (x the kernel's mix, median of the rounds' own ratios):")
        for name, label in FLOAT_WORK.items():
            if name == "all":
                continue
            key = f"block_work_{name}"
            ratio = statistics.median(r[key] / r["block_work"] for r in rounds)
            print(f"  {label}: {statistics.median(r[key] for r in rounds):.0f} GMAC/s a thread, x{ratio:.2f}")
    print(f"decode step: batch 1 {step1 * 1e3:.2f} ms, batch 8 {step8 * 1e3:.2f} ms -> 8 streams / 1 = "
          f"{8 * step1 / step8:.2f}")
    print(f"{macs / 1e6:.1f} M multiply-adds a token; 8 tokens at the ceiling: {floor8 * 1e3:.2f} ms -> at most "
          f"{8 * step1 / floor8:.2f}x with everything else free; at the kernel's in-cache rate "
          f"({kernel * args.threads:.0f} GMAC/s): {in_cache8 * 1e3:.2f} ms -> at most {8 * step1 / in_cache8:.2f}x")
    path = write_result("int8-ceiling", {
        "threads": args.threads, "instruction_set": int8dot.INT8_ISA, "wide_512": int8dot.INT8_WIDE,
        "ceiling_gmac_s_one_thread": one, "rounds_gmac_s": rounds, "kernel_q4_1_batch8_in_cache_gmac_s": kernel,
        "step_batch1_ms": step1 * 1e3, "step_batch8_ms": step8 * 1e3,
        "ratio_8_to_1": 8 * step1 / step8, "macs_per_token": macs, "bound_at_ceiling": 8 * step1 / floor8,
        "bound_at_kernel_in_cache": 8 * step1 / in_cache8})
    print(f"written to {path}")


if __name__ == "__main__":
    main()
