"""In-process batched greedy decode, Pantheon and llama.cpp side by side: B sequences, one forward pass a step.

Both engines get the same prompt token ids (Pantheon's tokenizer on Pantheon's rendering of the chat template),
prefill each sequence on its own (not timed), then decode `n_decode` steps in which every sequence adds one
token, all B in one call: `model.forward` with B rows for Pantheon, one `llama_decode` of a B-token batch (one
token per sequence id) for llama.cpp, through llama-cpp-python's low-level API. Greedy on the raw logits, end
tokens forbidden, so every sequence decodes exactly n_decode tokens. The figure is B * n_decode / the decode
time: the aggregate decode rate of B streams with no server around it, the same thing bench/concurrency.py's
HTTP levels measure through the scheduler.

Used by bench/concurrency.py; also runnable on its own:

    .venv/bin/python bench/batched.py [--levels 1,2,4,8] [--tokens 64] [--threads 2] [--model FILE.gguf]
"""

from __future__ import annotations

import argparse
import ctypes
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def greedy(row: np.ndarray, forbidden: list[int]) -> int:
    row = row.copy()
    row[forbidden] = -np.inf
    return int(np.argmax(row))


class PantheonBatched:
    """Pantheon's model straight from the loader, on the cpu backend with `threads` threads; `int8` picks its
    arithmetic (default: PANTHEON_CPU_INT8's, as the server)."""

    def __init__(self, path: Path, threads: int, int8: bool | None = None) -> None:
        from pantheon.config import ModelOptions, read_env
        from pantheon.engine.loader import load_served_model
        from pantheon.kernels.cpu.backend import CpuBackend

        env = read_env()
        self.served = load_served_model(ModelOptions(path=path, name="bench"), env,
                                        CpuBackend(threads, int8=env.cpu_int8 if int8 is None else int8))
        self.model = self.served.model
        self.end_ids = sorted(set(self.served.tokenizer.stop_ids))

    def prompt_ids(self, text: str) -> list[int]:
        """The chat-templated prompt of one user message, as token ids."""
        rendered = self.served.template.render([{"role": "user", "content": text}], add_generation_prompt=True,
                                               extra={})
        return [int(t) for t in self.served.tokenizer.encode(rendered, parse_special=True)]

    def run(self, prompts: list[list[int]], n_decode: int) -> dict[str, float]:
        from pantheon.models.base import BatchRow

        n = len(prompts)
        state = self.model.new_state(n, max(len(p) for p in prompts) + n_decode + 8)
        tokens, positions = [], []
        t = time.perf_counter()
        for s, prompt in enumerate(prompts):
            logits = self.model.forward(state, [BatchRow(s, np.array(prompt, np.int32), 0)])
            tokens.append(greedy(logits[0], self.end_ids))
            positions.append(len(prompt))
        prefill = sum(len(p) for p in prompts) / (time.perf_counter() - t)
        t = time.perf_counter()
        for _ in range(n_decode):
            logits = self.model.forward(state, [BatchRow(s, np.array([tokens[s]], np.int32), positions[s])
                                                for s in range(n)])
            tokens = [greedy(logits[s], self.end_ids) for s in range(n)]
            positions = [p + 1 for p in positions]
        return {"decode_tok_s": n * n_decode / (time.perf_counter() - t), "prefill_tok_s": prefill}


