"""A/B of checkouts on the in-process batch-8 / batch-1 decode ratio, in alternating processes.

    .venv/bin/python bench/batch_ab.py OLD_TREE NEW_TREE [--pairs 5] [--rounds 6] [--tokens 128] [--model FILE.gguf]
    git worktree add /tmp/old HEAD~1 && .venv/bin/python bench/batch_ab.py /tmp/old .

Each tree (a checkout of this repository) runs in its own process, one after the other, `--pairs` times; the
trees take turns going first. A process decodes, round after round, 1 sequence then the 8 bench prompts
together (`bench.batched`'s decoder, greedy, 2 threads), and reports each round's pair of rates. The 2-core
VMs here change speed by +-15% from one process to the next, more than most single changes move, while the
two rates of one round move together: so the comparison is over many processes, as the median and 90th
percentile of the rounds, and per process. The processes share this machine with nothing else; do not run it
beside other work.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import subprocess
import sys
from pathlib import Path

# Runs inside each process, with the tree first on sys.path.
_CHILD = """
import json, sys
sys.path.insert(0, sys.argv[1])
from bench.batched import PantheonBatched
from bench.common import default_model
from bench.concurrency import PROMPTS
decoder = PantheonBatched(default_model() if sys.argv[4] == "-" else sys.argv[4], 2)
prompts = [decoder.prompt_ids(PROMPTS[i % len(PROMPTS)]) for i in range(8)]
decoder.run(prompts[:1], 8)
decoder.run(prompts, 8)
rows = []
for _ in range(int(sys.argv[2])):
    one = decoder.run(prompts[:1], int(sys.argv[3]))["decode_tok_s"]
    eight = decoder.run(prompts, int(sys.argv[3]))["decode_tok_s"]
    rows.append((one, eight))
print("ROWS " + json.dumps(rows))
"""


def _rounds(tree: Path, rounds: int, tokens: int, model: Path | None) -> list[tuple[float, float]]:
    done = subprocess.run([sys.executable, "-c", _CHILD, str(tree), str(rounds), str(tokens), str(model or "-")],
                          capture_output=True, text=True, check=True)
    line = next(row for row in done.stdout.splitlines() if row.startswith("ROWS "))
    return [tuple(pair) for pair in json.loads(line[5:])]


def _p90(values: list[float]) -> float:
    """The 90th percentile, nearest rank."""
    return sorted(values)[math.ceil(0.9 * len(values)) - 1]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("trees", nargs="+", type=Path)
    ap.add_argument("--pairs", type=int, default=5, help="processes per tree, alternating")
    ap.add_argument("--rounds", type=int, default=6, help="rounds per process")
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--model", type=Path, help="another GGUF file (default: the default model)")
    args = ap.parse_args()
    runs: dict[Path, list[list[tuple[float, float]]]] = {tree: [] for tree in args.trees}
    # The trees' order flips from one pair to the next (A B, B A, ...): on the 2-core Zen 3 VM (2026-12-04) the
    # same two trees gave batch-8 medians +6.6% with the new tree second in every pair and -3.6% with it first,
    # and a phase profile then showed the change did nothing: the second process of a pair had run faster.
    for i in range(args.pairs):
        for tree in args.trees if i % 2 == 0 else args.trees[::-1]:
            runs[tree].append(_rounds(tree.resolve(), args.rounds, args.tokens, args.model))
    print(f"{args.pairs} processes x {args.rounds} rounds per tree, {args.tokens} tokens, 1 and 8 streams, 2 threads"
          + (f", {args.model.name}" if args.model else ""))
    print(f"{'tree':30} {'B1 med':>7} {'B1 p90':>7} {'B8 med':>7} {'B8 p90':>7} {'B8/B1 med':>9}  B8 per process")
    for tree, procs in runs.items():
        rows = [row for proc in procs for row in proc]
        ones, eights = [one for one, _ in rows], [eight for _, eight in rows]
        per_process = " ".join(f"{statistics.median(e for _, e in proc):.0f}" for proc in procs)
        print(f"{str(tree):30} {statistics.median(ones):7.0f} {_p90(ones):7.0f} {statistics.median(eights):7.0f} "
              f"{_p90(eights):7.0f} {statistics.median(e / o for o, e in rows):9.2f}  {per_process}")


if __name__ == "__main__":
    main()
