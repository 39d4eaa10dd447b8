"""The numba CPU kernels in pantheon.kernels.cpu.ops against the numpy references, on random inputs.

Cache rows that an op must not read are filled with NaN, so a read past the causal edge shows up as NaN in
the output instead of as a small error that a tolerance could hide.
"""

from __future__ import annotations

import numba
import numpy as np
import pytest

from pantheon.kernels.cpu import ops
from pantheon.kernels.reference import ops as ref

TOKEN_COUNTS = [1, 5, 64, 130]
HEAD_LAYOUTS = [(9, 3), (4, 4), (8, 1)]  # (query heads, kv heads)
HEAD_DIMS = [64, 32]


def random(rng: np.random.Generator, shape, scale: float = 1.0) -> np.ndarray:
    return (rng.standard_normal(shape) * scale).astype(np.float32)


def assert_close(actual: np.ndarray, expected: np.ndarray, rel: float = 1e-4) -> None:
    """Max abs difference within `rel` of the output scale (NaN anywhere fails)."""
    assert actual.shape == expected.shape
    scale = float(np.max(np.abs(expected)))
    err = float(np.max(np.abs(actual.astype(np.float64) - expected)))
    assert err <= rel * scale, f"max abs diff {err:.3g} > {rel} * output scale {scale:.3g}"


def kv_cache(rng, ctx: int, n_kv_heads: int, head_dim: int, n_valid: int) -> tuple[np.ndarray, np.ndarray]:
    """(ctx, Hkv, hd) K and V caches: random rows below n_valid, NaN garbage from there on."""
    k = random(rng, (ctx, n_kv_heads, head_dim))
    v = random(rng, (ctx, n_kv_heads, head_dim))
    k[n_valid:] = np.nan
    v[n_valid:] = np.nan
    return k, v


# --- rmsnorm -------------------------------------------------------------------------------------------


@pytest.mark.parametrize("n_tokens", TOKEN_COUNTS)
@pytest.mark.parametrize("dim", [576, 64])
def test_rmsnorm_matches_reference(n_tokens, dim):
    rng = np.random.default_rng(n_tokens * 1000 + dim)
    x = random(rng, (n_tokens, dim), scale=3.0)
    weight = random(rng, dim)
    expected = ref.rmsnorm(x, weight, 1e-5)
    assert_close(ops.rmsnorm(x, weight, 1e-5), expected)
    out = np.empty_like(x)
    assert ops.rmsnorm(x, weight, 1e-5, out=out) is out
    assert_close(out, expected)
    ops.rmsnorm(x, weight, 1e-5, out=x)  # in place
    assert_close(x, expected)


@pytest.mark.parametrize("n_tokens", TOKEN_COUNTS)
def test_add_rmsnorm_updates_residual_and_normalizes(n_tokens):
    rng = np.random.default_rng(n_tokens)
    residual = random(rng, (n_tokens, 576), scale=5.0)
    delta = random(rng, (n_tokens, 576))
    weight = random(rng, 576)
    expected_residual, expected_out = ref.add_rmsnorm(residual, delta, weight, 1e-6)
    out = np.empty_like(residual)
    ops.add_rmsnorm(residual, delta, weight, 1e-6, out)
    np.testing.assert_array_equal(residual, expected_residual)  # a float32 add is exact either way
    assert_close(out, expected_out)


# --- rope ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("n_tokens", TOKEN_COUNTS)
@pytest.mark.parametrize("head_dim", HEAD_DIMS)
@pytest.mark.parametrize("partial", [False, True])
@pytest.mark.parametrize("neox", [False, True])
def test_rope_matches_reference(n_tokens, head_dim, partial, neox):
    rng = np.random.default_rng(n_tokens * 100 + head_dim + 7 * partial + 3 * neox)
    n_rot = head_dim // 2 if partial else head_dim
    x = random(rng, (n_tokens, 5, head_dim))
    # mostly large positions, where a float32 angle would already be visibly off
    positions = rng.integers(0, 6000, n_tokens).astype(np.int32)
    positions[0] = 5000
    expected = ref.rope(x, positions, n_rot, 10000.0, neox)
    rotated = x.copy()
    ops.rope_inplace(rotated, positions, n_rot, 10000.0, neox)
    assert_close(rotated, expected)
    np.testing.assert_array_equal(rotated[..., n_rot:], x[..., n_rot:])


@pytest.mark.parametrize("neox", [False, True])
def test_rope_freq_base_and_scale(neox):
    rng = np.random.default_rng(11)
    x = random(rng, (64, 3, 64))
    positions = (np.arange(64) * 97 + 5000).astype(np.int32)
    expected = ref.rope(x, positions, 48, 1_000_000.0, neox, freq_scale=0.25)
    ops.rope_inplace(x, positions, 48, 1_000_000.0, neox, freq_scale=0.25)
    assert_close(x, expected)


def test_rope_position_zero_is_identity():
    rng = np.random.default_rng(12)
    x = random(rng, (3, 4, 64))
    rotated = x.copy()
    ops.rope_inplace(rotated, np.zeros(3, dtype=np.int32), 64, 10000.0, False)
    np.testing.assert_array_equal(rotated, x)


