"""Aggregate decode throughput and time to first token at 1, 2, 4 and 8 concurrent streams, over HTTP against
a real `pantheon serve` on the default model (or `--model`); beside them the same levels decoded in-process by Pantheon
and by llama.cpp; and single-stream HTTP decode vs in-process decode.

    .venv/bin/python bench/concurrency.py [--levels 1,2,4,8] [--tokens 128] [--runs 3] [--threads 0] [--model FILE.gguf]

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

Beside each HTTP level, every round also decodes the same prompts in this process, right before or after it
(the server idle meanwhile), at the same levels and thread count, with `bench/batched.py`: Pantheon's model
with B sequences in one forward pass a step, and llama.cpp (llama-cpp-python's C API, where the `bench` extra
is installed) with B sequence ids in one llama_decode a step, in a child process of its own
(`LlamaCppProcess`: in this process its OpenMP use slowed Pantheon's batch-8 decode by ~20%). Those show what
the batched step itself gains from 1 to 8 streams on each engine, free of the server. HTTP / in-process (at
every level; the issue's bar is at 1 stream) is the median of the per-round ratios of those back-to-back
pairs.
Pantheon runs the int8-activation path by default (where the CPU has the instructions); PANTHEON_CPU_INT8=0
measures the float32 path. Prints a table and writes bench/results/<date>-concurrency.json.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any


sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.batched import LlamaCppProcess, PantheonBatched  # noqa: E402
from bench.common import default_model, write_result  # noqa: E402
from bench.sse_client import stream_chat_completions  # noqa: E402
from pantheon.config import read_env  # noqa: E402
from pantheon.io.gguf_file import open_gguf  # noqa: E402
from pantheon.io.tokenizer import Tokenizer  # noqa: E402
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


def end_token_ids(path: Path) -> list[int]:
    """The ids a turn of the model at `path` ends on: its tokenizer's end-of-generation set, the one the server
    stops on (`Tokenizer.stop_ids`), so that forbidding them makes every stream decode --tokens tokens whatever
    the model names its end tokens."""
    return sorted(Tokenizer.from_gguf_metadata(open_gguf(path, read_env().cache_dir).metadata).stop_ids)


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


def _medians(runs: list[dict[str, float]]) -> dict[str, Any]:
    row: dict[str, Any] = {k: statistics.median(r[k] for r in runs) for k in runs[0]}
    row["runs"] = runs
    return row


def _round_ratios(runs: list[dict[str, Any]], ones: list[dict[str, Any]], key: str, one_key: str) -> list[float]:
    return [r[key] / one[one_key] for r, one in zip(runs, ones)]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--levels", default="1,2,4,8")
    ap.add_argument("--tokens", type=int, default=128, help="tokens each stream decodes")
    ap.add_argument("--runs", type=int, default=3, help="rounds over the levels (median per level)")
    ap.add_argument("--threads", type=int, default=0, help="server and in-process threads (0 = all cores)")
    ap.add_argument("--temperature", type=float, default=0.0,
                    help="HTTP streams' temperature (0 = greedy; > 0 samples with the server's top_k 40 / top_p 0.95)")
    ap.add_argument("--model", type=Path, help="another GGUF file (default: the default model)")
    args = ap.parse_args()
    levels = [int(x) for x in args.levels.split(",")]
    threads = args.threads or len(os.sched_getaffinity(0))
    path = args.model or default_model()
    load_before = os.getloadavg()

    decoder = PantheonBatched(path, threads)
    prompts = [decoder.prompt_ids(PROMPTS[i % len(PROMPTS)]) for i in range(max(levels))]
    decoder.run(prompts[:1], 16)  # warm-up
    reference = LlamaCppProcess.load(path, threads, max(levels), max(map(len, prompts)) + args.tokens + 8,
                                     decoder.end_ids)
    inproc: dict[int, list[dict[str, float]]] = {n: [] for n in levels}
    llama: dict[int, list[dict[str, float]]] = {n: [] for n in levels}

    bias = {str(t): -100 for t in decoder.end_ids}  # the server's end tokens, as end_token_ids
    log = Path(tempfile.mkdtemp(prefix="bench-concurrency-")) / "serve.log"
    server = ServerProcess(["--model", f"{path}:bench", "--max-concurrent", str(max(levels)),
                            "--threads", str(threads), "--ctx-cap", "2048"], log_path=log).start()
    try:
        run_level(server, 1, 16, bias)  # warm-up: first-request costs stay out of the table
        # Rounds over all the levels, rather than all the runs of one level and then the next: this VM's speed
        # drifts by 10-30% over minutes, and a ratio between levels should compare neighbouring minutes.
        by_level: dict[int, list[dict[str, Any]]] = {n: [] for n in levels}
        for r in range(args.runs):
            for n in levels:
                # A level's HTTP and in-process runs go back to back (HTTP first in odd rounds), so their ratio
                # compares neighbouring seconds: with the in-process levels all run before the HTTP ones, the
                # single-stream pair was a minute apart and its ratio went from 0.77 to 1.19 between rounds
                # of one tree (2026-12-01, Zen 5 VM; adjacent pairs of the same tree: 0.92-0.98).
                pair = [lambda: by_level[n].append(run_level(server, n, args.tokens, bias, args.temperature)),
                        lambda: inproc[n].append(decoder.run(prompts[:n], args.tokens))]
                for run in pair[::-1] if r % 2 == 0 else pair:
                    run()
                if reference is not None:
                    llama[n].append(reference.run(prompts[:n], args.tokens))
        rows = []
        for n, runs in by_level.items():
            row = _medians(runs)
            row["streams"] = n
            # HTTP / in-process within each round: the pair ran back to back
            row["http_vs_in_process_rounds"] = [h["aggregate_decode_tok_s"] / i["decode_tok_s"]
                                                for h, i in zip(runs, inproc[n])]
            rows.append(row)
    finally:
        server.stop()
        if reference is not None:
            reference.close()
    load_after = os.getloadavg()

    one = levels[0] == 1
    in_rows = {n: _medians(inproc[n]) for n in levels}
    ll_rows = {n: _medians(llama[n]) for n in levels} if reference is not None else {}
    if one:
        # Every ratio to 1 stream is also taken within each round (the levels minutes apart at most).
        for row in rows[1:]:
            row["round_ratios"] = _round_ratios(row["runs"], rows[0]["runs"], "aggregate_decode_tok_s",
                                                "aggregate_decode_tok_s")
        for table in (in_rows, ll_rows):
            for n, row in table.items():
                row["round_ratios"] = _round_ratios(row["runs"], table[1]["runs"], "decode_tok_s", "decode_tok_s")
    nan = float("nan")

    def of_one(table: dict[int, dict[str, Any]], n: int) -> float:
        return statistics.median(table[n]["round_ratios"]) if one and n in table else nan

    def rate(table: dict[int, dict[str, Any]], n: int) -> float:
        return table[n]["decode_tok_s"] if n in table else nan

    print(f"{path.name}, {threads} threads, {args.tokens} tokens per stream, temperature "
          f"{args.temperature:g}, median of {args.runs} rounds; "
          f"load average {load_before[0]:.1f} before, {load_after[0]:.1f} after")
    print("aggregate decode tok/s (x 1 stream: the median of the per-round ratios); HTTP: pantheon serve, the "
          "scheduler's batched steps; in-process: one forward pass of B sequences a step, no server")
    print(f"{'streams':>7}{'HTTP':>9}{'x 1':>7}{'in-proc':>9}{'x 1':>7}{'HTTP/in-proc':>14}{'llama.cpp':>11}"
          f"{'x 1':>7}{'in-proc/llama':>15}{'overall':>9}{'TTFT med':>10}{'TTFT max':>10}")
    for row in rows:
        n, agg = row["streams"], row["aggregate_decode_tok_s"]
        http_x = statistics.median(row["round_ratios"]) if "round_ratios" in row else 1.0
        print(f"{n:>7}{agg:>9.1f}{http_x:>7.2f}{rate(in_rows, n):>9.1f}{of_one(in_rows, n):>7.2f}"
              f"{statistics.median(row['http_vs_in_process_rounds']):>14.2f}{rate(ll_rows, n):>11.1f}"
              f"{of_one(ll_rows, n):>7.2f}{rate(in_rows, n) / rate(ll_rows, n):>15.2f}"
              f"{row['overall_tok_s']:>9.1f}{row['ttft_median_s']:>10.2f}{row['ttft_max_s']:>10.2f}")
    for row in rows[1:] if one else []:
        print(f"{row['streams']} streams / 1 stream over HTTP, round by round: "
              f"{' '.join(f'{x:.2f}' for x in row['round_ratios'])}")
    http_ratio = rows[0]["http_vs_in_process_rounds"] if one else [nan]
    ratio = statistics.median(http_ratio)
    print(f"single stream decode: HTTP {rows[0]['aggregate_decode_tok_s']:.1f} tok/s, in-process "
          f"{rate(in_rows, levels[0]):.1f} tok/s (medians); HTTP / in-process round by round: "
          f"{' '.join(f'{x:.2f}' for x in http_ratio)} (median {ratio:.2f})")
    out = write_result("concurrency", {"args": {**vars(args), "model": str(path)}, "threads": threads,
                                       "load_avg_before": load_before,
                                       "load_avg_after": load_after, "levels": rows,
                                       "in_process_levels": in_rows, "llama_cpp_levels": ll_rows or None,
                                       "http_vs_in_process": ratio, "http_vs_in_process_rounds": http_ratio})
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
