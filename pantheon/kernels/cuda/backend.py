"""The cuda backend: the ops of pantheon.kernels.backend.Backend on numba device arrays, on one die.

Weights stay in their GGUF block format in device memory (`quant.CudaWeight`); activations, KV pools and
every array the model holds are numba device arrays (C-contiguous, so model code may reshape and slice them).
All work is queued on one stream per backend; `to_host` is the only synchronisation point of a step.

Host arrays are accepted wherever the protocol takes ids or positions: they are checked on the host (a bad
slot, position or token id raises as on the cpu backend) and uploaded. Device arrays cannot be checked without
a sync, so the kernels skip (kv_write) or NaN-fill (embed, decode attention) what falls outside.

KV rings (`kv_pool`) are charged to the die. A ring that does not fit (device out of memory, or the die's
budget spent) is made in host memory instead: that layer's cache writes and attention then run on the host
(the cpu backend's float32 kernels, the same tokens), `heal_rings` retries the device allocation on a bounded
backoff, and `attention_residency` reports it all (see residency.py).
"""

from __future__ import annotations

import contextlib
import functools
import threading
import weakref
from collections.abc import Iterator
from typing import Any

import numpy as np

from pantheon.errors import ModelLoadError
from pantheon.io.gguf_file import GGUFFile
from pantheon.kernels.backend import checked_row_run
from pantheon.kernels.cpu import ops as host_ops
from pantheon.kernels.cpu.moe import ExpertWeights, stacked_experts
from pantheon.kernels.cuda import decode_step, hybrid_step, moe, ops, quant, ssm
from pantheon.kernels.cuda.dies import DieBudgetExceeded, DieManager
from pantheon.kernels.cuda.graphs import CaptureLayer, GraphResidency, default_capture_layer
from pantheon.kernels.cuda.launch import GEOMETRY, MAX_HEAD_DIM, SIMULATOR, Geometry, cuda
from pantheon.kernels.cuda.quant import CudaWeight
from pantheon.kernels.cuda.residency import AttentionResidency

F32 = 0

# The die whose context each thread has current (set by CudaBackend._activate); shared by every backend, since a
# worker thread may run steps of models on different dies.
_thread_die = threading.local()

CUDA_ERROR_OUT_OF_MEMORY = 2


def current_die() -> int | None:
    """The die whose context the calling thread has current (None before any backend made one current)."""
    return getattr(_thread_die, "die", None)


def _on_its_die(cls: type) -> type:
    """Every public method of `cls` first makes the backend's die current on the calling thread.

    A model over several dies (segments.py) calls its layers' backends in turn, at load (weights, norms, rings)
    and in a forward pass; an allocation, copy or launch made while another die's context is current would
    land on that die, or queue on a stream of another context. Checking costs a thread-local read when the die
    is already current, which it is for all but the first call after a switch."""
    for name, member in list(vars(cls).items()):
        if name.startswith("_") or not callable(member) or isinstance(member, (staticmethod, classmethod)):
            continue

        def on_die(self: Any, *args: Any, _method: Any = member, **kwargs: Any) -> Any:
            self._activate()
            return _method(self, *args, **kwargs)

        setattr(cls, name, functools.wraps(member)(on_die))
    return cls


@contextlib.contextmanager
def _out_of_memory_is_memory_error(what: str) -> Iterator[None]:
    """A failed device allocation raises MemoryError (the model manager answers 507), like a host one."""
    try:
        yield
    except Exception as exc:
        code = getattr(exc, "code", None)
        if code is not None and int(code) == CUDA_ERROR_OUT_OF_MEMORY:
            raise MemoryError(f"{what}: out of device memory") from exc
        raise


