"""Speed and accuracy by quantization format, Pantheon vs llama.cpp, on files llama.cpp's own quantizer writes.

    .venv/bin/python bench/formats.py [--base smollm2|1b] [--formats Q4_K_M,Q5_K_M,Q4_0,Q8_0] [--threads 2]
                                      [--prompt 256] [--decode 64] [--runs 2]

Most GGUF files people download are Q4_K_M or Q5_K_M, not the default model's Q4_1. This bench has
llama-cpp-python's `llama_model_quantize` write each format (once, under $PANTHEON_HOME/bench/formats/) from
  smollm2  the default model, requantized: the shapes of a SmolLM2-135M Q4_K_M from the hub, where the
           576-wide matrices fall back to Q5_0 / Q5_1 and the output matrix is Q8_0;
  1b       a random-weight llama of 1B-class shapes (D 1024, 16 heads of 64, 4 KV heads, FFN 2816, 16 layers,
           the default model's vocabulary and template), written as F16 first: every matrix takes the format's
           own types (Q4_K_M: Q4_K, and Q6_K for the output matrix, attn_v and half of ffn_down).
For each format it prints the weight bytes by type, prefill and single-stream decode tok/s for both engines
(bench/decode.py's loops, median of --runs) and their ratio, and how far each engine's logits are from exact
arithmetic: the relative error (L2) of the last position's logits against Pantheon's float32 path (weights
dequantized exactly, float activations), mean over 6 prompts, for Pantheon's int8 path and for llama.cpp.
Writes bench/results/<date>-formats-<base>.json. Needs the bench extra (llama-cpp-python).
"""

from __future__ import annotations

import argparse
import collections
import ctypes
import sys
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import default_model, prompt_tokens, write_result  # noqa: E402
from bench.decode import bench_llama_cpp, bench_pantheon  # noqa: E402
from pantheon.config import ModelOptions, read_env  # noqa: E402
from pantheon.engine.loader import load_served_model  # noqa: E402
from pantheon.io.gguf_file import open_gguf  # noqa: E402
from pantheon.kernels.cpu.backend import CpuBackend  # noqa: E402
from pantheon.models.base import BatchRow  # noqa: E402

# llama.cpp's LLAMA_FTYPE_MOSTLY_* values
FTYPES = {"Q4_0": 2, "Q4_1": 3, "Q8_0": 7, "Q5_0": 8, "Q5_1": 9, "Q2_K": 10, "Q3_K_M": 12, "Q4_K_S": 14, "Q4_K_M": 15,
          "Q5_K_M": 17, "Q6_K": 18, "IQ4_NL": 25, "IQ4_XS": 30}
ACCURACY_PROMPTS = (9, 17, 33, 50, 77, 101)  # prompt lengths, tokens


def _random_f16_model(path: Path) -> None:
    from tests.tiny_models import write_tiny_llama

    import gguf

    write_tiny_llama(path, n_layers=16, d=1024, heads=16, kv_heads=4, ffn=2816, ctx=4096,
                     qtype=gguf.GGMLQuantizationType.F16, name="random-1b")


def model_file(base: str, fmt: str) -> Path:
    """The `base` model in format `fmt`, written by llama.cpp's quantizer on first use."""
    import llama_cpp

    folder = read_env().home / "bench" / "formats"
    folder.mkdir(parents=True, exist_ok=True)
    out = folder / f"{base}-{fmt}.gguf"
    if out.exists():
        return out
    if base == "smollm2":
        source = default_model()
    else:
        source = folder / "1b-F16.gguf"
        if not source.exists():
            _random_f16_model(source)
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = FTYPES[fmt]
    params.nthread = 2
    params.allow_requantize = True
    partial = out.with_suffix(".partial")
    if llama_cpp.llama_model_quantize(str(source).encode(), str(partial).encode(), ctypes.byref(params)) != 0:
        raise SystemExit(f"llama.cpp could not quantize {source} to {fmt}")
    partial.rename(out)
    return out


