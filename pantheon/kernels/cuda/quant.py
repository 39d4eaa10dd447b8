"""Matrix products and embedding lookups on CUDA, computed directly on GGUF blocks in device memory.

A weight is N x K (N output features, K input features), each row kept as its raw GGUF bytes on the device:
uint8 (N, row_bytes), the same layout the cpu backend mmaps. Nothing is ever dequantized into device memory.
The unit of work is 32 consecutive values of one row (one block of the 32-value types, an eighth of a K-quant
super-block): `_deq_unit` unpacks a unit into 32 floats in thread-local storage (registers after NVVM unrolls
the loops), which are then dotted with every activation row of the current batch tile.

`matmul`: a block owns `mm_rows` weight rows (threadIdx.y) and `mm_threads` threads per row (threadIdx.x) that
take the row's units round-robin; each thread keeps one partial sum per activation row of a tile of
BATCH_TILE rows, and a shared-memory tree sums the partials (no warp shuffles: the simulator has none). Batch
invariance, as on the cpu: a row of x gets the same instructions in the same order whatever else is in its
batch, so its result does not depend on the batch (greedy output under load equals output alone).

Block layouts are those of gguf.quants (and of pantheon.kernels.cpu.quant, whose comments spell them out). The
fp16 scales are read through a float16 view of the same bytes (every block size and field offset is even);
F32 rows through a float32 view; BF16 by widening the 16 bits to a float32 bit pattern.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np
from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType
from numba import float32, int32, uint32

from pantheon.kernels.cpu.int8dot import IQ4_VALUES
from pantheon.kernels.cuda.launch import BATCH_TILE, GEOMETRY, MM_SHARED, Geometry, blocks, cuda

F32, F16, BF16 = 0, 1, 30
Q4_0, Q4_1, Q5_0, Q5_1, Q8_0 = 2, 3, 6, 7, 8
IQ4_NL, IQ4_XS = 20, 23
# IQ4_NL / IQ4_XS values: a 4-bit index into the format's fixed table, times the block's scale.
_IQ4_TABLE = IQ4_VALUES.astype(np.float32)
Q2_K, Q3_K, Q4_K, Q5_K, Q6_K = 10, 11, 12, 13, 14

SUPPORTED_TYPES: frozenset[int] = frozenset(
    {F32, F16, BF16, Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, Q2_K, Q3_K, Q4_K, Q5_K, Q6_K, IQ4_NL, IQ4_XS}
)
FLOAT_TYPES = frozenset({F32, F16, BF16})
UNIT = 32  # values per unit of work


class UnsupportedTensorType(ValueError):
    """A ggml tensor type that these kernels cannot multiply."""


@dataclass(frozen=True)
class CudaWeight:
    """A weight matrix as raw GGUF bytes in device memory: `rows` (N) rows of `cols` (K) values.

    `data` is uint8 (rows, row_bytes); `half` a float16 view of the same bytes (fp16 scales, F16 values);
    `f32` a float32 view for F32 weights and a 1x1 placeholder otherwise.
    """

    qtype: int
    rows: int
    cols: int
    data: Any
    half: Any
    f32: Any

    @property
    def nbytes(self) -> int:
        return int(self.rows) * int(self.data.shape[1])


def type_name(qtype: int) -> str:
    try:
        return f"{GGMLQuantizationType(qtype).name} ({qtype})"
    except ValueError:
        return f"unknown ({qtype})"


def row_bytes(qtype: int, rows: int, cols: int) -> int:
    """Bytes of one row; raises UnsupportedTensorType or ValueError for what the kernels cannot take."""
    if qtype not in SUPPORTED_TYPES:
        raise UnsupportedTensorType(f"ggml tensor type {type_name(qtype)} is not supported by the CUDA kernels")
    block, block_bytes = GGML_QUANT_SIZES[GGMLQuantizationType(qtype)]
    if rows < 1 or cols < 1:
        raise ValueError(f"weight shape must be positive, got rows={rows} cols={cols}")
    if cols % block:
        raise ValueError(f"{type_name(qtype)}: cols={cols} is not a multiple of the block size {block}")
    return cols // block * block_bytes


def upload_weight(raw: np.ndarray, qtype: int, rows: int, cols: int, placeholder: Any, stream: Any = 0) -> CudaWeight:
    """Copy a tensor's bytes (any C-contiguous array of exactly rows * row_bytes bytes) to the device as is.

    `placeholder` is a 1x1 float32 device array shared by the non-F32 weights (the kernels take one signature).
    """
    qtype, rows, cols = int(qtype), int(rows), int(cols)
    nbytes_row = row_bytes(qtype, rows, cols)
    host = np.ascontiguousarray(raw)
    if host.nbytes != rows * nbytes_row:
        raise ValueError(f"{type_name(qtype)} {rows}x{cols} needs {rows * nbytes_row} bytes, got {host.nbytes}")
    host = host.reshape(-1).view(np.uint8).reshape(rows, nbytes_row)
    data = cuda.to_device(host, stream=stream)
    half = data.view(np.float16)
    f32 = data.view(np.float32) if qtype == F32 else placeholder
    return CudaWeight(qtype, rows, cols, data, half, f32)


def matmul(w: CudaWeight, x: Any, out: Any = None, stream: Any = 0, geometry: Geometry = GEOMETRY) -> Any:
    """out = x @ dequantize(w).T: x float32 (B, K) C-contiguous device array -> float32 (B, N)."""
    if x.dtype != np.float32 or len(x.shape) != 2 or x.shape[1] != w.cols or not x.is_c_contiguous():
        raise ValueError(f"x must be C-contiguous float32 of shape (B, {w.cols}), got {x.dtype} {tuple(x.shape)}")
    batch = x.shape[0]
    if out is None:
        out = cuda.device_array((batch, w.rows), dtype=np.float32, stream=stream)
    elif out.dtype != np.float32 or tuple(out.shape) != (batch, w.rows) or not out.is_c_contiguous():
        raise ValueError(f"out must be C-contiguous float32 of shape ({batch}, {w.rows}), got {out.dtype} "
                         f"{tuple(out.shape)}")
    if batch == 0:
        return out
    ny, nx = geometry.mm_rows, geometry.mm_threads
    items = -(-w.rows // ny) * -(-batch // BATCH_TILE)
    _matmul_kernel[blocks(items, geometry=geometry), (nx, ny), stream](w.qtype, w.data, w.half, w.f32, x, out)
    return out


def expert_matmul(w: CudaWeight, stride: int, offset: int, n_rows: int, x: Any, tiles: tuple[Any, Any, Any],
                  n_tiles: int, stream: Any = 0, geometry: Geometry = GEOMETRY, out: Any = None) -> Any:
    """(P, n_rows) = the rows of x through their experts' matrices (into `out` when given); `tiles` = (expert,
    start, count) integer device arrays of n_tiles tiles of at most BATCH_TILE consecutive rows of x that share
    an expert."""
    if out is None:
        out = cuda.device_array((x.shape[0], n_rows), dtype=np.float32, stream=stream)
    if n_tiles == 0:
        return out
    ny, nx = geometry.mm_rows, geometry.mm_threads
    items = -(-n_rows // ny) * n_tiles
    _expert_matmul_kernel[blocks(items, geometry=geometry), (nx, ny), stream](
        w.qtype, w.data, w.half, w.f32, int(stride), int(offset), int(n_rows), x, *tiles, out)
    return out


def embed(w: CudaWeight, ids: Any, stream: Any = 0, geometry: Geometry = GEOMETRY, out: Any = None) -> Any:
    """Rows `ids` (1-D integer device array) of the dequantized weight: float32 (len(ids), K), into `out` when
    given.

    An id outside [0, rows) gives a row of NaN (a device array cannot be checked without a sync; host callers
    check first, see CudaBackend.embed)."""
    n = ids.shape[0]
    if out is None:
        out = cuda.device_array((n, w.cols), dtype=np.float32, stream=stream)
    if n == 0:
        return out
    units = -(-w.cols // UNIT)
    threads = geometry.ew_threads
    _embed_kernel[blocks(n * units, threads=threads, geometry=geometry), threads, stream](
        w.qtype, w.data, w.half, w.f32, ids, out)
    return out


# ---------------------------------------------------------------------------------------------------------------------
# Unit dequantizers: `_unit_<type>(wb, wh, row, u, wv)` writes the 32 values of unit u of weight row `row` into wv.
# wb is the uint8 view, wh the float16 view of the same bytes. Integers are widened to int32 before any arithmetic,
# which gives the same results in the simulator (numpy scalars) and in compiled code.


@cuda.jit(device=True)
def _unit_q8_0(wb, wh, row, u, wv):
    # d f16, qs int8[32]
    p = u * 34
    d = float32(wh[row, p // 2])
    for j in range(32):
        q = int32(wb[row, p + 2 + j])
        wv[j] = d * float32(q - ((q >> 7) << 8))


@cuda.jit(device=True)
def _unit_q4_0(wb, wh, row, u, wv):
    # d f16, qs[16]: value j is the low nibble of qs[j], value 16 + j the high one; d * (q - 8)
    p = u * 18
    d = float32(wh[row, p // 2])
    for j in range(16):
        q = int32(wb[row, p + 2 + j])
        wv[j] = d * float32((q & 15) - 8)
        wv[j + 16] = d * float32((q >> 4) - 8)


@cuda.jit(device=True)
def _iq4_values(wb, row, at, scale, wv):
    # the 16 qs bytes at wb[row, at]: value j is the table entry of byte j's low nibble, value 16 + j of its high
    # one; times scale
    for j in range(16):
        q = int32(wb[row, at + j])
        wv[j] = scale * _IQ4_TABLE[q & 15]
        wv[j + 16] = scale * _IQ4_TABLE[q >> 4]


@cuda.jit(device=True)
def _unit_iq4_nl(wb, wh, row, u, wv):
    # d f16, qs[16] (`_iq4_values`), times d
    p = u * 18
    _iq4_values(wb, row, p + 2, float32(wh[row, p // 2]), wv)


@cuda.jit(device=True)
def _unit_iq4_xs(wb, wh, row, u, wv):
    # superblocks of 256 values (136 bytes): d f16, scales_h u16, scales_l[4], qs[128]. Unit u is sub-block b = u % 8
    # of superblock u // 8: 6-bit scale ls = nibble b of scales_l | bits 2b, 2b + 1 of scales_h << 4, its 16 qs
    # bytes as IQ4_NL's; value d * (ls - 32) * entry
    p = (u >> 3) * 136
    b = u & 7
    d = float32(wh[row, p // 2])
    high = int32(wb[row, p + 2]) | (int32(wb[row, p + 3]) << 8)
    ls = ((int32(wb[row, p + 4 + (b >> 1)]) >> (4 * (b & 1))) & 15) | (((high >> (2 * b)) & 3) << 4)
    _iq4_values(wb, row, p + 8 + 16 * b, d * float32(ls - 32), wv)


@cuda.jit(device=True)
def _unit_q4_1(wb, wh, row, u, wv):
    # d f16, m f16, qs[16]; d * q + m
    p = u * 20
    d = float32(wh[row, p // 2])
    m = float32(wh[row, p // 2 + 1])
    for j in range(16):
        q = int32(wb[row, p + 4 + j])
        wv[j] = d * float32(q & 15) + m
        wv[j + 16] = d * float32(q >> 4) + m


@cuda.jit(device=True)
def _unit_q5_0(wb, wh, row, u, wv):
    # d f16, qh u32 (bit j: 5th bit of value j), qs[16] as Q4_0; d * (q - 16)
    p = u * 22
    d = float32(wh[row, p // 2])
    for j in range(16):
        q = int32(wb[row, p + 6 + j])
        hi_lo = (int32(wb[row, p + 2 + (j >> 3)]) >> (j & 7)) & 1
        hi_hi = (int32(wb[row, p + 4 + (j >> 3)]) >> (j & 7)) & 1
        wv[j] = d * float32(((q & 15) | (hi_lo << 4)) - 16)
        wv[j + 16] = d * float32(((q >> 4) | (hi_hi << 4)) - 16)


@cuda.jit(device=True)
def _unit_q5_1(wb, wh, row, u, wv):
    # d f16, m f16, qh u32, qs[16]; d * q + m
    p = u * 24
    d = float32(wh[row, p // 2])
    m = float32(wh[row, p // 2 + 1])
    for j in range(16):
        q = int32(wb[row, p + 8 + j])
        hi_lo = (int32(wb[row, p + 4 + (j >> 3)]) >> (j & 7)) & 1
        hi_hi = (int32(wb[row, p + 6 + (j >> 3)]) >> (j & 7)) & 1
        wv[j] = d * float32((q & 15) | (hi_lo << 4)) + m
        wv[j + 16] = d * float32((q >> 4) | (hi_hi << 4)) + m


@cuda.jit(device=True)
def _unit_q2_k(wb, wh, row, u, wv):
    # scales[16] (low nibble scale, high nibble min, per 16 values), qs[64] (2 bits), d f16, dmin f16.
    # Value h*128 + s*32 + l is bits 2s..2s+1 of qs[h*32 + l]; unit c = 4h + s.
    p = (u >> 3) * 84
    c = u & 7
    h = c >> 2
    s = c & 3
    d = float32(wh[row, (p + 80) // 2])
    dmin = float32(wh[row, (p + 82) // 2])
    for half in range(2):
        sc = int32(wb[row, p + h * 8 + s * 2 + half])
        dl = d * float32(sc & 15)
        ml = dmin * float32(sc >> 4)
        for l in range(half * 16, half * 16 + 16):
            q = (int32(wb[row, p + 16 + h * 32 + l]) >> (2 * s)) & 3
            wv[l] = dl * float32(q) - ml


@cuda.jit(device=True)
def _q3_k_scale(wb, row, p, k):
    """Signed 6-bit scale k (< 16) of the Q3_K block at byte p (its 12 scale bytes start at p + 96)."""
    if k < 8:
        low = int32(wb[row, p + 96 + k]) & 15
    else:
        low = int32(wb[row, p + 88 + k]) >> 4
    high = (int32(wb[row, p + 104 + (k & 3)]) >> (2 * (k >> 2))) & 3
    return (low | (high << 4)) - 32


@cuda.jit(device=True)
def _unit_q3_k(wb, wh, row, u, wv):
    # hmask[32], qs[64] (2 low bits, laid out as Q2_K), scales[12] (16 signed 6-bit), d f16.
    # Value h*128 + s*32 + l has high bit (hmask[l] >> (4h + s)) & 1; d * scale * (low2 - (0 if high else 4)).
    p = (u >> 3) * 110
    c = u & 7
    h = c >> 2
    s = c & 3
    d = float32(wh[row, (p + 108) // 2])
    for half in range(2):
        dl = d * float32(_q3_k_scale(wb, row, p, h * 8 + s * 2 + half))
        for l in range(half * 16, half * 16 + 16):
            q = (int32(wb[row, p + 32 + h * 32 + l]) >> (2 * s)) & 3
            high = (int32(wb[row, p + l]) >> (4 * h + s)) & 1
            wv[l] = dl * float32(q - 4 + 4 * high)


@cuda.jit(device=True)
def _k_scale(wb, row, p, sb):
    """6-bit scale of sub-block sb from the 12 packed bytes at p (Q4_K, Q5_K)."""
    if sb < 4:
        return int32(wb[row, p + sb]) & 63
    t = sb - 4
    return (int32(wb[row, p + 8 + t]) & 15) | ((int32(wb[row, p + t]) >> 2) & 48)


@cuda.jit(device=True)
def _k_min(wb, row, p, sb):
    """6-bit min of sub-block sb from the 12 packed bytes at p (Q4_K, Q5_K)."""
    if sb < 4:
        return int32(wb[row, p + 4 + sb]) & 63
    t = sb - 4
    return (int32(wb[row, p + 8 + t]) >> 4) | ((int32(wb[row, p + 4 + t]) >> 2) & 48)


@cuda.jit(device=True)
def _unit_q4_k(wb, wh, row, u, wv):
    # d f16, dmin f16, scales[12], qs[128]: sub-block c (= unit) is nibble c & 1 of qs[(c >> 1)*32 + l].
    p = (u >> 3) * 144
    c = u & 7
    d = float32(wh[row, p // 2]) * float32(_k_scale(wb, row, p + 4, c))
    m = float32(wh[row, p // 2 + 1]) * float32(_k_min(wb, row, p + 4, c))
    src = p + 16 + (c >> 1) * 32
    shift = 4 * (c & 1)
    for l in range(32):
        wv[l] = d * float32((int32(wb[row, src + l]) >> shift) & 15) - m


@cuda.jit(device=True)
def _unit_q5_k(wb, wh, row, u, wv):
    # d f16, dmin f16, scales[12], qh[32], qs[128]: Q4_K plus a 5th bit, (qh[l] >> c) & 1.
    p = (u >> 3) * 176
    c = u & 7
    d = float32(wh[row, p // 2]) * float32(_k_scale(wb, row, p + 4, c))
    m = float32(wh[row, p // 2 + 1]) * float32(_k_min(wb, row, p + 4, c))
    src = p + 48 + (c >> 1) * 32
    shift = 4 * (c & 1)
    for l in range(32):
        q = ((int32(wb[row, src + l]) >> shift) & 15) | (((int32(wb[row, p + 16 + l]) >> c) & 1) << 4)
        wv[l] = d * float32(q) - m


@cuda.jit(device=True)
def _unit_q6_k(wb, wh, row, u, wv):
    # ql[128], qh[64], scales int8[16], d f16. Value h*128 + t*32 + l: low 4 bits are nibble t >> 1 of
    # ql[h*64 + (t & 1)*32 + l], high 2 bits are bits 2t..2t+1 of qh[h*32 + l]; d * scale * (q - 32).
    p = (u >> 3) * 210
    c = u & 7
    h = c >> 2
    t = c & 3
    d = float32(wh[row, (p + 208) // 2])
    lo = p + h * 64 + (t & 1) * 32
    lo_shift = 4 * (t >> 1)
    for half in range(2):
        sc = int32(wb[row, p + 192 + h * 8 + t * 2 + half])
        dl = d * float32(sc - ((sc >> 7) << 8))
        for l in range(half * 16, half * 16 + 16):
            high = (int32(wb[row, p + 128 + h * 32 + l]) >> (2 * t)) & 3
            q = ((int32(wb[row, lo + l]) >> lo_shift) & 15) | (high << 4)
            wv[l] = dl * float32(q - 32)


@cuda.jit(device=True)
def _unit_f16(wh, row, u, n, wv):
    for j in range(n):
        wv[j] = float32(wh[row, u * 32 + j])


@cuda.jit(device=True)
def _unit_bf16(wb, row, u, n, wv):
    for j in range(n):
        e = 2 * (u * 32 + j)
        bits = int32(wb[row, e]) | (int32(wb[row, e + 1]) << 8)
        wv[j] = uint32(uint32(bits) << uint32(16)).view(np.float32)


@cuda.jit(device=True)
def _unit_f32(wf, row, u, n, wv):
    for j in range(n):
        wv[j] = wf[row, u * 32 + j]


@cuda.jit(device=True)
def _deq_unit(qtype, wb, wh, wf, row, u, n, wv):
    """wv[:n] = values u*32 .. u*32+n-1 of weight row `row`; n < 32 only for the last unit of a float row."""
    if qtype == Q4_1:
        _unit_q4_1(wb, wh, row, u, wv)
    elif qtype == Q8_0:
        _unit_q8_0(wb, wh, row, u, wv)
    elif qtype == Q4_K:
        _unit_q4_k(wb, wh, row, u, wv)
    elif qtype == Q6_K:
        _unit_q6_k(wb, wh, row, u, wv)
    elif qtype == Q5_K:
        _unit_q5_k(wb, wh, row, u, wv)
    elif qtype == Q4_0:
        _unit_q4_0(wb, wh, row, u, wv)
    elif qtype == Q5_0:
        _unit_q5_0(wb, wh, row, u, wv)
    elif qtype == Q5_1:
        _unit_q5_1(wb, wh, row, u, wv)
    elif qtype == Q3_K:
        _unit_q3_k(wb, wh, row, u, wv)
    elif qtype == Q2_K:
        _unit_q2_k(wb, wh, row, u, wv)
    elif qtype == IQ4_XS:
        _unit_iq4_xs(wb, wh, row, u, wv)
    elif qtype == IQ4_NL:
        _unit_iq4_nl(wb, wh, row, u, wv)
    elif qtype == F16:
        _unit_f16(wh, row, u, n, wv)
    elif qtype == BF16:
        _unit_bf16(wb, row, u, n, wv)
    else:
        _unit_f32(wf, row, u, n, wv)


# ---------------------------------------------------------------------------------------------------------------------
# Kernels.


@cuda.jit(device=True)
def _row_partials(qtype, wb, wh, wf, row, x, b0, nb, acc, wv):
    """acc[b] = this thread's share of x[b0 + b] . W[row] for b < nb: the units threadIdx.x, + blockDim.x, ..."""
    k_dim = x.shape[1]
    for b in range(BATCH_TILE):
        acc[b] = float32(0)
    for u in range(cuda.threadIdx.x, (k_dim + 31) // 32, cuda.blockDim.x):
        n = min(32, k_dim - u * 32)
        _deq_unit(qtype, wb, wh, wf, row, u, n, wv)
        c0 = u * 32
        for b in range(nb):
            s = float32(0)
            for j in range(n):
                s += wv[j] * x[b0 + b, c0 + j]
            acc[b] += s


@cuda.jit(device=True)
def _sum_partials(partial, acc, nb):
    """Sum acc over the threads of a row (threadIdx.x) through shared memory, in a fixed tree order. Returns the
    offset in `partial` where thread 0 of the row finds the nb totals (nobody writes them before the next call's
    tree, so no barrier is needed after reading them)."""
    tx = cuda.threadIdx.x
    mine = (cuda.threadIdx.y * cuda.blockDim.x + tx) * BATCH_TILE
    for b in range(BATCH_TILE):
        partial[mine + b] = acc[b]
    cuda.syncthreads()
    stride = cuda.blockDim.x // 2
    while stride > 0:
        if tx < stride:
            other = mine + stride * BATCH_TILE
            for b in range(nb):
                partial[mine + b] += partial[other + b]
        cuda.syncthreads()
        stride //= 2
    return mine


@cuda.jit
def _matmul_kernel(qtype, wb, wh, wf, x, out):
    """out[b, n] = sum_k x[b, k] * W[n, k]. Work item = (group of blockDim.y rows, tile of BATCH_TILE x rows);
    consecutive blocks take consecutive row groups, so the weights stream through in order."""
    n_rows = wb.shape[0]
    batch = x.shape[0]
    ny = cuda.blockDim.y
    partial = cuda.shared.array(MM_SHARED, float32)
    wv = cuda.local.array(32, float32)
    acc = cuda.local.array(BATCH_TILE, float32)
    n_groups = (n_rows + ny - 1) // ny
    n_tiles = (batch + BATCH_TILE - 1) // BATCH_TILE
    for item in range(cuda.blockIdx.x, n_groups * n_tiles, cuda.gridDim.x):
        b0 = (item // n_groups) * BATCH_TILE
        nb = min(BATCH_TILE, batch - b0)
        row = (item % n_groups) * ny + cuda.threadIdx.y
        if row < n_rows:
            _row_partials(qtype, wb, wh, wf, row, x, b0, nb, acc, wv)
        else:
            for b in range(BATCH_TILE):
                acc[b] = float32(0)
        mine = _sum_partials(partial, acc, nb)
        if cuda.threadIdx.x == 0 and row < n_rows:
            for b in range(nb):
                out[b0 + b, row] = partial[mine + b]


@cuda.jit
def _expert_matmul_kernel(qtype, wb, wh, wf, stride, offset, n_rows, x, tile_expert, tile_start, tile_count, out):
    """out[p, n] = x[p] . W_e[n] where tile t holds the pairs tile_start[t] .. + tile_count[t] (<= BATCH_TILE) of
    expert e = tile_expert[t], whose row n is weight row e * stride + offset + n. As `_matmul_kernel`, but every
    tile of activation rows may read a different expert."""
    ny = cuda.blockDim.y
    partial = cuda.shared.array(MM_SHARED, float32)
    wv = cuda.local.array(32, float32)
    acc = cuda.local.array(BATCH_TILE, float32)
    n_groups = (n_rows + ny - 1) // ny
    for item in range(cuda.blockIdx.x, n_groups * tile_expert.shape[0], cuda.gridDim.x):
        tile = item // n_groups
        b0 = tile_start[tile]
        nb = tile_count[tile]
        row = (item % n_groups) * ny + cuda.threadIdx.y
        if row < n_rows:
            _row_partials(qtype, wb, wh, wf, tile_expert[tile] * stride + offset + row, x, b0, nb, acc, wv)
        else:
            for b in range(BATCH_TILE):
                acc[b] = float32(0)
        mine = _sum_partials(partial, acc, nb)
        if cuda.threadIdx.x == 0 and row < n_rows:
            for b in range(nb):
                out[b0 + b, row] = partial[mine + b]


@cuda.jit
def _embed_kernel(qtype, wb, wh, wf, ids, out):
    k_dim = out.shape[1]
    n_units = (k_dim + 31) // 32
    n_rows = wb.shape[0]
    wv = cuda.local.array(32, float32)
    for item in range(cuda.grid(1), ids.shape[0] * n_units, cuda.gridsize(1)):
        r = item // n_units
        u = item % n_units
        n = min(32, k_dim - u * 32)
        row = ids[r]
        if row >= 0 and row < n_rows:
            _deq_unit(qtype, wb, wh, wf, row, u, n, wv)
            for j in range(n):
                out[r, u * 32 + j] = wv[j]
        else:
            for j in range(n):
                out[r, u * 32 + j] = math.nan


KERNELS = {"matmul": _matmul_kernel, "embed": _embed_kernel, "expert_matmul": _expert_matmul_kernel}

__all__ = ["SUPPORTED_TYPES", "CudaWeight", "UnsupportedTensorType", "embed", "expert_matmul", "matmul", "row_bytes",
           "type_name", "upload_weight"]
