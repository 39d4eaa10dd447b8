"""pantheon.kernels.cuda.ops against the numpy references, on random inputs (never zeros) and tiny shapes.

KV rows an op must not read hold NaN, so a read past the causal edge shows up as NaN, not as a small error a
tolerance could hide (as in tests/kernels/test_ops.py)."""

from __future__ import annotations

import numpy as np
import pytest

from pantheon.kernels.reference import ops as ref

pytestmark = pytest.mark.cuda_kernels


def random(rng: np.random.Generator, shape, scale: float = 1.0) -> np.ndarray:
    return (rng.standard_normal(shape) * scale).astype(np.float32)


def assert_close(actual: np.ndarray, expected: np.ndarray, rel: float = 1e-5) -> None:
    assert actual.shape == expected.shape
    scale = float(np.max(np.abs(expected)))
    err = float(np.max(np.abs(actual.astype(np.float64) - expected)))
    assert err <= rel * scale, f"max abs diff {err:.3g} > {rel} * output scale {scale:.3g}"


@pytest.fixture(scope="module")
def env():
    from numba import cuda

    from pantheon.kernels.cuda import ops
    from pantheon.kernels.cuda.launch import GEOMETRY

    return ops, cuda, GEOMETRY


def dev(cuda, a):
    return cuda.to_device(np.ascontiguousarray(a))


@pytest.mark.parametrize("dim", [40, 7])
def test_rmsnorm_and_add_rmsnorm(env, dim):
    ops, cuda, _ = env
    rng = np.random.default_rng(dim)
    x, delta, w = random(rng, (3, dim), 3.0), random(rng, (3, dim)), random(rng, dim)
    assert_close(ops.rmsnorm(dev(cuda, x), dev(cuda, w), 1e-5).copy_to_host(), ref.rmsnorm(x, w, 1e-5))
    in_place = dev(cuda, x)
    ops.rmsnorm(in_place, dev(cuda, w), 1e-5, out=in_place)
    assert_close(in_place.copy_to_host(), ref.rmsnorm(x, w, 1e-5))
    residual, out = dev(cuda, x), cuda.device_array((3, dim), np.float32)
    ops.add_rmsnorm(residual, dev(cuda, delta), dev(cuda, w), 1e-5, out)
    want_sum, want_norm = ref.add_rmsnorm(x, delta, w, 1e-5)
    assert_close(residual.copy_to_host(), want_sum)
    assert_close(out.copy_to_host(), want_norm)


@pytest.mark.parametrize("neox", [False, True], ids=["normal", "neox"])
def test_rope(env, neox):
    ops, cuda, _ = env
    rng = np.random.default_rng(1)
    x = random(rng, (3, 2, 16))
    positions = np.array([0, 9, 5000], np.int32)
    xd = dev(cuda, x)
    ops.rope_inplace(xd, dev(cuda, positions), 12, 10000.0, neox, 0.5)  # n_rot < head_dim: dims 12.. untouched
    got = xd.copy_to_host()
    assert_close(got, ref.rope(x, positions, 12, 10000.0, neox, 0.5))
    assert np.array_equal(got[..., 12:], x[..., 12:])
    with pytest.raises(ValueError):
        ops.rope_inplace(xd, dev(cuda, positions), 7, 10000.0, neox)


def test_swiglu_kv_write_gather_fill(env):
    ops, cuda, _ = env
    rng = np.random.default_rng(2)
    gate, up = random(rng, (3, 20), 4.0), random(rng, (3, 20))
    gate[0, 0] = -200.0  # exp overflow: silu -> -0
    assert_close(ops.swiglu(dev(cuda, gate), dev(cuda, up)).copy_to_host(), ref.swiglu(gate, up))
    g = dev(cuda, gate)
    ops.swiglu(g, dev(cuda, up), out=g)
    assert_close(g.copy_to_host(), ref.swiglu(gate, up))

    pool = np.full((2, 5, 2, 3), 7.0, np.float32)
    values = random(rng, (3, 2, 3))
    slots, positions = np.array([1, 0, 1], np.int32), np.array([4, 0, 2], np.int32)
    pd = dev(cuda, pool)
    ops.kv_write(pd, dev(cuda, slots), dev(cuda, positions), dev(cuda, values))
    pool[slots, positions] = values
    assert np.array_equal(pd.copy_to_host(), pool)

    x = random(rng, (4, 6))
    rows = np.array([3, 0, 3], np.int64)
    assert np.array_equal(ops.gather_rows(dev(cuda, x), dev(cuda, rows)).copy_to_host(), x[rows])
    parts = ops.split_cols(dev(cuda, x), (1, 3, 2))
    assert [p.shape for p in parts] == [(4, 1), (4, 3), (4, 2)]
    for part, expected in zip(parts, (x[:, :1], x[:, 1:4], x[:, 4:])):
        assert np.array_equal(part.copy_to_host(), expected)
    with pytest.raises(ValueError):
        ops.split_cols(dev(cuda, x), (2, 2))
    filled = ops.fill(cuda.device_array((3, 5), np.float32), 0).copy_to_host()
    assert np.array_equal(filled, np.zeros((3, 5), np.float32))


