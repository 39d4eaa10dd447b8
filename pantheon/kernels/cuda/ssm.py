"""CUDA kernels for the Gated DeltaNet (linear-attention) layers of Qwen3.5 / Qwen3-Next.

Shapes and semantics are those of pantheon.kernels.cpu.ssm (its docstring has the math): B sequences of L
tokens, q, k (B, L, Nk, dk), v (B, L, Nv, dv), g, beta (B, L, Nv); conv state (S, K-1, C) and recurrent state
(S, Nv, dv, dk) pools indexed by slot ids, updated in place. The recurrent state is stored transposed, as on the
cpu and in llama.cpp: row j of a head is column j of S[key, value].

The delta rule runs column-parallel: thread (b, h, j) owns row j of sequence b's value-head-h state (column j of
S), keeps it in thread-local storage for the whole call and walks the tokens in order. Every step of the rule is per column
(u_j = S[:, j] . k, delta_j, the rank-1 update of column j, o_j = S[:, j] . q), so the threads never talk to
each other. The same kernel serves `gated_delta_recurrent` (decode) and `gated_delta_chunked` (prefill): the
chunked form is the same rule reordered for CPU caches, equal up to rounding, and on a GPU the parallelism over
B * Nv * dv columns already fills the device for a prefill. (A WY-chunked tensor-core kernel is later work.)
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
from numba import float32, float64

from pantheon.kernels.cuda.launch import GEOMETRY, NORM_SHARED, Geometry, blocks, cuda
from pantheon.kernels.cuda.ops import _row_inv_rms

MAX_KEY_DIM = 256  # dk limit of the delta rule (thread-local state column)


@cuda.jit(device=True)
def _silu(v):
    # exp of a non-positive argument only: no overflow.
    if v >= float32(0):
        return v / (float32(1) + math.exp(-v))
    e = math.exp(v)
    return v * e / (float32(1) + e)


@cuda.jit
def _causal_conv_kernel(x, states, weight, slot_ids, out):
    """Thread per (sequence, channel): the channel's conv over the chunk, then its rolled state."""
    n_seq = x.shape[0]
    n_tok = x.shape[1]
    n_ch = x.shape[2]
    hist = weight.shape[1] - 1
    for item in range(cuda.grid(1), n_seq * n_ch, cuda.gridsize(1)):
        b = item // n_ch
        c = item % n_ch
        slot = slot_ids[b]
        for t in range(n_tok):
            acc = weight[c, hist] * x[b, t, c]
            for j in range(hist):
                src = t - hist + j
                if src >= 0:
                    acc += weight[c, j] * x[b, src, c]
                else:
                    acc += weight[c, j] * states[slot, hist + src, c]
            out[b, t, c] = _silu(acc)
        # The state keeps the last `hist` inputs of concat(state, x).
        if n_tok >= hist:
            for r in range(hist):
                states[slot, r, c] = x[b, n_tok - hist + r, c]
        else:
            for r in range(hist - n_tok):
                states[slot, r, c] = states[slot, r + n_tok, c]
            for r in range(n_tok):
                states[slot, hist - n_tok + r, c] = x[b, r, c]


@cuda.jit
def _gdn_gates_kernel(b, alpha, a, dt_bias, g, beta):
    # float64 as on the cpu: softplus and the sigmoid of the projections, T * Nv values per step.
    n_heads = b.shape[1]
    for item in range(cuda.grid(1), b.shape[0] * n_heads, cuda.gridsize(1)):
        t = item // n_heads
        h = item % n_heads
        beta[t, h] = float32(1.0 / (1.0 + math.exp(-float64(b[t, h]))))
        z = float64(alpha[t, h]) + float64(dt_bias[h])
        softplus = z if z > 20.0 else math.log1p(math.exp(z))  # torch's softplus threshold
        g[t, h] = float32(float64(a[h]) * softplus)


@cuda.jit
def _gated_rmsnorm_kernel(x, z, weight, eps, out):
    red = cuda.shared.array(NORM_SHARED, float32)
    for row in range(cuda.blockIdx.x, x.shape[0], cuda.gridDim.x):
        inv_rms = _row_inv_rms(red, x, row, float32(eps))
        for i in range(cuda.threadIdx.x, x.shape[1], cuda.blockDim.x):
            out[row, i] = x[row, i] * inv_rms * weight[i] * _silu(z[row, i])


