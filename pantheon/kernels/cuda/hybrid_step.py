"""A Qwen3.5 / Qwen3-Next decode step on the cuda backend, replayable as CUDA graphs, as decode_step.py does for
llama: arrays allocated once per batch size, the step's token ids, slots and positions in device buffers, one
graph slot per layer: gated attention layers under `batched_attn`, DeltaNet layers under `batched_ssm` (several
rows) or `single_ssm` (one). A routed-expert FFN takes `moe.moe_ffn_pairs` (nothing on the host), so MoE layers
capture too.

Each layer body runs the ops of `Qwen35Model.forward` for a decode batch (one token per row), in its order, into
the step's arrays: the same kernels, so the same bits as that path.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from pantheon.kernels.cuda import moe, ops, quant, ssm
from pantheon.kernels.cuda.decode_step import (LayerLaunch, SharedRows, attend, embed_step, run_slot, step_ids,
                                               step_logits)


@dataclass
class HybridBuffers:
    """Every array a decode step of `n` rows reads or writes (None where no layer of the model needs it)."""

    n: int
    tokens: Any
    slots: Any
    positions: Any
    x: Any  # residual stream (n, D)
    h: Any  # normed input of the next matmul (n, D)
    mixed: Any  # the mixer's output (n, D)
    ff: Any  # the FFN's output (n, D)
    attn: dict[str, Any]  # gated attention: q, gate, k, v (flat), out (n, Hq, hd), o
    delta: dict[str, Any]  # DeltaNet: qkv, z, b, alpha, g, beta, conv, core, y
    dense: dict[str, Any]  # dense FFN / shared expert: gate, up, act per width
    route: dict[str, Any]  # router: logits, ids, weights, shared gate
    pairs: moe.PairBuffers | None
    scratch: ops.DecodeScratch
    layers: dict[Any, LayerLaunch] = field(default_factory=dict)


class HybridDecodePlan:
    """A Qwen3.5-family model's decode step on the cuda backend, and the static arrays of each batch size."""

    def __init__(self, model: Any) -> None:
        self.config = model.config
        self.blocks = model.blocks
        self.output_norm = model.output_norm
        self.tok_embd = model.tok_embd
        self.output = model.output
        self.key_head = model.key_head
        self.steps: dict[int, HybridBuffers] = {}
        self.logits = SharedRows(int(self.output.rows))

    def buffers(self, backend: Any, n: int) -> HybridBuffers:
        found = self.steps.get(n)
        if found is not None:
            return found
        c, empty = self.config, backend.empty
        d, q_dim, kv_dim = c.d_model, c.n_heads * c.head_dim, c.n_kv_heads * c.head_dim
        recurrent = any(c.recurrent)
        attention = not all(c.recurrent)
        ffns = [blk.ffn for blk in self.blocks]
        routed = [f for f in ffns if hasattr(f, "router")]
        dense_widths = {int(f.w_gate.rows) for f in ffns if not hasattr(f, "router")}
        dense_widths |= {int(f.shared.w_gate.rows) for f in routed if f.shared is not None}
        made = HybridBuffers(
            n=n, tokens=empty((n,), np.int64), slots=empty((n,), np.int32), positions=empty((n,), np.int32),
            x=empty((n, d)), h=empty((n, d)), mixed=empty((n, d)), ff=empty((n, d)),
            attn={"q": empty((n, q_dim)), "gate": empty((n, q_dim)), "k": empty((n, kv_dim)),
                  "v": empty((n, kv_dim)), "out": empty((n, c.n_heads, c.head_dim)), "o": empty((n, q_dim))}
            if attention else {},
            delta={"qkv": empty((n, c.conv_dim)), "z": empty((n, c.value_dim)),
                   "b": empty((n, c.ssm_value_heads)), "alpha": empty((n, c.ssm_value_heads)),
                   "g": empty((n, c.ssm_value_heads)), "beta": empty((n, c.ssm_value_heads)),
                   "conv": empty((n, c.conv_dim)), "core": empty((n, c.ssm_value_heads, c.ssm_value_dim)),
                   "y": empty((n * c.ssm_value_heads, c.ssm_value_dim))} if recurrent else {},
            dense={w: {"gate": empty((n, w)), "up": empty((n, w)), "act": empty((n, w))} for w in dense_widths},
            route={"logits": empty((n, c.n_experts)), "ids": empty((n, c.n_experts_used), np.int32),
                   "weights": empty((n, c.n_experts_used)), "shared_gate": empty((n, 1))} if routed else {},
            pairs=moe.pair_buffers(n, c.n_experts_used, d, c.expert_ffn_dim, backend.stream) if routed else None,
            scratch=ops.DecodeScratch())
        self.steps[n] = made
        return made