def test_rope_rejects_odd_or_oversized_n_rot():
    x = np.ones((1, 1, 32), dtype=np.float32)
    positions = np.zeros(1, dtype=np.int32)
    for n_rot in (31, 34, 0):
        with pytest.raises(ValueError):
            ops.rope_inplace(x, positions, n_rot, 10000.0, False)


def test_rope_reuses_angles_only_for_the_same_positions_and_frequencies():
    """The sin/cos table is kept between calls: a second call with other positions (same array, changed in
    place), another base or another n_rot must not reuse it."""
    rng = np.random.default_rng(13)
    positions = np.array([5, 900], dtype=np.int32)
    for n_rot, base in ((64, 10000.0), (64, 10000.0), (32, 10000.0), (64, 500000.0)):
        for _ in range(2):
            x = random(rng, (2, 3, 64))
            rotated = x.copy()
            ops.rope_inplace(rotated, positions, n_rot, base, False)
            assert_close(rotated, ref.rope(x, positions, n_rot, base, False))
            positions += 7


# --- kv cache ------------------------------------------------------------------------------------------


def test_kv_write_matches_numpy_assignment_and_checks_bounds():
    rng = np.random.default_rng(14)
    pool = random(rng, (3, 10, 2, 8))
    expected = pool.copy()
    slots, positions = np.array([2, 0, 2], dtype=np.int32), np.array([9, 0, 4], dtype=np.int32)
    values = random(rng, (3, 2, 8))
    expected[slots, positions] = values
    ops.kv_write(pool, slots, positions, values)
    np.testing.assert_array_equal(pool, expected)
    for bad_slots, bad_positions in (([3], [0]), ([0], [10]), ([-1], [0]), ([0], [-1])):
        with pytest.raises(IndexError):
            ops.kv_write(pool, np.array(bad_slots, np.int32), np.array(bad_positions, np.int32), values[:1])
    np.testing.assert_array_equal(pool, expected)  # a refused write changed nothing
    with pytest.raises(ValueError):
        ops.kv_write(pool, slots, positions, random(rng, (3, 2, 4)))


def test_kv_write_into_a_float16_pool_rounds_like_numpy():
    rng = np.random.default_rng(15)
    pool = np.zeros((2, 6, 2, 8), dtype=np.float16)
    values = random(rng, (3, 2, 8), scale=3.0)
    values[0, 0, :4] = [1.0 + 2.0**-11, 1.0 + 3 * 2.0**-11, 70000.0, -1e-9]  # ties to even, overflow, underflow
    values[0, 1, 0] = np.nan
    slots, positions = np.array([1, 0, 1], dtype=np.int32), np.array([5, 0, 2], dtype=np.int32)
    ops.kv_write(pool, slots, positions, values)
    expected = np.zeros_like(pool)
    with np.errstate(over="ignore"):
        expected[slots, positions] = values.astype(np.float16)
    np.testing.assert_array_equal(pool, expected)
    assert pool[1, 5, 0, 0] == 1.0 and pool[1, 5, 0, 1] == np.float16(1.0 + 2.0**-9) and np.isinf(pool[1, 5, 0, 2])


@pytest.mark.parametrize("heads", HEAD_LAYOUTS)
def test_attention_over_float16_caches(heads):
    """A float16 cache is read as the float32 values it rounds to; the queries are rounded to float16 for the
    dot products and the softmax weights for the products with the values (llama.cpp's arithmetic), by
    prefill and decode alike. Against float32 arithmetic on the rounded q, K and V that moves the output by
    ~1.5e-4 of its scale (float16 keeps 11 bits)."""
    n_q_heads, n_kv_heads = heads
    rng = np.random.default_rng(n_q_heads + 40)
    n_tokens, start_pos = 37, 90
    k, v = kv_cache(rng, 140, n_kv_heads, 64, start_pos + n_tokens)
    k16, v16 = k.astype(np.float16), v.astype(np.float16)
    k32, v32 = k16.astype(np.float32), v16.astype(np.float32)
    q = random(rng, (n_tokens, n_q_heads, 64))
    q32 = q.astype(np.float16).astype(np.float32)
    prefill = ops.attention(q, k16, v16, start_pos, 0.125)
    exact = ref.attention(q32, k32, v32, start_pos, 0.125)
    assert_close(prefill, exact, rel=5e-4)
    assert not np.array_equal(prefill, ops.attention(q32, k32, v32, start_pos, 0.125))  # the weights were rounded
    positions = np.arange(start_pos, start_pos + n_tokens, dtype=np.int32)
    slots = np.zeros(n_tokens, dtype=np.int32)
    decode = ops.attention_decode_batch(q, k16[None], v16[None], positions, 0.125, slot_ids=slots)
    assert_close(decode, prefill, rel=1e-6)


