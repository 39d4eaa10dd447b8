"""A llama decode step on the cuda backend, replayable as CUDA graphs: one graph slot per layer and batch size,
or, for a model over several dies, one per die's run of layers and batch size.

A captured graph replays the kernel launches it recorded, with the pointers and scalars they had then. So every
array a layer's launches touch is allocated once per batch size (`StepBuffers`) and kept, and every value that
changes from step to step (token ids, slots, positions) lives in a small device buffer that the step overwrites
before the layers run. The kernels already take slots and positions from device arrays, and the decode
attention splits the KV for the ring's length, not the step's, so its launch geometry is fixed too.

A step: the host checks and uploads the ids (outside any graph), the embedding and the first norm are launched
directly, then each layer runs through `GraphResidency.run` under the key ("decode", layer, batch size), class
`batched_attn`: replayed once captured, else launched directly with the same kernels in the same order (the
same bits either way). The output matrix is launched directly and its logits copied to the host, the step's
only synchronisation.

A layer whose KV ring lives in host memory (attention residency) runs its cache write and attention on the host,
which needs syncs; its slot is ineligible while that lasts, and eligible again once the ring is back on the die.
A ring that moves (a new state, or one healed onto the die) gets its layer's graphs dropped and captured anew.

Over several dies (segments.py) each die's run of layers is one slot ("segment", segment, batch size), class
`segment`, on that die's graphs; between two runs the residual stream, the normed input and the ids go to the
next die's buffers through the host (`hand_over`), outside the graphs.

`step_ids`, `embed_step`, `run_slot`, `attend`, `step_logits` and `SharedRows` serve the Qwen3.5-family step too
(hybrid_step.py).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from pantheon.kernels.cuda import ops, quant

GRAPH_CLASS = "batched_attn"
SEGMENT_CLASS = "segment"  # the layers of a model over several dies
HOST_RING = "KV ring in host memory"


@dataclass
class LayerLaunch:
    """The direct launches of one layer for one batch size, bound to its static buffers and state pools."""

    body: Any
    pools: tuple[Any, ...]


class SharedRows:
    """A (rows, cols) float32 device array shared by every batch size, grown to the largest asked for: for what
    no graph reads (the logits: the output matmul runs after the layers, directly), so that a server of many
    slots does not hold a vocabulary-wide buffer per batch size."""

    def __init__(self, cols: int) -> None:
        self.cols = cols
        self._array: Any = None

    def rows(self, backend: Any, n: int) -> Any:
        if self._array is None or self._array.shape[0] < n:
            self._array = backend.empty((n, self.cols))
        return self._array[:n]


def run_slot(backend: Any, launches: dict[Any, LayerLaunch], key: Any, graph_class: str, pools: tuple[Any, ...],
             make_body: Callable[[], Callable[[], None]]) -> None:
    """The launches of graph slot `key` (a layer of a decode step, or a die's segment of layers) through
    `backend.graphs`. `launches` holds the batch size's bodies; one is made (`make_body`) when the slot has none
    yet or its KV pools are not the ones it bound (a new state, or a host ring moved to the die: a graph
    captured before points at the old ones). A slot with a KV ring in host memory is ineligible while it is
    there."""
    graphs = backend.graphs
    launch = launches.get(key)
    if launch is None or any(a is not b for a, b in zip(launch.pools, pools)):
        graphs.invalidate(key)
        launch = launches[key] = LayerLaunch(make_body(), pools)
        if any(isinstance(p, np.ndarray) for p in pools):
            graphs.mark_ineligible(key, graph_class, HOST_RING)
        else:
            graphs.mark_eligible(key, HOST_RING)
    graphs.run(key, graph_class, launch.body, backend.stream)


def attend(backend: Any, q: Any, k: Any, v: Any, k_pool: Any, v_pool: Any, slots: Any, positions: Any, scale: float,
           out: Any, scratch: ops.DecodeScratch) -> None:
    """The decode step's cache writes and attention (q (n, Hq, hd), k and v (n, Hkv, hd)) into out: on the die
    with the step's own split-K scratch, or through the backend's host path for a ring in host memory (syncs;
    its layer is never captured)."""
    if isinstance(k_pool, np.ndarray):
        backend.kv_write(k_pool, slots, positions, k)
        backend.kv_write(v_pool, slots, positions, v)
        backend.attention_decode_batch(q, k_pool, v_pool, positions, scale, out, slot_ids=slots)
        return
    stream, geometry = backend.stream, backend.geometry
    ops.kv_write(k_pool, slots, positions, k, stream, geometry)
    ops.kv_write(v_pool, slots, positions, v, stream, geometry)
    ops.attention_decode_batch(q, k_pool, v_pool, positions, scale, out, slot_ids=slots, scratch=scratch,
                               stream=stream, geometry=geometry)


def step_ids(tokens: np.ndarray, slots: np.ndarray, positions: np.ndarray, vocab_rows: int, n_slots: int,
             ctx: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """A decode step's ids as the step buffers take them (int64 tokens, int32 slots and positions), after the
    checks the cpu backend's decode step makes: IndexError for a token id outside the embedding, ValueError for
    a slot or position outside the caches or two rows on one slot."""
    tokens = np.ascontiguousarray(tokens, dtype=np.int64)
    slots = np.ascontiguousarray(slots, dtype=np.int32)
    positions = np.ascontiguousarray(positions, dtype=np.int32)
    if tokens.size and (int(tokens.min()) < 0 or int(tokens.max()) >= vocab_rows):
        bad = int(tokens.min()) if int(tokens.min()) < 0 else int(tokens.max())
        raise IndexError(f"token id {bad} outside [0, {vocab_rows})")
    if slots.size and (int(slots.min()) < 0 or int(slots.max()) >= n_slots):
        raise ValueError(f"slot ids {slots.tolist()} outside [0, {n_slots})")
    if positions.size and (int(positions.min()) < 0 or int(positions.max()) >= ctx):
        raise ValueError(f"positions {positions.tolist()} outside a cache of {ctx}")
    if len(set(slots.tolist())) != len(slots):
        raise ValueError(f"decode step: two rows on one slot ({slots.tolist()})")
    return tokens, slots, positions


def _ids_to_device(backend: Any, buf: Any, ids: tuple[np.ndarray, ...]) -> None:
    for host, device in zip(ids, (buf.tokens, buf.slots, buf.positions)):
        device.copy_to_device(host, stream=backend.stream)


def embed_step(backend: Any, tok_embd: Any, first_norm: Any, eps: float, buf: Any, ids: tuple[np.ndarray, ...]
               ) -> None:
    """The start of a step, outside any graph: the ids (tokens, slots, positions) into buf's device buffers,
    then buf.x = their embeddings and buf.h = buf.x normed for the first layer."""
    stream, geometry = backend.stream, backend.geometry
    _ids_to_device(backend, buf, ids)
    quant.embed(tok_embd, buf.tokens, stream, geometry, out=buf.x)
    ops.rmsnorm(buf.x, first_norm, eps, buf.h, stream, geometry)


def hand_over(source: Any, target: Any, buf: "StepBuffers", onto: "StepBuffers", ids: tuple[np.ndarray, ...]
              ) -> None:
    """Between two dies' segments, outside any graph: the residual stream and the normed input (buf.x, buf.h,
    on `source`'s die) and the step's ids into `onto`'s buffers on `target`'s die, through host memory (a few
    rows). Leaves `target`'s die current. `onto`'s arrays are the ones its layers' graphs were captured on."""
    x, h = source.to_host(buf.x), source.to_host(buf.h)
    target.begin_step()
    onto.x.copy_to_device(x, stream=target.stream)
    onto.h.copy_to_device(h, stream=target.stream)
    _ids_to_device(target, onto, ids)


def step_logits(backend: Any, output: Any, logits: "SharedRows", h: Any, n: int) -> np.ndarray:
    """The end of a step, outside any graph: the output matrix over h's n rows, copied to the host."""
    rows = logits.rows(backend, n)
    quant.matmul(output, h, rows, backend.stream, backend.geometry)
    return backend.to_host(rows)


@dataclass
class StepBuffers:
    """Every array a decode step of `n` rows reads or writes, allocated once."""

    n: int
    tokens: Any
    slots: Any
    positions: Any
    x: Any  # the residual stream (n, D)
    h: Any  # normed input of the next matmul (n, D)
    qkv: Any  # stacked projection (n, q + 2 kv), or None
    q: Any  # (n, Hq, hd)
    k: Any  # (n, Hkv, hd)
    v: Any
    attn: Any  # (n, Hq, hd)
    o: Any  # (n, D)
    gate_up: Any  # stacked (n, 2F), or None
    gate: Any  # (n, F)
    up: Any
    ff: Any
    down: Any  # (n, D)
    scratch: ops.DecodeScratch
    layers: dict[Any, LayerLaunch] = field(default_factory=dict)  # graph slot key -> its bound launches


class CudaDecodePlan:
    """The weights of a llama model's decode step on the cuda backend, and the static buffers of each batch size
    it has run."""

    ends = True  # the whole step, token ids to logits, runs here (the llama model's `plan.ends` test)

    def __init__(self, blocks: list[Any], output_norm: Any, head_dim: int, tok_embd: Any, output: Any,
                 layer_backends: list[Any] | None = None, output_backend: Any = None) -> None:
        """`layer_backends`: each layer's die, for a model over several dies (segments.py), whose last die
        holds `output` (`output_backend`) and whose first the embedding; None: every layer on the step's."""
        self.blocks = blocks
        self.output_norm = output_norm
        self.head_dim = head_dim
        self.tok_embd = tok_embd
        self.output = output
        self.output_backend = output_backend
        # On several dies: (backend, its layers) for each die that holds layers, in layer order.
        self.segments: list[tuple[Any, list[int]]] | None = None
        if layer_backends is not None:
            self.segments = []
            for li, be in enumerate(layer_backends):
                if self.segments and self.segments[-1][0] is be:
                    self.segments[-1][1].append(li)
                else:
                    self.segments.append((be, [li]))
        self.steps: dict[tuple[int, int], StepBuffers] = {}  # (die, batch size) -> its buffers
        self.logits = SharedRows(int(output.rows))

    def buffers(self, backend: Any, n: int, n_q_heads: int, n_kv_heads: int) -> StepBuffers:
        """The buffers of a step of n rows on `backend`'s die (one set per die the model's layers sit on)."""
        found = self.steps.get((backend.die, n))
        if found is not None:
            return found
        blk, hd = self.blocks[0], self.head_dim
        d_model, ffn = int(blk.w_down.rows), int(blk.w_down.cols)
        empty = backend.empty
        stacked_qkv = blk.w_qkv is not None
        stacked_ffn = blk.w_gate_up is not None
        made = StepBuffers(
            n=n, tokens=empty((n,), np.int64), slots=empty((n,), np.int32), positions=empty((n,), np.int32),
            x=empty((n, d_model)), h=empty((n, d_model)),
            qkv=empty((n, (n_q_heads + 2 * n_kv_heads) * hd)) if stacked_qkv else None,
            q=empty((n, n_q_heads, hd)), k=empty((n, n_kv_heads, hd)), v=empty((n, n_kv_heads, hd)),
            attn=empty((n, n_q_heads, hd)), o=empty((n, d_model)),
            gate_up=empty((n, 2 * ffn)) if stacked_ffn else None,
            gate=empty((n, ffn)), up=empty((n, ffn)), ff=empty((n, ffn)), down=empty((n, d_model)),
            scratch=ops.DecodeScratch())
        self.steps[(backend.die, n)] = made
        return made


def _layer_body(backend: Any, plan: CudaDecodePlan, li: int, buf: StepBuffers, k_pool: Any, v_pool: Any,
                eps: float, n_rot: int, freq_base: float, freq_scale: float, scale: float) -> Any:
    """The launches of layer li for buf's batch size: the ops the llama model's own forward runs for a decode
    step, in its order, into buf's arrays. Binds nothing that changes between steps."""
    blk = plan.blocks[li]
    stream, geometry = backend.stream, backend.geometry
    n = buf.n
    q_flat, k_flat, v_flat = (a.reshape(n, a.shape[1] * a.shape[2]) for a in (buf.q, buf.k, buf.v))

    def body() -> None:
        if blk.w_qkv is not None:
            quant.matmul(blk.w_qkv, buf.h, buf.qkv, stream, geometry)
            ops.split_cols(buf.qkv, (q_flat.shape[1], k_flat.shape[1], v_flat.shape[1]), stream, geometry,
                           outs=(q_flat, k_flat, v_flat))
        else:
            for w, out in ((blk.wq, q_flat), (blk.wk, k_flat), (blk.wv, v_flat)):
                quant.matmul(w, buf.h, out, stream, geometry)
        ops.rope_inplace(buf.q, buf.positions, n_rot, freq_base, False, freq_scale, stream, geometry)
        ops.rope_inplace(buf.k, buf.positions, n_rot, freq_base, False, freq_scale, stream, geometry)
        attend(backend, buf.q, buf.k, buf.v, k_pool, v_pool, buf.slots, buf.positions, scale, buf.attn, buf.scratch)
        quant.matmul(blk.wo, buf.attn.reshape(n, buf.attn.shape[1] * buf.attn.shape[2]), buf.o, stream, geometry)
        ops.add_rmsnorm(buf.x, buf.o, blk.ffn_norm, eps, buf.h, stream, geometry)
        if blk.w_gate_up is not None:
            quant.matmul(blk.w_gate_up, buf.h, buf.gate_up, stream, geometry)
            ops.split_cols(buf.gate_up, (buf.gate.shape[1], buf.up.shape[1]), stream, geometry,
                           outs=(buf.gate, buf.up))
        else:
            quant.matmul(blk.w_gate, buf.h, buf.gate, stream, geometry)
            quant.matmul(blk.w_up, buf.h, buf.up, stream, geometry)
        ops.swiglu(buf.gate, buf.up, buf.ff, stream, geometry)
        quant.matmul(blk.w_down, buf.ff, buf.down, stream, geometry)
        ops.add_rmsnorm(buf.x, buf.down, blk.next_norm, eps, buf.h, stream, geometry)

    return body


def _segment_body(backend: Any, plan: CudaDecodePlan, layers: list[int], buf: StepBuffers, k_pools: list[Any],
                  v_pools: list[Any], *args: Any) -> Any:
    """The launches of a die's run of layers, one after the other: one graph per die and step."""
    bodies = [_layer_body(backend, plan, li, buf, k_pools[li], v_pools[li], *args) for li in layers]

    def body() -> None:
        for layer in bodies:
            layer()

    return body


def run_step(backend: Any, plan: CudaDecodePlan, tokens: np.ndarray, eps: float, k_pools: list[Any],
             v_pools: list[Any], slots: np.ndarray, positions: np.ndarray, n_q_heads: int, n_rot: int,
             freq_base: float, freq_scale: float, scale: float) -> np.ndarray:
    """Token ids (B,) -> logits (B, output rows) on the host, for one token per row at `positions` of `slots`.

    On one die each layer is a graph slot ("decode", layer, B). On several (`plan.segments`) each die's run of
    layers is one slot ("segment", segment index, B), class "segment", on that die's graphs, and the activations
    go from one die's buffers to the next's between them (`hand_over`), outside the graphs."""
    n_slots, ctx, n_kv_heads = (int(s) for s in k_pools[0].shape[:3])
    ids = step_ids(tokens, slots, positions, plan.tok_embd.rows, n_slots, ctx)
    n = len(ids[0])
    if n == 0:
        return np.empty((0, int(plan.output.rows)), np.float32)
    args = (eps, n_rot, freq_base, freq_scale, scale)
    segments = plan.segments or [(backend, list(range(len(plan.blocks))))]
    here = segments[0][0]
    here.begin_step()
    buf = plan.buffers(here, n, n_q_heads, n_kv_heads)
    embed_step(here, plan.tok_embd, plan.blocks[0].attn_norm, eps, buf, ids)
    for si, (be, layers) in enumerate(segments):
        if be is not here:
            onto = plan.buffers(be, n, n_q_heads, n_kv_heads)
            hand_over(here, be, buf, onto, ids)
            here, buf = be, onto
        for li in layers:
            be.attention_residency.reached(k_pools[li], isinstance(k_pools[li], np.ndarray))
        if plan.segments is None:
            for li in layers:
                run_slot(be, buf.layers, ("decode", li, n), GRAPH_CLASS, (k_pools[li], v_pools[li]),
                         lambda: _layer_body(be, plan, li, buf, k_pools[li], v_pools[li], *args))
        else:
            pools = tuple(pool for li in layers for pool in (k_pools[li], v_pools[li]))
            run_slot(be, buf.layers, ("segment", si, n), SEGMENT_CLASS, pools,
                     lambda: _segment_body(be, plan, layers, buf, k_pools, v_pools, *args))
    last = plan.output_backend or here
    if last is not here:  # a die that holds the output and no layer
        onto = plan.buffers(last, n, n_q_heads, n_kv_heads)
        hand_over(here, last, buf, onto, ids)
        buf = onto
    return step_logits(last, plan.output, plan.logits, buf.h, n)

__all__ = ["CudaDecodePlan", "GRAPH_CLASS", "HOST_RING", "LayerLaunch", "SEGMENT_CLASS", "SharedRows", "StepBuffers",
           "attend", "embed_step", "hand_over", "run_slot", "run_step", "step_ids", "step_logits"]