def _dense(backend: Any, f: Any, buf: HybridBuffers, out: Any) -> None:
    """out = down(silu(gate h) * up h), as Qwen35Model._swiglu."""
    stream, geometry = backend.stream, backend.geometry
    tmp = buf.dense[int(f.w_gate.rows)]
    quant.matmul(f.w_gate, buf.h, tmp["gate"], stream, geometry)
    quant.matmul(f.w_up, buf.h, tmp["up"], stream, geometry)
    ops.swiglu(tmp["gate"], tmp["up"], tmp["act"], stream, geometry)
    quant.matmul(f.w_down, tmp["act"], out, stream, geometry)


def _ffn(backend: Any, plan: HybridDecodePlan, f: Any, buf: HybridBuffers) -> None:
    """buf.ff = the layer's FFN of buf.h, as Qwen35Model._swiglu / _moe."""
    if not hasattr(f, "router"):
        _dense(backend, f, buf, buf.ff)
        return
    stream, geometry, r = backend.stream, backend.geometry, buf.route
    quant.matmul(f.router, buf.h, r["logits"], stream, geometry)
    moe.moe_route(r["logits"], plan.config.n_experts_used, stream, geometry, out=(r["ids"], r["weights"]))
    if f.shared is not None:
        _dense(backend, f.shared, buf, buf.ff)
        if f.shared_gate is not None:
            quant.matmul(f.shared_gate, buf.h, r["shared_gate"], stream, geometry)
            ssm.sigmoid_mul(buf.ff, r["shared_gate"], buf.ff, stream, geometry)
    else:
        ops.fill(buf.ff, 0, stream, geometry)
    moe.moe_ffn_pairs(buf.h, f.gate, f.up, f.down, r["ids"], r["weights"], buf.ff, buf.pairs, stream, geometry)