@pytest.mark.parametrize("n_tokens", [1, 8, 40])
@pytest.mark.parametrize("kv_dtype", [np.float32, np.float16])
@pytest.mark.parametrize("neox", [False, True])
@pytest.mark.parametrize("n_rot", [64, 32])
def test_rope_qkv_into_cache_equals_split_rope_and_kv_write(n_tokens, kv_dtype, neox, n_rot):
    """The fused kernel gives the bits of the ops it replaces: split, rope of q and k, kv_write of k and v."""
    n_q, n_kv, head_dim = 9, 3, 64
    rng = np.random.default_rng(n_tokens + n_rot + neox)
    qkv = random(rng, (n_tokens, (n_q + 2 * n_kv) * head_dim))
    slots = rng.integers(0, 4, n_tokens).astype(np.int32)
    positions = (np.arange(n_tokens) * 3 + 5).astype(np.int32)
    k_pool = np.full((4, 128, n_kv, head_dim), np.nan, dtype=kv_dtype)
    v_pool = k_pool.copy()
    expected_k, expected_v = k_pool.copy(), v_pool.copy()
    q = ops.rope_qkv_into_cache(qkv, n_q, k_pool, v_pool, slots, positions, n_rot, 10000.0, neox)
    widths = np.cumsum([0, n_q * head_dim, n_kv * head_dim, n_kv * head_dim])
    q2, k2, v2 = (qkv[:, a:b].copy().reshape(n_tokens, -1, head_dim)
                  for a, b in zip(widths, widths[1:]))
    ops.rope_inplace(q2, positions, n_rot, 10000.0, neox)
    ops.rope_inplace(k2, positions, n_rot, 10000.0, neox)
    ops.kv_write(expected_k, slots, positions, k2)
    ops.kv_write(expected_v, slots, positions, v2)
    np.testing.assert_array_equal(q, q2)
    np.testing.assert_array_equal(k_pool, expected_k)  # NaN where nothing was written, on both sides
    np.testing.assert_array_equal(v_pool, expected_v)
    assert_close(q, ref.rope(qkv[:, : n_q * head_dim].reshape(n_tokens, n_q, head_dim), positions, n_rot,
                             10000.0, neox), rel=1e-5)


def test_rope_qkv_into_cache_rejects_bad_input():
    qkv = np.ones((2, 15 * 8), dtype=np.float32)
    pool = np.zeros((2, 4, 3, 8), dtype=np.float32)
    slots, positions = np.array([0, 1], np.int32), np.array([0, 3], np.int32)
    with pytest.raises(ValueError):  # 8 query heads do not fill the row
        ops.rope_qkv_into_cache(qkv, 8, pool, pool.copy(), slots, positions, 8, 10000.0, False)
    with pytest.raises(IndexError):
        ops.rope_qkv_into_cache(qkv, 9, pool, pool.copy(), slots, np.array([0, 4], np.int32), 8, 10000.0, False)
    with pytest.raises(ValueError):
        ops.rope_qkv_into_cache(qkv, 9, pool, pool.copy(), slots[:1], positions, 8, 10000.0, False)
    assert not pool.any()  # a refused call wrote nothing


@pytest.mark.parametrize("kv_dtype", [np.float32, np.float16])
@pytest.mark.parametrize(("heads", "head_dim"), [((9, 3), 64), ((8, 2), 32), ((4, 4), 48), ((6, 2), 40)])
@pytest.mark.parametrize("positions", [[0], [700], [130, 0, 515, 64, 1023]])
@pytest.mark.parametrize("head_major", [False, True])
def test_attention_decode_qkv_equals_rope_qkv_into_cache_then_decode_attention(kv_dtype, heads, head_dim,
                                                                               positions, head_major):
    """The fused decode step gives the bits of the two launches it replaces, output and caches alike: one
    sequence (its heads split over items) or several, contexts split into runs past 512 keys, both cache
    layouts; a head dim off a multiple of 16 takes the two launches themselves."""
    from pantheon.kernels.cpu.backend import CpuBackend

    n_q, n_kv = heads
    rng = np.random.default_rng(head_dim + len(positions) + positions[0])
    n_slots, ctx = 6, 1100
    positions = np.array(positions, dtype=np.int32)
    slots = rng.permutation(n_slots)[: len(positions)].astype(np.int32)
    qkv = random(rng, (len(positions), (n_q + 2 * n_kv) * head_dim))

    def pools() -> tuple[np.ndarray, np.ndarray]:
        k, v = (CpuBackend.kv_pool(n_slots, ctx, n_kv, head_dim, kv_dtype) if head_major
                else np.empty((n_slots, ctx, n_kv, head_dim), dtype=kv_dtype) for _ in range(2))
        fill = np.random.default_rng(7)
        k[:] = fill.standard_normal(k.shape).astype(kv_dtype)
        v[:] = fill.standard_normal(v.shape).astype(kv_dtype)
        return k, v

    k1, v1 = pools()
    q = ops.rope_qkv_into_cache(qkv, n_q, k1, v1, slots, positions, head_dim, 10000.0, False)
    expected = ops.attention_decode_batch(q, k1, v1, positions, 0.125, slot_ids=slots)
    k2, v2 = pools()
    fused = ops.attention_decode_qkv(qkv, n_q, k2, v2, slots, positions, head_dim, 10000.0, False, 0.125)
    np.testing.assert_array_equal(fused, expected)
    np.testing.assert_array_equal(k2, k1)
    np.testing.assert_array_equal(v2, v1)


