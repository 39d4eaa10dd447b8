"""Run by tests/kernels/test_cache_consistency.py in a child process: every cpu op once on fixed inputs, then
one line of output hashes. Run twice against one NUMBA_CACHE_DIR, the first run compiles every kernel and the
second loads them from the cache: the lines must be equal. `python -m tests.kernels.cache_probe ops|hybrid|decode`
runs one of its parts (the test runs them side by side: compiling is single-threaded)."""

from __future__ import annotations

import hashlib
import sys
from pathlib import Path

import numpy as np

from pantheon.io.gguf_file import open_gguf
from pantheon.kernels.cpu import int8dot, ops, quant
from pantheon.kernels.cpu.backend import CpuBackend
from pantheon.kernels.reference import quant as reference
from pantheon.models.base import BatchRow
from pantheon.models.registry import load_model

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "qwen35"


def digest(a: np.ndarray) -> str:
    return hashlib.blake2b(np.ascontiguousarray(a).tobytes(), digest_size=6).hexdigest()


def ops_part() -> dict[str, str]:
    """The kernels one at a time."""
    rng = np.random.default_rng(0)
    x = rng.standard_normal((40, 576)).astype(np.float32)
    w = rng.standard_normal(576).astype(np.float32)
    out = {"rmsnorm": digest(ops.rmsnorm(x, w, 1e-5))}
    residual, normed = x.copy(), np.empty_like(x)
    ops.add_rmsnorm(residual, x * 0.5, w, 1e-5, normed)
    out["add_rmsnorm"] = digest(normed) + digest(residual)
    gate, up = rng.standard_normal((2, 40, 1536)).astype(np.float32)
    out["swiglu"] = digest(ops.swiglu(gate, up))
    q = rng.standard_normal((40, 9, 64)).astype(np.float32)
    k, v = rng.standard_normal((2, 64, 3, 64)).astype(np.float32)
    out["attention"] = digest(ops.attention(q, k, v, 0, 0.125))
    for n in (40, 3):  # the parallel and the serial rope kernels
        rotated = q[:n].copy()
        ops.rope_inplace(rotated, np.arange(100, 100 + n, dtype=np.int32), 64, 10000.0, False)
        out[f"rope{n}"] = digest(rotated)
    for n in (40, 3):  # the fused split + rope + cache write, parallel and serial, into a float16 cache
        qkv = rng.standard_normal((n, 15 * 64)).astype(np.float32)
        k_pool, v_pool = np.zeros((2, 2, 64, 3, 64), dtype=np.float16)
        slots, positions = np.zeros(n, np.int32), np.arange(n, dtype=np.int32)
        rotated = ops.rope_qkv_into_cache(qkv, 9, k_pool, v_pool, slots, positions, 64, 10000.0, False)
        decoded = ops.attention_decode_batch(rotated[-1:], k_pool, v_pool, positions[-1:], 0.125,
                                             slot_ids=slots[:1])
        out[f"qkv{n}"] = digest(rotated) + digest(k_pool) + digest(v_pool) + digest(decoded)
    # The fused decode step (rotation, cache writes and attention in one launch), one sequence and three.
    qkv = rng.standard_normal((3, 15 * 64)).astype(np.float32)
    k_pool, v_pool = rng.standard_normal((2, 3, 600, 3, 64)).astype(np.float16)
    for n in (1, 3):
        decoded = ops.attention_decode_qkv(qkv[:n], 9, k_pool, v_pool, np.arange(n, dtype=np.int32),
                                           np.array([520, 7, 90][:n], np.int32), 64, 10000.0, False, 0.125)
        out[f"decode_qkv{n}"] = digest(decoded) + digest(k_pool) + digest(v_pool)
    out["swiglu_stacked"] = digest(ops.swiglu_stacked(np.concatenate([gate, up], axis=1)))
    for qtype in (3, 8, 12):  # Q4_1, Q8_0, Q4_K
        weight = quant.prepare_weight(reference.random_weight_bytes(qtype, 64, 768, rng), qtype, 64, 768)
        xs = rng.standard_normal((9, 768)).astype(np.float32)
        out[f"matmul{qtype}"] = digest(quant.matmul(weight, xs))
        if int8dot.INT8_ISA is not None and qtype in int8dot.INT8_TYPES:
            out[f"int8_{qtype}"] = digest(quant.matmul(weight, xs, int8=True))
            prefill = rng.standard_normal((48, 768)).astype(np.float32)  # quantized on all threads
            out[f"int8_{qtype}_prefill"] = digest(quant.matmul(weight, prefill, int8=True))
    return out


def hybrid_part() -> dict[str, str]:
    """Whole forwards of the hybrid models."""
    out = {}
    # The hybrid models' kernels (conv, delta rule chunked and recurrent, gated norm, MoE) through whole forwards.
    for name in ("qwen35", "qwen35moe"):
        model = load_model(open_gguf(FIXTURES / f"{name}.gguf", None), CpuBackend())
        state = model.new_state(1, 64)
        tokens = (np.arange(40, dtype=np.int32) * 7) % 200
        prefill = model.forward(state, [BatchRow(0, tokens, 0, "all")])
        decode = model.forward(state, [BatchRow(0, np.array([5], np.int32), 40)])
        out[name] = digest(prefill) + digest(decode)
    return out


def decode_part() -> dict[str, str]:
    """The default model's compiled decode step (kernels/cpu/decode_layers.py) and its Python loop."""
    out = {}
    from pantheon.config import ModelOptions, read_env
    from pantheon.engine.loader import load_served_model

    env = read_env()
    if env.default_model_path.exists() and int8dot.INT8_ISA is not None:
        model = load_served_model(ModelOptions(path=env.default_model_path, name="probe"), env,
                                  CpuBackend(2, int8=True)).model
        for name, plan in (("decode_step", model._decode_plan), ("decode_loop", None)):
            model._decode_plan = plan
            state = model.new_state(2, 64)
            model.forward(state, [BatchRow(0, np.arange(1, 30, dtype=np.int32), 0, "none")])
            model.forward(state, [BatchRow(1, np.arange(5, 20, dtype=np.int32), 0, "none")])
            logits = model.forward(state, [BatchRow(0, np.array([7], np.int32), 29),
                                           BatchRow(1, np.array([9], np.int32), 15)])
            out[name] = digest(logits) + digest(state.k[-1]) + digest(state.v[-1])
    return out


PARTS = {"ops": ops_part, "hybrid": hybrid_part, "decode": decode_part}


def main(part: str) -> None:
    print(" ".join(f"{name}={value}" for name, value in PARTS[part]().items()))


if __name__ == "__main__":
    main(sys.argv[1])
