"""The Qwen3.5 / Qwen3-Next hybrid architectures (GGUF `qwen35`, `qwen35moe`, `qwen3next`).

x = embed(tokens)
for each block:  x += mixer(norm(x))          mixer = gated attention (1 block in 4) or Gated DeltaNet
                 x += ffn(norm(x))            ffn = SwiGLU (qwen35) or routed experts + gated shared expert
logits = Wout . norm(x)                       (Wout = token embeddings when output.weight is absent)

gated attention:  [q | gate] per head = Wq . x;  q, k = rope(rmsnorm(q)), rope(rmsnorm(k)) on the first
                  rope_dim dims (NeoX pairs);  o = attn(q, k, v) * sigmoid(gate);  out = Wo . o
Gated DeltaNet:   [Q | K | V] = silu(causal_conv(Wqkv . x));  z = Wz . x;  beta = sigmoid(Wb . x);
                  g = ssm_a * softplus(Wa . x + dt_bias);  o = delta_rule(l2norm(Q), l2norm(K), V, g, beta);
                  out = Wout . (rmsnorm(o) * w * silu(z))   per value head
MoE:              p = softmax(Wr . x), top-k renormalised;  sum_e p_e SwiGLU_e(x) + sigmoid(ws . x) SwiGLU_s(x)

The GGUF already holds the zero-centred norms as 1 + w and ssm_a as -exp(A_log). Value heads of qwen35* files
are in tiled order (head h uses key head h % Nk), those of qwen3next in grouped order (h // (Nv / Nk)); the
converter writes no flag, the architecture decides. Trailing MTP blocks (`nextn_predict_layers`) are skipped.
Layout facts: reference/qwen35-gguf.md beside the design notes (tensor names, converter transforms, math).

Sequence state per slot: a KV ring for each attention block; the conv inputs (K-1, C) and the recurrent
state (Nv, dv, dk) for each DeltaNet block. The recurrent part cannot be rewound to an earlier position, so
`supports_prefix_rewind` is False and `snapshot_slot` / `restore_slot` keep and reinstall copies of it
(turn-boundary checkpoints; the attention KV of the kept prefix is positional and stays valid in its slot).
The state records how many tokens each slot's recurrent state has consumed (`HybridState.n_tokens`): a row
starting at 0 clears the slot, and a row starting anywhere else than that count is refused (ValueError)
rather than silently continuing another position's state.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from pantheon.errors import ModelLoadError
from pantheon.io.gguf_file import GGUFFile
from pantheon.models.base import ArchMetadata, BatchRow, begin_forward, output_logits

ARCHITECTURES = ("qwen35", "qwen35moe", "qwen3next")


@dataclass(frozen=True)
class Qwen35Config:
    architecture: str
    n_layers: int  # main stack, MTP blocks excluded
    recurrent: tuple[bool, ...]  # per layer: True = Gated DeltaNet, False = gated attention
    d_model: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    rope_dim: int
    rope_base: float
    rms_eps: float
    vocab_size: int
    context_length: int
    conv_kernel: int
    ssm_key_heads: int  # Nk
    ssm_value_heads: int  # Nv
    ssm_key_dim: int  # dk
    ssm_value_dim: int  # dv
    tiled_value_heads: bool
    ffn_dim: int
    n_experts: int
    n_experts_used: int
    expert_ffn_dim: int
    shared_ffn_dim: int

    @property
    def key_dim(self) -> int:
        return self.ssm_key_heads * self.ssm_key_dim

    @property
    def value_dim(self) -> int:
        return self.ssm_value_heads * self.ssm_value_dim

    @property
    def conv_dim(self) -> int:
        return 2 * self.key_dim + self.value_dim

    def key_head_of_value_head(self) -> np.ndarray:
        heads = np.arange(self.ssm_value_heads)
        if self.tiled_value_heads:
            return (heads % self.ssm_key_heads).astype(np.int32)
        return (heads // (self.ssm_value_heads // self.ssm_key_heads)).astype(np.int32)

    @classmethod
    def from_metadata(cls, meta: dict[str, Any], arch: str) -> "Qwen35Config":
        md = ArchMetadata(meta, arch)
        get = md.get

        block_count = int(get("block_count"))
        n_layers = block_count - int(get("nextn_predict_layers", 0))
        d_model = int(get("embedding_length"))
        n_heads = int(get("attention.head_count"))
        head_dim = int(get("attention.key_length", d_model // n_heads))
        kv = get("attention.head_count_kv", n_heads)
        # Some converters write one value per layer, 0 on the DeltaNet layers.
        n_kv_heads = max(int(x) for x in kv) if isinstance(kv, list) else int(kv)
        flags = meta.get(f"{arch}.attention.recurrent_layers")
        if flags is not None:
            if len(flags) < n_layers:
                raise ModelLoadError(f"{arch}.attention.recurrent_layers has {len(flags)} entries for "
                                     f"{n_layers} layers")
            recurrent = tuple(bool(f) for f in flags[:n_layers])
        else:
            interval = int(get("full_attention_interval", 4))
            recurrent = tuple((i + 1) % interval != 0 for i in range(n_layers))
        n_key_heads = int(get("ssm.group_count"))
        n_value_heads = int(get("ssm.time_step_rank"))
        if n_key_heads < 1 or n_value_heads % n_key_heads:
            raise ModelLoadError(f"{arch}: {n_value_heads} value heads do not divide into {n_key_heads} key heads")
        ffn_dim = int(meta.get(f"{arch}.feed_forward_length", 0) or 0)
        n_experts = int(meta.get(f"{arch}.expert_count", 0) or 0)
        n_used = int(meta.get(f"{arch}.expert_used_count", 0) or 0)
        return cls(
            architecture=arch,
            n_layers=n_layers,
            recurrent=recurrent,
            d_model=d_model,
            n_heads=n_heads,
            n_kv_heads=n_kv_heads,
            head_dim=head_dim,
            rope_dim=int(get("rope.dimension_count", head_dim)),
            rope_base=float(get("rope.freq_base", 10000.0)),
            rms_eps=float(get("attention.layer_norm_rms_epsilon")),
            vocab_size=md.vocab_size(),
            context_length=int(get("context_length", 4096)),
            conv_kernel=int(get("ssm.conv_kernel")),
            ssm_key_heads=n_key_heads,
            ssm_value_heads=n_value_heads,
            ssm_key_dim=int(get("ssm.state_size")),
            ssm_value_dim=int(get("ssm.inner_size")) // n_value_heads,
            tiled_value_heads=arch != "qwen3next",
            ffn_dim=ffn_dim,
            n_experts=n_experts,
            n_experts_used=n_used,
            expert_ffn_dim=int(meta.get(f"{arch}.expert_feed_forward_length", 0) or (ffn_dim // max(n_used, 1))),
            shared_ffn_dim=int(meta.get(f"{arch}.expert_shared_feed_forward_length", 0) or ffn_dim),
        )


# -- weights -----------------------------------------------------------------------------------------------


@dataclass
class GatedAttention:
    wq: Any  # (H * hd, D): the query rows of attn_q
    wgate: Any  # (H * hd, D): the output-gate rows of attn_q
    wk: Any
    wv: Any
    wo: Any
    q_norm: Any
    k_norm: Any


@dataclass
class GatedDeltaNet:
    w_qkv: Any  # (conv_dim, D): [Q | K | V]
    w_z: Any  # (value_dim, D)
    w_beta: Any  # (Nv, D)
    w_alpha: Any  # (Nv, D)
    conv: Any  # (conv_dim, K)
    a: Any  # (Nv,) = -exp(A_log)
    dt_bias: Any  # (Nv,)
    norm: Any  # (dv,)
    w_out: Any  # (D, value_dim)


@dataclass
class DenseFFN:
    w_gate: Any
    w_up: Any
    w_down: Any


@dataclass
class MoEFFN:
    router: Any  # (E, D)
    gate: Any  # expert matrices, see Backend.experts
    up: Any
    down: Any
    shared_gate: Any | None  # (1, D): the shared expert's sigmoid gate
    shared: DenseFFN | None


@dataclass
class Block:
    attn_norm: Any
    post_norm: Any
    mixer: GatedAttention | GatedDeltaNet
    ffn: DenseFFN | MoEFFN


class _Loader:
    """Tensor lookup with shape checks, so a malformed file fails at load naming the tensor."""

    def __init__(self, gguf: GGUFFile, backend: Any) -> None:
        self.gguf = gguf
        self.be = backend

    def has(self, name: str) -> bool:
        return name in self.gguf.tensors

    def need(self, name: str) -> str:
        if name not in self.gguf.tensors:
            raise ModelLoadError(f"{self.gguf.path}: missing tensor {name!r}")
        return name

    def matrix(self, name: str, rows: int, cols: int) -> Any:
        w = self.be.weight(self.gguf, self.need(name))
        if (w.rows, w.cols) != (rows, cols):
            raise ModelLoadError(f"{self.gguf.path}: tensor {name!r} is {w.rows}x{w.cols}, expected {rows}x{cols}")
        return w

    def vector(self, name: str, size: int) -> Any:
        v = self.be.vector(self.gguf, self.need(name))
        if v.shape[0] != size:
            raise ModelLoadError(f"{self.gguf.path}: tensor {name!r} has {v.shape[0]} values, expected {size}")
        return v

    def rows(self, w: Any, rows: np.ndarray) -> Any:
        return self.be.weight_rows(w, np.asarray(rows, dtype=np.int64))


def _per_group_rows(n_groups: int, group: int, start: int, size: int) -> np.ndarray:
    """Rows [start, start + size) of each of n_groups consecutive groups of `group` rows, group by group."""
    return (np.arange(n_groups)[:, None] * group + start + np.arange(size)[None, :]).reshape(-1)


def _load_attention(ld: _Loader, p: str, c: Qwen35Config) -> GatedAttention:
    q_dim, kv_dim, d = c.n_heads * c.head_dim, c.n_kv_heads * c.head_dim, c.d_model
    if ld.has(p + "attn_q.weight"):
        q_gate = ld.matrix(p + "attn_q.weight", 2 * q_dim, d)
        wk = ld.matrix(p + "attn_k.weight", kv_dim, d)
        wv = ld.matrix(p + "attn_v.weight", kv_dim, d)
    else:  # a fused [q+gate | k | v] tensor, which llama.cpp also accepts
        fused = ld.matrix(p + "attn_qkv.weight", 2 * q_dim + 2 * kv_dim, d)
        q_gate = ld.rows(fused, np.arange(2 * q_dim))
        wk = ld.rows(fused, 2 * q_dim + np.arange(kv_dim))
        wv = ld.rows(fused, 2 * q_dim + kv_dim + np.arange(kv_dim))
    # attn_q rows are per head [query (hd) | gate (hd)]; split them into two matrices once, here.
    hd = c.head_dim
    return GatedAttention(
        wq=ld.rows(q_gate, _per_group_rows(c.n_heads, 2 * hd, 0, hd)),
        wgate=ld.rows(q_gate, _per_group_rows(c.n_heads, 2 * hd, hd, hd)),
        wk=wk,
        wv=wv,
        wo=ld.matrix(p + "attn_output.weight", d, q_dim),
        q_norm=ld.vector(p + "attn_q_norm.weight", hd),
        k_norm=ld.vector(p + "attn_k_norm.weight", hd),
    )


def _load_delta_net(ld: _Loader, p: str, c: Qwen35Config) -> GatedDeltaNet:
    d, nk, nv = c.d_model, c.ssm_key_heads, c.ssm_value_heads
    dk, dv, r = c.ssm_key_dim, c.ssm_value_dim, c.ssm_value_heads // c.ssm_key_heads
    if ld.has(p + "attn_qkv.weight"):
        w_qkv = ld.matrix(p + "attn_qkv.weight", c.conv_dim, d)
        w_z = ld.matrix(p + "attn_gate.weight", c.value_dim, d)
    else:  # legacy Qwen3-Next: the raw HF in_proj_qkvz, rows per key head [q (dk), k (dk), v (r dv), z (r dv)]
        group = 2 * dk + 2 * r * dv
        qkvz = ld.matrix(p + "ssm_in.weight", nk * group, d)
        w_qkv = ld.rows(qkvz, np.concatenate([_per_group_rows(nk, group, 0, dk),
                                              _per_group_rows(nk, group, dk, dk),
                                              _per_group_rows(nk, group, 2 * dk, r * dv)]))
        w_z = ld.rows(qkvz, _per_group_rows(nk, group, 2 * dk + r * dv, r * dv))
    if ld.has(p + "ssm_ba.weight"):  # qwen3next: rows per key head [b (r) | a (r)]
        ba = ld.matrix(p + "ssm_ba.weight", 2 * nv, d)
        w_beta = ld.rows(ba, _per_group_rows(nk, 2 * r, 0, r))
        w_alpha = ld.rows(ba, _per_group_rows(nk, 2 * r, r, r))
    else:
        w_beta = ld.matrix(p + "ssm_beta.weight", nv, d)
        w_alpha = ld.matrix(p + "ssm_alpha.weight", nv, d)
    return GatedDeltaNet(
        w_qkv=w_qkv,
        w_z=w_z,
        w_beta=w_beta,
        w_alpha=w_alpha,
        conv=ld.vector(p + "ssm_conv1d.weight", c.conv_dim * c.conv_kernel).reshape(c.conv_dim, c.conv_kernel),
        a=ld.vector(p + "ssm_a", nv),
        dt_bias=ld.vector(p + "ssm_dt.bias", nv),
        norm=ld.vector(p + "ssm_norm.weight", dv),
        w_out=ld.matrix(p + "ssm_out.weight", d, c.value_dim),
    )


def _load_ffn(ld: _Loader, p: str, c: Qwen35Config) -> DenseFFN | MoEFFN:
    d = c.d_model
    if not ld.has(p + "ffn_gate_inp.weight"):
        return DenseFFN(ld.matrix(p + "ffn_gate.weight", c.ffn_dim, d), ld.matrix(p + "ffn_up.weight", c.ffn_dim, d),
                        ld.matrix(p + "ffn_down.weight", d, c.ffn_dim))
    e, fe, be = c.n_experts, c.expert_ffn_dim, ld.be
    if not 1 <= c.n_experts_used <= e:
        raise ModelLoadError(f"{ld.gguf.path}: expert_used_count {c.n_experts_used} of expert_count {e}")
    if ld.has(p + "ffn_gate_exps.weight"):
        gate = be.experts(ld.matrix(p + "ffn_gate_exps.weight", e * fe, d), e)
        up = be.experts(ld.matrix(p + "ffn_up_exps.weight", e * fe, d), e)
    else:  # fused, HF chunk order: gate first
        gate_up = ld.matrix(p + "ffn_gate_up_exps.weight", e * 2 * fe, d)
        gate, up = be.experts(gate_up, e, 2, 0), be.experts(gate_up, e, 2, 1)
    shared = shared_gate = None
    if ld.has(p + "ffn_gate_shexp.weight"):
        fs = c.shared_ffn_dim
        shared = DenseFFN(ld.matrix(p + "ffn_gate_shexp.weight", fs, d), ld.matrix(p + "ffn_up_shexp.weight", fs, d),
                          ld.matrix(p + "ffn_down_shexp.weight", d, fs))
        if ld.has(p + "ffn_gate_inp_shexp.weight"):
            shared_gate = ld.matrix(p + "ffn_gate_inp_shexp.weight", 1, d)
    return MoEFFN(router=ld.matrix(p + "ffn_gate_inp.weight", e, d), gate=gate, up=up,
                  down=be.experts(ld.matrix(p + "ffn_down_exps.weight", e * d, fe), e),
                  shared_gate=shared_gate, shared=shared)


# -- state -------------------------------------------------------------------------------------------------


@dataclass
class HybridState:
    """Per-layer pools for every slot; an entry is None where the layer has no state of that kind."""

    ctx_cap: int
    n_tokens: np.ndarray  # (S,) int64: how many tokens each slot's recurrent state has consumed
    k: list[Any]  # attention: (S, ctx_cap, Hkv, hd)
    v: list[Any]
    conv: list[Any]  # DeltaNet: (S, K-1, conv_dim), the last K-1 conv inputs
    ssm: list[Any]  # DeltaNet: (S, Nv, dv, dk) float32, each head's S[key, value] transposed

    @property
    def n_slots(self) -> int:
        pools = [p for p in self.k + self.conv if p is not None]
        return pools[0].shape[0] if pools else 0


@dataclass(frozen=True)
class RecurrentSnapshot:
    """One slot's conv and recurrent state after its first n_tokens tokens (host copies, DeltaNet layers)."""

    n_tokens: int
    conv: tuple[np.ndarray, ...]
    ssm: tuple[np.ndarray, ...]

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in self.conv + self.ssm)


