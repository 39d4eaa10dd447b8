"""numba CPU kernels for the non-matmul ops of a llama-family transformer.

Every kernel is compiled with `nogil=True`: the scheduler runs the forward pass in a worker thread while the
trio loop keeps serving, so no kernel may hold the GIL. Arrays are float32 and C-contiguous unless a
docstring says otherwise; the wrappers do not copy or convert, so passing anything else compiles (and caches)
a slower specialization rather than failing.

Each op has a serial kernel for decode-size inputs and, where the work can pay for a thread launch, a
`parallel=True` twin that the wrapper picks above a size threshold. Attention is always parallel.
The numpy references these are tested against live in `pantheon.kernels.reference.ops`.
"""

from __future__ import annotations

import numba
import numpy as np
from llvmlite import ir
from numba import prange
from numba.core import types
from numba.extending import intrinsic

from pantheon.kernels.cpu import HOST_CPU_FEATURES
from pantheon.kernels.cpu.attend_ir import (LANES, MAX_WIDTH, key_scores_intrinsic, prefetch_rows_intrinsic,
                                            value_accumulate_intrinsic)
from pantheon.kernels.cpu.llvm_ir import call

# 'reassoc' lets LLVM vectorize sum and dot reductions; 'contract' allows FMAs. Neither assumes finite
# values, so NaN and inf still propagate the way IEEE says. error_model="numpy" drops the ZeroDivisionError
# check numba puts on every float division: that branch alone kept swiglu's loop scalar (6.4 vs 0.9 us).
_FASTMATH = {"reassoc", "contract"}
_njit = numba.njit(cache=True, nogil=True, fastmath=_FASTMATH, error_model="numpy")
_njit_parallel = numba.njit(cache=True, nogil=True, fastmath=_FASTMATH, error_model="numpy", parallel=True)
# A prange body hands its loop index to a compiled function as np.int64(index): numba types the body twice, the
# index int64 in the function and uint64 in the parallel loop, and each type compiles its own copy of the
# callee (for the decode step's `_team_member`, ~20 s of a cold start).
# Inlined by numba into its callers: an array passed to a compiled call is reference-counted around it, an
# atomic increment and decrement per array and call (in a per-16-keys loop, ~12% of decode attention).
_njit_inline = numba.njit(cache=True, nogil=True, fastmath=_FASTMATH, error_model="numpy", inline="always")

# Sizes from which the parallel twin of an op is used. A parallel launch costs 1.5-3 us even when it does
# nothing, so decode-size rows stay serial. Crossovers measured on Zen 4 with 2 threads (rmsnorm ~25k
# elements, swiglu ~10k, rope ~10 tokens), rounded up. rope counts tokens: its cost is the per-token sin/cos.
RMSNORM_PARALLEL_MIN_ELEMENTS = 1 << 15
SWIGLU_PARALLEL_MIN_ELEMENTS = 1 << 14
ROPE_PARALLEL_MIN_TOKENS = 16

# Attention tiling: the online softmax works through the keys KEY_TILE at a time.
KEY_TILE = 64
# Decode attention splits a sequence's keys into runs of this many, each its own work item, merged at the end
# (so a long context keeps both threads busy even at batch 1). Fixed, not derived from the batch or the
# thread count, so a sequence's result does not depend on what else was batched with it.
DECODE_SPLIT_KEYS = 512
# Decode attention splits the query heads of a kv head over work items when fewer (sequence, kv head) pairs
# than this would leave threads idle (batch 1).
DECODE_MIN_ITEMS = 4
# Prefill attention takes this many consecutive tokens of a sequence through each tile of keys together, so the
# tile's keys and values come from L1 for all of them (`_attention_prefill_kernel`), not from L2 or L3 once per
# token. On the 2-core Zen 3 VM, 256 tokens over 7.5k of context (9 query heads on 3 kv heads, float16):
# 73 -> 56-59 ms over C-ordered caches (4 and 16 about as fast as 8); bench/long_prefill.py (the backend's
# head-major pools, 7800 tokens) attention 31.7 -> 25.7-27.9 s. Widening each tile to float32 once for the
# block instead of once per token (exact, same bits) measured slower (66-71 ms): the tile doubles in L1.
PREFILL_QUERY_BLOCK = 8
# Softmax weights (relative to the running max, which weighs 1) below this add nothing a float32 sum can
# hold; skipping them also keeps denormal products (slow on x86) out of the accumulator.
MIN_WEIGHT = np.float32(2.0**-40)


# --- exp ---------------------------------------------------------------------------------------------


@intrinsic
def _int32_bits_as_float32(typingctx, bits):
    def codegen(context, builder, signature, args):
        return builder.bitcast(args[0], ir.FloatType())

    return types.float32(types.int32), codegen


# Only 'contract' here: reassociating would undo the two-part ln2 subtraction that keeps r exact. LLVM, not
# numba, inlines it, so these per-instruction flags survive inside the callers' 'reassoc' loops.
@numba.njit(cache=True, nogil=True, fastmath={"contract"}, error_model="numpy")
def _exp_f32(x):
    """exp of a float32, within 1e-7 relative of the true value, written so that LLVM vectorizes it.

    np.exp in a numba loop is a scalar libm call (no SVML here), about 10x slower than this; swiglu and the
    softmax spend most of their time in it. Range reduction exp(x) = 2**n * exp(r), |r| <= ln2 / 2, then the
    Cephes expf polynomial for exp(r), and 2**n built from its exponent bits. Results below exp(-60) ~ 9e-27
    flush to 0: softmax weights that small change nothing at float32 precision, and left in they make
    denormal products with the values (p * v), which x86 computes ~100x slower (measured: attention over a
    512-token context took 3.2 ms per token instead of 1.2 on some prompts). Results past about 88.4 (true
    limit 88.72) overflow to inf, NaN stays NaN.
    """
    clamped = min(max(x, np.float32(-87.3)), np.float32(88.7))
    n = np.floor(clamped * np.float32(1.4426950408889634) + np.float32(0.5))
    # ln2 split in two so that n * ln2_hi is exact and r keeps full precision
    r = clamped - n * np.float32(0.693359375) + n * np.float32(2.12194440e-4)
    p = np.float32(1.9875691500e-4)
    p = p * r + np.float32(1.3981999507e-3)
    p = p * r + np.float32(8.3334519073e-3)
    p = p * r + np.float32(4.1665795894e-2)
    p = p * r + np.float32(1.6666665459e-1)
    p = p * r + np.float32(5.0000001201e-1)
    p = p * r * r + r + np.float32(1.0)
    result = p * _int32_bits_as_float32((np.int32(n) + np.int32(127)) << 23)
    if x < np.float32(-60.0):
        result = np.float32(0.0)
    return result if x == x else x


# --- float16 KV values ----------------------------------------------------------------------------------
#
# numba has no float16 type on the CPU, so a float16 KV cache reaches the kernels viewed as uint16 (its bits),
# and these two intrinsics convert one value each way. Both are plain LLVM fpext / fptrunc: F16C's vcvtph2ps /
# vcvtps2ph once vectorized, round to nearest even like numpy's astype(float16). A float32 cache passes
# through them unchanged, so one kernel source serves both cache types (numba compiles one each).


@intrinsic
def _kv_to_f32(typingctx, value):
    """A KV cache element as float32: uint16 holds float16 bits; float32 is returned as it is."""
    if value == types.uint16:
        def codegen(context, builder, signature, args):
            return builder.fpext(builder.bitcast(args[0], ir.HalfType()), ir.FloatType())
    elif value == types.float32:
        def codegen(context, builder, signature, args):
            return args[0]
    else:
        return None
    return types.float32(value), codegen