def test_attention_decode_qkv_rejects_bad_input():
    n_q, n_kv, hd = 9, 3, 16
    qkv = np.ones((2, (n_q + 2 * n_kv) * hd), dtype=np.float32)
    k, v = np.zeros((3, 8, n_kv, hd), np.float32), np.zeros((3, 8, n_kv, hd), np.float32)
    call = lambda slots, positions, heads=n_q: ops.attention_decode_qkv(  # noqa: E731
        qkv, heads, k, v, np.array(slots, np.int32), np.array(positions, np.int32), hd, 10000.0, False, 0.25)
    with pytest.raises(ValueError, match="one slot"):
        call([1, 1], [2, 5])  # two rows of one slot would race on its cache
    with pytest.raises(ValueError):
        call([0, 3], [2, 5])  # no slot 3
    with pytest.raises(ValueError):
        call([0, 1], [2, 8])  # position past the cache
    with pytest.raises(ValueError):
        call([0, 1], [2, 5], heads=8)  # 8 query heads do not fill the row
    assert not k.any() and not v.any()  # a refused call wrote nothing
    assert call([0, 2], [0, 7]).shape == (2, n_q, hd)


# --- swiglu --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("n_tokens", TOKEN_COUNTS)
def test_swiglu_matches_reference(n_tokens):
    rng = np.random.default_rng(n_tokens + 50)
    gate = random(rng, (n_tokens, 1536), scale=4.0)
    up = random(rng, (n_tokens, 1536))
    expected = ref.swiglu(gate, up)
    assert_close(ops.swiglu(gate, up), expected)
    ops.swiglu(gate, up, out=gate)  # in place over the gate
    assert_close(gate, expected)


@pytest.mark.parametrize("n_tokens", [1, 8, 64])
def test_swiglu_stacked_equals_swiglu_of_the_halves(n_tokens):
    rng = np.random.default_rng(n_tokens + 60)
    gate_up = random(rng, (n_tokens, 2 * 1536), scale=4.0)
    expected = ops.swiglu(np.ascontiguousarray(gate_up[:, :1536]), np.ascontiguousarray(gate_up[:, 1536:]))
    np.testing.assert_array_equal(ops.swiglu_stacked(gate_up), expected)
    with pytest.raises(ValueError):
        ops.swiglu_stacked(gate_up[:, :-1].copy())


def test_swiglu_saturates_cleanly():
    gate = np.linspace(-120.0, 120.0, 2 * 1536, dtype=np.float32).reshape(2, 1536)
    up = np.random.default_rng(3).standard_normal((2, 1536)).astype(np.float32)
    result = ops.swiglu(gate, up)
    assert np.all(np.isfinite(result))
    assert_close(result, ref.swiglu(gate, up))


# --- attention -----------------------------------------------------------------------------------------


@pytest.mark.parametrize("n_tokens", TOKEN_COUNTS)
@pytest.mark.parametrize("heads", HEAD_LAYOUTS)
@pytest.mark.parametrize("head_dim", HEAD_DIMS)
@pytest.mark.parametrize("start_pos", [0, 17])
def test_attention_matches_reference(n_tokens, heads, head_dim, start_pos):
    n_q_heads, n_kv_heads = heads
    rng = np.random.default_rng(n_tokens * 7919 + n_q_heads * 31 + head_dim + start_pos)
    n_valid = start_pos + n_tokens
    k, v = kv_cache(rng, n_valid + 23, n_kv_heads, head_dim, n_valid)
    q = random(rng, (n_tokens, n_q_heads, head_dim))
    scale = head_dim**-0.5
    expected = ref.attention(q, k, v, start_pos, scale)
    assert_close(ops.attention(q, k, v, start_pos, scale), expected)
    out = np.empty_like(q)
    assert ops.attention(q, k, v, start_pos, scale, out=out) is out
    assert_close(out, expected)


def test_attention_peaked_scores():
    # Scores spread over hundreds of units: the running max is replaced many times, and most weights
    # underflow to zero. Checks the rescaling of the accumulator.
    rng = np.random.default_rng(5)
    k, v = kv_cache(rng, 300, 2, 64, 260)
    q = random(rng, (130, 4, 64), scale=30.0)
    expected = ref.attention(q, k, v, 130, 0.125)
    assert_close(ops.attention(q, k, v, 130, 0.125), expected)
    ops.attention(q, k, v, 130, 0.125, out=q)  # writing over the queries is allowed
    assert_close(q, expected)


def test_attention_long_prompt():
    rng = np.random.default_rng(6)
    k, v = kv_cache(rng, 1100, 1, 64, 1030)
    q = random(rng, (1000, 2, 64))
    assert_close(ops.attention(q, k, v, 30, 0.125), ref.attention(q, k, v, 30, 0.125))


