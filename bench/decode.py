"""Prefill and single-stream decode speed on the default model, Pantheon vs llama.cpp, in one run.

    .venv/bin/python bench/decode.py [--threads 2] [--prompt 512] [--decode 128] [--runs 3] [--model FILE.gguf]

llama.cpp runs through llama-cpp-python when it is importable (`pip install -e '.[bench]'`), with the same
thread count, prompt tokens and greedy decoding. Prints medians and the ratio Pantheon / llama.cpp, and
writes bench/results/<date>-decode.json. Pantheon runs the int8-activation path by default (where the CPU has
the instructions); PANTHEON_CPU_INT8=0 measures the float32 path.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numba
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import default_model, median, prompt_tokens, write_result  # noqa: E402
from pantheon.config import ModelOptions, read_env  # noqa: E402
from pantheon.engine.loader import load_served_model  # noqa: E402
from pantheon.kernels.cpu.backend import CpuBackend  # noqa: E402
from pantheon.models.base import BatchRow  # noqa: E402


def bench_pantheon(path: Path, threads: int, n_prompt: int, n_decode: int, runs: int) -> dict[str, float]:
    served = load_served_model(ModelOptions(path=path, name="bench"), read_env(), CpuBackend(threads, int8=read_env().cpu_int8))
    model = served.model
    tokens = np.array(prompt_tokens(served.tokenizer, n_prompt), np.int32)
    state = model.new_state(1, n_prompt + n_decode + 8)
    model.forward(state, [BatchRow(0, tokens[:16], 0)])  # compile / warm up
    prefill, decode = [], []
    for _ in range(runs):
        t = time.perf_counter()
        logits = model.forward(state, [BatchRow(0, tokens, 0)])
        prefill.append(n_prompt / (time.perf_counter() - t))
        tok, pos = int(np.argmax(logits[0])), n_prompt
        t = time.perf_counter()
        for _ in range(n_decode):
            logits = model.forward(state, [BatchRow(0, np.array([tok], np.int32), pos)])
            tok, pos = int(np.argmax(logits[0])), pos + 1
        decode.append(n_decode / (time.perf_counter() - t))
    return {"prefill_tok_s": median(prefill), "decode_tok_s": median(decode)}


@numba.njit(parallel=True, nogil=True, cache=True, fastmath=True)
def _read_all(a: np.ndarray) -> float:
    total = np.float32(0.0)
    for i in numba.prange(a.shape[0]):
        total += a[i]
    return total


def memory_read_gb_s(threads: int, size_bytes: int = 1 << 30) -> float:
    """Measured read bandwidth: a parallel sum over a 1 GiB float32 array (best of 5)."""
    numba.set_num_threads(threads)
    a = np.ones(size_bytes // 4, dtype=np.float32)
    _read_all(a)
    best = min(_timed(lambda: _read_all(a)) for _ in range(5))
    return size_bytes / best / 1e9


def _timed(fn) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def weight_bytes_per_token(path: Path) -> int:
    """Bytes of weights one decode step reads: every matrix once; the token embedding table is read whole
    only when it is also the output matrix (tied), else one row of it."""
    from pantheon.io.gguf_file import open_gguf

    gguf = open_gguf(path, read_env().cache_dir)
    total = sum(t.nbytes for name, t in gguf.tensors.items() if name != "token_embd.weight")
    embd = gguf.tensors["token_embd.weight"]
    return total + (embd.nbytes if "output.weight" not in gguf.tensors else embd.nbytes // embd.rows)


def bench_llama_cpp(path: Path, threads: int, tokens: list[int], n_decode: int, runs: int) -> dict[str, float] | None:
    try:
        import llama_cpp
    except ImportError:
        return None
    llm = llama_cpp.Llama(model_path=str(path), n_ctx=len(tokens) + n_decode + 8, n_batch=len(tokens),
                          n_threads=threads, n_threads_batch=threads, verbose=False)
    llm.eval(tokens[:16])
    prefill, decode = [], []
    for _ in range(runs):
        llm.reset()
        t = time.perf_counter()
        llm.eval(tokens)
        prefill.append(len(tokens) / (time.perf_counter() - t))
        t = time.perf_counter()
        for _ in range(n_decode):
            tok = llm.sample(temp=0.0)
            llm.eval([tok])
        decode.append(n_decode / (time.perf_counter() - t))
    return {"prefill_tok_s": median(prefill), "decode_tok_s": median(decode)}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--prompt", type=int, default=512)
    ap.add_argument("--decode", type=int, default=128)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--model", type=Path, help="another GGUF file (default: the default model)")
    args = ap.parse_args()
    path = args.model or default_model()
    ours = bench_pantheon(path, args.threads, args.prompt, args.decode, args.runs)
    from pantheon.io.gguf_file import open_gguf
    from pantheon.io.tokenizer import Tokenizer

    tok = Tokenizer.from_gguf_metadata(open_gguf(path, read_env().cache_dir).metadata)
    ref = bench_llama_cpp(path, args.threads, prompt_tokens(tok, args.prompt), args.decode, args.runs)
    bandwidth = memory_read_gb_s(args.threads)
    per_token = weight_bytes_per_token(path)
    floor = bandwidth * 1e9 / per_token
    print(f"{path.name}, {args.threads} threads, prompt {args.prompt}, decode {args.decode}, "
          f"median of {args.runs}, {'int8' if read_env().cpu_int8 else 'float32'} activations "
          "(PANTHEON_CPU_INT8)")
    print(f"memory-bandwidth floor: {per_token / 1e6:.1f} MB of weights per token at {bandwidth:.1f} GB/s "
          f"measured read bandwidth = {floor:.0f} tok/s decode ceiling")
    print(f"{'figure':<28}{'pantheon':>12}{'llama.cpp':>12}{'ratio':>8}{'pantheon/floor':>16}")
    for key, label in (("prefill_tok_s", "prefill tok/s"), ("decode_tok_s", "decode tok/s (1 stream)")):
        r = ref[key] if ref else float("nan")
        of_floor = f"{ours[key] / floor:>16.2f}" if key == "decode_tok_s" else f"{'-':>16}"
        print(f"{label:<28}{ours[key]:>12.1f}{r:>12.1f}{ours[key] / r if ref else float('nan'):>8.2f}{of_floor}")
    out = write_result("decode", {"args": {**vars(args), "model": str(path)}, "pantheon": ours, "llama_cpp": ref,
                                  "floor": {"weight_bytes_per_token": per_token, "read_gb_s": bandwidth,
                                            "decode_tok_s": floor}})
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