def _attention(backend: Any, plan: HybridDecodePlan, m: Any, buf: HybridBuffers, k_pool: Any, v_pool: Any) -> None:
    """buf.mixed = gated attention of buf.h, as Qwen35Model._attention for one token per row."""
    c, stream, geometry, a, n = plan.config, backend.stream, backend.geometry, buf.attn, buf.n
    hd = c.head_dim
    for w, out in ((m.wq, a["q"]), (m.wgate, a["gate"]), (m.wk, a["k"]), (m.wv, a["v"])):
        quant.matmul(w, buf.h, out, stream, geometry)
    for x, norm in ((a["q"], m.q_norm), (a["k"], m.k_norm)):
        rows = x.reshape(x.shape[0] * x.shape[1] // hd, hd)
        ops.rmsnorm(rows, norm, c.rms_eps, rows, stream, geometry)
    q, k = a["q"].reshape(n, c.n_heads, hd), a["k"].reshape(n, c.n_kv_heads, hd)
    ops.rope_inplace(q, buf.positions, c.rope_dim, c.rope_base, True, 1.0, stream, geometry)
    ops.rope_inplace(k, buf.positions, c.rope_dim, c.rope_base, True, 1.0, stream, geometry)
    attend(backend, q, k, a["v"].reshape(n, c.n_kv_heads, hd), k_pool, v_pool, buf.slots, buf.positions,
           1.0 / float(np.sqrt(hd)), a["out"], buf.scratch)
    ssm.sigmoid_mul(a["out"].reshape(n, c.n_heads * hd), a["gate"], a["o"], stream, geometry)
    quant.matmul(m.wo, a["o"], buf.mixed, stream, geometry)


def _delta_net(backend: Any, plan: HybridDecodePlan, m: Any, buf: HybridBuffers, conv_pool: Any,
               ssm_pool: Any) -> None:
    """buf.mixed = the Gated DeltaNet of buf.h, as Qwen35Model._delta_net for one token per row (the recurrent
    rule over all rows at once)."""
    c, stream, geometry, t, n = plan.config, backend.stream, backend.geometry, buf.delta, buf.n
    nk, nv, dk, dv = c.ssm_key_heads, c.ssm_value_heads, c.ssm_key_dim, c.ssm_value_dim
    for w, out in ((m.w_qkv, t["qkv"]), (m.w_z, t["z"]), (m.w_beta, t["b"]), (m.w_alpha, t["alpha"])):
        quant.matmul(w, buf.h, out, stream, geometry)
    ssm.gdn_gates(t["b"], t["alpha"], m.a, m.dt_bias, stream, geometry, out=(t["g"], t["beta"]))
    cv = ssm.causal_conv1d(t["qkv"].reshape(n, 1, c.conv_dim), conv_pool, m.conv, buf.slots,
                           t["conv"].reshape(n, 1, c.conv_dim), stream, geometry)
    q = cv[:, :, : c.key_dim].reshape(n, 1, nk, dk)
    k = cv[:, :, c.key_dim : 2 * c.key_dim].reshape(n, 1, nk, dk)
    v = cv[:, :, 2 * c.key_dim :].reshape(n, 1, nv, dv)
    ssm.gated_delta(q, k, v, t["g"].reshape(n, 1, nv), t["beta"].reshape(n, 1, nv), ssm_pool, buf.slots,
                    plan.key_head, 1.0 / float(np.sqrt(dk)), c.rms_eps, t["core"].reshape(n, 1, nv, dv),
                    "gated_delta_recurrent", stream, geometry)
    ssm.gated_rmsnorm(t["core"].reshape(n * nv, dv), t["z"].reshape(n * nv, dv), m.norm, c.rms_eps, t["y"], stream,
                      geometry)
    quant.matmul(m.w_out, t["y"].reshape(n, nv * dv), buf.mixed, stream, geometry)


def _layer_body(backend: Any, plan: HybridDecodePlan, li: int, buf: HybridBuffers, pools: tuple[Any, Any]) -> Any:
    blk = plan.blocks[li]
    eps = plan.config.rms_eps
    next_norm = plan.blocks[li + 1].attn_norm if li + 1 < len(plan.blocks) else plan.output_norm
    stream, geometry = backend.stream, backend.geometry
    mixer = _delta_net if plan.config.recurrent[li] else _attention

    def body() -> None:
        mixer(backend, plan, blk.mixer, buf, *pools)
        ops.add_rmsnorm(buf.x, buf.mixed, blk.post_norm, eps, buf.h, stream, geometry)
        _ffn(backend, plan, blk.ffn, buf)
        ops.add_rmsnorm(buf.x, buf.ff, next_norm, eps, buf.h, stream, geometry)

    return body


def run_step(backend: Any, plan: HybridDecodePlan, state: Any, tokens: np.ndarray, slots: np.ndarray,
             positions: np.ndarray) -> np.ndarray:
    """Token ids (B,) -> logits (B, output rows) on the host, one token per row at `positions` of `slots`, the
    model's HybridState pools updated as its forward would."""
    c = plan.config
    ids = step_ids(tokens, slots, positions, plan.tok_embd.rows, state.n_slots, state.ctx_cap)
    n = len(ids[0])
    if n == 0:
        return np.empty((0, int(plan.output.rows)), np.float32)
    buf = plan.buffers(backend, n)
    embed_step(backend, plan.tok_embd, plan.blocks[0].attn_norm, c.rms_eps, buf, ids)
    for li, recurrent in enumerate(c.recurrent):
        if recurrent:
            pools, graph_class = (state.conv[li], state.ssm[li]), "batched_ssm" if n > 1 else "single_ssm"
        else:
            pools, graph_class = (state.k[li], state.v[li]), "batched_attn"
            backend.attention_residency.reached(pools[0], isinstance(pools[0], np.ndarray))
        run_slot(backend, buf.layers, ("decode", li, n), graph_class, pools,
                 lambda: _layer_body(backend, plan, li, buf, pools))
    return step_logits(backend, plan.output, plan.logits, buf.h, n)

__all__ = ["HybridBuffers", "HybridDecodePlan", "run_step"]
