"""Integer dot products of Q4_1 / Q8_0 (and Q4_0) weight rows with int8-quantized activations (x86 only).

The arithmetic llama.cpp's CPU backend does for these types: each activation row is quantized once per matmul
to blocks of 32 int8 values with the scale stored as float16, as llama.cpp's Q8_0 / Q8_1 blocks do
(`quantize_rows`: round to nearest, q from 127 / max|x|, the scale max|x| / 127 rounded to float16), and a
weight block meets an activation block as 32 int8 x uint8 products summed in int32, scaled once per block in
float32. One VNNI instruction (`vpdpbusd`) does 32 such products and partial sums.

Numba compiles without LLVM's SLP vectorizer and types integer arithmetic as int64, so these loops cannot be
written as numba Python and vectorize. `_make_rows_dot` therefore builds intrinsics that emit the whole loop
over the blocks as LLVM IR on 256-bit vectors. The unit of work is one block of 8 weight rows side by side
(`pack_weight`, done once at load: `QWeight.int8_packed`): weight vector u holds values 4u..4u+3 of the
block in each of the 8 rows (one 32-bit lane per row), and the activation block's values 4u..4u+3 are
broadcast to all lanes, so 8 `vpdpbusd` leave each row's exact integer sum for the block in its own lane. One
conversion and one fma then scale all eight rows at once (a second fma, into its own accumulator, adds Q4_1's
m terms), and after the last block the 8 lanes are the 8 outputs: no horizontal sums, and no padding of K
(an earlier layout put 8 blocks of one row side by side and padded K = 576 from 18 to 24 blocks). Up to 8
activation rows share each weight block's loads and unpacking; a row's float arithmetic is the same whatever
the number of rows (batch invariance).

The instruction set is fixed when this module is imported (`INT8_ISA`): VNNI where the CPU has it
(AVX512-VNNI with VL, the path tested here on Zen 4, or AVX-VNNI), else AVX2's `vpmaddubsw` + `vpmaddwd`
(exact here: the unsigned operand is at most 128, so a pair of products is at most 2 * 128 * 127 < 32767;
Q4_1's pairs are small enough that a block's eight add up in 16 bits before one `vpmaddwd` widens them),
else None and the float path is used. With AVX-512 VNNI (and BW), `INT8_WIDE`: the kernels take two groups
of 8 rows a call on 512-bit vectors, lanes 8..15 the second group's (`_make_rows_dot`'s 16 lanes; on the
2-core Zen 5 VM a batch-8 Q4_1 1536 x 576 matmul in cache went from 179 to 307 GMAC/s a thread, and the
in-process batch-8 decode from ~1150 to ~1400 tok/s before the prefetch below); a matmul of fewer than
`WIDE_MIN_ROWS` activation rows, which waits on memory, stays on 8 lanes. A lane's arithmetic is the same on
either width. The AVX2 kernels, and the 8-lane VNNI ones, are also run on a wide machine by the tests
(`matmul_with_isa`): the integer sums are exact on all, so the bits agree. Numba's on-disk cache is keyed by
CPU name and features, so a cached kernel never runs on a CPU that lacks its instructions.

Per block (the m term of Q4_1 uses the activation block's sum, precomputed by `quantize_rows`):
    Q4_1:  d_w * d_x * sum(q_w * q_x) + m_w * (d_x * sum(q_x))       q_w in 0..15
    Q8_0:  d_w * d_x * sum(q_w * q_x)                               q_w in -128..127
Q8_0 on VNNI takes its weights as q_w + 128 (unsigned: `pack_weight` flips their bytes' top bit) against the
signed activations, and adds -128 * sum(q_x) to each block's sum once it is a float, exactly (`quantize_rows`'
corrections, which the Q8_0 kernels read in place of xs; `_offset_q8_0` says why this way round); on AVX2 the
weights' signs move onto the activations (|q_w| * sign(q_w) q_x) instead, as vpmaddubsw would saturate on
(q_w + 128) * q_x.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

import numba
import numpy as np
from llvmlite import ir
from numba import types
from numba.extending import intrinsic

from pantheon.kernels.cpu import HOST_CPU_FEATURES, HOST_CPU_VENDOR, gemm_call
from pantheon.kernels.cpu.llvm_ir import call, counted_loop, fma, splat

__all__ = ["INT8_ISA", "INT8_TYPES", "matmul", "pack_weight", "quantize_rows"]

Q4_0, Q4_1, Q8_0 = 2, 3, 8
# Q4_0 runs on the Q4_1 kernels: `pack_weight` writes its blocks as Q4_1 ones (`kernel_qtype`).
INT8_TYPES: frozenset[int] = frozenset({Q4_0, Q4_1, Q8_0})
# IQ4_NL's and IQ4_XS's values (int8k): a 4-bit index into this fixed non-uniform table, times the block's scale.
IQ4_VALUES = np.array([-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113], dtype=np.int8)
QK = 32  # values per activation block (and per Q4_1 / Q8_0 weight block)
LANES = 8  # weight rows side by side in the lanes of one vector
# Bytes of one packed block of 8 rows (see `pack_weight`): Q4_1 8 f16 d, 8 f16 m, 128 bytes of nibbles; Q8_0
# 8 f16 d, 256 bytes of values.
Q4_1_GROUP, Q8_0_GROUP = 160, 272
Q8_0_VALUES = 16  # where a packed Q8_0 block's values start


def _detect_isa() -> str | None:
    features = HOST_CPU_FEATURES
    if "+avx512vnni" in features and "+avx512vl" in features or "+avxvnni" in features:
        return "vnni"
    if "+avx2" in features:
        return "avx2"
    return None


INT8_ISA: str | None = _detect_isa()
# VNNI on 512-bit vectors too (AVX-512 VNNI with BW for the byte operations): the kernels then take two groups
# of 8 weight rows a call (`_make_rows_dot`'s 16 lanes), half the instructions for the same products.
INT8_WIDE: bool = INT8_ISA == "vnni" and {"+avx512vnni", "+avx512bw", "+avx512f"} <= HOST_CPU_FEATURES
# Fewer activation rows than this take the 8-lane kernels even where the 16-lane ones exist. With few rows a
# matmul waits on memory, and there one group a call streams the weights faster: on the 2-core Zen 4 VM
# (2026-12-04), 2 threads, Q4_1 matrices of 23 MB from memory, 1 / 2 / 4 rows at 36-59 / 36-37 / 36 GB/s on 8
# lanes against 22-35 / 30-39 / 26-34 on 16 (Q8_0 at 1 row 26-54 against 25-40); at 8 rows 16 lanes were ahead
# (20-23 against 15-21); the default model's single-stream decode 195-220 tok/s against 164-172.
WIDE_MIN_ROWS = 8


def _offset_q8_0(isa: str | None) -> bool:
    """With VNNI, Q8_0 takes its weights as q_w + 128, the unsigned operand, and takes 128 * sum(q_x) off each
    block's sum (the activations' corrections, `XS_CORRECTIONS`, read in place of xs); AVX2's vpmaddubsw would
    saturate on those products, so there the weights' signs move onto the activations instead
    (|q_w| * sign(q_w) q_x).

    The weights, not the activations, are the unsigned side so that an activation piece can be the signed
    operand, which vpdpbusd reads broadcast from memory. With the activations as q_x + 128 (until 2026-12-07)
    each of the 8 pieces of each of the 8 rows was first broadcast into a register of its own: the 16-lane loop
    held 64 broadcasts a block beside its 64 dot products, 236 instructions a block on the 2-core Xeon VM (AMX,
    AVX-512 VNNI, LLVM's "rocketlake" schedule), where it spilled to the stack (12 accesses a block), and 217
    under LLVM's Zen 4 schedule; now 157 and 158, no spill. The packed blocks also lost the 128 * sum(q_w) that
    the old form took off (32 of a group's 304 bytes): the default model's output matrix is 10.5% smaller. The
    same bits as before. On the Xeon VM: the 1536 x 576 Q8_0 matmul in cache, one thread, each version on its
    own packing in turns, batch 1 / 4 / 8 / 16 x1.04 / x0.97 / x1.05 / x1.04; the default model in-process
    (`bench/batch_ab.py --pairs 4 --rounds 4`) batch 1 223 -> 244 tok/s, batch 8 840 -> 875 (every process of
    the new tree above every one of the old); on the 2-core Zen 4 VM the same A/B, batch 1 243 -> 258, batch 8
    1076 -> 1121."""
    return isa == "vnni"


# Whether this CPU's Q8_0 kernels take the weights as the unsigned operand: then `pack_weight` stores Q8_0 values
# as q + 128 (a constant to the compiled code, which reads that packing).
OFFSET_Q8_0: bool = _offset_q8_0(INT8_ISA)
# What a kernel reads in the xs slot of the quantized activations (`quantize_rows`): d * sum(q) per block (Q4_1's
# m terms), the sums of its two 16-value halves of q (int8k's Q6_K and IQ4 on VNNI), or -128 * sum(q) per block
# (offset Q8_0).
XS_SCALED, XS_HALVES, XS_CORRECTIONS = 0, 1, 2


_i1, _i8, _i16, _i32, _i64 = ir.IntType(1), ir.IntType(8), ir.IntType(16), ir.IntType(32), ir.IntType(64)
_f16, _f32 = ir.HalfType(), ir.FloatType()
_v32i8, _v16i16 = ir.VectorType(_i8, 32), ir.VectorType(_i16, 16)
_v8i32, _v8f16, _v8f32 = ir.VectorType(_i32, 8), ir.VectorType(_f16, 8), ir.VectorType(_f32, 8)


def _unsigned_signed_dot(builder: ir.IRBuilder, isa: str, u: ir.Value, s: ir.Value, acc: ir.Value | None
                         ) -> ir.Value:
    """<n x i32>: lane i = acc[i] + sum of u[4i+j] * s[4i+j], j < 4 (u as uint8, s as int8, both <4n x i8>;
    n = 16 on VNNI only)."""
    if isa == "vnni":
        lanes = u.type.count // 4
        ty = ir.VectorType(_i32, lanes)
        start = acc if acc is not None else ir.Constant(ty, None)
        return call(builder, f"llvm.x86.avx512.vpdpbusd.{32 * lanes}", ty,
                     [start, builder.bitcast(u, ty), builder.bitcast(s, ty)])
    pairs = call(builder, "llvm.x86.avx2.pmadd.ub.sw", _v16i16, [u, s])
    dot = call(builder, "llvm.x86.avx2.pmadd.wd", _v8i32, [pairs, ir.Constant(_v16i16, [1] * 16)])
    return dot if acc is None else builder.add(acc, dot)


def _q4_block_sums_avx2(builder: ir.IRBuilder, pairs: list[tuple[ir.Value, ir.Value]]) -> ir.Value:
    """<8 x i32>: a Q4_1 block's eight (nibbles, int8 activations) vector pairs summed per lane, on AVX2.

    `vpmaddubsw` leaves 16-bit sums of two products; with weights 0..15 and activations within +-127 (the
    quantizer's range) one is at most 2 * 15 * 127 = 3810, so all eight pieces' sums fit in 16 bits (30480)
    and add as int16, exactly: one `vpmaddwd` per block widens them, not one per piece (9 multiplies a block
    instead of 16). On Zen 3 (2 threads, batch 8, 1536 x 576) the matmul went from 61 to 73 GMAC/s a thread."""
    chains = []
    for half in (pairs[:4], pairs[4:]):  # two chains of four, for latency
        chain = None
        for u, s in half:
            piece = call(builder, "llvm.x86.avx2.pmadd.ub.sw", _v16i16, [u, s])
            chain = piece if chain is None else builder.add(chain, piece)
        chains.append(chain)
    return call(builder, "llvm.x86.avx2.pmadd.wd", _v8i32,
                [builder.add(chains[0], chains[1]), ir.Constant(_v16i16, [1] * 16)])


def _load(builder: ir.IRBuilder, base: ir.Value, offset: ir.Value, ty: ir.Type) -> ir.Value:
    """A `ty` at byte `offset` of the i8* `base`."""
    ptr = builder.bitcast(builder.gep(base, [offset]), ty.as_pointer())
    return builder.load(ptr, align=1)


def _lanes_reduced(builder: ir.IRBuilder, v: ir.Value, op: Any) -> ir.Value:
    """op over the 8 lanes of v, pairwise (lanes i and i + width, widths 4, 2, 1): a scalar."""
    for width in (4, 2, 1):
        mask_lo = ir.Constant(ir.VectorType(_i32, width), list(range(width)))
        mask_hi = ir.Constant(ir.VectorType(_i32, width), list(range(width, 2 * width)))
        v = op(builder.shuffle_vector(v, v, mask_lo), builder.shuffle_vector(v, v, mask_hi))
    return builder.extract_element(v, ir.Constant(_i32, 0))


def _larger(builder: ir.IRBuilder, a: ir.Value, b: ir.Value) -> ir.Value:
    """Lane-wise a if a > b else b: one vmaxps (NaN lanes are dealt with by the caller)."""
    return builder.select(builder.fcmp_ordered(">", a, b), a, b)


def _group_block_base(j: ir.Value, q4: bool, builder: ir.IRBuilder) -> ir.Value:
    """Byte offset of block j in a packed group of 8 rows."""
    return builder.mul(j, ir.Constant(_i64, Q4_1_GROUP if q4 else Q8_0_GROUP))


# Where the kernels' prefetches of the next group put its bytes (llvm.prefetch's locality), by vector width and CPU
# vendor. On AMD, with 8 lanes non-temporal (prefetchnta; the weights are read once a step): a batch-1 matmul waits
# on memory and reaches the group within about a microsecond. The 16-lane kernels, which take 8 activation rows a
# call (from `WIDE_MIN_ROWS`), spend longer on each block and reach the prefetched group later, and a non-temporal
# line did not wait for them: on the 2-core Zen 4 VM (2026-12-05) the default model's batch-8 output matmul (Q8_0
# 49152 x 576, 30 MB, 2 threads, from memory) took 1.29-1.49 ms with prefetchnta and 0.78-0.96 ms with prefetcht1 /
# prefetcht2 (prefetcht0: 1.34-1.46), its in-cache arithmetic ~0.84 ms; inside the decode step
# (`bench/phase_profile.py --levels 8`, alternating trees, 2 processes each) that matmul went from 4300-4800 to
# 2200-2800 k cycles a step and nothing else moved, and `bench/batch_ab.py --pairs 4 --rounds 4` gave batch-8
# medians 926 -> 1012 tok/s (batch 1 249 / 253), and again 941 -> 1100 (batch 1 281 / 289). (Prefetcht1 at 8 lanes
# too slowed batch 1 by ~9% in the one A/B it had, within this VM's noise.)
#
# On Intel prefetcht1 at both widths. There a non-temporal line goes to L1 without filling L2 or the last level, so
# weights that the last level could hold come from memory again every step: on the 2-core Xeon VM (AMX, 480 MB L3,
# 2026-12-07) prefetchnta against prefetcht0 at 8 lanes, in one process taking turns (`bench/gemm_ab.py`'s step A/B,
# 4 rounds), gave batch-1 decode 85.6 against 195.6 tok/s (x2.33 per round, 2.09-3.07) and batch 8 899.6 / 896.6;
# the 1536 x 576 Q8_0 matmul in cache, one thread, batch 1 54.3 against 71.8 GMAC/s. Prefetcht1 against prefetcht0
# there: batch 1 x1.02 (0.94-1.13), batch 8 x1.01; no prefetch at 8 lanes x0.61 of prefetcht0. `bench/decode.py`
# there, before and after: single stream 77.8 -> 219.7 tok/s (llama.cpp 63.9 / 64.3).
_INTEL = HOST_CPU_VENDOR == "GenuineIntel"
# llvm.prefetch's locality: 0 prefetchnta, 2 prefetcht1
_PREFETCH_LOCALITY = {LANES: 2 if _INTEL else 0, 2 * LANES: 2}


def prefetch_line(builder: ir.IRBuilder, address: ir.Value, lanes: int) -> None:
    """A software prefetch of the cache line at `address` (an i8*) for a kernel of `lanes` lanes: of a weight
    group ahead, where `_PREFETCH_LOCALITY` says. It never faults, past the matrix's end too."""
    # llvm.prefetch(address, read, locality, data cache)
    call(builder, "llvm.prefetch.p0", ir.VoidType(), [address, ir.Constant(_i32, 0),
                                                      ir.Constant(_i32, _PREFETCH_LOCALITY[lanes]),
                                                      ir.Constant(_i32, 1)])


def _prefetch_next_group(builder: ir.IRBuilder, q4: bool, wptr: ir.Value, row_bytes: ir.Value, j: ir.Value,
                         lanes: int) -> None:
    """Ask for block j of the next packed group (the next row of the packed matrix, where a chunk of groups
    goes next; with 16 lanes, of the next two): a group ahead is further than the hardware prefetcher runs. At
    every batch size and on both widths (`prefetch_line`). With one activation row the loop waits on memory:
    the batch-1 decode step on the 2-core Zen 3 VM was 5-16% faster in 9 of 10 rounds of two A/B runs (200
    steps a round). With 16 lanes (`INT8_WIDE`) the loop waits on memory at every batch size: on the 2-core
    Zen 5 VM, 8 sequences decoded in-process at 1723-1818 tok/s with the prefetch at every size against
    1374-1491 with it at one row only (3 alternating runs of 3 rounds, `bench/batched.py`'s loop); two pairs
    ahead measured the same as one (so did two pairs ahead on Zen 4 with prefetcht1). With 8 lanes (AVX2) and
    4 or 8 rows the loop is bound by its arithmetic, but inside a decode step it still waited on the weights:
    `bench/batch_ab.py --pairs 4 --rounds 4` on the 2-core Zen 3 VM (2026-12-04), batch-8 medians 613 ->
    644 tok/s (per process 585-626 -> 631-647), batch 1 unchanged (218 / 221)."""
    group = Q4_1_GROUP if q4 else Q8_0_GROUP
    groups = lanes // LANES
    for step in range(groups, 2 * groups):
        ahead = builder.add(builder.mul(row_bytes, ir.Constant(_i64, step)), _group_block_base(j, q4, builder))
        for line in range(0, group, 64):
            prefetch_line(builder, builder.gep(wptr, [builder.add(ahead, ir.Constant(_i64, line))]), lanes)


def _joined(builder: ir.IRBuilder, a: ir.Value, b: ir.Value) -> ir.Value:
    """The vector a then b (two of one type): lanes 0..n-1 from a, n..2n-1 from b."""
    n = a.type.count
    return builder.shuffle_vector(a, b, ir.Constant(ir.VectorType(_i32, 2 * n), list(range(2 * n))))


def _group_loader(builder: ir.IRBuilder, wptr: ir.Value, row_bytes: ir.Value, lanes: int) -> Any:
    """load(offset, ty): a `ty` at byte `offset` of the packed group at wptr, for 8 lanes; for 16, that and the
    same `ty` of the next group (row_bytes further) side by side: lanes 8..15 are the next 8 weight rows."""

    def load(offset: ir.Value, ty: ir.Type) -> ir.Value:
        value = _load(builder, wptr, offset, ty)
        if lanes == LANES:
            return value
        return _joined(builder, value, _load(builder, wptr, builder.add(offset, row_bytes), ty))

    return load


def _high_nibbles(builder: ir.IRBuilder, v: ir.Value, lanes: int) -> ir.Value:
    """The high nibble of each byte of v (the 4 * lanes bytes of a weight vector), as a byte 0..15.

    On 256-bit vectors a byte shift (LLVM emits `vgf2p8affineqb` where the CPU has GFNI). On 512-bit ones a 32-bit
    shift and a mask (`vpsrld`, `vpandq`): there the batch-8 Q4_1 loop is bound by the 512-bit operations that only
    two of Zen 4's four vector pipes run (`vpdpbusd`, the float multiplies and, as it measures, `vgf2p8affineqb`),
    and a shift and a mask go to the others: 92 of those a block (16 weight rows, 8 activation rows), 88 now. On the
    2-core Zen 4 VM (2026-12-07), the 1536 x 576 Q4_1 matmul in cache on one thread, the two forms in turns
    (`bench/gemm_ab.py`, four runs of 5-21 rounds): batch 8 x1.038, x1.025, x1.007, x1.018 per round (151.4 -> 157.2
    GMAC/s in the first), batch 16 x1.036, x1.025, x1.017; the same at 8 lanes made batch 1 x0.885, so 256-bit
    vectors keep the byte shift. The batch-8 decode step (its Q4_1 matmuls most of it) moved within the host's
    noise (in-process in turns x1.043 and x0.975; `bench/batch_ab.py --pairs 4 --rounds 4` medians 962 -> 997
    tok/s). int8k's 4-bit and 5-bit unpacking in this form measured no gain (batch 8 and 16, 1536 x 1024 in cache:
    Q4_K 0.99, Q5_K and Q5_1 1.00, Q6_K 0.96) and keeps the byte shift."""
    if lanes == LANES:
        return builder.lshr(v, ir.Constant(v.type, [4] * (4 * lanes)))
    words = ir.VectorType(_i32, lanes)  # lane = 4 bytes of one weight row
    shifted = builder.bitcast(builder.lshr(builder.bitcast(v, words), ir.Constant(words, [4] * lanes)), v.type)
    return builder.and_(shifted, ir.Constant(v.type, [15] * (4 * lanes)))


def _weight_block(builder: ir.IRBuilder, isa: str, q4: bool, load: Any, j: ir.Value, lanes: int
                  ) -> tuple[list[ir.Value], ir.Value]:
    """The weight side of block j of a packed group of 8 rows (16 lanes: of two groups, `_group_loader`): the
    eight vectors that meet the broadcast activation pieces 0..7 (Q8_0 on VNNI: q + 128 as packed; on AVX2
    their magnitudes, then the signed values too), and the d scales as float32 (lane = row). Q4_1's m scales
    are read by the second loop (`_m_scales`)."""
    base = _group_block_base(j, q4, builder)
    v_bytes = ir.VectorType(_i8, 4 * lanes)

    def at(offset: int, ty: ir.Type) -> ir.Value:
        return load(builder.add(base, ir.Constant(_i64, offset)), ty)

    d_w = builder.fpext(at(0, _v8f16), ir.VectorType(_f32, lanes))
    if q4:
        packed = [at(32 + 32 * t, _v32i8) for t in range(4)]
        low = [builder.and_(v, ir.Constant(v_bytes, [15] * (4 * lanes))) for v in packed]
        return low + [_high_nibbles(builder, v, lanes) for v in packed], d_w
    values = [at(Q8_0_VALUES + 32 * u, _v32i8) for u in range(8)]
    if _offset_q8_0(isa):
        return values, d_w
    if OFFSET_Q8_0:  # AVX2's kernels on a VNNI machine's packing (the tests run both): q again
        values = [builder.xor(v, ir.Constant(v_bytes, [-128] * (4 * lanes))) for v in values]
    magnitudes = [call(builder, "llvm.abs.v32i8", _v32i8, [v, ir.Constant(_i1, 0)]) for v in values]
    return magnitudes + values, d_w


def _m_scales(builder: ir.IRBuilder, load: Any, j: ir.Value, lanes: int) -> ir.Value:
    """Q4_1's m scales of block j of a packed group (16 lanes: of two groups), as float32 (lane = row)."""
    offset = builder.add(_group_block_base(j, True, builder), ir.Constant(_i64, 16))
    return builder.fpext(load(offset, _v8f16), ir.VectorType(_f32, lanes))


def _row_block(builder: ir.IRBuilder, isa: str, q4: bool, weights: list[ir.Value], d_w: ir.Value,
               x_offset: ir.Value | None, xptr: ir.Value, d_x: ir.Value, acc: ir.Value) -> ir.Value:
    """acc after one activation row's block (its 32 int8 values at xptr, scale d_x) meets weight block
    `weights` of 8 rows: piece u of the activations (values 4u..4u+3) is broadcast to every lane and meets
    weight vector u, so eight unsigned x signed dot instructions leave each row's exact integer sum in its
    lane; one conversion and one fma add d_w * d_x times it to acc. x_offset (offset Q8_0 only): -128 * sum(q_x),
    a float32 added after the conversion (both integers below 2 ** 24 in magnitude: exact, the block's integer
    sum as AVX2's form gives it, and the same bits after)."""
    lanes = d_w.type.count
    pieces = [builder.bitcast(splat(builder, _load(builder, xptr, ir.Constant(_i64, 4 * u), _i32), lanes),
                              ir.VectorType(_i8, 4 * lanes))
              for u in range(8)]
    if q4 or _offset_q8_0(isa):  # offset Q8_0: (q_w + 128) * q_x, corrected below
        pairs = list(zip(weights, pieces))
    else:
        pairs = [(weights[u], call(builder, "llvm.x86.avx2.psign.b", _v32i8, [pieces[u], weights[8 + u]]))
                 for u in range(8)]
    if q4 and isa == "avx2":
        sums = _q4_block_sums_avx2(builder, pairs)
    else:
        # One chain of eight per row. Two chains of four (for latency) needed 16 chain registers at 8 rows, and
        # with the 8 weight vectors and 8 accumulators the 16-lane loop spilled to the stack (14 stack accesses,
        # 25 register moves a block); with the rows' chains interleaved there is latency enough to hide. On
        # the 2-core Zen 5 VM, 1 thread, Q4_1 3072 x 576 in cache: batch 8 215-232 -> 252-255 GMAC/s, batch 1
        # and 4 unchanged; the model's matmuls of a batch-8 step from memory, 2 threads, in one process
        # alternating with the old kernels: 3.55 -> 3.12 ms. The integer sums are exact in any order.
        sums = None
        for u, s in pairs:
            sums = _unsigned_signed_dot(builder, isa, u, s, sums)
    products = builder.sitofp(sums, d_w.type)
    if x_offset is not None:  # a float add that reads its operand broadcast from memory: no register a row
        products = builder.fadd(products, splat(builder, x_offset, lanes))
    return fma(builder, products, builder.fmul(d_w, splat(builder, d_x, lanes)), acc)


def _block_loop(builder: ir.IRBuilder, n_blocks: ir.Value, n_acc: int, lanes: int, body: Any) -> list[ir.Value]:
    """`for j in range(n_blocks)` carrying n_acc <lanes x float> accumulators from zero: body(j, accs) gives the
    next ones. The final accumulators (zero when n_blocks is 0)."""
    return counted_loop(builder, n_blocks, [ir.Constant(ir.VectorType(_f32, lanes), None)] * n_acc, body,
                        may_be_empty=True)


@dataclass
class RowsDotOperands:
    """What a rows-dot intrinsic's code works on (args: packed, g, xq, xd, xs, b, out, n0; `_make_rows_dot`):
    wptr the first byte of packed group g, row_bytes a group's bytes, n_blocks the activation blocks a row, xrows
    the first byte of each of the n_x activation rows b.., firsts the index of their first block in xd / xs."""

    wptr: ir.Value
    row_bytes: ir.Value
    n_blocks: ir.Value
    xrows: list[ir.Value]
    firsts: list[ir.Value]
    xd: Any
    xs: Any
    out: Any
    rows: list[ir.Value]
    n0: ir.Value

    @classmethod
    def of(cls, context: Any, builder: ir.IRBuilder, arg_types: Any, args: Any, n_x: int) -> "RowsDotOperands":
        packed_t, _, xq_t, xd_t, xs_t, _, out_t, _ = arg_types
        w = context.make_array(packed_t)(context, builder, args[0])
        x = context.make_array(xq_t)(context, builder, args[2])
        d = context.make_array(xd_t)(context, builder, args[3])
        s = context.make_array(xs_t)(context, builder, args[4])
        o = context.make_array(out_t)(context, builder, args[6])
        # Row g of the packed matrix, addressed here: a packed[g] view per group (made by the caller) cost an
        # atomic increment and decrement of the matrix's reference count, on a count both threads share.
        row_bytes = builder.extract_value(w.strides, 0)
        wptr = builder.gep(builder.bitcast(w.data, _i8.as_pointer()), [builder.mul(args[1], row_bytes)])
        n_blocks = builder.extract_value(d.shape, 1)
        k_dim = builder.extract_value(x.shape, 1)
        rows = [builder.add(args[5], ir.Constant(_i64, r)) for r in range(n_x)]
        xrows = [builder.gep(builder.bitcast(x.data, _i8.as_pointer()), [builder.mul(row, k_dim)]) for row in rows]
        firsts = [builder.mul(row, n_blocks) for row in rows]
        return cls(wptr, row_bytes, n_blocks, xrows, firsts, d, s, o, rows, args[7])

    def store(self, builder: ir.IRBuilder, totals: list[ir.Value], lanes: int) -> None:
        """out[rows[r], n0 : n0 + lanes] = totals[r], only the lanes inside out."""
        _store_lanes(builder, self.out, self.rows, self.n0, builder.extract_value(self.out.shape, 1), totals, lanes)


def _store_lanes(builder: ir.IRBuilder, o: Any, rows: list[ir.Value], n0: ir.Value, n_out: ir.Value,
                 totals: list[ir.Value], lanes: int) -> None:
    """out[rows[r], n0 : n0 + lanes] = totals[r] (o: the out array's struct), only the lanes below n_out."""
    n_valid = builder.sub(n_out, n0)
    whole = builder.icmp_signed(">=", n_valid, ir.Constant(_i64, lanes))
    for r, total in enumerate(totals):
        first = builder.gep(o.data, [builder.add(builder.mul(rows[r], n_out), n0)])
        with builder.if_else(whole) as (all_lanes, some_lanes):
            with all_lanes:
                builder.store(total, builder.bitcast(first, total.type.as_pointer()), align=4)
            with some_lanes:  # the last group of a matrix whose rows are not a multiple of 8
                for lane in range(lanes):
                    inside = builder.icmp_signed(">", n_valid, ir.Constant(_i64, lane))
                    with builder.if_then(inside):
                        builder.store(builder.extract_element(total, ir.Constant(_i32, lane)),
                                      builder.gep(first, [ir.Constant(_i64, lane)]))


def _make_rows_dot(n_x: int, isa: str, lanes: int = LANES) -> Any:
    """An intrinsic (qtype, packed, g, xq, xd, xs, b, out, n0) that sets out[b + r, n0 : n0 + 8] (the part of it
    inside out) for r < n_x to the dot products of packed group g of 8 weight rows (row g of a `pack_weight`
    matrix, Q4_1 or Q8_0 as qtype says) with activation row b + r as `quantize_rows` left it. With 16 lanes
    (AVX-512 VNNI only) it does groups g and g + 1 at once, on 512-bit vectors: out[b + r, n0 : n0 + 16]; the
    caller sees that group g + 1 exists.

    An output's sum is the same sequence of float operations for every n_x: blocks in order into one 8-lane
    float32 accumulator (lane = weight row), Q4_1's m terms into a second, the two added at the end; a lane's
    operations do not depend on the vector's width either, so both widths give the same bits. Several
    activation rows per call share each weight block's loads and unpacking. The m terms have their own loop
    over the blocks after the integer one: their accumulators would not fit in AVX2's 16 vector registers
    beside the integer loop's (it spilled to the stack at n_x = 8), and a separate chain gives the same bits."""

    def rows_dot(typingctx, qtype, packed, g, xq, xd, xs, b, out, n0):
        return types.void(qtype, packed, g, xq, xd, xs, b, out, n0), codegen

    def codegen(context, builder, signature, args):
        qtype = args[0]
        is_q4 = builder.icmp_signed("==", qtype, ir.Constant(qtype.type, Q4_1))
        with builder.if_else(is_q4) as (q4_arm, q8_0_arm):
            with q4_arm:
                emit(context, builder, signature.args[1:], args[1:], True)
            with q8_0_arm:
                emit(context, builder, signature.args[1:], args[1:], False)
        return context.get_dummy_value()

    def emit(context, builder, arg_types, args, q4):  # type: ignore[no-untyped-def]
        op = RowsDotOperands.of(context, builder, arg_types, args, n_x)
        wptr, row_bytes, n_blocks, xrows, firsts, d, s = (op.wptr, op.row_bytes, op.n_blocks, op.xrows, op.firsts,
                                                           op.xd, op.xs)

        def x_offset(r: int, j: ir.Value) -> ir.Value | None:
            """-128 * sum(q_x) of row r's block j, for offset Q8_0 (xs holds the corrections), else None."""
            if q4 or not _offset_q8_0(isa):
                return None
            return builder.load(builder.gep(s.data, [builder.add(firsts[r], j)]))

        def dots(j: ir.Value, accs: list[ir.Value]) -> list[ir.Value]:
            _prefetch_next_group(builder, q4, wptr, row_bytes, j, lanes)
            weights, d_w = _weight_block(builder, isa, q4, load, j, lanes)
            return [_row_block(builder, isa, q4, weights, d_w, x_offset(r, j),
                               builder.gep(xrows[r], [builder.mul(j, ir.Constant(_i64, QK))]),
                               builder.load(builder.gep(d.data, [builder.add(firsts[r], j)])), accs[r])
                    for r in range(n_x)]

        def m_terms(j: ir.Value, accs: list[ir.Value]) -> list[ir.Value]:
            m_w = _m_scales(builder, load, j, lanes)
            return [fma(builder, m_w, splat(builder, builder.load(builder.gep(s.data, [builder.add(firsts[r], j)])),
                                            lanes), accs[r])
                    for r in range(n_x)]

        load = _group_loader(builder, wptr, row_bytes, lanes)
        totals = _block_loop(builder, n_blocks, n_x, lanes, dots)
        if q4:
            totals = [builder.fadd(t, m)
                      for t, m in zip(totals, _block_loop(builder, n_blocks, n_x, lanes, m_terms))]
        op.store(builder, totals, lanes)

    rows_dot.__name__ = rows_dot.__qualname__ = f"rows_dot_{n_x}_{isa}_{lanes}"
    return intrinsic(rows_dot)


_ISA = INT8_ISA or "avx2"  # the kernels below are never called without one
_dot_1, _dot_4, _dot_8 = (_make_rows_dot(n, _ISA) for n in (1, 4, 8))
# Two groups and 8 activation rows a call on 512-bit vectors with AVX-512 VNNI (`INT8_WIDE`); elsewhere never
# called, and the 8-lane kernel stands in so that nothing asks LLVM for instructions the CPU lacks.
_wide_8 = _make_rows_dot(8, _ISA, 2 * LANES) if INT8_WIDE else _dot_8


_KERNEL = dict(cache=True, nogil=True, error_model="numpy")


# --- weights ---------------------------------------------------------------------------------------------


@numba.njit(inline="always")
def put_f16(src, o, dst, at, lane):
    """A row's f16 at src[o:o + 2] into lane `lane` of the 8 f16 lanes at dst[at] (a packed group's d or m)."""
    dst[at + 2 * lane] = src[o]
    dst[at + 2 * lane + 1] = src[o + 1]


@numba.njit(inline="always")
def put_nibble_bytes(src, o, dst, at, lane):
    """A row's 16 nibble bytes at src[o:] (byte j: value j in the low nibble, j + 16 in the high one; Q4_0's,
    Q4_1's and IQ4's layout) into lane `lane` of the 4 nibble vectors at dst[at]: byte 4t + k goes to vector t."""
    for j in range(16):
        dst[at + 32 * (j // 4) + 4 * lane + j % 4] = src[o + j]


@numba.njit(parallel=True, **_KERNEL)
def _pack_rows(qtype, data, packed, n_blocks):
    """GGUF Q4_1 / Q8_0 rows -> the layout of `pack_weight` (lanes past the last row stay zero)."""
    block_bytes = 20 if qtype == Q4_1 else 34
    group_bytes = Q4_1_GROUP if qtype == Q4_1 else Q8_0_GROUP
    for n in numba.prange(data.shape[0]):
        src = data[n]
        dst = packed[n // LANES]
        lane = n % LANES
        for blk in range(n_blocks):
            o, base = blk * block_bytes, blk * group_bytes
            put_f16(src, o, dst, base, lane)  # d
            if qtype == Q4_1:
                put_f16(src, o + 2, dst, base + 16, lane)  # m
                put_nibble_bytes(src, o + 4, dst, base + 32, lane)
            else:
                flip = np.uint8(128 if OFFSET_Q8_0 else 0)  # q + 128 as an unsigned byte: its top bit flipped
                for j in range(32):
                    dst[base + Q8_0_VALUES + 32 * (j // 4) + 4 * lane + j % 4] = src[o + 2 + j] ^ flip


def kernel_qtype(qtype: int) -> int:
    """The type whose kernels run a `qtype` weight packed by `pack_weight`: Q4_1 for Q4_0, else itself."""
    return Q4_1 if qtype == Q4_0 else qtype


def with_m(data: np.ndarray, block_bytes: int, offset: int) -> np.ndarray:
    """Rows of blocks [f16 d][values] meaning d * (q - offset) (Q4_0: offset 8, Q5_0: 16) as rows of blocks
    [f16 d][f16 m][the same values] meaning d * q + m (Q4_1, Q5_1), m = -offset * d: exact in f16 (a power of two
    times d; overflow would need |d| > 65504 / offset, far past any real scale)."""
    blocks = data.reshape(data.shape[0], -1, block_bytes)
    d = np.ascontiguousarray(blocks[:, :, :2]).view(np.float16)
    out = np.empty((blocks.shape[0], blocks.shape[1], block_bytes + 2), np.uint8)
    out[:, :, :2] = blocks[:, :, :2]
    out[:, :, 2:4] = (d.astype(np.float32) * np.float32(-offset)).astype(np.float16).view(np.uint8)
    out[:, :, 4:] = blocks[:, :, 2:]
    return out.reshape(data.shape[0], -1)


def pack_weight(qtype: int, data: np.ndarray) -> np.ndarray:
    """A Q4_0, Q4_1 or Q8_0 weight's rows (raw GGUF bytes, (N, row_bytes) uint8) rearranged for the row dots,
    once at load: (ceil(N / 8), blocks * group bytes), row g holding weight rows 8g..8g+7 block by block. A block
    of the 8 rows is, for Q4_1, [8 f16 d][8 f16 m][4 x 32 bytes: vector t, lane i = bytes 4t..4t+3 of row i's
    nibbles], for Q8_0 [8 f16 d][8 x 32 bytes: vector u, lane i = values 4u..4u+3 of row i, as q + 128 where
    `OFFSET_Q8_0`]; the lanes past the last row are zero bytes. Same size. Q4_0 is packed as the
    Q4_1 weight it equals (`kernel_qtype`), 2 bytes a block larger."""
    if qtype == Q4_0:
        qtype, data = Q4_1, with_m(data, 18, 8)
    n_blocks = data.shape[1] // (20 if qtype == Q4_1 else 34)
    n_groups = -(-data.shape[0] // LANES)
    packed = np.zeros((n_groups, n_blocks * (Q4_1_GROUP if qtype == Q4_1 else Q8_0_GROUP)), np.uint8)
    _pack_rows(qtype, data, packed, n_blocks)
    packed.flags.writeable = False
    return packed


# --- activations -----------------------------------------------------------------------------------------


def _as_half(builder: ir.IRBuilder, value: ir.Value) -> ir.Value:
    """A float32 rounded to the nearest float16 (ties to even, as F16C's vcvtps2ph), as float32; a finite value
    past float16's range (65504) stays as it is. llama.cpp's float16 turns that into an infinity, and the logits
    into NaN: s = scale * sum(q) is about the sum of the block's values, past 65504 once they average ~2000 with
    one sign (the tests' random models get there), and the K-quants' kernels, which llama.cpp feeds float32
    sums (Q8_K), read s too."""
    half = builder.fpext(builder.fptrunc(value, _f16), _f32)
    inf = ir.Constant(_f32, float("inf"))
    overflowed = builder.and_(builder.fcmp_ordered("==", call(builder, "llvm.fabs.f32", _f32, [half]), inf),
                              builder.fcmp_ordered("<", call(builder, "llvm.fabs.f32", _f32, [value]), inf))
    return builder.select(overflowed, value, half)


@intrinsic
def _quantize_block(typingctx, x, xq, xd, xs, xh, xc, row, block):
    """Block `block` (32 values) of row `row` of x into xq / xd / xs as `quantize_rows` describes, the sums of its
    two 16-value halves into xh[row, 2 * block : 2 * block + 2] where xh has columns (`XS_HALVES`), and
    -128 * sum(q) into xc[row, block] where xc has columns (`XS_CORRECTIONS`), on 256-bit vectors: max |x| and
    the non-finite test, 32 multiplies and rounds (vroundps), the int32 sums, and one store of the 32 bytes.
    Numba's scalar version of the same took 2-3x longer (np.rint stays a scalar call there), which at batch 8 was
    ~8 us of every matmul spent on one thread."""
    sig = types.void(x, xq, xd, xs, xh, xc, row, block)

    def codegen(context, builder, signature, args):
        xa, qa, da, sa, ha, ca = (context.make_array(t)(context, builder, a)
                                  for t, a in zip(signature.args[:6], args[:6]))
        row, blk = args[6], args[7]
        first = builder.add(builder.mul(row, builder.extract_value(xa.shape, 1)),
                            builder.mul(blk, ir.Constant(_i64, QK)))
        values = [_load(builder, builder.bitcast(xa.data, _i8.as_pointer()),
                        builder.mul(builder.add(first, ir.Constant(_i64, 8 * t)), ir.Constant(_i64, 4)), _v8f32)
                  for t in range(4)]
        magnitudes = [call(builder, "llvm.fabs.v8f32", _v8f32, [v]) for v in values]
        widest = _larger(builder, _larger(builder, magnitudes[0], magnitudes[1]),
                         _larger(builder, magnitudes[2], magnitudes[3]))
        amax = _lanes_reduced(builder, widest, lambda a, b: _larger(builder, a, b))
        # x - x is 0, or NaN for an infinity or a NaN: a NaN scale makes every product with this block NaN, as
        # the float path would.
        zeros = [builder.fsub(v, v) for v in values]
        nonfinite = _lanes_reduced(builder, builder.fadd(builder.fadd(zeros[0], zeros[1]),
                                                         builder.fadd(zeros[2], zeros[3])), builder.fadd)
        exact = builder.fadd(builder.fdiv(amax, ir.Constant(_f32, 127.0)), nonfinite)
        inv = builder.select(builder.fcmp_ordered(">", exact, ir.Constant(_f32, 0.0)),
                             builder.fdiv(ir.Constant(_f32, 127.0), amax), ir.Constant(_f32, 0.0))
        d = _as_half(builder, exact)  # the scale as the block stores it (`quantize_rows`)
        inv_v = splat(builder, inv, 8)
        quants = [builder.fptosi(call(builder, "llvm.rint.v8f32", _v8f32, [builder.fmul(v, inv_v)]), _v8i32)
                  for v in values]
        pairs = [builder.add(quants[2 * h], quants[2 * h + 1]) for h in (0, 1)]  # values 0..15, 16..31
        total = _lanes_reduced(builder, builder.add(pairs[0], pairs[1]), builder.add)
        small = [builder.trunc(q, ir.VectorType(_i8, 8)) for q in quants]
        halves = [builder.shuffle_vector(small[2 * h], small[2 * h + 1], ir.Constant(ir.VectorType(_i32, 16),
                                                                                     list(range(16))))
                  for h in range(2)]
        joined = builder.shuffle_vector(halves[0], halves[1], ir.Constant(ir.VectorType(_i32, 32), list(range(32))))
        qfirst = builder.add(builder.mul(row, builder.extract_value(qa.shape, 1)),
                             builder.mul(blk, ir.Constant(_i64, QK)))
        qptr = builder.gep(builder.bitcast(qa.data, _i8.as_pointer()), [qfirst])
        builder.store(joined, builder.bitcast(qptr, _v32i8.as_pointer()), align=1)
        at = builder.add(builder.mul(row, builder.extract_value(da.shape, 1)), blk)
        builder.store(d, builder.gep(da.data, [at]))
        scaled_sum = builder.fmul(exact, builder.sitofp(total, _f32))  # Q8_1's s: the exact scale times sum(q)
        builder.store(_as_half(builder, scaled_sum), builder.gep(sa.data, [at]))
        wants_halves = builder.icmp_signed("!=", builder.extract_value(ha.shape, 1), ir.Constant(_i64, 0))
        with builder.if_then(wants_halves):
            for h in (0, 1):
                builder.store(builder.sitofp(_lanes_reduced(builder, pairs[h], builder.add), _f32),
                              builder.gep(ha.data, [builder.add(builder.mul(at, ir.Constant(_i64, 2)),
                                                                ir.Constant(_i64, h))]))
        wants_corrections = builder.icmp_signed("!=", builder.extract_value(ca.shape, 1), ir.Constant(_i64, 0))
        with builder.if_then(wants_corrections):  # exact: at most 128 * 32 * 127 in magnitude
            correction = builder.sitofp(builder.mul(total, ir.Constant(_i32, -128)), _f32)
            builder.store(correction, builder.gep(ca.data, [at]))
        return context.get_dummy_value()

    return sig, codegen


@numba.njit(parallel=True, **_KERNEL)
def _quantize_rows_parallel(x, xq, xd, xs, xh, xc):
    for b in numba.prange(x.shape[0]):
        for i in range(x.shape[1] // QK):
            _quantize_block(x, xq, xd, xs, xh, xc, b, i)


@numba.njit(**_KERNEL)
def _quantize_rows_serial(x, xq, xd, xs, xh, xc):
    for b in range(x.shape[0]):
        for i in range(x.shape[1] // QK):
            _quantize_block(x, xq, xd, xs, xh, xc, b, i)


# Below this many values a decode batch is quantized on the calling thread: waking the pool costs more
# than the work (a 576-wide row takes ~0.3 us; four matmuls a layer, every layer, every token).
_PARALLEL_QUANTIZE_MIN = 1 << 15


@numba.njit(**_KERNEL)
def _quantize(x, kind):
    """(xq, xd, xs) of x for kernels that read `kind` in the xs slot (`quantize_rows`)."""
    batch, k_dim = x.shape
    xq = np.empty((batch, k_dim), dtype=np.int8)
    xd = np.empty((batch, k_dim // QK), dtype=np.float32)
    xs = np.empty((batch, k_dim // QK), dtype=np.float32)
    xh = np.empty((batch, k_dim // 16 if kind == XS_HALVES else 0), dtype=np.float32)
    xc = np.empty((batch, k_dim // QK if kind == XS_CORRECTIONS else 0), dtype=np.float32)
    if x.size >= _PARALLEL_QUANTIZE_MIN:
        _quantize_rows_parallel(x, xq, xd, xs, xh, xc)
    else:
        _quantize_rows_serial(x, xq, xd, xs, xh, xc)
    return xq, xd, (xs, xh, xc)[kind]


@numba.njit(inline="always", **_KERNEL)
def xs_kind(qtype, offset_q8_0):
    """What this module's kernels of kernel type `qtype` read in the xs slot (`XS_SCALED` ..): offset Q8_0's
    (`offset_q8_0`: `_offset_q8_0` of the instruction set) the corrections. `int8k.xs_kind` says it for every
    type."""
    return XS_CORRECTIONS if offset_q8_0 and qtype == Q8_0 else XS_SCALED


def quantize_rows(x: np.ndarray, kind: int = XS_SCALED) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """x float32 (B, K), K a multiple of 32 -> the operands of the row dots, per block of 32 values: q int8
    (B, K), d float32 (B, K / 32), and what the kernels read in the xs slot (`kind`): d * sum(q) float32
    (B, K / 32) (`XS_SCALED`), the sums of each block's two 16-value halves of q float32 (B, K / 16)
    (`XS_HALVES`), or -128 * sum(q) float32 (B, K / 32) (`XS_CORRECTIONS`); the last two exact.

    As llama.cpp's quantize_row_q8_0 / q8_1 (x86) write them: q = round-half-even(x * (127 / max|x|)), d the
    exact scale max|x| / 127 rounded to float16 (Q8_0's and Q8_1's d), and XS_SCALED the exact scale times
    sum(q) rounded to float16 (Q8_1's s, which llama.cpp's Q4_1 and Q5_1 dot products read for their m terms).
    The float16 roundings move a result by ~1e-4 of itself; what they buy is llama.cpp's arithmetic, and its
    greedy tokens a little longer: on the default model (`bench/llama_agreement.py`, 16 prompts, 2-core Zen 4
    VM, 2026-12-07) the first token that differs from llama.cpp's came at a median of 15 instead of 10.5 (llama.cpp
    itself with flash attention off: 32), and fed llama.cpp's tokens the top token was llama.cpp's at 97.5% and
    97.4% of steps (64 and 160 tokens a prompt) instead of 96.2% and 97.1% (llama.cpp without flash attention:
    97.8%, 97.5%). The default model's logits move by ~0.7 for any change of rounding anywhere, so closer than
    llama.cpp's two attention paths are to each other is not to be had."""
    return _quantize(x, np.int64(kind))


# --- matmul ----------------------------------------------------------------------------------------------


@numba.njit(**_KERNEL)
def _wide_span(qtype, packed, g_lo, g_hi, xq, xd, xs, out, col0, rows):
    """Activation rows 0 .. rows - 1 (a multiple of 8) against the pairs of weight groups g_lo .. g_hi - 1 (an even
    count), on the 16-lane kernels, 8 rows a call.

    The loop around a kernel is kept bare on purpose (the other kernels are called from `_narrow_span`, after
    it): LLVM compiles the inlined kernel's block loop together with what is live around it. Called per pair of
    groups from one function that also held the 8-, 4- and 1-row kernels' leftover loops, the 16-lane loop ran
    ~10% under the same kernel called from a bare loop (its assembly reloaded 4 addresses from the stack a block,
    1 now; that this alone is the cause was not isolated). `bench/gemm_ab.py` against that version (2026-12-06,
    2-core Zen 4 VM, in cache, one thread, the two taking turns): Q4_1 batch 8 142.5 -> 159.1 GMAC/s, batch 16
    148.7 -> 157.2; Q8_0 batch 8 121.4 -> 161.4, batch 16 126.1 -> 159.3; the same bits."""
    for g in range(g_lo, g_hi, 2):
        for b in range(0, rows, 8):
            _wide_8(qtype, packed, g, xq, xd, xs, b, out, col0 + g * LANES)


@numba.njit(**_KERNEL)
def _narrow_span(qtype, packed, g_lo, g_hi, xq, xd, xs, out, col0, b_lo):
    """Activation rows b_lo .. against weight groups g_lo .. g_hi - 1 on the 8-lane kernels: 8 rows a call while
    there are 8, then 4, then one. A group's blocks are used for every row while they are in L1. Kept apart from
    `_wide_span` (its docstring says why); the 1-row kernel gained the most (same measurement: Q4_1 batch 1
    57.7 -> 73.1 GMAC/s, Q8_0 53.8 -> 64.0)."""
    batch = xq.shape[0]
    for g in range(g_lo, g_hi):
        n0 = col0 + g * LANES
        b = b_lo
        while b + 8 <= batch:
            _dot_8(qtype, packed, g, xq, xd, xs, b, out, n0)
            b += 8
        while b + 4 <= batch:
            _dot_4(qtype, packed, g, xq, xd, xs, b, out, n0)
            b += 4
        while b < batch:
            _dot_1(qtype, packed, g, xq, xd, xs, b, out, n0)
            b += 1


@numba.njit(**_KERNEL)
def _gemm_groups(qtype, packed, xq, xd, xs, out, g_lo, g_hi, col0):
    """out[b, col0 + 8g : col0 + 8g + 8] for every activation row b and weight group g in g_lo .. g_hi - 1 (col0:
    where the matrix's outputs start in out, which may hold other matrices' beside them; its rows then a multiple
    of 8, or its last group would write into the next one's). With `INT8_WIDE` and at least `WIDE_MIN_ROWS`
    activation rows, the pairs of groups go to the 16-lane kernels 8 rows a call (`_wide_span`), the rows left
    over and an odd last group to the 8-lane ones (`_narrow_span`); a lane's arithmetic is the same on both
    widths, so every output has the same bits whichever kernel computes it."""
    batch = xq.shape[0]
    g = g_lo
    if INT8_WIDE and batch >= WIDE_MIN_ROWS:
        g = g_lo + (g_hi - g_lo) // 2 * 2
        rows = batch // 8 * 8
        _wide_span(qtype, packed, g_lo, g, xq, xd, xs, out, col0, rows)
        if rows < batch:
            _narrow_span(qtype, packed, g_lo, g, xq, xd, xs, out, col0, rows)
    _narrow_span(qtype, packed, g, g_hi, xq, xd, xs, out, col0, 0)


def _gemm_groups_c(  # type: ignore[no-untyped-def]
        qtype, packed, n_groups, group_bytes, xq, n_rows, width, xd, xd_cols, xs, xs_cols, out, out_rows, out_cols,
        g_lo, g_hi, col0):
    """`_gemm_groups` over raw pointers and shapes (`gemm_call._GEMM`), compiled as a C function."""
    w, a, ad, s, o = gemm_call.as_arrays(packed, n_groups, group_bytes, xq, n_rows, width, xd, xd_cols, xs, xs_cols,
                                         out, out_rows, out_cols)
    _gemm_groups(qtype, w, a, ad, s, o, g_lo, g_hi, col0)


@functools.cache
def gemm_address() -> int:
    """The address of `_gemm_groups` as a C function, compiled (or loaded from the kernel cache) on first use: the
    compiled matmuls (`gemm_chunks`, the decode step) call it by that address (`gemm_call`), so its kernels are
    compiled once, not once into each of them."""
    return gemm_call.compile_gemm(_gemm_groups_c)


@numba.njit(parallel=True, **_KERNEL)
def gemm_chunks(gemm, qtype, packed, xq, xd, xs, out, n_chunks):
    """out[b, n] = row_dot(W[n], x[b]) for every pair, by the gemm at address `gemm` (`gemm_address` here, or
    int8k's); groups of 8 weight rows split into about n_chunks chunks over the threads."""
    n_groups = packed.shape[0]
    chunk = (n_groups + n_chunks - 1) // n_chunks
    chunk += chunk % 2  # whole pairs of groups for the wide kernels
    for c in numba.prange((n_groups + chunk - 1) // chunk):
        gemm_call.call_gemm(gemm, qtype, packed, xq, xd, xs, out, c * chunk, min(n_groups, (c + 1) * chunk), 0)


@numba.njit(**_KERNEL)
def _matmul(gemm, qtype, packed, x, out, n_chunks):
    xq, xd, xs = _quantize(x, xs_kind(qtype, OFFSET_Q8_0))
    gemm_chunks(gemm, qtype, packed, xq, xd, xs, out, n_chunks)


def matmul(qtype: int, packed: np.ndarray, x: np.ndarray, out: np.ndarray, threads: int | None = None) -> None:
    """out = x @ W.T with x quantized to int8 blocks first (see the module docstring); W Q4_1 or Q8_0, its rows
    as `pack_weight` left them. One compiled call: the quantization's buffers and launch add nothing from
    Python to a decode step's few hundred matmuls. `threads`: the thread count, when the caller knows it
    (numba.get_num_threads costs 0.75 us, ~0.1 ms of a decode step's 120 matmuls)."""
    n_chunks = 4 * (threads or numba.get_num_threads())
    qtype = kernel_qtype(qtype)
    _matmul(gemm_address(), qtype, packed, x, out, n_chunks)


def serial_gemm(dot: Any) -> Any:
    """A compiled (not cached on disk) one-row-at-a-time gemm on the one-row rows-dot intrinsic `dot`, for tests."""

    @numba.njit(nogil=True, error_model="numpy")
    def gemm(qtype, packed, xq, xd, xs, out):
        for g in range(packed.shape[0]):
            for b in range(xq.shape[0]):
                dot(qtype, packed, g, xq, xd, xs, b, out, g * LANES)

    return gemm


@functools.cache
def _serial_gemm(isa: str) -> Any:
    """A one-row-at-a-time gemm on the kernels of another instruction set, for tests: on a VNNI machine the AVX2
    variant runs too, and must give the same bits (the integer sums are exact either way)."""
    return serial_gemm(_make_rows_dot(1, isa))


def matmul_with_isa(isa: str, qtype: int, packed: np.ndarray, x: np.ndarray, out: np.ndarray) -> None:
    """`matmul` on the kernels of `isa` ("vnni" or "avx2"; the CPU must have it), serially; for tests."""
    qtype = kernel_qtype(qtype)
    _serial_gemm(isa)(qtype, packed, *_quantize(x, xs_kind(qtype, _offset_q8_0(isa))), out)
