"""Time to a new session's first reply when another session already holds the same long system prompt (the
opencode case: every session opens with ~7.5k tokens of system prompt and tools), over HTTP against a real
`pantheon serve` on the default model.

    .venv/bin/python bench/shared_prefix.py [--system-tokens 4800] [--threads 0] [--runs 2]

Each run opens three sessions (ids new to the server) with the same system prompt and a short question:
the first pays for the whole prompt (each run's differs from the others' at its first words); the second
starts from a copy of the first's prefix (`SessionTable._shared_start`); the third sends `cache_prompt:
false`, the cold reference, whose greedy reply must equal the second's. Prints seconds, prompt and cached
tokens per turn (medians over runs), and writes bench/results/<date>-shared-prefix.json.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import FILLER, default_model, write_result  # noqa: E402
from tests.server_process import ServerProcess  # noqa: E402


def turn(server: ServerProcess, session_id: str, system: str, question: str, **extra: Any) -> dict[str, Any]:
    body = {"messages": [{"role": "system", "content": system}, {"role": "user", "content": question}],
            "max_tokens": 8, "temperature": 0, **extra}
    started = time.perf_counter()
    reply = httpx.post(server.base_url + "/v1/chat/completions", json=body, headers={"X-Session-Id": session_id},
                       timeout=900).json()
    return {"seconds": time.perf_counter() - started, "prompt_tokens": reply["usage"]["prompt_tokens"],
            "cached_tokens": reply["usage"]["prompt_tokens_details"]["cached_tokens"],
            "content": reply["choices"][0]["message"]["content"]}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--system-tokens", type=int, default=4800, help="about this many tokens of system prompt")
    ap.add_argument("--threads", type=int, default=0, help="0: the server's default")
    ap.add_argument("--runs", type=int, default=2)
    args = ap.parse_args()

    # FILLER is ~48 tokens per 250 characters on the default model's vocabulary.
    filler = (FILLER * (args.system_tokens // 40 + 2))[: args.system_tokens * 250 // 48]
    log = Path(tempfile.mkdtemp()) / "serve.log"
    flags = ["--model", f"{default_model()}:bench", "--max-sessions", str(3 * args.runs + 1)]
    if args.threads:
        flags += ["--threads", str(args.threads)]
    server = ServerProcess(flags, log_path=log).start()
    runs = []
    try:
        turn(server, "warm-up", "Hello.", "Hi.")
        for r in range(args.runs):
            system = f"Run {r}. {filler}"  # its own prompt, so that each run's first session pays for it
            first = turn(server, f"first-{r}", system, "What is the capital of France?")
            copied = turn(server, f"copied-{r}", system, "Name a colour.")
            cold = turn(server, f"cold-{r}", system, "Name a colour.", cache_prompt=False)
            assert copied["content"] == cold["content"], (copied, cold)
            runs.append({"first": first, "copied": copied, "cold": cold})
            for name in ("first", "copied", "cold"):
                t = runs[-1][name]
                print(f"run {r} {name:6s}: {t['seconds']:6.2f} s, prompt {t['prompt_tokens']}, "
                      f"cached {t['cached_tokens']}")
    finally:
        server.stop()
    medians = {name: statistics.median(run[name]["seconds"] for run in runs) for name in ("first", "copied", "cold")}
    print(f"medians: first {medians['first']:.2f} s, copied {medians['copied']:.2f} s, cold {medians['cold']:.2f} s "
          f"({medians['cold'] / medians['copied']:.0f}x)")
    print(f"wrote {write_result('shared-prefix', {'args': vars(args), 'runs': runs, 'median_seconds': medians})}")


if __name__ == "__main__":
    main()
