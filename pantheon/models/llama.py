"""The llama architecture (SmolLM2, Mistral, MiniCPM5 ... everything GGUF labels `llama`).

x = embed(tokens)
for each block:  x += Wo . attn(rope(Wq . norm(x)), rope(Wk . norm(x)), Wv . norm(x))
                 x += Wdown . (silu(Wgate . norm(x)) * Wup . norm(x))
logits = Wout . norm(x)          (Wout = token embeddings when output.weight is absent: tied)
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from pantheon.errors import ModelLoadError
from pantheon.io.gguf_file import GGUFFile
from pantheon.models.base import ArchMetadata, BatchRow, begin_forward, last_backend, layer_backend, output_logits


@dataclass(frozen=True)
class LlamaConfig:
    n_layers: int
    d_model: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    ffn_dim: int
    vocab_size: int
    context_length: int
    rope_dim: int
    rope_base: float
    rope_scale: float
    rms_eps: float

    @classmethod
    def from_metadata(cls, meta: dict[str, Any], arch: str = "llama") -> "LlamaConfig":
        md = ArchMetadata(meta, arch)
        get = md.get

        d_model = int(get("embedding_length"))
        n_heads = int(get("attention.head_count"))
        head_dim = int(get("attention.key_length", d_model // n_heads))
        scale = meta.get(f"{arch}.rope.scaling.factor") if meta.get(f"{arch}.rope.scaling.type") == "linear" else None
        return cls(
            n_layers=int(get("block_count")),
            d_model=d_model,
            n_heads=n_heads,
            n_kv_heads=int(get("attention.head_count_kv", n_heads)),
            head_dim=head_dim,
            ffn_dim=int(get("feed_forward_length")),
            vocab_size=md.vocab_size(),
            context_length=int(get("context_length", 4096)),
            rope_dim=int(get("rope.dimension_count", head_dim)),
            rope_base=float(get("rope.freq_base", 10000.0)),
            rope_scale=1.0 / float(scale) if scale else 1.0,
            rms_eps=float(get("attention.layer_norm_rms_epsilon", 1e-5)),
        )


@dataclass
class LlamaBlock:
    attn_norm: np.ndarray
    wq: Any
    wk: Any
    wv: Any
    wo: Any
    ffn_norm: np.ndarray
    w_gate: Any
    w_up: Any
    w_down: Any
    # The same matrices stacked by rows, when their formats allow it: one matmul (one kernel launch, one
    # pass of the activations) instead of three and two. None: use the separate ones.
    w_qkv: Any = None
    w_gate_up: Any = None
    # The norm after this layer's FFN (the next layer's attn_norm, or the output norm), on this layer's die: the
    # same array on one die; a copy when the next layer or the output sits on another (segments.py), whose
    # memory this die's kernels cannot read. None: the next one's own (set by LlamaModel).
    next_norm: Any = None


def _stacked(gguf: GGUFFile, backend: Any, names: list[str]) -> Any:
    """One matrix made of the named matrices' rows, or None when their types or widths differ, the backend
    cannot take such a matrix, or it would quantize them at load (`QuantizeAtLoad.quantizes`: bytes concatenated
    here would skip that). The quantized bytes are concatenated, never dequantized."""
    infos = [gguf.tensors[n] for n in names]
    quantizes = getattr(backend, "quantizes", None)
    if (len({i.qtype for i in infos}) != 1 or len({i.cols for i in infos}) != 1
            or not hasattr(backend, "split_cols") or (quantizes is not None and any(map(quantizes, infos)))):
        return None
    raw = np.concatenate([gguf.tensor_bytes(n) for n in names])
    return backend.weight_from_raw(raw, infos[0].qtype, sum(i.rows for i in infos), infos[0].cols)


@dataclass
class KVState:
    """Per-layer K and V for every slot: (n_slots, ctx_cap, n_kv_heads, head_dim) of the backend's kv_dtype."""

    k: list[np.ndarray]
    v: list[np.ndarray]
    ctx_cap: int
    # The caches as the compiled decode path takes them (`backend.kernel_pools`), made on its first step.
    kernel_pools: Any = field(default=None, compare=False, repr=False)

    @property
    def n_slots(self) -> int:
        return self.k[0].shape[0] if self.k else 0


