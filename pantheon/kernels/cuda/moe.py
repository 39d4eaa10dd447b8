"""Mixture-of-experts on CUDA: the router, and an expert FFN that reads only the selected experts' blocks.

Expert weights are pantheon.kernels.cpu.moe.ExpertWeights over a CudaWeight (a stacked GGUF tensor in device
memory; the layout object is backend-neutral). `moe_ffn` groups the (token, rank) pairs by expert on the host,
as the cpu backend does, so it copies the top-k ids (T x k int32) to the host once per MoE layer: a sync, and
a step that contains it cannot be captured as a CUDA graph. A decode step takes `moe_ffn_pairs` instead: one
tile per (token, rank) pair, its expert read on the device, nothing on the host (the same bits). Each
expert's pairs are cut into tiles of at most BATCH_TILE rows; `quant.expert_matmul` runs every tile through
its expert's rows, with the dense matmul's per-row instructions, so a token's result does not depend on which
other tokens share its experts, and the combine sums its experts in its own top-k order (batch invariance).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np
from numba import float32, float64

from pantheon.kernels.cpu.moe import ExpertWeights
from pantheon.kernels.cuda import ops, quant
from pantheon.kernels.cuda.launch import BATCH_TILE, GEOMETRY, Geometry, blocks, cuda

MAX_EXPERTS = 512  # the router's thread-local probabilities


@cuda.jit
def _moe_route_kernel(logits, k, ids, weights):
    """Thread per token: float64 softmax over the E logits, the top k (lower id first among equals), renormalised;
    the same steps and roundings as the cpu router."""
    probs = cuda.local.array(MAX_EXPERTS, float64)
    n_experts = logits.shape[1]
    for t in range(cuda.grid(1), logits.shape[0], cuda.gridsize(1)):
        top = -math.inf
        for e in range(n_experts):
            top = max(top, float64(logits[t, e]))
        total = 0.0
        for e in range(n_experts):
            p = math.exp(float64(logits[t, e]) - top)
            probs[e] = p
            total += p
        chosen = 0.0
        for r in range(k):
            best = -1
            for e in range(n_experts):
                if probs[e] >= 0.0 and (best < 0 or probs[e] > probs[best]):
                    best = e
            ids[t, r] = best
            weights[t, r] = float32(probs[best] / total)
            chosen += probs[best] / total
            probs[best] = -1.0
        for r in range(k):
            weights[t, r] = float32(weights[t, r] / chosen)


@cuda.jit
def _combine_kernel(y, pair_of, weights, out):
    """out[t, i] += sum_r weights[t, r] * y[pair_of[t, r], i], r in top-k order."""
    width = out.shape[1]
    for item in range(cuda.grid(1), out.shape[0] * width, cuda.gridsize(1)):
        t = item // width
        i = item % width
        acc = out[t, i]
        for r in range(weights.shape[1]):
            acc += weights[t, r] * y[pair_of[t, r], i]
        out[t, i] = acc


def moe_route(logits: Any, k: int, stream: Any = 0, geometry: Geometry = GEOMETRY,
              out: tuple[Any, Any] | None = None) -> tuple[Any, Any]:
    """softmax -> top-k -> renormalise over router logits (T, E): (ids int32 (T, k), weights float32 (T, k)),
    into `out` when given."""
    n_tok, n_experts = logits.shape
    if not 1 <= k <= n_experts:
        raise ValueError(f"moe_route: cannot pick {k} of {n_experts} experts")
    if n_experts > MAX_EXPERTS:
        raise ValueError(f"moe_route: {n_experts} experts is above the kernel's limit of {MAX_EXPERTS}")
    if out is None:
        out = (cuda.device_array((n_tok, k), dtype=np.int32, stream=stream),
               cuda.device_array((n_tok, k), dtype=np.float32, stream=stream))
    ids, weights = out
    if n_tok:
        threads = geometry.ew_threads
        _moe_route_kernel[blocks(n_tok, threads=threads, geometry=geometry), threads, stream](logits, int(k), ids,
                                                                                              weights)
    return ids, weights


def _run(experts: ExpertWeights, x: Any, tiles: tuple[Any, Any, Any], n_tiles: int, stream: Any,
         geometry: Geometry, out: Any = None) -> Any:
    return quant.expert_matmul(experts.weight, experts.stride, experts.offset, experts.rows, x, tiles, n_tiles,
                               stream, geometry, out)


def _check_ffn(x: Any, gate: ExpertWeights, up: ExpertWeights, down: ExpertWeights, weights: Any, out: Any,
               n_tok: int, k: int) -> None:
    if (gate.cols != x.shape[1] or up.cols != x.shape[1] or up.rows != gate.rows or down.cols != gate.rows
            or down.rows != x.shape[1] or tuple(out.shape) != tuple(x.shape) or tuple(weights.shape) != (n_tok, k)
            or not gate.n_experts == up.n_experts == down.n_experts):
        raise ValueError(f"moe_ffn shapes do not fit: x {tuple(x.shape)}, gate {gate.rows}x{gate.cols}, "
                         f"up {up.rows}x{up.cols}, down {down.rows}x{down.cols}, ids {(n_tok, k)}, "
                         f"out {tuple(out.shape)}")


def moe_ffn(x: Any, gate: ExpertWeights, up: ExpertWeights, down: ExpertWeights, ids: Any, weights: Any, out: Any,
            ids_host: np.ndarray, stream: Any = 0, geometry: Geometry = GEOMETRY) -> Any:
    """out[t] += sum_r weights[t, r] * down_e(silu(gate_e x_t) * up_e x_t), e = ids[t, r]; `ids_host` is the host
    copy of ids (the backend makes it). x (T, D), weights (T, k) device arrays; returns out."""
    n_tok, k = ids_host.shape
    _check_ffn(x, gate, up, down, weights, out, n_tok, k)
    if n_tok == 0:
        return out
    flat = ids_host.reshape(-1)
    if int(flat.min()) < 0 or int(flat.max()) >= gate.n_experts:
        raise ValueError(f"moe_ffn: expert id outside [0, {gate.n_experts})")
    # Pairs (token, rank) sorted by expert, within an expert by token; tiles never straddle two experts.
    order = np.argsort(flat, kind="stable")
    experts, first, counts = np.unique(flat[order], return_index=True, return_counts=True)
    tile_expert, tile_start, tile_count = [], [], []
    for e, start, count in zip(experts, first, counts):
        for s in range(int(start), int(start + count), BATCH_TILE):
            tile_expert.append(int(e))
            tile_start.append(s)
            tile_count.append(min(BATCH_TILE, int(start + count) - s))
    tiles = tuple(cuda.to_device(np.array(a, dtype=np.int64), stream=stream)
                  for a in (tile_expert, tile_start, tile_count))
    pair_of = np.empty(len(order), dtype=np.int64)
    pair_of[order] = np.arange(len(order))
    rows = cuda.to_device((order // k).astype(np.int64), stream=stream)
    xs = ops.gather_rows(x, rows, stream, geometry)
    n_tiles = len(tile_expert)
    act = ops.swiglu(_run(gate, xs, tiles, n_tiles, stream, geometry), _run(up, xs, tiles, n_tiles, stream, geometry),
                     stream=stream, geometry=geometry)
    y = _run(down, act, tiles, n_tiles, stream, geometry)
    _combine(y, cuda.to_device(pair_of.reshape(n_tok, k), stream=stream), weights, out, stream, geometry)
    return out


def _combine(y: Any, pair_of: Any, weights: Any, out: Any, stream: Any, geometry: Geometry) -> None:
    n = out.shape[0] * out.shape[1]
    threads = geometry.ew_threads
    _combine_kernel[blocks(n, threads=threads, geometry=geometry), threads, stream](y, pair_of, weights, out)


@dataclass
class PairBuffers:
    """The arrays `moe_ffn_pairs` uses for T tokens of k experts each (P = T k pairs, in (token, rank) order),
    allocated once: the pairs' token rows, one tile per pair, and the intermediate activations."""

    rows: Any  # int64 (P,): the token of each pair
    tile_start: Any  # int64 (P,): pair p is tile p ...
    tile_count: Any  # ... of one row
    pair_of: Any  # int64 (T, k): the pair of (token, rank), for the combine
    xs: Any  # (P, D)
    gate: Any  # (P, F)
    up: Any
    act: Any
    y: Any  # (P, D)


