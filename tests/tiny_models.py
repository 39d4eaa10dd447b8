"""Tiny random-weight llama GGUFs for tests that need a second model or float weights (not committed:
written into a temp dir). They carry the default model's tokenizer and chat template, so they serve."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import gguf
import numpy as np

from pantheon.config import read_env
from pantheon.io.gguf_file import open_gguf
from pantheon.kernels.reference.quant import random_weight_bytes

_Q = gguf.GGMLQuantizationType
# The types gguf's own quantizer writes.
_QUANTIZABLE = frozenset({_Q.Q4_0, _Q.Q4_1, _Q.Q5_0, _Q.Q5_1, _Q.Q8_0})

TOKENIZER_KEYS = ("tokenizer.ggml.model", "tokenizer.ggml.pre", "tokenizer.ggml.tokens", "tokenizer.ggml.token_type",
                  "tokenizer.ggml.merges", "tokenizer.ggml.bos_token_id", "tokenizer.ggml.eos_token_id",
                  "tokenizer.ggml.add_bos_token", "tokenizer.chat_template")


def default_tokenizer_metadata() -> dict[str, Any]:
    env = read_env()
    meta = open_gguf(env.default_model_path, env.cache_dir).metadata
    return {k: meta[k] for k in TOKENIZER_KEYS if k in meta}


def _add_metadata(w: gguf.GGUFWriter, meta: dict[str, Any]) -> None:
    for key, value in meta.items():
        if isinstance(value, bool):
            w.add_bool(key, value)
        elif isinstance(value, int):
            w.add_uint32(key, value)
        elif isinstance(value, str):
            w.add_string(key, value)
        elif isinstance(value, list):
            w.add_array(key, value)


def write_tiny_llama(path: Path, *, seed: int = 0, n_layers: int = 2, d: int = 64, heads: int = 4, kv_heads: int = 2,
                     ffn: int = 128, ctx: int = 512, qtype: gguf.GGMLQuantizationType = gguf.GGMLQuantizationType.F32,
                     name: str = "tiny", types: dict[str, int] | None = None) -> Path:
    """types: a tensor name's type where it is not qtype (e.g. {"blk.0.attn_v.weight": Q6_K}). Types that gguf
    cannot quantize (the K-quants, IQ4) get random bytes of that type (`random_weight_bytes`: every packed field's
    bit patterns, scales of magnitude 1e-3..1e-1) in place of the matrix's values."""
    meta = default_tokenizer_metadata()
    vocab = len(meta["tokenizer.ggml.tokens"])
    rng = np.random.default_rng(seed)
    hd = d // heads
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_string("general.name", name)
    w.add_block_count(n_layers)
    w.add_context_length(ctx)
    w.add_embedding_length(d)
    w.add_feed_forward_length(ffn)
    w.add_head_count(heads)
    w.add_head_count_kv(kv_heads)
    w.add_rope_dimension_count(hd)
    w.add_rope_freq_base(10000.0)
    w.add_layer_norm_rms_eps(1e-5)
    _add_metadata(w, meta)

    def matrix(rows: int, cols: int) -> np.ndarray:
        return (rng.standard_normal((rows, cols)) / np.sqrt(cols)).astype(np.float32)

    def add(name_: str, array: np.ndarray) -> None:
        kind = gguf.GGMLQuantizationType((types or {}).get(name_, qtype))
        if kind == gguf.GGMLQuantizationType.F32 or array.ndim == 1:
            w.add_tensor(name_, array)
        elif kind == gguf.GGMLQuantizationType.F16:
            w.add_tensor(name_, array.astype(np.float16))
        elif kind in _QUANTIZABLE:
            w.add_tensor(name_, gguf.quants.quantize(array, kind), raw_dtype=kind)
        else:
            w.add_tensor(name_, random_weight_bytes(kind, *array.shape, rng), raw_dtype=kind)

    add("token_embd.weight", matrix(vocab, d))
    add("output_norm.weight", (1 + 0.1 * rng.standard_normal(d)).astype(np.float32))
    for i in range(n_layers):
        p = f"blk.{i}."
        add(p + "attn_norm.weight", (1 + 0.1 * rng.standard_normal(d)).astype(np.float32))
        add(p + "ffn_norm.weight", (1 + 0.1 * rng.standard_normal(d)).astype(np.float32))
        add(p + "attn_q.weight", matrix(heads * hd, d))
        add(p + "attn_k.weight", matrix(kv_heads * hd, d))
        add(p + "attn_v.weight", matrix(kv_heads * hd, d))
        add(p + "attn_output.weight", matrix(d, heads * hd))
        add(p + "ffn_gate.weight", matrix(ffn, d))
        add(p + "ffn_up.weight", matrix(ffn, d))
        add(p + "ffn_down.weight", matrix(d, ffn))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path
