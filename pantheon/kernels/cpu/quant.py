"""Matrix products computed directly on GGUF quantized weights, on the CPU, with numba.

A weight is N x K: N rows (output features) of K values (input features, ggml ne0), each row stored as its raw GGUF
blocks. Activations `x` are float32 (B, K); `matmul` returns float32 (B, N) = x @ dequantize(W).T.

One path for every batch size, `_gemm_rows`: four weight rows at a time are unpacked by the type's row
dequantizer (`_deq_<type>`) into a float32 scratch that stays in L1, then dotted with every activation row while
they are hot, so the weights are read from memory once per call (once per 1 MiB block of x for very large
batches). Each activation row takes the same instructions whatever the batch size, which makes the result of a
row independent of the batch it is in (see `_dot_4_rows`). Dequantizing tiles and multiplying with OpenBLAS was
measured too (Q4_1 1536x576, one thread, ms per call, rows / tiles+BLAS: B=64 1.18 / 1.62, B=512 9.63 / 9.59,
B=2048 40.7 / 38.4): it is not faster at the batch sizes the scheduler uses, and would break batch invariance.

Nothing is dequantized at load time: `prepare_weight` validates sizes and takes a read-only view of the bytes.

Why a scratch row and not a dot product on each block in registers: numba compiles without LLVM's SLP vectorizer, so
a block's 16- or 32-wide inner loop only vectorizes as a loop, and a dot product per block then pays a horizontal
sum per block and per activation row. Q4_1 1536x576, one thread (Zen 4): a dot product per block took 0.137 ms at
B=1 and 1.03 ms at B=8; unpacking to a scratch row took 0.105 ms and 0.32 ms.

The kernels release the GIL (`nogil`) and run on numba's thread pool (`parallel`), sized by the caller with
`numba.set_num_threads`.
"""

from __future__ import annotations

import functools
import mmap
from collections.abc import Iterable
from dataclasses import dataclass

import numba
import numpy as np
from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType
from llvmlite import ir
from numba import prange, types
from numba.extending import intrinsic

from pantheon.kernels.cpu import int8dot, int8k

__all__ = [
    "SUPPORTED_TYPES",
    "QWeight",
    "UnsupportedTensorType",
    "dequantize_rows",
    "matmul",
    "prepare_weight",
]

F32, F16, BF16 = 0, 1, 30
Q4_0, Q4_1, Q5_0, Q5_1, Q8_0 = 2, 3, 6, 7, 8
Q2_K, Q3_K, Q4_K, Q5_K, Q6_K = 10, 11, 12, 13, 14
IQ4_NL, IQ4_XS = 20, 23
# IQ4_NL / IQ4_XS: 4-bit indices into a fixed non-uniform table of values (`int8dot.IQ4_VALUES`).
_IQ4_FLOATS = int8dot.IQ4_VALUES.astype(np.float32)
# Q4_0's nibble q stands for q - 8: the same lookup as IQ4's, through this table.
_Q4_0_FLOATS = np.arange(-8, 8, dtype=np.float32)

# Bytes of x that `_gemm_rows` streams per pass over a chunk of weight rows, so the block stays in cache (Q4_K
# 2048x8192 at B=512, one thread: 770 ms with the whole 16 MiB of x per pass, 214 ms with 1 MiB blocks).
_X_BLOCK_BYTES = 1024 * 1024
# Widest K for which `_gemm_rows` unpacks 8 weight rows at a time (8 x 768 float32 = 24 KiB of L1 scratch).
_GROUP8_MAX_K = 768

# Every inner loop over a block runs `range(n16)` or `range(2 * n16)` with n16 == 16 passed in from Python. A literal
# bound would let LLVM unroll the 16-trip loop into straight-line code before its loop vectorizer runs, and numba
# runs without the SLP vectorizer, so it would stay scalar (measured 2.3 vs 11.5 Gelem/s for a Q4_1 row).
_N16 = 16

# Fast-math without nnan/ninf: reassociation lets the dot products vectorize, and NaN/Inf in the data still propagate.
_FASTMATH = {"reassoc", "contract", "nsz", "arcp"}
_KERNEL = dict(cache=True, nogil=True, fastmath=_FASTMATH)


# Types with integer kernels (int8 activations): int8dot's, and int8k's (K-quants, 5-bit).
INT8_KERNEL_TYPES: frozenset[int] = int8dot.INT8_TYPES | int8k.TYPES


class UnsupportedTensorType(ValueError):
    """A ggml tensor type that these kernels cannot multiply."""


