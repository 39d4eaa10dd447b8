"""A llama decode step's layers in one compiled call: no Python, and no GIL, between its kernels.

Driven from Python, a decode step of the default model is ~270 kernel calls (four matmuls, the attention, two
norms and the SwiGLU per layer), each paying its wrapper's checks, numba's argument unboxing and a release
and re-acquire of the GIL: about 1 ms of a 4-5 ms batch-1 step on the 2-core test VM. Under the server the
re-acquires also wait on the event loop, which holds the GIL while it sends the tokens of the step before.
`decode_layers` runs the same kernels, with the same arguments, in the same order, from one nogil function,
so the numbers are the bits of the Python path (tests/kernels/test_decode_layers.py).

Only the shape of model that the int8 path serves whole takes it: every layer's q|k|v and gate|up stacked,
all four matrices Q4_1 or Q8_0 (`int8dot.INT8_TYPES`) on a CPU with the int8 kernels, a head dim that is a
multiple of 16 (the attention intrinsics). Anything else keeps the Python loop. When the embedding is
quantized and the output matrix is an int8-path type too (the default model), `decode_step` also takes
the embedding rows, the first norm and the output matmul: token ids in, logits out, one GIL round trip.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numba
import numpy as np
from numba.typed import List

from pantheon.kernels.cpu import int8dot, ops, quant

# The matrices of a layer, in the order of `DecodePlan.qtypes` / `rows` columns.
QKV, OUT, GATE_UP, DOWN = 0, 1, 2, 3


@numba.njit(cache=True, nogil=True, error_model="numpy")
def _matmul(qtype, packed, rows, x, flip, n_chunks):
    out = np.empty((x.shape[0], rows), dtype=np.float32)
    int8dot._matmul(qtype, packed, x, out, flip, n_chunks)
    return out


@numba.njit(cache=True, nogil=True, error_model="numpy")
def _layers(x, h, qtypes, rows, flips, w_qkv, w_out, w_gate_up, w_down, ffn_norms, next_norms, eps, k_pools,
            v_pools, slots, positions, cos_table, sin_table, scale, n_q_heads, n_chunks):
    n_seqs = x.shape[0]
    head_dim = k_pools[0].shape[3]
    for li in range(len(w_qkv)):
        qkv = _matmul(qtypes[li, QKV], w_qkv[li], rows[li, QKV], h, flips[li, QKV], n_chunks)
        attn = np.empty((n_seqs, n_q_heads, head_dim), dtype=np.float32)
        ops._attention_decode_qkv_kernel(qkv, False, cos_table, sin_table, k_pools[li], v_pools[li], slots,
                                         positions, scale, attn)
        o = _matmul(qtypes[li, OUT], w_out[li], rows[li, OUT], attn.reshape(n_seqs, n_q_heads * head_dim),
                    flips[li, OUT], n_chunks)
        ops._add_rmsnorm_rows(x, o, ffn_norms[li], eps, h)
        ff = ops._swiglu_stacked_rows(_matmul(qtypes[li, GATE_UP], w_gate_up[li], rows[li, GATE_UP], h,
                                     flips[li, GATE_UP], n_chunks))
        d = _matmul(qtypes[li, DOWN], w_down[li], rows[li, DOWN], ff, flips[li, DOWN], n_chunks)
        ops._add_rmsnorm_rows(x, d, next_norms[li], eps, h)


@numba.njit(cache=True, nogil=True, error_model="numpy")
def _step(tokens, embd_qtype, embd_data, first_norm, out_qtype, out_packed, out_rows, out_flip, qtypes, rows, flips,
          w_qkv, w_out, w_gate_up, w_down, ffn_norms, next_norms, eps, k_pools, v_pools, slots, positions,
          n_rot, freq_base, freq_scale, scale, n_q_heads, n_chunks):
    """The whole decode step: the rotation's angles, embedding rows, the first norm, the layers and the output
    matrix; the logits (B, out_rows)."""
    for t in range(tokens.shape[0]):
        if tokens[t] < 0 or tokens[t] >= embd_data.shape[0]:
            raise IndexError("token id out of range for the embedding")
    cos_table = np.empty((positions.shape[0], n_rot // 2), dtype=np.float32)
    sin_table = np.empty((positions.shape[0], n_rot // 2), dtype=np.float32)
    ops._rope_angles(positions, n_rot, freq_base, freq_scale, cos_table, sin_table)
    x = np.empty((tokens.shape[0], first_norm.shape[0]), dtype=np.float32)
    quant._dequant_rows(embd_qtype, embd_data, tokens, x, quant._N16)
    h = np.empty_like(x)
    ops._rmsnorm_rows(x, first_norm, eps, h)
    _layers(x, h, qtypes, rows, flips, w_qkv, w_out, w_gate_up, w_down, ffn_norms, next_norms, eps, k_pools, v_pools,
            slots, positions, cos_table, sin_table, scale, n_q_heads, n_chunks)
    return _matmul(out_qtype, out_packed, out_rows, h, out_flip, n_chunks)


@dataclass
class DecodeEnds:
    """The embedding and the output matrix, when the compiled step can take them too: a quantized embedding
    (dequantized row by row as `quant.dequantize_rows` does) and an int8-path output matrix."""

    embd_qtype: int
    embd_data: np.ndarray
    first_norm: np.ndarray
    out_qtype: int
    out_packed: np.ndarray
    out_rows: int
    out_flip: np.int32


@dataclass
class DecodePlan:
    """A model's weights as `decode_layers` takes them, built once."""

    qtypes: np.ndarray  # int64 (L, 4)
    rows: np.ndarray  # int64 (L, 4): each matrix's output features
    flips: np.ndarray  # int32 (L, 4): `int8dot._flip` of each matrix
    w_qkv: Any  # typed lists of the packed matrices (int8dot.pack_weight)
    w_out: Any
    w_gate_up: Any
    w_down: Any
    ffn_norms: np.ndarray  # float32 (L, D)
    next_norms: np.ndarray  # float32 (L, D): the next layer's attention norm, the output norm after the last
    head_dim: int
    ends: DecodeEnds | None = None  # set when the whole step, embedding to logits, runs compiled