class LlamaCppBatched:
    """llama.cpp through llama-cpp-python's C API: one context with `max_seqs` sequences (`n_seq_max`), cleared
    before every run. None of it exists when llama_cpp is not installed (`load` returns None)."""

    _quiet: Any = None  # the log callback, kept alive as long as llama.cpp may call it

    def __init__(self, llama_cpp: Any, path: Path, threads: int, max_seqs: int, n_ctx_seq: int,
                 end_ids: list[int], flash_attn_type: int | None = None) -> None:
        self.lib = lib = llama_cpp
        if LlamaCppBatched._quiet is None:
            LlamaCppBatched._quiet = lib.llama_log_callback(lambda level, text, data: None)
            lib.llama_log_set(LlamaCppBatched._quiet, ctypes.c_void_p(0))
        lib.llama_backend_init()
        self.model = lib.llama_model_load_from_file(str(path).encode(), lib.llama_model_default_params())
        if not self.model:
            raise RuntimeError(f"llama.cpp could not load {path}")
        self.n_vocab = lib.llama_vocab_n_tokens(lib.llama_model_get_vocab(self.model))
        params = lib.llama_context_default_params()
        params.n_ctx = max_seqs * n_ctx_seq
        params.n_batch = params.n_ubatch = n_ctx_seq
        params.n_seq_max = max_seqs
        params.n_threads = params.n_threads_batch = threads
        if flash_attn_type is not None:  # llama.cpp's LLAMA_FLASH_ATTN_TYPE_*: -1 auto (the default), 0 off, 1 on
            params.flash_attn_type = flash_attn_type
        self.ctx = lib.llama_init_from_model(self.model, params)
        self.capacity = n_ctx_seq
        self.batch = lib.llama_batch_init(n_ctx_seq, 0, max_seqs)
        self.end_ids = end_ids

    @classmethod
    def load(cls, path: Path, threads: int, max_seqs: int, n_ctx_seq: int, end_ids: list[int],
             flash_attn_type: int | None = None) -> LlamaCppBatched | None:
        try:
            import llama_cpp
        except ImportError:
            return None
        return cls(llama_cpp, path, threads, max_seqs, n_ctx_seq, end_ids, flash_attn_type)

    def close(self) -> None:
        self.lib.llama_batch_free(self.batch)
        self.lib.llama_free(self.ctx)
        self.lib.llama_model_free(self.model)

    def _decode(self, rows: list[tuple[int, int, int, bool]]) -> None:
        """One llama_decode of rows (token, position, sequence id, wants logits)."""
        if len(rows) > self.capacity:
            raise ValueError("more tokens than the batch holds")
        batch = self.batch
        batch.n_tokens = len(rows)
        for i, (token, pos, seq, wants) in enumerate(rows):
            batch.token[i], batch.pos[i], batch.n_seq_id[i], batch.logits[i] = token, pos, 1, wants
            batch.seq_id[i][0] = seq
        status = self.lib.llama_decode(self.ctx, batch)
        if status != 0:
            raise RuntimeError(f"llama_decode returned {status}")

    def _logits(self, i: int) -> np.ndarray:
        return np.ctypeslib.as_array(self.lib.llama_get_logits_ith(self.ctx, i), shape=(self.n_vocab,))

    def run(self, prompts: list[list[int]], n_decode: int) -> dict[str, float]:
        self.lib.llama_memory_clear(self.lib.llama_get_memory(self.ctx), True)
        n = len(prompts)
        tokens, positions = [], []
        t = time.perf_counter()
        for s, prompt in enumerate(prompts):
            self._decode([(tok, i, s, i == len(prompt) - 1) for i, tok in enumerate(prompt)])
            tokens.append(greedy(self._logits(len(prompt) - 1), self.end_ids))
            positions.append(len(prompt))
        prefill = sum(len(p) for p in prompts) / (time.perf_counter() - t)
        t = time.perf_counter()
        for _ in range(n_decode):
            self._decode([(tokens[s], positions[s], s, True) for s in range(n)])
            tokens = [greedy(self._logits(s), self.end_ids) for s in range(n)]
            positions = [p + 1 for p in positions]
        return {"decode_tok_s": n * n_decode / (time.perf_counter() - t), "prefill_tok_s": prefill}


