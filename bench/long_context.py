"""Decode speed as the context grows: in-process decode steps on the default model at 1 and 8 sequences after
prompts of 100, 1000 and 2000 tokens (attention's share grows with the context; the weights' does not).

    .venv/bin/python bench/long_context.py [--threads 2] [--contexts 100,1000,2000] [--batches 1,8] [--steps 16]

Each sequence of a batch gets the same prompt, prefilled once; then `--steps` decode steps are timed one by
one (median). Prints ms per step and tok/s, and writes bench/results/<date>-long-context.json.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import default_model, prompt_tokens, write_result  # noqa: E402
from pantheon.config import ModelOptions, read_env  # noqa: E402
from pantheon.engine.loader import load_served_model  # noqa: E402
from pantheon.kernels.cpu.backend import CpuBackend  # noqa: E402
from pantheon.models.base import BatchRow  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--threads", type=int, default=0, help="0 = all cores")
    ap.add_argument("--contexts", default="100,1000,2000")
    ap.add_argument("--batches", default="1,8")
    ap.add_argument("--steps", type=int, default=16)
    args = ap.parse_args()
    threads = args.threads or len(os.sched_getaffinity(0))
    contexts = [int(x) for x in args.contexts.split(",")]
    batches = [int(x) for x in args.batches.split(",")]
    env = read_env()
    served = load_served_model(ModelOptions(path=default_model(), name="bench"), env,
                               CpuBackend(threads, int8=env.cpu_int8))
    model = served.model
    rows = []
    for ctx in contexts:
        tokens = np.array(prompt_tokens(served.tokenizer, ctx), np.int32)
        for batch in batches:
            state = model.new_state(batch, len(tokens) + args.steps + 8)
            for slot in range(batch):
                model.forward(state, [BatchRow(slot, tokens, 0, "none")])
            times = []
            for step in range(args.steps):
                pos = len(tokens) + step
                started = time.perf_counter()
                model.forward(state, [BatchRow(slot, np.array([1], np.int32), pos) for slot in range(batch)])
                times.append(time.perf_counter() - started)
            step_s = statistics.median(times)
            rows.append({"context": len(tokens), "batch": batch, "step_ms": step_s * 1e3, "tok_s": batch / step_s})
            print(f"context {len(tokens):>5}, batch {batch}: {step_s * 1e3:7.2f} ms a step, {batch / step_s:6.0f} tok/s",
                  flush=True)
    out = write_result("long-context", {"args": vars(args), "threads": threads, "kv_dtype": str(model.state_dtype),
                                        "rows": rows})
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