@_on_its_die
class CudaBackend:
    name = "cuda"
    accelerator = True
    kv_dtype = np.dtype(np.float32)

    def __init__(self, die: int = 0, die_manager: DieManager | None = None, owner: str = "",
                 geometry: Geometry = GEOMETRY, capture: CaptureLayer | None = None) -> None:
        """A backend whose arrays live on `die` (an ordinal of the die manager; CUDA_VISIBLE_DEVICES-relative).

        `owner` names the model in the die manager's accounting of weight bytes."""
        self.die = int(die)
        self.die_manager = die_manager
        self.owner = owner
        self.geometry = geometry
        self._activate()
        self.stream = cuda.stream()
        self._placeholder = cuda.to_device(np.zeros((1, 1), np.float32), stream=self.stream)
        self._dummy_ids = cuda.to_device(np.zeros(1, np.int32), stream=self.stream)
        self._scratch = ops.DecodeScratch()
        # The split-K partials are one buffer: two threads' attention calls must not interleave their launches.
        self._attention_lock = threading.Lock()
        self.weight_bytes = 0
        self.graphs = GraphResidency(capture if capture is not None else default_capture_layer())
        self.attention_residency = AttentionResidency()

    # -- weights and memory --------------------------------------------------------------------------------
    def weight(self, gguf: GGUFFile, name: str) -> CudaWeight:
        info = gguf.tensors[name]
        try:
            nbytes = info.rows * quant.row_bytes(int(info.qtype), info.rows, info.cols)
        except ValueError as exc:  # UnsupportedTensorType included
            raise ModelLoadError(f"{gguf.path}: tensor {name!r}: {exc}") from None
        self._charge(nbytes, name)
        try:
            with _out_of_memory_is_memory_error(name):
                w = quant.upload_weight(gguf.tensor_bytes(name), info.qtype, info.rows, info.cols,
                                        self._placeholder, self.stream)
        except ValueError as exc:
            self._release(nbytes)
            raise ModelLoadError(f"{gguf.path}: tensor {name!r}: {exc}") from None
        return w

    def weight_from_raw(self, raw: np.ndarray, qtype: int, rows: int, cols: int) -> CudaWeight:
        """A matrix from GGUF-format bytes built in memory (quantize-at-load), copied to the device as is."""
        try:
            nbytes = int(rows) * quant.row_bytes(int(qtype), int(rows), int(cols))
        except ValueError as exc:
            raise ModelLoadError(f"in-memory tensor: {exc}") from None
        self._charge(nbytes, "in-memory tensor")
        try:
            with _out_of_memory_is_memory_error("in-memory tensor"):
                return quant.upload_weight(raw, qtype, rows, cols, self._placeholder, self.stream)
        except ValueError as exc:
            self._release(nbytes)
            raise ModelLoadError(f"in-memory tensor: {exc}") from None

    def weight_rows(self, w: CudaWeight, rows: np.ndarray) -> CudaWeight:
        """Rows `rows` of a matrix: a device view when they are one ascending run, else a device-side copy of
        those rows' blocks (charged to the die)."""
        rows, start = checked_row_run(rows, w.rows)
        if start is not None:
            data = w.data[start : start + len(rows)]
        else:
            self._charge(len(rows) * int(w.data.shape[1]), "row selection")
            data = ops.gather_rows(w.data, self.upload(rows), self.stream, self.geometry)
        f32 = data.view(np.float32) if w.qtype == F32 else self._placeholder
        return CudaWeight(w.qtype, len(rows), w.cols, data, data.view(np.float16), f32)

    @staticmethod
    def experts(w: CudaWeight, n_experts: int, split: int = 1, part: int = 0) -> ExpertWeights:
        try:
            return stacked_experts(w, n_experts, split, part)
        except ValueError as exc:
            raise ModelLoadError(str(exc)) from None

    def vector(self, gguf: GGUFFile, name: str) -> Any:
        """A small tensor (norm weights) as float32 on the device; quantized ones are dequantized on the host."""
        info = gguf.tensors[name]
        if info.qtype == F32:
            host = np.ascontiguousarray(gguf.tensor_bytes(name)).view(np.float32)
        else:
            from pantheon.kernels.cpu import quant as cpu_quant

            w = cpu_quant.prepare_weight(gguf.tensor_bytes(name), info.qtype, info.rows, info.cols)
            host = cpu_quant.dequantize_rows(w, np.arange(w.rows, dtype=np.int64)).reshape(-1)
        self._charge(host.nbytes, name)
        return cuda.to_device(host, stream=self.stream)

    def _charge(self, nbytes: int, what: str) -> None:
        if self.die_manager is not None:
            try:
                self.die_manager.charge(self.die, self.owner, nbytes)
            except DieBudgetExceeded as exc:
                raise MemoryError(f"{what}: {exc}") from None
        self.weight_bytes += nbytes

    def _release(self, nbytes: int) -> None:
        if self.die_manager is not None:
            self.die_manager.release(self.die, self.owner, nbytes)
        self.weight_bytes -= nbytes

    def close(self) -> None:
        """Give this backend's weight bytes back to the die manager (the arrays go with their last reference)."""
        if self.weight_bytes:
            self._release(self.weight_bytes)

    def die_status(self) -> list[dict[str, Any]]:
        """`/admin/dies` rows from the die manager (die, card, vram_budget, vram_used)."""
        return self.die_manager.status() if self.die_manager is not None else []

    def zeros(self, shape: tuple[int, ...], dtype: Any = np.float32) -> Any:
        return ops.fill(self.empty(shape, dtype), 0, self.stream, self.geometry)

    def kv_pool(self, n_slots: int, ctx_cap: int, n_kv_heads: int, head_dim: int, dtype: Any) -> Any:
        """A layer's K or V ring on the die, or in host memory when it cannot be allocated there."""
        shape = (n_slots, ctx_cap, n_kv_heads, head_dim)
        if head_dim <= MAX_HEAD_DIM:
            try:
                return self._device_ring(shape, dtype)
            except MemoryError:
                placed = self.attention_residency.ring_failed
        else:
            placed = self.attention_residency.impossible_ring
        host = np.zeros(shape, np.dtype(dtype))
        placed(host)
        return host

    def _device_ring(self, shape: tuple[int, ...], dtype: Any) -> Any:
        """A zeroed device ring charged to the die (released when the ring is garbage); MemoryError when the
        die's budget or its memory does not have it."""
        nbytes = int(np.prod(shape)) * np.dtype(dtype).itemsize
        if self.die_manager is not None:
            try:
                self.die_manager.charge(self.die, self.owner, nbytes)
            except DieBudgetExceeded as exc:
                raise MemoryError(f"KV ring: {exc}") from None
        try:
            ring = self.zeros(shape, dtype)
        except MemoryError:
            self._release_ring(nbytes)
            raise
        try:
            weakref.finalize(ring, self._release_ring, nbytes)
        except TypeError:  # an array type without weak references: the charge stays until the model unloads
            self.weight_bytes += nbytes
        return ring

    def _release_ring(self, nbytes: int) -> None:
        if self.die_manager is not None:
            self.die_manager.release(self.die, self.owner, nbytes)

    def heal_rings(self, k_pools: list[Any], v_pools: list[Any]) -> None:
        """At the start of a forward pass: a layer with a ring in host memory gets both rings there (its
        attention needs them in one place), and once its retry is due, both back on the die with their
        contents, if they fit now."""
        residency = self.attention_residency
        if not residency.any_host_rings:  # every ring is on the die (each forward asks: keep it one test)
            return
        for li, (k, v) in enumerate(zip(k_pools, v_pools)):
            k_host, v_host = isinstance(k, np.ndarray), isinstance(v, np.ndarray)
            if k is None or not (k_host or v_host):
                continue
            if not k_host:
                k_pools[li] = k = self.to_host(k)
                residency.host_ring(k)
            if not v_host:
                v_pools[li] = v = self.to_host(v)
                residency.host_ring(v)
            if not residency.due_for_retry(k):
                continue
            try:
                k_dev = self._device_ring(k.shape, k.dtype)
                v_dev = self._device_ring(v.shape, v.dtype)
            except MemoryError:
                residency.retry_failed(k)
                continue
            k_dev.copy_to_device(k, stream=self.stream)
            v_dev.copy_to_device(v, stream=self.stream)
            k_pools[li], v_pools[li] = k_dev, v_dev
            residency.moved_to_die(k, k_dev)
            residency.forget_host_ring(v)

    def empty(self, shape: tuple[int, ...], dtype: Any = np.float32) -> Any:
        with _out_of_memory_is_memory_error(f"array {tuple(shape)}"):
            return cuda.device_array(shape, dtype=dtype, stream=self.stream)

    def copy_kv_rows(self, pool: Any, src: int, dst: int, n: int) -> None:
        """pool[dst, :n] = pool[src, :n], device to device (both runs are contiguous: (S, ctx, H, hd) pools)."""
        if n > 0 and isinstance(pool, np.ndarray):
            pool[dst, :n] = pool[src, :n]
        elif n > 0:
            pool[dst, :n].copy_to_device(pool[src, :n], stream=self.stream)

    def upload(self, host: np.ndarray) -> Any:
        return cuda.to_device(np.ascontiguousarray(host), stream=self.stream)

    def to_host(self, array: Any) -> np.ndarray:
        if isinstance(array, np.ndarray):
            return array
        host = array.copy_to_host(stream=self.stream)
        self.stream.synchronize()
        return host

    def synchronize(self) -> None:
        self.stream.synchronize()

    def begin_step(self) -> None:
        self._activate()

    def _activate(self) -> None:
        """Make this backend's die current on the calling thread (steps run on trio's worker threads). The
        simulator has one context for every die; it only records which die the thread is on (`current_die`)."""
        if getattr(_thread_die, "die", None) == self.die:
            return
        if not SIMULATOR:
            from numba.cuda.cudadrv import devices
            from numba.cuda.cudadrv.driver import driver

            # Set, not push: a worker thread that ran another die's step before must not grow its context stack.
            context = devices.gpus[self.die].get_primary_context()
            driver.cuCtxSetCurrent(context.handle)
            context.prepare_for_use()
        _thread_die.die = self.die

    # -- ops -----------------------------------------------------------------------------------------------
    def matmul(self, w: CudaWeight, x: Any, out: Any = None) -> Any:
        return quant.matmul(w, self._device(x), out, self.stream, self.geometry)

    def embed(self, w: CudaWeight, ids: Any) -> Any:
        if isinstance(ids, np.ndarray):
            ids = self._checked(ids, 0, w.rows, "token id")
        return quant.embed(w, ids, self.stream, self.geometry)

    def split_cols(self, x: Any, widths: tuple[int, ...]) -> list[Any]:
        return ops.split_cols(self._device(x), widths, self.stream, self.geometry)

    def gather_rows(self, x: Any, rows: Any) -> Any:
        if isinstance(rows, np.ndarray):
            rows = self._checked(rows, 0, x.shape[0], "row")
        return ops.gather_rows(x, rows, self.stream, self.geometry)

    def rmsnorm(self, x: Any, weight: Any, eps: float, out: Any = None) -> Any:
        return ops.rmsnorm(self._device(x), weight, eps, out, self.stream, self.geometry)

    def add_rmsnorm(self, residual: Any, delta: Any, weight: Any, eps: float, out: Any) -> None:
        ops.add_rmsnorm(residual, delta, weight, eps, out, self.stream, self.geometry)

    def rope_inplace(self, x: Any, positions: Any, n_rot: int, freq_base: float, neox: bool,
                     freq_scale: float = 1.0) -> None:
        ops.rope_inplace(x, self._device(positions), n_rot, freq_base, neox, freq_scale, self.stream, self.geometry)

    def swiglu(self, gate: Any, up: Any, out: Any = None) -> Any:
        return ops.swiglu(gate, up, out, self.stream, self.geometry)

    def kv_write(self, pool: Any, slots: Any, positions: Any, values: Any) -> None:
        if isinstance(pool, np.ndarray):  # a host ring
            host_ops.kv_write(pool, self._host_ints(slots), self._host_ints(positions),
                              np.ascontiguousarray(self.to_host(values), dtype=np.float32))
            return
        if isinstance(slots, np.ndarray):
            slots = self._checked(slots, 0, pool.shape[0], "slot")
        if isinstance(positions, np.ndarray):
            positions = self._checked(positions, 0, pool.shape[1], "position")
        ops.kv_write(pool, slots, positions, values, self.stream, self.geometry)

    def attention(self, q: Any, k_pool: Any, v_pool: Any, slot: int, start_pos: int, scale: float,
                  out: Any = None) -> Any:
        on_host = isinstance(k_pool, np.ndarray)
        self.attention_residency.reached(k_pool, on_host)
        if on_host:
            host = host_ops.attention(self._host_f32(q), k_pool[slot], v_pool[slot], int(start_pos), scale)
            return self._device_result(host, out)
        with self._attention_lock:
            return ops.attention(q, k_pool, v_pool, int(slot), int(start_pos), scale, out, self._scratch,
                                 self._dummy_ids, self.stream, self.geometry)

    def attention_decode_batch(self, q: Any, k_pool: Any, v_pool: Any, positions: Any, scale: float,
                               out: Any = None, *, slot_ids: Any) -> Any:
        on_host = isinstance(k_pool, np.ndarray)
        self.attention_residency.reached(k_pool, on_host)
        if on_host:
            host = host_ops.attention_decode_batch(self._host_f32(q), k_pool, v_pool, self._host_ints(positions),
                                                   scale, slot_ids=self._host_ints(slot_ids))
            return self._device_result(host, out)
        if isinstance(slot_ids, np.ndarray):
            slot_ids = self._checked(slot_ids, 0, k_pool.shape[0], "slot id", ValueError)
        if isinstance(positions, np.ndarray):
            positions = self._checked(positions, 0, k_pool.shape[1], "position", ValueError)
        with self._attention_lock:
            return ops.attention_decode_batch(q, k_pool, v_pool, positions, scale, out, slot_ids=slot_ids,
                                              scratch=self._scratch, stream=self.stream, geometry=self.geometry)

    # -- the llama decode step, layer by layer through graph slots (decode_step.py) ----------------------------
    def decode_plan(self, blocks: list[Any], output_norm: Any, head_dim: int, tok_embd: Any = None,
                    output: Any = None) -> decode_step.CudaDecodePlan | None:
        if tok_embd is None or output is None:
            return None
        return decode_step.CudaDecodePlan(blocks, output_norm, head_dim, tok_embd, output)

    @staticmethod
    def kernel_pools(pools: list[Any]) -> list[Any]:
        """The model's own list: `heal_rings` replaces its entries, and the step sees them."""
        return pools

    def decode_step(self, plan: decode_step.CudaDecodePlan, tokens: np.ndarray, eps: float, k_pools: list[Any],
                    v_pools: list[Any], slots: np.ndarray, positions: np.ndarray, n_q_heads: int, n_rot: int,
                    freq_base: float, freq_scale: float, scale: float) -> np.ndarray:
        return decode_step.run_step(self, plan, tokens, eps, k_pools, v_pools, slots, positions, n_q_heads, n_rot,
                                    freq_base, freq_scale, scale)

    def hybrid_decode_plan(self, model: Any) -> hybrid_step.HybridDecodePlan:
        """A Qwen3.5-family model's decode steps, layer by layer through graph slots (hybrid_step.py)."""
        return hybrid_step.HybridDecodePlan(model)

    def hybrid_decode_step(self, plan: hybrid_step.HybridDecodePlan, state: Any, tokens: np.ndarray,
                           slots: np.ndarray, positions: np.ndarray) -> np.ndarray:
        return hybrid_step.run_step(self, plan, state, tokens, slots, positions)

    # -- hybrid (Gated DeltaNet) and MoE layers ---------------------------------------------------------------
    def causal_conv1d(self, x: Any, states: Any, weight: Any, slot_ids: Any, out: Any = None) -> Any:
        return ssm.causal_conv1d(x, states, weight, slot_ids, out, self.stream, self.geometry)

    def gdn_gates(self, b: Any, alpha: Any, a: Any, dt_bias: Any) -> tuple[Any, Any]:
        return ssm.gdn_gates(b, alpha, a, dt_bias, self.stream, self.geometry)

    def gated_delta_recurrent(self, q: Any, k: Any, v: Any, g: Any, beta: Any, states: Any, slot_ids: Any,
                              key_head: Any, scale: float, eps: float, out: Any = None) -> Any:
        return ssm.gated_delta(q, k, v, g, beta, states, slot_ids, key_head, scale, eps, out,
                               "gated_delta_recurrent", self.stream, self.geometry)

    def gated_delta_chunked(self, q: Any, k: Any, v: Any, g: Any, beta: Any, states: Any, slot_ids: Any,
                            key_head: Any, scale: float, eps: float, out: Any = None) -> Any:
        # The column-parallel kernel serves both forms (see pantheon.kernels.cuda.ssm).
        return ssm.gated_delta(q, k, v, g, beta, states, slot_ids, key_head, scale, eps, out,
                               "gated_delta_chunked", self.stream, self.geometry)

    def gated_rmsnorm(self, x: Any, z: Any, weight: Any, eps: float, out: Any = None) -> Any:
        return ssm.gated_rmsnorm(x, z, weight, eps, out, self.stream, self.geometry)

    def sigmoid_mul(self, x: Any, gate: Any, out: Any = None) -> Any:
        return ssm.sigmoid_mul(x, gate, out, self.stream, self.geometry)

    def moe_route(self, logits: Any, k: int) -> tuple[Any, Any]:
        return moe.moe_route(self._device(logits), k, self.stream, self.geometry)

    def moe_ffn(self, x: Any, gate: ExpertWeights, up: ExpertWeights, down: ExpertWeights, ids: Any, weights: Any,
                out: Any) -> Any:
        for experts in (gate, up, down):
            if experts.weight.qtype not in quant.SUPPORTED_TYPES:
                raise quant.UnsupportedTensorType(f"ggml tensor type {experts.weight.qtype} is not supported")
        ids_host = np.asarray(self.to_host(ids))  # the grouping by expert runs on the host (a sync)
        return moe.moe_ffn(x, gate, up, down, ids, self._device(weights), out, ids_host, self.stream, self.geometry)

    # -- helpers -------------------------------------------------------------------------------------------
    def _host_ints(self, values: Any) -> np.ndarray:
        return np.ascontiguousarray(self.to_host(values)).astype(np.int32)

    def _host_f32(self, array: Any) -> np.ndarray:
        return np.ascontiguousarray(self.to_host(array), dtype=np.float32)

    def _device_result(self, host: np.ndarray, out: Any) -> Any:
        if out is None:
            return self.upload(host)
        out.copy_to_device(np.ascontiguousarray(host, dtype=np.float32), stream=self.stream)
        return out

    def _device(self, array: Any) -> Any:
        return self.upload(array) if isinstance(array, np.ndarray) else array

    def _checked(self, values: np.ndarray, lo: int, hi: int, what: str, error: type[Exception] = IndexError) -> Any:
        """Upload ids or positions after checking them on the host (errors as the cpu backend raises them)."""
        if values.ndim != 1 or values.dtype.kind not in "iu":
            raise ValueError(f"{what}s must be a 1-D integer array, got {values.dtype} {values.shape}")
        if values.size and (int(values.min()) < lo or int(values.max()) >= hi):
            bad = int(values.min()) if int(values.min()) < lo else int(values.max())
            raise error(f"{what} {bad} outside [{lo}, {hi})")
        return self.upload(values.astype(np.int32 if what != "token id" else np.int64))


__all__ = ["CudaBackend", "current_die"]
