"""A/B of two versions of `kernels/cpu/decode_layers.py` in one process, taking turns run by run.

    .venv/bin/python bench/step_ab.py OLD_FILE NEW_FILE [--rounds 10] [--tokens 96] [--levels 1,8]
    git show HEAD~1:pantheon/kernels/cpu/decode_layers.py > /tmp/old_decode_layers.py
    .venv/bin/python bench/step_ab.py /tmp/old_decode_layers.py pantheon/kernels/cpu/decode_layers.py

Each file is imported as a module of its own (the rest of the package shared), and the decode step's thread team
(`decode_layers._team_step`, what `decode_step` runs) is routed to one or the other before each run of
`bench.batched`'s in-process decoder: per round and level, one run of each, the order alternating from round
to round. The 2-core VMs here change speed by 10-25% from one process to the next and within minutes; runs a
second apart in one process see the same machine, so the per-round ratio NEW / OLD is what this reports
(median, min, max), beside the medians of the rates. Only changes confined to that one file can be compared
this way; `bench/batch_ab.py` compares whole checkouts in alternating processes. The same file on both sides
(2-core Zen 4 VM, 2026-12-06, runs of 2, 6 and 12 rounds): medians batch 8 0.995-1.002, batch 1 0.961-1.013,
single rounds 0.92-1.11: a difference of a percent or two needs several runs that agree.
"""

from __future__ import annotations

import argparse
import importlib.util
import statistics
import sys
from collections.abc import Callable
from pathlib import Path
from types import ModuleType
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def load_copy(path: Path, name: str) -> ModuleType:
    """`path` (a version of decode_layers.py) imported as module `name`."""
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # its dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def compare(engine: Any, levels: list[int], rounds: int, tokens: int, names: tuple[str, str],
            switch: Callable[[str], None]) -> dict[tuple[str, int], list[float]]:
    """Decode rates (tok/s) of `engine` (`bench.batched.PantheonBatched`) on the bench prompts per (setup, level),
    for the two setups `names`, `switch(name)` putting the engine on one: both warmed at every level, then per
    round and level one run of each, their order alternating from round to round. Prints per level the medians
    and the per-round ratio second / first; returns the rates."""
    from bench.concurrency import PROMPTS

    prompts = [engine.prompt_ids(p) for p in PROMPTS]
    old, new = names
    rates: dict[tuple[str, int], list[float]] = {(k, n): [] for k in names for n in levels}
    for name in names:  # compiled and warm
        switch(name)
        for n in levels:
            engine.run([prompts[i % len(prompts)] for i in range(n)], 4)
    for r in range(rounds):
        for n in levels:
            batch = [prompts[i % len(prompts)] for i in range(n)]
            for name in (names if r % 2 == 0 else names[::-1]):
                switch(name)
                rates[(name, n)].append(engine.run(batch, tokens)["decode_tok_s"])
    for n in levels:
        a, b = rates[(old, n)], rates[(new, n)]
        ratios = [y / x for x, y in zip(a, b)]
        print(f"batch {n}: {old} {statistics.median(a):.1f} tok/s, {new} {statistics.median(b):.1f}; {new} / {old} "
              f"per round: median {statistics.median(ratios):.3f}, min {min(ratios):.3f}, max {max(ratios):.3f}")
    return rates


def compare_teams(engine: Any, levels: list[int], rounds: int, tokens: int,
                  teams: dict[str, Callable[..., Any]]) -> dict[tuple[str, int], list[float]]:
    """`compare` of two versions of the decode step's thread team (`decode_layers._team_step`, what
    `decode_step` runs), `teams` naming them in (first, second) order; the team as it was is put back after."""
    from pantheon.kernels.cpu import decode_layers

    as_is = decode_layers._team_step

    def route(name: str) -> None:
        decode_layers._team_step = teams[name]

    first, second = teams
    try:
        return compare(engine, levels, rounds, tokens, (first, second), route)
    finally:
        decode_layers._team_step = as_is


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("old", type=Path)
    ap.add_argument("new", type=Path)
    ap.add_argument("--rounds", type=int, default=10)
    ap.add_argument("--tokens", type=int, default=96, help="decode steps a run")
    ap.add_argument("--levels", default="1,8")
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()

    from bench.batched import PantheonBatched
    from bench.common import default_model

    teams = {"old": load_copy(args.old, "decode_layers_old")._team_step,
             "new": load_copy(args.new, "decode_layers_new")._team_step}
    compare_teams(PantheonBatched(default_model(), args.threads), [int(v) for v in args.levels.split(",")],
                  args.rounds, args.tokens, teams)


if __name__ == "__main__":
    main()