def build_plan(blocks: list[Any], output_norm: np.ndarray, head_dim: int, int8: bool, tok_embd: Any = None,
               output: Any = None) -> DecodePlan | None:
    """The plan for a llama model's blocks, or None when they are not all of the shape this path serves. With
    the embedding and output matrices given and of a shape it takes, the plan covers the whole step."""
    if not int8 or int8dot.INT8_ISA is None or head_dim % ops.LANES or not blocks:
        return None
    matrices = []
    for blk in blocks:
        layer = (blk.w_qkv, blk.wo, blk.w_gate_up, blk.w_down)
        if any(w is None or getattr(w, "qtype", None) not in int8dot.INT8_TYPES for w in layer):
            return None
        matrices.append(layer)
    lists = [List() for _ in range(4)]
    for layer in matrices:
        for target, w in zip(lists, layer):
            target.append(w.int8_packed)
    ends = None
    if (tok_embd is not None and output is not None and getattr(tok_embd, "qtype", quant.F32) != quant.F32
            and tok_embd.qtype in quant.SUPPORTED_TYPES and getattr(output, "qtype", None) in int8dot.INT8_TYPES):
        ends = DecodeEnds(embd_qtype=tok_embd.qtype, embd_data=tok_embd.data,
                          first_norm=np.asarray(blocks[0].attn_norm, dtype=np.float32), out_qtype=output.qtype,
                          out_packed=output.int8_packed, out_rows=output.rows,
                          out_flip=np.int32(int8dot._flip(output.qtype, int8dot.INT8_ISA)))
    return DecodePlan(
        ends=ends,
        qtypes=np.array([[w.qtype for w in layer] for layer in matrices], dtype=np.int64),
        rows=np.array([[w.rows for w in layer] for layer in matrices], dtype=np.int64),
        flips=np.array([[int8dot._flip(w.qtype, int8dot.INT8_ISA) for w in layer] for layer in matrices],
                       dtype=np.int32),
        w_qkv=lists[0], w_out=lists[1], w_gate_up=lists[2], w_down=lists[3],
        ffn_norms=np.stack([np.asarray(blk.ffn_norm, dtype=np.float32) for blk in blocks]),
        next_norms=np.stack([np.asarray(b.attn_norm, dtype=np.float32) for b in blocks[1:]]
                            + [np.asarray(output_norm, dtype=np.float32)]),
        head_dim=head_dim,
    )


