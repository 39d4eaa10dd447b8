"""pantheon.kernels.cpu.int8dot (int8 activations x Q4_1 / Q8_0 weights) against its numpy reference."""

from __future__ import annotations

import numpy as np
import pytest

from pantheon.kernels.cpu import int8dot, quant
from pantheon.kernels.cpu.backend import CpuBackend
from pantheon.kernels.reference import quant as reference

pytestmark = pytest.mark.skipif(int8dot.INT8_ISA is None, reason="no VNNI or AVX2 on this CPU: no int8 path")

Q4_1, Q8_0, Q4_K = 3, 8, 12
TYPES = [Q4_1, Q8_0]


def weight(qtype: int, rows: int, cols: int, seed: int = 0) -> quant.QWeight:
    raw = reference.random_weight_bytes(qtype, rows, cols, np.random.default_rng(seed))
    return quant.prepare_weight(raw, qtype, rows, cols)


def activations(batch: int, cols: int, seed: int = 1) -> np.ndarray:
    rng = np.random.default_rng(seed)
    # Rows of different magnitudes, and blocks of one row too, so every block has its own scale.
    return (rng.standard_normal((batch, cols)) * rng.uniform(0.01, 30.0, (batch, 1))).astype(np.float32)


def test_quantize_rows_matches_reference() -> None:
    x = activations(5, 96)
    x[2, 32:64] = 0.0  # an all-zero block: scale 0, values 0
    xq, xd, xs = int8dot.quantize_rows(x)
    q, d = reference.quantize_rows_q8(x)
    assert np.array_equal(xq, q)
    assert np.array_equal(xd, d)
    sums = q.reshape(5, 3, 32).astype(np.int64).sum(axis=2)
    np.testing.assert_allclose(xs, d * sums, rtol=1e-6)
    assert xd[2, 1] == 0.0 and not xq[2, 32:64].any()
    assert np.abs(xq.astype(np.int16)).max() == 127


@pytest.mark.parametrize("qtype", TYPES, ids=["Q4_1", "Q8_0"])
@pytest.mark.parametrize("cols", [32, 96, 576])  # 1, 3 (odd: a tail block) and 18 blocks
@pytest.mark.parametrize("batch", [1, 3, 4, 5, 8, 33])
def test_matmul_matches_reference(qtype: int, cols: int, batch: int) -> None:
    w = weight(qtype, 37, cols, seed=cols)
    x = activations(batch, cols, seed=batch)
    out = np.full((batch, 37), np.nan, dtype=np.float32)
    int8dot.matmul(qtype, w.data, x, out)
    expected = reference.matmul_int8(qtype, w.data, x)
    err = np.linalg.norm(out - expected) / np.linalg.norm(expected)
    assert err < 2e-6, err
    # ... and the rounding is what moves it from the exact product, by about 1% at most.
    exact = reference.matmul(qtype, w.data, x)
    assert np.linalg.norm(out - exact) / np.linalg.norm(exact) < 0.02


@pytest.mark.parametrize("qtype", TYPES, ids=["Q4_1", "Q8_0"])
def test_a_row_does_not_depend_on_its_batch(qtype: int) -> None:
    """Bit for bit: rows 0..7 go through the four-row variant, row 8 through the one-row one."""
    w = weight(qtype, 64, 576)
    x = activations(9, 576)
    batched = quant.matmul(w, x, int8=True)
    for b in range(9):
        alone = quant.matmul(w, np.ascontiguousarray(x[b : b + 1]), int8=True)
        assert np.array_equal(alone[0], batched[b]), b


def test_types_without_an_int8_kernel_use_the_float_path() -> None:
    w = weight(Q4_K, 16, 256)
    x = activations(3, 256)
    assert np.array_equal(quant.matmul(w, x, int8=True), quant.matmul(w, x))


def test_backend_switch() -> None:
    w = weight(Q4_1, 16, 64)
    x = activations(2, 64)
    assert CpuBackend().int8 is False  # float unless asked
    assert CpuBackend(int8=False).int8 is False
    assert np.array_equal(CpuBackend(int8=False).matmul(w, x), quant.matmul(w, x))
    assert np.array_equal(CpuBackend(int8=True).matmul(w, x), quant.matmul(w, x, int8=True))
    assert not np.array_equal(quant.matmul(w, x, int8=True), quant.matmul(w, x))


def test_nan_in_activations_propagates() -> None:
    w = weight(Q4_1, 8, 64)
    x = activations(2, 64)
    x[1, 5] = np.nan
    out = quant.matmul(w, x, int8=True)
    assert np.isfinite(out[0]).all()
    assert np.isnan(out[1]).all()
