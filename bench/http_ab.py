"""A/B over HTTP: two `pantheon serve`s of the default model, both up, decoding in alternating rounds.

    .venv/bin/python bench/http_ab.py [--a-tree OLD] [--b-tree NEW] [--a-env K=V,..] [--b-env K=V,..]
                                      [--pairs 30] [--restarts 3] [--levels 1,8] [--tokens 128]
    git worktree add /tmp/old HEAD~1 && .venv/bin/python bench/http_ab.py --a-tree /tmp/old
    .venv/bin/python bench/http_ab.py --a-env PANTHEON_STREAM_INTERVAL_MS=10 --b-env PANTHEON_STREAM_INTERVAL_MS=30

Server A runs the checkout `--a-tree` with the environment variables `--a-env`, server B `--b-tree` with
`--b-env` (both trees default to this one). They are started once, side by side, with the flags
`bench/concurrency.py` gives its server (`--max-concurrent` the largest level, 2 threads, a 2048-token window),
and take turns: a pair is, for every level, one round of that many greedy streams on each server (the order A B
or B A flips from one pair to the next), read by `bench/sse_client.py`, each round's figure the aggregate decode
rate over the window where all its streams decode (`bench.concurrency.run_level`). The idle server costs the
other nothing measurable (it waits in epoll), unless its environment keeps threads busy: with
`OMP_WAIT_POLICY=ACTIVE` a server's OpenMP workers spin while it is idle, and the other one decoded at a third
of its speed.

Why pairs, and many: these 2-core VMs drift by 10-30% over minutes, more than most changes move, while two
rounds a few seconds apart see the same machine. The comparison is the median of the per-pair ratios B / A
and how many pairs B won; on the Zen 4 VM (2026-12-05) eight pairs of a change gave +3.3% and +3.7% at one
stream where thirty pairs of the same two trees gave +0.9% (a pair takes ~2 s at 128 tokens).

Why restarts: a server process keeps its own speed. Two servers of the same tree (A/A, 12 pairs, one start each,
Zen 4 VM, 2026-12-06) gave B / A 0.973 at one stream with B ahead in 0 of 12 pairs, then 1.002 (7 of 12) in a
second start: a bias of a few percent that no number of pairs averages out, and as large as the changes measured.
With `--restarts K` the pairs are run in K blocks, each with both servers started afresh (which starts first
alternates from block to block); the summary is over all pairs, and each block's own B / A is printed and kept
(`blocks`), so that one lucky start shows as one block. Prints a table and writes
bench/results/<date>-http-ab.json.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from contextlib import chdir
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import default_model, write_result  # noqa: E402
from bench.concurrency import end_token_ids, run_level  # noqa: E402
from tests.server_process import ServerProcess  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent


def parse_env(text: str) -> dict[str, str]:
    """'K=V,K2=V2' as a dict ('' is none)."""
    env: dict[str, str] = {}
    for item in filter(None, text.split(",")):
        key, eq, value = item.partition("=")
        if not eq or not key:
            raise SystemExit(f"--a-env / --b-env take K=V pairs separated by commas, not {item!r}")
        env[key] = value
    return env


def start(tree: Path, env: dict[str, str], max_concurrent: int) -> ServerProcess:
    """`pantheon serve` from `tree` (the working directory comes first on a `python -m` module path)."""
    server = ServerProcess(["--model", f"{default_model()}:bench", "--max-concurrent", str(max_concurrent),
                            "--threads", "2", "--ctx-cap", "2048"], env=env)
    with chdir(tree):
        return server.start()


def summarize(rates: dict[str, dict[int, list[float]]]) -> dict[str, Any]:
    """Per level: each server's median rate, the median of the per-pair ratios B / A and the pairs B won; per
    server, the median of its per-pair ratios of the highest level to the lowest."""
    levels = sorted(rates["A"])
    summary: dict[str, Any] = {"levels": {}}
    for level in levels:
        a, b = rates["A"][level], rates["B"][level]
        ratios = [y / x for x, y in zip(a, b)]
        summary["levels"][level] = {"a_median": statistics.median(a), "b_median": statistics.median(b),
                                    "b_over_a": statistics.median(ratios), "b_won": sum(r > 1 for r in ratios),
                                    "pairs": len(ratios)}
    if len(levels) > 1:
        low, high = levels[0], levels[-1]
        summary["high_over_low"] = {name: statistics.median(h / lo for lo, h in zip(by[low], by[high]))
                                    for name, by in rates.items()}
    return summary


def block_sizes(pairs: int, restarts: int) -> list[int]:
    """`pairs` split into `restarts` blocks as evenly as they go (the earlier blocks one longer), none empty."""
    blocks = max(1, min(restarts, pairs))
    return [pairs // blocks + (i < pairs % blocks) for i in range(blocks)]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--a-tree", type=Path, default=ROOT)
    ap.add_argument("--b-tree", type=Path, default=ROOT)
    ap.add_argument("--a-env", default="")
    ap.add_argument("--b-env", default="")
    ap.add_argument("--pairs", type=int, default=30)
    ap.add_argument("--restarts", type=int, default=3, help="blocks of pairs, each with both servers started afresh")
    ap.add_argument("--levels", default="1,8")
    ap.add_argument("--tokens", type=int, default=128)
    args = ap.parse_args()
    levels = [int(n) for n in args.levels.split(",")]
    bias = {str(t): -100 for t in end_token_ids(default_model())}
    setups = {"A": (args.a_tree.resolve(), parse_env(args.a_env)), "B": (args.b_tree.resolve(), parse_env(args.b_env))}
    per_block: list[dict[str, dict[int, list[float]]]] = []  # each block's rates, by server and level
    blocks: list[dict[str, Any]] = []
    i = 0
    for block, size in enumerate(block_sizes(args.pairs, args.restarts)):
        servers: dict[str, ServerProcess] = {}
        block_rates: dict[str, dict[int, list[float]]] = {name: {level: [] for level in levels} for name in setups}
        per_block.append(block_rates)
        try:
            for name in ("A", "B") if block % 2 == 0 else ("B", "A"):
                tree, env = setups[name]
                servers[name] = start(tree, env, max(levels))
                run_level(servers[name], max(levels), 16, bias)  # warm-up: first-request costs stay out
            for _ in range(size):
                for level in levels:
                    for name in ("A", "B") if i % 2 == 0 else ("B", "A"):
                        block_rates[name][level].append(
                            run_level(servers[name], level, args.tokens, bias)["aggregate_decode_tok_s"])
                i += 1
                print(f"pair {i}: " + "  ".join(f"{name}{level} {block_rates[name][level][-1]:.0f}"
                                                for level in levels for name in ("A", "B")), flush=True)
        finally:
            for server in servers.values():
                server.stop()
        blocks.append(summarize(block_rates))
        print(f"block {block + 1} (servers started afresh): " + "  ".join(
            f"{level} streams B / A {row['b_over_a']:.3f}" for level, row in blocks[-1]["levels"].items()),
            flush=True)
    rates = {name: {level: [r for b in per_block for r in b[name][level]] for level in levels} for name in setups}
    summary = summarize(rates)
    print(f"A: {setups['A'][0]} {args.a_env or '(no env)'}\nB: {setups['B'][0]} {args.b_env or '(no env)'}")
    print(f"{args.pairs} pairs in {len(blocks)} blocks of their own server starts, {args.tokens} tokens a stream, "
          "2 threads; aggregate decode tok/s")
    for level, row in summary["levels"].items():
        print(f"{level} streams: A {row['a_median']:.0f}, B {row['b_median']:.0f}, B / A per pair "
              f"{row['b_over_a']:.3f} (B ahead in {row['b_won']} of {row['pairs']}); per block "
              + ", ".join(f"{b['levels'][level]['b_over_a']:.3f}" for b in blocks))
    for name, ratio in summary.get("high_over_low", {}).items():
        print(f"{name}: {levels[-1]} / {levels[0]} streams per pair {ratio:.2f}")
    path = write_result("http-ab", {"a": {"tree": str(setups["A"][0]), "env": setups["A"][1]},
                                    "b": {"tree": str(setups["B"][0]), "env": setups["B"][1]},
                                    "pairs": args.pairs, "restarts": len(blocks), "tokens": args.tokens,
                                    "rates": rates, **summary, "blocks": blocks})
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
