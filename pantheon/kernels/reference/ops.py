"""Plain numpy references for the non-matmul transformer ops.

Each function mirrors one op of `pantheon.kernels.cpu.ops` and is what the kernel tests compare against.
They compute in float64, build full matrices where that is simplest, and return new float32 arrays;
speed does not matter here, being obviously right does.
"""

from __future__ import annotations

import numpy as np


def rmsnorm(x: np.ndarray, weight: np.ndarray, eps: float) -> np.ndarray:
    """x (T, D), weight (D,) -> x / sqrt(mean(x**2) + eps) * weight, row by row."""
    x64 = x.astype(np.float64)
    inv_rms = 1.0 / np.sqrt(np.mean(x64 * x64, axis=-1, keepdims=True) + eps)
    return (x64 * inv_rms * weight.astype(np.float64)).astype(np.float32)


def add_rmsnorm(
    residual: np.ndarray, delta: np.ndarray, weight: np.ndarray, eps: float
) -> tuple[np.ndarray, np.ndarray]:
    """Returns (residual + delta, rmsnorm(residual + delta)) without touching the inputs."""
    summed = residual + delta
    return summed, rmsnorm(summed, weight, eps)


def rope(
    x: np.ndarray,
    positions: np.ndarray,
    n_rot: int,
    freq_base: float,
    neox: bool,
    freq_scale: float = 1.0,
) -> np.ndarray:
    """Rotary embedding of x (T, H, head_dim) at positions (T,); returns a rotated copy.

    Pair i of a head (i < n_rot / 2) turns by theta_i = pos * freq_scale * freq_base ** (-2i / n_rot).
    The "normal" layout pairs dims (2i, 2i + 1), the NeoX layout pairs (i, i + n_rot / 2).
    Dims from n_rot on are copied unchanged.
    """
    half = n_rot // 2
    inv_freq = float(freq_base) ** (-2.0 * np.arange(half, dtype=np.float64) / n_rot)
    theta = positions.astype(np.float64)[:, None] * float(freq_scale) * inv_freq[None, :]  # (T, half)
    cos = np.cos(theta)[:, None, :]
    sin = np.sin(theta)[:, None, :]
    out = x.astype(np.float64)
    if neox:
        a, b = out[..., :half].copy(), out[..., half:n_rot].copy()
        out[..., :half] = a * cos - b * sin
        out[..., half:n_rot] = a * sin + b * cos
    else:
        a, b = out[..., 0:n_rot:2].copy(), out[..., 1:n_rot:2].copy()
        out[..., 0:n_rot:2] = a * cos - b * sin
        out[..., 1:n_rot:2] = a * sin + b * cos
    return out.astype(np.float32)


def swiglu(gate: np.ndarray, up: np.ndarray) -> np.ndarray:
    """silu(gate) * up, elementwise."""
    g = gate.astype(np.float64)
    return (g / (1.0 + np.exp(-g)) * up.astype(np.float64)).astype(np.float32)


def attention(
    q: np.ndarray, k_cache: np.ndarray, v_cache: np.ndarray, start_pos: int, scale: float
) -> np.ndarray:
    """Causal grouped-query attention of T new queries over one sequence's KV cache.

    q (T, Hq, hd); k_cache, v_cache (ctx, Hkv, hd) already hold the new rows at
    start_pos .. start_pos + T - 1. Query t sits at start_pos + t and sees cache rows 0 .. start_pos + t.
    Query head h reads kv head h // (Hq // Hkv). Rows from start_pos + T on are never read.
    Returns (T, Hq, hd).
    """
    n_tokens, n_q_heads, _ = q.shape
    n_kv_heads = k_cache.shape[1]
    group = n_q_heads // n_kv_heads
    n_keys = start_pos + n_tokens
    kv_of_q_head = np.arange(n_q_heads) // group
    keys = k_cache[:n_keys].astype(np.float64)[:, kv_of_q_head]  # (n_keys, Hq, hd)
    values = v_cache[:n_keys].astype(np.float64)[:, kv_of_q_head]
    scores = np.einsum("thd,khd->htk", q.astype(np.float64), keys) * scale  # (Hq, T, n_keys)
    visible = np.arange(n_keys)[None, :] <= (start_pos + np.arange(n_tokens))[:, None]  # (T, n_keys)
    scores = np.where(visible[None], scores, -np.inf)
    scores -= scores.max(axis=-1, keepdims=True)
    weights = np.exp(scores)
    weights /= weights.sum(axis=-1, keepdims=True)
    return np.einsum("htk,khd->thd", weights, values).astype(np.float32)
