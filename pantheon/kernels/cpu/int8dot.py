"""Integer dot products of Q4_1 / Q8_0 weight rows with int8-quantized activations (x86 only).

The arithmetic llama.cpp's CPU backend does for these types: each activation row is quantized once per matmul
to blocks of 32 int8 values with a float32 scale (`quantize_rows`, round to nearest, scale = max|x| / 127),
and a weight block meets an activation block as 32 int8 x uint8 products summed in int32, scaled once per
block in float32. One VNNI instruction (`vpdpbusd`) does a block's 32 products and sums; the float path of
`quant.py` needs two FMAs per 16 products plus the conversion of every weight to float32 first.

Numba compiles without LLVM's SLP vectorizer and types integer arithmetic as int64, so these loops cannot be
written as numba Python and vectorize. `_make_row_dot` therefore builds intrinsics that emit the whole loop
over a row's blocks as LLVM IR on 256-bit vectors, keeping the per-block float32 partial sums in vector
registers and reducing them once at the end of the row. The instruction set is fixed when this module is
imported (`INT8_ISA`): VNNI where the CPU has it (AVX512-VNNI with VL — the path tested here, on Zen 4 — or
AVX-VNNI, not tried), else AVX2's `vpmaddubsw` + `vpmaddwd` (exact here: the unsigned operand is at most 128,
so a pair of products is at most 2 * 128 * 127 < 32767), else None and the float path is used. Numba's on-disk cache is keyed by CPU name and features, so a cached kernel never runs on a CPU that
lacks its instructions.

Per block (the m term of Q4_1 uses the activation block's sum, precomputed by `quantize_rows`):
    Q4_1:  d_w * d_x * sum(q_w * q_x) + m_w * (d_x * sum(q_x))       q_w in 0..15
    Q8_0:  d_w * d_x * sum(q_w * q_x)                               q_w in -128..127 (as |q_w| * sign(q_w) q_x)
"""

from __future__ import annotations

from typing import Any

import llvmlite.binding as llvm_binding
import numba
import numpy as np
from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic

__all__ = ["INT8_ISA", "INT8_TYPES", "matmul", "quantize_rows"]

Q4_1, Q8_0 = 3, 8
INT8_TYPES: frozenset[int] = frozenset({Q4_1, Q8_0})
QK = 32  # values per activation block (and per Q4_1 / Q8_0 weight block)


def _detect_isa() -> str | None:
    features = set(llvm_binding.get_host_cpu_features().flatten().split(","))
    if "+avx512vnni" in features and "+avx512vl" in features or "+avxvnni" in features:
        return "vnni"
    if "+avx2" in features:
        return "avx2"
    return None


INT8_ISA: str | None = _detect_isa()

_i1, _i8, _i16, _i32, _i64 = ir.IntType(1), ir.IntType(8), ir.IntType(16), ir.IntType(32), ir.IntType(64)
_f16, _f32 = ir.HalfType(), ir.FloatType()
_v16i8, _v32i8 = ir.VectorType(_i8, 16), ir.VectorType(_i8, 32)
_v16i16, _v8i32, _v8f32 = ir.VectorType(_i16, 16), ir.VectorType(_i32, 8), ir.VectorType(_f32, 8)


def _splat(builder: ir.IRBuilder, value: ir.Value, vtype: ir.VectorType) -> ir.Value:
    one = builder.insert_element(ir.Constant(vtype, ir.Undefined), value, ir.Constant(_i32, 0))
    lanes = ir.Constant(ir.VectorType(_i32, vtype.count), [0] * vtype.count)
    return builder.shuffle_vector(one, ir.Constant(vtype, ir.Undefined), lanes)


def _call(builder: ir.IRBuilder, name: str, ret: ir.Type, args: list[ir.Value]) -> ir.Value:
    fnty = ir.FunctionType(ret, [a.type for a in args])
    return builder.call(cgutils.get_or_insert_function(builder.module, fnty, name), args)


def _unsigned_signed_dot(builder: ir.IRBuilder, u: ir.Value, s: ir.Value) -> ir.Value:
    """<8 x i32>: lane i = sum of u[4i+j] * s[4i+j], j < 4 (u as uint8, s as int8, both <32 x i8>)."""
    if INT8_ISA == "vnni":
        zero = ir.Constant(_v8i32, None)
        return _call(builder, "llvm.x86.avx512.vpdpbusd.256", _v8i32,
                     [zero, builder.bitcast(u, _v8i32), builder.bitcast(s, _v8i32)])
    pairs = _call(builder, "llvm.x86.avx2.pmadd.ub.sw", _v16i16, [u, s])
    return _call(builder, "llvm.x86.avx2.pmadd.wd", _v8i32, [pairs, ir.Constant(_v16i16, [1] * 16)])


