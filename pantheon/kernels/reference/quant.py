"""Reference for pantheon.kernels.cpu.quant: dequantize with gguf.quants, multiply in float64.

Shapes: `data` is a weight's raw GGUF bytes, uint8 (N, row_bytes); the dequantized weight is float32 (N, K).
"""

from __future__ import annotations

import numpy as np
from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType
from gguf.quants import dequantize as _gguf_dequantize

# Byte offsets, inside one block, of the fp16 scale fields (d, m, dmin) of each block-quantized type.
F16_SCALE_OFFSETS: dict[int, tuple[int, ...]] = {
    GGMLQuantizationType.Q8_0: (0,),
    GGMLQuantizationType.Q4_0: (0,),
    GGMLQuantizationType.Q4_1: (0, 2),
    GGMLQuantizationType.Q5_0: (0,),
    GGMLQuantizationType.Q5_1: (0, 2),
    GGMLQuantizationType.Q2_K: (80, 82),
    GGMLQuantizationType.Q3_K: (108,),
    GGMLQuantizationType.Q4_K: (0, 2),
    GGMLQuantizationType.Q5_K: (0, 2),
    GGMLQuantizationType.Q6_K: (208,),
    GGMLQuantizationType.IQ4_NL: (0,),
    GGMLQuantizationType.IQ4_XS: (0,),
}


def dequantize(qtype: int, data: np.ndarray) -> np.ndarray:
    """float32 (N, K) from the raw rows (N, row_bytes) of a ggml type-`qtype` tensor."""
    rows = np.asarray(data, dtype=np.uint8)
    return np.asarray(_gguf_dequantize(rows, GGMLQuantizationType(qtype)), dtype=np.float32)


def matmul(qtype: int, data: np.ndarray, x: np.ndarray) -> np.ndarray:
    """float64 (B, N) = x @ dequantize(qtype, data).T, with x (B, K)."""
    return np.asarray(x, dtype=np.float64) @ dequantize(qtype, data).astype(np.float64).T


def random_weight_bytes(qtype: int, rows: int, cols: int, rng: np.random.Generator) -> np.ndarray:
    """Raw bytes (rows, row_bytes) of a random type-`qtype` weight, for tests and benchmarks.

    Float types hold N(0, 1) values. Block types hold random bytes with every fp16 scale overwritten by a finite
    value of magnitude in [1e-3, 1e-1] and random sign, so every packed field (nibbles, high bits, 6-bit scales) is
    exercised with all its bit patterns.
    """
    qtype = GGMLQuantizationType(qtype)
    values = rng.standard_normal((rows, cols)).astype(np.float32)
    if qtype == GGMLQuantizationType.F32:
        return values.view(np.uint8)
    if qtype == GGMLQuantizationType.F16:
        return values.astype(np.float16).view(np.uint8)
    if qtype == GGMLQuantizationType.BF16:
        return (values.view(np.uint32) >> 16).astype(np.uint16).view(np.uint8)
    block, block_bytes = GGML_QUANT_SIZES[qtype]
    n_blocks = cols // block
    raw = rng.integers(0, 256, (rows, n_blocks, block_bytes), dtype=np.uint8)
    for offset in F16_SCALE_OFFSETS[qtype]:
        scale = rng.uniform(1e-3, 1e-1, (rows, n_blocks)) * rng.choice([-1.0, 1.0], (rows, n_blocks))
        raw[:, :, offset : offset + 2] = scale.astype(np.float16).view(np.uint8).reshape(rows, n_blocks, 2)
    return raw.reshape(rows, n_blocks * block_bytes)


def quantize_rows_q8(x: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The int8 rounding of pantheon.kernels.cpu.int8dot (llama.cpp's Q8_0 / Q8_1 on x86), in numpy: per block of
    32 values of each row, q = round-half-even(x * (127 / max|x|)), d = max|x| / 127 rounded to float16, and
    s = (max|x| / 127) * sum(q) rounded to float16 (`_as_half`), all in float32. Returns (q int8 (B, K),
    d float32 (B, K/32), s float32 (B, K/32))."""
    x = np.asarray(x, dtype=np.float32)
    blocks = x.reshape(x.shape[0], -1, 32)
    amax = np.abs(blocks).max(axis=2)
    exact = (amax / np.float32(127.0)).astype(np.float32)
    with np.errstate(divide="ignore"):
        inv = np.where(exact > 0, np.float32(127.0) / amax, np.float32(0.0)).astype(np.float32)
    q = np.rint(blocks * inv[:, :, None]).astype(np.int8)
    sums = q.astype(np.int32).sum(axis=2).astype(np.float32)
    return q.reshape(x.shape), _as_half(exact), _as_half(exact * sums)


def _as_half(values: np.ndarray) -> np.ndarray:
    """float32 values rounded to float16 and back; finite ones past float16's range kept as they are."""
    with np.errstate(over="ignore"):
        half = values.astype(np.float16).astype(np.float32)
    return np.where(np.isinf(half) & np.isfinite(values), values, half).astype(np.float32)


# The quant bytes of one block (first, end) of the types whose int8 kernels add an m term: a value d * q + m
# (Q4_1, Q5_1), d * (q - 8) or d * (q - 16) (Q4_0, Q5_0: m = -8 d, -16 d) or a K-quant's d * sc * q - dmin * m_j.
_QUANT_BYTES: dict[int, tuple[int, int]] = {
    GGMLQuantizationType.Q4_0: (2, 18),
    GGMLQuantizationType.Q4_1: (4, 20),
    GGMLQuantizationType.Q5_0: (2, 22),
    GGMLQuantizationType.Q5_1: (4, 24),
    GGMLQuantizationType.Q4_K: (16, 144),
    GGMLQuantizationType.Q5_K: (16, 176),
}


def block_offsets(qtype: int, data: np.ndarray) -> np.ndarray | None:
    """float32 (N, K / 32): the m term of each 32-value block of each row (what a block's values are when every
    quant is 0), for the types whose int8 kernels add one (`_QUANT_BYTES`); None for the others."""
    if qtype not in _QUANT_BYTES:
        return None
    first, end = _QUANT_BYTES[qtype]
    rows = np.asarray(data, dtype=np.uint8)
    blocks = rows.reshape(rows.shape[0], -1, GGML_QUANT_SIZES[qtype][1]).copy()
    blocks[:, :, first:end] = 0
    return dequantize(qtype, blocks.reshape(rows.shape))[:, ::32]


def matmul_int8(qtype: int, data: np.ndarray, x: np.ndarray) -> np.ndarray:
    """float64 (B, N): the weight dequantized as in `matmul`, times x after `quantize_rows_q8`; a block's m term
    (`block_offsets`) times the activations' s, as the kernels take it, in place of d * sum(q)."""
    q, d, s = quantize_rows_q8(x)
    blocks = q.reshape(q.shape[0], -1, 32).astype(np.float64)
    out = (blocks * d[:, :, None]).reshape(q.shape) @ dequantize(qtype, data).astype(np.float64).T
    offsets = block_offsets(qtype, data)
    if offsets is not None:
        out += (s.astype(np.float64) - d * blocks.sum(axis=2)) @ offsets.astype(np.float64).T
    return out
