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


def quantize_rows_q8(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The int8 rounding of pantheon.kernels.cpu.int8dot, in numpy: per block of 32 values of each row,
    d = max|x| / 127 and q = round-half-even(x * (1 / d)), all in float32. Returns (q int8 (B, K), d (B, K/32))."""
    x = np.asarray(x, dtype=np.float32)
    blocks = x.reshape(x.shape[0], -1, 32)
    d = (np.abs(blocks).max(axis=2) / np.float32(127.0)).astype(np.float32)
    with np.errstate(divide="ignore"):
        inv = np.where(d > 0, np.float32(1.0) / d, np.float32(0.0)).astype(np.float32)
    q = np.rint(blocks * inv[:, :, None]).astype(np.int8)
    return q.reshape(x.shape), d


def matmul_int8(qtype: int, data: np.ndarray, x: np.ndarray) -> np.ndarray:
    """float64 (B, N): the weight dequantized as in `matmul`, times x after `quantize_rows_q8`."""
    q, d = quantize_rows_q8(x)
    xq = (q.reshape(q.shape[0], -1, 32).astype(np.float64) * d[:, :, None]).reshape(q.shape)
    return xq @ dequantize(qtype, data).astype(np.float64).T