@dataclass(frozen=True)
class QWeight:
    """A weight matrix as raw GGUF bytes: `rows` (N) rows of `cols` (K) values, shape (rows, row_bytes) uint8."""

    qtype: int
    rows: int
    cols: int
    data: np.ndarray

    def __post_init__(self) -> None:
        # Plain ints: GGUFReader hands out enum types and numpy shapes, which numba would compile separately.
        for name in ("qtype", "rows", "cols"):
            object.__setattr__(self, name, int(getattr(self, name)))
        row_bytes = _row_bytes(self.qtype, self.rows, self.cols)
        data = self.data
        if not isinstance(data, np.ndarray) or data.dtype != np.uint8 or data.shape != (self.rows, row_bytes):
            raise ValueError(
                f"QWeight data must be uint8 of shape ({self.rows}, {row_bytes}) for {_type_name(self.qtype)} "
                f"{self.rows}x{self.cols}, got {getattr(data, 'dtype', type(data).__name__)} "
                f"{getattr(data, 'shape', '')}"
            )
        if not data.flags.c_contiguous:
            raise ValueError("QWeight data must be C-contiguous")

    @property
    def nbytes(self) -> int:
        return self.data.nbytes

    @functools.cached_property
    def int8_packed(self) -> np.ndarray:
        """The rows rearranged for the int8 kernels (`int8dot.pack_weight`, `int8k.pack_weight` for the K and
        5-bit types), built on first use (the load's warm-up forward) and kept; the types of `INT8_KERNEL_TYPES`
        only. Two threads racing here build the same array twice."""
        if self.qtype in int8k.TYPES:
            return int8k.pack_weight(self.qtype, self.data)
        return int8dot.pack_weight(self.qtype, self.data)


# Transparent huge pages (x86-64's 2 MiB pages) for the packed weights: `pack_on_huge_pages`.
HUGE_PAGE = 2 << 20
# Address space reserved per raw byte (not memory: pages count once written). Packed over raw, measured for small
# and model-sized matrices: Q8_0 1.12-1.21, Q4_0 and Q5_0 up to 1.20 (rows padded to a group), Q3_K 1.91-2.06.
_PACKED_PER_RAW = 2.5
_MAP_NORESERVE = 0x4000  # Linux's MAP_NORESERVE (not in Python's mmap module before 3.13)


