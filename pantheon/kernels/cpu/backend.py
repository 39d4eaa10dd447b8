"""The cpu backend: numba kernels over GGUF blocks kept in their on-disk format (mmapped, never copied), except
that with int8 activations each matrix of a type with int8 kernels (`quant.INT8_KERNEL_TYPES`) is rearranged
once into their layout (a copy of about the same size, `QWeight.int8_packed`, made by the load's warm-up; the
mmapped original then goes cold)."""

from __future__ import annotations

import mmap
import threading
from typing import Any

import numba
import numpy as np

from pantheon.errors import ModelLoadError
from pantheon.io.gguf_file import GGUFFile
from pantheon.kernels.backend import checked_row_run
from pantheon.kernels.cpu import decode_layers, int8dot, moe, ops, quant, ssm
from pantheon.kernels.cpu.moe import ExpertWeights
from pantheon.kernels.cpu.quant import QWeight

F32 = 0


# Per thread: the numba thread count the cpu backends last set there (see `CpuBackend.begin_step`).
_thread_settings = threading.local()


class CpuBackend:
    name = "cpu"
    accelerator = False

    def __init__(self, threads: int = 0, int8: bool = False) -> None:
        self.threads = min(threads, numba.config.NUMBA_NUM_THREADS) if threads > 0 else numba.config.NUMBA_NUM_THREADS
        # int8 activations for Q4_1 / Q8_0 weights where the CPU has the instructions (quant.matmul).
        self.int8 = int8 and int8dot.INT8_ISA is not None
        # The KV cache in float16 goes with the int8 arithmetic, as in llama.cpp: half the bytes that decode
        # attention streams from memory (it misses cache every layer at batch 8) and half the session memory.
        # The float path keeps float32 everywhere.
        self.kv_dtype = np.dtype(np.float16 if self.int8 and ops.HAS_F16C else np.float32)

    # -- weights -------------------------------------------------------------------------------------------
    def weight(self, gguf: GGUFFile, name: str) -> QWeight:
        info = gguf.tensors[name]
        try:
            return quant.prepare_weight(gguf.tensor_bytes(name), info.qtype, info.rows, info.cols)
        except ValueError as exc:  # UnsupportedTensorType included
            raise ModelLoadError(f"{gguf.path}: tensor {name!r}: {exc}") from None

    @staticmethod
    def weight_from_raw(raw: np.ndarray, qtype: int, rows: int, cols: int) -> QWeight:
        """A matrix from bytes built in memory (e.g. quantized at load)."""
        return quant.prepare_weight(raw, qtype, rows, cols)

    def vector(self, gguf: GGUFFile, name: str) -> np.ndarray:
        """A small 1-D tensor (norm weights) as float32."""
        info = gguf.tensors[name]
        if info.qtype == F32:
            return gguf.tensor_bytes(name).view(np.float32)
        w = quant.prepare_weight(gguf.tensor_bytes(name), info.qtype, info.rows, info.cols)
        return quant.dequantize_rows(w, np.arange(w.rows, dtype=np.int64)).reshape(-1)

    @staticmethod
    def weight_rows(w: QWeight, rows: np.ndarray) -> QWeight:
        """Rows `rows` of a matrix: a view when they are one ascending run, else a copy of those rows' blocks."""
        rows, start = checked_row_run(rows, w.rows)
        if start is not None:
            data = w.data[start : start + len(rows)]
        else:
            data = np.ascontiguousarray(w.data[rows])
            data.flags.writeable = False
        return QWeight(w.qtype, len(rows), w.cols, data)

    @staticmethod
    def experts(w: QWeight, n_experts: int, split: int = 1, part: int = 0) -> ExpertWeights:
        try:
            return moe.stacked_experts(w, n_experts, split, part)
        except ValueError as exc:
            raise ModelLoadError(str(exc)) from None

    # -- per-step ------------------------------------------------------------------------------------------
    def begin_step(self) -> None:
        # numba's thread count is per calling thread (steps may run on other threads than the load's). Setting
        # it costs ~20 us of a decode step in place (the call is cache-cold after a step), so it is set only
        # when this thread's last setting differs; only the cpu backends set it.
        if getattr(_thread_settings, "threads", None) != self.threads:
            numba.set_num_threads(self.threads)
            _thread_settings.threads = self.threads

    def zeros(self, shape: tuple[int, ...], dtype: type = np.float32) -> np.ndarray:
        return np.zeros(shape, dtype=dtype)

    def empty(self, shape: tuple[int, ...], dtype: type = np.float32) -> np.ndarray:
        return np.empty(shape, dtype=dtype)

    @staticmethod
    def kv_pool(n_slots: int, ctx_cap: int, n_kv_heads: int, head_dim: int, dtype: Any) -> np.ndarray:
        """A layer's K or V cache for every slot, indexed [slot, position, kv head, :] like any backend's, but
        stored head-major (slot, kv head, position, :): decode attention walks one kv head's keys of one
        sequence, which are then contiguous instead of a row apart. The kernels take the strided view (the
        attention intrinsics read its strides). Measured: 30 layers of batch-8 attention from memory, context
        1000: 20.0 -> 14.2 ms; context 100: 2.20 -> 2.03 ms."""
        shape = (n_slots, n_kv_heads, ctx_cap, head_dim)
        nbytes = int(np.prod(shape)) * np.dtype(dtype).itemsize
        if nbytes == 0:
            return np.zeros(shape, dtype=dtype).transpose(0, 2, 1, 3)
        # Anonymous pages, zero-filled by the kernel on first touch. np.zeros (calloc, which numpy marks for
        # huge pages) made the first prefill into each fresh slot take 180-340 ms instead of 23 ms here: with
        # the heads a megabyte apart, a 35-token prompt touched ~150 fresh 2 MB pages.
        buf = mmap.mmap(-1, nbytes)
        return np.frombuffer(buf, dtype=dtype).reshape(shape).transpose(0, 2, 1, 3)

    @staticmethod
    def copy_kv_rows(pool: np.ndarray, src: int, dst: int, n: int) -> None:
        """pool[dst, :n] = pool[src, :n] (a slot's first n positions into another slot)."""
        pool[dst, :n] = pool[src, :n]

    @staticmethod
    def upload(host: np.ndarray) -> np.ndarray:
        return host

    @staticmethod
    def to_host(array: np.ndarray) -> np.ndarray:
        return array

    @staticmethod
    def split_cols(x: np.ndarray, widths: tuple[int, ...]) -> list[np.ndarray]:
        """Consecutive column blocks of x (T, sum(widths)), each contiguous (views when T == 1)."""
        out, start = [], 0
        for width in widths:
            out.append(np.ascontiguousarray(x[:, start : start + width]))
            start += width
        return out

    @staticmethod
    def concat_cols(parts: list[np.ndarray]) -> np.ndarray:
        """The parts (T, w_i) side by side: (T, sum(w_i)), contiguous."""
        return np.concatenate(parts, axis=1)

    @staticmethod
    def gather_rows(x: np.ndarray, rows: np.ndarray) -> np.ndarray:
        return np.ascontiguousarray(x[rows])

    @staticmethod
    def attention(q: np.ndarray, k_pool: np.ndarray, v_pool: np.ndarray, slot: int, start_pos: int, scale: float,
                  out: np.ndarray | None = None) -> np.ndarray:
        return ops.attention(q, k_pool[slot], v_pool[slot], start_pos, scale, out)

    def without_int8(self) -> "CpuBackend":
        """The same backend with every activation kept in float32 (for models that need that arithmetic)."""
        return CpuBackend(self.threads, int8=False)

    def matmul(self, w: QWeight, x: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
        return quant.matmul(w, x, out, int8=self.int8, threads=self.threads)

    def decode_plan(self, blocks: list[Any], output_norm: np.ndarray, head_dim: int, tok_embd: Any = None,
                    output: Any = None) -> Any:
        """The weights of a llama model's layers for `decode_layers` (and, where it can take them, its
        embedding and output matrix for `decode_step`), or None when its shape is not served."""
        return decode_layers.build_plan(blocks, output_norm, head_dim, self.int8, tok_embd, output)

    kernel_pools = staticmethod(decode_layers.kernel_pools)

    def decode_layers(self, plan: Any, x: np.ndarray, h: np.ndarray, eps: float, k_pools: Any, v_pools: Any,
                      slots: np.ndarray, positions: np.ndarray, n_q_heads: int, n_rot: int, freq_base: float,
                      freq_scale: float, scale: float) -> None:
        decode_layers.decode_layers(plan, x, h, eps, k_pools, v_pools, slots, positions, n_q_heads, n_rot,
                                    freq_base, freq_scale, scale, self.threads)

    def decode_step(self, plan: Any, tokens: np.ndarray, eps: float, k_pools: Any, v_pools: Any, slots: np.ndarray,
                    positions: np.ndarray, n_q_heads: int, n_rot: int, freq_base: float, freq_scale: float,
                    scale: float) -> np.ndarray:
        return decode_layers.decode_step(plan, tokens, eps, k_pools, v_pools, slots, positions, n_q_heads, n_rot,
                                         freq_base, freq_scale, scale, self.threads)

    embed = staticmethod(quant.dequantize_rows)
    rmsnorm = staticmethod(ops.rmsnorm)
    add_rmsnorm = staticmethod(ops.add_rmsnorm)
    rope_inplace = staticmethod(ops.rope_inplace)
    kv_write = staticmethod(ops.kv_write)
    swiglu = staticmethod(ops.swiglu)
    rope_qkv_into_cache = staticmethod(ops.rope_qkv_into_cache)
    swiglu_stacked = staticmethod(ops.swiglu_stacked)
    attention_decode_batch = staticmethod(ops.attention_decode_batch)
    attention_decode_qkv = staticmethod(ops.attention_decode_qkv)
    causal_conv1d = staticmethod(ssm.causal_conv1d)
    gdn_gates = staticmethod(ssm.gdn_gates)
    gated_delta_recurrent = staticmethod(ssm.gated_delta_recurrent)
    gated_delta_chunked = staticmethod(ssm.gated_delta_chunked)
    gated_rmsnorm = staticmethod(ssm.gated_rmsnorm)
    sigmoid_mul = staticmethod(ssm.sigmoid_mul)
    moe_route = staticmethod(moe.moe_route)
    moe_ffn = staticmethod(moe.moe_ffn)
