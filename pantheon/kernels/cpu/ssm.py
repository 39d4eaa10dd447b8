"""numba CPU kernels for the Gated DeltaNet (linear-attention) layers of Qwen3.5 / Qwen3-Next.

Shapes: B sequences of L tokens each (a prefill chunk is B=1, a decode step is L=1), Nk key heads of dk,
Nv value heads of dv, C = conv channels (the [Q | K | V] projection, 2*Nk*dk + Nv*dv), K = conv taps.
The per-slot state lives in pools indexed by `slot_ids`: conv state (S, K-1, C), the last K-1 conv inputs
(time-major, oldest first); recurrent state (S, Nv, dv, dk), stored transposed as llama.cpp does: row j of
a head holds S[:, j] of the HF orientation S[key, value], so every hot loop runs over contiguous keys.

    conv:   c_t = silu(sum_j w[:, j] * x_{t-K+1+j}), inputs before the chunk come from the conv state
    gates:  beta = sigmoid(b),  g = a * softplus(alpha + dt_bias)            (a = -exp(A_log) < 0)
    delta:  S <- exp(g_t) S;  S <- S + k_t (beta_t (v_t - S^T k_t))^T;  o_t = S^T q_t
            with q, k L2-normalised per head and q scaled by 1/sqrt(dk)
    norm:   y = rmsnorm(o) * w * silu(z)  per value head

The delta rule comes in two forms that compute the same thing: `gated_delta_recurrent` walks the tokens
one by one (decode, batched over slots: one parallel item per (sequence, value head)) in one pass over the
state per token, and `gated_delta_chunked` (prefill) processes CHUNK tokens at a time with the WY/UT form of
reference/qwen35-gguf.md section 4.2, reading and writing the state once per chunk. On a CPU the chunked form
is not the faster one: both do ~3 dk*dv multiply-adds per token, and the chunk adds O(CHUNK * (dk + dv))
(x1.44 at CHUNK 64, dk = dv = 128). Measured on one Zen core, 256 tokens x 32 heads: chunked 34 ms,
recurrent 22 ms of CPU time, both ~17 GMAC/s; it pays off where matrix units run the chunk's products.
Each (sequence, head) item runs the same instructions whatever else is in the batch, so a sequence's
numbers do not depend on its batch (batch invariance).

Every kernel is `nogil` (the forward runs in a worker thread). The numpy references live in
`pantheon.kernels.reference.ssm`.
"""

from __future__ import annotations

import math

import numba
import numpy as np
from numba import prange

# The vectorizable float32 exp of the transformer ops (np.exp in a numba loop is a scalar libm call).
from pantheon.kernels.cpu.ops import _exp_f32

_FASTMATH = {"reassoc", "contract"}
_njit = numba.njit(cache=True, nogil=True, fastmath=_FASTMATH, error_model="numpy")
_njit_parallel = numba.njit(cache=True, nogil=True, fastmath=_FASTMATH, error_model="numpy", parallel=True)

CHUNK = 64  # tokens per chunk of the chunked delta rule (as HF and llama.cpp)
ELEMENTWISE_PARALLEL_MIN = 1 << 15  # elements from which the gate / norm helpers use the thread pool

_f32 = np.float32


# --- causal conv --------------------------------------------------------------------------------------


@_njit
def _silu(v):
    return v / (_f32(1.0) + _exp_f32(-v))


@_njit
def _axpy(w, x, out):
    for c in range(out.shape[0]):
        out[c] += w[c] * x[c]


