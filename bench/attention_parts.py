"""Where decode attention's time goes on this CPU: one layer's batched decode attention
(`ops.attention_decode_batch`), in the caches, on one thread, as it is and with one of its parts left out.

    .venv/bin/python bench/attention_parts.py [--batch 8] [--positions 100,400] [--rounds 5] [--calls 2000]
                                              [--q-heads 9] [--kv-heads 3] [--head-dim 64]

Each variant is a scratch copy of kernels/cpu/ops.py with one statement of `_attend_group` replaced, imported as
a module of its own (the rest of the package shared); a statement it looks for and does not find stops it with
the statement's text. The variants without a part compute wrong values: their times only count.

  real        ops.py as it is
  no_scores   without the key scores (`_scores_for_heads`: the query . key products, their folds, the tile max)
  no_values   without the weighted values (`_values_for_heads`: the weights times the value rows)
  no_softmax  without the exponentials and the float16 rounding of the weights (the sum kept)

The variants take turns round by round, over the same float16 caches (SmolLM2's shapes by default: 9 query heads
on 3 kv heads of 64) at each query position. Printed per position: each variant's median time a call, in ns per
(sequence, kv head, key) and as a share of the real one's time saved.
"""

from __future__ import annotations

import argparse
import importlib.util
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import numba  # noqa: E402
import numpy as np  # noqa: E402

from bench.common import replace_once, write_result  # noqa: E402

OPS_PATH = Path(__file__).resolve().parent.parent / "pantheon" / "kernels" / "cpu" / "ops.py"
_SCORES = """                    _scores_for_heads(q_rows, h, width, keys, kvh, j0, min(LANES, k1 - j0), scale, scores, j0 - k0,
                                      tile_max)"""
_VALUES = """                _values_for_heads(acc, h, min(MAX_WIDTH, first + group - h), scores, values, kvh, k0, k1 - k0)"""
_SOFTMAX = """                    p = _exp_f32(scores[h, j] - new_max)
                    total += p
                    weight = _kv_to_f32(_f32_to_kv(p, values))  # float16 over a float16 cache
                    scores[h, j] = np.float32(0.0) if weight < MIN_WEIGHT else weight"""
# (what the variant replaces, with what): each keeps the loops around it, so only the part's own work goes.
VARIANTS: dict[str, tuple[str, str] | None] = {
    "real": None,
    "no_scores": (_SCORES, "                    tile_max[h] = np.float32(0.0)"),
    "no_values": (_VALUES, "                acc[h, 0] += scores[h, 0]"),
    "no_softmax": (_SOFTMAX, """                    p = scores[h, j] - new_max
                    total += p
                    scores[h, j] = p"""),
}


def load_variants(names: list[str], scratch: Path) -> dict[str, Any]:
    """Each named variant of ops.py as a module of its own, written under `scratch`."""
    source = OPS_PATH.read_text()
    modules = {}
    for name in names:
        change = VARIANTS[name]
        text = source
        if change is not None:
            text = replace_once(text, *change, f"ops.py no longer has the statement {name} replaces")
        path = scratch / f"attention_parts_{name}.py"
        path.write_text(text)
        spec = importlib.util.spec_from_file_location(f"attention_parts_{name}", path)
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        modules[name] = module
    return modules


def make_inputs(batch: int, position: int, q_heads: int, kv_heads: int, head_dim: int,
                seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    shape = (batch, position + 1, kv_heads, head_dim)
    return {"q": rng.standard_normal((batch, q_heads, head_dim)).astype(np.float32),
            "k": rng.standard_normal(shape).astype(np.float16), "v": rng.standard_normal(shape).astype(np.float16),
            "positions": np.full(batch, position, np.int32), "slot_ids": np.arange(batch, dtype=np.int32)}


def attend(module: Any, inputs: dict[str, np.ndarray], out: np.ndarray) -> np.ndarray:
    scale = 1.0 / float(np.sqrt(inputs["q"].shape[2]))
    return module.attention_decode_batch(inputs["q"], inputs["k"], inputs["v"], inputs["positions"], scale, out,
                                         slot_ids=inputs["slot_ids"])


def measure(modules: dict[str, Any], inputs: dict[str, np.ndarray], rounds: int, calls: int) -> dict[str, Any]:
    """Median ns a call of each variant over `rounds` turns of `calls` calls, and each one's output."""
    outs = {name: np.empty_like(inputs["q"]) for name in modules}
    for name, module in modules.items():  # compile and warm
        attend(module, inputs, outs[name])
    times: dict[str, list[float]] = {name: [] for name in modules}
    for _ in range(rounds):
        for name, module in modules.items():
            out = outs[name]
            start = time.perf_counter_ns()
            for _ in range(calls):
                attend(module, inputs, out)
            times[name].append((time.perf_counter_ns() - start) / calls)
    return {"ns_per_call": {name: statistics.median(t) for name, t in times.items()}, "outputs": outs}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--positions", default="100,400")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--calls", type=int, default=2000)
    parser.add_argument("--q-heads", type=int, default=9)
    parser.add_argument("--kv-heads", type=int, default=3)
    parser.add_argument("--head-dim", type=int, default=64)
    args = parser.parse_args()
    numba.set_num_threads(1)
    rows = []
    with tempfile.TemporaryDirectory() as scratch:
        modules = load_variants(list(VARIANTS), Path(scratch))
        for position in (int(p) for p in args.positions.split(",")):
            inputs = make_inputs(args.batch, position, args.q_heads, args.kv_heads, args.head_dim)
            got = measure(modules, inputs, args.rounds, args.calls)["ns_per_call"]
            keys = args.batch * args.kv_heads * (position + 1)
            row = {"position": position, "ns_per_call": got,
                   "ns_per_key": {name: ns / keys for name, ns in got.items()},
                   "share_saved": {name: 1.0 - ns / got["real"] for name, ns in got.items() if name != "real"}}
            rows.append(row)
            print(f"batch {args.batch}, position {position} ({keys} (sequence, kv head, key) triples), one thread:")
            for name, ns in got.items():
                saved = "" if name == "real" else f"  ({100 * row['share_saved'][name]:+.0f}% of real's time saved)"
                print(f"  {name:<11} {ns / 1e3:8.1f} us a call  {ns / keys:6.2f} ns a key{saved}")
    write_result("attention-parts", {"args": vars(args), "levels": rows})


if __name__ == "__main__":
    main()
