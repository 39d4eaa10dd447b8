"""Integer dot products of Q4_K / Q6_K weight rows with int8-quantized activations (x86 only).

The K-quant types of llama.cpp's Q4_K_M and Q6_K files (Q4_K for most matrices, Q6_K for the output matrix,
attn_v and half of ffn_down; llama.cpp's quantizer also writes the output matrix of its Q4_0 and Q4_1 files as
Q6_K). Same scheme as `int8dot` (read its docstring first): activations quantized once per matmul to blocks of
32 int8 values, weight rows packed at load in groups of 8 side by side, one 32-bit lane per row, and each row's
exact integer sum per 32-value block scaled once in float32. Only the packing and the scales differ:

    Q4_K  superblocks of 256 values: f16 d and dmin, 6-bit scale sc_j and min m_j per 32-value sub-block j,
          4-bit q. Sub-block j is a Q4_1 block with d_w = d * sc_j and m_w = -dmin * m_j (both exact in
          float32): the Q4_1 arithmetic, with the two scales made from bytes at each block.
    Q6_K  superblocks of 256: f16 d, a signed 8-bit scale per 16 values, 6-bit q (value d * sc * (q - 32)).
          w = q - 32 is signed (-32..31): its magnitude meets the activations with w's sign moved onto them
          (`vpsignb`), as int8dot's Q8_0 does on AVX2; the two 16-value halves of a block sum apart and are
          scaled by their own d * sc.

The packed layouts (`pack_weight`) keep the types' sizes within ~3%: a Q4_K superblock of 8 rows is 1184 bytes
(8 x 144 = 1152 in the file; its 6-bit scales become bytes), a Q6_K one 1680 (8 x 210; the 6-bit values stay
6-bit, split into a nibble vector and 2-bit planes that the kernel joins). These kernels have their own
compiled functions, apart from int8dot's, so that the decode step compiled for Q4_1 / Q8_0 models does not
carry them; a model with K-quant matrices runs them matmul by matmul. 8 lanes (256-bit vectors) on every ISA.
"""

from __future__ import annotations

import functools
from typing import Any

import numba
import numpy as np
from llvmlite import ir
from numba import types
from numba.extending import intrinsic

from pantheon.kernels.cpu import int8dot
from pantheon.kernels.cpu.int8dot import LANES, QK
from pantheon.kernels.cpu.llvm_ir import call, fma, splat

__all__ = ["K_TYPES", "matmul", "pack_weight"]

Q4_K, Q6_K = 12, 14
K_TYPES: frozenset[int] = frozenset({Q4_K, Q6_K})
SUPER = 256  # values per superblock
# Bytes of one packed superblock of 8 rows (see `pack_weight`), and of one row's superblock in the file.
Q4_K_GROUP, Q6_K_GROUP = 1184, 1680
Q4_K_BYTES, Q6_K_BYTES = 144, 210
# Offsets inside a packed superblock.
_Q4K_SC, _Q4K_M, _Q4K_NIBBLES = 32, 96, 160  # after 8 f16 d, 8 f16 dmin; 128 nibble bytes a sub-block
_Q6K_SC, _Q6K_VALUES = 16, 144  # after 8 f16 d: 16 halves x 8 int8 scales; 192 value bytes a sub-block

_i1, _i8, _i32, _i64 = ir.IntType(1), ir.IntType(8), ir.IntType(32), ir.IntType(64)
_f16, _f32 = ir.HalfType(), ir.FloatType()
_v8i8, _v32i8 = ir.VectorType(_i8, 8), ir.VectorType(_i8, 32)
_v16i16, _v8i32 = ir.VectorType(ir.IntType(16), 16), ir.VectorType(_i32, 8)
_v8f16, _v8f32 = ir.VectorType(_f16, 8), ir.VectorType(_f32, 8)


def _bytes(value: int) -> ir.Constant:
    return ir.Constant(_v32i8, [value] * 32)


def _superblock(builder: ir.IRBuilder, j: ir.Value, group: int) -> tuple[ir.Value, ir.Value]:
    """(byte offset of block j's superblock in a packed group row, j's sub-block 0..7 in it)."""
    base = builder.mul(builder.lshr(j, ir.Constant(_i64, 3)), ir.Constant(_i64, group))
    return base, builder.and_(j, ir.Constant(_i64, 7))


