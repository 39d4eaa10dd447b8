"""Hybrid-model speed: Qwen3.5-MoE shapes (Gated DeltaNet + gated attention + routed experts) on the CPU.

    .venv/bin/python bench/hybrid.py [--threads 2] [--layers 8] [--experts 128] [--prompt 512] [--decode 32]
                                     [--batch 4] [--runs 2]

The model is a random-weight `qwen35moe` GGUF with the real Qwen3.5-35B-A3B layer shapes (D 2048, 16/2 heads
of 256, 16 key / 32 value DeltaNet heads of 128, experts of 512 with top-8 and a shared expert, vocab 248320,
three DeltaNet blocks per attention block) but fewer layers and experts; it is written once (Q4_K matrices,
Q6_K output, like a Q4_K_M file) under $PANTHEON_HOME/bench/. Measured, each as the best of --runs:

  prefill tok/s       the prompt in 256-token chunks, as the scheduler runs it (chunked delta rule)
  prefill recurrent   the same with the token-by-token delta rule, and the ratio chunked / recurrent
  decode tok/s        one sequence; and --batch sequences decoding together (aggregate tok/s)
  delta-rule kernel   one layer's 256-token prefill, chunked vs recurrent, on this process's CPU time

Rates are given per wall-clock second and per CPU second of the process (all its threads): on a shared
machine the wall-clock rates depend on the load (recorded), the CPU-time ones much less. Prints a table and
writes bench/results/<date>-hybrid-<threads>t.json.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import write_result  # noqa: E402
from pantheon.config import read_env  # noqa: E402
from pantheon.io.gguf_file import open_gguf  # noqa: E402
from pantheon.kernels.cpu import ssm  # noqa: E402
from pantheon.kernels.cpu.backend import CpuBackend  # noqa: E402
from pantheon.models.base import BatchRow  # noqa: E402
from pantheon.models.registry import load_model  # noqa: E402

ARCH = "qwen35moe"
D, N_HEADS, N_KV, HEAD_DIM, ROPE_DIM = 2048, 16, 2, 256, 64
NK, NV, DK, DV, CONV_K = 16, 32, 128, 128, 4
EXPERT_FFN, SHARED_FFN, TOP_K, VOCAB = 512, 512, 8, 248320
CHUNK = 256  # the scheduler's prefill chunk

F32, Q8_0, Q4_K, Q6_K = 0, 8, 12, 14
BLOCK = {Q8_0: (32, 34), Q4_K: (256, 144), Q6_K: (256, 210)}


# -- the model file ----------------------------------------------------------------------------------------


def random_blocks(rng: np.random.Generator, qtype: int, shape: tuple[int, ...]) -> np.ndarray:
    """Random quantized blocks whose scales give weights of std ~ 1/sqrt(cols) (finite activations)."""
    block, nbytes = BLOCK[qtype]
    *lead, cols = shape
    n_blocks = int(np.prod(lead)) * (cols // block)
    raw = np.frombuffer(rng.bytes(n_blocks * nbytes), np.uint8).reshape(n_blocks, nbytes).copy()
    std = 1.0 / np.sqrt(cols)
    if qtype == Q8_0:
        raw[:, 0:2] = np.full((n_blocks, 1), std / 74, np.float16).view(np.uint8)
    elif qtype == Q4_K:  # d * sc * q - dmin * m, sc, m < 64, q < 16: dmin = 7.5 d centres the values
        raw[:, 0:2] = np.full((n_blocks, 1), std / 200, np.float16).view(np.uint8)
        raw[:, 2:4] = np.full((n_blocks, 1), 7.5 * std / 200, np.float16).view(np.uint8)
    else:  # Q6_K: d * scale * (q - 32), scale int8
        raw[:, 208:210] = np.full((n_blocks, 1), std / 1300, np.float16).view(np.uint8)
    return raw.reshape(*lead, cols // block * nbytes)


def tensor_plan(layers: int, experts: int) -> list[tuple[str, tuple[int, ...], int]]:
    """(name, numpy shape, ggml type) of every tensor, in file order."""
    conv_dim, value_dim = 2 * NK * DK + NV * DV, NV * DV
    plan = [("token_embd.weight", (VOCAB, D), Q4_K), ("output_norm.weight", (D,), F32),
            ("output.weight", (VOCAB, D), Q6_K)]
    for i in range(layers):
        p = f"blk.{i}."
        plan += [(p + "attn_norm.weight", (D,), F32), (p + "post_attention_norm.weight", (D,), F32)]
        if (i + 1) % 4:
            plan += [(p + "attn_qkv.weight", (conv_dim, D), Q4_K), (p + "attn_gate.weight", (value_dim, D), Q4_K),
                     (p + "ssm_beta.weight", (NV, D), Q8_0), (p + "ssm_alpha.weight", (NV, D), Q8_0),
                     (p + "ssm_conv1d.weight", (conv_dim, CONV_K), F32), (p + "ssm_a", (NV,), F32),
                     (p + "ssm_dt.bias", (NV,), F32), (p + "ssm_norm.weight", (DV,), F32),
                     (p + "ssm_out.weight", (D, value_dim), Q4_K)]
        else:
            plan += [(p + "attn_q.weight", (2 * N_HEADS * HEAD_DIM, D), Q4_K),
                     (p + "attn_k.weight", (N_KV * HEAD_DIM, D), Q4_K),
                     (p + "attn_v.weight", (N_KV * HEAD_DIM, D), Q4_K),
                     (p + "attn_output.weight", (D, N_HEADS * HEAD_DIM), Q4_K),
                     (p + "attn_q_norm.weight", (HEAD_DIM,), F32), (p + "attn_k_norm.weight", (HEAD_DIM,), F32)]
        plan += [(p + "ffn_gate_inp.weight", (experts, D), F32),
                 (p + "ffn_gate_exps.weight", (experts, EXPERT_FFN, D), Q4_K),
                 (p + "ffn_up_exps.weight", (experts, EXPERT_FFN, D), Q4_K),
                 (p + "ffn_down_exps.weight", (experts, D, EXPERT_FFN), Q4_K),
                 (p + "ffn_gate_inp_shexp.weight", (D,), F32),
                 (p + "ffn_gate_shexp.weight", (SHARED_FFN, D), Q4_K),
                 (p + "ffn_up_shexp.weight", (SHARED_FFN, D), Q4_K),
                 (p + "ffn_down_shexp.weight", (D, SHARED_FFN), Q4_K)]
    return plan


def f32_values(rng: np.random.Generator, name: str, shape: tuple[int, ...]) -> np.ndarray:
    if name.endswith("ssm_a"):
        return -rng.uniform(0.05, 4.0, shape).astype(np.float32)
    if name.endswith(("norm.weight", "ssm_dt.bias")):
        return (1.0 + 0.1 * rng.standard_normal(shape)).astype(np.float32)
    return (rng.standard_normal(shape) / np.sqrt(shape[-1])).astype(np.float32)


def write_model(path: Path, layers: int, experts: int) -> None:
    import gguf

    from bench.twin import write_tensors

    rng = np.random.default_rng(0)
    plan = tensor_plan(layers, experts)
    w = gguf.GGUFWriter(str(path.with_suffix(".tmp")), ARCH)
    w.add_name("pantheon-bench-qwen35moe")
    for add, value in [(w.add_block_count, layers), (w.add_context_length, 262144), (w.add_embedding_length, D),
                       (w.add_feed_forward_length, SHARED_FFN), (w.add_head_count, N_HEADS),
                       (w.add_head_count_kv, N_KV), (w.add_key_length, HEAD_DIM), (w.add_value_length, HEAD_DIM),
                       (w.add_layer_norm_rms_eps, 1e-6), (w.add_rope_dimension_count, ROPE_DIM),
                       (w.add_rope_freq_base, 1e7), (w.add_ssm_conv_kernel, CONV_K), (w.add_ssm_state_size, DK),
                       (w.add_ssm_group_count, NK), (w.add_ssm_time_step_rank, NV), (w.add_ssm_inner_size, NV * DV),
                       (w.add_expert_count, experts), (w.add_expert_used_count, TOP_K),
                       (w.add_expert_feed_forward_length, EXPERT_FFN),
                       (w.add_expert_shared_feed_forward_length, SHARED_FFN), (w.add_vocab_size, VOCAB)]:
        add(value)
    w.add_rope_dimension_sections([11, 11, 10, 0])
    w.add_uint32(f"{ARCH}.full_attention_interval", 4)
    write_tensors(w, plan, lambda qtype, name: BLOCK[qtype],
                  lambda name, shape, qtype: f32_values(rng, name, shape) if qtype == F32 else
                  random_blocks(rng, qtype, shape))
    w.close()
    path.with_suffix(".tmp").replace(path)


# -- measurements ------------------------------------------------------------------------------------------


class RecurrentPrefill(CpuBackend):
    """The cpu backend with the token-by-token delta rule in place of the chunked one."""

    gated_delta_chunked = staticmethod(ssm.gated_delta_recurrent)


def prefill(model, tokens: np.ndarray) -> tuple[float, float]:
    """(tokens per wall second, tokens per CPU second of this process)."""
    state = model.new_state(1, len(tokens) + 8)
    wall, cpu = time.perf_counter(), time.process_time()
    for a in range(0, len(tokens), CHUNK):
        b = min(len(tokens), a + CHUNK)
        model.forward(state, [BatchRow(0, tokens[a:b], a, "last" if b == len(tokens) else "none")])
    return len(tokens) / (time.perf_counter() - wall), len(tokens) / (time.process_time() - cpu)


def decode(model, tokens: np.ndarray, n_decode: int, batch: int) -> tuple[float, float]:
    """(tokens per wall second, per CPU second), all `batch` sequences counted."""
    state = model.new_state(batch, len(tokens) + n_decode + 8)
    for s in range(batch):
        model.forward(state, [BatchRow(s, tokens, 0, "none")])
    pos = len(tokens)
    next_tokens = [int(t) for t in tokens[:batch]]
    wall, cpu = time.perf_counter(), time.process_time()
    for _ in range(n_decode):
        logits = model.forward(state, [BatchRow(s, np.array([next_tokens[s]], np.int32), pos) for s in range(batch)])
        next_tokens = [int(np.argmax(row)) for row in logits]
        pos += 1
    return batch * n_decode / (time.perf_counter() - wall), batch * n_decode / (time.process_time() - cpu)


def best(runs: int, measure) -> tuple[float, float]:
    results = [measure() for _ in range(runs)]
    return max(r[0] for r in results), max(r[1] for r in results)


def delta_kernel_ms(threads: int, runs: int) -> dict[str, float]:
    """CPU milliseconds of one layer's delta rule over a 256-token chunk (other load drops out)."""
    import numba

    numba.set_num_threads(threads)
    rng = np.random.default_rng(1)
    packed = rng.standard_normal((1, CHUNK, 2 * NK * DK + NV * DV)).astype(np.float32)
    q = packed[:, :, : NK * DK].reshape(1, CHUNK, NK, DK)
    k = packed[:, :, NK * DK : 2 * NK * DK].reshape(1, CHUNK, NK, DK)
    v = packed[:, :, 2 * NK * DK :].reshape(1, CHUNK, NV, DV)
    g, beta = ssm.gdn_gates(rng.standard_normal((CHUNK, NV)).astype(np.float32),
                            rng.standard_normal((CHUNK, NV)).astype(np.float32),
                            -rng.uniform(0.05, 4.0, NV).astype(np.float32), np.zeros(NV, np.float32))
    g, beta = g.reshape(1, CHUNK, NV), beta.reshape(1, CHUNK, NV)
    heads = (np.arange(NV) % NK).astype(np.int32)
    states = np.zeros((1, NV, DV, DK), np.float32)
    out = {}
    for name, rule in (("chunked", ssm.gated_delta_chunked), ("recurrent", ssm.gated_delta_recurrent)):
        rule(q, k, v, g, beta, states, [0], heads, DK ** -0.5, 1e-6)
        best = float("inf")
        for _ in range(max(3, runs)):
            t = time.process_time()
            rule(q, k, v, g, beta, states, [0], heads, DK ** -0.5, 1e-6)
            best = min(best, time.process_time() - t)
        out[name] = 1e3 * best
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--experts", type=int, default=128)
    ap.add_argument("--prompt", type=int, default=512)
    ap.add_argument("--decode", type=int, default=32)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--runs", type=int, default=2)
    args = ap.parse_args()
    env = read_env()
    folder = env.home / "bench"
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"qwen35moe-35b-a3b-shapes-{args.layers}L-{args.experts}E-q4k.gguf"
    if not path.exists():
        print(f"writing {path} ...", flush=True)
        write_model(path, args.layers, args.experts)
    print(f"model: {path} ({path.stat().st_size / 2**30:.2f} GiB)", flush=True)

    backend = CpuBackend(args.threads)
    model = load_model(open_gguf(path, env.cache_dir), backend)
    tokens = np.random.default_rng(2).integers(0, VOCAB, args.prompt).astype(np.int32)
    model.forward(model.new_state(2, 64), [BatchRow(0, tokens[:40], 0)])  # compile / warm up every path
    results: dict[str, float] = {}
    results["prefill_tok_s"], results["prefill_tok_per_cpu_s"] = best(args.runs, lambda: prefill(model, tokens))
    model.backend = RecurrentPrefill(args.threads)
    results["prefill_recurrent_tok_s"], results["prefill_recurrent_tok_per_cpu_s"] = best(
        args.runs, lambda: prefill(model, tokens))
    model.backend = backend
    results["prefill_chunked_over_recurrent"] = results["prefill_tok_s"] / results["prefill_recurrent_tok_s"]
    results["prefill_chunked_over_recurrent_cpu"] = (results["prefill_tok_per_cpu_s"]
                                                     / results["prefill_recurrent_tok_per_cpu_s"])
    results["decode_tok_s"], results["decode_tok_per_cpu_s"] = best(
        args.runs, lambda: decode(model, tokens[:64], args.decode, 1))
    key = f"decode_batch{args.batch}"
    results[f"{key}_tok_s"], results[f"{key}_tok_per_cpu_s"] = best(
        args.runs, lambda: decode(model, tokens[:64], args.decode, args.batch))
    kernel = delta_kernel_ms(args.threads, args.runs)
    results["delta_kernel_chunked_ms"] = kernel["chunked"]
    results["delta_kernel_recurrent_ms"] = kernel["recurrent"]
    results["delta_kernel_chunked_over_recurrent_speed"] = kernel["recurrent"] / kernel["chunked"]

    load = os.getloadavg()
    n_delta = sum((i + 1) % 4 != 0 for i in range(args.layers))
    print(f"\nqwen35moe, 35B-A3B layer shapes, {args.layers} layers ({n_delta} DeltaNet), {args.experts} experts "
          f"top-{TOP_K}, Q4_K; {args.threads} threads; load average {load[0]:.1f}")
    print(f"{'measure':<40}{'value':>12}")
    for key, value in results.items():
        print(f"{key:<40}{value:>12.3f}")
    out = write_result(f"hybrid-{args.threads}t", {"model": path.name, "layers": args.layers, "experts": args.experts,
                                  "threads": args.threads, "prompt_tokens": args.prompt, "decode_tokens": args.decode,
                                  "load_average": load, **results})
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