# Channel loops always start at 0: a loop over range(c0, c1) keeps numba's negative-index check and does not
# vectorize (16 ms against 1.2 ms for 256 x 8192). So the work is split over tokens, whose outputs are
# independent (each reads only inputs), and the state is rolled afterwards.
@_njit_parallel
def _causal_conv_kernel(x, states, taps, slot_ids, out):
    """taps (K, C): the weight transposed, so the channel loops are contiguous and vectorize."""
    n_seq, n_tok, n_ch = x.shape
    hist = taps.shape[0] - 1
    last = taps[hist]
    for item in prange(n_seq * n_tok):
        b = item // n_tok
        t = item % n_tok
        state = states[slot_ids[b]]
        xb = x[b]
        o = out[b, t]
        xt = xb[t]
        for c in range(n_ch):
            o[c] = last[c] * xt[c]
        for j in range(hist):
            src = t - hist + j  # the input tap j multiplies: this chunk's, or the state's before it
            if src >= 0:
                _axpy(taps[j], xb[src], o)
            else:
                _axpy(taps[j], state[hist + src], o)
        for c in range(n_ch):
            o[c] = _silu(o[c])


@_njit
def _roll_conv_states(x, states, slot_ids):
    """Each sequence's state keeps the last K-1 inputs of concat(state, x)."""
    n_seq, n_tok, _ = x.shape
    hist = states.shape[1]
    for b in range(n_seq):
        state = states[slot_ids[b]]
        if n_tok >= hist:
            for r in range(hist):
                state[r, :] = x[b, n_tok - hist + r]
        else:
            for r in range(hist - n_tok):
                state[r, :] = state[r + n_tok]
            for r in range(n_tok):
                state[hist - n_tok + r, :] = x[b, r]


def _check_slots(slot_ids: np.ndarray, n_seq: int, n_slots: int, what: str) -> None:
    if len(slot_ids) != n_seq:
        raise ValueError(f"{what}: {len(slot_ids)} slot ids for {n_seq} sequences")
    if n_seq and (int(slot_ids.min()) < 0 or int(slot_ids.max()) >= n_slots):
        raise ValueError(f"{what}: slot id out of range [0, {n_slots})")
    if len(np.unique(slot_ids)) != n_seq:
        raise ValueError(f"{what}: a slot appears twice in one batch")


def causal_conv1d(x: np.ndarray, states: np.ndarray, weight: np.ndarray, slot_ids: np.ndarray,
                  out: np.ndarray | None = None) -> np.ndarray:
    """Depthwise causal conv + SiLU of B sequences of L tokens, x (B, L, C), continuing each slot's conv state.

    states (S, K-1, C) is updated in place (sequence b uses slot slot_ids[b]); weight (C, K), tap K-1 on the
    current token. Returns out (B, L, C) (must not alias x).
    """
    n_seq, _, n_ch = x.shape
    if weight.shape[0] != n_ch or states.shape[1:] != (weight.shape[1] - 1, n_ch):
        raise ValueError(f"causal_conv1d shapes do not fit: x {x.shape}, weight {weight.shape}, "
                         f"states {states.shape}")
    slot_ids = np.ascontiguousarray(slot_ids, dtype=np.int32)
    _check_slots(slot_ids, n_seq, states.shape[0], "causal_conv1d")
    if out is None:
        out = np.empty_like(x)
    if x.size:
        _causal_conv_kernel(x, states, np.ascontiguousarray(weight.T), slot_ids, out)
        _roll_conv_states(x, states, slot_ids)
    return out


# --- gates, norms -------------------------------------------------------------------------------------


@_njit
def _gates_kernel(b, alpha, a, dt_bias, g, beta):
    for t in range(b.shape[0]):
        for h in range(b.shape[1]):
            beta[t, h] = _f32(1.0 / (1.0 + math.exp(-np.float64(b[t, h]))))
            z = np.float64(alpha[t, h]) + np.float64(dt_bias[h])
            softplus = z if z > 20.0 else math.log1p(math.exp(z))  # torch's softplus threshold
            g[t, h] = _f32(np.float64(a[h]) * softplus)


