"""What a key cache stored dimension by dimension takes off decode attention's key scores, with the keys in the
caches.

    .venv/bin/python bench/key_layout.py [--batch 8] [--positions 100,400,1000] [--rounds 3] [--keys 200000]
    .venv/bin/python bench/key_layout.py --in-step [--levels 1,8] [--tokens 128] [--rounds 3] [--threads 2]

The cpu backend stores a layer's keys position by position (`CpuBackend.kv_pool`: per slot and kv head, one
row of head-dim values a key), and `attend_ir.key_scores_intrinsic` computes 16 keys' scores with one 16-lane
partial sum per key and head, then folds the partials pairwise (~25 512-bit operations a key for SmolLM2's 3
query heads, ~9 of them folds: `bench/attention_parts.py`). Stored dimension by dimension instead (per slot and
kv head, one row of positions a dimension), 16 consecutive keys of one dimension are one vector and each
head's 16 scores build up lane by lane, an fma per dimension and head, with no folds. Both layouts are numpy
views indexed [slot, position, kv head, :], so the rest of the code would read them alike; only the kernels
that walk the keys (this intrinsic, the prefetches, the cache writes) would care.

This bench builds that second intrinsic here (`key_scores_by_dim_intrinsic`; nothing in pantheon/ uses it) and
times both over the same float16 keys in the caches, one thread, the query heads of a kv head together:
`--batch` sequences x the kv heads x each position's keys, 16 at a time, rounds taking turns. Printed per
position: ns per (sequence, kv head, key) for each layout, and their ratio. The scores are checked against
numpy first (both within float32 rounding of it; the sums run in different orders). Writes
bench/results/<date>-key-layout.json.

On the 2-core Zen 4 VM (2026-12-06, `--rounds 5`, `2026-12-06-key-layout.json`): by dimension 0.67, 0.67 and 0.72 of
the time at positions 100, 400 and 1000. That did not carry over to the decode step. The whole cache laid out so
(each slot's and kv head's keys as one row of positions per dimension, padded to a multiple of 16: a strided view,
so the rest of the code read it unchanged) with this intrinsic in the attention, against the tree without it
(`bench/http_ab.py`, 16 then 12 pairs, 128 tokens a stream; `2026-12-06-http-ab-keys-by-dimension.json` is the
second run): batch 1 0.85 and 0.92, batch 8 0.94 and 0.90 (the second run with the key pools on huge pages): a
sequence's keys for one item became 64 short runs a page apart instead of one run, and the attention waits on memory
in the step (`bench/phase_profile.py --attention-twice`: a third of its time). A layout that keeps tiles of 16 keys
together (dimension-major inside a tile) would keep the one run, but is no strided view of [slot, position, kv
head, :]: every reader and writer of the keys would have to know it. Not done.

`--in-step` times such tiles inside the decode step before anyone builds them: scratch copies of ops.py and
decode_layers.py (`write_tile_timing_copies`) whose attention reads each 16 keys' 2 KB as a tile, dimension by
dimension (`key_scores_by_dim_intrinsic(tiles=True)`, checked against numpy over a real tiled cache by the tests),
over the cache as it is: the same memory and the tiled arithmetic, wrong scores. `bench.step_ab.compare` runs the
step with them and as it is in turns (in-process batched decode, the default model). On the 2-core Zen 4 VM
(2026-12-06, stop 57; `2026-12-06-key-layout-in-step-{128,256}.json`): 128 tokens a stream, 10 rounds, batch 8
1.003 (per round 0.964-1.066), batch 1 0.985; 256 tokens, 8 rounds, batch 8 1.021 (1.001-1.048), batch 1 1.000.
The same copies run by hand before: 128 tokens batch 8 0.987 and 0.998, 256 tokens 1.051 and 1.015, 1000 tokens
batch 8 0.992, batch 1 1.028. The scores' third less arithmetic hardly shows, because in the step the attention
waits on memory: not worth a layout every reader and writer of the keys would have to know.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import numba  # noqa: E402
import numpy as np  # noqa: E402
from llvmlite import ir  # noqa: E402
from numba import types  # noqa: E402
from numba.extending import intrinsic  # noqa: E402

from bench.common import replace_once, write_result  # noqa: E402
from pantheon.kernels.cpu import attend_ir  # noqa: E402
from pantheon.kernels.cpu.attend_ir import (LANES, _f32, _i64, _load_f32, _raise_max, _vf,  # noqa: E402
                                            key_scores_operands)
from pantheon.kernels.cpu.llvm_ir import byte_ptr, counted_loop, fma, splat  # noqa: E402

# Independent accumulators per head: one chain per head would wait on each fma's latency (4 cycles).
DIM_CHAINS = 4


def key_scores_by_dim_intrinsic(width: int, tiles: bool = False) -> Any:
    """`attend_ir.key_scores_intrinsic`'s call over keys (ctx, Hkv, hd) stored dimension by dimension:
    strides[0] is the item size, and each dimension's row holds at least j0 + 16 positions (the caller's
    promise). Key i's score lands in lane i; lanes i >= n hold whatever positions j0 + i hold (stored, never
    read, left out of the max). The head dimension must be a multiple of DIM_CHAINS.

    With `tiles`, over keys kept in tiles of 16 positions, dimension by dimension inside a tile (one kv head's
    tile: dimension d's 16 values at d * 32 bytes, float16), the tiles of a kv head one after another: j0 a
    multiple of 16, and keys a view whose strides[0] is a position row's bytes (hd items) and strides[1] a kv
    head's, so that j0 * strides[0] + kvh * strides[1] is the tile's first byte (`tiled_view`)."""

    def key_scores(typingctx, q_rows, h0, keys, kvh, j0, n, scale, scores, col, maxes):  # type: ignore[no-untyped-def]
        return types.void(q_rows, h0, keys, kvh, j0, n, scale, scores, col, maxes), codegen

    def codegen(context, builder, signature, args):  # type: ignore[no-untyped-def]
        q, k, s, m, (h0, kvh, j0, n, scale, col), half = key_scores_operands(context, builder, signature, args)
        item = 2 if half else 4
        q_stride, s_stride = (builder.extract_value(a.strides, 0) for a in (q, s))
        if tiles:
            d_stride = ir.Constant(_i64, LANES * item)
            first = builder.mul(j0, builder.extract_value(k.strides, 0))
        else:
            d_stride = builder.extract_value(k.strides, 2)
            first = builder.mul(j0, ir.Constant(_i64, item))
        base = builder.add(first, builder.mul(kvh, builder.extract_value(k.strides, 1)))
        n_steps = builder.sdiv(builder.extract_value(q.shape, 1), ir.Constant(_i64, DIM_CHAINS))
        q_rows = [builder.bitcast(byte_ptr(builder, q.data, builder.mul(builder.add(h0, ir.Constant(_i64, h)),
                                                                        q_stride)), _f32.as_pointer())
                  for h in range(width)]

        def step(i, accs):  # type: ignore[no-untyped-def]
            d0 = builder.mul(i, ir.Constant(_i64, DIM_CHAINS))
            updated = list(accs)
            for c in range(DIM_CHAINS):
                d = builder.add(d0, ir.Constant(_i64, c))
                kv = _load_f32(builder, byte_ptr(builder, k.data, builder.add(base, builder.mul(d, d_stride))), half)
                for h in range(width):
                    qd = splat(builder, builder.load(builder.gep(q_rows[h], [d])), LANES)
                    updated[c * width + h] = fma(builder, qd, kv, accs[c * width + h])
            return updated

        accs = counted_loop(builder, n_steps, [ir.Constant(_vf, None)] * (DIM_CHAINS * width), step)
        scale_v = splat(builder, scale, LANES)
        live = builder.icmp_signed("<", ir.Constant(ir.VectorType(_i64, LANES), list(range(LANES))),
                                   splat(builder, n, LANES))
        minus_inf = ir.Constant(_vf, [float("-inf")] * LANES)
        for h in range(width):
            total = accs[h]
            for c in range(1, DIM_CHAINS):
                total = builder.fadd(total, accs[c * width + h])
            at = builder.add(builder.mul(builder.add(h0, ir.Constant(_i64, h)), s_stride),
                             builder.mul(col, ir.Constant(_i64, 4)))
            scaled = builder.fmul(total, scale_v)
            builder.store(scaled, builder.bitcast(byte_ptr(builder, s.data, at), _vf.as_pointer()), align=4)
            head_max = builder.bitcast(byte_ptr(builder, m.data, builder.mul(
                builder.add(h0, ir.Constant(_i64, h)), builder.extract_value(m.strides, 0))), _f32.as_pointer())
            builder.store(_raise_max(builder, builder.load(head_max), builder.select(live, scaled, minus_inf)),
                          head_max)
        return context.get_dummy_value()

    key_scores.__name__ = key_scores.__qualname__ = f"bench_key_scores_by_{'tile' if tiles else 'dim'}_{width}"
    return intrinsic(key_scores)


_BY_ROW = attend_ir.key_scores_intrinsic(3)
_BY_DIM = key_scores_by_dim_intrinsic(3)
_BY_TILE = key_scores_by_dim_intrinsic(3, tiles=True)


# The key layouts `scores_all` reads: position by position (the cache as it is), dimension by dimension, and
# tiles of 16 positions dimension by dimension (`tiled_view`).
BY_ROW, BY_DIM, BY_TILE = 0, 1, 2


@numba.njit(nogil=True)
def scores_all(q, pool, ctx, scale, scores, maxes, reps, layout):  # type: ignore[no-untyped-def]
    """Every sequence's and kv head's scores of keys 0 .. ctx - 1, reps times, over keys in `layout` (BY_ROW,
    BY_DIM, BY_TILE). scores[b, kvh] (3, >= ctx rounded up to 16) and maxes[b, kvh] (3,) take the last rep's."""
    for _ in range(reps):
        for b in range(pool.shape[0]):
            keys = pool[b]
            for kvh in range(keys.shape[1]):
                for j0 in range(0, ctx, LANES):
                    n = min(LANES, ctx - j0)
                    if layout == BY_DIM:
                        _BY_DIM(q, 0, keys, kvh, j0, n, scale, scores[b, kvh], j0, maxes[b, kvh])
                    elif layout == BY_TILE:
                        _BY_TILE(q, 0, keys, kvh, j0, n, scale, scores[b, kvh], j0, maxes[b, kvh])
                    else:
                        _BY_ROW(q, 0, keys, kvh, j0, n, scale, scores[b, kvh], j0, maxes[b, kvh])


def tiled_view(keys: np.ndarray) -> np.ndarray:
    """float16 keys (batch, kv heads, ctx, hd) kept in tiles of 16 positions, dimension by dimension inside a tile
    (zeros past ctx), as the view `key_scores_by_dim_intrinsic(tiles=True)` takes: [slot, position, kv head, :]
    strides whose position and kv head strides find a tile's first byte (only there; uint16 bits)."""
    batch, kv_heads, ctx, head_dim = keys.shape
    cap = -(-ctx // LANES) * LANES
    padded = np.zeros((batch, kv_heads, cap, head_dim), np.uint16)
    padded[:, :, :ctx] = keys.view(np.uint16)
    tiles = np.ascontiguousarray(padded.reshape(batch, kv_heads, cap // LANES, LANES, head_dim).swapaxes(3, 4))
    item = tiles.itemsize
    return np.lib.stride_tricks.as_strided(
        tiles, shape=(batch, cap, kv_heads, head_dim),
        strides=(kv_heads * cap * head_dim * item, head_dim * item, cap * head_dim * item, item))


# What `write_tile_timing_copies` replaces: ops.py's key-scores intrinsics, decode_layers.py's import of ops.
_OPS_SCORES = ("_key_scores_1, _key_scores_2, _key_scores_3, _key_scores_4 = "
               "(key_scores_intrinsic(w) for w in range(1, 5))")
_LAYERS_IMPORT = "from pantheon.kernels.cpu import attend_ir, gemm_call, int8dot, int8k, ops, quant, team"
PACKAGE = Path(__file__).resolve().parent.parent / "pantheon" / "kernels" / "cpu"


def write_tile_timing_copies(folder: Path) -> Path:
    """Scratch copies that time tiles of 16 keys inside the decode step without the layout: ops.py with the
    tiled key scores (`key_scores_by_dim_intrinsic(tiles=True)`) in place of the attention's, and decode_layers.py
    importing that copy. Over the cache as it is (head-major rows, `CpuBackend.kv_pool`) a tile's read is the same
    2 KB that positions j0 .. j0 + 15 of the kv head fill, so the step reads the same memory and does the tiled
    arithmetic, with wrong scores (the timing only counts: every stream decodes its fixed number of tokens). What a
    real tiled cache adds, its writes of a key as 64 values 32 bytes apart, is left out. Returns the
    decode_layers copy; a statement it looks for and does not find stops it with the statement's text."""
    ops_copy = folder / "ops_key_tiles.py"
    ops_copy.write_text(replace_once((PACKAGE / "ops.py").read_text(), _OPS_SCORES, (
        "from bench.key_layout import key_scores_by_dim_intrinsic  # noqa: E402\n"
        "_key_scores_1, _key_scores_2, _key_scores_3, _key_scores_4 = "
        "(key_scores_by_dim_intrinsic(w, tiles=True) for w in range(1, 5))"), "ops.py changed"))
    layers_copy = folder / "decode_layers_key_tiles.py"
    layers_copy.write_text(replace_once((PACKAGE / "decode_layers.py").read_text(), _LAYERS_IMPORT, (
        "from pantheon.kernels.cpu import attend_ir, gemm_call, int8dot, int8k, quant, team\n"
        "from bench.step_ab import load_copy as _load_copy\n"
        f"ops = _load_copy({str(ops_copy)!r}, 'ops_key_tiles')"), "decode_layers.py changed"))
    return layers_copy


def in_step(levels: list[int], rounds: int, tokens: int, threads: int) -> dict[str, Any]:
    """The decode step with the tiled key scores (`write_tile_timing_copies`) against it as it is, in one process,
    taking turns run by run (`bench.step_ab.compare_teams`, in-process batched decode of the default model)."""
    from bench.batched import PantheonBatched
    from bench.common import default_model
    from bench.step_ab import compare_teams, load_copy
    from pantheon.kernels.cpu import decode_layers

    with tempfile.TemporaryDirectory() as tmp:
        teams = {"by_row": decode_layers._team_step,
                 "tiles": load_copy(write_tile_timing_copies(Path(tmp)), "decode_layers_key_tiles")._team_step}
        rates = compare_teams(PantheonBatched(default_model(), threads), levels, rounds, tokens, teams)
    return {str(n): {"by_row_tok_s": rates[("by_row", n)], "tiles_tok_s": rates[("tiles", n)],
                     "tiles_over_by_row": statistics.median(
                         t / r for r, t in zip(rates[("by_row", n)], rates[("tiles", n)]))}
            for n in levels}


def make_keys(batch: int, kv_heads: int, ctx: int, head_dim: int, seed: int = 0
              ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The same float16 keys in both layouts, as [slot, position, kv head, :] views of uint16 bits (each
    layout's rows padded to a multiple of 16 positions, zeros past ctx), and the keys as float32."""
    cap = -(-ctx // LANES) * LANES
    values = np.random.default_rng(seed).standard_normal((batch, kv_heads, ctx, head_dim)).astype(np.float16)
    by_row = np.zeros((batch, kv_heads, cap, head_dim), np.uint16)
    by_row[:, :, :ctx] = values.view(np.uint16)
    by_dim = np.zeros((batch, kv_heads, head_dim, cap), np.uint16)
    by_dim[:, :, :, :ctx] = values.view(np.uint16).transpose(0, 1, 3, 2)
    return by_row.transpose(0, 2, 1, 3), by_dim.transpose(0, 3, 1, 2), values.astype(np.float32)


def run(batch: int, position: int, rounds: int, keys_per_call: int, kv_heads: int = 3, head_dim: int = 64
        ) -> dict[str, Any]:
    by_row, by_dim, keys = make_keys(batch, kv_heads, position, head_dim)
    q = np.random.default_rng(1).standard_normal((3, head_dim)).astype(np.float32)
    scale = np.float32(head_dim ** -0.5)
    want = np.einsum("bkpd,hd->bkhp", keys, q) * scale
    cap = by_row.shape[1]  # positions a row holds: a multiple of 16, so each call's 16 lanes stay inside
    outputs = {}
    for name, layout, pool in (("by_row", BY_ROW, by_row), ("by_dim", BY_DIM, by_dim)):
        scores = np.zeros((batch, kv_heads, 3, cap), np.float32)
        maxes = np.full((batch, kv_heads, 3), -np.inf, np.float32)
        scores_all(q, pool, position, scale, scores, maxes, 1, layout)
        np.testing.assert_allclose(scores[..., :position], want, rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(maxes, want.max(axis=-1), rtol=1e-5, atol=1e-5)
        outputs[name] = (layout, pool, scores, maxes)
    reps = max(1, keys_per_call // (batch * kv_heads * position))
    times: dict[str, list[float]] = {name: [] for name in outputs}
    for _ in range(rounds):
        for name, (layout, pool, scores, maxes) in outputs.items():
            start = time.perf_counter()
            scores_all(q, pool, position, scale, scores, maxes, reps, layout)
            times[name].append((time.perf_counter() - start) / (reps * batch * kv_heads * position) * 1e9)
    ns = {name: statistics.median(t) for name, t in times.items()}
    return {"position": position, "ns_per_key": ns, "rounds_ns_per_key": times,
            "by_dim_over_by_row": ns["by_dim"] / ns["by_row"]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--positions", default="100,400,1000")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--keys", type=int, default=2_000_000, help="(sequence, kv head, key) triples a timed call")
    ap.add_argument("--in-step", action="store_true", help="time tiles of 16 keys inside the decode step instead")
    ap.add_argument("--levels", default="1,8", help="--in-step: the batch sizes")
    ap.add_argument("--tokens", type=int, default=128, help="--in-step: decode steps a run")
    ap.add_argument("--threads", type=int, default=2, help="--in-step: the step's threads")
    args = ap.parse_args()
    if args.in_step:
        levels = [int(v) for v in args.levels.split(",")]
        print("wrote", write_result("key-layout-in-step", {"args": vars(args), "levels": in_step(
            levels, args.rounds, args.tokens, args.threads)}))
        return
    numba.set_num_threads(1)
    rows = [run(args.batch, int(p), args.rounds, args.keys) for p in args.positions.split(",")]
    print(f"key scores, batch {args.batch}, 3 query heads a kv head of 64, float16 keys in the caches, one thread;"
          " ns per (sequence, kv head, key), median of rounds")
    for row in rows:
        ns = row["ns_per_key"]
        print(f"  position {row['position']:>5}: by row {ns['by_row']:.2f}  by dimension {ns['by_dim']:.2f}"
              f"  ratio {row['by_dim_over_by_row']:.2f}")
    print("wrote", write_result("key-layout", {"args": vars(args), "positions": rows}))


if __name__ == "__main__":
    main()
