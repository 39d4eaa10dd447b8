"""Mixture-of-experts on the CPU: the router and an expert FFN that reads only the selected experts' weights.

An expert tensor in GGUF stacks E matrices (ggml ne {cols, rows, E}), which `quant.prepare_weight` sees as one
(E * rows_total) x cols weight; expert e's matrix is its rows [e * stride + offset, ... + rows). `offset` and
`stride` let one fused gate_up tensor serve as two expert matrices.

`moe_ffn` groups the (token, expert) pairs of a batch by expert, so every selected expert's rows are
dequantized once per call and dotted with all its tokens while hot, exactly as `quant._gemm_rows` does for a
dense weight (same row dequantizers, same per-row dot loop). A token's result therefore does not depend on
which other tokens share its experts, and its expert outputs are summed in its own top-k order: batch
invariance holds as for the dense matmul.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numba
import numpy as np
from numba import prange

from pantheon.kernels.cpu import ops, quant
from pantheon.kernels.cpu.quant import _N16, QWeight, _deq_row, _dot_1_row, _dot_4_rows

_FASTMATH = {"reassoc", "contract", "nsz", "arcp"}
_KERNEL = dict(cache=True, nogil=True, fastmath=_FASTMATH)


@dataclass(frozen=True)
class ExpertWeights:
    """n_experts matrices of `rows` x weight.cols inside one stacked weight (see the module docstring)."""

    weight: QWeight
    n_experts: int
    rows: int
    stride: int
    offset: int = 0

    def __post_init__(self) -> None:
        if self.rows < 1 or self.offset + self.rows > self.stride or self.weight.rows != self.n_experts * self.stride:
            raise ValueError(f"expert layout does not fit the weight: {self.n_experts} experts of {self.rows} rows "
                             f"at offset {self.offset}, stride {self.stride}, weight rows {self.weight.rows}")

    @property
    def cols(self) -> int:
        return self.weight.cols


def stacked_experts(weight: QWeight, n_experts: int, split: int = 1, part: int = 0) -> ExpertWeights:
    """The experts of a stacked tensor; split > 1 takes part `part` of each expert's rows (fused gate_up)."""
    if n_experts < 1 or weight.rows % n_experts:
        raise ValueError(f"a weight of {weight.rows} rows does not hold {n_experts} experts")
    stride = weight.rows // n_experts
    if split < 1 or stride % split or not 0 <= part < split:
        raise ValueError(f"cannot take part {part} of {split} from experts of {stride} rows")
    rows = stride // split
    return ExpertWeights(weight, n_experts, rows, stride, part * rows)


# --- router -------------------------------------------------------------------------------------------


@numba.njit(cache=True, nogil=True)
def _route_row(logits, k, ids, weights, probs, t):
    row = logits[t]
    top = -np.inf
    for e in range(row.shape[0]):
        top = max(top, np.float64(row[e]))
    total = 0.0
    for e in range(row.shape[0]):
        p = math.exp(np.float64(row[e]) - top)
        probs[e] = p
        total += p
    chosen = 0.0
    for r in range(k):
        best = -1
        for e in range(row.shape[0]):  # the first of equal probabilities wins
            if probs[e] >= 0.0 and (best < 0 or probs[e] > probs[best]):
                best = e
        ids[t, r] = best
        weights[t, r] = probs[best] / total
        chosen += probs[best] / total
        probs[best] = -1.0
    for r in range(k):
        weights[t, r] = weights[t, r] / chosen


@numba.njit(cache=True, nogil=True)
def _route_kernel(logits, k, ids, weights):
    probs = np.empty(logits.shape[1], dtype=np.float64)
    for t in range(logits.shape[0]):  # T x E values: never worth a thread launch
        _route_row(logits, k, ids, weights, probs, t)