def _at(builder: ir.IRBuilder, wptr: ir.Value, base: ir.Value, offset: int | ir.Value, ty: ir.Type) -> ir.Value:
    if isinstance(offset, int):
        offset = ir.Constant(_i64, offset)
    return int8dot._load(builder, wptr, builder.add(base, offset), ty)


def _lane_bytes(builder: ir.IRBuilder, wptr: ir.Value, base: ir.Value, offset: ir.Value, signed: bool) -> ir.Value:
    """8 bytes (one a lane) at base + offset as float32 lanes."""
    raw = _at(builder, wptr, base, offset, _v8i8)
    if signed:
        return builder.sitofp(builder.sext(raw, _v8i32), _v8f32)
    return builder.uitofp(builder.zext(raw, _v8i32), _v8f32)


def _prefetch_next_group(builder: ir.IRBuilder, wptr: ir.Value, row_bytes: ir.Value, j: ir.Value, q4: bool) -> None:
    """Block j's share of the next packed group (a superblock's bytes over its 8 blocks), non-temporal, as
    int8dot's kernels do."""
    group = Q4_K_GROUP if q4 else Q6_K_GROUP
    share = group // 8
    start = builder.add(row_bytes, builder.mul(j, ir.Constant(_i64, share)))
    for line in range(0, share, 64):
        address = builder.gep(wptr, [builder.add(start, ir.Constant(_i64, line))])
        call(builder, "llvm.prefetch.p0", ir.VoidType(), [address, ir.Constant(_i32, 0), ir.Constant(_i32, 0),
                                                          ir.Constant(_i32, 1)])


def _pieces(builder: ir.IRBuilder, xptr: ir.Value) -> list[ir.Value]:
    """The activation block at xptr as 8 vectors, piece u (values 4u..4u+3) broadcast to every lane."""
    return [builder.bitcast(splat(builder, int8dot._load(builder, xptr, ir.Constant(_i64, 4 * u), _i32), LANES),
                            _v32i8)
            for u in range(8)]


def _q4_k_weights(builder: ir.IRBuilder, wptr: ir.Value, j: ir.Value) -> tuple[list[ir.Value], ir.Value]:
    """Block j of a packed Q4_K group: the 8 nibble vectors (values 4u..4u+3 of each row in vector u) and d * sc_j
    per lane."""
    base, sub = _superblock(builder, j, Q4_K_GROUP)
    d = builder.fpext(_at(builder, wptr, base, 0, _v8f16), _v8f32)
    sc = _lane_bytes(builder, wptr, base, builder.add(builder.mul(sub, ir.Constant(_i64, 8)),
                                                      ir.Constant(_i64, _Q4K_SC)), signed=False)
    nibbles = builder.add(builder.mul(sub, ir.Constant(_i64, 128)), ir.Constant(_i64, _Q4K_NIBBLES))
    packed = [_at(builder, wptr, base, builder.add(nibbles, ir.Constant(_i64, 32 * t)), _v32i8) for t in range(4)]
    low = [builder.and_(v, _bytes(15)) for v in packed]
    high = [builder.lshr(v, _bytes(4)) for v in packed]
    return low + high, builder.fmul(d, sc)


def _q4_k_m_scales(builder: ir.IRBuilder, wptr: ir.Value, j: ir.Value) -> ir.Value:
    """-dmin * m_j per lane for block j of a packed Q4_K group."""
    base, sub = _superblock(builder, j, Q4_K_GROUP)
    dmin = builder.fpext(_at(builder, wptr, base, 16, _v8f16), _v8f32)
    mins = _lane_bytes(builder, wptr, base, builder.add(builder.mul(sub, ir.Constant(_i64, 8)),
                                                        ir.Constant(_i64, _Q4K_M)), signed=False)
    return builder.fneg(builder.fmul(dmin, mins))