@pytest.mark.parametrize("heads", HEAD_LAYOUTS)
def test_prefill_equals_token_by_token(heads):
    n_q_heads, n_kv_heads = heads
    rng = np.random.default_rng(n_q_heads)
    n_tokens, start_pos = 70, 17
    k, v = kv_cache(rng, 128, n_kv_heads, 64, start_pos + n_tokens)
    q = random(rng, (n_tokens, n_q_heads, 64))
    at_once = ops.attention(q, k, v, start_pos, 0.125)
    one_by_one = np.concatenate(
        [ops.attention(q[t : t + 1], k, v, start_pos + t, 0.125) for t in range(n_tokens)]
    )
    np.testing.assert_array_equal(one_by_one, at_once)
    bounds = [0, 7, 23, 40, n_tokens]  # uneven chunks, as a chunked prefill would send them
    chunked = np.concatenate(
        [ops.attention(q[a:b], k, v, start_pos + a, 0.125) for a, b in zip(bounds, bounds[1:])]
    )
    np.testing.assert_array_equal(chunked, at_once)


@pytest.mark.parametrize("heads", [(9, 3), (12, 2), (4, 4)])
@pytest.mark.parametrize("kv_dtype", [np.float32, np.float16])
@pytest.mark.parametrize("start_pos, n_tokens", [(0, 1), (3, 45), (ops.DECODE_SPLIT_KEYS - 20, 61), (1100, 13)])
def test_prefill_gives_each_position_the_bits_of_its_decode_step(heads, kv_dtype, start_pos, n_tokens):
    """Prefill attends its tokens PREFILL_QUERY_BLOCK at a time over each tile of keys; each token's numbers
    are still those of a decode step at its position (a cached prompt resumes with a cold one's bits), across
    blocks, the key runs of DECODE_SPLIT_KEYS and a block that straddles one, and writing over the queries."""
    n_q_heads, n_kv_heads = heads
    rng = np.random.default_rng(start_pos + n_tokens)
    k, v = kv_cache(rng, start_pos + n_tokens + 9, n_kv_heads, 64, start_pos + n_tokens)
    k, v = k.astype(kv_dtype), v.astype(kv_dtype)
    q = random(rng, (n_tokens, n_q_heads, 64), scale=2.0)
    prefill = ops.attention(q, k, v, start_pos, 0.125)
    positions = np.arange(start_pos, start_pos + n_tokens, dtype=np.int32)
    decoded = np.concatenate([
        ops.attention_decode_batch(q[t : t + 1], k[None], v[None], positions[t : t + 1], 0.125,
                                   slot_ids=np.zeros(1, dtype=np.int32)) for t in range(n_tokens)])
    np.testing.assert_array_equal(prefill, decoded)
    q_rounded = q if kv_dtype == np.float32 else q.astype(np.float16).astype(np.float32)
    expected = ref.attention(q_rounded, k.astype(np.float32), v.astype(np.float32), start_pos, 0.125)
    assert_close(prefill, expected, rel=1e-4 if kv_dtype == np.float32 else 5e-4)
    ops.attention(q, k, v, start_pos, 0.125, out=q)
    np.testing.assert_array_equal(q, prefill)


def test_attention_rejects_rows_past_the_cache():
    q = np.ones((5, 4, 32), dtype=np.float32)
    k = np.ones((20, 2, 32), dtype=np.float32)
    with pytest.raises(ValueError):
        ops.attention(q, k, k, 16, 0.1)
    three_kv_heads = np.ones((20, 3, 32), dtype=np.float32)  # 4 query heads do not split into 3 groups
    with pytest.raises(ValueError):
        ops.attention(q, three_kv_heads, three_kv_heads, 0, 0.1)


# --- attention_decode_batch ----------------------------------------------------------------------------


def stacked_caches(rng, positions, slot_ids, n_slots, ctx, n_kv_heads, head_dim):
    """(S, ctx, Hkv, hd) caches: each used slot valid up to its sequence's position, NaN elsewhere."""
    k_all = np.full((n_slots, ctx, n_kv_heads, head_dim), np.nan, dtype=np.float32)
    v_all = np.full_like(k_all, np.nan)
    for slot, pos in zip(slot_ids, positions):
        k_all[slot], v_all[slot] = kv_cache(rng, ctx, n_kv_heads, head_dim, pos + 1)
    return k_all, v_all


# Decode attention runs the query heads of a kv head together in groups of up to 4 (attend_ir), so groups of
# 6 and 8 exercise the group split; head dims that are multiples of 16 take the vector intrinsics (48: a block
# of 2 chunks and one of 1), others (40) the plain loops.
DECODE_HEAD_LAYOUTS = [*HEAD_LAYOUTS, (32, 8), (12, 2), (16, 2)]
DECODE_HEAD_DIMS = [*HEAD_DIMS, 128, 48, 40]


