"""The MoE kernels (pantheon.kernels.cpu.moe) against the numpy references, on random quantized experts."""

from __future__ import annotations

import numpy as np
import pytest
from gguf.constants import GGMLQuantizationType as Q

from pantheon.kernels.cpu import moe, quant
from pantheon.kernels.reference import moe as ref
from pantheon.kernels.reference import quant as ref_quant

D, FE, E = 64, 96, 6


def experts(qtype: int, rows: int, cols: int, seed: int, split: int = 1):
    """A stacked expert tensor: the raw bytes as a QWeight and the dequantized (E, rows * split, cols) floats."""
    raw = ref_quant.random_weight_bytes(qtype, E * rows * split, cols, np.random.default_rng(seed))
    dense = ref_quant.dequantize(qtype, raw).reshape(E, rows * split, cols)
    return quant.prepare_weight(raw, qtype, E * rows * split, cols), dense


def relative_error(got: np.ndarray, expected: np.ndarray) -> float:
    return float(np.linalg.norm(got - expected) / np.linalg.norm(expected))


def test_route_matches_reference():
    rng = np.random.default_rng(0)
    logits = rng.standard_normal((40, 16)).astype(np.float32) * 3
    ids, w = moe.moe_route(logits, 4)
    ids_ref, w_ref = ref.moe_route(logits, 4)
    np.testing.assert_array_equal(ids, ids_ref)
    np.testing.assert_allclose(w, w_ref, rtol=1e-6)
    np.testing.assert_allclose(w.sum(1), 1.0, rtol=1e-6)


def test_route_breaks_ties_towards_the_lower_id():
    ids, w = moe.moe_route(np.zeros((1, 5), np.float32), 3)
    assert ids.tolist() == [[0, 1, 2]]
    np.testing.assert_allclose(w, 1 / 3)


@pytest.mark.parametrize("qtypes", [(Q.Q8_0, Q.Q4_0, Q.Q5_1), (Q.F32, Q.F16, Q.Q4_K)],
                         ids=["q8_q4_q5", "f32_f16_q4k"])
@pytest.mark.parametrize("n_tok", [1, 5, 37])
def test_moe_ffn_matches_reference(qtypes, n_tok):
    cols_down = 256 if qtypes[2] == Q.Q4_K else FE  # K-quants need 256-wide rows
    fe = cols_down
    d = 256 if qtypes[2] == Q.Q4_K else D
    gate, gate_d = experts(qtypes[0], fe, d, 1)
    up, up_d = experts(qtypes[1], fe, d, 2)
    down, down_d = experts(qtypes[2], d, fe, 3)
    rng = np.random.default_rng(n_tok)
    x = rng.standard_normal((n_tok, d)).astype(np.float32)
    ids, w = moe.moe_route(rng.standard_normal((n_tok, E)).astype(np.float32), 3)
    shared = rng.standard_normal((n_tok, d)).astype(np.float32)
    out = shared.copy()
    got = moe.moe_ffn(x, moe.stacked_experts(gate, E), moe.stacked_experts(up, E), moe.stacked_experts(down, E),
                      ids, w, out)
    assert got is out
    expected = shared + ref.moe_ffn(x, gate_d, up_d, down_d, ids, w)
    assert relative_error(out, expected) < 1e-5


def test_fused_gate_up_tensor_is_split_per_expert():
    gate_up, gate_up_d = experts(Q.Q8_0, FE, D, 4, split=2)
    down, down_d = experts(Q.Q8_0, D, FE, 5)
    rng = np.random.default_rng(6)
    x = rng.standard_normal((9, D)).astype(np.float32)
    ids, w = moe.moe_route(rng.standard_normal((9, E)).astype(np.float32), 2)
    out = np.zeros_like(x)
    moe.moe_ffn(x, moe.stacked_experts(gate_up, E, 2, 0), moe.stacked_experts(gate_up, E, 2, 1),
                moe.stacked_experts(down, E), ids, w, out)
    expected = ref.moe_ffn(x, gate_up_d[:, :FE], gate_up_d[:, FE:], down_d, ids, w)
    assert relative_error(out, expected) < 1e-5


def test_moe_ffn_is_batch_invariant():
    """A token's output is bitwise the same alone and inside a batch that shares its experts."""
    gate, _ = experts(Q.Q4_0, FE, D, 7)
    up, _ = experts(Q.Q4_0, FE, D, 8)
    down, _ = experts(Q.Q8_0, D, FE, 9)
    ex = [moe.stacked_experts(w, E) for w in (gate, up, down)]
    rng = np.random.default_rng(10)
    x = rng.standard_normal((23, D)).astype(np.float32)
    ids, w = moe.moe_route(rng.standard_normal((23, E)).astype(np.float32), 3)
    batch = moe.moe_ffn(x, *ex, ids, w, np.zeros_like(x))
    for t in (0, 11, 22):
        alone = moe.moe_ffn(x[t : t + 1].copy(), *ex, ids[t : t + 1].copy(), w[t : t + 1].copy(),
                            np.zeros((1, D), np.float32))
        np.testing.assert_array_equal(alone[0], batch[t])


def test_moe_ffn_reads_only_the_selected_experts():
    """Unselected experts' rows are NaN; a read of any of them would poison the output."""
    used = [1, 4]
    weights, dense = [], []
    for seed, (rows, cols) in zip((11, 12, 13), [(FE, D), (FE, D), (D, FE)]):
        values = np.random.default_rng(seed).standard_normal((E, rows, cols)).astype(np.float32)
        dense.append(values.copy())
        values[[e for e in range(E) if e not in used]] = np.nan
        weights.append(quant.prepare_weight(values, Q.F32, E * rows, cols))
    gate, up, down = weights
    gate_d, up_d, down_d = dense
    rng = np.random.default_rng(14)
    x = rng.standard_normal((4, D)).astype(np.float32)
    ids = np.array([[1, 4], [4, 1], [1, 4], [4, 1]], np.int32)
    w = np.full((4, 2), 0.5, np.float32)
    out = moe.moe_ffn(x, *(moe.stacked_experts(m, E) for m in (gate, up, down)), ids, w, np.zeros_like(x))
    assert np.isfinite(out).all()
    assert relative_error(out, ref.moe_ffn(x, gate_d, up_d, down_d, ids, w)) < 1e-5


def test_moe_ffn_rejects_expert_ids_out_of_range():
    gate, _ = experts(Q.F32, FE, D, 15)
    down, _ = experts(Q.F32, D, FE, 16)
    with pytest.raises(ValueError, match="expert id"):
        moe.moe_ffn(np.zeros((1, D), np.float32), moe.stacked_experts(gate, E), moe.stacked_experts(gate, E),
                    moe.stacked_experts(down, E), np.array([[E]], np.int32), np.ones((1, 1), np.float32),
                    np.zeros((1, D), np.float32))