def bytes_by_type(path: Path) -> dict[str, int]:
    from gguf.constants import GGMLQuantizationType

    totals: collections.Counter[str] = collections.Counter()
    for info in open_gguf(path, read_env().cache_dir).tensors.values():
        totals[GGMLQuantizationType(info.qtype).name] += info.nbytes
    return dict(totals)


def logits_errors(path: Path, threads: int) -> dict[str, float]:
    """Mean relative error of the last position's logits against Pantheon's float32 path, over
    ACCURACY_PROMPTS: Pantheon's int8 path and llama.cpp's."""
    import llama_cpp

    env = read_env()
    engines = [load_served_model(ModelOptions(path=path, name=f"accuracy-{int8}"), env, CpuBackend(threads, int8=int8))
               for int8 in (False, True)]
    llm = llama_cpp.Llama(model_path=str(path), n_ctx=256, logits_all=True, n_threads=threads, verbose=False)
    errors: dict[str, list[float]] = {"pantheon_int8": [], "llama_cpp": []}
    for n in ACCURACY_PROMPTS:
        tokens = prompt_tokens(engines[0].tokenizer, n)
        exact, ours = (e.model.forward(e.model.new_state(1, 256), [BatchRow(0, np.array(tokens, np.int32), 0)])[0]
                       for e in engines)
        llm.reset()
        llm.eval(tokens)
        theirs = np.array(llm.scores[len(tokens) - 1], dtype=np.float32)
        scale = float(np.linalg.norm(exact))
        errors["pantheon_int8"].append(float(np.linalg.norm(ours - exact)) / scale)
        errors["llama_cpp"].append(float(np.linalg.norm(theirs - exact)) / scale)
    return {key: float(np.mean(values)) for key, values in errors.items()}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--base", choices=("smollm2", "1b"), default="smollm2")
    ap.add_argument("--formats", default="Q4_K_M,Q5_K_M,Q4_0,Q8_0")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--prompt", type=int, default=256)
    ap.add_argument("--decode", type=int, default=64)
    ap.add_argument("--runs", type=int, default=2)
    args = ap.parse_args()
    rows: dict[str, Any] = {}
    for fmt in args.formats.split(","):
        path = model_file(args.base, fmt)
        from pantheon.io.tokenizer import Tokenizer

        tokens = prompt_tokens(Tokenizer.from_gguf_metadata(open_gguf(path, read_env().cache_dir).metadata),
                               args.prompt)
        rows[fmt] = {
            "types_mb": {k: round(v / 1e6, 1) for k, v in bytes_by_type(path).items()},
            "pantheon": bench_pantheon(path, args.threads, args.prompt, args.decode, args.runs),
            "llama_cpp": bench_llama_cpp(path, args.threads, tokens, args.decode, args.runs),
            "logits_error": logits_errors(path, args.threads),
        }
    print(f"{args.base}, {args.threads} threads, prompt {args.prompt}, decode {args.decode}, median of {args.runs}")
    print(f"{'format':<8}{'prefill':>10}{'llama.cpp':>10}{'ratio':>7}{'decode':>9}{'llama.cpp':>10}{'ratio':>7}"
          f"{'err int8':>10}{'err l.cpp':>10}  weights MB by type")
    for fmt, row in rows.items():
        ours, ref, err = row["pantheon"], row["llama_cpp"], row["logits_error"]
        print(f"{fmt:<8}{ours['prefill_tok_s']:>10.1f}{ref['prefill_tok_s']:>10.1f}"
              f"{ours['prefill_tok_s'] / ref['prefill_tok_s']:>7.2f}{ours['decode_tok_s']:>9.1f}"
              f"{ref['decode_tok_s']:>10.1f}{ours['decode_tok_s'] / ref['decode_tok_s']:>7.2f}"
              f"{err['pantheon_int8']:>10.4f}{err['llama_cpp']:>10.4f}  {row['types_mb']}")
    out = write_result(f"formats-{args.base}", {"args": vars(args), "formats": rows})
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