@pytest.mark.parametrize("heads", DECODE_HEAD_LAYOUTS)
@pytest.mark.parametrize("head_dim", DECODE_HEAD_DIMS)
def test_decode_batch_equals_per_sequence_attention(heads, head_dim):
    n_q_heads, n_kv_heads = heads
    rng = np.random.default_rng(n_q_heads * 10 + head_dim)
    positions = np.array([0, 17, 300, 5, 130], dtype=np.int32)
    slot_ids = np.array([6, 0, 3, 7, 2], dtype=np.int32)
    k_all, v_all = stacked_caches(rng, positions, slot_ids, 8, 320, n_kv_heads, head_dim)
    q = random(rng, (len(positions), n_q_heads, head_dim))
    scale = head_dim**-0.5
    batched = ops.attention_decode_batch(q, k_all, v_all, positions, scale, slot_ids=slot_ids)
    for b, (slot, pos) in enumerate(zip(slot_ids, positions)):
        single = ops.attention(q[b : b + 1], k_all[slot], v_all[slot], int(pos), scale)
        assert_close(batched[b : b + 1], single, rel=1e-6)
        expected = ref.attention(q[b : b + 1], k_all[slot], v_all[slot], int(pos), scale)
        assert_close(batched[b : b + 1], expected)


@pytest.mark.parametrize("kv_dtype", [np.float32, np.float16])
def test_decode_batch_long_contexts_are_split_and_merged(kv_dtype):
    """Keys past DECODE_SPLIT_KEYS are attended in separate work items whose softmax states are merged."""
    rng = np.random.default_rng(33)
    positions = np.array([ops.DECODE_SPLIT_KEYS - 1, ops.DECODE_SPLIT_KEYS, 2 * ops.DECODE_SPLIT_KEYS + 300, 7],
                         dtype=np.int32)
    slot_ids = np.array([1, 2, 0, 3], dtype=np.int32)
    k_all, v_all = stacked_caches(rng, positions, slot_ids, 4, 1400, 3, 64)
    k_all, v_all = k_all.astype(kv_dtype), v_all.astype(kv_dtype)
    q = random(rng, (len(positions), 9, 64), scale=2.0)
    batched = ops.attention_decode_batch(q, k_all, v_all, positions, 0.125, slot_ids=slot_ids)
    for b, (slot, pos) in enumerate(zip(slot_ids, positions)):
        q_b = q[b : b + 1] if kv_dtype == np.float32 else q[b : b + 1].astype(np.float16).astype(np.float32)
        expected = ref.attention(q_b, k_all[slot].astype(np.float32), v_all[slot].astype(np.float32), int(pos), 0.125)
        assert_close(batched[b : b + 1], expected, rel=1e-4 if kv_dtype == np.float32 else 5e-4)


@pytest.mark.parametrize("heads", [(9, 3), (32, 8), (8, 1)])
@pytest.mark.parametrize("kv_dtype", [np.float32, np.float16])
def test_decode_batch_bits_do_not_depend_on_the_batch_or_threads(heads, kv_dtype):
    """A sequence's output is the same bits alone (where its query heads are split over work items) as in a
    batch, and with one thread as with all: batching never changes a greedy token."""
    n_q_heads, n_kv_heads = heads
    rng = np.random.default_rng(n_q_heads)
    positions = np.array([40, 700, 3, 129, 64], dtype=np.int32)
    slot_ids = np.array([4, 0, 2, 1, 3], dtype=np.int32)
    k_all, v_all = stacked_caches(rng, positions, slot_ids, 5, 800, n_kv_heads, 64)
    k_all, v_all = k_all.astype(kv_dtype), v_all.astype(kv_dtype)
    q = random(rng, (len(positions), n_q_heads, 64))
    batched = ops.attention_decode_batch(q, k_all, v_all, positions, 0.125, slot_ids=slot_ids)
    for b in range(len(positions)):
        alone = ops.attention_decode_batch(q[b : b + 1], k_all, v_all, positions[b : b + 1], 0.125,
                                           slot_ids=slot_ids[b : b + 1])
        np.testing.assert_array_equal(alone, batched[b : b + 1])
    threads = numba.get_num_threads()
    try:
        numba.set_num_threads(1)
        one_thread = ops.attention_decode_batch(q, k_all, v_all, positions, 0.125, slot_ids=slot_ids)
    finally:
        numba.set_num_threads(threads)
    np.testing.assert_array_equal(one_thread, batched)


def test_decode_batch_default_slots_and_out():
    rng = np.random.default_rng(21)
    positions = np.array([3, 40], dtype=np.int32)
    k_all, v_all = stacked_caches(rng, positions, [0, 1], 2, 64, 3, 64)
    q = random(rng, (2, 9, 64))
    out = np.empty_like(q)
    assert ops.attention_decode_batch(q, k_all, v_all, positions, 0.125, out) is out
    for b in range(2):
        expected = ref.attention(q[b : b + 1], k_all[b], v_all[b], int(positions[b]), 0.125)
        assert_close(out[b : b + 1], expected)


