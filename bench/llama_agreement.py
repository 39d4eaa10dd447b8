"""How closely Pantheon's greedy decoding follows llama.cpp's on the default model, measured against how closely
llama.cpp follows itself when only its attention path changes.

    .venv/bin/python bench/llama_agreement.py [--prompts 16] [--tokens 64] [--threads 2] [--model FILE.gguf]

Engines, all on the same prompt token ids (Pantheon's tokenizer on its rendering of the chat template, as
`bench/batched.py` gives both engines), end tokens forbidden so that every run decodes --tokens tokens:

  llama.cpp         llama-cpp-python's C API with its default context (flash attention "auto": on, on a CPU):
                    the reference
  llama.cpp no-FA   the same with flash attention off (the softmax materialised, then multiplied by V)
  pantheon          the cpu backend as the server runs it (the int8 path where the CPU has the instructions)
  pantheon float    the float32 path (PANTHEON_CPU_INT8=0)

Per engine against the reference:
  free-run          each engine decodes greedily on its own; the index of the first token that differs from the
                    reference's (median over prompts), and how many prompts gave the same tokens throughout
  teacher-forced    every engine is fed the reference's tokens; the share of steps whose top token is the
                    reference's, and the median over steps of the largest logit difference over the vocabulary

The default model's logits move by ~0.5-1 for any change in rounding anywhere (its activations are rounded to
8-bit blocks before each matmul, so a small difference flips a rounding and grows by a quantization step), and a
greedy run then follows another path from the first near-tie. The row to compare Pantheon's with is therefore
llama.cpp's own no-FA row: a difference in arithmetic as small as llama.cpp's two attention paths. Needs the
`bench` extra (llama-cpp-python). Prints a table and writes bench/results/<date>-llama-agreement.json.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path
from typing import Any, Protocol

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.batched import LlamaCppBatched, PantheonBatched, greedy  # noqa: E402
from bench.common import default_model, write_result  # noqa: E402
from bench.concurrency import PROMPTS as STORY_PROMPTS  # noqa: E402
from pantheon.kernels.cpu import int8dot  # noqa: E402
from pantheon.models.base import BatchRow  # noqa: E402

PROMPTS = [*STORY_PROMPTS, "What is the capital of France?", "List five fruits and their colors.",
           "Write a python function that reverses a string.", "Give me three tips for learning a new language.",
           "What is 17 times 23?", "Summarize the plot of Romeo and Juliet.", "How do airplanes stay in the air?",
           "Write a haiku about autumn."]


class Engine(Protocol):
    def prefill(self, prompt: list[int]) -> np.ndarray: ...  # logits after the prompt, the state reset first

    def step(self, token: int) -> np.ndarray: ...  # logits after one more token


class LlamaEngine:
    def __init__(self, llama: LlamaCppBatched) -> None:
        self.llama = llama
        self.pos = 0

    def prefill(self, prompt: list[int]) -> np.ndarray:
        lib = self.llama.lib
        lib.llama_memory_clear(lib.llama_get_memory(self.llama.ctx), True)
        self.llama._decode([(tok, i, 0, i == len(prompt) - 1) for i, tok in enumerate(prompt)])
        self.pos = len(prompt)
        return self.llama._logits(len(prompt) - 1).copy()

    def step(self, token: int) -> np.ndarray:
        self.llama._decode([(token, self.pos, 0, True)])
        self.pos += 1
        return self.llama._logits(0).copy()


class PantheonEngine:
    def __init__(self, batched: PantheonBatched, capacity: int) -> None:
        self.model = batched.model
        self.capacity = capacity
        self.state: Any = None
        self.pos = 0

    def _forward(self, tokens: list[int]) -> np.ndarray:
        logits = self.model.forward(self.state, [BatchRow(0, np.array(tokens, np.int32), self.pos)])
        self.pos += len(tokens)
        return np.asarray(logits[0], dtype=np.float32).copy()

    def prefill(self, prompt: list[int]) -> np.ndarray:
        self.state = self.model.new_state(1, self.capacity)
        self.pos = 0
        return self._forward(prompt)

    def step(self, token: int) -> np.ndarray:
        return self._forward([token])


def free_run(engine: Engine, prompt: list[int], n: int, forbidden: list[int]) -> list[int]:
    logits = engine.prefill(prompt)
    tokens = []
    for _ in range(n):
        tokens.append(greedy(logits, forbidden))
        if len(tokens) < n:
            logits = engine.step(tokens[-1])
    return tokens


def teacher_forced(engine: Engine, prompt: list[int], continuation: list[int]) -> np.ndarray:
    """The logits before each token of `continuation`, the engine fed the continuation whatever it predicts."""
    rows = [engine.prefill(prompt)]
    for token in continuation[:-1]:
        rows.append(engine.step(token))
    return np.stack(rows)


def first_difference(a: list[int], b: list[int]) -> int:
    """Index of the first token where a and b differ; len(a) when they agree throughout."""
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), len(a))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--model", type=Path, help="another GGUF file (default: the default model)")
    args = ap.parse_args()
    path = args.model or default_model()
    ours = PantheonBatched(path, args.threads, int8=int8dot.INT8_ISA is not None)
    forbidden = ours.end_ids
    prompts = [ours.prompt_ids(PROMPTS[i % len(PROMPTS)]) for i in range(args.prompts)]
    capacity = max(map(len, prompts)) + args.tokens + 8
    fa_auto = LlamaCppBatched.load(path, args.threads, 1, capacity, forbidden)
    if fa_auto is None:
        raise SystemExit("llama-cpp-python is not installed: `make bench` installs the bench extra")
    engines: dict[str, Engine] = {
        "llama.cpp": LlamaEngine(fa_auto),
        "llama.cpp no-FA": LlamaEngine(LlamaCppBatched(fa_auto.lib, path, args.threads, 1, capacity, forbidden, 0)),
        "pantheon": PantheonEngine(ours, capacity),
        "pantheon float": PantheonEngine(PantheonBatched(path, args.threads, int8=False), capacity),
    }
    runs = {name: [free_run(engine, p, args.tokens, forbidden) for p in prompts] for name, engine in engines.items()}
    reference = runs["llama.cpp"]
    forced = {name: [teacher_forced(engine, p, c) for p, c in zip(prompts, reference)]
              for name, engine in engines.items()}
    rows = []
    print(f"default model, {args.prompts} prompts x {args.tokens} greedy tokens, {args.threads} threads; "
          f"against llama.cpp (flash attention auto)")
    print(f"{'engine':>16}{'first diff (median)':>21}{'same run':>10}{'top-1 agree':>13}{'max |dlogit| (median)':>23}")
    for name in engines:
        if name == "llama.cpp":
            continue
        firsts = [first_difference(r, ref) for r, ref in zip(runs[name], reference)]
        agree = float(np.mean([np.mean(a.argmax(-1) == b.argmax(-1))
                               for a, b in zip(forced[name], forced["llama.cpp"])]))
        spread = float(np.median(np.concatenate([np.abs(a - b).max(-1)
                                                 for a, b in zip(forced[name], forced["llama.cpp"])])))
        same = sum(f == args.tokens for f in firsts)
        rows.append({"engine": name, "first_difference": firsts, "first_difference_median": statistics.median(firsts),
                     "same_run": same, "top1_agreement": agree, "max_abs_logit_diff_median": spread})
        print(f"{name:>16}{statistics.median(firsts):>21.1f}{same:>7}/{args.prompts:<2}{agree:>13.3f}{spread:>23.3f}")
    out = write_result("llama-agreement", {"args": {k: str(v) for k, v in vars(args).items()}, "rows": rows})
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
