"""bench/key_layout.py: its dimension-major key scores agree with numpy and with the position-major intrinsic the
attention uses, on tiny shapes, and leave the lanes past a run's last key out of the max; its tiled scores agree
with numpy over a tiled cache; its in-step copies route the decode step's attention to them."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from bench.key_layout import (BY_DIM, BY_ROW, BY_TILE, make_keys, run, scores_all, tiled_view,
                              write_tile_timing_copies)
from bench.step_ab import load_copy

pytestmark = pytest.mark.slow


def test_both_layouts_score_the_same_keys_alike() -> None:
    result = run(batch=2, position=40, rounds=1, keys_per_call=1000, head_dim=16)  # 40: a run ends mid-vector
    assert set(result["ns_per_key"]) == {"by_row", "by_dim"}
    assert all(ns > 0 for ns in result["ns_per_key"].values())

    by_row, by_dim, keys = make_keys(batch=1, kv_heads=3, ctx=40, head_dim=16, seed=3)
    q = np.random.default_rng(4).standard_normal((3, 16)).astype(np.float32)
    got = {}
    for name, pool in (("row", by_row), ("dim", by_dim)):
        scores = np.zeros((1, 3, 3, 48), np.float32)
        maxes = np.full((1, 3, 3), -np.inf, np.float32)
        scores_all(q, pool, 40, np.float32(0.25), scores, maxes, 1, BY_DIM if name == "dim" else BY_ROW)
        got[name] = (scores[..., :40], maxes)
    np.testing.assert_allclose(got["dim"][0], got["row"][0], rtol=1e-5, atol=1e-6)  # sums in another order
    for scores, maxes in got.values():
        np.testing.assert_array_equal(maxes, scores.max(axis=-1))  # each layout's max is its own scores' max


def test_positions_past_the_run_stay_out_of_the_max() -> None:
    _, by_dim, keys = make_keys(batch=1, kv_heads=3, ctx=20, head_dim=16, seed=5)
    by_dim.base[..., 20:] = np.float16(50.0).view(np.uint16)  # positions 20..31 of each dimension's row
    q = np.ones((3, 16), np.float32)  # those positions would score 800
    scores = np.zeros((1, 3, 3, 32), np.float32)
    maxes = np.full((1, 3, 3), -np.inf, np.float32)
    scores_all(q, by_dim, 20, np.float32(1.0), scores, maxes, 1, BY_DIM)
    want = np.einsum("bkpd,hd->bkhp", keys, q)
    np.testing.assert_allclose(maxes, want.max(axis=-1), rtol=1e-5)
    assert (scores[..., 20:32] > 700).all()  # stored, as the docstring says, but not in the max


def test_tiles_score_a_tiled_cache() -> None:
    """The intrinsic the in-step timing puts in the attention computes the right scores over a real tiled cache
    (a run ending mid-tile too), so the step it is timed in does the arithmetic a tiled cache would."""
    rng = np.random.default_rng(6)
    keys = rng.standard_normal((2, 3, 40, 16)).astype(np.float16)
    q = rng.standard_normal((3, 16)).astype(np.float32)
    scores = np.zeros((2, 3, 3, 48), np.float32)
    maxes = np.full((2, 3, 3), -np.inf, np.float32)
    scores_all(q, tiled_view(keys), 40, np.float32(0.25), scores, maxes, 1, BY_TILE)
    want = np.einsum("bkpd,hd->bkhp", keys.astype(np.float32), q) * np.float32(0.25)
    np.testing.assert_allclose(scores[..., :40], want, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(maxes, want.max(axis=-1), rtol=1e-5, atol=1e-5)


def test_in_step_copies_route_the_attention_to_the_tiled_scores(tmp_path: Path) -> None:
    layers_copy = write_tile_timing_copies(tmp_path)
    module = load_copy(layers_copy, "decode_layers_key_tiles_test")
    assert module.ops.__name__ == "ops_key_tiles"  # the copy's attention is the scratch ops, not pantheon's
    assert "key_scores_by_dim_intrinsic(w, tiles=True)" in (tmp_path / "ops_key_tiles.py").read_text()
    assert callable(module._team_step)
