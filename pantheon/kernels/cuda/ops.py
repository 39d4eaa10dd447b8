"""CUDA kernels for the non-matmul ops of a llama-family transformer, and their host-side launchers.

Arrays are float32, C-contiguous device arrays unless a docstring says otherwise. Reductions go through shared
memory (`_block_sum`), never warp shuffles, so the simulator runs the same code as hardware. The numpy
references these are tested against live in `pantheon.kernels.reference.ops`.

Attention:
- `attention` (one sequence, T queries at start_pos..): prefill is a tiled online softmax, one query per thread,
  K/V tiles of KEY_TILE keys staged in shared memory by the whole block, causal by key index. Chunks of at most
  `small_prefill` tokens go to the decode kernel instead (one block per query and KV split).
- `attention_decode_batch` (one query per sequence, any slots): split-K over the KV. Each (sequence, head,
  split) block walks its keys with one running (max, sum, accumulator) per thread, merges them through shared
  memory and, when the KV is split, writes a partial that `_attention_combine_kernel` rescales and sums.
GQA everywhere: query head h reads kv head h // (Hq // Hkv).
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
from numba import float32, float64

from pantheon.kernels.cuda.launch import (
    DEC_SHARED_THREADS,
    GEOMETRY,
    KEY_TILE,
    MAX_HEAD_DIM,
    NORM_SHARED,
    Geometry,
    blocks,
    cuda,
)

# ---------------------------------------------------------------------------------------------------------------------
# Device helpers.


@cuda.jit(device=True)
def _block_sum(red, value):
    """Sum of `value` over a 1-D block (power-of-two size), returned to every thread; `red` is shared scratch."""
    t = cuda.threadIdx.x
    red[t] = value
    cuda.syncthreads()
    stride = cuda.blockDim.x // 2
    while stride > 0:
        if t < stride:
            red[t] += red[t + stride]
        cuda.syncthreads()
        stride //= 2
    total = red[0]
    cuda.syncthreads()  # red is reused by the next call
    return total


# ---------------------------------------------------------------------------------------------------------------------
# Norms.


@cuda.jit(device=True)
def _row_inv_rms(red, x, row, eps32):
    """1 / rms(x[row]) (with eps), to every thread of the block that holds the row."""
    dim = x.shape[1]
    part = float32(0)
    for i in range(cuda.threadIdx.x, dim, cuda.blockDim.x):
        v = x[row, i]
        part += v * v
    total = _block_sum(red, part)
    return float32(1) / math.sqrt(total / float32(dim) + eps32)


@cuda.jit
def _rmsnorm_kernel(x, weight, eps, out):
    red = cuda.shared.array(NORM_SHARED, float32)
    for row in range(cuda.blockIdx.x, x.shape[0], cuda.gridDim.x):
        inv_rms = _row_inv_rms(red, x, row, float32(eps))
        for i in range(cuda.threadIdx.x, x.shape[1], cuda.blockDim.x):
            out[row, i] = x[row, i] * inv_rms * weight[i]


@cuda.jit
def _add_rmsnorm_kernel(residual, delta, weight, eps, out):
    red = cuda.shared.array(NORM_SHARED, float32)
    t = cuda.threadIdx.x
    nt = cuda.blockDim.x
    dim = residual.shape[1]
    eps32 = float32(eps)
    for row in range(cuda.blockIdx.x, residual.shape[0], cuda.gridDim.x):
        part = float32(0)
        for i in range(t, dim, nt):
            v = residual[row, i] + delta[row, i]
            residual[row, i] = v
            part += v * v
        total = _block_sum(red, part)
        inv_rms = float32(1) / math.sqrt(total / float32(dim) + eps32)
        for i in range(t, dim, nt):
            out[row, i] = residual[row, i] * inv_rms * weight[i]


def rmsnorm(x: Any, weight: Any, eps: float, out: Any = None, stream: Any = 0,
            geometry: Geometry = GEOMETRY) -> Any:
    """x (T, D) -> x / sqrt(mean(x**2) + eps) * weight, into `out` (may be x)."""
    if out is None:
        out = cuda.device_array(x.shape, dtype=np.float32, stream=stream)
    if x.shape[0]:
        threads = geometry.norm_threads
        _rmsnorm_kernel[blocks(x.shape[0], geometry=geometry), threads, stream](x, weight, float(eps), out)
    return out


def add_rmsnorm(residual: Any, delta: Any, weight: Any, eps: float, out: Any, stream: Any = 0,
                geometry: Geometry = GEOMETRY) -> None:
    """residual += delta in place, then out = rmsnorm(residual)."""
    if residual.shape[0]:
        threads = geometry.norm_threads
        _add_rmsnorm_kernel[blocks(residual.shape[0], geometry=geometry), threads, stream](
            residual, delta, weight, float(eps), out)


# ---------------------------------------------------------------------------------------------------------------------
# RoPE, SwiGLU, KV write, row gather, fill.


@cuda.jit
def _rope_kernel(x, positions, n_rot, freq_base, neox, freq_scale):
    # The angle and its sin/cos in float64, as on the cpu: at position 5000 a float32 angle is ~3e-4 rad off.
    # One (token, pair) item does every head of the token, so the fp64 work is T * n_rot / 2 per call.
    half = n_rot // 2
    n_heads = x.shape[1]
    for item in range(cuda.grid(1), x.shape[0] * half, cuda.gridsize(1)):
        t = item // half
        i = item % half
        theta = float64(positions[t]) * freq_scale * math.pow(freq_base, -2.0 * i / n_rot)
        c = float32(math.cos(theta))
        s = float32(math.sin(theta))
        if neox:
            ia = i
            ib = i + half
        else:
            ia = 2 * i
            ib = 2 * i + 1
        for h in range(n_heads):
            a = x[t, h, ia]
            b = x[t, h, ib]
            x[t, h, ia] = a * c - b * s
            x[t, h, ib] = a * s + b * c


def rope_inplace(x: Any, positions: Any, n_rot: int, freq_base: float, neox: bool, freq_scale: float = 1.0,
                 stream: Any = 0, geometry: Geometry = GEOMETRY) -> None:
    """Rotate the first n_rot dims of every head of x (T, H, hd) by its token's position (int32 (T,))."""
    if n_rot % 2 or not 0 < n_rot <= x.shape[2]:
        raise ValueError(f"n_rot must be even and in (0, head_dim={x.shape[2]}], got {n_rot}")
    items = x.shape[0] * (n_rot // 2)
    if items:
        threads = geometry.ew_threads
        _rope_kernel[blocks(items, threads=threads, geometry=geometry), threads, stream](
            x, positions, int(n_rot), float(freq_base), 1 if neox else 0, float(freq_scale))


@cuda.jit
def _swiglu_kernel(gate, up, out):
    for i in range(cuda.grid(1), gate.shape[0], cuda.gridsize(1)):
        g = gate[i]
        # exp of a non-positive argument only: no overflow (and no overflow warning in the simulator).
        if g >= float32(0):
            silu = g / (float32(1) + math.exp(-g))
        else:
            e = math.exp(g)
            silu = g * e / (float32(1) + e)
        out[i] = silu * up[i]


def swiglu(gate: Any, up: Any, out: Any = None, stream: Any = 0, geometry: Geometry = GEOMETRY) -> Any:
    """silu(gate) * up for gate, up (T, F); `out` may alias either."""
    if out is None:
        out = cuda.device_array(gate.shape, dtype=np.float32, stream=stream)
    n = int(np.prod(gate.shape))
    if n:
        threads = geometry.ew_threads
        _swiglu_kernel[blocks(n, threads=threads, geometry=geometry), threads, stream](
            gate.reshape(n), up.reshape(n), out.reshape(n))
    return out


@cuda.jit
def _kv_write_kernel(pool, slots, positions, values):
    n_heads = values.shape[1]
    hd = values.shape[2]
    per_token = n_heads * hd
    for item in range(cuda.grid(1), values.shape[0] * per_token, cuda.gridsize(1)):
        t = item // per_token
        r = item % per_token
        slot = slots[t]
        pos = positions[t]
        if slot >= 0 and slot < pool.shape[0] and pos >= 0 and pos < pool.shape[1]:
            pool[slot, pos, r // hd, r % hd] = values[t, r // hd, r % hd]


def kv_write(pool: Any, slots: Any, positions: Any, values: Any, stream: Any = 0,
             geometry: Geometry = GEOMETRY) -> None:
    """pool[slots[t], positions[t]] = values[t]; pool (S, ctx, H, hd), values (T, H, hd). Rows outside the pool
    are skipped (the host side checks host arrays before launching)."""
    n = int(np.prod(values.shape))
    if n:
        threads = geometry.ew_threads
        _kv_write_kernel[blocks(n, threads=threads, geometry=geometry), threads, stream](pool, slots, positions, values)


@cuda.jit
def _gather_rows_kernel(x, rows, out):
    width = x.shape[1]
    for item in range(cuda.grid(1), rows.shape[0] * width, cuda.gridsize(1)):
        r = item // width
        c = item % width
        out[r, c] = x[rows[r], c]


def gather_rows(x: Any, rows: Any, stream: Any = 0, geometry: Geometry = GEOMETRY, out: Any = None) -> Any:
    """x[rows] for x (T, D) and a 1-D integer device array of row ids (checked by the caller), into `out` when
    given."""
    if out is None:
        out = cuda.device_array((rows.shape[0], x.shape[1]), dtype=x.dtype, stream=stream)
    n = rows.shape[0] * x.shape[1]
    if n:
        threads = geometry.ew_threads
        _gather_rows_kernel[blocks(n, threads=threads, geometry=geometry), threads, stream](x, rows, out)
    return out


@cuda.jit
def _copy_cols_kernel(x, start, out):
    width = out.shape[1]
    for item in range(cuda.grid(1), out.shape[0] * width, cuda.gridsize(1)):
        r = item // width
        c = item % width
        out[r, c] = x[r, start + c]


def split_cols(x: Any, widths: tuple[int, ...], stream: Any = 0, geometry: Geometry = GEOMETRY,
               outs: tuple[Any, ...] | None = None) -> list[Any]:
    """Consecutive column blocks of x (T, sum(widths)), each copied into its own contiguous device array
    (the kernels index rows by their width, so a strided view would not do): `outs` when given."""
    if sum(widths) != x.shape[1]:
        raise ValueError(f"column widths {widths} do not add up to {x.shape[1]}")
    parts, start = [], 0
    for i, width in enumerate(widths):
        out = cuda.device_array((x.shape[0], width), dtype=x.dtype, stream=stream) if outs is None else outs[i]
        n = x.shape[0] * width
        if n:
            threads = geometry.ew_threads
            _copy_cols_kernel[blocks(n, threads=threads, geometry=geometry), threads, stream](x, start, out)
        parts.append(out)
        start += width
    return parts


@cuda.jit
def _fill_kernel(flat, value):
    for i in range(cuda.grid(1), flat.shape[0], cuda.gridsize(1)):
        flat[i] = value


def fill(array: Any, value: float, stream: Any = 0, geometry: Geometry = GEOMETRY) -> Any:
    n = int(np.prod(array.shape))
    if n:
        threads = geometry.ew_threads
        _fill_kernel[blocks(n, threads=threads, geometry=geometry), threads, stream](array.reshape(n), value)
    return array


# ---------------------------------------------------------------------------------------------------------------------
# Attention.


@cuda.jit
def _attention_prefill_kernel(q, keys, values, start_pos, scale, out):
    """q (T, Hq, hd) at positions start_pos.., keys/values (ctx, Hkv, hd) of its slot. Work item = (tile of
    blockDim.x queries, head); thread i owns query tile*blockDim.x + i."""
    n_tok = q.shape[0]
    n_q_heads = q.shape[1]
    hd = q.shape[2]
    group = n_q_heads // keys.shape[1]
    nq = cuda.blockDim.x
    tid = cuda.threadIdx.x
    k_tile = cuda.shared.array((KEY_TILE, MAX_HEAD_DIM), float32)
    v_tile = cuda.shared.array((KEY_TILE, MAX_HEAD_DIM), float32)
    q_row = cuda.local.array(MAX_HEAD_DIM, float32)
    acc = cuda.local.array(MAX_HEAD_DIM, float32)
    scores = cuda.local.array(KEY_TILE, float32)
    scale32 = float32(scale)
    n_tiles = (n_tok + nq - 1) // nq
    for item in range(cuda.blockIdx.x, n_tiles * n_q_heads, cuda.gridDim.x):
        # Last query tiles first: they see the most keys, so the longest blocks start earliest.
        tile = n_tiles - 1 - item // n_q_heads
        head = item % n_q_heads
        kv = head // group
        t = tile * nq + tid
        active = t < n_tok
        my_last = start_pos + t  # the last key this query sees
        block_last = start_pos + min(tile * nq + nq, n_tok) - 1
        row_max = float32(-math.inf)
        row_sum = float32(0)
        for d in range(hd):
            acc[d] = float32(0)
            q_row[d] = q[t, head, d] * scale32 if active else float32(0)
        for k0 in range(0, block_last + 1, KEY_TILE):
            for idx in range(tid, KEY_TILE * hd, nq):
                j = idx // hd
                d = idx % hd
                if k0 + j <= block_last:
                    k_tile[j, d] = keys[k0 + j, kv, d]
                    v_tile[j, d] = values[k0 + j, kv, d]
            cuda.syncthreads()
            n_seen = min(KEY_TILE, my_last - k0 + 1)
            if active and n_seen > 0:
                tile_max = row_max
                for j in range(n_seen):
                    s = float32(0)
                    for d in range(hd):
                        s += q_row[d] * k_tile[j, d]
                    scores[j] = s
                    tile_max = max(tile_max, s)
                correction = math.exp(row_max - tile_max)
                row_sum *= correction
                for d in range(hd):
                    acc[d] *= correction
                for j in range(n_seen):
                    p = math.exp(scores[j] - tile_max)
                    row_sum += p
                    for d in range(hd):
                        acc[d] += p * v_tile[j, d]
                row_max = tile_max
            cuda.syncthreads()  # the tile is overwritten next
        if active:
            inv = float32(1) / row_sum
            for d in range(hd):
                out[t, head, d] = acc[d] * inv


@cuda.jit
def _attention_decode_kernel(q, k_pool, v_pool, slot_ids, positions, slot0, pos0, scale, n_splits,
                             part_max, part_sum, part_acc, out):
    """One query per row b of q (B, Hq, hd). Row b reads slot slot_ids[b] up to key positions[b] or, when
    slot0 >= 0, slot slot0 up to key pos0 + b (a short prefill chunk of one sequence). Work item = (b, head,
    split); with n_splits == 1 the result goes to out, else to the partials for the combine kernel."""
    n_seq = q.shape[0]
    n_q_heads = q.shape[1]
    hd = q.shape[2]
    n_slots = k_pool.shape[0]
    ctx = k_pool.shape[1]
    group = n_q_heads // k_pool.shape[2]
    nt = cuda.blockDim.x
    tid = cuda.threadIdx.x
    sh_max = cuda.shared.array(DEC_SHARED_THREADS, float32)
    sh_sum = cuda.shared.array(DEC_SHARED_THREADS, float32)
    sh_acc = cuda.shared.array((DEC_SHARED_THREADS, MAX_HEAD_DIM), float32)
    q_row = cuda.local.array(MAX_HEAD_DIM, float32)
    acc = cuda.local.array(MAX_HEAD_DIM, float32)
    scale32 = float32(scale)
    for item in range(cuda.blockIdx.x, n_seq * n_q_heads * n_splits, cuda.gridDim.x):
        split = item % n_splits
        head = (item // n_splits) % n_q_heads
        b = item // (n_splits * n_q_heads)
        if slot0 >= 0:
            slot = slot0
            pos = pos0 + b
        else:
            slot = slot_ids[b]
            pos = positions[b]
        n_keys = pos + 1
        if slot < 0 or slot >= n_slots or pos < 0 or pos >= ctx:
            n_keys = 0  # an invalid row reads nothing and comes out NaN
        chunk = (n_keys + n_splits - 1) // n_splits
        lo = split * chunk
        hi = min(n_keys, lo + chunk)
        kv = head // group
        for d in range(hd):
            q_row[d] = q[b, head, d] * scale32
            acc[d] = float32(0)
        run_max = float32(-math.inf)
        run_sum = float32(0)
        for j in range(lo + tid, hi, nt):
            s = float32(0)
            for d in range(hd):
                s += q_row[d] * k_pool[slot, j, kv, d]
            if s > run_max:
                correction = math.exp(run_max - s)
                run_sum *= correction
                for d in range(hd):
                    acc[d] *= correction
                run_max = s
            p = math.exp(s - run_max)
            run_sum += p
            for d in range(hd):
                acc[d] += p * v_pool[slot, j, kv, d]
        # Merge the threads' running states: rescale each to the block max, then sum in thread order.
        sh_max[tid] = run_max
        cuda.syncthreads()
        block_max = float32(-math.inf)
        for i in range(nt):
            block_max = max(block_max, sh_max[i])
        factor = float32(0)
        if run_max > float32(-math.inf):
            factor = math.exp(run_max - block_max)
        sh_sum[tid] = run_sum * factor
        for d in range(hd):
            sh_acc[tid, d] = acc[d] * factor
        cuda.syncthreads()
        total = float32(0)
        for i in range(nt):
            total += sh_sum[i]
        for d in range(tid, hd, nt):
            a = float32(0)
            for i in range(nt):
                a += sh_acc[i, d]
            if n_splits == 1:
                out[b, head, d] = a / total if total > float32(0) else float32(math.nan)
            else:
                part_acc[b, head, split, d] = a
        if tid == 0 and n_splits > 1:
            part_max[b, head, split] = block_max
            part_sum[b, head, split] = total
        cuda.syncthreads()  # the shared state is rewritten by the next item


@cuda.jit
def _attention_combine_kernel(part_max, part_sum, part_acc, out):
    n_seq = out.shape[0]
    n_q_heads = out.shape[1]
    hd = out.shape[2]
    n_splits = part_acc.shape[2]
    for item in range(cuda.grid(1), n_seq * n_q_heads * hd, cuda.gridsize(1)):
        d = item % hd
        head = (item // hd) % n_q_heads
        b = item // (hd * n_q_heads)
        top = float32(-math.inf)
        for s in range(n_splits):
            if part_sum[b, head, s] > float32(0):
                top = max(top, part_max[b, head, s])
        total = float32(0)
        a = float32(0)
        for s in range(n_splits):
            if part_sum[b, head, s] > float32(0):
                f = math.exp(part_max[b, head, s] - top)
                total += part_sum[b, head, s] * f
                a += part_acc[b, head, s, d] * f
        out[b, head, d] = a / total if total > float32(0) else float32(math.nan)


def _check_heads(q: Any, k_pool: Any, v_pool: Any) -> None:
    if len(k_pool.shape) != 4 or tuple(v_pool.shape) != tuple(k_pool.shape):
        raise ValueError(f"attention takes stacked caches (S, ctx, Hkv, hd), got {tuple(k_pool.shape)} / "
                         f"{tuple(v_pool.shape)}")
    if k_pool.shape[3] != q.shape[2] or q.shape[1] % k_pool.shape[2]:
        raise ValueError(f"attention shapes do not fit: q {tuple(q.shape)}, caches {tuple(k_pool.shape)}")
    if q.shape[2] > MAX_HEAD_DIM:
        raise ValueError(f"head_dim {q.shape[2]} is above the kernels' limit of {MAX_HEAD_DIM}")


class DecodeScratch:
    """Grow-only device buffers for the split-K partials; stable pointers between calls of one size (which CUDA
    graph replays need)."""

    def __init__(self) -> None:
        self._buffers: dict[str, Any] = {}

    def get(self, name: str, shape: tuple[int, ...], stream: Any = 0) -> Any:
        size = int(np.prod(shape))
        buf = self._buffers.get(name)
        if buf is None or buf.shape[0] < size:
            buf = cuda.device_array(max(size, 1), dtype=np.float32, stream=stream)
            self._buffers[name] = buf
        return buf[:size].reshape(shape)


def _decode(q: Any, k_pool: Any, v_pool: Any, slot_ids: Any, positions: Any, slot0: int, pos0: int, scale: float,
            n_keys_bound: int, out: Any, scratch: DecodeScratch, stream: Any, geometry: Geometry) -> Any:
    n_seq, n_q_heads, hd = q.shape
    n_splits = max(1, min(geometry.max_splits, -(-n_keys_bound // geometry.split_keys)))
    threads = geometry.dec_threads
    if n_splits > 1:
        part_max = scratch.get("max", (n_seq, n_q_heads, n_splits), stream)
        part_sum = scratch.get("sum", (n_seq, n_q_heads, n_splits), stream)
        part_acc = scratch.get("acc", (n_seq, n_q_heads, n_splits, hd), stream)
    else:
        part_max = part_sum = scratch.get("none", (1, 1, 1), stream)
        part_acc = scratch.get("none4", (1, 1, 1, 1), stream)
    items = n_seq * n_q_heads * n_splits
    _attention_decode_kernel[blocks(items, geometry=geometry), threads, stream](
        q, k_pool, v_pool, slot_ids, positions, int(slot0), int(pos0), float(scale), int(n_splits),
        part_max, part_sum, part_acc, out)
    if n_splits > 1:
        ew = geometry.ew_threads
        _attention_combine_kernel[blocks(n_seq * n_q_heads * hd, threads=ew, geometry=geometry), ew, stream](
            part_max, part_sum, part_acc, out)
    return out


def attention(q: Any, k_pool: Any, v_pool: Any, slot: int, start_pos: int, scale: float, out: Any = None,
              scratch: DecodeScratch | None = None, dummy_ids: Any = None, stream: Any = 0,
              geometry: Geometry = GEOMETRY) -> Any:
    """Causal GQA of one sequence's T queries (T, Hq, hd) at start_pos.. over slot `slot` of the stacked caches
    (S, ctx, Hkv, hd), whose rows start_pos .. start_pos + T - 1 already hold the new keys and values.
    `out` may be q itself."""
    _check_heads(q, k_pool, v_pool)
    n_tok = q.shape[0]
    if not 0 <= slot < k_pool.shape[0]:
        raise ValueError(f"attention: slot {slot} outside a pool of {k_pool.shape[0]}")
    if start_pos < 0 or start_pos + n_tok > k_pool.shape[1]:
        raise ValueError(f"attention: rows {start_pos}..{start_pos + n_tok - 1} are outside a cache of "
                         f"{k_pool.shape[1]}")
    if out is None:
        out = cuda.device_array(q.shape, dtype=np.float32, stream=stream)
    if n_tok == 0:
        return out
    if n_tok <= geometry.small_prefill:
        if scratch is None:
            scratch = DecodeScratch()
        if dummy_ids is None:
            dummy_ids = cuda.to_device(np.zeros(1, np.int32), stream=stream)
        return _decode(q, k_pool, v_pool, dummy_ids, dummy_ids, slot, start_pos, scale, start_pos + n_tok, out,
                       scratch, stream, geometry)
    threads = geometry.attn_queries
    items = -(-n_tok // threads) * q.shape[1]
    _attention_prefill_kernel[blocks(items, geometry=geometry), threads, stream](
        q, k_pool[slot], v_pool[slot], int(start_pos), float(scale), out)
    return out


def attention_decode_batch(q: Any, k_pool: Any, v_pool: Any, positions: Any, scale: float, out: Any = None, *,
                           slot_ids: Any, scratch: DecodeScratch | None = None, stream: Any = 0,
                           geometry: Geometry = GEOMETRY) -> Any:
    """One query per sequence, q (B, Hq, hd): sequence b attends to rows 0..positions[b] of slot slot_ids[b]
    (int32 device arrays). A slot or position outside the cache gives NaN for that sequence. The KV is split
    for a bound of ctx keys (the positions live on the device), each split a share of the sequence's keys."""
    _check_heads(q, k_pool, v_pool)
    if positions.shape[0] != q.shape[0] or slot_ids.shape[0] != q.shape[0]:
        raise ValueError(f"attention_decode_batch: {q.shape[0]} queries, {positions.shape[0]} positions, "
                         f"{slot_ids.shape[0]} slot ids")
    if out is None:
        out = cuda.device_array(q.shape, dtype=np.float32, stream=stream)
    if q.shape[0] == 0:
        return out
    return _decode(q, k_pool, v_pool, slot_ids, positions, -1, 0, scale, k_pool.shape[1], out,
                   scratch or DecodeScratch(), stream, geometry)


KERNELS = {
    "rmsnorm": _rmsnorm_kernel,
    "add_rmsnorm": _add_rmsnorm_kernel,
    "rope": _rope_kernel,
    "swiglu": _swiglu_kernel,
    "kv_write": _kv_write_kernel,
    "gather_rows": _gather_rows_kernel,
    "copy_cols": _copy_cols_kernel,
    "fill": _fill_kernel,
    "attention_prefill": _attention_prefill_kernel,
    "attention_decode": _attention_decode_kernel,
    "attention_combine": _attention_combine_kernel,
}

__all__ = ["DecodeScratch", "add_rmsnorm", "attention", "attention_decode_batch", "fill", "gather_rows",
           "kv_write", "rmsnorm", "rope_inplace", "split_cols", "swiglu"]
