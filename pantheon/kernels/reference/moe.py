"""Plain numpy references for `pantheon.kernels.cpu.moe`: the router and a dense loop over tokens and experts.

Expert matrices are given dequantized, float (E, rows, cols); everything is computed in float64.
"""

from __future__ import annotations

import numpy as np


def moe_route(logits: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
    """softmax -> top k (stable: lower id first among equals) -> renormalise. Returns (ids, weights)."""
    x = logits.astype(np.float64)
    p = np.exp(x - x.max(1, keepdims=True))
    p /= p.sum(1, keepdims=True)
    ids = np.argsort(-p, axis=1, kind="stable")[:, :k]
    w = np.take_along_axis(p, ids, 1)
    return ids, w / w.sum(1, keepdims=True)


def silu(x: np.ndarray) -> np.ndarray:
    return x / (1.0 + np.exp(-x))


def moe_ffn(x: np.ndarray, gate: np.ndarray, up: np.ndarray, down: np.ndarray, ids: np.ndarray,
            weights: np.ndarray) -> np.ndarray:
    """sum_r weights[t, r] * down[e] @ (silu(gate[e] @ x_t) * (up[e] @ x_t)), e = ids[t, r]; returns (T, D)."""
    x = x.astype(np.float64)
    out = np.zeros(x.shape)
    for t in range(x.shape[0]):
        for e, w in zip(ids[t], weights[t]):
            h = silu(gate[e].astype(np.float64) @ x[t]) * (up[e].astype(np.float64) @ x[t])
            out[t] += w * (down[e].astype(np.float64) @ h)
    return out