def test_decode_batch_rejects_bad_input():
    q = np.ones((2, 4, 32), dtype=np.float32)
    k_all = np.ones((3, 16, 2, 32), dtype=np.float32)
    positions = np.array([1, 2], dtype=np.int32)
    with pytest.raises(TypeError):
        ops.attention_decode_batch(q, [k_all[0], k_all[1]], [k_all[0], k_all[1]], positions, 0.1)
    with pytest.raises(ValueError):
        ops.attention_decode_batch(q, k_all, k_all, positions, 0.1, slot_ids=np.array([0, 3], dtype=np.int32))
    with pytest.raises(ValueError):
        ops.attention_decode_batch(q, k_all, k_all, np.array([1, 16], dtype=np.int32), 0.1)


# --- kernel properties ---------------------------------------------------------------------------------


@numba.njit(cache=False)
def _tile_scores(q_rows, width, keys, kvh, j0, n, scale, scores, maxes):
    ops._scores_for_heads(q_rows, 0, width, keys, kvh, j0, n, scale, scores, 0, maxes)


@pytest.mark.parametrize("width", [1, 2, 3, 4])
@pytest.mark.parametrize("kv_dtype", [np.float32, np.float16])
def test_key_scores_raise_each_heads_max_to_its_largest_score_ignoring_nan(width, kv_dtype):
    """The score intrinsic folds each head's running max in registers (attend_ir): the max of the scores it
    stores for keys 0 .. n - 1, NaN scores left out, never lowered, for any n <= 16."""
    rng = np.random.default_rng(width)
    head_dim, n_kv = 64, 2
    keys = rng.standard_normal((20, n_kv, head_dim)).astype(kv_dtype)
    keys[5, 1, 3] = np.nan  # key 5 of kv head 1 scores NaN for every head
    view = ops.kernel_view(keys[None])[0]
    q_rows = rng.standard_normal((width, head_dim)).astype(np.float32)
    for kvh in range(n_kv):
        for j0, n in [(0, 16), (2, 5), (4, 1), (4, 2), (1, 16), (5, 1)]:
            scores = np.zeros((width, 16), dtype=np.float32)
            start = rng.standard_normal(width).astype(np.float32)
            start[0] = np.float32(50.0)  # above every score: stays
            maxes = start.copy()
            _tile_scores(q_rows, width, view, kvh, j0, n, np.float32(0.125), scores, maxes)
            for h in range(width):
                valid = scores[h, :n][~np.isnan(scores[h, :n])]
                expected = max(start[h], valid.max()) if valid.size else start[h]
                assert maxes[h] == expected, (kvh, j0, n, h)
            if kvh == 1 and j0 == 5 and n == 1:
                assert np.isnan(scores[:, 0]).all()


@numba.njit(cache=False)
def _prefetch(cache, kvh, j0, j1):
    ops._prefetch_rows(cache, kvh, j0, j1)


@pytest.mark.parametrize("kv_dtype", [np.float32, np.float16])
@pytest.mark.parametrize("head_major", [False, True])
def test_prefetch_rows_takes_any_run_of_rows_and_changes_nothing(kv_dtype, head_major):
    """Decode attention prefetches the key and value rows it is about to read (attend_ir): over head-major pools
    (adjacent rows, one run of lines) and C-ordered ones (a row apart), any run of rows within the cache, the
    empty run included, compiles, runs and leaves the cache as it was."""
    from pantheon.kernels.cpu.backend import CpuBackend

    n_slots, ctx, n_kv, head_dim = 2, 40, 3, 64
    rng = np.random.default_rng(5)
    pool = CpuBackend.kv_pool(n_slots, ctx, n_kv, head_dim, kv_dtype) if head_major else np.empty(
        (n_slots, ctx, n_kv, head_dim), dtype=kv_dtype)
    pool[...] = rng.standard_normal(pool.shape).astype(kv_dtype)
    before = pool.copy()
    view = ops.kernel_view(pool)
    for slot in range(n_slots):
        for kvh in range(n_kv):
            for j0, j1 in [(0, 0), (0, 1), (7, 7), (0, ctx), (ctx - 1, ctx), (3, 29)]:
                _prefetch(view[slot], kvh, j0, j1)
    np.testing.assert_array_equal(pool, before)


def test_every_kernel_releases_the_gil():
    kernels = [value for value in vars(ops).values() if isinstance(value, numba.core.registry.CPUDispatcher)]
    assert len(kernels) >= 10
    for kernel in kernels:
        assert kernel.targetoptions.get("nogil"), kernel.py_func.__name__


