"""The ops interface every backend implements; model code calls only these (never numba or numpy-on-device).

Arrays are the backend's own (numpy on the cpu backend, device arrays on cuda): model code may reshape and
slice them (contiguous views) but computes only through these methods. Host data crosses with `upload` and
`to_host`. Shapes use T = tokens in the step, D = model width; float32 everywhere unless stated.
"""

from __future__ import annotations

from typing import Any, Protocol

import numpy as np

from pantheon.errors import ModelLoadError
from pantheon.io.gguf_file import GGUFFile

Array = Any  # numpy.ndarray on cpu, a device array on cuda


def checked_row_run(rows: np.ndarray, n_rows: int) -> tuple[np.ndarray, int | None]:
    """For `weight_rows`: the row ids as int64, checked against a matrix of `n_rows` rows, and the first id
    when they are one ascending run (the selection is then a view), else None (a copy is needed)."""
    rows = np.asarray(rows, dtype=np.int64)
    if rows.ndim != 1 or not len(rows) or rows.min() < 0 or rows.max() >= n_rows:
        raise ModelLoadError(f"row selection outside a weight of {n_rows} rows")
    start = int(rows[0])
    return rows, start if np.array_equal(rows, np.arange(start, start + len(rows))) else None


class Backend(Protocol):
    name: str  # "cpu" | "cuda"
    accelerator: bool  # True when forward passes run on an accelerator
    kv_dtype: np.dtype  # element type of the KV caches models allocate (float32, or float16 on the cpu int8 path)

    # -- weights and memory --------------------------------------------------------------------------------
    def weight(self, gguf: GGUFFile, name: str) -> Any:
        """A matrix (rows x cols) kept in its GGUF block format, for `matmul` and `embed`."""

    def weight_from_raw(self, raw: np.ndarray, qtype: int, rows: int, cols: int) -> Any:
        """A matrix from GGUF-format bytes built in memory (quantize-at-load)."""

    def vector(self, gguf: GGUFFile, name: str) -> Array:
        """A small tensor (norm weights, biases) as float32, flattened."""

    def weight_rows(self, w: Any, rows: np.ndarray) -> Any:
        """The matrix made of rows `rows` (in that order) of a loaded matrix (a view when they are one run)."""

    def experts(self, w: Any, n_experts: int, split: int = 1, part: int = 0) -> Any:
        """A loaded stacked expert tensor (E * rows, cols) for `moe_ffn`; split/part pick a row group of each."""

    def zeros(self, shape: tuple[int, ...], dtype: Any = np.float32) -> Array: ...

    def empty(self, shape: tuple[int, ...], dtype: Any = np.float32) -> Array: ...

    def kv_pool(self, n_slots: int, ctx_cap: int, n_kv_heads: int, head_dim: int, dtype: Any) -> Array:
        """One layer's K or V cache for every slot, zeroed, indexed [slot, position, kv head, :] (its storage
        order is the backend's choice)."""

    def copy_kv_rows(self, pool: Array, src: int, dst: int, n: int) -> None:
        """pool[dst, :n] = pool[src, :n]: a slot's first n positions into another slot (a new conversation that
        starts from the prefix it shares with one its session holds)."""

    def upload(self, host: np.ndarray) -> Array:
        """A host array (token ids, positions, slot ids) as a backend array."""

    def to_host(self, array: Array) -> np.ndarray: ...

    def begin_step(self) -> None:
        """Called at the start of every forward step, on the thread that runs it."""

    # -- ops -----------------------------------------------------------------------------------------------
    def matmul(self, w: Any, x: Array, out: Array | None = None) -> Array:
        """x (T, K) @ W.T -> (T, N). A row's result does not depend on the other rows (batch invariance)."""

    def embed(self, w: Any, ids: Array) -> Array:
        """Rows `ids` of W, dequantized: (len(ids), K)."""

    def split_cols(self, x: Array, widths: tuple[int, ...]) -> list[Array]:
        """Consecutive column blocks of x (T, sum(widths)) as contiguous arrays (optional: model code stacks
        matrices that share an input only on backends that have it)."""

    def gather_rows(self, x: Array, rows: Array) -> Array:
        """x[rows] as a new contiguous array."""

    def rmsnorm(self, x: Array, weight: Array, eps: float, out: Array | None = None) -> Array: ...

    def add_rmsnorm(self, residual: Array, delta: Array, weight: Array, eps: float, out: Array) -> None:
        """residual += delta; out = rmsnorm(residual)."""

    def rope_inplace(self, x: Array, positions: Array, n_rot: int, freq_base: float, neox: bool,
                     freq_scale: float = 1.0) -> None:
        """Rotate the first n_rot dims of every head of x (T, H, hd) by its token's position."""

    def swiglu(self, gate: Array, up: Array, out: Array | None = None) -> Array:
        """silu(gate) * up."""

    def kv_write(self, pool: Array, slots: Array, positions: Array, values: Array) -> None:
        """pool[slots[t], positions[t]] = values[t] for every token t; pool is (S, ctx, H, hd)."""

    # Optional fused forms (the cpu backend has them; model code falls back to split_cols and the ops above):
    #   rope_qkv_into_cache(qkv, n_q_heads, k_pool, v_pool, slots, positions, n_rot, freq_base, neox,
    #                       freq_scale) -> q: the stacked q|k|v projection split, q and k rotated, k and v
    #                       written to the caches, q returned (T, Hq, hd);
    #   swiglu_stacked(gate_up) -> silu(gate) * up of the stacked gate|up projection (T, 2F);
    #   attention_decode_qkv(qkv, n_q_heads, k_pool, v_pool, slots, positions, n_rot, freq_base, neox, scale,
    #                        freq_scale) -> rope_qkv_into_cache then attention_decode_batch for one token per
    #                        sequence (distinct slots), in one launch: the attention output (B, Hq, hd);
    #   decode_plan(blocks, output_norm, head_dim, tok_embd, output) -> a plan or None, with kernel_pools(pools),
    #                        decode_layers(plan, ...) and decode_step(plan, ...): a llama decode step's layers
    #                        (or the whole step, token ids to logits) in one call (cpu: kernels/cpu/decode_layers.py;
    #                        cuda: kernels/cuda/decode_step.py, whole steps only, each layer a CUDA graph slot).

    def attention(self, q: Array, k_pool: Array, v_pool: Array, slot: int, start_pos: int, scale: float,
                  out: Array | None = None) -> Array:
        """Causal GQA of one sequence's T queries (T, Hq, hd) at positions start_pos.. over its slot's cache."""

    def attention_decode_batch(self, q: Array, k_pool: Array, v_pool: Array, positions: Array, scale: float,
                               out: Array | None = None, *, slot_ids: Array) -> Array:
        """One query per sequence (B, Hq, hd); sequence b attends to rows 0..positions[b] of slot slot_ids[b]."""

    # -- hybrid (Gated DeltaNet) and MoE layers: B sequences of L tokens, see kernels/cpu/ssm.py and moe.py ----
    def causal_conv1d(self, x: Array, states: Array, weight: Array, slot_ids: Array,
                      out: Array | None = None) -> Array:
        """silu(depthwise causal conv) of x (B, L, C) continuing conv states (S, K-1, C) in place; weight (C, K)."""

    def gdn_gates(self, b: Array, alpha: Array, a: Array, dt_bias: Array) -> tuple[Array, Array]:
        """(g, beta) = (a * softplus(alpha + dt_bias), sigmoid(b)) for b, alpha (T, Nv)."""

    def gated_delta_recurrent(self, q: Array, k: Array, v: Array, g: Array, beta: Array, states: Array,
                              slot_ids: Array, key_head: Array, scale: float, eps: float,
                              out: Array | None = None) -> Array:
        """Gated delta rule token by token (decode), q/k L2-normalised inside; states (S, Nv, dv, dk) in place."""

    def gated_delta_chunked(self, q: Array, k: Array, v: Array, g: Array, beta: Array, states: Array,
                            slot_ids: Array, key_head: Array, scale: float, eps: float,
                            out: Array | None = None) -> Array:
        """The same rule in chunks of 64 tokens (prefill); equal to the recurrent form up to rounding."""

    def gated_rmsnorm(self, x: Array, z: Array, weight: Array, eps: float, out: Array | None = None) -> Array:
        """rmsnorm(x) * weight * silu(z), row by row (x, z (N, d))."""

    def sigmoid_mul(self, x: Array, gate: Array, out: Array | None = None) -> Array:
        """x * sigmoid(gate), gate (T, N) or (T, 1)."""

    def moe_route(self, logits: Array, k: int) -> tuple[Array, Array]:
        """softmax -> top-k -> renormalise over router logits (T, E): (ids int32 (T, k), weights (T, k))."""

    def moe_ffn(self, x: Array, gate: Any, up: Any, down: Any, ids: Array, weights: Array, out: Array) -> Array:
        """out += the routed SwiGLU experts' weighted sum per token; reads only the selected experts."""
