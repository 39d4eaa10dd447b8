"""pantheon.kernels.cpu.gemm_call: the int8 gemm called by address gives the bits of the matmul it stands for."""

from __future__ import annotations

import numba
import numpy as np
import pytest
from numba.core import errors

from pantheon.kernels.cpu import gemm_call, int8dot, int8k, quant
from tests.kernels.test_int8dot import activations, weight

pytestmark = pytest.mark.skipif(int8dot.INT8_ISA is None, reason="no int8 kernels on this CPU")

Q4_0, Q4_1, Q5_0, Q8_0, Q4_K, Q5_K, Q6_K, IQ4_XS = 2, 3, 6, 8, 12, 13, 14, 23
# (type, whether it needs the gemm of every type): int8dot's types run on both.
CASES = [(Q4_1, False), (Q8_0, False), (Q4_0, False), (Q4_1, True), (Q8_0, True), (Q5_0, True), (Q4_K, True),
         (Q5_K, True), (Q6_K, True), (IQ4_XS, True)]
IDS = ["Q4_1", "Q8_0", "Q4_0", "Q4_1-any", "Q8_0-any", "Q5_0", "Q4_K", "Q5_K", "Q6_K", "IQ4_XS"]


@numba.njit
def _groups_by_address(address, qtype, packed, xq, xd, xs, out, col0, step):  # type: ignore[no-untyped-def]
    """Every group of packed, `step` groups a call (pairs and singles: the wide kernels take two at once)."""
    for g in range(0, packed.shape[0], step):
        gemm_call.call_gemm(address, qtype, packed, xq, xd, xs, out, g, min(packed.shape[0], g + step), col0)


def _quantized(w: quant.QWeight, x: np.ndarray) -> tuple[int, tuple[np.ndarray, np.ndarray, np.ndarray]]:
    """w's kernel type and x quantized for it, as the matmuls do."""
    if w.qtype in int8k.TYPES:
        kernel = int8k.kernel_qtype(w.qtype)
        return kernel, int8k._activations(kernel, x, int8k._UNSIGNED)
    kernel = int8dot.kernel_qtype(w.qtype)
    return kernel, int8dot._quantize(x, int8dot.xs_kind(kernel, int8dot.OFFSET_Q8_0))


@pytest.mark.parametrize(("qtype", "k_quants"), CASES, ids=IDS)
@pytest.mark.parametrize("batch", [1, 5, 8, 11])
def test_the_call_by_address_gives_the_matmuls_bits(qtype: int, k_quants: bool, batch: int) -> None:
    """44 rows (five groups of 8, the last partial, and an odd count of groups for the pairs), written from column
    col0 of a wider output whose other columns stay untouched."""
    w = weight(qtype, 44, 512, seed=qtype)
    x = activations(batch, 512, seed=batch)
    expected = quant.matmul(w, x, int8=True)
    kernel, (xq, xd, xs) = _quantized(w, x)
    col0, address = 16, int8k.gemm_address() if k_quants else int8dot.gemm_address()
    for step in (1, 2, 5):
        out = np.full((batch, col0 + 48 + 8), np.nan, dtype=np.float32)
        _groups_by_address(address, kernel, w.int8_packed, xq, xd, xs, out, col0, step)
        assert np.array_equal(out[:, col0 : col0 + 44], expected), step
        assert np.isnan(out[:, :col0]).all() and np.isnan(out[:, col0 + 48 :]).all()


def test_a_strided_array_is_refused_when_compiled() -> None:
    w = weight(Q4_1, 8, 64)
    kernel, (xq, xd, xs) = _quantized(w, activations(2, 64))
    out = np.zeros((2, 16), dtype=np.float32)[:, ::2]  # not C-contiguous
    with pytest.raises(errors.TypingError, match="out must be a 2-d C-contiguous"):
        _groups_by_address(int8dot.gemm_address(), kernel, w.int8_packed, xq, xd, xs, out, 0, 1)