@intrinsic
def _f32_to_kv(typingctx, value, pool):
    """A float32 as an element of `pool` (a KV cache array): float16 bits for uint16, else itself."""
    if pool.dtype == types.uint16:
        def codegen(context, builder, signature, args):
            return builder.bitcast(builder.fptrunc(args[0], ir.HalfType()), ir.IntType(16))
    elif pool.dtype == types.float32:
        def codegen(context, builder, signature, args):
            return args[0]
    else:
        return None
    return pool.dtype(types.float32, pool), codegen


# Without F16C, LLVM would lower the conversions to runtime-library calls that numba's JIT may not link.
HAS_F16C = "+f16c" in HOST_CPU_FEATURES


def kernel_view(cache: np.ndarray) -> np.ndarray:
    """A KV cache as the kernels take it: float16 as its uint16 bits, float32 as it is."""
    return cache.view(np.uint16) if cache.dtype == np.float16 else cache


# --- rmsnorm -------------------------------------------------------------------------------------------


@_njit
def _rmsnorm_row(x, weight, eps, out, t):
    # The sum of squares is accumulated in float64, as ggml does: rows reach 8k elements with outlier
    # channels in the thousands, and a float64 sum costs nothing measurable at these sizes.
    x_row = x[t]
    out_row = out[t]
    dim = x_row.shape[0]
    sum_sq = 0.0
    for i in range(dim):
        value = np.float64(x_row[i])
        sum_sq += value * value
    inv_rms = np.float32(1.0 / np.sqrt(sum_sq / dim + eps))
    for i in range(dim):
        out_row[i] = x_row[i] * inv_rms * weight[i]


@_njit
def _rmsnorm_serial(x, weight, eps, out):
    for t in range(x.shape[0]):
        _rmsnorm_row(x, weight, eps, out, t)


@_njit_parallel
def _rmsnorm_parallel(x, weight, eps, out):
    for t in prange(x.shape[0]):
        _rmsnorm_row(x, weight, eps, out, t)


@_njit
def _add_rmsnorm_row(residual, delta, weight, eps, out, t):
    residual_row = residual[t]
    delta_row = delta[t]
    out_row = out[t]
    dim = residual_row.shape[0]
    sum_sq = 0.0  # float64 for the same reason as in _rmsnorm_row
    for i in range(dim):
        summed = residual_row[i] + delta_row[i]
        residual_row[i] = summed
        sum_sq += np.float64(summed) * np.float64(summed)
    inv_rms = np.float32(1.0 / np.sqrt(sum_sq / dim + eps))
    for i in range(dim):
        out_row[i] = residual_row[i] * inv_rms * weight[i]


@_njit
def _add_rmsnorm_serial(residual, delta, weight, eps, out):
    for t in range(residual.shape[0]):
        _add_rmsnorm_row(residual, delta, weight, eps, out, t)


@_njit_parallel
def _add_rmsnorm_parallel(residual, delta, weight, eps, out):
    for t in prange(residual.shape[0]):
        _add_rmsnorm_row(residual, delta, weight, eps, out, t)


# The size-to-kernel choice of each wrapper below, compiled, so that other compiled code (the decode step of
# kernels/cpu/decode_layers.py) takes the very same kernel the wrapper would.
@_njit
def _rmsnorm_rows(x, weight, eps, out):
    if x.size >= RMSNORM_PARALLEL_MIN_ELEMENTS:
        _rmsnorm_parallel(x, weight, eps, out)
    else:
        _rmsnorm_serial(x, weight, eps, out)


@_njit
def _add_rmsnorm_rows(residual, delta, weight, eps, out):
    if residual.size >= RMSNORM_PARALLEL_MIN_ELEMENTS:
        _add_rmsnorm_parallel(residual, delta, weight, eps, out)
    else:
        _add_rmsnorm_serial(residual, delta, weight, eps, out)


def rmsnorm(x: np.ndarray, weight: np.ndarray, eps: float, out: np.ndarray | None = None) -> np.ndarray:
    """Root-mean-square norm of each row: x (T, D), weight (D,) -> x / sqrt(mean(x**2) + eps) * weight.

    Writes into `out` (T, D) when given (it may be `x` itself) and returns it.
    """
    if out is None:
        out = np.empty_like(x)
    _rmsnorm_rows(x, weight, eps, out)
    return out


def add_rmsnorm(
    residual: np.ndarray, delta: np.ndarray, weight: np.ndarray, eps: float, out: np.ndarray
) -> None:
    """Fused residual add and norm: residual += delta in place, then out = rmsnorm(residual, weight, eps).

    residual, delta, out are (T, D); weight is (D,). One pass over the row instead of two.
    """
    _add_rmsnorm_rows(residual, delta, weight, eps, out)


# --- rope ----------------------------------------------------------------------------------------------