def pair_buffers(n_tok: int, k: int, d_model: int, ffn: int, stream: Any = 0) -> PairBuffers:
    pairs = np.arange(n_tok * k, dtype=np.int64)

    def empty(cols: int) -> Any:
        return cuda.device_array((n_tok * k, cols), dtype=np.float32, stream=stream)

    return PairBuffers(rows=cuda.to_device(pairs // k, stream=stream), tile_start=cuda.to_device(pairs, stream=stream),
                       tile_count=cuda.to_device(np.ones_like(pairs), stream=stream),
                       pair_of=cuda.to_device(pairs.reshape(n_tok, k), stream=stream), xs=empty(d_model),
                       gate=empty(ffn), up=empty(ffn), act=empty(ffn), y=empty(d_model))


def moe_ffn_pairs(x: Any, gate: ExpertWeights, up: ExpertWeights, down: ExpertWeights, ids: Any, weights: Any,
                  out: Any, bufs: PairBuffers, stream: Any = 0, geometry: Geometry = GEOMETRY) -> Any:
    """`moe_ffn` without the host: every (token, rank) pair is its own tile, its expert read from `ids` on the
    device, so nothing waits for the router and the launches can be captured in a graph. The same bits as the
    grouped form (a row's products do not depend on its tile-mates, and the combine keeps top-k order); each
    pair reads its expert's rows on its own, so it suits a decode step's few tokens, not a prefill. `ids` come
    from `moe_route` (always in range)."""
    n_tok, k = ids.shape
    _check_ffn(x, gate, up, down, weights, out, n_tok, k)
    if n_tok == 0:
        return out
    n_pairs = n_tok * k
    ops.gather_rows(x, bufs.rows, stream, geometry, out=bufs.xs)
    tiles = (ids.reshape(n_pairs), bufs.tile_start, bufs.tile_count)
    _run(gate, bufs.xs, tiles, n_pairs, stream, geometry, bufs.gate)
    _run(up, bufs.xs, tiles, n_pairs, stream, geometry, bufs.up)
    ops.swiglu(bufs.gate, bufs.up, bufs.act, stream, geometry)
    _run(down, bufs.act, tiles, n_pairs, stream, geometry, bufs.y)
    _combine(bufs.y, bufs.pair_of, weights, out, stream, geometry)
    return out


KERNELS = {"moe_route": _moe_route_kernel, "combine": _combine_kernel}

__all__ = ["MAX_EXPERTS", "PairBuffers", "moe_ffn", "moe_ffn_pairs", "moe_route", "pair_buffers"]