def _load(builder: ir.IRBuilder, base: ir.Value, offset: ir.Value, ty: ir.Type) -> ir.Value:
    ptr = builder.bitcast(builder.gep(base, [offset]), ty.as_pointer())
    return builder.load(ptr, align=1)


def _fma(builder: ir.IRBuilder, a: ir.Value, b: ir.Value, c: ir.Value) -> ir.Value:
    """a * b + c, rounded once: an explicit fma, so that LLVM may not reassociate the chain and every row's sum
    is the same sequence of operations in every variant (batch invariance)."""
    suffix = f"v{a.type.count}f32" if isinstance(a.type, ir.VectorType) else "f32"
    return _call(builder, f"llvm.fma.{suffix}", a.type, [a, b, c])


def _make_row_dot(q4: bool, n_x: int) -> Any:
    """An intrinsic (wrow, xq, xd, xs, b, out, n) that sets out[b + r, n] for r < n_x to the dot product of one
    weight row (its raw Q4_1 or Q8_0 bytes) with activation row b + r as quantized by `quantize_rows`.

    A row's sum is the same for every n_x: two float32 vector accumulators (even and odd blocks), each block
    added with one fma, the two added and reduced pairwise at the end; for Q4_1 the m terms likewise in two
    scalar chains. Several activation rows per call share each weight block's loads and unpacking."""

    def row_dot(typingctx, wrow, xq, xd, xs, b, out, n):
        return types.void(wrow, xq, xd, xs, b, out, n), codegen

    def codegen(context, builder, signature, args):
        wrow_t, xq_t, xd_t, xs_t, _, out_t, _ = signature.args
        w = context.make_array(wrow_t)(context, builder, args[0])
        x = context.make_array(xq_t)(context, builder, args[1])
        d = context.make_array(xd_t)(context, builder, args[2])
        s = context.make_array(xs_t)(context, builder, args[3])
        o = context.make_array(out_t)(context, builder, args[5])
        b0, n = args[4], args[6]
        wptr = builder.bitcast(w.data, _i8.as_pointer())
        n_blocks = builder.extract_value(d.shape, 1)
        k_dim = builder.extract_value(x.shape, 1)
        block_bytes = 20 if q4 else 34
        n_out = builder.extract_value(o.shape, 1)
        rows = [builder.add(b0, ir.Constant(_i64, r)) for r in range(n_x)]
        xptrs = [builder.bitcast(builder.gep(x.data, [builder.mul(row, k_dim)]), _i8.as_pointer()) for row in rows]
        dptrs = [builder.gep(d.data, [builder.mul(row, n_blocks)]) for row in rows]
        sptrs = [builder.gep(s.data, [builder.mul(row, n_blocks)]) for row in rows]

        def block(i: ir.Value, faccs: list[ir.Value], maccs: list[ir.Value]) -> tuple[list, list]:
            p = builder.mul(i, ir.Constant(_i64, block_bytes))
            d_w = builder.fpext(_load(builder, wptr, p, _f16), _f32)
            if q4:
                m_w = builder.fpext(_load(builder, wptr, builder.add(p, ir.Constant(_i64, 2)), _f16), _f32)
                qs = _load(builder, wptr, builder.add(p, ir.Constant(_i64, 4)), _v16i8)
                lo = builder.and_(qs, ir.Constant(_v16i8, [15] * 16))
                hi = builder.lshr(qs, ir.Constant(_v16i8, [4] * 16))
                u = builder.shuffle_vector(lo, hi, ir.Constant(ir.VectorType(_i32, 32), list(range(32))))
            else:
                qw = _load(builder, wptr, builder.add(p, ir.Constant(_i64, 2)), _v32i8)
                u = _call(builder, "llvm.abs.v32i8", _v32i8, [qw, ir.Constant(_i1, 0)])
            new_f, new_m = [], []
            for r in range(n_x):
                xv = _load(builder, xptrs[r], builder.mul(i, ir.Constant(_i64, QK)), _v32i8)
                d_x = builder.load(builder.gep(dptrs[r], [i]))
                if q4:
                    dot = _unsigned_signed_dot(builder, u, xv)
                    s_x = builder.load(builder.gep(sptrs[r], [i]))
                    new_m.append(_fma(builder, m_w, s_x, maccs[r]))
                else:
                    dot = _unsigned_signed_dot(builder, u, _call(builder, "llvm.x86.avx2.psign.b", _v32i8, [xv, qw]))
                    new_m.append(maccs[r])
                scale = _splat(builder, builder.fmul(d_w, d_x), _v8f32)
                new_f.append(_fma(builder, builder.sitofp(dot, _v8f32), scale, faccs[r]))
            return new_f, new_m

        zero_v, zero_f = ir.Constant(_v8f32, None), ir.Constant(_f32, 0.0)
        n_pairs = builder.sdiv(n_blocks, ir.Constant(_i64, 2))
        entry = builder.basic_block
        loop = builder.append_basic_block("int8dot.loop")
        after = builder.append_basic_block("int8dot.after")
        builder.cbranch(builder.icmp_signed(">", n_pairs, ir.Constant(_i64, 0)), loop, after)

        builder.position_at_end(loop)
        j = builder.phi(_i64)
        phis = [builder.phi(_v8f32) for _ in range(2 * n_x)] + [builder.phi(_f32) for _ in range(2 * n_x)]
        even_f, odd_f = phis[0:n_x], phis[n_x : 2 * n_x]
        even_m, odd_m = phis[2 * n_x : 3 * n_x], phis[3 * n_x :]
        i0 = builder.mul(j, ir.Constant(_i64, 2))
        even_f2, even_m2 = block(i0, even_f, even_m)
        odd_f2, odd_m2 = block(builder.add(i0, ir.Constant(_i64, 1)), odd_f, odd_m)
        j_next = builder.add(j, ir.Constant(_i64, 1))
        builder.cbranch(builder.icmp_signed("<", j_next, n_pairs), loop, after)
        loop_end = builder.basic_block
        j.add_incoming(ir.Constant(_i64, 0), entry)
        j.add_incoming(j_next, loop_end)
        for phi, value in zip(phis, even_f2 + odd_f2 + even_m2 + odd_m2):
            phi.add_incoming(zero_v if phi.type == _v8f32 else zero_f, entry)
            phi.add_incoming(value, loop_end)

        builder.position_at_end(after)
        merged = []
        for value in even_f2 + odd_f2 + even_m2 + odd_m2:
            phi = builder.phi(value.type)
            phi.add_incoming(zero_v if value.type == _v8f32 else zero_f, entry)
            phi.add_incoming(value, loop_end)
            merged.append(phi)
        even_f, odd_f = merged[0:n_x], merged[n_x : 2 * n_x]
        even_m, odd_m = merged[2 * n_x : 3 * n_x], merged[3 * n_x :]
        # An odd last block goes to the even chain.
        last = builder.sub(n_blocks, ir.Constant(_i64, 1))
        with builder.if_then(builder.icmp_signed("==", builder.srem(n_blocks, ir.Constant(_i64, 2)),
                                                 ir.Constant(_i64, 1))):
            tail_f, tail_m = block(last, even_f, even_m)
            tail_bb = builder.basic_block
        f_phis, m_phis = [], []
        for r in range(n_x):
            f_phis.append(builder.phi(_v8f32))
            f_phis[r].add_incoming(even_f[r], after)
            f_phis[r].add_incoming(tail_f[r], tail_bb)
            m_phis.append(builder.phi(_f32))
            m_phis[r].add_incoming(even_m[r], after)
            m_phis[r].add_incoming(tail_m[r], tail_bb)
        for r in range(n_x):
            f_phi, m_phi = f_phis[r], m_phis[r]
            v = builder.fadd(f_phi, odd_f[r])
            # Lanes summed pairwise in a fixed order.
            for width in (4, 2, 1):
                mask_lo = ir.Constant(ir.VectorType(_i32, width), list(range(width)))
                mask_hi = ir.Constant(ir.VectorType(_i32, width), list(range(width, 2 * width)))
                v = builder.fadd(builder.shuffle_vector(v, v, mask_lo), builder.shuffle_vector(v, v, mask_hi))
            total = builder.fadd(builder.extract_element(v, ir.Constant(_i32, 0)), builder.fadd(m_phi, odd_m[r]))
            builder.store(total, builder.gep(o.data, [builder.add(builder.mul(rows[r], n_out), n)]))
        return context.get_dummy_value()

    row_dot.__name__ = row_dot.__qualname__ = f"{'q4_1' if q4 else 'q8_0'}_row_dot_{n_x}"
    return intrinsic(row_dot)


