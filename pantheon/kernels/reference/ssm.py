"""Plain numpy references for the Gated DeltaNet ops of `pantheon.kernels.cpu.ssm`.

They compute in float64, one obvious step at a time, and return new arrays (states are returned, never
updated in place). Shapes as in the kernels: B sequences of L tokens, q, k (B, L, Nk, dk), v (B, L, Nv, dv),
g, beta (B, L, Nv), one recurrent state (Nv, dk, dv) and one conv state (K-1, C) per sequence.
"""

from __future__ import annotations

import numpy as np


def silu(x: np.ndarray) -> np.ndarray:
    return x / (1.0 + np.exp(-x))


def sigmoid(x: np.ndarray) -> np.ndarray:
    return 1.0 / (1.0 + np.exp(-x))


def causal_conv1d(x: np.ndarray, state: np.ndarray, weight: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """One sequence: x (L, C), state (K-1, C), weight (C, K) -> (silu(conv) (L, C), new state (K-1, C))."""
    hist = weight.shape[1] - 1
    full = np.concatenate([state, x]).astype(np.float64)  # (K-1+L, C)
    out = np.zeros(x.shape, np.float64)
    for t in range(x.shape[0]):
        out[t] = (full[t : t + hist + 1].T * weight.astype(np.float64)).sum(1)
    return silu(out), full[full.shape[0] - hist :]


def gdn_gates(b: np.ndarray, alpha: np.ndarray, a: np.ndarray, dt_bias: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(g, beta) = (a * softplus(alpha + dt_bias), sigmoid(b))."""
    z = alpha.astype(np.float64) + dt_bias
    softplus = np.where(z > 20.0, z, np.log1p(np.exp(np.minimum(z, 20.0))))
    return a.astype(np.float64) * softplus, sigmoid(b.astype(np.float64))


def l2norm(x: np.ndarray, eps: float) -> np.ndarray:
    """x / sqrt(sum(x**2) + eps) over the last axis (the form of FLA and HF)."""
    x = x.astype(np.float64)
    return x / np.sqrt((x * x).sum(-1, keepdims=True) + eps)


def _expand(x: np.ndarray, key_head: np.ndarray) -> np.ndarray:
    return x[..., key_head, :]  # (L, Nk, d) -> (L, Nv, d)


def gated_delta_recurrent(q, k, v, g, beta, state, key_head, scale, eps):
    """One sequence: q, k (L, Nk, dk), v (L, Nv, dv), g, beta (L, Nv), state (Nv, dk, dv) -> (out, state)."""
    qn = _expand(l2norm(q, eps), key_head) * scale
    kn = _expand(l2norm(k, eps), key_head)
    v, g, beta = (np.asarray(x, np.float64) for x in (v, g, beta))
    s = state.astype(np.float64).copy()
    out = np.zeros(v.shape, np.float64)
    for t in range(v.shape[0]):
        s *= np.exp(g[t])[:, None, None]
        kv_mem = np.einsum("hkv,hk->hv", s, kn[t])
        delta = (v[t] - kv_mem) * beta[t][:, None]
        s += np.einsum("hk,hv->hkv", kn[t], delta)
        out[t] = np.einsum("hkv,hk->hv", s, qn[t])
    return out, s


def gated_delta_chunked(q, k, v, g, beta, state, key_head, scale, eps, chunk=64):
    """The chunked (WY / UT transform) form of `gated_delta_recurrent`, zero-padded to whole chunks."""
    qn = _expand(l2norm(q, eps), key_head) * scale
    kn = _expand(l2norm(k, eps), key_head)
    n_tok, n_vh, dv = v.shape
    pad = (-n_tok) % chunk

    def padded(x):
        return np.concatenate([x.astype(np.float64), np.zeros((pad,) + x.shape[1:])])

    qn, kn, vp, gp, bp = map(padded, (qn, kn, v, g, beta))
    out = np.zeros(vp.shape)
    s = state.astype(np.float64).copy()
    for h in range(n_vh):
        sh = s[h]
        for c0 in range(0, n_tok + pad, chunk):
            sl = slice(c0, c0 + chunk)
            qc, kc, vc, gc, bc = qn[sl, h], kn[sl, h], vp[sl, h], gp[sl, h], bp[sl, h]
            cum = np.cumsum(gc)
            decay = np.tril(np.exp(np.tril(cum[:, None] - cum[None, :])))
            kb = kc * bc[:, None]
            m = np.tril(kb @ kc.T * decay, -1)
            t_inv = np.linalg.inv(np.eye(chunk) + m)
            u = t_inv @ (vc * bc[:, None])
            w = t_inv @ (kb * np.exp(cum)[:, None])
            v_new = u - w @ sh
            a = np.tril(qc @ kc.T * decay)
            out[sl, h] = (qc * np.exp(cum)[:, None]) @ sh + a @ v_new
            sh = sh * np.exp(cum[-1]) + (kc * np.exp(cum[-1] - cum)[:, None]).T @ v_new
        s[h] = sh
    return out[:n_tok], s


def gated_rmsnorm(x: np.ndarray, z: np.ndarray, weight: np.ndarray, eps: float) -> np.ndarray:
    x = x.astype(np.float64)
    return x / np.sqrt((x * x).mean(-1, keepdims=True) + eps) * weight * silu(z.astype(np.float64))


def sigmoid_mul(x: np.ndarray, gate: np.ndarray) -> np.ndarray:
    return x.astype(np.float64) * sigmoid(gate.astype(np.float64))