# -- the model ---------------------------------------------------------------------------------------------


class Qwen35Model:
    state_dtype = np.dtype(np.float32)
    # The recurrent state holds every position at once: a prefix cannot be kept by truncating it.
    supports_prefix_rewind = False

    def __init__(self, config: Qwen35Config, backend: Any, tok_embd: Any, blocks: list[Block], output_norm: Any,
                 output: Any) -> None:
        self.config = config
        self.architecture = config.architecture
        self.backend = backend
        self.tok_embd = tok_embd
        self.blocks = blocks
        self.output_norm = output_norm
        self.output = output
        self.vocab_size = config.vocab_size
        self.context_length = config.context_length
        # The key head each value head reads (device array on the cuda backend).
        self.key_head = backend.upload(config.key_head_of_value_head())
        # Backends that run a decode step (one token per row) through a plan of their own: the cuda one, whose
        # plan replays each layer as a CUDA graph (kernels/cuda/hybrid_step.py).
        self._decode_plan = backend.hybrid_decode_plan(self) if hasattr(backend, "hybrid_decode_plan") else None

    @classmethod
    def from_gguf(cls, gguf: GGUFFile, backend: Any) -> "Qwen35Model":
        arch = gguf.architecture
        if arch not in ARCHITECTURES:
            raise ModelLoadError(f"{gguf.path}: architecture {arch!r} is not one of {ARCHITECTURES}")
        cfg = Qwen35Config.from_metadata(gguf.metadata, arch)
        if getattr(backend, "int8", False):
            # Float activations for the hybrids: rounding them to int8 blocks (the cpu backend's default for
            # llama) amplifies the small chunked-vs-recurrent differences of the delta rule past the bar of
            # their transformers goldens, and that arithmetic has not been checked against llama.cpp here.
            backend = backend.without_int8()
        ld = _Loader(gguf, backend)
        blocks = []
        for i in range(cfg.n_layers):
            p = f"blk.{i}."
            blocks.append(Block(
                attn_norm=ld.vector(p + "attn_norm.weight", cfg.d_model),
                post_norm=ld.vector(p + "post_attention_norm.weight", cfg.d_model),
                mixer=_load_delta_net(ld, p, cfg) if cfg.recurrent[i] else _load_attention(ld, p, cfg),
                ffn=_load_ffn(ld, p, cfg),
            ))
        tok_embd = backend.weight(gguf, ld.need("token_embd.weight"))
        output = backend.weight(gguf, "output.weight") if ld.has("output.weight") else tok_embd
        for name, w in (("token_embd", tok_embd), ("output", output)):
            if w.cols != cfg.d_model or w.rows < cfg.vocab_size:
                raise ModelLoadError(f"{gguf.path}: {name} weight {w.rows}x{w.cols} does not fit the config")
        return cls(cfg, backend, tok_embd, blocks, ld.vector("output_norm.weight", cfg.d_model), output)

    # -- state ---------------------------------------------------------------------------------------------
    def new_state(self, n_slots: int, ctx_cap: int) -> HybridState:
        c, be = self.config, self.backend
        kv = (n_slots, ctx_cap, c.n_kv_heads, c.head_dim)
        state = HybridState(ctx_cap, np.zeros(n_slots, dtype=np.int64), [], [], [], [])
        for recurrent in c.recurrent:
            state.k.append(None if recurrent else be.kv_pool(*kv, np.float32))
            state.v.append(None if recurrent else be.kv_pool(*kv, np.float32))
            state.conv.append(be.zeros((n_slots, c.conv_kernel - 1, c.conv_dim)) if recurrent else None)
            state.ssm.append(be.zeros((n_slots, c.ssm_value_heads, c.ssm_value_dim, c.ssm_key_dim))
                             if recurrent else None)
        return state

    def clear_slot(self, state: HybridState, slot: int) -> None:
        """Zero a slot's recurrent state: a sequence starting at position 0 must not continue another's."""
        for pool in state.conv + state.ssm:
            if pool is not None:
                pool[slot] = 0.0
        state.n_tokens[slot] = 0

    def snapshot_slot(self, state: HybridState, slot: int) -> RecurrentSnapshot:
        """Copies of the slot's recurrent state as it is now: after its first state.n_tokens[slot] tokens."""
        be = self.backend
        return RecurrentSnapshot(
            int(state.n_tokens[slot]),
            tuple(np.array(be.to_host(p[slot])) for p in state.conv if p is not None),
            tuple(np.array(be.to_host(p[slot])) for p in state.ssm if p is not None))

    def restore_slot(self, state: HybridState, slot: int, snap: RecurrentSnapshot) -> None:
        """Reinstall a snapshot of this slot: the slot then holds the state after snap.n_tokens tokens (the
        attention KV rows below that are positional and must still hold the same tokens)."""
        be = self.backend
        conv = [p for p in state.conv if p is not None]
        ssm = [p for p in state.ssm if p is not None]
        if len(conv) != len(snap.conv) or len(ssm) != len(snap.ssm):
            raise ValueError("snapshot does not fit this model")
        for pool, arr in zip(conv + ssm, snap.conv + snap.ssm):
            pool[slot] = be.upload(arr)
        state.n_tokens[slot] = snap.n_tokens

    def checkpoint_layout(self) -> list[tuple[str, tuple[int, ...]]]:
        """Names and shapes of `checkpoint_arrays`: the recurrent layers' part of `slot_layout`."""
        return [(name, shape) for name, shape in self.slot_layout(0) if name.startswith(("conv", "ssm"))]

    def checkpoint_arrays(self, snap: RecurrentSnapshot) -> list[tuple[str, np.ndarray]]:
        """A checkpoint as named arrays, in `checkpoint_layout` order (for a session blob)."""
        names = [name for name, _ in self.checkpoint_layout()]
        conv = iter(snap.conv)
        ssm = iter(snap.ssm)
        return [(name, next(conv) if name.startswith("conv") else next(ssm)) for name in names]

    def checkpoint_from_arrays(self, n_tokens: int, arrays: list[tuple[str, np.ndarray]]) -> RecurrentSnapshot:
        """The checkpoint `checkpoint_arrays` wrote (layout checked by the caller)."""
        return RecurrentSnapshot(n_tokens, tuple(np.array(a, dtype=self.state_dtype) for n, a in arrays
                                                 if n.startswith("conv")),
                                 tuple(np.array(a, dtype=self.state_dtype) for n, a in arrays if n.startswith("ssm")))

    def state_dims(self) -> dict[str, Any]:
        """The geometry a session blob must match to be restored into this model."""
        c = self.config
        return {"n_layers": c.n_layers, "layer_types": "".join("L" if r else "A" for r in c.recurrent),
                "n_kv_heads": c.n_kv_heads, "head_dim": c.head_dim, "conv": [c.conv_kernel - 1, c.conv_dim],
                "ssm": [c.ssm_value_heads, c.ssm_value_dim, c.ssm_key_dim]}

    def slot_layout(self, n_tokens: int) -> list[tuple[str, tuple[int, ...]]]:
        c = self.config
        layout: list[tuple[str, tuple[int, ...]]] = []
        for li, recurrent in enumerate(c.recurrent):
            if recurrent:
                layout.append((f"conv{li}", (c.conv_kernel - 1, c.conv_dim)))
                layout.append((f"ssm{li}", (c.ssm_value_heads, c.ssm_value_dim, c.ssm_key_dim)))
            else:
                layout.append((f"k{li}", (n_tokens, c.n_kv_heads, c.head_dim)))
                layout.append((f"v{li}", (n_tokens, c.n_kv_heads, c.head_dim)))
        return layout

    def read_slot(self, state: HybridState, slot: int, n_tokens: int) -> list[tuple[str, np.ndarray]]:
        """Copies of one slot's state for its first n_tokens positions (for a session blob)."""
        be = self.backend
        arrays = []
        for li, recurrent in enumerate(self.config.recurrent):
            if recurrent:
                arrays.append((f"conv{li}", np.array(be.to_host(state.conv[li][slot]))))
                arrays.append((f"ssm{li}", np.array(be.to_host(state.ssm[li][slot]))))
            else:
                arrays.append((f"k{li}", np.array(be.to_host(state.k[li][slot, :n_tokens]))))
                arrays.append((f"v{li}", np.array(be.to_host(state.v[li][slot, :n_tokens]))))
        return arrays

    def write_slot(self, state: HybridState, slot: int, arrays: list[tuple[str, np.ndarray]], n_tokens: int) -> None:
        """Install state read by read_slot. The caller has checked the layout with slot_layout."""
        by_name = dict(arrays)
        be = self.backend
        for li, recurrent in enumerate(self.config.recurrent):
            if recurrent:
                state.conv[li][slot] = be.upload(by_name[f"conv{li}"])
                state.ssm[li][slot] = be.upload(by_name[f"ssm{li}"])
            else:
                state.k[li][slot, :n_tokens] = be.upload(by_name[f"k{li}"])
                state.v[li][slot, :n_tokens] = be.upload(by_name[f"v{li}"])
        state.n_tokens[slot] = n_tokens

    def kv_bytes_per_token(self) -> int:
        c = self.config
        return 2 * sum(not r for r in c.recurrent) * c.n_kv_heads * c.head_dim * 4

    def recurrent_bytes_per_slot(self) -> int:
        c = self.config
        per_layer = (c.conv_kernel - 1) * c.conv_dim + c.ssm_value_heads * c.ssm_key_dim * c.ssm_value_dim
        return 4 * per_layer * sum(c.recurrent)

    def state_bytes(self, n_slots: int, ctx_cap: int) -> int:
        """Memory of new_state(n_slots, ctx_cap) once every slot is full."""
        return n_slots * (ctx_cap * self.kv_bytes_per_token() + self.recurrent_bytes_per_slot())

    # -- forward -------------------------------------------------------------------------------------------
    def forward(self, state: HybridState, batch: list[BatchRow]) -> np.ndarray:
        """One step: a prefill chunk of one sequence, or one decode token for each of several sequences (rows
        of any mix work; DeltaNet rows of more than one token use the chunked delta rule)."""
        c, be = self.config, self.backend
        begin_forward(be, state.k, state.v)
        for row in batch:
            if row.start_pos + len(row.tokens) > state.ctx_cap:
                raise ValueError(f"slot {row.slot}: {row.start_pos}+{len(row.tokens)} tokens exceed ctx "
                                 f"{state.ctx_cap}")
            if row.start_pos == 0:
                self.clear_slot(state, row.slot)
            elif row.start_pos != state.n_tokens[row.slot]:
                # Continuing elsewhere would silently mix two sequences' states: rewinding needs restore_slot.
                raise ValueError(f"slot {row.slot} holds the recurrent state after {state.n_tokens[row.slot]} "
                                 f"tokens and cannot continue at position {row.start_pos}")
        if self._decode_plan is not None and all(len(r.tokens) == 1 and r.logits == "last" for r in batch):
            logits = be.hybrid_decode_step(
                self._decode_plan, state, np.fromiter((r.tokens[0] for r in batch), np.int64, len(batch)),
                np.array([r.slot for r in batch], np.int32), np.array([r.start_pos for r in batch], np.int32))
            for row in batch:
                state.n_tokens[row.slot] = row.start_pos + 1
            return logits[:, : c.vocab_size]
        lengths = [len(r.tokens) for r in batch]
        offsets = np.cumsum([0, *lengths])
        n_tok = int(offsets[-1])
        step = _Step(
            batch=batch,
            offsets=offsets,
            n_tok=n_tok,
            decode_only=n_tok == len(batch),
            positions=be.upload(np.concatenate(
                [np.arange(r.start_pos, r.start_pos + n, dtype=np.int32) for r, n in zip(batch, lengths)])),
            token_slots=be.upload(np.repeat(np.array([r.slot for r in batch], dtype=np.int32), lengths)),
            row_slots=be.upload(np.array([r.slot for r in batch], dtype=np.int32)),
        )
        x = be.embed(self.tok_embd, be.upload(np.concatenate([r.tokens for r in batch]).astype(np.int64)))
        h = be.rmsnorm(x, self.blocks[0].attn_norm, c.rms_eps)
        for li, blk in enumerate(self.blocks):
            if isinstance(blk.mixer, GatedDeltaNet):
                mixed = self._delta_net(blk.mixer, state.conv[li], state.ssm[li], h, step)
            else:
                mixed = self._attention(blk.mixer, state.k[li], state.v[li], h, step)
            be.add_rmsnorm(x, mixed, blk.post_norm, c.rms_eps, h)
            ff = self._moe(blk.ffn, h) if isinstance(blk.ffn, MoEFFN) else self._swiglu(blk.ffn, h)
            next_norm = self.blocks[li + 1].attn_norm if li + 1 < len(self.blocks) else self.output_norm
            be.add_rmsnorm(x, ff, next_norm, c.rms_eps, h)

        for row in batch:
            state.n_tokens[row.slot] = row.start_pos + len(row.tokens)

        # h now holds output_norm(x) for every position.
        return output_logits(be, self.output, h, batch, offsets, c.vocab_size)

    def _attention(self, m: GatedAttention, k_pool: Any, v_pool: Any, h: Any, step: "_Step") -> Any:
        c, be, n = self.config, self.backend, step.n_tok
        q = be.matmul(m.wq, h)
        gate = be.matmul(m.wgate, h)
        k = be.matmul(m.wk, h)
        v = be.matmul(m.wv, h).reshape(n, c.n_kv_heads, c.head_dim)
        be.rmsnorm(q.reshape(-1, c.head_dim), m.q_norm, c.rms_eps, out=q.reshape(-1, c.head_dim))
        be.rmsnorm(k.reshape(-1, c.head_dim), m.k_norm, c.rms_eps, out=k.reshape(-1, c.head_dim))
        q = q.reshape(n, c.n_heads, c.head_dim)
        k = k.reshape(n, c.n_kv_heads, c.head_dim)
        be.rope_inplace(q, step.positions, c.rope_dim, c.rope_base, True)
        be.rope_inplace(k, step.positions, c.rope_dim, c.rope_base, True)
        be.kv_write(k_pool, step.token_slots, step.positions, k)
        be.kv_write(v_pool, step.token_slots, step.positions, v)
        scale = 1.0 / float(np.sqrt(c.head_dim))
        if step.decode_only:
            attn = be.attention_decode_batch(q, k_pool, v_pool, step.positions, scale, slot_ids=step.token_slots)
        else:
            attn = be.empty((n, c.n_heads, c.head_dim))
            for row, a, b in step.segments():
                be.attention(q[a:b], k_pool, v_pool, row.slot, row.start_pos, scale, out=attn[a:b])
        o = be.sigmoid_mul(attn.reshape(n, c.n_heads * c.head_dim), gate)
        return be.matmul(m.wo, o)

    def _delta_net(self, m: GatedDeltaNet, conv_pool: Any, ssm_pool: Any, h: Any, step: "_Step") -> Any:
        c, be, n = self.config, self.backend, step.n_tok
        nk, nv, dk, dv = c.ssm_key_heads, c.ssm_value_heads, c.ssm_key_dim, c.ssm_value_dim
        mixed = be.matmul(m.w_qkv, h)
        z = be.matmul(m.w_z, h)
        g, beta = be.gdn_gates(be.matmul(m.w_beta, h), be.matmul(m.w_alpha, h), m.a, m.dt_bias)
        conv = be.empty((n, c.conv_dim))
        core = be.empty((n, nv, dv))
        scale = 1.0 / float(np.sqrt(dk))
        # Segments of rows that run as one call: all decode rows together (B sequences of 1 token), else each
        # row alone (1 sequence of L tokens).
        if step.decode_only:
            calls = [(step.row_slots, 0, n, len(step.batch), 1)]
        else:
            calls = [(be.upload(np.array([row.slot], np.int32)), a, b, 1, b - a) for row, a, b in step.segments()]
        for slots, a, b, n_seq, length in calls:
            cv = be.causal_conv1d(mixed[a:b].reshape(n_seq, length, c.conv_dim), conv_pool, m.conv, slots,
                                  out=conv[a:b].reshape(n_seq, length, c.conv_dim))
            # q, k, v are strided column slices of the conv output (the kernels read them in place).
            q = cv[:, :, : c.key_dim].reshape(n_seq, length, nk, dk)
            k = cv[:, :, c.key_dim : 2 * c.key_dim].reshape(n_seq, length, nk, dk)
            v = cv[:, :, 2 * c.key_dim :].reshape(n_seq, length, nv, dv)
            rule = be.gated_delta_chunked if length > 1 else be.gated_delta_recurrent
            rule(q, k, v, g[a:b].reshape(n_seq, length, nv), beta[a:b].reshape(n_seq, length, nv), ssm_pool,
                 slots, self.key_head, scale, c.rms_eps, out=core[a:b].reshape(n_seq, length, nv, dv))
        y = be.gated_rmsnorm(core.reshape(n * nv, dv), z.reshape(n * nv, dv), m.norm, c.rms_eps)
        return be.matmul(m.w_out, y.reshape(n, nv * dv))

    def _swiglu(self, f: DenseFFN, h: Any) -> Any:
        be = self.backend
        return be.matmul(f.w_down, be.swiglu(be.matmul(f.w_gate, h), be.matmul(f.w_up, h)))

    def _moe(self, f: MoEFFN, h: Any) -> Any:
        be = self.backend
        ids, weights = be.moe_route(be.matmul(f.router, h), self.config.n_experts_used)
        if f.shared is not None:
            out = self._swiglu(f.shared, h)
            if f.shared_gate is not None:
                be.sigmoid_mul(out, be.matmul(f.shared_gate, h), out=out)
        else:
            out = be.zeros(h.shape)
        return be.moe_ffn(h, f.gate, f.up, f.down, ids, weights, out)


@dataclass
class _Step:
    """What every layer of one forward step needs to know about its batch."""

    batch: list[BatchRow]
    offsets: np.ndarray
    n_tok: int
    decode_only: bool
    positions: Any  # (T,) int32
    token_slots: Any  # (T,) int32
    row_slots: Any  # (B,) int32

    def segments(self):
        return zip(self.batch, self.offsets[:-1], self.offsets[1:])