def pack_on_huge_pages(weights: Iterable[QWeight]) -> int:
    """Build the packed rows (`int8_packed`) of `weights` one after another in one anonymous mapping marked for
    transparent huge pages (madvise MADV_HUGEPAGE), each in place of its own array; returns the bytes placed.

    Why: packed one by one, a llama model's matrices are separate arrays of a few hundred KB to a few MB, on
    4 KiB pages (numpy asks for huge pages from 4 MB up), and a decode step reads every one of them: ~17k pages
    for SmolLM2-135M's 66 MB of layers, about 5x what the second-level TLB holds, so the step's weight stream
    walked the page tables all along. In one mapping aligned to 2 MiB they are ~33 huge pages. The default
    model's decode in-process, both layouts in one process taking turns (`bench/huge_pages_ab.py`, 2-core Zen 4
    VM, 2026-12-06, 12 and 16 rounds): batch 8 +1.5% and +2.4% (per-round ratios 0.99-1.05), batch 1 +1.0% and
    +1.2%. A kernel without transparent huge pages (or with them off) leaves 4 KiB pages and the same bytes.

    Each weight is packed, copied into the mapping and its own array dropped before the next is packed, so a
    load (`decode_layers.build_plan`, before anything else holds the arrays) never holds two copies of the
    model. The mapping reserves address space for every weight (no memory until written); a weight that does not
    fit, or a system without the mapping, keeps its own array."""
    weights = [w for w in {id(w): w for w in weights}.values() if w.qtype in INT8_KERNEL_TYPES]  # once each
    if not weights or not hasattr(mmap, "MADV_HUGEPAGE"):
        return 0
    room = int(sum(w.data.nbytes for w in weights) * _PACKED_PER_RAW) + len(weights) * 64 + 2 * HUGE_PAGE
    try:
        mapping = mmap.mmap(-1, room, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | _MAP_NORESERVE)
        mapping.madvise(mmap.MADV_HUGEPAGE)
    except (OSError, ValueError):
        return 0
    arena = np.frombuffer(mapping, dtype=np.uint8)  # keeps the mapping alive as long as a view of it lives
    start = at = (-arena.ctypes.data) % HUGE_PAGE  # the first 2 MiB boundary inside the mapping
    for w in weights:
        packed = w.int8_packed
        if at + packed.nbytes > arena.size:
            continue
        placed = arena[at:at + packed.nbytes].view(packed.dtype).reshape(packed.shape)
        placed[...] = packed
        placed.flags.writeable = False
        w.__dict__["int8_packed"] = placed  # functools.cached_property's slot: later reads get the copy
        at += -(-packed.nbytes // 64) * 64  # the next starts on a cache line
    return at - start


def prepare_weight(raw: np.ndarray, qtype: int, rows: int, cols: int) -> QWeight:
    """Wrap a tensor's bytes (as GGUFReader gives them) as a QWeight, without copying.

    Args:
        raw: C-contiguous array of any dtype and shape holding exactly rows * row_bytes bytes (may be a memmap).
        qtype: ggml type id.
        rows: N, the output features (ggml ne1).
        cols: K, the input features (ggml ne0); a multiple of the type's block size.

    Raises:
        UnsupportedTensorType: qtype is not in SUPPORTED_TYPES.
        ValueError: the sizes do not match, or raw is not C-contiguous.
    """
    qtype, rows, cols = int(qtype), int(rows), int(cols)
    row_bytes = _row_bytes(qtype, rows, cols)
    if not isinstance(raw, np.ndarray):
        raise ValueError(f"raw must be a numpy array, got {type(raw).__name__}")
    if raw.nbytes != rows * row_bytes:
        raise ValueError(
            f"{_type_name(qtype)} {rows}x{cols} needs {rows * row_bytes} bytes ({rows} rows of {row_bytes}), "
            f"got {raw.nbytes} (dtype {raw.dtype}, shape {raw.shape})"
        )
    if not raw.flags.c_contiguous:
        raise ValueError("raw tensor bytes must be C-contiguous")
    # np.asarray drops the memmap subclass (a view, no copy); read-only keeps one numba signature for every weight.
    data = np.asarray(raw).reshape(-1).view(np.uint8).reshape(rows, row_bytes)
    data.flags.writeable = False
    return QWeight(qtype, rows, cols, data)


def matmul(w: QWeight, x: np.ndarray, out: np.ndarray | None = None, *, int8: bool = False,
           threads: int | None = None) -> np.ndarray:
    """out = x @ dequantize(w).T, float32 (B, N).

    x is float32 (B, K), C-contiguous; out, if given, is float32 (B, N), C-contiguous, and is written in place.
    int8: for the types of `INT8_KERNEL_TYPES`, on CPUs that have the instructions, x is first rounded to int8
    blocks and the products are integer (llama.cpp's arithmetic; see int8dot). Either way a row's result does
    not depend on the other rows of x. `threads`: numba's current thread count, when the caller knows it
    (asking numba costs ~0.75 us a call).

    Raises:
        UnsupportedTensorType: w.qtype is not in SUPPORTED_TYPES.
        ValueError: x or out has the wrong dtype, shape or layout.
    """
    if w.qtype not in SUPPORTED_TYPES:
        raise UnsupportedTensorType(f"ggml tensor type {_type_name(w.qtype)} is not supported by the CPU kernels")
    if x.dtype != np.float32 or x.ndim != 2 or x.shape[1] != w.cols or not x.flags.c_contiguous:
        raise ValueError(
            f"x must be C-contiguous float32 of shape (B, {w.cols}), got {x.dtype} {x.shape}"
            + ("" if x.flags.c_contiguous else " (not C-contiguous)")
        )
    batch = x.shape[0]
    if out is None:
        out = np.empty((batch, w.rows), dtype=np.float32)
    elif out.dtype != np.float32 or out.shape != (batch, w.rows) or not out.flags.c_contiguous:
        raise ValueError(f"out must be C-contiguous float32 of shape ({batch}, {w.rows}), got {out.dtype} {out.shape}")
    if batch == 0:
        return out
    if int8 and int8dot.INT8_ISA is not None and w.qtype in int8dot.INT8_TYPES:
        int8dot.matmul(w.qtype, w.int8_packed, x, out, threads)
    elif int8 and int8dot.INT8_ISA is not None and w.qtype in int8k.TYPES:
        int8k.matmul(w.qtype, w.int8_packed, x, out, threads)
    else:
        _gemm_rows(w.qtype, w.data, x, out, _N16, 4 * (threads or numba.get_num_threads()))
    return out


def dequantize_rows(w: QWeight, row_ids: np.ndarray) -> np.ndarray:
    """Rows `row_ids` of the dequantized weight, float32 (len(row_ids), K): the embedding lookup.

    Raises:
        ValueError: row_ids is not a 1-D integer array.
        IndexError: an id is outside [0, rows).
    """
    if w.qtype not in SUPPORTED_TYPES:
        raise UnsupportedTensorType(f"ggml tensor type {_type_name(w.qtype)} is not supported by the CPU kernels")
    ids = np.asarray(row_ids)
    if ids.ndim != 1 or ids.dtype.kind not in "iu":
        raise ValueError(f"row_ids must be a 1-D integer array, got {ids.dtype} {ids.shape}")
    out = np.empty((ids.shape[0], w.cols), dtype=np.float32)
    if ids.shape[0] == 0:
        return out
    lo, hi = int(ids.min()), int(ids.max())
    if lo < 0 or hi >= w.rows:
        raise IndexError(f"row id {lo if lo < 0 else hi} out of range for a weight with {w.rows} rows")
    if w.qtype == F32:
        np.take(w.data.view(np.float32), ids, axis=0, out=out)
    else:
        _dequant_rows(w.qtype, w.data, np.ascontiguousarray(ids, dtype=np.int64), out, _N16)
    return out


# ---------------------------------------------------------------------------------------------------------------------
# Python-side helpers.


def _type_name(qtype: int) -> str:
    try:
        return f"{GGMLQuantizationType(qtype).name} ({qtype})"
    except ValueError:
        return f"unknown ({qtype})"


def _row_bytes(qtype: int, rows: int, cols: int) -> int:
    if qtype not in SUPPORTED_TYPES:
        raise UnsupportedTensorType(f"ggml tensor type {_type_name(qtype)} is not supported by the CPU kernels")
    block, block_bytes = GGML_QUANT_SIZES[GGMLQuantizationType(qtype)]
    if rows < 1 or cols < 1:
        raise ValueError(f"weight shape must be positive, got rows={rows} cols={cols}")
    if cols % block:
        raise ValueError(f"{_type_name(qtype)}: cols={cols} is not a multiple of the block size {block}")
    return cols // block * block_bytes


# ---------------------------------------------------------------------------------------------------------------------
# Scalar conversions (LLVM IR: `fpext half` compiles to one F16C instruction; numba has no float16 type on the CPU).


@intrinsic
def _half(typingctx, lo, hi):
    """float32 from the little-endian IEEE half in bytes (lo, hi)."""
    if lo != types.uint8 or hi != types.uint8:
        return None

    def codegen(context, builder, signature, args):
        i16 = ir.IntType(16)
        bits = builder.or_(builder.zext(args[0], i16), builder.shl(builder.zext(args[1], i16), ir.Constant(i16, 8)))
        return builder.fpext(builder.bitcast(bits, ir.HalfType()), ir.FloatType())

    return types.float32(lo, hi), codegen


@intrinsic
def _bf16(typingctx, lo, hi):
    """float32 from the little-endian bfloat16 in bytes (lo, hi)."""
    if lo != types.uint8 or hi != types.uint8:
        return None

    def codegen(context, builder, signature, args):
        i32 = ir.IntType(32)
        bits = builder.or_(
            builder.shl(builder.zext(args[0], i32), ir.Constant(i32, 16)),
            builder.shl(builder.zext(args[1], i32), ir.Constant(i32, 24)),
        )
        return builder.bitcast(bits, ir.FloatType())

    return types.float32(lo, hi), codegen


_u8, _i8, _f32 = np.uint8, np.int8, np.float32

# ---------------------------------------------------------------------------------------------------------------------
# Row dequantizers: `_deq_<type>(row, dst, n16)` writes the K floats of one weight row (its raw bytes) into dst[:K].
# Block layouts follow gguf.quants (dequantize_blocks). Integer values are narrowed (_u8/_i8) before the float
# conversion: numba computes integers in int64, and a 64-bit int->float conversion vectorizes badly or not at all.


@intrinsic
def _f32_bits(typingctx, b0, b1, b2, b3):
    """float32 from its four little-endian bytes."""
    if not all(b == types.uint8 for b in (b0, b1, b2, b3)):
        return None

    def codegen(context, builder, signature, args):
        i32 = ir.IntType(32)
        bits = builder.zext(args[0], i32)
        for i, byte in enumerate(args[1:], start=1):
            bits = builder.or_(bits, builder.shl(builder.zext(byte, i32), ir.Constant(i32, 8 * i)))
        return builder.bitcast(bits, ir.FloatType())

    return types.float32(b0, b1, b2, b3), codegen


@numba.njit(**_KERNEL)
def _deq_f32(row, dst, n16):
    for k in range(row.shape[0] // 4):
        dst[k] = _f32_bits(row[4 * k], row[4 * k + 1], row[4 * k + 2], row[4 * k + 3])


@numba.njit(**_KERNEL)
def _deq_f16(row, dst, n16):
    for k in range(row.shape[0] // 2):
        dst[k] = _half(row[2 * k], row[2 * k + 1])


@numba.njit(**_KERNEL)
def _deq_bf16(row, dst, n16):
    for k in range(row.shape[0] // 2):
        dst[k] = _bf16(row[2 * k], row[2 * k + 1])


@numba.njit(**_KERNEL)
def _deq_q8_0(row, dst, n16):
    # d f16, qs int8[32]
    for i in range(row.shape[0] // 34):
        p, o = i * 34, i * 32
        d = _half(row[p], row[p + 1])
        for j in range(2 * n16):
            dst[o + j] = d * _f32(_i8(row[p + 2 + j]))


@numba.njit(inline="always")
def _deq_nibbles(row, at, table, scale, dst, o, n16):
    """A block of 32 values from the 16 bytes at row[at]: element j is the table entry of byte j's low nibble,
    element 16 + j of its high one; times scale."""
    for j in range(n16):
        q = row[at + j]
        dst[o + j] = scale * table[q & 15]
        dst[o + 16 + j] = scale * table[q >> 4]


@numba.njit(**_KERNEL)
def _deq_nibble_blocks(row, dst, n16, table):
    # Q4_0 and IQ4_NL: blocks of d f16, qs[16] (`_deq_nibbles`)
    for i in range(row.shape[0] // 18):
        _deq_nibbles(row, i * 18 + 2, table, _half(row[i * 18], row[i * 18 + 1]), dst, i * 32, n16)


@numba.njit(**_KERNEL)
def _deq_iq4_xs(row, dst, n16):
    # d f16, scales_h (u16), scales_l[4], qs[128]: sub-block b of 32 values has the 6-bit scale ls = nibble b of
    # scales_l | bits 2b, 2b + 1 of scales_h << 4 and 16 qs bytes laid out as IQ4_NL's; value d * (ls - 32) * entry
    for i in range(row.shape[0] // 136):
        p, o = i * 136, i * 256
        d = _half(row[p], row[p + 1])
        for b in range(8):
            _deq_nibbles(row, p + 8 + 16 * b, _IQ4_FLOATS, d * _f32(int8k.iq4_xs_scale(row, p, b)), dst, o + 32 * b,
                         n16)


@numba.njit(**_KERNEL)
def _deq_q4_1(row, dst, n16):
    # d f16, m f16, qs[16]; value d * q + m
    for i in range(row.shape[0] // 20):
        p, o = i * 20, i * 32
        d = _half(row[p], row[p + 1])
        m = _half(row[p + 2], row[p + 3])
        for j in range(n16):
            q = row[p + 4 + j]
            dst[o + j] = d * _f32(_u8(q & 15)) + m
            dst[o + 16 + j] = d * _f32(_u8(q >> 4)) + m


# _BIT[j] = 1 << j: testing a qh bit against a loaded mask vectorizes in 32-bit lanes, where `(qh >> j) & 1` with a
# per-lane shift stays in 64-bit lanes (5.2 against 8.5 Gelem/s for Q5_0).
_BIT = np.array([1 << j for j in range(32)], dtype=np.uint32)


@numba.njit(inline="always")
def _u32(row, p):
    """The little-endian uint32 at row[p:p+4]."""
    lo = np.uint32(row[p]) | (np.uint32(row[p + 1]) << 8)
    return lo | (np.uint32(row[p + 2]) << 16) | (np.uint32(row[p + 3]) << 24)


@numba.njit(**_KERNEL)
def _deq_q5_0(row, dst, n16):
    # d f16, qh u32 (bit j is the 5th bit of element j), qs[16] as Q4_0; value d * (q - 16)
    for i in range(row.shape[0] // 22):
        p, o = i * 22, i * 32
        d = _half(row[p], row[p + 1])
        qh = _u32(row, p + 2)
        for j in range(n16):
            q = row[p + 6 + j]
            lo = (q & 15) | (16 if qh & _BIT[j] else 0)
            hi = (q >> 4) | (16 if qh & _BIT[j + 16] else 0)
            dst[o + j] = d * _f32(_i8(lo - 16))
            dst[o + 16 + j] = d * _f32(_i8(hi - 16))


@numba.njit(**_KERNEL)
def _deq_q5_1(row, dst, n16):
    # d f16, m f16, qh u32, qs[16]; value d * q + m
    for i in range(row.shape[0] // 24):
        p, o = i * 24, i * 32
        d = _half(row[p], row[p + 1])
        m = _half(row[p + 2], row[p + 3])
        qh = _u32(row, p + 4)
        for j in range(n16):
            q = row[p + 8 + j]
            lo = (q & 15) | (16 if qh & _BIT[j] else 0)
            hi = (q >> 4) | (16 if qh & _BIT[j + 16] else 0)
            dst[o + j] = d * _f32(_u8(lo)) + m
            dst[o + 16 + j] = d * _f32(_u8(hi)) + m


# The K-quant loops read each packed byte once and write every element made from it (four 2-bit or two 4-bit
# fields), with constant shifts and masks: a shift by a loop variable stays in 64-bit lanes.


@numba.njit(**_KERNEL)
def _deq_q2_k(row, dst, n16):
    # scales[16] (low nibble: scale, high: min, per group of 16), qs[64] (2 bits), d f16, dmin f16.
    # Element h*128 + s*32 + l (h < 2, s < 4, l < 32) is bits 2s..2s+1 of qs[h*32 + l]; its group is element // 16.
    for i in range(row.shape[0] // 84):
        p, o = i * 84, i * 256
        d = _half(row[p + 80], row[p + 81])
        dmin = _half(row[p + 82], row[p + 83])
        for h in range(2):
            for g2 in range(2):
                g = p + h * 8 + g2  # scale byte of shift s: row[g + 2s]
                d0, m0 = d * _f32(_u8(row[g] & 15)), dmin * _f32(_u8(row[g] >> 4))
                d1, m1 = d * _f32(_u8(row[g + 2] & 15)), dmin * _f32(_u8(row[g + 2] >> 4))
                d2, m2 = d * _f32(_u8(row[g + 4] & 15)), dmin * _f32(_u8(row[g + 4] >> 4))
                d3, m3 = d * _f32(_u8(row[g + 6] & 15)), dmin * _f32(_u8(row[g + 6] >> 4))
                src = p + 16 + h * 32 + g2 * 16
                e = o + h * 128 + g2 * 16
                for l in range(n16):
                    q = row[src + l]
                    dst[e + l] = d0 * _f32(_u8(q & 3)) - m0
                    dst[e + 32 + l] = d1 * _f32(_u8((q >> 2) & 3)) - m1
                    dst[e + 64 + l] = d2 * _f32(_u8((q >> 4) & 3)) - m2
                    dst[e + 96 + l] = d3 * _f32(_u8(q >> 6)) - m3


@numba.njit(inline="always")
def _q3_k_scale(row, p, k):
    """Signed 6-bit scale k (< 16) of the Q3_K block at p: low 4 bits from scales[k] (k < 8) or scales[k-8] >> 4,
    high 2 bits from scales[8 + k%4] >> 2*(k//4); scales start at byte 96."""
    low = (np.int64(row[p + 96 + k]) & 15) if k < 8 else (np.int64(row[p + 88 + k]) >> 4)
    high = (np.int64(row[p + 104 + (k & 3)]) >> (2 * (k >> 2))) & 3
    return _f32(_i8((low | (high << 4)) - 32))


@numba.njit(**_KERNEL)
def _deq_q3_k(row, dst, n16):
    # hmask[32], qs[64] (2 low bits, laid out as Q2_K), scales[12] (16 signed 6-bit scales), d f16.
    # Element h*128 + s*32 + l has high bit (hmask[l] >> (4h + s)) & 1, and value d * scale * (low2 + 4*high - 4).
    for i in range(row.shape[0] // 110):
        p, o = i * 110, i * 256
        d = _half(row[p + 108], row[p + 109])
        for h in range(2):
            for g2 in range(2):
                k = h * 8 + g2  # scale of shift s: k + 2s
                d0, d1 = d * _q3_k_scale(row, p, k), d * _q3_k_scale(row, p, k + 2)
                d2, d3 = d * _q3_k_scale(row, p, k + 4), d * _q3_k_scale(row, p, k + 6)
                bit = _u8(1 << (4 * h))  # hmask bit of shift 0
                src = p + 32 + h * 32 + g2 * 16
                msk = p + g2 * 16
                e = o + h * 128 + g2 * 16
                for l in range(n16):
                    q, hm = row[src + l], row[msk + l]
                    # low2 - 4 where the hmask bit is clear, low2 where it is set
                    dst[e + l] = d0 * _f32(_i8((q & 3) - (0 if hm & bit else 4)))
                    dst[e + 32 + l] = d1 * _f32(_i8(((q >> 2) & 3) - (0 if hm & (bit << 1) else 4)))
                    dst[e + 64 + l] = d2 * _f32(_i8(((q >> 4) & 3) - (0 if hm & (bit << 2) else 4)))
                    dst[e + 96 + l] = d3 * _f32(_i8((q >> 6) - (0 if hm & (bit << 3) else 4)))


@numba.njit(inline="always")
def _k_scale_min(row, p, sb):
    """6-bit (scale, min) of sub-block sb from the 12 packed bytes at row[p:p+12] (Q4_K, Q5_K)."""
    if sb < 4:
        return np.int64(row[p + sb]) & 63, np.int64(row[p + 4 + sb]) & 63
    t = sb - 4
    lo, sc_hi, mn_hi = np.int64(row[p + 8 + t]), np.int64(row[p + t]), np.int64(row[p + 4 + t])
    return (lo & 15) | ((sc_hi >> 2) & 48), (lo >> 4) | ((mn_hi >> 2) & 48)


@numba.njit(**_KERNEL)
def _deq_q4_k(row, dst, n16):
    # d f16, dmin f16, scales[12] (8 x 6-bit scale and min), qs[128].
    # Element c*64 + s*32 + l (c < 4, s < 2) is nibble s of qs[c*32 + l], in sub-block 2c + s; value d*sc*q - dmin*mn.
    for i in range(row.shape[0] // 144):
        p, o = i * 144, i * 256
        d = _half(row[p], row[p + 1])
        dmin = _half(row[p + 2], row[p + 3])
        for c in range(4):
            sc0, mn0 = _k_scale_min(row, p + 4, 2 * c)
            sc1, mn1 = _k_scale_min(row, p + 4, 2 * c + 1)
            d0, m0 = d * _f32(_u8(sc0)), dmin * _f32(_u8(mn0))
            d1, m1 = d * _f32(_u8(sc1)), dmin * _f32(_u8(mn1))
            src = p + 16 + c * 32
            e = o + c * 64
            for l in range(2 * n16):
                q = row[src + l]
                dst[e + l] = d0 * _f32(_u8(q & 15)) - m0
                dst[e + 32 + l] = d1 * _f32(_u8(q >> 4)) - m1


@numba.njit(**_KERNEL)
def _deq_q5_k(row, dst, n16):
    # d f16, dmin f16, scales[12], qh[32], qs[128]: Q4_K plus a 5th bit, (qh[l] >> sub-block) & 1.
    for i in range(row.shape[0] // 176):
        p, o = i * 176, i * 256
        d = _half(row[p], row[p + 1])
        dmin = _half(row[p + 2], row[p + 3])
        for c in range(4):
            sc0, mn0 = _k_scale_min(row, p + 4, 2 * c)
            sc1, mn1 = _k_scale_min(row, p + 4, 2 * c + 1)
            d0, m0 = d * _f32(_u8(sc0)), dmin * _f32(_u8(mn0))
            d1, m1 = d * _f32(_u8(sc1)), dmin * _f32(_u8(mn1))
            bit = _u8(1 << (2 * c))  # qh bit of sub-block 2c
            src = p + 48 + c * 32
            e = o + c * 64
            for l in range(2 * n16):
                q, qh = row[src + l], row[p + 16 + l]
                dst[e + l] = d0 * _f32(_u8((q & 15) | (16 if qh & bit else 0))) - m0
                dst[e + 32 + l] = d1 * _f32(_u8((q >> 4) | (16 if qh & (bit << 1) else 0))) - m1


# Q6_K takes one 32-trip loop that picks the scale per lane (`first`): as two 16-trip loops, one per scale, LLVM
# vectorized it with byte gathers (2.9 against 8.6 Gelem/s).
@numba.njit(**_KERNEL)
def _deq_q6_k(row, dst, n16):
    # ql[128] (low 4 bits), qh[64] (high 2 bits), scales int8[16] (per group of 16), d f16; value d*scale*(q - 32).
    # Element h*128 + t*32 + l (h < 2, t < 4, l < 32): low bits are nibble t//2 of ql[h*64 + (t%2)*32 + l],
    # high bits are bits 2t..2t+1 of qh[h*32 + l].
    for i in range(row.shape[0] // 210):
        p, o = i * 210, i * 256
        d = _half(row[p + 208], row[p + 209])
        for h in range(2):
            g = p + 192 + h * 8  # scale of t: row[g + 2t] for l < 16, row[g + 2t + 1] for l >= 16
            da0, db0 = d * _f32(_i8(row[g])), d * _f32(_i8(row[g + 1]))
            da1, db1 = d * _f32(_i8(row[g + 2])), d * _f32(_i8(row[g + 3]))
            da2, db2 = d * _f32(_i8(row[g + 4])), d * _f32(_i8(row[g + 5]))
            da3, db3 = d * _f32(_i8(row[g + 6])), d * _f32(_i8(row[g + 7]))
            lo = p + h * 64
            hi = p + 128 + h * 32
            e = o + h * 128
            for l in range(2 * n16):
                first = l < n16
                a, b, qh = row[lo + l], row[lo + 32 + l], row[hi + l]
                dst[e + l] = (da0 if first else db0) * _f32(_i8(((a & 15) | ((qh & 3) << 4)) - 32))
                dst[e + 32 + l] = (da1 if first else db1) * _f32(_i8(((b & 15) | ((qh & 12) << 2)) - 32))
                dst[e + 64 + l] = (da2 if first else db2) * _f32(_i8(((a >> 4) | (qh & 48)) - 32))
                dst[e + 96 + l] = (da3 if first else db3) * _f32(_i8(((b >> 4) | ((qh >> 2) & 48)) - 32))


# ---------------------------------------------------------------------------------------------------------------------
# Drivers. They take the ggml type id and pick the row dequantizer per row (`_deq_row`): a runtime switch keeps one
# signature per driver, which numba caches on disk. (Passing the dequantizer itself as an argument compiles a
# specialisation per type, but numba's cache cannot key those across processes: every start recompiled them.)


@numba.njit(**_KERNEL)
def _deq_row(qtype, row, dst, n16):
    """dst[:K] = dequantized row; qtype is one of SUPPORTED_TYPES (checked by the Python callers)."""
    if qtype == Q4_1:
        _deq_q4_1(row, dst, n16)
    elif qtype == Q8_0:
        _deq_q8_0(row, dst, n16)
    elif qtype == Q4_K:
        _deq_q4_k(row, dst, n16)
    elif qtype == Q6_K:
        _deq_q6_k(row, dst, n16)
    elif qtype == Q5_K:
        _deq_q5_k(row, dst, n16)
    elif qtype == Q4_0:
        _deq_nibble_blocks(row, dst, n16, _Q4_0_FLOATS)
    elif qtype == Q5_0:
        _deq_q5_0(row, dst, n16)
    elif qtype == Q5_1:
        _deq_q5_1(row, dst, n16)
    elif qtype == Q3_K:
        _deq_q3_k(row, dst, n16)
    elif qtype == Q2_K:
        _deq_q2_k(row, dst, n16)
    elif qtype == IQ4_XS:
        _deq_iq4_xs(row, dst, n16)
    elif qtype == IQ4_NL:
        _deq_nibble_blocks(row, dst, n16, _IQ4_FLOATS)
    elif qtype == F16:
        _deq_f16(row, dst, n16)
    elif qtype == BF16:
        _deq_bf16(row, dst, n16)
    elif qtype == F32:
        _deq_f32(row, dst, n16)


@numba.njit(parallel=True, **_KERNEL)
def _gemm_rows(qtype, data, x, out, n16, n_chunks):
    """out = x @ W.T: weight rows are unpacked a group at a time into an L1-resident scratch, then dotted with
    every activation row in turn (one row, the group's accumulators, one pass over K).

    A group is 8 weight rows when 8 unpacked rows fit comfortably in L1 (K <= _GROUP8_MAX_K), else 4: 8 rows
    reuse each activation load twice as often (ffn_up at B=8: 0.12 ms instead of 0.21, the Q8_0 head 4.7
    instead of 7.4; 2 threads, Zen 4) but a 48 KiB scratch at K=1536 spills L1 and loses. The grouping
    depends on the weight only, never on the batch, so batch invariance holds (see `_dot_4_rows`).

    The rows are split into about n_chunks equal chunks, one scratch each (a few per thread balances the load). The
    batch is walked in blocks of at most _X_BLOCK_BYTES of x, so the block that is re-read for every group of
    weight rows stays in cache; a weight row is unpacked once per block."""
    n_rows = data.shape[0]
    batch, k_dim = x.shape
    group = 8 if k_dim <= _GROUP8_MAX_K else 4
    block = max(1, min(batch, max(4, _X_BLOCK_BYTES // (16 * k_dim) * 4)))  # rows of x per pass
    chunk = group * ((n_rows + group * n_chunks - 1) // (group * n_chunks))  # rows per chunk
    for c in prange((n_rows + chunk - 1) // chunk):
        w = np.empty((group, k_dim), dtype=np.float32)
        start = c * chunk
        end = min(n_rows, start + chunk)
        for b0 in range(0, batch, block):
            xb = x[b0 : b0 + block]
            ob = out[b0 : b0 + block]
            n = start
            while group == 8 and n + 8 <= end:
                for r in range(8):
                    _deq_row(qtype, data[n + r], w[r], n16)
                _dot_8_rows(w, xb, ob, n)
                n += 8
            while n + 4 <= end:
                for r in range(4):
                    _deq_row(qtype, data[n + r], w[r], n16)
                _dot_4_rows(w, xb, ob, n)
                n += 4
            for r in range(n, end):
                _deq_row(qtype, data[r], w[0], n16)
                _dot_1_row(w[0], xb, ob, r)


@numba.njit(inline="always", fastmath=_FASTMATH)
def _dot_8_rows(w, x, out, n):
    """out[:, n:n+8] = x @ w[:8].T, one activation row at a time (the same per-row code at every batch size)."""
    w0, w1, w2, w3, w4, w5, w6, w7 = w[0], w[1], w[2], w[3], w[4], w[5], w[6], w[7]
    for b in range(x.shape[0]):
        x0 = x[b]
        a0 = a1 = a2 = a3 = a4 = a5 = a6 = a7 = _f32(0)
        for k in range(x.shape[1]):
            y0 = x0[k]
            a0 += w0[k] * y0
            a1 += w1[k] * y0
            a2 += w2[k] * y0
            a3 += w3[k] * y0
            a4 += w4[k] * y0
            a5 += w5[k] * y0
            a6 += w6[k] * y0
            a7 += w7[k] * y0
        out[b, n], out[b, n + 1], out[b, n + 2], out[b, n + 3] = a0, a1, a2, a3
        out[b, n + 4], out[b, n + 5], out[b, n + 6], out[b, n + 7] = a4, a5, a6, a7


@numba.njit(inline="always", fastmath=_FASTMATH)
def _dot_4_rows(w, x, out, n):
    """out[:, n:n+4] = x @ w[:4].T, one activation row at a time.

    Every activation row goes through this same loop whatever the batch size, so a row's result does not
    depend on what else is in the batch (batch invariance: greedy output under load equals output alone, and
    a cached prefix gives the same numbers as a cold prefill). A 4x4 register tile would be ~25% faster at
    B=8, but LLVM vectorizes its reductions differently from the remainder rows', which changes the bits."""
    w0, w1, w2, w3 = w[0], w[1], w[2], w[3]
    for b in range(x.shape[0]):
        x0 = x[b]
        a0 = a1 = a2 = a3 = _f32(0)
        for k in range(x.shape[1]):
            y0 = x0[k]
            a0 += w0[k] * y0
            a1 += w1[k] * y0
            a2 += w2[k] * y0
            a3 += w3[k] * y0
        out[b, n], out[b, n + 1], out[b, n + 2], out[b, n + 3] = a0, a1, a2, a3


@numba.njit(inline="always", fastmath=_FASTMATH)
def _dot_1_row(w0, x, out, n):
    """out[:, n] = x @ w0"""
    for b in range(x.shape[0]):
        x0 = x[b]
        acc = _f32(0)
        for k in range(x.shape[1]):
            acc += w0[k] * x0[k]
        out[b, n] = acc


@numba.njit(parallel=True, **_KERNEL)
def _dequant_rows(qtype, data, ids, out, n16):
    """out[r] = dequantized row ids[r] (ids already checked to be in range)."""
    for r in prange(ids.shape[0]):
        _deq_row(qtype, data[ids[r]], out[r], n16)


# Every type has a branch in `_deq_row`.
SUPPORTED_TYPES: frozenset[int] = frozenset(
    {F32, F16, BF16, Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, Q2_K, Q3_K, Q4_K, Q5_K, Q6_K, IQ4_NL, IQ4_XS}
)
