"""Where a decode step's time goes: every backend op timed, per op and per matmul shape, at batch 1 and 8.

    .venv/bin/python bench/step_profile.py [THREADS]           # int8 activations (the default)
    PANTHEON_CPU_INT8=0 .venv/bin/python bench/step_profile.py   # float32 activations
    PROFILE_PYTHON_LOOP=1 .venv/bin/python bench/step_profile.py  # the layers one op at a time, from Python

By default a decode step runs as one compiled call where the model has that path (kernels/cpu/decode_layers.py),
which shows here as the single op `decode_step` (or `decode_layers`, when the embedding or the output matrix
stays outside); PROFILE_PYTHON_LOOP=1 turns it off to see the ops one by one (the same kernels, plus the
Python between them).

Prefills 200 prompt tokens per sequence, then times 48 decode steps (the second of two rounds), so the
context is ~250-300 tokens. "outside ops" is the step time not spent inside a backend op (Python, sampling).
"""

import collections
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import numpy as np  # noqa: E402
from bench.common import default_model, prompt_tokens  # noqa: E402
from pantheon.config import ModelOptions, read_env  # noqa: E402
from pantheon.engine.loader import load_served_model  # noqa: E402
from pantheon.kernels.cpu.backend import CpuBackend  # noqa: E402
from pantheon.models.base import BatchRow  # noqa: E402

threads = int(sys.argv[1]) if len(sys.argv) > 1 else 2
be = CpuBackend(threads, int8=read_env().cpu_int8)
served = load_served_model(ModelOptions(path=default_model(), name="p"), read_env(), be)
model = served.model
if os.environ.get("PROFILE_PYTHON_LOOP") == "1":
    model._decode_plan = None
times = collections.defaultdict(float)
OPS = ["decode_step", "decode_layers", "matmul", "embed", "split_cols", "rmsnorm", "add_rmsnorm", "rope_inplace", "swiglu", "kv_write",
       "rope_qkv_into_cache", "swiglu_stacked", "attention_decode_batch", "attention_decode_qkv", "attention"]
for name in OPS:
    f = getattr(be, name)
    def wrap(*a, _f=f, _n=name, **k):
        t = time.perf_counter(); r = _f(*a, **k); times[_n] += time.perf_counter() - t
        if _n == "matmul":
            key = (a[0].rows, a[0].cols, a[1].shape[0]); times["mm%s" % (key,)] += time.perf_counter() - t
        return r
    setattr(be, name, wrap)
tokens = np.array(prompt_tokens(served.tokenizer, 200), np.int32)
for B in (1, 8):
    state = model.new_state(B, 600)
    for s in range(B):
        model.forward(state, [BatchRow(s, tokens, 0)])
    pos = len(tokens)
    toks = [1] * B
    for it in range(2):
        times.clear()
        n = 48
        t0 = time.perf_counter()
        for _ in range(n):
            lg = model.forward(state, [BatchRow(s, np.array([toks[s]], np.int32), pos) for s in range(B)])
            toks = [int(np.argmax(lg[s])) for s in range(B)]
            pos += 1
        tot = time.perf_counter() - t0
    print(f"B={B}: step {tot/n*1e3:.2f} ms -> {B*n/tot:.1f} tok/s")
    ops = sum(v for k, v in times.items() if not k.startswith("mm("))
    for k, v in sorted(times.items(), key=lambda kv: -kv[1]):
        print(f"   {k:28s} {v/n*1e3:7.3f} ms")
    print(f"   outside ops: {(tot-ops)/n*1e3:.3f} ms")