class LlamaModel:
    architecture = "llama"

    def __init__(self, config: LlamaConfig, backend: Any, tok_embd: Any, blocks: list[LlamaBlock],
                 output_norm: np.ndarray, output: Any) -> None:
        self.config = config
        self.backend = backend
        for li, blk in enumerate(blocks):
            if blk.next_norm is None:
                blk.next_norm = blocks[li + 1].attn_norm if li + 1 < len(blocks) else output_norm
        # The backend of each layer, and of the output: all `backend` but on several dies (kernels/cuda/segments.py).
        self.layer_backends = [layer_backend(backend, li, config.n_layers) for li in range(config.n_layers)]
        self.output_backend = last_backend(backend)
        # The element type of the KV cache, and so of a session blob's arrays.
        self.state_dtype = np.dtype(backend.kv_dtype)
        # Backends with the fused kernels for the stacked projections (`rope_qkv_into_cache`, `swiglu_stacked`)
        # run each in one call instead of a split and several ops.
        self._fused_ops = hasattr(backend, "rope_qkv_into_cache") and hasattr(backend, "swiglu_stacked")
        # And a decode step's attention straight from the stacked projection (`attention_decode_qkv`).
        self._fused_decode = self._fused_ops and hasattr(backend, "attention_decode_qkv")
        # Backends that run a whole decode step's layers in one compiled call, for the shapes they serve.
        self._decode_plan = (backend.decode_plan(blocks, output_norm, config.head_dim, tok_embd, output)
                             if hasattr(backend, "decode_plan") else None)
        self.tok_embd = tok_embd
        self.blocks = blocks
        self.output_norm = output_norm
        self.output = output
        self.vocab_size = config.vocab_size
        self.context_length = config.context_length
        self._attention_scale = 1.0 / float(np.sqrt(config.head_dim))

    @classmethod
    def from_gguf(cls, gguf: GGUFFile, backend: Any) -> "LlamaModel":
        cfg = LlamaConfig.from_metadata(gguf.metadata, gguf.architecture)

        def need(name: str) -> str:
            if name not in gguf.tensors:
                raise ModelLoadError(f"{gguf.path}: missing tensor {name!r}")
            return name

        blocks = []
        for i in range(cfg.n_layers):
            p = f"blk.{i}."
            be = layer_backend(backend, i, cfg.n_layers)
            blocks.append(LlamaBlock(
                attn_norm=be.vector(gguf, need(p + "attn_norm.weight")),
                wq=be.weight(gguf, need(p + "attn_q.weight")),
                wk=be.weight(gguf, need(p + "attn_k.weight")),
                wv=be.weight(gguf, need(p + "attn_v.weight")),
                wo=be.weight(gguf, need(p + "attn_output.weight")),
                ffn_norm=be.vector(gguf, need(p + "ffn_norm.weight")),
                w_gate=be.weight(gguf, need(p + "ffn_gate.weight")),
                w_up=be.weight(gguf, need(p + "ffn_up.weight")),
                w_down=be.weight(gguf, need(p + "ffn_down.weight")),
                w_qkv=_stacked(gguf, be, [p + "attn_q.weight", p + "attn_k.weight", p + "attn_v.weight"]),
                w_gate_up=_stacked(gguf, be, [p + "ffn_gate.weight", p + "ffn_up.weight"]),
            ))
        tok_embd = backend.weight(gguf, need("token_embd.weight"))
        last = last_backend(backend)
        if "output.weight" in gguf.tensors:
            output = last.weight(gguf, "output.weight")
        else:  # tied: the embedding itself, or its copy on the last die
            output = tok_embd if last is backend else last.weight(gguf, need("token_embd.weight"))
        for i, blk in enumerate(blocks):
            be, following = layer_backend(backend, i, cfg.n_layers), (
                layer_backend(backend, i + 1, cfg.n_layers) if i + 1 < cfg.n_layers else last)
            if be is not following:
                blk.next_norm = be.vector(gguf, f"blk.{i + 1}.attn_norm.weight" if i + 1 < cfg.n_layers
                                          else "output_norm.weight")
        model = cls(cfg, backend, tok_embd, blocks, last.vector(gguf, need("output_norm.weight")), output)
        model._check_shapes()
        return model

    def _check_shapes(self) -> None:
        c = self.config
        q_dim, kv_dim = c.n_heads * c.head_dim, c.n_kv_heads * c.head_dim
        expected = {"wq": (q_dim, c.d_model), "wk": (kv_dim, c.d_model), "wv": (kv_dim, c.d_model),
                    "wo": (c.d_model, q_dim), "w_gate": (c.ffn_dim, c.d_model), "w_up": (c.ffn_dim, c.d_model),
                    "w_down": (c.d_model, c.ffn_dim)}
        for i, block in enumerate(self.blocks):
            for attr, shape in expected.items():
                w = getattr(block, attr)
                if (w.rows, w.cols) != shape:
                    raise ModelLoadError(f"blk.{i}.{attr}: shape {(w.rows, w.cols)}, expected {shape}")
        if self.output.cols != c.d_model or self.output.rows < c.vocab_size:
            raise ModelLoadError(f"output weight shape {(self.output.rows, self.output.cols)} does not fit the config")

    # -- state ---------------------------------------------------------------------------------------------
    def new_state(self, n_slots: int, ctx_cap: int) -> KVState:
        c = self.config
        shape = (n_slots, ctx_cap, c.n_kv_heads, c.head_dim)
        return KVState(k=[be.kv_pool(*shape, self.state_dtype) for be in self.layer_backends],
                       v=[be.kv_pool(*shape, self.state_dtype) for be in self.layer_backends], ctx_cap=ctx_cap)

    def state_dims(self) -> dict[str, int]:
        """The geometry a session blob must match to be restored into this model."""
        c = self.config
        return {"n_layers": c.n_layers, "n_kv_heads": c.n_kv_heads, "head_dim": c.head_dim}

    def read_slot(self, state: KVState, slot: int, n_tokens: int) -> list[tuple[str, np.ndarray]]:
        """Copies of one slot's state for its first n_tokens positions (for a session blob)."""
        arrays = []
        for li, be in enumerate(self.layer_backends):
            be.begin_step()  # the die of the layer's rings current on this thread
            # np.array copies: a host view must not alias the live pool (on cuda to_host already copies).
            arrays.append((f"k{li}", np.array(be.to_host(state.k[li][slot, :n_tokens]))))
            arrays.append((f"v{li}", np.array(be.to_host(state.v[li][slot, :n_tokens]))))
        return arrays

    def slot_layout(self, n_tokens: int) -> list[tuple[str, tuple[int, ...]]]:
        c = self.config
        shape = (n_tokens, c.n_kv_heads, c.head_dim)
        return [(f"{kind}{li}", shape) for li in range(c.n_layers) for kind in ("k", "v")]

    def write_slot(self, state: KVState, slot: int, arrays: list[tuple[str, np.ndarray]], n_tokens: int) -> None:
        """Install state read by read_slot. The caller has checked the layout with slot_layout."""
        by_name = dict(arrays)
        for li, be in enumerate(self.layer_backends):
            be.begin_step()  # the die of the layer's rings current on this thread
            state.k[li][slot, :n_tokens] = by_name[f"k{li}"]
            state.v[li][slot, :n_tokens] = by_name[f"v{li}"]

    # A slot's first positions can be copied into another (`copy_prefix`): a recurrent model's state cannot.
    supports_prefix_copy = True

    def copy_prefix(self, state: KVState, src: int, dst: int, n_tokens: int) -> None:
        """Slot dst's first n_tokens positions become slot src's (a new conversation starting from what it shares
        with another one)."""
        for be, k, v in zip(self.layer_backends, state.k, state.v):
            be.copy_kv_rows(k, src, dst, n_tokens)
            be.copy_kv_rows(v, src, dst, n_tokens)

    def state_bytes(self, n_slots: int, ctx_cap: int) -> int:
        """Memory of new_state(n_slots, ctx_cap) once every slot is full."""
        return n_slots * ctx_cap * self.kv_bytes_per_token()

    def kv_bytes_per_token(self) -> int:
        c = self.config
        return 2 * c.n_layers * c.n_kv_heads * c.head_dim * self.state_dtype.itemsize

    # -- forward -------------------------------------------------------------------------------------------
    def _rotated_queries(self, be: Any, blk: LlamaBlock, h: Any, k_pool: Any, v_pool: Any, token_slots: Any,
                         positions: Any, n_tok: int) -> Any:
        """The queries (T, Hq, hd) of normed input h, rotated (on `be`, the layer's backend); the rotated keys
        and the values written to the caches at (token_slots, positions)."""
        c = self.config
        if blk.w_qkv is not None and self._fused_ops:
            # Split, rotated and written to the caches in one kernel.
            return be.rope_qkv_into_cache(be.matmul(blk.w_qkv, h), c.n_heads, k_pool, v_pool, token_slots,
                                          positions, c.rope_dim, c.rope_base, False, c.rope_scale)
        q_dim, kv_dim = c.n_heads * c.head_dim, c.n_kv_heads * c.head_dim
        if blk.w_qkv is not None:
            q, k, v = be.split_cols(be.matmul(blk.w_qkv, h), (q_dim, kv_dim, kv_dim))
        else:
            q, k, v = be.matmul(blk.wq, h), be.matmul(blk.wk, h), be.matmul(blk.wv, h)
        q = q.reshape(n_tok, c.n_heads, c.head_dim)
        k = k.reshape(n_tok, c.n_kv_heads, c.head_dim)
        v = v.reshape(n_tok, c.n_kv_heads, c.head_dim)
        be.rope_inplace(q, positions, c.rope_dim, c.rope_base, False, c.rope_scale)
        be.rope_inplace(k, positions, c.rope_dim, c.rope_base, False, c.rope_scale)
        be.kv_write(k_pool, token_slots, positions, k)
        be.kv_write(v_pool, token_slots, positions, v)
        return q

    def forward(self, state: KVState, batch: list[BatchRow]) -> np.ndarray:
        return self.prepare_forward(state, batch)()

    def prepare_forward(self, state: KVState, batch: list[BatchRow]) -> Callable[[], np.ndarray]:
        """`forward` in two parts: the inputs checked and built here, the compute in the returned call. The
        scheduler hands the previous decode step's tokens to the event loop between the two, so that the loop
        wakes while this thread computes without the GIL instead of while it still needs it."""
        be = self.backend
        begin_forward(be, state.k, state.v)
        for row in batch:
            if row.start_pos + len(row.tokens) > state.ctx_cap:
                raise ValueError(f"slot {row.slot}: {row.start_pos}+{len(row.tokens)} tokens exceed ctx {state.ctx_cap}")
        plan = self._decode_plan
        if plan is not None and state.kernel_pools is None:
            state.kernel_pools = (be.kernel_pools(state.k), be.kernel_pools(state.v))
        if (plan is not None and plan.ends is not None
                and all(len(r.tokens) == 1 and r.logits == "last" for r in batch)):
            return self._prepared_decode_step(state, batch, plan)
        lengths = [len(r.tokens) for r in batch]
        offsets = np.cumsum([0, *lengths])
        n_tok = int(offsets[-1])
        decode_only = n_tok == len(batch)
        tokens = be.upload(np.concatenate([r.tokens for r in batch]).astype(np.int64))
        positions = be.upload(np.concatenate(
            [np.arange(r.start_pos, r.start_pos + n, dtype=np.int32) for r, n in zip(batch, lengths)]))
        token_slots = be.upload(np.repeat(np.array([r.slot for r in batch], dtype=np.int32), lengths))
        # The layers alone in one call where the backend has that (the cpu backend; the cuda one runs only whole
        # steps, taken above).
        plan = plan if decode_only and hasattr(be, "decode_layers") and plan is not None and plan.layers_path else None
        return lambda: self._compute(state, batch, plan, tokens, positions, token_slots, offsets)

    def _prepared_decode_step(self, state: KVState, batch: list[BatchRow], plan: Any) -> Callable[[], np.ndarray]:
        """A decode step (one token per row, logits for each) whose embedding-to-logits path is one compiled call
        (`plan.ends`): the GIL is taken back once a step, not after every kernel. Its inputs are built with
        as little Python as possible: it runs cache-cold after every step, ~20 us warm costing ~130 in place."""
        c, be = self.config, self.backend
        n = len(batch)
        tokens = np.fromiter((r.tokens[0] for r in batch), dtype=np.int64, count=n)
        positions = np.fromiter((r.start_pos for r in batch), dtype=np.int32, count=n)
        slots = np.fromiter((r.slot for r in batch), dtype=np.int32, count=n)

        def whole_step() -> np.ndarray:
            logits = be.decode_step(plan, tokens, c.rms_eps, *state.kernel_pools, slots, positions, c.n_heads,
                                    c.rope_dim, c.rope_base, c.rope_scale, self._attention_scale)
            return logits[:, : c.vocab_size]

        return whole_step

    def _compute(self, state: KVState, batch: list[BatchRow], plan: Any, tokens: Any, positions: Any,
                 token_slots: Any, offsets: np.ndarray) -> np.ndarray:
        c, be = self.config, self.backend
        scale = self._attention_scale
        n_tok = int(offsets[-1])
        decode_only = n_tok == len(batch)
        x = be.embed(self.tok_embd, tokens)
        h = be.rmsnorm(x, self.blocks[0].attn_norm, c.rms_eps)
        if plan is not None:
            be.decode_layers(plan, x, h, c.rms_eps, *state.kernel_pools, token_slots, positions, c.n_heads,
                             c.rope_dim, c.rope_base, c.rope_scale, scale)
            return output_logits(be, self.output, h, batch, offsets, c.vocab_size)
        here = self.layer_backends[0] if self.layer_backends else be
        for li, blk in enumerate(self.blocks):
            be = self.layer_backends[li]
            if be is not here:  # the next die's segment (kernels/cuda/segments.py)
                x, h, positions, token_slots = self.backend.hand_over((x, h, positions, token_slots), here, be)
                here = be
            k_pool, v_pool = state.k[li], state.v[li]
            if decode_only and self._fused_decode and (blk.w_qkv is not None or hasattr(be, "concat_cols")):
                # Rotation, cache writes and attention of the whole batch in one launch; q, k and v of different
                # types side by side first (what the compiled step's q|k|v phase writes).
                qkv = (be.matmul(blk.w_qkv, h) if blk.w_qkv is not None
                       else be.concat_cols([be.matmul(w, h) for w in (blk.wq, blk.wk, blk.wv)]))
                attn = be.attention_decode_qkv(qkv, c.n_heads, k_pool, v_pool, token_slots, positions, c.rope_dim,
                                               c.rope_base, False, scale, c.rope_scale)
            else:
                q = self._rotated_queries(be, blk, h, k_pool, v_pool, token_slots, positions, n_tok)
                if decode_only:
                    # One token per sequence: one batched launch over (sequence, head).
                    attn = be.attention_decode_batch(q, k_pool, v_pool, positions, scale, slot_ids=token_slots)
                else:
                    attn = be.empty((n_tok, c.n_heads, c.head_dim))
                    for row, a, b in zip(batch, offsets[:-1], offsets[1:]):
                        be.attention(q[a:b], k_pool, v_pool, row.slot, row.start_pos, scale, out=attn[a:b])
            o = be.matmul(blk.wo, attn.reshape(n_tok, c.n_heads * c.head_dim))
            be.add_rmsnorm(x, o, blk.ffn_norm, c.rms_eps, h)
            if blk.w_gate_up is not None and self._fused_ops:
                ff = be.swiglu_stacked(be.matmul(blk.w_gate_up, h))
            elif blk.w_gate_up is not None:
                ff = be.swiglu(*be.split_cols(be.matmul(blk.w_gate_up, h), (c.ffn_dim, c.ffn_dim)))
            else:
                ff = be.swiglu(be.matmul(blk.w_gate, h), be.matmul(blk.w_up, h))
            d = be.matmul(blk.w_down, ff)
            be.add_rmsnorm(x, d, blk.next_norm, c.rms_eps, h)

        if self.output_backend is not here:
            (h,) = self.backend.hand_over((h,), here, self.output_backend)
        # h now holds output_norm(x) for every position.
        return output_logits(self.output_backend, self.output, h, batch, offsets, c.vocab_size)