def moe_route(logits: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
    """Softmax over the E router logits of each token (T, E), the top k, renormalised to sum to 1.

    Returns (ids int32 (T, k), weights float32 (T, k)), best first; of equal probabilities the lower id wins.
    """
    n_tok, n_experts = logits.shape
    if not 1 <= k <= n_experts:
        raise ValueError(f"moe_route: cannot pick {k} of {n_experts} experts")
    ids = np.empty((n_tok, k), dtype=np.int32)
    weights = np.empty((n_tok, k), dtype=np.float32)
    if n_tok:
        _route_kernel(logits, int(k), ids, weights)
    return ids, weights


# --- expert matmuls -----------------------------------------------------------------------------------


@numba.njit(parallel=True, **_KERNEL)
def _expert_gemm(qtype, data, stride, offset, n_rows, x, seg_starts, seg_experts, out, n16, rows_per_item):
    """out[p, :] = x[p] @ W_e.T for the pairs p of each segment s (tokens of expert e = seg_experts[s]).

    Work items are (segment, block of rows_per_item weight rows); a block's rows are unpacked four at a time
    into a scratch and dotted with every x row of its segment (quant._dot_4_rows, as the dense matmul)."""
    k_dim = x.shape[1]
    n_blocks = (n_rows + rows_per_item - 1) // rows_per_item
    for item in prange(seg_experts.shape[0] * n_blocks):
        s = item // n_blocks
        r0 = (item % n_blocks) * rows_per_item
        r1 = min(n_rows, r0 + rows_per_item)
        base = seg_experts[s] * stride + offset
        xs = x[seg_starts[s] : seg_starts[s + 1]]
        os = out[seg_starts[s] : seg_starts[s + 1]]
        w = np.empty((4, k_dim), dtype=np.float32)
        n = r0
        while n + 4 <= r1:
            for r in range(4):
                _deq_row(qtype, data[base + n + r], w[r], n16)
            _dot_4_rows(w, xs, os, n)
            n += 4
        for r in range(n, r1):
            _deq_row(qtype, data[base + r], w[0], n16)
            _dot_1_row(w[0], xs, os, r)


@numba.njit(cache=True, nogil=True, parallel=True)
def _combine(y, pair_of, weights, out):
    """out[t] += sum_r weights[t, r] * y[pair_of[t, r]], r in top-k order."""
    for t in prange(out.shape[0]):
        dst = out[t]
        for r in range(weights.shape[1]):
            src = y[pair_of[t, r]]
            wr = weights[t, r]
            for i in range(dst.shape[0]):
                dst[i] += wr * src[i]


def _run(experts: ExpertWeights, x: np.ndarray, seg_starts: np.ndarray, seg_experts: np.ndarray) -> np.ndarray:
    out = np.empty((x.shape[0], experts.rows), dtype=np.float32)
    # Enough items for ~4 per thread, each a multiple of 4 rows.
    items_wanted = 4 * numba.get_num_threads()
    per_item = -(-experts.rows * len(seg_experts) // items_wanted)
    per_item = min(experts.rows, max(4, -(-per_item // 4) * 4))
    w = experts.weight
    _expert_gemm(w.qtype, w.data, experts.stride, experts.offset, experts.rows, x, seg_starts, seg_experts, out,
                 _N16, per_item)
    return out


def moe_ffn(x: np.ndarray, gate: ExpertWeights, up: ExpertWeights, down: ExpertWeights, ids: np.ndarray,
            weights: np.ndarray, out: np.ndarray) -> np.ndarray:
    """out[t] += sum_r weights[t, r] * down_e(silu(gate_e x_t) * up_e x_t), e = ids[t, r]: the routed experts.

    x (T, D) float32; ids int32 and weights float32 (T, k) from `moe_route`; out (T, D) is added to in place
    (it usually holds the gated shared expert already) and returned. Only the selected experts' rows are read.
    """
    n_tok, k = ids.shape
    if (gate.cols != x.shape[1] or up.cols != x.shape[1] or up.rows != gate.rows or down.cols != gate.rows
            or down.rows != x.shape[1] or out.shape != x.shape or weights.shape != ids.shape
            or not gate.n_experts == up.n_experts == down.n_experts):
        raise ValueError(f"moe_ffn shapes do not fit: x {x.shape}, gate {gate.rows}x{gate.cols}, "
                         f"up {up.rows}x{up.cols}, down {down.rows}x{down.cols}, ids {ids.shape}, out {out.shape}")
    for w in (gate.weight, up.weight, down.weight):
        if w.qtype not in quant.SUPPORTED_TYPES:
            raise quant.UnsupportedTensorType(f"ggml tensor type {w.qtype} is not supported by the CPU kernels")
    if n_tok == 0:
        return out
    flat = ids.reshape(-1)
    if int(flat.min()) < 0 or int(flat.max()) >= gate.n_experts:
        raise ValueError(f"moe_ffn: expert id outside [0, {gate.n_experts})")
    # Pairs (token, rank) sorted by expert; within an expert by token.
    order = np.argsort(flat, kind="stable")
    seg_experts, first = np.unique(flat[order], return_index=True)
    seg_starts = np.append(first, len(order)).astype(np.int64)
    seg_experts = seg_experts.astype(np.int64)
    pair_of = np.empty(len(order), dtype=np.int64)
    pair_of[order] = np.arange(len(order))
    xs = np.ascontiguousarray(x[order // k])
    act = ops.swiglu(_run(gate, xs, seg_starts, seg_experts), _run(up, xs, seg_starts, seg_experts))
    y = _run(down, act, seg_starts, seg_experts)
    _combine(y, pair_of.reshape(n_tok, k), weights, out)
    return out
