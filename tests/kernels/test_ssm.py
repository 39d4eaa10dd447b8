"""The Gated DeltaNet kernels (pantheon.kernels.cpu.ssm) against the numpy references, on random inputs.

The two forms of the delta rule are checked against each other and against both references, with non-zero
start states, lengths that are not multiples of the chunk, Nk != Nv in grouped and tiled head order, and
strided q/k/v views (how the model passes slices of the conv output).
"""

from __future__ import annotations

import numpy as np
import pytest

from pantheon.kernels.cpu import ssm
from pantheon.kernels.reference import ssm as ref

EPS = 1e-6


def random(rng: np.random.Generator, shape, scale: float = 1.0) -> np.ndarray:
    return (rng.standard_normal(shape) * scale).astype(np.float32)


def assert_close(actual: np.ndarray, expected: np.ndarray, rel: float = 1e-4) -> None:
    """Max abs difference within `rel` of the output scale (NaN anywhere fails)."""
    assert actual.shape == expected.shape, (actual.shape, expected.shape)
    scale = float(np.max(np.abs(expected)))
    err = float(np.max(np.abs(actual.astype(np.float64) - expected)))
    assert err <= rel * scale, f"max abs diff {err:.3g} > {rel} * output scale {scale:.3g}"


def hf(state: np.ndarray) -> np.ndarray:
    """The kernels keep each head's state transposed, (dv, dk); the references use S[key, value]."""
    return np.swapaxes(state, -1, -2)