def kv_pools(rng, n_slots: int, ctx: int, n_kv: int, hd: int, valid: list[int]):
    k, v = random(rng, (n_slots, ctx, n_kv, hd)), random(rng, (n_slots, ctx, n_kv, hd))
    for slot, n in enumerate(valid):
        k[slot, n:] = np.nan
        v[slot, n:] = np.nan
    return k, v


@pytest.mark.parametrize("n_tokens,start_pos", [(1, 0), (2, 9), (3, 0), (6, 5)])
@pytest.mark.parametrize("heads", [(4, 2), (2, 2), (4, 1)], ids=["gqa", "mha", "mqa"])
def test_attention_prefill(env, n_tokens, start_pos, heads):
    """1-2 tokens take the split-K decode kernel, 3+ the tiled prefill kernel (two query tiles at 6)."""
    ops, cuda, _ = env
    n_q, n_kv = heads
    hd, ctx = 8, 16
    rng = np.random.default_rng(n_tokens * 10 + start_pos)
    n_valid = start_pos + n_tokens
    k, v = kv_pools(rng, 2, ctx, n_kv, hd, [ctx, n_valid])
    q = random(rng, (n_tokens, n_q, hd))
    want = ref.attention(q, k[1], v[1], start_pos, 0.35)
    got = ops.attention(dev(cuda, q), dev(cuda, k), dev(cuda, v), 1, start_pos, 0.35).copy_to_host()
    assert_close(got, want)
    qd = dev(cuda, q)
    ops.attention(qd, dev(cuda, k), dev(cuda, v), 1, start_pos, 0.35, out=qd)  # out may be q
    assert_close(qd.copy_to_host(), want)


def test_attention_rejects_bad_geometry(env):
    ops, cuda, _ = env
    q = dev(cuda, np.ones((2, 4, 8), np.float32))
    pool = dev(cuda, np.ones((1, 8, 2, 8), np.float32))
    with pytest.raises(ValueError):
        ops.attention(q, pool, pool, 0, 7, 1.0)  # rows 7..8 outside a cache of 8
    with pytest.raises(ValueError):
        ops.attention(q, pool, pool, 1, 0, 1.0)  # no slot 1
    with pytest.raises(ValueError):
        ops.attention(dev(cuda, np.ones((2, 3, 8), np.float32)), pool, pool, 0, 0, 1.0)  # 3 heads over 2


@pytest.mark.parametrize("ctx", [8, 32], ids=["one-split", "split-k"])
def test_attention_decode_batch(env, ctx):
    """Sequences of different lengths in any slots; at ctx 32 the simulator geometry splits the KV four ways,
    so short sequences leave splits empty and long ones span all of them."""
    ops, cuda, geometry = env
    rng = np.random.default_rng(ctx)
    n_q, n_kv, hd = 4, 2, 8
    positions = np.array([ctx - 1, 0, 5, 2], np.int32)
    slot_ids = np.array([2, 0, 1, 2], np.int32)
    lengths = [0, 0, 0]
    for s, p in zip(slot_ids, positions):
        lengths[s] = max(lengths[s], p + 1)
    k, v = kv_pools(rng, 3, ctx, n_kv, hd, lengths)
    q = random(rng, (4, n_q, hd))
    got = ops.attention_decode_batch(dev(cuda, q), dev(cuda, k), dev(cuda, v), dev(cuda, positions), 0.3,
                                     slot_ids=dev(cuda, slot_ids)).copy_to_host()
    for b in range(4):
        # the reference reads rows 0..positions[b]; rows past it in a longer slot are not NaN, so slice them off
        s, p = slot_ids[b], positions[b]
        want = ref.attention(q[b:b + 1], k[s, :p + 1], v[s, :p + 1], p, 0.3)
        assert_close(got[b:b + 1], want)
    if ctx == 32:
        assert -(-ctx // geometry.split_keys) > 1  # the split path really ran


def test_attention_decode_out_of_range_gives_nan(env):
    ops, cuda, _ = env
    q = dev(cuda, np.ones((2, 2, 8), np.float32))
    pool = dev(cuda, np.ones((1, 8, 2, 8), np.float32))
    got = ops.attention_decode_batch(q, pool, pool, dev(cuda, np.array([3, 8], np.int32)), 1.0,
                                     slot_ids=dev(cuda, np.array([0, 0], np.int32))).copy_to_host()
    assert np.isfinite(got[0]).all() and np.isnan(got[1]).all()