def _q6_k_weights(builder: ir.IRBuilder, wptr: ir.Value, j: ir.Value
                  ) -> tuple[list[ir.Value], list[ir.Value], ir.Value, ir.Value]:
    """Block j of a packed Q6_K group: the 8 vectors of w = q - 32 (values 4u..4u+3 of each row in vector u), their
    magnitudes, and d * sc of the block's two halves (values 0..15, 16..31) per lane."""
    base, sub = _superblock(builder, j, Q6_K_GROUP)
    d = builder.fpext(_at(builder, wptr, base, 0, _v8f16), _v8f32)
    scales = builder.add(builder.mul(sub, ir.Constant(_i64, 16)), ir.Constant(_i64, _Q6K_SC))
    sc_a = _lane_bytes(builder, wptr, base, scales, signed=True)
    sc_b = _lane_bytes(builder, wptr, base, builder.add(scales, ir.Constant(_i64, 8)), signed=True)
    values = builder.add(builder.mul(sub, ir.Constant(_i64, 192)), ir.Constant(_i64, _Q6K_VALUES))
    nibbles = [_at(builder, wptr, base, builder.add(values, ir.Constant(_i64, 32 * t)), _v32i8) for t in range(4)]
    planes = [_at(builder, wptr, base, builder.add(values, ir.Constant(_i64, 128 + 32 * h)), _v32i8)
              for h in range(2)]
    signed, magnitudes = [], []
    for u in range(8):
        low = builder.and_(nibbles[u], _bytes(15)) if u < 4 else builder.lshr(nibbles[u - 4], _bytes(4))
        high = builder.and_(builder.lshr(planes[u // 4], _bytes(2 * (u % 4))), _bytes(3))
        w = builder.sub(builder.or_(low, builder.shl(high, _bytes(4))), _bytes(32))
        signed.append(w)
        magnitudes.append(call(builder, "llvm.abs.v32i8", _v32i8, [w, ir.Constant(_i1, 0)]))
    return signed, magnitudes, builder.fmul(d, sc_a), builder.fmul(d, sc_b)


def _half_sum(builder: ir.IRBuilder, isa: str, pairs: list[tuple[ir.Value, ir.Value]]) -> ir.Value:
    """<8 x i32>: four (magnitudes, signed activations) pairs summed per lane. On AVX2 the four `vpmaddubsw`
    results add in 16 bits first: |w| <= 32 and |x| <= 127, so each is at most 2 * 32 * 127 = 8128 and four
    at most 32512."""
    if isa == "vnni":
        total = None
        for u, s in pairs:
            total = int8dot._unsigned_signed_dot(builder, isa, u, s, total)
        return total
    chain = None
    for u, s in pairs:
        piece = call(builder, "llvm.x86.avx2.pmadd.ub.sw", _v16i16, [u, s])
        chain = piece if chain is None else builder.add(chain, piece)
    return call(builder, "llvm.x86.avx2.pmadd.wd", _v8i32, [chain, ir.Constant(_v16i16, [1] * 16)])


def _make_rows_dot(n_x: int, isa: str) -> Any:
    """An intrinsic (qtype, packed, g, xq, xd, xs, b, out, n0), as int8dot's `_make_rows_dot` (8 lanes) but for
    Q4_K or Q6_K packed groups (`pack_weight`): out[b + r, n0 : n0 + 8] for r < n_x. Float operations per output
    in the same order for every n_x (batch invariance): blocks in order into one accumulator (Q6_K: half a,
    then half b), Q4_K's m terms into a second, added at the end."""

    def rows_dot(typingctx, qtype, packed, g, xq, xd, xs, b, out, n0):
        return types.void(qtype, packed, g, xq, xd, xs, b, out, n0), codegen

    def codegen(context, builder, signature, args):
        is_q4 = builder.icmp_signed("==", args[0], ir.Constant(args[0].type, Q4_K))
        with builder.if_else(is_q4) as (q4_arm, q6_arm):
            with q4_arm:
                emit(context, builder, signature.args[1:], args[1:], True)
            with q6_arm:
                emit(context, builder, signature.args[1:], args[1:], False)
        return context.get_dummy_value()

    def emit(context, builder, arg_types, args, q4):  # type: ignore[no-untyped-def]
        packed_t, _, xq_t, xd_t, xs_t, _, out_t, _ = arg_types
        w = context.make_array(packed_t)(context, builder, args[0])
        x = context.make_array(xq_t)(context, builder, args[2])
        d = context.make_array(xd_t)(context, builder, args[3])
        s = context.make_array(xs_t)(context, builder, args[4])
        o = context.make_array(out_t)(context, builder, args[6])
        b0, n0 = args[5], args[7]
        row_bytes = builder.extract_value(w.strides, 0)
        wptr = builder.gep(builder.bitcast(w.data, _i8.as_pointer()), [builder.mul(args[1], row_bytes)])
        n_blocks = builder.extract_value(d.shape, 1)
        k_dim = builder.extract_value(x.shape, 1)
        n_out = builder.extract_value(o.shape, 1)
        rows = [builder.add(b0, ir.Constant(_i64, r)) for r in range(n_x)]
        xrows = [builder.gep(builder.bitcast(x.data, _i8.as_pointer()), [builder.mul(row, k_dim)]) for row in rows]
        firsts = [builder.mul(row, n_blocks) for row in rows]

        def x_scale(r: int, j: ir.Value, scales: Any) -> ir.Value:
            return splat(builder, builder.load(builder.gep(scales.data, [builder.add(firsts[r], j)])), LANES)

        def dots(j: ir.Value, accs: list[ir.Value]) -> list[ir.Value]:
            _prefetch_next_group(builder, wptr, row_bytes, j, q4)
            new = []
            if q4:
                weights, d_w = _q4_k_weights(builder, wptr, j)
            else:
                signed, magnitudes, d_a, d_b = _q6_k_weights(builder, wptr, j)
            for r in range(n_x):
                pieces = _pieces(builder, builder.gep(xrows[r], [builder.mul(j, ir.Constant(_i64, QK))]))
                d_x = x_scale(r, j, d)
                if q4:
                    pairs = list(zip(weights, pieces))
                    if isa == "avx2":
                        sums = int8dot._q4_block_sums_avx2(builder, pairs)
                    else:
                        sums = None
                        for u, p in pairs:
                            sums = int8dot._unsigned_signed_dot(builder, isa, u, p, sums)
                    new.append(fma(builder, builder.sitofp(sums, _v8f32), builder.fmul(d_w, d_x), accs[r]))
                    continue
                pairs = [(magnitudes[u], call(builder, "llvm.x86.avx2.psign.b", _v32i8, [pieces[u], signed[u]]))
                         for u in range(8)]
                acc = fma(builder, builder.sitofp(_half_sum(builder, isa, pairs[:4]), _v8f32),
                          builder.fmul(d_a, d_x), accs[r])
                new.append(fma(builder, builder.sitofp(_half_sum(builder, isa, pairs[4:]), _v8f32),
                               builder.fmul(d_b, d_x), acc))
            return new

        def m_terms(j: ir.Value, accs: list[ir.Value]) -> list[ir.Value]:
            m_w = _q4_k_m_scales(builder, wptr, j)
            return [fma(builder, m_w, x_scale(r, j, s), accs[r]) for r in range(n_x)]

        totals = int8dot._block_loop(builder, "k_dots", n_blocks, n_x, LANES, dots)
        if q4:
            totals = [builder.fadd(t, m)
                      for t, m in zip(totals, int8dot._block_loop(builder, "k_m", n_blocks, n_x, LANES, m_terms))]
        int8dot._store_lanes(builder, o, rows, n0, n_out, totals, LANES)

    rows_dot.__name__ = rows_dot.__qualname__ = f"k_rows_dot_{n_x}_{isa}"
    return intrinsic(rows_dot)


_ISA = int8dot.INT8_ISA or "avx2"  # never called without one
_dot_1, _dot_4, _dot_8 = (_make_rows_dot(n, _ISA) for n in (1, 4, 8))
_KERNEL = dict(cache=True, nogil=True, error_model="numpy")


# --- weights ---------------------------------------------------------------------------------------------


@numba.njit(inline="always")
def _scale_min(src, p, j):
    """Q4_K's 6-bit (scale, min) of sub-block j from the 12 bytes at src[p:p+12]."""
    if j < 4:
        return src[p + j] & 63, src[p + 4 + j] & 63
    lo = src[p + 4 + j]
    return (lo & 15) | ((src[p + j - 4] >> 6) << 4), (lo >> 4) | ((src[p + j] >> 6) << 4)


@numba.njit(parallel=True, **_KERNEL)
def _pack_q4_k(data, packed, n_super):
    """GGUF Q4_K rows -> `pack_weight`'s layout. Row superblock: d, dmin (f16), scales[12], qs[128], where value
    64c + l (l < 32) is the low nibble of qs[32c + l] and value 64c + 32 + l its high nibble."""
    for n in numba.prange(data.shape[0]):
        src = data[n]
        dst = packed[n // LANES]
        lane = n % LANES
        values = np.empty(32, np.uint8)
        for s in range(n_super):
            o, base = s * Q4_K_BYTES, s * Q4_K_GROUP
            for k in range(2):
                dst[base + 2 * lane + k] = src[o + k]  # d
                dst[base + 16 + 2 * lane + k] = src[o + 2 + k]  # dmin
            for j in range(8):
                sc, mn = _scale_min(src, o + 4, j)
                dst[base + _Q4K_SC + 8 * j + lane] = sc
                dst[base + _Q4K_M + 8 * j + lane] = mn
                first = o + 16 + 32 * (j // 2)
                for v in range(32):
                    byte = src[first + v]
                    values[v] = byte >> 4 if j % 2 else byte & 15
                _put_nibbles(values, dst, base + _Q4K_NIBBLES + 128 * j, lane)


@numba.njit(inline="always")
def _put_nibbles(values, dst, at, lane):
    """32 values < 16 as int8dot's Q4_1 nibble vectors: vector t, lane, byte p holds values 4t + p (low nibble)
    and 4t + p + 16 (high)."""
    for k in range(16):
        dst[at + 32 * (k // 4) + 4 * lane + k % 4] = (values[k] & 15) | ((values[k + 16] & 15) << 4)


@numba.njit(parallel=True, **_KERNEL)
def _pack_q6_k(data, packed, n_super):
    """GGUF Q6_K rows -> `pack_weight`'s layout. Row superblock: ql[128], qh[64], scales[16] (int8), d (f16); in
    each half of 128 values (ql + 64h, qh + 32h), value l, l + 32, l + 64, l + 96 (l < 32) take their low 4 bits
    from ql[l] & 15, ql[l + 32] & 15, ql[l] >> 4, ql[l + 32] >> 4 and their high 2 from qh[l] bits 0-1, 2-3,
    4-5, 6-7."""
    for n in numba.prange(data.shape[0]):
        src = data[n]
        dst = packed[n // LANES]
        lane = n % LANES
        q = np.empty(SUPER, np.uint8)
        for s in range(n_super):
            o, base = s * Q6_K_BYTES, s * Q6_K_GROUP
            for half in range(2):
                ql, qh, first = o + 64 * half, o + 128 + 32 * half, 128 * half
                for v in range(32):
                    low, high = src[ql + v], src[qh + v]
                    wide = src[ql + v + 32]
                    q[first + v] = (low & 15) | ((high & 3) << 4)
                    q[first + v + 32] = (wide & 15) | (((high >> 2) & 3) << 4)
                    q[first + v + 64] = (low >> 4) | (((high >> 4) & 3) << 4)
                    q[first + v + 96] = (wide >> 4) | (((high >> 6) & 3) << 4)
            for k in range(2):
                dst[base + 2 * lane + k] = src[o + 208 + k]  # d
            for h in range(16):
                dst[base + _Q6K_SC + 8 * h + lane] = src[o + 192 + h]  # the scale of values 16h..16h+15
            for j in range(8):
                at = base + _Q6K_VALUES + 192 * j
                values = q[32 * j: 32 * j + 32]
                _put_nibbles(values, dst, at, lane)
                # 2-bit planes: plane h, lane, byte p holds the high bits of values 4u + p for u = 4h + r (r < 4)
                # in bits 2r, 2r + 1.
                for h in range(2):
                    for p in range(4):
                        byte = 0
                        for r in range(4):
                            byte |= ((values[4 * (4 * h + r) + p] >> 4) & 3) << (2 * r)
                        dst[at + 128 + 32 * h + 4 * lane + p] = byte


def pack_weight(qtype: int, data: np.ndarray) -> np.ndarray:
    """A Q4_K or Q6_K weight's rows (raw GGUF bytes, (N, row_bytes) uint8) rearranged for the row dots, once at
    load: (ceil(N / 8), superblocks * group bytes), row g holding weight rows 8g..8g+7 superblock by superblock.
    A Q4_K superblock of 8 rows: [8 f16 d][8 f16 dmin][8 sub-blocks x 8 scale bytes (one a lane)][8 x 8 min
    bytes][8 x 128 bytes: sub-block j's nibbles as int8dot packs a Q4_1 block's]. A Q6_K one: [8 f16 d][16
    halves x 8 int8 scales][8 x 192 bytes: sub-block j's low nibbles as a Q4_1 block's, then two 32-byte planes
    of its 2-bit highs]. Lanes past the last row are zero."""
    q4 = qtype == Q4_K
    n_super = data.shape[1] // (Q4_K_BYTES if q4 else Q6_K_BYTES)
    n_groups = -(-data.shape[0] // LANES)
    packed = np.zeros((n_groups, n_super * (Q4_K_GROUP if q4 else Q6_K_GROUP)), np.uint8)
    (_pack_q4_k if q4 else _pack_q6_k)(data, packed, n_super)
    packed.flags.writeable = False
    return packed


# --- matmul ----------------------------------------------------------------------------------------------


@numba.njit(**_KERNEL)
def _group_rows(qtype, packed, g, xq, xd, xs, out):
    """Every activation row against weight group g, 8 rows a call while there are 8, then 4, then one."""
    batch = xq.shape[0]
    n0 = g * LANES
    b = 0
    while b + 8 <= batch:
        _dot_8(qtype, packed, g, xq, xd, xs, b, out, n0)
        b += 8
    while b + 4 <= batch:
        _dot_4(qtype, packed, g, xq, xd, xs, b, out, n0)
        b += 4
    while b < batch:
        _dot_1(qtype, packed, g, xq, xd, xs, b, out, n0)
        b += 1


@numba.njit(parallel=True, **_KERNEL)
def _gemm(qtype, packed, xq, xd, xs, out, n_chunks):
    n_groups = packed.shape[0]
    chunk = (n_groups + n_chunks - 1) // n_chunks
    for c in numba.prange((n_groups + chunk - 1) // chunk):
        for g in range(c * chunk, min(n_groups, (c + 1) * chunk)):
            _group_rows(qtype, packed, g, xq, xd, xs, out)


@numba.njit(**_KERNEL)
def _matmul(qtype, packed, x, out, n_chunks):
    xq, xd, xs = int8dot._quantize(x, np.int32(0))
    _gemm(qtype, packed, xq, xd, xs, out, n_chunks)


def matmul(qtype: int, packed: np.ndarray, x: np.ndarray, out: np.ndarray, threads: int | None = None) -> None:
    """out = x @ W.T with x quantized to int8 blocks first; W Q4_K or Q6_K, its rows as `pack_weight` left them
    (K a multiple of 256)."""
    _matmul(qtype, packed, x, out, 4 * (threads or numba.get_num_threads()))


@functools.cache
def _serial_gemm(isa: str) -> Any:
    """A one-row-at-a-time gemm on the kernels of another instruction set (not cached on disk), for tests."""
    dot = _make_rows_dot(1, isa)

    @numba.njit(nogil=True, error_model="numpy")
    def gemm(qtype, packed, xq, xd, xs, out):
        for g in range(packed.shape[0]):
            for b in range(xq.shape[0]):
                dot(qtype, packed, g, xq, xd, xs, b, out, g * LANES)

    return gemm


def matmul_with_isa(isa: str, qtype: int, packed: np.ndarray, x: np.ndarray, out: np.ndarray) -> None:
    """`matmul` on the kernels of `isa` ("vnni" or "avx2"; the CPU must have it), serially; for tests."""
    _serial_gemm(isa)(qtype, packed, *int8dot._quantize(x, np.int32(0)), out)