def gdn_gates(b: np.ndarray, alpha: np.ndarray, a: np.ndarray, dt_bias: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Per-token, per-value-head gates from the projections b, alpha (T, Nv): returns (g, beta), both (T, Nv).

    beta = sigmoid(b); g = a * softplus(alpha + dt_bias), with a = ssm_a = -exp(A_log) (Nv,), so g <= 0.
    """
    g = np.empty_like(alpha)
    beta = np.empty_like(b)
    _gates_kernel(b, alpha, a, dt_bias, g, beta)  # T x Nv values: never worth a thread launch
    return g, beta


@_njit
def _gated_rmsnorm_row(x, z, weight, eps, out, r):
    xr = x[r]
    zr = z[r]
    o = out[r]
    sum_sq = 0.0
    for i in range(xr.shape[0]):
        v = np.float64(xr[i])
        sum_sq += v * v
    inv = _f32(1.0 / np.sqrt(sum_sq / xr.shape[0] + eps))
    for i in range(xr.shape[0]):
        o[i] = xr[i] * inv * weight[i] * _silu(zr[i])


@_njit
def _gated_rmsnorm_serial(x, z, weight, eps, out):
    for r in range(x.shape[0]):
        _gated_rmsnorm_row(x, z, weight, eps, out, r)


@_njit_parallel
def _gated_rmsnorm_parallel(x, z, weight, eps, out):
    for r in prange(x.shape[0]):
        _gated_rmsnorm_row(x, z, weight, eps, out, r)


def gated_rmsnorm(x: np.ndarray, z: np.ndarray, weight: np.ndarray, eps: float,
                  out: np.ndarray | None = None) -> np.ndarray:
    """rmsnorm(x) * weight * silu(z), row by row: x, z (N, d), weight (d,). `out` may alias x."""
    if out is None:
        out = np.empty_like(x)
    if x.size >= ELEMENTWISE_PARALLEL_MIN:
        _gated_rmsnorm_parallel(x, z, weight, float(eps), out)
    else:
        _gated_rmsnorm_serial(x, z, weight, float(eps), out)
    return out


@_njit
def _sigmoid_mul_rows(x, gate, out, t0, t1):
    per_col = gate.shape[1] != 1
    for t in range(t0, t1):
        if per_col:
            for i in range(x.shape[1]):
                out[t, i] = x[t, i] / (_f32(1.0) + _exp_f32(-gate[t, i]))
        else:
            s = _f32(1.0) / (_f32(1.0) + _exp_f32(-gate[t, 0]))
            for i in range(x.shape[1]):
                out[t, i] = x[t, i] * s


@_njit
def _sigmoid_mul_serial(x, gate, out):
    _sigmoid_mul_rows(x, gate, out, 0, x.shape[0])


@_njit_parallel
def _sigmoid_mul_parallel(x, gate, out):
    for t in prange(x.shape[0]):
        _sigmoid_mul_rows(x, gate, out, t, t + 1)


def sigmoid_mul(x: np.ndarray, gate: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
    """x * sigmoid(gate) for x (T, N) and gate (T, N) or (T, 1) (one gate per row). `out` may alias x."""
    if gate.shape not in ((x.shape[0], x.shape[1]), (x.shape[0], 1)):
        raise ValueError(f"sigmoid_mul: gate {gate.shape} does not fit x {x.shape}")
    if out is None:
        out = np.empty_like(x)
    if x.size >= ELEMENTWISE_PARALLEL_MIN:
        _sigmoid_mul_parallel(x, gate, out)
    else:
        _sigmoid_mul_serial(x, gate, out)
    return out


# --- gated delta rule ---------------------------------------------------------------------------------


@_njit
def _load_normalised(src, dst, scale, eps):
    """dst = src / sqrt(sum(src**2) + eps) * scale (the L2 norm of FLA / HF, accumulated in float64)."""
    sum_sq = 0.0
    for i in range(src.shape[0]):
        v = np.float64(src[i])
        sum_sq += v * v
    inv = _f32(scale / np.sqrt(sum_sq + eps))
    for i in range(src.shape[0]):
        dst[i] = src[i] * inv


@_njit
def _dot(a, b):
    acc = _f32(0.0)
    for i in range(a.shape[0]):
        acc += a[i] * b[i]
    return acc


@_njit_parallel
def _delta_recurrent_kernel(q, k, v, g, beta, states, slot_ids, key_head, scale, eps, out):
    n_seq, n_tok, _, dk = q.shape
    n_vh, dv = v.shape[2], v.shape[3]
    for item in prange(n_seq * n_vh):
        b = item // n_vh
        h = item % n_vh
        kh = key_head[h]
        state = states[slot_ids[b], h]  # (dv, dk): row j is S[:, j]
        qn = np.empty(dk, dtype=np.float32)
        kn = np.empty(dk, dtype=np.float32)
        for t in range(n_tok):
            _load_normalised(q[b, t, kh], qn, scale, eps)
            _load_normalised(k[b, t, kh], kn, 1.0, eps)
            decay = _f32(math.exp(np.float64(g[b, t, h])))
            bt = beta[b, t, h]
            kq = _dot(kn, qn)
            vt = v[b, t, h]
            o = out[b, t, h]
            # With u = S^T k and w = S^T q of the incoming state, delta = beta (v - decay u) and the output
            # of the updated state o = (decay S + k delta^T)^T q = decay w + (k.q) delta: then the update is
            # a second, last pass over the state.
            for j in range(dv):
                row = state[j]
                u = _f32(0.0)
                w = _f32(0.0)
                for i in range(dk):
                    u += row[i] * kn[i]
                    w += row[i] * qn[i]
                delta = bt * (vt[j] - decay * u)
                o[j] = decay * w + kq * delta
                for i in range(dk):
                    row[i] = decay * row[i] + delta * kn[i]


@_njit
def _delta_chunk(q, k, v, g, beta, b, h, kh, c0, n, state, scale, eps,
                 qc, kc, gcum, bc, dq, kd, mat_a, mat_m, u, w, o, kdt):
    """One chunk of n tokens (c0 ..) of sequence b, value head h; state (dv, dk) is updated in place and the
    chunk's outputs are left in o[:n]. Scratch arrays are (CHUNK, ...), kdt (dk, CHUNK)."""
    dv = state.shape[0]
    dk = state.shape[1]
    acc = 0.0
    for i in range(n):
        t = c0 + i
        _load_normalised(q[b, t, kh], qc[i], scale, eps)
        _load_normalised(k[b, t, kh], kc[i], 1.0, eps)
        acc += np.float64(g[b, t, h])
        gcum[i] = acc  # G_i, the decay from the chunk start through token i (log space, <= 0)
        bc[i] = beta[b, t, h]
    g_last = gcum[n - 1]
    for i in range(n):
        dq[i] = _f32(math.exp(gcum[i]))  # exp(G_i): decay of the incoming state at token i
        kd[i] = _f32(math.exp(g_last - gcum[i]))  # exp(G_last - G_i): decay from token i to the chunk end
    # A_ij = exp(G_i - G_j) q_i.k_j (j <= i); M_ij = beta_i exp(G_i - G_j) k_i.k_j (j < i)
    for i in range(n):
        for j in range(i + 1):
            decay = _f32(math.exp(gcum[i] - gcum[j]))
            mat_a[i, j] = decay * _dot(qc[i], kc[j])
            if j < i:
                mat_m[i, j] = bc[i] * decay * _dot(kc[i], kc[j])
    # (I + M) U = diag(beta) V and (I + M) W = diag(beta exp(G)) K, by forward substitution.
    for i in range(n):
        bi = bc[i]
        bw = bi * dq[i]
        vt = v[b, c0 + i, h]
        ui = u[i]
        wi = w[i]
        for j in range(dv):
            ui[j] = bi * vt[j]
        for a in range(dk):
            wi[a] = bw * kc[i, a]
        for j in range(i):
            m = mat_m[i, j]
            uj = u[j]
            wj = w[j]
            for c in range(dv):
                ui[c] -= m * uj[c]
            for a in range(dk):
                wi[a] -= m * wj[a]
    # V' = U - W S (into u) and the inter-chunk output O = diag(exp(G)) Q S: dot products with state rows,
    # four tokens at a time so a state row is loaded once for eight dot products.
    n4 = n - n % 4
    for j in range(dv):
        srow = state[j]
        for i in range(0, n4, 4):
            w0, w1, w2, w3 = w[i], w[i + 1], w[i + 2], w[i + 3]
            q0, q1, q2, q3 = qc[i], qc[i + 1], qc[i + 2], qc[i + 3]
            sw0 = sw1 = sw2 = sw3 = sq0 = sq1 = sq2 = sq3 = _f32(0.0)
            for a in range(dk):
                sa = srow[a]
                sw0 += w0[a] * sa
                sw1 += w1[a] * sa
                sw2 += w2[a] * sa
                sw3 += w3[a] * sa
                sq0 += q0[a] * sa
                sq1 += q1[a] * sa
                sq2 += q2[a] * sa
                sq3 += q3[a] * sa
            u[i, j] -= sw0
            u[i + 1, j] -= sw1
            u[i + 2, j] -= sw2
            u[i + 3, j] -= sw3
            o[i, j] = dq[i] * sq0
            o[i + 1, j] = dq[i + 1] * sq1
            o[i + 2, j] = dq[i + 2] * sq2
            o[i + 3, j] = dq[i + 3] * sq3
        for i in range(n4, n):
            u[i, j] -= _dot(w[i], srow)
            o[i, j] = dq[i] * _dot(qc[i], srow)
    # O += A V' (intra-chunk)
    for i in range(n):
        oi = o[i]
        for j in range(i + 1):
            aij = mat_a[i, j]
            uj = u[j]
            for c in range(dv):
                oi[c] += aij * uj[c]
    # S = exp(G_last) S + sum_i (exp(G_last - G_i) k_i) V'_i^T. As dot products over the chunk's tokens:
    # S^T[j, a] = decay S^T[j, a] + V'[:, j] . Kd[:, a], with Kd = the decayed keys transposed (into w).
    for i in range(n):
        for a in range(dk):
            kdt[a, i] = kc[i, a] * kd[i]
    s_decay = _f32(math.exp(g_last))
    col = mat_m[0]  # scratch of CHUNK floats for a column of V'
    for j in range(dv):
        for i in range(n):
            col[i] = u[i, j]
        srow = state[j]
        for a in range(dk):
            kda = kdt[a]
            acc = _f32(0.0)
            for i in range(n):
                acc += col[i] * kda[i]
            srow[a] = s_decay * srow[a] + acc


@_njit_parallel
def _delta_chunked_kernel(q, k, v, g, beta, states, slot_ids, key_head, scale, eps, chunk, out):
    n_seq, n_tok, _, dk = q.shape
    n_vh, dv = v.shape[2], v.shape[3]
    for item in prange(n_seq * n_vh):
        b = item // n_vh
        h = item % n_vh
        kh = key_head[h]
        state = states[slot_ids[b], h]
        qc = np.empty((chunk, dk), dtype=np.float32)
        kc = np.empty((chunk, dk), dtype=np.float32)
        gcum = np.empty(chunk, dtype=np.float64)
        bc = np.empty(chunk, dtype=np.float32)
        dq = np.empty(chunk, dtype=np.float32)
        kd = np.empty(chunk, dtype=np.float32)
        mat_a = np.empty((chunk, chunk), dtype=np.float32)
        mat_m = np.empty((chunk, chunk), dtype=np.float32)
        u = np.empty((chunk, dv), dtype=np.float32)
        w = np.empty((chunk, dk), dtype=np.float32)
        o = np.empty((chunk, dv), dtype=np.float32)
        kdt = np.zeros((dk, chunk), dtype=np.float32)
        for c0 in range(0, n_tok, chunk):
            n = min(chunk, n_tok - c0)
            _delta_chunk(q, k, v, g, beta, b, h, kh, c0, n, state, scale, eps,
                         qc, kc, gcum, bc, dq, kd, mat_a, mat_m, u, w, o, kdt)
            for i in range(n):
                dst = out[b, c0 + i, h]
                for c in range(dv):
                    dst[c] = o[i, c]


def _check_delta(q, k, v, g, beta, states, slot_ids, key_head, what):
    n_seq, n_tok, n_kh, dk = q.shape
    n_vh, dv = v.shape[2], v.shape[3]
    if (k.shape != q.shape or v.shape[:2] != (n_seq, n_tok) or g.shape != (n_seq, n_tok, n_vh)
            or beta.shape != g.shape or states.shape[1:] != (n_vh, dv, dk) or len(key_head) != n_vh):
        raise ValueError(f"{what} shapes do not fit: q {q.shape}, k {k.shape}, v {v.shape}, g {g.shape}, "
                         f"beta {beta.shape}, states {states.shape}, key_head {len(key_head)}")
    key_head = np.ascontiguousarray(key_head, dtype=np.int32)
    if n_vh and (int(key_head.min()) < 0 or int(key_head.max()) >= n_kh):
        raise ValueError(f"{what}: key_head entries must be in [0, {n_kh})")
    slot_ids = np.ascontiguousarray(slot_ids, dtype=np.int32)
    _check_slots(slot_ids, n_seq, states.shape[0], what)
    return slot_ids, key_head


def gated_delta_recurrent(q: np.ndarray, k: np.ndarray, v: np.ndarray, g: np.ndarray, beta: np.ndarray,
                          states: np.ndarray, slot_ids: np.ndarray, key_head: np.ndarray, scale: float,
                          eps: float, out: np.ndarray | None = None) -> np.ndarray:
    """The gated delta rule token by token, for B sequences of L tokens (decode: L = 1, batched over slots).

    q, k (B, L, Nk, dk) and v (B, L, Nv, dv) may be strided views (slices of the conv output); g, beta
    (B, L, Nv); states (S, Nv, dv, dk) float32 (transposed, see the module docstring), updated in place
    (sequence b uses slot slot_ids[b]);
    key_head (Nv,) int: the key head of each value head (h // (Nv/Nk) grouped, h % Nk tiled). q and k are
    L2-normalised per head here (x / sqrt(sum(x**2) + eps)) and q is multiplied by `scale`.
    Returns out (B, L, Nv, dv).
    """
    slot_ids, key_head = _check_delta(q, k, v, g, beta, states, slot_ids, key_head, "gated_delta_recurrent")
    if out is None:
        out = np.empty(v.shape, dtype=np.float32)
    if v.size:
        _delta_recurrent_kernel(q, k, v, g, beta, states, slot_ids, key_head, float(scale), float(eps), out)
    return out


def gated_delta_chunked(q: np.ndarray, k: np.ndarray, v: np.ndarray, g: np.ndarray, beta: np.ndarray,
                        states: np.ndarray, slot_ids: np.ndarray, key_head: np.ndarray, scale: float,
                        eps: float, out: np.ndarray | None = None, chunk: int = CHUNK) -> np.ndarray:
    """The same computation as `gated_delta_recurrent`, `chunk` tokens at a time (prefill).

    Chunks start at the first token of the call; the last one may be shorter (no padding is needed: padded
    tokens with beta = g = 0 would change nothing). Equal to the recurrent form up to float32 rounding.
    """
    slot_ids, key_head = _check_delta(q, k, v, g, beta, states, slot_ids, key_head, "gated_delta_chunked")
    if chunk < 1:
        raise ValueError(f"gated_delta_chunked: chunk must be positive, got {chunk}")
    if out is None:
        out = np.empty(v.shape, dtype=np.float32)
    if v.size:
        _delta_chunked_kernel(q, k, v, g, beta, states, slot_ids, key_head, float(scale), float(eps),
                              int(chunk), out)
    return out