@pytest.mark.parametrize("kv_dtype", [np.float32, np.float16])
@pytest.mark.parametrize("head_dim", [64, 48, 40])
def test_head_major_pools_give_the_same_bits(kv_dtype, head_dim):
    """The cpu backend stores KV pools head-major behind the [slot, position, head] view (CpuBackend.kv_pool):
    writing into them and attending over them gives exactly what C-ordered pools give (the plain loops that
    head dims off a multiple of 16 take compile differently for strided arrays: equal within rounding)."""
    from pantheon.kernels.cpu.backend import CpuBackend

    n_q, n_kv, n_slots, ctx = 9, 3, 3, 96
    rng = np.random.default_rng(head_dim)
    strided_k = CpuBackend.kv_pool(n_slots, ctx, n_kv, head_dim, kv_dtype)
    strided_v = CpuBackend.kv_pool(n_slots, ctx, n_kv, head_dim, kv_dtype)
    assert strided_k.shape == (n_slots, ctx, n_kv, head_dim) and not strided_k.flags.c_contiguous
    assert strided_k.strides[1] == head_dim * strided_k.itemsize  # a kv head's positions are adjacent
    plain_k, plain_v = np.zeros_like(strided_k, order="C"), np.zeros_like(strided_v, order="C")
    positions = np.concatenate([np.arange(60), np.arange(37), np.arange(80)]).astype(np.int32)
    slots = np.repeat(np.arange(n_slots), [60, 37, 80]).astype(np.int32)
    qkv = random(rng, (len(positions), (n_q + 2 * n_kv) * head_dim))
    q_plain = ops.rope_qkv_into_cache(qkv, n_q, plain_k, plain_v, slots, positions, head_dim, 10000.0, False)
    q_strided = ops.rope_qkv_into_cache(qkv, n_q, strided_k, strided_v, slots, positions, head_dim, 10000.0, False)
    np.testing.assert_array_equal(q_strided, q_plain)
    np.testing.assert_array_equal(strided_k, plain_k)
    np.testing.assert_array_equal(strided_v, plain_v)
    extra = random(rng, (2, n_kv, head_dim))
    for pool in (plain_k, strided_k):
        ops.kv_write(pool, np.array([0, 1], np.int32), np.array([60, 37], np.int32), extra)
    np.testing.assert_array_equal(strided_k, plain_k)
    last = np.array([60, 37, 79], dtype=np.int32)
    q = random(rng, (3, n_q, head_dim))
    ids = np.array([0, 1, 2], dtype=np.int32)
    strided = ops.attention_decode_batch(q, strided_k, strided_v, last, 0.1, slot_ids=ids)
    plain = ops.attention_decode_batch(q, plain_k, plain_v, last, 0.1, slot_ids=ids)
    if head_dim % 16 == 0:
        np.testing.assert_array_equal(strided, plain)
    else:
        assert_close(strided, plain, rel=1e-5)


def _fresh_asm(fn, *args) -> str:
    """The assembly of fn's numba function compiled afresh (not from the on-disk cache, whose code cannot be
    inspected) with the module's flags, for args."""
    probe = numba.njit(nogil=True, fastmath=ops._FASTMATH, error_model="numpy")(fn.py_func)
    probe(*args)
    return "\n".join(cres.library.get_asm_str() for cres in probe.overloads.values())


def test_the_decode_steps_elementwise_loops_vectorize_without_gathers():
    """The SwiGLU's column runs and a decode attention item's rotations and cache writes read and write runs of
    consecutive floats. Indexed as `row[lo + i]`, the index could be negative as far as LLVM knew, numba's
    wrap-around of negative indices stayed in the loop, and LLVM vectorized it with gathers and scatters
    (the SwiGLU of 8 rows of 1536 on one thread of the 2-core Zen 5 VM: 6.0 us, 2.5 us as slices)."""
    rng = np.random.default_rng(0)
    gate_up = rng.standard_normal((2, 2 * 96)).astype(np.float32)
    out = np.zeros((2, 96), dtype=np.float32)
    asm = _fresh_asm(ops._swiglu_stacked_cols, gate_up, out, 1, 32, 96)
    np.testing.assert_allclose(out[1, 32:], ref.swiglu(gate_up[1, 32:96], gate_up[1, 96 + 32:]), rtol=1e-5)
    assert not out[0].any() and not out[1, :32].any()  # only row 1's columns 32..95
    assert "vgather" not in asm and "vscatter" not in asm

    from pantheon.kernels.cpu.backend import CpuBackend

    n, n_q, n_kv, hd = 2, 4, 2, 32
    qkv = rng.standard_normal((n, (n_q + 2 * n_kv) * hd)).astype(np.float32)
    k_pool, v_pool = (ops.kernel_view(CpuBackend.kv_pool(n, 16, n_kv, hd, np.float16)) for _ in range(2))
    slots, positions = np.arange(n, dtype=np.int32), np.array([3, 7], dtype=np.int32)
    first_item, per_subgroup, n_subgroups, max_splits = ops._decode_layout(n, n_q, n_kv, n, 16, slots, positions,
                                                                           True)
    part_max, part_sum, part_acc = ops._split_states(n, n_q, hd, max_splits)
    angles = [np.ones((n, hd // 2), dtype=np.float32), np.zeros((n, hd // 2), dtype=np.float32)]
    attn = np.zeros((n, n_q, hd), dtype=np.float32)
    # One compiled function holds both rotations (neox is a run-time flag) and the value write.
    asm = _fresh_asm(ops._attention_qkv_item, 0, qkv, True, *angles, k_pool, v_pool, slots, positions,
                     np.float32(0.25), attn, first_item, per_subgroup, n_subgroups, part_max, part_sum, part_acc,
                     ops._item_scratch(per_subgroup, hd))
    assert "vgather" not in asm and "vscatter" not in asm
