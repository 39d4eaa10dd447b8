"""A long prompt prefilled as the server does it, in chunks of `PREFILL_CHUNK` tokens, and the share of that
time spent in attention (the rest is mostly the matmuls). An opencode agent turn is ~7.8k tokens, so a cold
turn's time to first token is this.

    .venv/bin/python bench/long_prefill.py [--threads 2] [--tokens 7800] [--runs 1]

The backend's `attention` (the prefill path: each prompt row attends as a decode step at its position would)
is wrapped with a timer. Prints seconds, tok/s and the attention's share per run (medians over runs), and
writes bench/results/<date>-long-prefill.json. `bench/decode.py --prompt N` puts the same prompt beside
llama.cpp, in one forward pass.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import default_model, median, prompt_tokens, write_result  # noqa: E402
from pantheon.config import ModelOptions, read_env  # noqa: E402
from pantheon.engine.loader import load_served_model  # noqa: E402
from pantheon.kernels.cpu.backend import CpuBackend  # noqa: E402
from pantheon.models.base import BatchRow  # noqa: E402
from pantheon.sched.scheduler import PREFILL_CHUNK  # noqa: E402


class TimedAttention(CpuBackend):
    """The cpu backend with its prefill attention timed."""

    attention_s = 0.0

    def attention(self, *args: Any, **kwargs: Any) -> np.ndarray:  # type: ignore[override]
        started = time.perf_counter()
        try:
            return super().attention(*args, **kwargs)
        finally:
            self.attention_s += time.perf_counter() - started


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)))
    ap.add_argument("--tokens", type=int, default=7800)
    ap.add_argument("--runs", type=int, default=1)
    args = ap.parse_args()

    env = read_env()
    backend = TimedAttention(args.threads, int8=env.cpu_int8)
    served = load_served_model(ModelOptions(path=default_model(), name="bench"), env, backend)
    model = served.model
    tokens = np.array(prompt_tokens(served.tokenizer, args.tokens), np.int32)
    state = model.new_state(1, args.tokens + 8)
    model.forward(state, [BatchRow(0, tokens[:PREFILL_CHUNK], 0)])  # compile / warm up
    runs = []
    for _ in range(args.runs):
        backend.attention_s = 0.0
        started = time.perf_counter()
        for a in range(0, len(tokens), PREFILL_CHUNK):
            model.forward(state, [BatchRow(0, tokens[a:a + PREFILL_CHUNK], a)])
        seconds = time.perf_counter() - started
        share = backend.attention_s / seconds
        runs.append({"seconds": seconds, "tok_s": len(tokens) / seconds, "attention_share": share})
        print(f"{len(tokens)} tokens in chunks of {PREFILL_CHUNK}: {seconds:.1f} s ({len(tokens) / seconds:.0f} "
              f"tok/s), attention {backend.attention_s:.1f} s ({share:.0%})")
    result = {"args": vars(args), "chunk": PREFILL_CHUNK, "runs": runs,
              "median": {key: median([r[key] for r in runs]) for key in runs[0]}}
    print(f"wrote {write_result('long-prefill', result)}")


if __name__ == "__main__":
    main()
