"""Aggregate decode throughput and time to first token at 1, 2, 4 and 8 concurrent streams, over HTTP against
a real `pantheon serve` on the default model; plus single-stream HTTP decode vs in-process decode.

    .venv/bin/python bench/concurrency.py [--levels 1,2,4,8] [--tokens 128] [--runs 3] [--threads 0]

The levels are measured in rounds (1, 2, 4, 8, then again), so every level sees the same drift of the machine's
speed; the table shows medians over the rounds, and the ratio to 1 stream is also given round by round.
Each stream is a streamed greedy chat completion (end tokens forbidden with logit_bias, so every stream
decodes exactly --tokens tokens; too short for the repetition detector), read by `bench/sse_client.py` (all
streams from one thread over raw sockets: the clients share the server's 2 cores, and httpx on a thread per
stream took ~420 us of CPU per token). Per level:

  aggregate decode tok/s  tokens received while *all* streams were decoding (from the last stream's first
                          token to the first stream's end) / that window: the batched decode rate, free of
                          prefill and of ramp-up / tail effects
  overall tok/s           all completion tokens / wall time from the requests to the last end (includes
                          prefill and queueing)
  TTFT                    median and max over the streams, from sending the request to its first content

The in-process figure decodes greedily with batch 1 straight on the model (as bench/decode.py does), same
thread count, same prompt, in this process, once per round before the HTTP levels (the server idle meanwhile);
the HTTP / in-process ratio is the median of the per-round ratios. Both run the int8-activation path by
default (where the CPU has the instructions); PANTHEON_CPU_INT8=0 measures the float32 path. Prints a table
and writes bench/results/<date>-concurrency.json.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import default_model, write_result  # noqa: E402
from bench.sse_client import stream_chat_completions  # noqa: E402
from tests.server_process import ServerProcess  # noqa: E402

PROMPTS = [
    "Write a long story about a dragon and a knight.",
    "Explain how a steam engine works, step by step.",
    "Describe a walk through a busy market in the morning.",
    "Write a letter to a friend about your summer holiday.",
    "Tell me about the history of the printing press.",
    "Describe the life cycle of a butterfly in detail.",
    "Write a short essay about the importance of sleep.",
    "Explain why the seasons change during the year.",
]
END_TOKENS = ("<|im_end|>", "<|endoftext|>")


def end_token_ids(path: Path) -> list[int]:
    import gguf

    reader = gguf.GGUFReader(str(path))
    f = reader.fields["tokenizer.ggml.tokens"]
    ids = []
    for token_id, i in enumerate(f.data):
        if bytes(f.parts[i]).decode("utf-8", "replace") in END_TOKENS:
            ids.append(token_id)
    return ids


def run_level(server: ServerProcess, n: int, tokens: int, bias: dict[str, float], temperature: float = 0.0
              ) -> dict[str, Any]:
    bodies = [{"messages": [{"role": "user", "content": PROMPTS[i % len(PROMPTS)]}], "temperature": temperature,
               "max_tokens": tokens, "logit_bias": bias, "stream": True, "stream_options": {"include_usage": True}}
              for i in range(n)]
    outs = stream_chat_completions("127.0.0.1", server.port, bodies)
    errors = [o.error for o in outs if o.error is not None]
    if errors:
        raise SystemExit(f"{n} streams: {errors}")
    firsts = [o.times[0] for o in outs]
    ends = [o.times[-1] for o in outs]
    start = min(o.sent for o in outs)
    lo, hi = max(firsts), min(ends)
    in_window = sum(1 for o in outs for t in o.times if lo < t <= hi)
    total = sum(o.completion_tokens if o.completion_tokens is not None else len(o.times) for o in outs)
    chunks = sum(len(o.times) for o in outs)
    window_ok = hi - lo > 0.5 and in_window >= 4 * n
    return {
        "streams": n,
        "aggregate_decode_tok_s": in_window / (hi - lo) if window_ok else chunks / (max(ends) - min(firsts)),
        "window_s": hi - lo,
        "overall_tok_s": total / (max(ends) - start),
        "ttft_median_s": statistics.median(f - o.sent for f, o in zip(firsts, outs)),
        "ttft_max_s": max(f - o.sent for f, o in zip(firsts, outs)),
        "completion_tokens": total,
        "content_chunks": chunks,
        "wall_s": max(ends) - start,
    }


class InProcessDecoder:
    """Greedy batch-1 decode straight on the model (as bench/decode.py does), in this process, with no server
    running: the figure the single HTTP stream is compared with."""

    def __init__(self, path: Path, threads: int, prompt: str) -> None:
        from pantheon.config import ModelOptions, read_env
        from pantheon.engine.loader import load_served_model
        from pantheon.kernels.cpu.backend import CpuBackend

        served = load_served_model(ModelOptions(path=path, name="bench"), read_env(),
                                   CpuBackend(threads, int8=read_env().cpu_int8))
        self.model = served.model
        text = served.template.render([{"role": "user", "content": prompt}], add_generation_prompt=True, extra={})
        self.tokens = np.array(served.tokenizer.encode(text, parse_special=True), np.int32)
        self.end_ids = list(set(served.tokenizer.stop_ids))

    def run(self, n_decode: int) -> dict[str, float]:
        from pantheon.models.base import BatchRow

        state = self.model.new_state(1, len(self.tokens) + n_decode + 8)
        t = time.perf_counter()
        logits = self.model.forward(state, [BatchRow(0, self.tokens, 0)])
        prefill = len(self.tokens) / (time.perf_counter() - t)
        row = logits[0].copy()
        row[self.end_ids] = -np.inf
        tok, pos = int(np.argmax(row)), len(self.tokens)
        t = time.perf_counter()
        for _ in range(n_decode):
            logits = self.model.forward(state, [BatchRow(0, np.array([tok], np.int32), pos)])
            row = logits[0].copy()
            row[self.end_ids] = -np.inf
            tok, pos = int(np.argmax(row)), pos + 1
        return {"decode_tok_s": n_decode / (time.perf_counter() - t), "prefill_tok_s": prefill,
                "prompt_tokens": len(self.tokens)}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--levels", default="1,2,4,8")
    ap.add_argument("--tokens", type=int, default=128, help="tokens each stream decodes")
    ap.add_argument("--runs", type=int, default=3, help="rounds over the levels (median per level)")
    ap.add_argument("--threads", type=int, default=0, help="server and in-process threads (0 = all cores)")
    ap.add_argument("--temperature", type=float, default=0.0,
                    help="HTTP streams' temperature (0 = greedy; > 0 samples with the server's top_k 40 / top_p 0.95)")
    args = ap.parse_args()
    levels = [int(x) for x in args.levels.split(",")]
    threads = args.threads or len(os.sched_getaffinity(0))
    path = default_model()
    load_before = os.getloadavg()

    decoder = InProcessDecoder(path, threads, PROMPTS[0])
    decoder.run(16)  # warm-up
    inproc_runs: list[dict[str, float]] = []

    bias = {str(t): -100 for t in end_token_ids(path)}
    log = Path(tempfile.mkdtemp(prefix="bench-concurrency-")) / "serve.log"
    server = ServerProcess(["--model", f"{path}:bench", "--max-concurrent", str(max(levels)),
                            "--threads", str(threads), "--ctx-cap", "2048"], log_path=log).start()
    try:
        run_level(server, 1, 16, bias)  # warm-up: first-request costs stay out of the table
        # Rounds over all the levels, rather than all the runs of one level and then the next: this VM's speed
        # drifts by 10-30% over minutes, and a ratio between levels should compare neighbouring minutes.
        by_level: dict[int, list[dict[str, Any]]] = {n: [] for n in levels}
        for _ in range(args.runs):
            # In-process decode in every round too, so that the HTTP / in-process ratio compares neighbouring
            # minutes (one in-process figure before all the rounds gave 0.84 and 1.10 in two runs of one tree).
            inproc_runs.append(decoder.run(args.tokens))
            for n in levels:
                by_level[n].append(run_level(server, n, args.tokens, bias, args.temperature))
        rows = []
        for n, runs in by_level.items():
            row = {k: statistics.median(r[k] for r in runs) for k in runs[0]}
            row["streams"] = n
            row["runs"] = runs
            rows.append(row)
    finally:
        server.stop()
    load_after = os.getloadavg()

    base = rows[0]["aggregate_decode_tok_s"] if rows and rows[0]["streams"] == 1 else float("nan")
    if rows and rows[0]["streams"] == 1:
        # The ratio to 1 stream also taken within each round (the levels minutes apart at most).
        for row in rows[1:]:
            row["round_ratios"] = [r["aggregate_decode_tok_s"] / one["aggregate_decode_tok_s"]
                                   for r, one in zip(row["runs"], rows[0]["runs"])]
    print(f"SmolLM2-135M-Instruct Q4_1, {threads} threads, {args.tokens} tokens per stream, temperature "
          f"{args.temperature:g}, median of {args.runs} rounds; "
          f"load average {load_before[0]:.1f} before, {load_after[0]:.1f} after")
    print(f"{'streams':>7}{'agg decode tok/s':>18}{'x 1 stream':>12}{'per stream':>12}{'overall tok/s':>15}"
          f"{'TTFT med s':>12}{'TTFT max s':>12}")
    for row in rows:
        n, agg = row["streams"], row["aggregate_decode_tok_s"]
        print(f"{n:>7}{agg:>18.1f}{agg / base:>12.2f}{agg / n:>12.1f}{row['overall_tok_s']:>15.1f}"
              f"{row['ttft_median_s']:>12.2f}{row['ttft_max_s']:>12.2f}")
    for row in rows:
        if "round_ratios" in row:
            print(f"{row['streams']} streams / 1 stream, round by round: "
                  f"{' '.join(f'{x:.2f}' for x in row['round_ratios'])} (median "
                  f"{statistics.median(row['round_ratios']):.2f})")
    http_one = rows[0]["aggregate_decode_tok_s"] if rows[0]["streams"] == 1 else float("nan")
    inproc = {k: statistics.median(r[k] for r in inproc_runs) for k in inproc_runs[0]}
    inproc["runs"] = inproc_runs
    round_ratios = ([one["aggregate_decode_tok_s"] / ip["decode_tok_s"]
                     for one, ip in zip(rows[0]["runs"], inproc_runs)] if rows[0]["streams"] == 1 else [float("nan")])
    ratio = statistics.median(round_ratios)
    print(f"single stream decode: HTTP {http_one:.1f} tok/s, in-process {inproc['decode_tok_s']:.1f} tok/s "
          f"(medians); HTTP / in-process round by round: {' '.join(f'{x:.2f}' for x in round_ratios)} "
          f"(median {ratio:.2f})")
    out = write_result("concurrency", {"args": vars(args), "threads": threads, "load_avg_before": load_before,
                                       "load_avg_after": load_after, "levels": rows, "in_process": inproc,
                                       "http_vs_in_process": ratio, "http_vs_in_process_rounds": round_ratios})
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
