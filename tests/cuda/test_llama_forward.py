"""A whole tiny llama on CudaBackend gives CpuBackend's logits: prefill, greedy decode, a batched decode of two
slots and a mixed step (one slot decoding while the other prefills), under the simulator or on a GPU.

The model is written here with gguf.GGUFWriter: D=64, 2 layers, 4 query / 2 kv heads, vocab 128, and a mix of
weight types (Q8_0 tied embeddings/output, Q4_1, Q4_0, Q5_1, F16, F32).
"""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import pytest

from pantheon.io.gguf_file import open_gguf
from pantheon.kernels.cpu.backend import CpuBackend
from pantheon.models.base import BatchRow
from pantheon.models.llama import LlamaModel

pytestmark = [pytest.mark.cuda_kernels, pytest.mark.slow]

T = gguf.GGMLQuantizationType
VOCAB, D, LAYERS, HEADS, KV_HEADS, FFN, CTX = 128, 64, 2, 4, 2, 128, 64
WEIGHT_TYPES = {"attn_q": T.Q4_1, "attn_k": T.Q8_0, "attn_v": T.F16, "attn_output": T.F32,
                "ffn_gate": T.Q4_0, "ffn_up": T.Q5_1, "ffn_down": T.Q4_1}


def write_model(path: Path, seed: int = 7) -> Path:
    rng = np.random.default_rng(seed)
    hd = D // HEADS
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_block_count(LAYERS)
    w.add_context_length(CTX)
    w.add_embedding_length(D)
    w.add_feed_forward_length(FFN)
    w.add_head_count(HEADS)
    w.add_head_count_kv(KV_HEADS)
    w.add_rope_dimension_count(hd)
    w.add_rope_freq_base(10000.0)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_vocab_size(VOCAB)

    def add(name: str, array: np.ndarray, qtype: T = T.F32) -> None:
        if qtype == T.F32:
            w.add_tensor(name, array)
        elif qtype == T.F16:
            w.add_tensor(name, array.astype(np.float16))
        else:
            w.add_tensor(name, gguf.quants.quantize(array, qtype), raw_dtype=qtype)

    def matrix(rows: int, cols: int) -> np.ndarray:
        return (rng.standard_normal((rows, cols)) * 2 / np.sqrt(cols)).astype(np.float32)

    def norm() -> np.ndarray:
        return (1 + 0.1 * rng.standard_normal(D)).astype(np.float32)

    add("token_embd.weight", matrix(VOCAB, D), T.Q8_0)
    add("output_norm.weight", norm())
    shapes = {"attn_q": (HEADS * hd, D), "attn_k": (KV_HEADS * hd, D), "attn_v": (KV_HEADS * hd, D),
              "attn_output": (D, HEADS * hd), "ffn_gate": (FFN, D), "ffn_up": (FFN, D), "ffn_down": (D, FFN)}
    for i in range(LAYERS):
        add(f"blk.{i}.attn_norm.weight", norm())
        add(f"blk.{i}.ffn_norm.weight", norm())
        for name, shape in shapes.items():
            add(f"blk.{i}.{name}.weight", matrix(*shape), WEIGHT_TYPES[name])
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def assert_logits_close(got: np.ndarray, want: np.ndarray) -> None:
    assert got.shape == want.shape and np.isfinite(got).all()
    scale = float(np.abs(want).max())
    err = float(np.abs(got.astype(np.float64) - want).max())
    assert err <= 2e-4 * scale, f"max abs diff {err:.3g} against logit scale {scale:.3g}"


def test_tiny_llama_matches_cpu(tmp_path: Path) -> None:
    from pantheon.kernels.cuda.backend import CudaBackend

    gguf_file = open_gguf(write_model(tmp_path / "tiny.gguf"))
    models = [LlamaModel.from_gguf(gguf_file, CpuBackend(int8=False)), LlamaModel.from_gguf(gguf_file, CudaBackend())]
    states = [m.new_state(2, CTX) for m in models]

    def step(batch: list[BatchRow]) -> np.ndarray:
        cpu, gpu = (m.forward(s, batch) for m, s in zip(models, states))
        assert_logits_close(gpu, cpu)
        return cpu

    prompt = np.array([5, 17, 99, 3, 64, 127, 0], dtype=np.int32)
    logits = step([BatchRow(slot=0, tokens=prompt, start_pos=0, logits="all")])  # tiled prefill
    assert logits.shape == (len(prompt), VOCAB)
    second = np.array([42, 8], dtype=np.int32)
    step([BatchRow(slot=1, tokens=second, start_pos=0)])  # a short chunk takes the split-K kernel
    pos = [len(prompt), len(second)]
    tokens = [int(np.argmax(logits[-1])), 11]
    for _ in range(2):  # greedy decode of slot 0 alone
        logits = step([BatchRow(slot=0, tokens=np.array([tokens[0]], np.int32), start_pos=pos[0])])
        tokens[0], pos[0] = int(np.argmax(logits[-1])), pos[0] + 1
    for _ in range(2):  # batched decode of both slots, in reverse slot order
        batch = [BatchRow(slot=s, tokens=np.array([tokens[s]], np.int32), start_pos=pos[s]) for s in (1, 0)]
        logits = step(batch)
        for row, s in enumerate((1, 0)):
            tokens[s], pos[s] = int(np.argmax(logits[row])), pos[s] + 1
    # A mixed step: slot 0 decodes one token while slot 1 prefills three more.
    chunk = np.array([1, 2, 3], dtype=np.int32)
    step([BatchRow(slot=0, tokens=np.array([tokens[0]], np.int32), start_pos=pos[0]),
          BatchRow(slot=1, tokens=chunk, start_pos=pos[1], logits="all")])