def _llama_worker(conn: Any, path: Path, threads: int, max_seqs: int, n_ctx_seq: int, end_ids: list[int]) -> None:
    """`LlamaCppProcess`'s child: loads llama.cpp, then answers (prompts, n_decode) with `run`'s result until
    it gets None."""
    engine = LlamaCppBatched.load(path, threads, max_seqs, n_ctx_seq, end_ids)
    conn.send(engine is not None)
    try:
        while (job := conn.recv()) is not None:
            conn.send(engine.run(*job))  # type: ignore[union-attr]
    finally:
        if engine is not None:
            engine.close()


class LlamaCppProcess:
    """`LlamaCppBatched` in a process of its own, run by the same calls. Both engines use OpenMP through the
    one libgomp, and in one process a single llama.cpp run left Pantheon's batch-8 decode slower for the rest
    of the process: on the 2-core Zen 5 VM 1405 tok/s against 1742 without it (batch 1: 425 and 454; 3 rounds
    each, 2026-12-01). The child waits on its pipe while Pantheon runs."""

    def __init__(self, conn: Any, process: Any) -> None:
        self._conn, self._process = conn, process

    @classmethod
    def load(cls, path: Path, threads: int, max_seqs: int, n_ctx_seq: int, end_ids: list[int]
             ) -> LlamaCppProcess | None:
        import importlib.util
        import multiprocessing

        if importlib.util.find_spec("llama_cpp") is None:
            return None
        context = multiprocessing.get_context("spawn")
        conn, child_conn = context.Pipe()
        process = context.Process(target=_llama_worker, args=(child_conn, path, threads, max_seqs, n_ctx_seq,
                                                              end_ids), daemon=True)
        process.start()
        if not conn.recv():
            process.join()
            return None
        return cls(conn, process)

    def run(self, prompts: list[list[int]], n_decode: int) -> dict[str, float]:
        self._conn.send((prompts, n_decode))
        return self._conn.recv()

    def close(self) -> None:
        self._conn.send(None)
        self._process.join(timeout=30)


def main() -> None:
    from bench.common import default_model, median
    from bench.concurrency import PROMPTS

    ap = argparse.ArgumentParser()
    ap.add_argument("--levels", default="1,2,4,8")
    ap.add_argument("--tokens", type=int, default=64, help="tokens each sequence decodes")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--model", type=Path, help="another GGUF file (default: the default model)")
    args = ap.parse_args()
    levels = [int(x) for x in args.levels.split(",")]
    path = args.model or default_model()
    ours = PantheonBatched(path, args.threads)
    prompts = [ours.prompt_ids(PROMPTS[i % len(PROMPTS)]) for i in range(max(levels))]
    ref = LlamaCppProcess.load(path, args.threads, max(levels), max(map(len, prompts)) + args.tokens + 8,
                               ours.end_ids)
    ours.run(prompts[:1], 8)  # warm-up (compilation is cached, but the first call still loads it)
    results: dict[str, dict[int, list[float]]] = {"pantheon": {n: [] for n in levels},
                                                  "llama.cpp": {n: [] for n in levels}}
    for _ in range(args.runs):
        for n in levels:
            results["pantheon"][n].append(ours.run(prompts[:n], args.tokens)["decode_tok_s"])
            if ref is not None:
                results["llama.cpp"][n].append(ref.run(prompts[:n], args.tokens)["decode_tok_s"])
    print(f"{'streams':>7}{'pantheon tok/s':>16}{'x 1':>7}{'llama.cpp tok/s':>17}{'x 1':>7}{'ratio':>8}")
    for n in levels:
        ours_n, ref_n = median(results["pantheon"][n]), median(results["llama.cpp"][n] or [float("nan")])
        ours_1, ref_1 = median(results["pantheon"][levels[0]]), median(results["llama.cpp"][levels[0]] or [1.0])
        print(f"{n:>7}{ours_n:>16.1f}{ours_n / ours_1:>7.2f}{ref_n:>17.1f}{ref_n / ref_1:>7.2f}{ours_n / ref_n:>8.2f}")
    if ref is not None:
        ref.close()


if __name__ == "__main__":
    main()