def key_heads(n_kh: int, n_vh: int, tiled: bool) -> np.ndarray:
    r = n_vh // n_kh
    return np.array([h % n_kh if tiled else h // r for h in range(n_vh)], np.int32)


def delta_inputs(rng, n_seq, n_tok, n_kh, n_vh, dk, dv):
    """q, k, v as strided views of one packed (B, L, C) array, like the conv output the model slices."""
    key_dim = n_kh * dk
    packed = random(rng, (n_seq, n_tok, 2 * key_dim + n_vh * dv))
    q = packed[:, :, :key_dim].reshape(n_seq, n_tok, n_kh, dk)
    k = packed[:, :, key_dim : 2 * key_dim].reshape(n_seq, n_tok, n_kh, dk)
    v = packed[:, :, 2 * key_dim :].reshape(n_seq, n_tok, n_vh, dv)
    a = -np.exp(rng.standard_normal(n_vh)).astype(np.float32)
    g, beta = ssm.gdn_gates(random(rng, (n_seq * n_tok, n_vh)), random(rng, (n_seq * n_tok, n_vh)), a,
                            random(rng, n_vh))
    return q, k, v, g.reshape(n_seq, n_tok, n_vh), beta.reshape(n_seq, n_tok, n_vh)


# --- causal conv ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("n_tok", [1, 2, 3, 5, 70])
def test_causal_conv_matches_reference_and_rolls_the_state(n_tok):
    rng = np.random.default_rng(n_tok)
    n_ch, width = 600, 4  # 600 channels: two parallel blocks, the second one partial
    weight = random(rng, (n_ch, width))
    states = random(rng, (3, width - 1, n_ch))
    x = random(rng, (1, n_tok, n_ch))
    expected, new_state = ref.causal_conv1d(x[0], states[2], weight)
    before = states.copy()
    out = ssm.causal_conv1d(x, states, weight, np.array([2], np.int32))
    assert_close(out[0], expected)
    np.testing.assert_array_equal(states[2], new_state.astype(np.float32))
    np.testing.assert_array_equal(states[:2], before[:2])  # other slots untouched


def test_causal_conv_in_pieces_equals_one_call():
    rng = np.random.default_rng(7)
    weight = random(rng, (96, 4))
    x = random(rng, (1, 40, 96))
    whole_state = np.zeros((1, 3, 96), np.float32)
    whole = ssm.causal_conv1d(x, whole_state, weight, np.array([0]))
    state = np.zeros((1, 3, 96), np.float32)
    parts = [ssm.causal_conv1d(np.ascontiguousarray(x[:, a:b]), state, weight, np.array([0]))
             for a, b in [(0, 1), (1, 3), (3, 20), (20, 21), (21, 40)]]
    np.testing.assert_array_equal(np.concatenate(parts, axis=1), whole)
    np.testing.assert_array_equal(state, whole_state)


def test_causal_conv_decode_batch_is_batch_invariant():
    rng = np.random.default_rng(8)
    weight = random(rng, (64, 4))
    states = random(rng, (4, 3, 64))
    x = random(rng, (3, 1, 64))
    batch_states = states.copy()
    batch = ssm.causal_conv1d(x, batch_states, weight, np.array([3, 0, 2]))
    for b, slot in enumerate([3, 0, 2]):
        alone_states = states.copy()
        alone = ssm.causal_conv1d(np.ascontiguousarray(x[b : b + 1]), alone_states, weight, np.array([slot]))
        np.testing.assert_array_equal(alone[0], batch[b])
        np.testing.assert_array_equal(alone_states[slot], batch_states[slot])


def test_causal_conv_rejects_a_slot_twice():
    with pytest.raises(ValueError, match="twice"):
        ssm.causal_conv1d(np.zeros((2, 1, 8), np.float32), np.zeros((2, 3, 8), np.float32),
                          np.zeros((8, 4), np.float32), np.array([1, 1]))


# --- gates and norms -----------------------------------------------------------------------------------


def test_gates_match_reference():
    rng = np.random.default_rng(3)
    b, alpha = random(rng, (50, 8), 4.0), random(rng, (50, 8), 12.0)  # some alpha + dt_bias past 20
    a, dt_bias = -np.exp(random(rng, 8)), random(rng, 8)
    g, beta = ssm.gdn_gates(b, alpha, a, dt_bias)
    g_ref, beta_ref = ref.gdn_gates(b, alpha, a, dt_bias)
    np.testing.assert_allclose(g, g_ref, rtol=1e-6, atol=1e-30)
    np.testing.assert_allclose(beta, beta_ref, rtol=1e-6)
    assert (g <= 0).all()


@pytest.mark.parametrize("rows", [3, 600])
def test_gated_rmsnorm_matches_reference(rows):
    rng = np.random.default_rng(rows)
    x, z, w = random(rng, (rows, 128), 3.0), random(rng, (rows, 128), 3.0), random(rng, 128)
    expected = ref.gated_rmsnorm(x, z, w, EPS)
    assert_close(ssm.gated_rmsnorm(x, z, w, EPS), expected)
    ssm.gated_rmsnorm(x, z, w, EPS, out=x)  # in place
    assert_close(x, expected)


@pytest.mark.parametrize("per_row", [False, True])
def test_sigmoid_mul_matches_reference(per_row):
    rng = np.random.default_rng(int(per_row))
    x = random(rng, (300, 256), 2.0)
    gate = random(rng, (300, 1) if per_row else (300, 256), 4.0)
    assert_close(ssm.sigmoid_mul(x, gate), ref.sigmoid_mul(x, gate))


# --- the delta rule ------------------------------------------------------------------------------------

DELTA_CASES = [
    # (n_tok, n_kh, n_vh, dk, dv, tiled)
    (1, 2, 4, 16, 16, True),
    (63, 2, 2, 32, 16, False),
    (150, 2, 6, 16, 32, True),  # 150: two whole chunks and a partial one
    (150, 2, 6, 16, 32, False),
    (64, 1, 3, 32, 32, False),
]


@pytest.mark.parametrize("n_tok,n_kh,n_vh,dk,dv,tiled", DELTA_CASES)
def test_delta_rule_forms_match_each_other_and_the_references(n_tok, n_kh, n_vh, dk, dv, tiled):
    rng = np.random.default_rng(n_tok * 100 + n_vh + tiled)
    q, k, v, g, beta = delta_inputs(rng, 1, n_tok, n_kh, n_vh, dk, dv)
    heads = key_heads(n_kh, n_vh, tiled)
    scale = dk ** -0.5
    state0 = random(rng, (2, n_vh, dv, dk), 0.5)  # slot 1 is used; slot 0 must stay as it is
    rec_out, rec_state = ref.gated_delta_recurrent(q[0], k[0], v[0], g[0], beta[0], hf(state0[1]), heads, scale, EPS)
    chk_out, chk_state = ref.gated_delta_chunked(q[0], k[0], v[0], g[0], beta[0], hf(state0[1]), heads, scale, EPS)
    assert_close(chk_out, rec_out, 1e-9)  # the two reference forms agree to float64 rounding
    assert_close(chk_state, rec_state, 1e-9)

    slots = np.array([1], np.int32)
    s_rec = state0.copy()
    out_rec = ssm.gated_delta_recurrent(q, k, v, g, beta, s_rec, slots, heads, scale, EPS)
    s_chk = state0.copy()
    out_chk = ssm.gated_delta_chunked(q, k, v, g, beta, s_chk, slots, heads, scale, EPS)
    for out, state in [(out_rec, s_rec), (out_chk, s_chk)]:
        assert_close(out[0], rec_out, 2e-5)
        assert_close(hf(state[1]), rec_state, 2e-5)
        np.testing.assert_array_equal(state[0], state0[0])
    assert_close(out_chk[0], out_rec[0].astype(np.float64), 2e-5)


def test_chunked_delta_rule_in_pieces_equals_one_call():
    """A prefill split at arbitrary points (a resumed conversation) continues the same state."""
    rng = np.random.default_rng(11)
    q, k, v, g, beta = delta_inputs(rng, 1, 200, 2, 4, 16, 16)
    heads = key_heads(2, 4, True)
    state = random(rng, (1, 4, 16, 16), 0.3)  # dk == dv here
    whole_state = state.copy()
    whole = ssm.gated_delta_chunked(q, k, v, g, beta, whole_state, [0], heads, 0.25, EPS)
    outs = []
    for a, b in [(0, 70), (70, 71), (71, 200)]:
        outs.append(ssm.gated_delta_chunked(q[:, a:b], k[:, a:b], v[:, a:b], g[:, a:b], beta[:, a:b], state,
                                            [0], heads, 0.25, EPS))
    assert_close(np.concatenate(outs, axis=1), whole, 2e-5)
    assert_close(state, whole_state, 2e-5)


def test_recurrent_decode_batch_is_batch_invariant():
    rng = np.random.default_rng(12)
    q, k, v, g, beta = delta_inputs(rng, 3, 1, 2, 4, 16, 16)
    heads = key_heads(2, 4, False)
    states = random(rng, (5, 4, 16, 16), 0.5)
    slots = np.array([4, 1, 2], np.int32)
    batch_states = states.copy()
    batch = ssm.gated_delta_recurrent(q, k, v, g, beta, batch_states, slots, heads, 0.25, EPS)
    for b in range(3):
        alone_states = states.copy()
        alone = ssm.gated_delta_recurrent(q[b : b + 1], k[b : b + 1], v[b : b + 1], g[b : b + 1],
                                          beta[b : b + 1], alone_states, slots[b : b + 1], heads, 0.25, EPS)
        np.testing.assert_array_equal(alone[0], batch[b])
        np.testing.assert_array_equal(alone_states[slots[b]], batch_states[slots[b]])


def test_delta_rule_rejects_shapes_that_do_not_fit():
    rng = np.random.default_rng(13)
    q, k, v, g, beta = delta_inputs(rng, 1, 4, 2, 4, 16, 16)
    with pytest.raises(ValueError, match="do not fit"):
        ssm.gated_delta_chunked(q, k, v, g, beta, np.zeros((1, 4, 8, 16), np.float32), [0],
                                key_heads(2, 4, True), 0.25, EPS)