_q4_1_dot_1, _q4_1_dot_4 = _make_row_dot(True, 1), _make_row_dot(True, 4)
_q8_0_dot_1, _q8_0_dot_4 = _make_row_dot(False, 1), _make_row_dot(False, 4)


_KERNEL = dict(cache=True, nogil=True, error_model="numpy")


@numba.njit(**_KERNEL)
def _quantize_row(x, xq, xd, xs, n16):
    """One row: xq = round(x / d) per block of 32 with d = max|x| / 127; xs = d * sum(xq) per block."""
    for i in range(x.shape[0] // QK):
        o = i * QK
        amax = np.float32(0.0)
        nonfinite = np.float32(0.0)  # NaN when the block holds a NaN or an infinity, else 0
        for j in range(2 * n16):
            amax = max(amax, abs(x[o + j]))
            nonfinite += x[o + j] - x[o + j]
        # A NaN scale makes every product with this block NaN, as the float path would.
        d = amax / np.float32(127.0) + nonfinite
        inv = np.float32(1.0) / d if d > 0 else np.float32(0.0)
        total = np.int32(0)
        for j in range(2 * n16):
            q = np.int32(np.rint(x[o + j] * inv))
            xq[o + j] = q
            total += q
        xd[i] = d
        xs[i] = d * np.float32(total)


@numba.njit(parallel=True, **_KERNEL)
def _quantize_rows_parallel(x, xq, xd, xs, n16):
    for b in numba.prange(x.shape[0]):
        _quantize_row(x[b], xq[b], xd[b], xs[b], n16)


@numba.njit(**_KERNEL)
def _quantize_rows_serial(x, xq, xd, xs, n16):
    for b in range(x.shape[0]):
        _quantize_row(x[b], xq[b], xd[b], xs[b], n16)


# Below this many values a decode batch is quantized on the calling thread: waking the pool costs more
# than the work (one 576-wide row is ~0.2 us; five matmuls a layer, every layer, every token).
_PARALLEL_QUANTIZE_MIN = 1 << 15


def quantize_rows(x: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """x float32 (B, K), K a multiple of 32 -> (xq int8 (B, K), xd float32 (B, K/32), xs float32 (B, K/32))."""
    batch, k_dim = x.shape
    xq = np.empty((batch, k_dim), dtype=np.int8)
    xd = np.empty((batch, k_dim // QK), dtype=np.float32)
    xs = np.empty((batch, k_dim // QK), dtype=np.float32)
    quantize = _quantize_rows_parallel if x.size >= _PARALLEL_QUANTIZE_MIN else _quantize_rows_serial
    quantize(x, xq, xd, xs, 16)
    return xq, xd, xs


@numba.njit(parallel=True, **_KERNEL)
def _gemm_int8(qtype, data, xq, xd, xs, out, n_chunks):
    """out[b, n] = row_dot(W[n], x[b]) for every pair; rows split into about n_chunks chunks over the threads.
    Each weight row is used for every activation row while it is in L1."""
    n_rows = data.shape[0]
    batch = xq.shape[0]
    chunk = (n_rows + n_chunks - 1) // n_chunks
    for c in numba.prange((n_rows + chunk - 1) // chunk):
        start = c * chunk
        end = min(n_rows, start + chunk)
        for n in range(start, end):
            wrow = data[n]
            b = 0
            if qtype == Q4_1:
                while b + 4 <= batch:
                    _q4_1_dot_4(wrow, xq, xd, xs, b, out, n)
                    b += 4
                while b < batch:
                    _q4_1_dot_1(wrow, xq, xd, xs, b, out, n)
                    b += 1
            else:
                while b + 4 <= batch:
                    _q8_0_dot_4(wrow, xq, xd, xs, b, out, n)
                    b += 4
                while b < batch:
                    _q8_0_dot_1(wrow, xq, xd, xs, b, out, n)
                    b += 1


def matmul(qtype: int, data: np.ndarray, x: np.ndarray, out: np.ndarray) -> None:
    """out = x @ W.T with x quantized to int8 blocks first (see the module docstring); W Q4_1 or Q8_0."""
    xq, xd, xs = quantize_rows(x)
    _gemm_int8(qtype, data, xq, xd, xs, out, 4 * numba.get_num_threads())