def kernel_pools(pools: list[np.ndarray]) -> Any:
    """One layer list of KV caches as the kernels take them (a typed list of `ops.kernel_view`s)."""
    views = List()
    for pool in pools:
        views.append(ops.kernel_view(pool))
    return views


def _rows(head_dim: int, slots: np.ndarray, positions: np.ndarray, n_rot: int, freq_base: float,
          freq_scale: float) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """A step's slots and positions as int32, and the rotation's angle tables for them."""
    ops._check_n_rot(n_rot, head_dim)
    slots, positions = np.asarray(slots, dtype=np.int32), np.asarray(positions, dtype=np.int32)
    return (slots, positions, *ops._angle_tables(positions, n_rot, float(freq_base), float(freq_scale)))


def decode_layers(plan: DecodePlan, x: np.ndarray, h: np.ndarray, eps: float, k_pools: Any, v_pools: Any,
                  slots: np.ndarray, positions: np.ndarray, n_q_heads: int, n_rot: int, freq_base: float,
                  freq_scale: float, scale: float, threads: int) -> None:
    """Every layer of a decode step (one token per sequence, distinct slots): x (B, D) the residual stream and
    h (B, D) its first attention norm on entry; on return x is the last layer's residual and h its output
    norm. k_pools / v_pools from `kernel_pools`. Rotation as `ops.rope_qkv_into_cache` with neox False."""
    slots, positions, cos_table, sin_table = _rows(plan.head_dim, slots, positions, n_rot, freq_base, freq_scale)
    _layers(x, h, plan.qtypes, plan.rows, plan.flips, plan.w_qkv, plan.w_out, plan.w_gate_up, plan.w_down,
            plan.ffn_norms, plan.next_norms, float(eps), k_pools, v_pools, slots, positions, cos_table,
            sin_table, float(scale), n_q_heads, 4 * threads)


def decode_step(plan: DecodePlan, tokens: np.ndarray, eps: float, k_pools: Any, v_pools: Any, slots: np.ndarray,
                positions: np.ndarray, n_q_heads: int, n_rot: int, freq_base: float, freq_scale: float, scale: float,
                threads: int) -> np.ndarray:
    """A whole decode step in one compiled call (plan.ends set): token ids (B,) -> logits (B, output rows), as
    the embedding, `decode_layers` and the output matmul give them. Raises IndexError for a token id outside the
    embedding, ValueError for a slot or position outside the caches or two rows on one slot."""
    ends = plan.ends
    ops._check_n_rot(n_rot, plan.head_dim)
    # The angle tables are made inside the compiled step: this Python runs cache-cold after every step.
    return _step(np.ascontiguousarray(tokens, dtype=np.int64), ends.embd_qtype, ends.embd_data, ends.first_norm,
                 ends.out_qtype, ends.out_packed, ends.out_rows, ends.out_flip, plan.qtypes, plan.rows, plan.flips,
                 plan.w_qkv, plan.w_out, plan.w_gate_up, plan.w_down, plan.ffn_norms, plan.next_norms, float(eps),
                 k_pools, v_pools, np.asarray(slots, dtype=np.int32), np.asarray(positions, dtype=np.int32), n_rot,
                 float(freq_base), float(freq_scale), float(scale), n_q_heads, 4 * threads)
