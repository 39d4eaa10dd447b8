"""How far batched decode can go on this CPU: the int8 multiply ceiling against the measured decode steps.

At batch 8 a decode step of the default model is compute-bound on a 2-core AVX2 machine: every token needs
its ~135 M multiply-adds, and the int8 kernels (kernels/cpu/int8dot.py) spend one `vpmaddubsw` (AVX2, 32
products) or `vpdpbusd` (VNNI) per 32 of them, plus the adds that widen and sum the products. This bench
measures, on this machine and in one run:

1. the ceiling: independent chains of the dot instruction and the add that accumulates its result (AVX2:
   `vpmaddubsw` + `vpaddw`, the pair the Q4_1 kernel issues per 32 products; VNNI: `vpdpbusd`) on one
   thread, nothing else in the loop: GMAC/s a thread (times the threads for the machine);
2. the int8 matmul kernel at batch 8 on a matrix that stays in the caches (576 x 1536, Q4_1): what the
   kernel's other instructions (activation broadcasts, scaling, the m terms) leave of the ceiling;
3. decode steps of the default model at batch 1 and 8 (2 threads by default, ~100 tokens of context), and
   the 8-stream / 1-stream ratio the ceiling allows: 8 x step(1) / (8 tokens' multiply-adds at the
   ceiling), an upper bound that counts no attention, no norms, no memory traffic.

    .venv/bin/python bench/int8_ceiling.py [--threads 2]
"""

from __future__ import annotations

import argparse
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
from pantheon.kernels.cpu.llvm_ir import call  # noqa: E402

CHAINS = 8  # independent accumulators: enough to cover the instruction's latency
_i8, _i16, _i32, _i64 = ir.IntType(8), ir.IntType(16), ir.IntType(32), ir.IntType(64)
_v16i16 = ir.VectorType(_i16, 16)


def _dot_loop(isa: str, lanes: int):  # type: ignore[no-untyped-def]
    """An intrinsic (iterations) -> int64: CHAINS dot instructions an iteration into CHAINS accumulators, on
    vectors of `lanes` 32-bit lanes (16: 512-bit, VNNI only). The activation operand moves by one byte add an
    iteration so that LLVM cannot hoist the dots out of the loop."""
    v_bytes, v_words = ir.VectorType(_i8, 4 * lanes), ir.VectorType(_i32, lanes)

    @intrinsic
    def dot_loop(typingctx, iterations):  # type: ignore[no-untyped-def]
        def codegen(context, builder, signature, args):  # type: ignore[no-untyped-def]
            n = args[0]
            weights = [ir.Constant(v_bytes, [(3 * k + j) % 15 + 1 for j in range(4 * lanes)]) for k in range(CHAINS)]
            acc_type = v_words if isa == "vnni" else _v16i16
            entry = builder.basic_block
            loop = builder.append_basic_block("loop")
            done = builder.append_basic_block("done")
            builder.branch(loop)
            builder.position_at_end(loop)
            i = builder.phi(_i64)
            x = builder.phi(v_bytes)
            accs = [builder.phi(acc_type) for _ in range(CHAINS)]
            new = []
            for w, acc in zip(weights, accs):
                if isa == "vnni":
                    new.append(call(builder, f"llvm.x86.avx512.vpdpbusd.{32 * lanes}", v_words,
                                    [acc, builder.bitcast(w, v_words), builder.bitcast(x, v_words)]))
                else:
                    new.append(builder.add(acc, call(builder, "llvm.x86.avx2.pmadd.ub.sw", _v16i16, [w, x])))
            x_next = builder.add(x, ir.Constant(v_bytes, [1] * (4 * lanes)))
            i_next = builder.add(i, ir.Constant(_i64, 1))
            builder.cbranch(builder.icmp_signed("<", i_next, n), loop, done)
            i.add_incoming(ir.Constant(_i64, 0), entry)
            i.add_incoming(i_next, loop)
            x.add_incoming(ir.Constant(v_bytes, [1] * (4 * lanes)), entry)
            x.add_incoming(x_next, loop)
            for phi, value in zip(accs, new):
                phi.add_incoming(ir.Constant(acc_type, None), entry)
                phi.add_incoming(value, loop)
            builder.position_at_end(done)
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


def kernel_rate(rows: int = 1536, cols: int = 576, batch: int = 8, seconds: float = 1.0) -> float:
    """GMAC/s of the int8 matmul on one thread, a Q4_1 matrix that stays in the caches, `batch` rows."""
    import gguf

    rng = np.random.default_rng(0)
    raw = gguf.quants.quantize(rng.standard_normal((rows, cols)).astype(np.float32), gguf.GGMLQuantizationType.Q4_1)
    packed = int8dot.pack_weight(int8dot.Q4_1, raw.reshape(rows, -1))
    x = rng.standard_normal((batch, cols)).astype(np.float32)
    out = np.empty((batch, rows), np.float32)
    previous = numba.get_num_threads()
    numba.set_num_threads(1)
    try:
        int8dot.matmul(int8dot.Q4_1, packed, x, out, threads=1)
        calls, start = 0, time.perf_counter()
        while time.perf_counter() - start < seconds:
            int8dot.matmul(int8dot.Q4_1, packed, x, out, threads=1)
            calls += 1
        return calls * rows * cols * batch / (time.perf_counter() - start) / 1e9
    finally:
        numba.set_num_threads(previous)


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
    args = parser.parse_args()
    if int8dot.INT8_ISA is None:
        sys.exit("this CPU has neither AVX2 nor VNNI: the int8 kernels do not run here")
    one = ceiling()
    team = one * args.threads
    kernel = kernel_rate()
    step1, step8, macs = decode_steps(args.threads)
    floor8 = 8 * macs / (team * 1e9)
    in_cache8 = 8 * macs / (kernel * args.threads * 1e9)
    width = " on 512-bit vectors" if int8dot.INT8_WIDE else ""
    print(f"instruction set: {int8dot.INT8_ISA}{width}; threads {args.threads}")
    print(f"ceiling (dot + add chains): {one:.1f} GMAC/s a thread, {team:.1f} for {args.threads}")
    print(f"int8 matmul kernel, Q4_1 1536 x 576, batch 8, in cache, one thread: {kernel:.1f} GMAC/s "
          f"({kernel / one:.2f} of the ceiling)")
    print(f"decode step: batch 1 {step1 * 1e3:.2f} ms, batch 8 {step8 * 1e3:.2f} ms -> 8 streams / 1 = "
          f"{8 * step1 / step8:.2f}")
    print(f"{macs / 1e6:.1f} M multiply-adds a token; 8 tokens at the ceiling: {floor8 * 1e3:.2f} ms -> at most "
          f"{8 * step1 / floor8:.2f}x with everything else free; at the kernel's in-cache rate "
          f"({kernel * args.threads:.0f} GMAC/s): {in_cache8 * 1e3:.2f} ms -> at most {8 * step1 / in_cache8:.2f}x")
    path = write_result("int8-ceiling", {
        "threads": args.threads, "instruction_set": int8dot.INT8_ISA, "wide_512": int8dot.INT8_WIDE,
        "ceiling_gmac_s_one_thread": one,
        "kernel_q4_1_batch8_in_cache_gmac_s": kernel, "step_batch1_ms": step1 * 1e3, "step_batch8_ms": step8 * 1e3,
        "ratio_8_to_1": 8 * step1 / step8, "macs_per_token": macs, "bound_at_ceiling": 8 * step1 / floor8,
        "bound_at_kernel_in_cache": 8 * step1 / in_cache8})
    print(f"written to {path}")


if __name__ == "__main__":
    main()