@cuda.jit
def _sigmoid_mul_kernel(x, gate, out):
    width = x.shape[1]
    per_col = gate.shape[1] != 1
    for item in range(cuda.grid(1), x.shape[0] * width, cuda.gridsize(1)):
        t = item // width
        i = item % width
        gv = gate[t, i] if per_col else gate[t, 0]
        if gv >= float32(0):
            s = float32(1) / (float32(1) + math.exp(-gv))
        else:
            e = math.exp(gv)
            s = e / (float32(1) + e)
        out[t, i] = x[t, i] * s


@cuda.jit
def _delta_rule_kernel(q, k, v, g, beta, states, slot_ids, key_head, scale, eps, out):
    n_seq = q.shape[0]
    n_tok = q.shape[1]
    dk = q.shape[3]
    n_vh = v.shape[2]
    dv = v.shape[3]
    col = cuda.local.array(MAX_KEY_DIM, float32)
    scale32 = float32(scale)
    eps32 = float32(eps)
    for item in range(cuda.grid(1), n_seq * n_vh * dv, cuda.gridsize(1)):
        j = item % dv
        h = (item // dv) % n_vh
        b = item // (dv * n_vh)
        kh = key_head[h]
        slot = slot_ids[b]
        for i in range(dk):
            col[i] = states[slot, h, j, i]
        for t in range(n_tok):
            sq = float32(0)
            sk = float32(0)
            for i in range(dk):
                qi = q[b, t, kh, i]
                ki = k[b, t, kh, i]
                sq += qi * qi
                sk += ki * ki
            q_norm = scale32 / math.sqrt(sq + eps32)
            k_norm = float32(1) / math.sqrt(sk + eps32)
            decay = math.exp(g[b, t, h])
            u = float32(0)  # S^T k before the decay
            for i in range(dk):
                u += col[i] * k[b, t, kh, i]
            delta = beta[b, t, h] * (v[b, t, h, j] - decay * u * k_norm)
            o = float32(0)
            for i in range(dk):
                s = decay * col[i] + k[b, t, kh, i] * k_norm * delta
                col[i] = s
                o += q[b, t, kh, i] * s
            out[b, t, h, j] = o * q_norm
        for i in range(dk):
            states[slot, h, j, i] = col[i]


# ---------------------------------------------------------------------------------------------------------------------
# Launchers. Host-side checks mirror pantheon.kernels.cpu.ssm; ids given as device arrays are trusted.


def _check_slots(slot_ids: Any, n_seq: int, n_slots: int, what: str) -> None:
    if len(slot_ids) != n_seq:
        raise ValueError(f"{what}: {len(slot_ids)} slot ids for {n_seq} sequences")
    if isinstance(slot_ids, np.ndarray) and n_seq:
        if int(slot_ids.min()) < 0 or int(slot_ids.max()) >= n_slots:
            raise ValueError(f"{what}: slot id out of range [0, {n_slots})")
        if len(np.unique(slot_ids)) != n_seq:
            raise ValueError(f"{what}: a slot appears twice in one batch")


def _ids(values: Any, stream: Any) -> Any:
    if isinstance(values, np.ndarray):
        return cuda.to_device(np.ascontiguousarray(values, dtype=np.int32), stream=stream)
    return values


def causal_conv1d(x: Any, states: Any, weight: Any, slot_ids: Any, out: Any = None, stream: Any = 0,
                  geometry: Geometry = GEOMETRY) -> Any:
    """silu(depthwise causal conv) of x (B, L, C) continuing the conv states (S, K-1, C) in place; weight (C, K)."""
    n_seq, _, n_ch = x.shape
    if weight.shape[0] != n_ch or tuple(states.shape[1:]) != (weight.shape[1] - 1, n_ch):
        raise ValueError(f"causal_conv1d shapes do not fit: x {tuple(x.shape)}, weight {tuple(weight.shape)}, "
                         f"states {tuple(states.shape)}")
    _check_slots(slot_ids, n_seq, states.shape[0], "causal_conv1d")
    if out is None:
        out = cuda.device_array(x.shape, dtype=np.float32, stream=stream)
    if n_seq * n_ch and x.shape[1]:
        threads = geometry.ew_threads
        _causal_conv_kernel[blocks(n_seq * n_ch, threads=threads, geometry=geometry), threads, stream](
            x, states, weight, _ids(slot_ids, stream), out)
    return out


def gdn_gates(b: Any, alpha: Any, a: Any, dt_bias: Any, stream: Any = 0, geometry: Geometry = GEOMETRY,
              out: tuple[Any, Any] | None = None) -> tuple[Any, Any]:
    """(g, beta) = (a * softplus(alpha + dt_bias), sigmoid(b)) for b, alpha (T, Nv), into `out` when given."""
    if out is None:
        out = (cuda.device_array(alpha.shape, dtype=np.float32, stream=stream),
               cuda.device_array(b.shape, dtype=np.float32, stream=stream))
    g, beta = out
    n = b.shape[0] * b.shape[1]
    if n:
        threads = geometry.ew_threads
        _gdn_gates_kernel[blocks(n, threads=threads, geometry=geometry), threads, stream](b, alpha, a, dt_bias, g, beta)
    return g, beta


def gated_rmsnorm(x: Any, z: Any, weight: Any, eps: float, out: Any = None, stream: Any = 0,
                  geometry: Geometry = GEOMETRY) -> Any:
    """rmsnorm(x) * weight * silu(z), row by row (x, z (N, d)); `out` may alias x."""
    if out is None:
        out = cuda.device_array(x.shape, dtype=np.float32, stream=stream)
    if x.shape[0]:
        _gated_rmsnorm_kernel[blocks(x.shape[0], geometry=geometry), geometry.norm_threads, stream](
            x, z, weight, float(eps), out)
    return out


def sigmoid_mul(x: Any, gate: Any, out: Any = None, stream: Any = 0, geometry: Geometry = GEOMETRY) -> Any:
    """x * sigmoid(gate) for x (T, N) and gate (T, N) or (T, 1); `out` may alias x."""
    if tuple(gate.shape) not in ((x.shape[0], x.shape[1]), (x.shape[0], 1)):
        raise ValueError(f"sigmoid_mul: gate {tuple(gate.shape)} does not fit x {tuple(x.shape)}")
    if out is None:
        out = cuda.device_array(x.shape, dtype=np.float32, stream=stream)
    n = x.shape[0] * x.shape[1]
    if n:
        threads = geometry.ew_threads
        _sigmoid_mul_kernel[blocks(n, threads=threads, geometry=geometry), threads, stream](x, gate, out)
    return out


def gated_delta(q: Any, k: Any, v: Any, g: Any, beta: Any, states: Any, slot_ids: Any, key_head: Any, scale: float,
                eps: float, out: Any = None, what: str = "gated_delta_recurrent", stream: Any = 0,
                geometry: Geometry = GEOMETRY) -> Any:
    """The gated delta rule over B sequences of L tokens; states (S, Nv, dv, dk) updated in place."""
    n_seq, n_tok, n_kh, dk = q.shape
    n_vh, dv = v.shape[2], v.shape[3]
    if (tuple(k.shape) != tuple(q.shape) or tuple(v.shape[:2]) != (n_seq, n_tok)
            or tuple(g.shape) != (n_seq, n_tok, n_vh) or tuple(beta.shape) != tuple(g.shape)
            or tuple(states.shape[1:]) != (n_vh, dv, dk) or len(key_head) != n_vh):
        raise ValueError(f"{what} shapes do not fit: q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}, "
                         f"g {tuple(g.shape)}, beta {tuple(beta.shape)}, states {tuple(states.shape)}, "
                         f"key_head {len(key_head)}")
    if dk > MAX_KEY_DIM:
        raise ValueError(f"{what}: key dim {dk} is above the kernel's limit of {MAX_KEY_DIM}")
    if isinstance(key_head, np.ndarray) and n_vh and (int(key_head.min()) < 0 or int(key_head.max()) >= n_kh):
        raise ValueError(f"{what}: key_head entries must be in [0, {n_kh})")
    _check_slots(slot_ids, n_seq, states.shape[0], what)
    if out is None:
        out = cuda.device_array(v.shape, dtype=np.float32, stream=stream)
    n = n_seq * n_vh * dv
    if n and n_tok:
        threads = geometry.ew_threads
        _delta_rule_kernel[blocks(n, threads=threads, geometry=geometry), threads, stream](
            q, k, v, g, beta, states, _ids(slot_ids, stream), _ids(key_head, stream), float(scale), float(eps), out)
    return out


KERNELS = {
    "causal_conv": _causal_conv_kernel,
    "gdn_gates": _gdn_gates_kernel,
    "gated_rmsnorm": _gated_rmsnorm_kernel,
    "sigmoid_mul": _sigmoid_mul_kernel,
    "delta_rule": _delta_rule_kernel,
}

__all__ = ["causal_conv1d", "gated_delta", "gated_rmsnorm", "gdn_gates", "sigmoid_mul"]