# No fast-math flags on the rope kernels: with them, the same kernel computed different bits freshly compiled
# and loaded from numba's on-disk cache (measured: the parallel one even with the helper inlined), so a
# server's numbers changed between its first start and its restarts. tests/kernels/test_ops.py checks
# fresh == cached for every op in child processes.
@numba.njit(cache=True, nogil=True, error_model="numpy")
def _rope_angles(positions, n_rot, freq_base, freq_scale, cos_table, sin_table):
    # Angles and their sin/cos are computed in float64: at position 5000 a float32 angle is off by ~3e-4 rad,
    # which would show as a 3e-4 relative error in q and k. Each angle straight from its exponent: no rounding
    # accumulates along the pairs.
    for t in range(positions.shape[0]):
        base = np.float64(positions[t]) * freq_scale
        for i in range(n_rot // 2):
            theta = base * freq_base ** (-2.0 * i / n_rot)
            cos_table[t, i] = np.float32(np.cos(theta))
            sin_table[t, i] = np.float32(np.sin(theta))


@intrinsic
def _fma32(typingctx, a, b, c):  # type: ignore[no-untyped-def]
    """a * b + c on float32, rounded once (llvm.fma: never split, whatever the caller's fast-math flags)."""

    def codegen(context, builder, signature, args):  # type: ignore[no-untyped-def]
        return call(builder, "llvm.fma.f32", ir.FloatType(), list(args))

    return types.float32(types.float32, types.float32, types.float32), codegen


@numba.njit(cache=True, nogil=True, error_model="numpy", inline="always")
def _turn(a, b, c, s):
    """(a c - b s, a s + b c) of float32 values with explicit fmas, each second product rounded on its own. Written
    as plain float32 arithmetic, the kernels' 'contract' flag let LLVM fuse either product, and it chose
    differently in different callers: the fused decode kernel and rope_qkv_into_cache then disagreed in the
    last bit of a rotated key."""
    zero = np.float32(0.0)
    return (_fma32(a, c, -_fma32(b, s, zero)), _fma32(a, s, _fma32(b, c, zero)))


@numba.njit(cache=True, nogil=True, error_model="numpy", inline="always")
def _store_head(src, dst):
    """dst = src (float32 values, at least as many) in dst's element type (a float16 cache's bits, or float32).
    Both are indexed from 0: an index such as `row[start + c]` could be negative as far as LLVM knew, numba's
    wrap-around of negative indices stayed in the loop, and it vectorized to gathers and scatters."""
    for c in range(dst.shape[0]):
        dst[c] = _f32_to_kv(src[c], dst)


@numba.njit(cache=True, nogil=True, error_model="numpy", inline="always")
def _rotate_head(row, src, neox, cos_row, sin_row, dst):
    """dst (hd,) = the head at row[src : src + hd] with its first n_rot dims turned pair by pair (see
    `rope_inplace`), in dst's element type (a float16 cache's bits, or float32). dst may be that very head:
    each pair is read before it is written."""
    half = cos_row.shape[0]
    # Slices indexed from the loop counters alone, as in `_store_head`.
    head = row[src:src + dst.shape[0]]
    if neox:
        first, second = head[:half], head[half:2 * half]
        dst_first, dst_second = dst[:half], dst[half:2 * half]
        for i in range(half):
            x, y = _turn(first[i], second[i], cos_row[i], sin_row[i])
            dst_first[i] = _f32_to_kv(x, dst)
            dst_second[i] = _f32_to_kv(y, dst)
    else:
        for i in range(half):
            x, y = _turn(head[2 * i], head[2 * i + 1], cos_row[i], sin_row[i])
            dst[2 * i] = _f32_to_kv(x, dst)
            dst[2 * i + 1] = _f32_to_kv(y, dst)
    _store_head(head[2 * half:], dst[2 * half:])  # dims past n_rot are not rotated


@numba.njit(cache=True, nogil=True, error_model="numpy", inline="always")
def _rope_token(x, neox, cos_row, sin_row, t):
    for h in range(x.shape[1]):
        _rotate_head(x[t, h], 0, neox, cos_row, sin_row, x[t, h])


@numba.njit(cache=True, nogil=True, error_model="numpy")
def _rope_serial(x, neox, cos_table, sin_table):
    for t in range(x.shape[0]):
        _rope_token(x, neox, cos_table[t], sin_table[t], t)


@numba.njit(cache=True, nogil=True, error_model="numpy", parallel=True)
def _rope_parallel(x, neox, cos_table, sin_table):
    for t in prange(x.shape[0]):
        _rope_token(x, neox, cos_table[t], sin_table[t], t)


# The last few angle tables, by (positions, n_rot, base, scale): q and k of every layer of a forward pass turn
# by the same angles, so a step computes its sin/cos once instead of twice per layer.
_ANGLE_TABLES: dict[tuple, tuple[np.ndarray, np.ndarray]] = {}
_ANGLE_TABLES_KEPT = 4


def _angle_tables(positions: np.ndarray, n_rot: int, freq_base: float, freq_scale: float
                  ) -> tuple[np.ndarray, np.ndarray]:
    key = (positions.tobytes(), positions.dtype.str, n_rot, freq_base, freq_scale)
    tables = _ANGLE_TABLES.get(key)
    if tables is None:
        half = n_rot // 2
        tables = (np.empty((len(positions), half), np.float32), np.empty((len(positions), half), np.float32))
        _rope_angles(positions, n_rot, freq_base, freq_scale, *tables)
        if len(_ANGLE_TABLES) >= _ANGLE_TABLES_KEPT:
            _ANGLE_TABLES.clear()  # threads may race here: the worst is a recompute
        _ANGLE_TABLES[key] = tables
    return tables


def _check_n_rot(n_rot: int, head_dim: int) -> None:
    if n_rot % 2 or not 0 < n_rot <= head_dim:
        raise ValueError(f"n_rot must be even and in (0, head_dim={head_dim}], got {n_rot}")


def rope_inplace(
    x: np.ndarray,
    positions: np.ndarray,
    n_rot: int,
    freq_base: float,
    neox: bool,
    freq_scale: float = 1.0,
) -> None:
    """Rotary position embedding, in place, of x (T, H, head_dim) at positions (T,) int32.

    The first n_rot dims of each head (n_rot even, <= head_dim) turn pair by pair: pair i by
    theta_i = pos * freq_scale * freq_base ** (-2i / n_rot), (a, b) -> (a cos - b sin, a sin + b cos).
    neox=False pairs dims (2i, 2i + 1) (llama.cpp LLAMA_ROPE_TYPE_NORM); neox=True pairs (i, i + n_rot / 2)
    (LLAMA_ROPE_TYPE_NEOX). Dims from n_rot on are left as they are.
    """
    _check_n_rot(n_rot, x.shape[2])
    if len(positions) != x.shape[0]:
        raise ValueError(f"rope: {len(positions)} positions for {x.shape[0]} rows")
    cos_table, sin_table = _angle_tables(np.asarray(positions), n_rot, float(freq_base), float(freq_scale))
    if x.shape[0] >= ROPE_PARALLEL_MIN_TOKENS:
        _rope_parallel(x, bool(neox), cos_table, sin_table)
    else:
        _rope_serial(x, bool(neox), cos_table, sin_table)


@numba.njit(cache=True, nogil=True, error_model="numpy", inline="always")
def _qkv_token(qkv, t, neox, cos_row, sin_row, q_out, k_pool, v_pool, slot, pos):
    """Token t of a stacked q|k|v projection: q rotated into q_out[t], k rotated and v as it is into the
    caches at (slot, pos)."""
    row = qkv[t]
    n_q, head_dim, n_kv = q_out.shape[1], q_out.shape[2], k_pool.shape[2]
    for h in range(n_q):
        _rotate_head(row, h * head_dim, neox, cos_row, sin_row, q_out[t, h])
    for h in range(n_kv):
        _rotate_head(row, (n_q + h) * head_dim, neox, cos_row, sin_row, k_pool[slot, pos, h])
    v_row = v_pool[slot, pos]
    v_first = (n_q + n_kv) * head_dim
    for h in range(n_kv):
        _store_head(row[v_first + h * head_dim:v_first + (h + 1) * head_dim], v_row[h])


@numba.njit(cache=True, nogil=True, error_model="numpy")
def _check_cache_rows(pool, slots, positions):
    for t in range(slots.shape[0]):
        if not (0 <= slots[t] < pool.shape[0] and 0 <= positions[t] < pool.shape[1]):
            raise IndexError("slot or position outside the KV cache")


@numba.njit(cache=True, nogil=True, error_model="numpy")
def _qkv_serial(qkv, neox, cos_table, sin_table, q_out, k_pool, v_pool, slots, positions):
    _check_cache_rows(k_pool, slots, positions)
    for t in range(qkv.shape[0]):
        _qkv_token(qkv, t, neox, cos_table[t], sin_table[t], q_out, k_pool, v_pool, slots[t], positions[t])


@numba.njit(cache=True, nogil=True, error_model="numpy", parallel=True)
def _qkv_parallel(qkv, neox, cos_table, sin_table, q_out, k_pool, v_pool, slots, positions):
    _check_cache_rows(k_pool, slots, positions)
    for t in prange(qkv.shape[0]):
        _qkv_token(qkv, t, neox, cos_table[t], sin_table[t], q_out, k_pool, v_pool, slots[t], positions[t])


def _qkv_inputs(name: str, qkv: np.ndarray, n_q_heads: int, k_pool: np.ndarray, v_pool: np.ndarray,
                slots: np.ndarray, positions: np.ndarray, n_rot: int, freq_base: float, freq_scale: float
                ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """The checks of a stacked q|k|v projection against its caches (ValueError naming `name`), then (slots,
    positions, cos_table, sin_table) for the kernels."""
    n_kv, head_dim = k_pool.shape[2], k_pool.shape[3]
    if qkv.ndim != 2 or qkv.shape[1] != (n_q_heads + 2 * n_kv) * head_dim or v_pool.shape != k_pool.shape \
            or n_q_heads % n_kv:
        raise ValueError(f"{name}: projection {qkv.shape} for {n_q_heads} query heads and caches "
                         f"{k_pool.shape} / {v_pool.shape}")
    _check_n_rot(n_rot, head_dim)
    slots, positions = np.asarray(slots), np.asarray(positions)
    if not len(slots) == len(positions) == qkv.shape[0]:
        raise ValueError(f"{name}: {len(slots)} slots, {len(positions)} positions for {qkv.shape[0]} rows")
    return (slots, positions, *_angle_tables(positions, n_rot, float(freq_base), float(freq_scale)))


def rope_qkv_into_cache(
    qkv: np.ndarray,
    n_q_heads: int,
    k_pool: np.ndarray,
    v_pool: np.ndarray,
    slots: np.ndarray,
    positions: np.ndarray,
    n_rot: int,
    freq_base: float,
    neox: bool,
    freq_scale: float = 1.0,
) -> np.ndarray:
    """The stacked projection q|k|v (T, (Hq + 2 Hkv) * hd) split, rotated and stored in one pass: returns q
    (T, Hq, hd) rotated as `rope_inplace` would; k rotated and v as they are go to k_pool / v_pool (S, ctx, Hkv,
    hd, float32 or float16) at [slots[t], positions[t]], as `kv_write` would. One kernel call where the split,
    two rotations and two cache writes took seven (each a few microseconds at decode sizes)."""
    slots, positions, cos_table, sin_table = _qkv_inputs("rope_qkv_into_cache", qkv, n_q_heads, k_pool, v_pool,
                                                         slots, positions, n_rot, freq_base, freq_scale)
    n_tok, head_dim = qkv.shape[0], k_pool.shape[3]
    q = np.empty((n_tok, n_q_heads, head_dim), dtype=np.float32)
    kernel = _qkv_parallel if n_tok >= ROPE_PARALLEL_MIN_TOKENS else _qkv_serial
    kernel(qkv, bool(neox), cos_table, sin_table, q, kernel_view(k_pool), kernel_view(v_pool), slots, positions)
    return q


# --- kv cache ------------------------------------------------------------------------------------------


@numba.njit(cache=True, nogil=True, error_model="numpy")
def _kv_write_kernel(pool, slots, positions, values):
    _check_cache_rows(pool, slots, positions)
    for t in range(values.shape[0]):
        src = values[t]
        dst = pool[slots[t], positions[t]]
        for h in range(src.shape[0]):
            for c in range(src.shape[1]):
                dst[h, c] = _f32_to_kv(src[h, c], pool)


def kv_write(pool: np.ndarray, slots: np.ndarray, positions: np.ndarray, values: np.ndarray) -> None:
    """pool[slots[t], positions[t]] = values[t] for each row t: pool (S, ctx, Hkv, hd) float32 or float16
    (rounded to nearest even), values (T, Hkv, hd) float32. One kernel call instead of numpy's fancy-index
    assignment (~5 us a call, two calls per layer per step)."""
    if values.shape[1:] != pool.shape[2:] or not len(slots) == len(positions) == len(values):
        raise ValueError(f"kv_write: values {values.shape} into a pool {pool.shape} with {len(slots)} slots, "
                         f"{len(positions)} positions")
    _kv_write_kernel(kernel_view(pool), np.asarray(slots), np.asarray(positions), values)


# --- swiglu --------------------------------------------------------------------------------------------


@numba.njit(cache=True, nogil=True, fastmath=_FASTMATH, error_model="numpy", inline="always")
def _silu_times(g, u):
    # exp(-g) overflows to inf for g < -88.4 and g / inf is -0, which is the right limit.
    return g / (np.float32(1.0) + _exp_f32(-g)) * u


@_njit
def _swiglu_row(gate, up, out, t):
    gate_row = gate[t]
    up_row = up[t]
    out_row = out[t]
    for i in range(gate_row.shape[0]):
        out_row[i] = _silu_times(gate_row[i], up_row[i])


@_njit
def _swiglu_serial(gate, up, out):
    for t in range(gate.shape[0]):
        _swiglu_row(gate, up, out, t)


@_njit_parallel
def _swiglu_parallel(gate, up, out):
    for t in prange(gate.shape[0]):
        _swiglu_row(gate, up, out, t)


@_njit
def _swiglu_stacked_row(gate_up, out, t):
    _swiglu_stacked_cols(gate_up, out, t, 0, out.shape[1])


@_njit
def _swiglu_stacked_cols(gate_up, out, t, lo, hi):
    """SwiGLU of row t of the stacked gate|up rows, columns lo .. hi - 1 (a team shares a row's columns out).

    Over slices, indexed from 0: with `range(lo, hi)` an index could be negative as far as LLVM knew, so
    numba's wrap-around of negative indices stayed in the loop and it vectorized to gathers and scatters: a
    batch-8 step's 8 rows of 1536 took 6.0 us on one thread of the 2-core Zen 5 VM, 2.5 us as slices."""
    width = out.shape[1]
    gate = gate_up[t, lo:hi]
    up = gate_up[t, width + lo:width + hi]
    out_part = out[t, lo:hi]
    for i in range(out_part.shape[0]):
        out_part[i] = _silu_times(gate[i], up[i])


@_njit
def _swiglu_stacked_serial(gate_up, out):
    for t in range(gate_up.shape[0]):
        _swiglu_stacked_row(gate_up, out, t)


@_njit_parallel
def _swiglu_stacked_parallel(gate_up, out):
    for t in prange(gate_up.shape[0]):
        _swiglu_stacked_row(gate_up, out, t)


@_njit
def _swiglu_stacked_rows(gate_up):
    """swiglu_stacked's kernel choice, compiled (see `_rmsnorm_rows`)."""
    out = np.empty((gate_up.shape[0], gate_up.shape[1] // 2), dtype=np.float32)
    if out.size >= SWIGLU_PARALLEL_MIN_ELEMENTS:
        _swiglu_stacked_parallel(gate_up, out)
    else:
        _swiglu_stacked_serial(gate_up, out)
    return out


def swiglu_stacked(gate_up: np.ndarray) -> np.ndarray:
    """silu(gate) * up from the stacked projection gate|up (T, 2F): (T, F), without splitting it first."""
    if gate_up.ndim != 2 or gate_up.shape[1] % 2:
        raise ValueError(f"swiglu_stacked: need (T, 2F), got {gate_up.shape}")
    return _swiglu_stacked_rows(gate_up)


def swiglu(gate: np.ndarray, up: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
    """silu(gate) * up for gate, up (T, F); writes into `out` (may alias gate or up) and returns it."""
    if out is None:
        out = np.empty_like(gate)
    if gate.size >= SWIGLU_PARALLEL_MIN_ELEMENTS:
        _swiglu_parallel(gate, up, out)
    else:
        _swiglu_serial(gate, up, out)
    return out


# --- attention -----------------------------------------------------------------------------------------


@_njit
def _attend_row(q, b, head, keys, values, kv_head, pos, scale, out, scores, acc, q_row):
    """Attention of query row q[b, head], at position pos, over key rows 0 .. pos of keys[:, kv_head] /
    values[:, kv_head]: the plain loops, for head dims the vector intrinsics do not take (not a multiple of 16).

    Online softmax over tiles of KEY_TILE keys: a running max and sum, and an accumulator rescaled whenever the
    max grows, so no score row is ever built. Everything is float32; the running max keeps every exp()
    argument <= 0. Over a float16 cache this is llama.cpp's arithmetic: the query is rounded to float16 first
    (into q_row) for the dot products with the keys, and the softmax weights to float16 for the products with
    the values (it rounds both to the cache's type before its matrix products); over a float32 cache q_row is
    a plain copy and the weights stay float32. With either rounding left out, the golden prompt's greedy tokens
    or its logits drifted from llama.cpp's (tests/test_golden_smollm2.py).
    """
    row_max = np.float32(-np.inf)
    row_sum = np.float32(0.0)
    acc[:] = 0.0
    for c in range(q_row.shape[0]):
        q_row[c] = _kv_to_f32(_f32_to_kv(q[b, head, c], keys))
    for k0 in range(0, pos + 1, KEY_TILE):
        k1 = min(pos + 1, k0 + KEY_TILE)
        new_max = row_max
        for j in range(k0, k1):
            k_row = keys[j, kv_head]
            dot = np.float32(0.0)
            for c in range(q_row.shape[0]):
                dot += q_row[c] * _kv_to_f32(k_row[c])
            score = dot * scale
            scores[j - k0] = score
            new_max = max(new_max, score)
        correction = _exp_f32(row_max - new_max)
        total = row_sum * correction
        if correction != 1.0:
            for c in range(acc.shape[0]):
                acc[c] *= correction
        for j in range(k0, k1):
            scores[j - k0] = _exp_f32(scores[j - k0] - new_max)
            total += scores[j - k0]
        for j in range(k0, k1):
            weight = _kv_to_f32(_f32_to_kv(scores[j - k0], values))  # float16 over a float16 cache
            if weight < MIN_WEIGHT:
                continue  # nothing at float32 precision, and its products with v would be denormal
            v_row = values[j, kv_head]
            for c in range(acc.shape[0]):
                acc[c] += weight * _kv_to_f32(v_row[c])
        row_sum = total
        row_max = new_max
    inv_total = np.float32(1.0) / row_sum
    out_row = out[b, head]
    for c in range(out_row.shape[0]):
        out_row[c] = acc[c] * inv_total


# One intrinsic per number of query heads handled together (1 .. MAX_WIDTH).
_key_scores_1, _key_scores_2, _key_scores_3, _key_scores_4 = (key_scores_intrinsic(w) for w in range(1, 5))
_values_1, _values_2, _values_3, _values_4 = (value_accumulate_intrinsic(w) for w in range(1, 5))
_prefetch_rows = prefetch_rows_intrinsic()


@_njit_inline
def _scores_for_heads(q_rows, h, width, keys, kvh, j0, n, scale, scores, col, maxes):
    if width == 4:
        _key_scores_4(q_rows, h, keys, kvh, j0, n, scale, scores, col, maxes)
    elif width == 3:
        _key_scores_3(q_rows, h, keys, kvh, j0, n, scale, scores, col, maxes)
    elif width == 2:
        _key_scores_2(q_rows, h, keys, kvh, j0, n, scale, scores, col, maxes)
    else:
        _key_scores_1(q_rows, h, keys, kvh, j0, n, scale, scores, col, maxes)


@_njit_inline
def _values_for_heads(acc, h, width, weights, values, kvh, j0, n):
    if width == 4:
        _values_4(acc, h, weights, values, kvh, j0, n)
    elif width == 3:
        _values_3(acc, h, weights, values, kvh, j0, n)
    elif width == 2:
        _values_2(acc, h, weights, values, kvh, j0, n)
    else:
        _values_1(acc, h, weights, values, kvh, j0, n)


@_njit
def _attend_group(q_rows, group, n_tok, keys, values, kvh, k_lo, k_hi, k_cap, scale, row_max, row_sum, acc, scores,
                  tile_max, tile_prefetch=True):
    """Online softmax of n_tok tokens' query rows of kv head kvh: token t's `group` rows are q_rows[t * group :
    (t + 1) * group] (hd wide), and it attends key rows k_lo .. min(k_hi + t, k_cap) - 1 (consecutive positions:
    a decode item has n_tok 1 and k_cap = k_hi). row_max, row_sum, acc, scores and tile_max have a row per
    query row, as q_rows.

    The arithmetic of `_attend_row` for one row per head, except that a score's dot product is summed in
    another order (attend_ir): per tile of KEY_TILE keys, the scores of every head, then each head's running
    max and sum and its rescaled accumulator, then the weighted values. Weights below MIN_WEIGHT become 0,
    which add nothing (`_attend_row` skips those rows). A token's rows go through the same operations whatever
    n_tok is: the tokens only take turns inside each tile, so a prefilled position gets a decoded one's bits
    while the tile's keys and values are read from memory once for all of them.

    With tile_prefetch, each tile's values and the next tile's keys are asked for into L1 before its scores
    (attend_ir.prefetch_rows_intrinsic), the first tile's keys at once: ~4 prefetches a key, ~15% of the
    attention's time when the rows are in the caches already (`bench/attention_parts.py`'s shapes, position
    400, 2026-12-06). The decode step's team asks for a whole item's rows into L2 before it
    (`decode_layers._prefetch_item_kv`) and goes without them: `bench/step_ab.py` (2-core Zen 4 VM, 2026-12-06,
    8-12 rounds), batch 8 +1.5%, +1.0% at 128 tokens and +2.8% at 256, batch 1 +0.4%, +1.6%; over HTTP
    (`bench/http_ab.py`, 16 pairs) 8 streams +2.1%, 1 stream +0.4%."""
    k_end = min(k_hi + n_tok - 1, k_cap)
    if tile_prefetch:
        _prefetch_rows(keys, kvh, k_lo, min(k_end, k_lo + KEY_TILE))
    for k0 in range(k_lo, k_end, KEY_TILE):
        if tile_prefetch:
            _prefetch_rows(values, kvh, k0, min(k_end, k0 + KEY_TILE))
            _prefetch_rows(keys, kvh, min(k_end, k0 + KEY_TILE), min(k_end, k0 + 2 * KEY_TILE))
        for t in range(n_tok):
            k1 = min(min(k_hi + t, k_cap), k0 + KEY_TILE)
            if k1 <= k0:
                continue  # this token's keys ended before the tile
            first = t * group
            tile_max[first:first + group] = -np.inf
            for h in range(first, first + group, MAX_WIDTH):
                width = min(MAX_WIDTH, first + group - h)
                for j0 in range(k0, k1, LANES):
                    _scores_for_heads(q_rows, h, width, keys, kvh, j0, min(LANES, k1 - j0), scale, scores, j0 - k0,
                                      tile_max)
            for h in range(first, first + group):
                old_max = row_max[h]
                new_max = max(old_max, tile_max[h])  # max(old_max, this tile's scores), NaN scores ignored
                correction = _exp_f32(old_max - new_max)
                total = row_sum[h] * correction
                if correction != 1.0:
                    for c in range(acc.shape[1]):
                        acc[h, c] *= correction
                for j in range(k1 - k0):
                    p = _exp_f32(scores[h, j] - new_max)
                    total += p
                    weight = _kv_to_f32(_f32_to_kv(p, values))  # float16 over a float16 cache
                    scores[h, j] = np.float32(0.0) if weight < MIN_WEIGHT else weight
                row_sum[h] = total
                row_max[h] = new_max
            for h in range(first, first + group, MAX_WIDTH):
                _values_for_heads(acc, h, min(MAX_WIDTH, first + group - h), scores, values, kvh, k0, k1 - k0)


@_njit
def _finish_rows(out, b, h0, n_heads, row_sum, acc):
    for i in range(n_heads):
        inv_total = np.float32(1.0) / row_sum[i]
        out_row = out[b, h0 + i]
        for c in range(out_row.shape[0]):
            out_row[c] = acc[i, c] * inv_total


@_njit
def _check_decode_rows(n_slots, ctx, slot_ids, positions, distinct_slots):
    """ValueError for a slot or position outside the caches (and, with distinct_slots, two rows on one slot)."""
    for b in range(slot_ids.shape[0]):
        if slot_ids[b] < 0 or slot_ids[b] >= n_slots:
            raise ValueError("attention_decode_batch: slot id out of range")
        if positions[b] < 0 or positions[b] >= ctx:
            raise ValueError("attention_decode_batch: position outside the KV cache")
        if distinct_slots:
            for other in range(b):
                if slot_ids[other] == slot_ids[b]:
                    raise ValueError("attention_decode_qkv: two sequences on one slot")


@_njit
def _decode_layout(n_seqs, n_q_heads, n_kv_heads, n_slots, ctx, slot_ids, positions, distinct_slots):
    """The work items of a decode attention launch: (sequence, kv head, subgroup of its query heads, run of
    DECODE_SPLIT_KEYS keys). The query heads of a kv head are split into subgroups only when there are fewer
    than DECODE_MIN_ITEMS (sequence, kv head) pairs (batch 1): a head's arithmetic is the same in any subgroup,
    so no bits change. Returns (first_item, per_subgroup, n_subgroups, max_splits): sequence b's items are
    first_item[b] .. first_item[b + 1] - 1. Raises ValueError for a slot or position outside the caches (and,
    with distinct_slots, for two sequences on one slot)."""
    group = n_q_heads // n_kv_heads
    n_subgroups = min(group, (DECODE_MIN_ITEMS + n_seqs * n_kv_heads - 1) // (n_seqs * n_kv_heads))
    per_subgroup = (group + n_subgroups - 1) // n_subgroups
    n_subgroups = (group + per_subgroup - 1) // per_subgroup
    per_split = n_kv_heads * n_subgroups
    _check_decode_rows(n_slots, ctx, slot_ids, positions, distinct_slots)
    first_item = np.empty(n_seqs + 1, dtype=np.int64)
    first_item[0] = 0
    max_splits = 1
    for b in range(n_seqs):
        n_splits = (positions[b] + DECODE_SPLIT_KEYS) // DECODE_SPLIT_KEYS
        max_splits = max(max_splits, n_splits)
        first_item[b + 1] = first_item[b] + per_split * n_splits
    return first_item, per_subgroup, n_subgroups, max_splits


@_njit
def _decode_item(item, first_item, per_subgroup, n_subgroups, group, n_kv_heads, positions):
    """(b, split, kvh, h0, n_heads, k_lo, k_hi) of work item `item` (see `_decode_layout`): sequence b, its
    key run `split` (keys k_lo .. k_hi - 1), kv head kvh and its query heads h0 .. h0 + n_heads - 1."""
    b = 0
    while first_item[b + 1] <= item:
        b += 1
    per_split = n_kv_heads * n_subgroups
    local = item - first_item[b]
    split = local // per_split
    kvh = (local % per_split) // n_subgroups
    h0 = kvh * group + (local % n_subgroups) * per_subgroup
    n_heads = min(per_subgroup, (kvh + 1) * group - h0)
    k_lo = split * DECODE_SPLIT_KEYS
    k_hi = min(positions[b] + 1, k_lo + DECODE_SPLIT_KEYS)
    return b, split, kvh, h0, n_heads, k_lo, k_hi


@_njit
def _item_scratch(max_heads, head_dim):
    """The work arrays of a decode attention work item of up to max_heads query heads: (q_rows, row_max,
    row_sum, acc, scores, tile_max). Every item sets what it reads, so a thread allocates them once and reuses
    them across its items (an allocation and its free per item cost more than some short items' arithmetic)."""
    return (np.empty((max_heads, head_dim), dtype=np.float32), np.empty(max_heads, dtype=np.float32),
            np.empty(max_heads, dtype=np.float32), np.empty((max_heads, head_dim), dtype=np.float32),
            np.empty((max_heads, KEY_TILE), dtype=np.float32), np.empty(max_heads, dtype=np.float32))


@_njit
def _attend_item(n_heads, keys, values, kvh, k_lo, k_hi, scale32, b, h0, split, single_run, out,
                 part_max, part_sum, part_acc, scratch, tile_prefetch=True):
    """Attend the first n_heads query rows of scratch's q_rows (already rounded to the cache's type) over keys
    k_lo .. k_hi - 1; a sequence's single run writes its output rows at once, a split one leaves its softmax
    state for `_merge_splits`. tile_prefetch: `_attend_group`'s."""
    q_all, max_all, sum_all, acc_all, scores_all, tile_all = scratch
    q_rows, row_max, row_sum, acc, scores, tile_max = (q_all[:n_heads], max_all[:n_heads], sum_all[:n_heads],
                                                       acc_all[:n_heads], scores_all[:n_heads], tile_all[:n_heads])
    row_max[:] = -np.inf
    row_sum[:] = 0.0
    acc[:, :] = 0.0
    _attend_group(q_rows, n_heads, 1, keys, values, kvh, k_lo, k_hi, k_hi, scale32, row_max, row_sum, acc, scores,
                  tile_max, tile_prefetch)
    _leave_rows(out, b, h0, n_heads, split, single_run, row_max, row_sum, acc, part_max, part_sum, part_acc)


@_njit
def _leave_rows(out, b, h0, n_heads, split, single_run, row_max, row_sum, acc, part_max, part_sum, part_acc):
    """Query rows h0 .. h0 + n_heads - 1 of sequence b after one run of keys: a sequence's single run writes its
    output rows at once (only its own item read these heads' q, so out may be q), a split one leaves its
    softmax state for `_merge_splits`."""
    if single_run:
        _finish_rows(out, b, h0, n_heads, row_sum, acc)
        return
    for i in range(n_heads):
        part_max[b, h0 + i, split] = row_max[i]
        part_sum[b, h0 + i, split] = row_sum[i]
        part_acc[b, h0 + i, split] = acc[i]


@_njit
def _merge_splits(positions, part_max, part_sum, part_acc, out):
    """The output rows of the sequences whose keys were split into runs: their softmax states merged."""
    _merge_split_rows(positions, part_max, part_sum, part_acc, out, 0, out.shape[0])


@_njit
def _merge_split_rows(positions, part_max, part_sum, part_acc, out, b_lo, b_hi):
    """`_merge_splits` for sequences b_lo .. b_hi - 1."""
    n_q_heads, head_dim = out.shape[1], out.shape[2]
    for b in range(b_lo, b_hi):
        n_splits = (positions[b] + DECODE_SPLIT_KEYS) // DECODE_SPLIT_KEYS
        if n_splits == 1:
            continue
        for head in range(n_q_heads):
            out_row = out[b, head]
            top = part_max[b, head, 0]
            for split in range(1, n_splits):
                top = max(top, part_max[b, head, split])
            total = np.float32(0.0)
            out_row[:] = 0.0
            for split in range(n_splits):
                factor = _exp_f32(part_max[b, head, split] - top)
                total += part_sum[b, head, split] * factor
                for c in range(head_dim):
                    out_row[c] += part_acc[b, head, split, c] * factor
            inv_total = np.float32(1.0) / total
            for c in range(head_dim):
                out_row[c] *= inv_total


@_njit
def _split_states(n_seqs, n_q_heads, head_dim, max_splits):
    """Buffers for the softmax states of split sequences (empty when no sequence is split)."""
    part_max = np.empty((n_seqs, n_q_heads, max_splits), dtype=np.float32)
    part_sum = np.empty((n_seqs, n_q_heads, max_splits), dtype=np.float32)
    part_acc = np.empty((n_seqs, n_q_heads, max_splits if max_splits > 1 else 0, head_dim), dtype=np.float32)
    return part_max, part_sum, part_acc


@_njit_parallel
def _attention_decode_kernel(q, k_all, v_all, slot_ids, positions, scale, out):
    n_seqs, n_q_heads, head_dim = q.shape
    n_kv_heads = k_all.shape[2]
    group = n_q_heads // n_kv_heads
    first_item, per_subgroup, n_subgroups, max_splits = _decode_layout(
        n_seqs, n_q_heads, n_kv_heads, k_all.shape[0], k_all.shape[1], slot_ids, positions, False)
    part_max, part_sum, part_acc = _split_states(n_seqs, n_q_heads, head_dim, max_splits)
    scale32 = np.float32(scale)
    for item in prange(first_item[n_seqs]):
        b, split, kvh, h0, n_heads, k_lo, k_hi = _decode_item(np.int64(item), first_item, per_subgroup,
                                                              n_subgroups, group, n_kv_heads, positions)
        keys = k_all[slot_ids[b]]
        values = v_all[slot_ids[b]]
        scratch = _item_scratch(n_heads, head_dim)
        q_rows = scratch[0]
        for i in range(n_heads):
            for c in range(head_dim):
                q_rows[i, c] = _kv_to_f32(_f32_to_kv(q[b, h0 + i, c], keys))
        _attend_item(n_heads, keys, values, kvh, k_lo, k_hi, scale32, b, h0, split,
                     first_item[b + 1] - first_item[b] == n_kv_heads * n_subgroups, out, part_max, part_sum, part_acc,
                     scratch)
    _merge_splits(positions, part_max, part_sum, part_acc, out)


@_njit
def _prefill_layout(n_tokens, n_kv_heads, start_pos):
    """The work items of a prefill attention launch: (block of PREFILL_QUERY_BLOCK tokens, run of
    DECODE_SPLIT_KEYS keys that some token of the block reaches, kv head). Block i's items are first_item[i] ..
    first_item[i + 1] - 1."""
    n_blocks = (n_tokens + PREFILL_QUERY_BLOCK - 1) // PREFILL_QUERY_BLOCK
    first_item = np.empty(n_blocks + 1, dtype=np.int64)
    first_item[0] = 0
    for i in range(n_blocks):
        last_pos = start_pos + min(n_tokens, (i + 1) * PREFILL_QUERY_BLOCK) - 1
        first_item[i + 1] = first_item[i] + n_kv_heads * (last_pos // DECODE_SPLIT_KEYS + 1)
    return first_item


@_njit_parallel
def _attention_prefill_kernel(q, keys, values, start_pos, scale, out):
    """`_attention_decode_kernel` for the consecutive positions start_pos .. of one sequence, the tokens taken
    PREFILL_QUERY_BLOCK at a time: a work item attends a block's tokens over one run of keys together
    (`_attend_group`), each token with a decoded position's operations, splits and merge."""
    n_tokens, n_q_heads, head_dim = q.shape
    n_kv_heads = keys.shape[1]
    group = n_q_heads // n_kv_heads
    first_item = _prefill_layout(n_tokens, n_kv_heads, start_pos)
    positions = np.arange(start_pos, start_pos + n_tokens).astype(np.int32)
    part_max, part_sum, part_acc = _split_states(n_tokens, n_q_heads, head_dim,
                                                 (start_pos + n_tokens - 1) // DECODE_SPLIT_KEYS + 1)
    scale32 = np.float32(scale)
    n_blocks = first_item.shape[0] - 1
    for item in prange(first_item[n_blocks]):
        block = 0
        while first_item[block + 1] <= item:
            block += 1
        split = (item - first_item[block]) // n_kv_heads
        kvh = (item - first_item[block]) % n_kv_heads
        k_lo = split * DECODE_SPLIT_KEYS
        # The block's tokens that reach this run of keys: a suffix of it (position >= k_lo).
        t_lo = max(block * PREFILL_QUERY_BLOCK, k_lo - start_pos)
        t_hi = min(n_tokens, (block + 1) * PREFILL_QUERY_BLOCK)
        n_tok = t_hi - t_lo
        q_rows, row_max, row_sum, acc, scores, tile_max = _item_scratch(n_tok * group, head_dim)
        for t in range(n_tok):
            for i in range(group):
                for c in range(head_dim):
                    q_rows[t * group + i, c] = _kv_to_f32(_f32_to_kv(q[t_lo + t, kvh * group + i, c], keys))
        row_max[:] = -np.inf
        row_sum[:] = 0.0
        acc[:, :] = 0.0
        _attend_group(q_rows, group, n_tok, keys, values, kvh, k_lo, start_pos + t_lo + 1, k_lo + DECODE_SPLIT_KEYS,
                      scale32, row_max, row_sum, acc, scores, tile_max)
        for t in range(n_tok):
            rows = slice(t * group, (t + 1) * group)
            _leave_rows(out, t_lo + t, kvh * group, group, split, start_pos + t_lo + t < DECODE_SPLIT_KEYS,
                        row_max[rows], row_sum[rows], acc[rows], part_max, part_sum, part_acc)
    _merge_splits(positions, part_max, part_sum, part_acc, out)


# No fast-math flags (see the rope kernels): `_rotate_head` is inlined here, and must compute what it does in
# `rope_qkv_into_cache`. The attention itself runs in `_attend_item`, compiled with its own flags.
@numba.njit(cache=True, nogil=True, error_model="numpy", parallel=True)
def _attention_decode_qkv_kernel(qkv, neox, cos_table, sin_table, k_all, v_all, slot_ids, positions, scale, out):
    """`_attention_decode_kernel` on the stacked projection: each item rotates its own query heads out of qkv,
    and every item whose run ends at the sequence's position first writes that position's rotated key and its
    value for its kv head (the items of one kv head's subgroups write the same bits there), as
    `rope_qkv_into_cache` would have before the launch."""
    n_seqs, n_q_heads, head_dim = out.shape
    first_item, per_subgroup, n_subgroups, max_splits = _decode_layout(
        n_seqs, n_q_heads, k_all.shape[2], k_all.shape[0], k_all.shape[1], slot_ids, positions, True)
    part_max, part_sum, part_acc = _split_states(n_seqs, n_q_heads, head_dim, max_splits)
    scale32 = np.float32(scale)
    for item in prange(first_item[n_seqs]):
        _attention_qkv_item(np.int64(item), qkv, neox, cos_table, sin_table, k_all, v_all, slot_ids, positions,
                            scale32, out, first_item, per_subgroup, n_subgroups, part_max, part_sum, part_acc,
                            _item_scratch(per_subgroup, head_dim))
    _merge_splits(positions, part_max, part_sum, part_acc, out)


# Inlined into the decode step's team member, which calls it for every item (at batch 8, 24 a layer), and into
# `_attention_decode_qkv_kernel` (`_njit_inline` says what a call costs). `bench/step_ab.py` against the call
# (2-core Zen 4 VM, 2026-12-06, three runs of 10-12 rounds): batch 8 +2.7%, +0.9%, +1.4%, batch 1 -0.7%, +4.2%,
# +1.5%; `bench/cold_start.py`: 65.7 s against 72.8 s, one start each (no cost seen).
@_njit_inline
def _attention_qkv_item(item, qkv, neox, cos_table, sin_table, k_all, v_all, slot_ids, positions, scale32, out,
                        first_item, per_subgroup, n_subgroups, part_max, part_sum, part_acc, scratch,
                        tile_prefetch=True):
    """Work item `item` of `_attention_decode_qkv_kernel` (see `_decode_layout`); scratch from
    `_item_scratch(per_subgroup, head_dim)`; tile_prefetch: `_attend_group`'s. Returns (b, h0, n_heads): the output
    rows out[b, h0 : h0 + n_heads] it wrote (or, for a split run, the rows whose softmax state it left)."""
    n_q_heads, head_dim = out.shape[1], out.shape[2]
    n_kv_heads = k_all.shape[2]
    group = n_q_heads // n_kv_heads
    v_first = (n_q_heads + n_kv_heads) * head_dim
    b, split, kvh, h0, n_heads, k_lo, k_hi = _decode_item(item, first_item, per_subgroup, n_subgroups, group,
                                                          n_kv_heads, positions)
    slot, pos, row = slot_ids[b], positions[b], qkv[b]
    keys = k_all[slot]
    values = v_all[slot]
    if k_hi == pos + 1:
        _rotate_head(row, (n_q_heads + kvh) * head_dim, neox, cos_table[b], sin_table[b], keys[pos, kvh])
        _store_head(row[v_first + kvh * head_dim:v_first + (kvh + 1) * head_dim], values[pos, kvh])
    q_rows = scratch[0]
    for i in range(n_heads):
        _rotate_head(row, (h0 + i) * head_dim, neox, cos_table[b], sin_table[b], q_rows[i])
        for c in range(head_dim):
            q_rows[i, c] = _kv_to_f32(_f32_to_kv(q_rows[i, c], keys))
    _attend_item(n_heads, keys, values, kvh, k_lo, k_hi, scale32, b, h0, split,
                 first_item[b + 1] - first_item[b] == n_kv_heads * n_subgroups, out, part_max, part_sum, part_acc,
                 scratch, tile_prefetch)
    return b, h0, n_heads


@_njit_parallel
def _attention_decode_rows_kernel(q, k_all, v_all, slot_ids, positions, scale, out):
    n_seqs, n_q_heads, head_dim = q.shape
    _check_decode_rows(k_all.shape[0], k_all.shape[1], slot_ids, positions, False)
    group = n_q_heads // k_all.shape[2]
    scale32 = np.float32(scale)
    for item in prange(n_seqs * n_q_heads):
        b = item // n_q_heads
        head = item % n_q_heads
        slot = slot_ids[b]
        scores = np.empty(KEY_TILE, dtype=np.float32)
        acc = np.empty(head_dim, dtype=np.float32)
        q_row = np.empty(head_dim, dtype=np.float32)
        _attend_row(q, b, head, k_all[slot], v_all[slot], head // group, positions[b], scale32, out,
                    scores, acc, q_row)


def attention(
    q: np.ndarray,
    k_cache: np.ndarray,
    v_cache: np.ndarray,
    start_pos: int,
    scale: float,
    out: np.ndarray | None = None,
) -> np.ndarray:
    """Causal grouped-query attention of T new tokens over one sequence's KV cache.

    q (T, Hq, hd); k_cache, v_cache (ctx, Hkv, hd), with the T new keys and values already written at rows
    start_pos .. start_pos + T - 1. Query t sits at position start_pos + t and attends to cache rows
    0 .. start_pos + t; rows past start_pos + T - 1 are never read. Query head h uses kv head
    h // (Hq // Hkv). Returns softmax(scale * q.k) . v as (T, Hq, hd), written into `out` when given
    (`out` may be q itself: each (rows, head) piece is written only after its own queries were read).

    Each token attends exactly as a decode step at its position does (`attention_decode_batch`, one row per
    token): a position's numbers do not depend on whether it was prefilled or decoded, so a turn whose prompt
    is cached up to its last token samples the same first token as an uncached one. The tokens go through each
    tile of keys PREFILL_QUERY_BLOCK at a time (`_attention_prefill_kernel`); head dims that are not a
    multiple of 16 take `attention_decode_batch`'s plain loops, one row per token.
    """
    n_tokens, n_q_heads, head_dim = q.shape
    ctx, n_kv_heads, kv_dim = k_cache.shape
    if kv_dim != head_dim or v_cache.shape != k_cache.shape or n_q_heads % n_kv_heads:
        raise ValueError(
            f"attention shapes do not fit: q {q.shape}, k_cache {k_cache.shape}, v_cache {v_cache.shape}"
        )
    if start_pos < 0 or start_pos + n_tokens > ctx:
        raise ValueError(
            f"attention: rows {start_pos}..{start_pos + n_tokens - 1} are outside a cache of {ctx}"
        )
    if head_dim % LANES == 0:
        if out is None:
            out = np.empty_like(q)
        _attention_prefill_kernel(q, kernel_view(k_cache), kernel_view(v_cache), start_pos, scale, out)
        return out
    positions = np.arange(start_pos, start_pos + n_tokens, dtype=np.int32)
    return attention_decode_batch(q, k_cache[None], v_cache[None], positions, scale, out,
                                  slot_ids=np.zeros(n_tokens, dtype=np.int32))


def attention_decode_batch(
    q: np.ndarray,
    k_cache: np.ndarray,
    v_cache: np.ndarray,
    positions: np.ndarray,
    scale: float,
    out: np.ndarray | None = None,
    *,
    slot_ids: np.ndarray | None = None,
) -> np.ndarray:
    """One decode token for each of B sequences, in a single parallel launch over (sequence, kv head): the
    query heads of a kv head read its keys and values together (attend_ir), and contexts longer than
    DECODE_SPLIT_KEYS are split into runs merged at the end. Head dims that are not a multiple of 16 take
    the plain loops of `_attend_row`, one (sequence, head) per item.

    The caches are stacked, not a list: k_cache, v_cache (S, ctx, Hkv, hd) hold S slots of one layer, and
    sequence b reads slot slot_ids[b] (int32 (B,); omitted means slot b, which needs S >= B). A slot's
    cache is the C-contiguous view k_cache[slot], which is what `attention` takes for that sequence.
    q (B, Hq, hd); positions int32 (B,): sequence b's query sits at positions[b] (its new key and value
    already written there) and attends to rows 0 .. positions[b] of its slot. Returns (B, Hq, hd), written
    into `out` when given (may be q itself). A slot id or position outside the cache raises ValueError.
    """
    n_seqs, n_q_heads, head_dim = q.shape
    is_stacked = isinstance(k_cache, np.ndarray) and k_cache.ndim == 4
    if not is_stacked or getattr(v_cache, "shape", None) != k_cache.shape:
        raise TypeError(
            "attention_decode_batch takes stacked caches (S, ctx, Hkv, hd) plus slot_ids, "
            f"got {type(k_cache).__name__} / {type(v_cache).__name__}"
        )
    if k_cache.shape[3] != head_dim or n_q_heads % k_cache.shape[2] or len(positions) != n_seqs:
        raise ValueError(
            f"attention_decode_batch shapes do not fit: q {q.shape}, caches {k_cache.shape}, "
            f"positions {len(positions)}"
        )
    if slot_ids is None:
        slot_ids = np.arange(n_seqs, dtype=np.int32)
    elif len(slot_ids) != n_seqs:
        raise ValueError(f"attention_decode_batch: {len(slot_ids)} slot ids for {n_seqs} queries")
    if out is None:
        out = np.empty_like(q)
    k_view, v_view = kernel_view(k_cache), kernel_view(v_cache)
    if head_dim % LANES == 0:
        _attention_decode_kernel(q, k_view, v_view, slot_ids, positions, scale, out)
    else:
        _attention_decode_rows_kernel(q, k_view, v_view, slot_ids, positions, scale, out)
    return out


def attention_decode_qkv(
    qkv: np.ndarray,
    n_q_heads: int,
    k_pool: np.ndarray,
    v_pool: np.ndarray,
    slots: np.ndarray,
    positions: np.ndarray,
    n_rot: int,
    freq_base: float,
    neox: bool,
    scale: float,
    freq_scale: float = 1.0,
) -> np.ndarray:
    """A decode step's attention straight from the stacked projection q|k|v (B, (Hq + 2 Hkv) * hd), one token
    per sequence on distinct slots: `rope_qkv_into_cache` then `attention_decode_batch`, in one parallel
    launch and with the same bits (the rotation and the attention are the same code). Sequence b's rotated
    key and its value land in k_pool / v_pool at [slots[b], positions[b]] as they would there. Returns the
    attention output (B, Hq, hd)."""
    head_dim = k_pool.shape[3]
    if head_dim % LANES:
        q = rope_qkv_into_cache(qkv, n_q_heads, k_pool, v_pool, slots, positions, n_rot, freq_base, neox, freq_scale)
        return attention_decode_batch(q, k_pool, v_pool, positions, scale, q, slot_ids=slots)
    slots, positions, cos_table, sin_table = _qkv_inputs("attention_decode_qkv", qkv, n_q_heads, k_pool, v_pool,
                                                         slots, positions, n_rot, freq_base, freq_scale)
    out = np.empty((qkv.shape[0], n_q_heads, head_dim), dtype=np.float32)
    _attention_decode_qkv_kernel(qkv, bool(neox), cos_table, sin_table, kernel_view(k_pool), kernel_view(v_pool),
                                 slots, positions, scale, out)
    return out
