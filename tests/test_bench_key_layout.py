"""bench/key_layout.py: its dimension-major key scores agree with numpy and with the position-major intrinsic the
attention uses, on tiny shapes, and leave the lanes past a run's last key out of the max."""

from __future__ import annotations

import numpy as np
import pytest

from bench.key_layout import make_keys, run, scores_all

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
        scores_all(q, pool, 40, np.float32(0.25), scores, maxes, 1, name == "dim")
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
    scores_all(q, by_dim, 20, np.float32(1.0), scores, maxes, 1, True)
    want = np.einsum("bkpd,hd->bkhp", keys, q)
    np.testing.assert_allclose(maxes, want.max(axis=-1), rtol=1e-5)
    assert (scores[..., 20:32] > 700).all()  # stored, as the docstring says, but not in the max
