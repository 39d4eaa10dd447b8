"""pantheon.kernels.cuda.quant against the numpy reference (gguf.quants dequantization, float64 products), for
every GGUF type the cpu backend supports, on tiny shapes (1-4 blocks) that the simulator runs in well under a
second each."""

from __future__ import annotations

import numpy as np
import pytest
from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

from pantheon.kernels.reference import quant as reference

pytestmark = pytest.mark.cuda_kernels

ALL_TYPES = [0, 1, 2, 3, 6, 7, 8, 10, 11, 12, 13, 14, 20, 23, 30]  # == quant.SUPPORTED_TYPES, sorted


def type_id(qtype: int) -> str:
    return GGMLQuantizationType(qtype).name


def width(qtype: int) -> int:
    block = GGML_QUANT_SIZES[GGMLQuantizationType(qtype)][0]
    return 256 if block == 256 else (40 if block == 1 else 96)  # float rows get a ragged last unit


def relative_error(got: np.ndarray, ref: np.ndarray) -> float:
    return float(np.linalg.norm(got.astype(np.float64) - ref) / max(np.linalg.norm(ref), 1e-30))


@pytest.fixture(scope="module")
def kernels():
    from numba import cuda

    from pantheon.kernels.cuda import quant

    placeholder = cuda.to_device(np.zeros((1, 1), np.float32))

    def upload(qtype: int, rows: int, cols: int, seed: int = 0):
        raw = reference.random_weight_bytes(qtype, rows, cols, np.random.default_rng(seed))
        return raw, quant.upload_weight(raw, qtype, rows, cols, placeholder)

    return quant, cuda, upload


def test_supported_types_match_the_cpu_backend(kernels):
    quant, _, _ = kernels
    from pantheon.kernels.cpu import quant as cpu_quant

    assert sorted(quant.SUPPORTED_TYPES) == ALL_TYPES == sorted(cpu_quant.SUPPORTED_TYPES)


@pytest.mark.parametrize("qtype", ALL_TYPES, ids=type_id)
def test_matmul_matches_reference(kernels, qtype):
    quant, cuda, upload = kernels
    rng = np.random.default_rng(qtype)
    cols = width(qtype)
    raw, w = upload(qtype, 3, cols, seed=qtype)  # 3 rows: the last row group of 2 is ragged
    x = rng.standard_normal((5, cols)).astype(np.float32)  # 5 rows: two batch tiles of 4 on the simulator
    got = quant.matmul(w, cuda.to_device(x)).copy_to_host()
    assert got.shape == (5, 3)
    assert relative_error(got, reference.matmul(qtype, raw, x)) < 1e-5
    # Batch invariance: every row alone gives the same bits as inside the batch.
    for b in (0, 4):
        alone = quant.matmul(w, cuda.to_device(np.ascontiguousarray(x[b:b + 1]))).copy_to_host()
        assert np.array_equal(alone[0], got[b])


@pytest.mark.parametrize("qtype", ALL_TYPES, ids=type_id)
def test_embed_matches_reference(kernels, qtype):
    quant, cuda, upload = kernels
    raw, w = upload(qtype, 4, width(qtype), seed=100 + qtype)
    ids = np.array([3, 0, 3], np.int64)
    got = quant.embed(w, cuda.to_device(ids)).copy_to_host()
    want = reference.dequantize(qtype, raw)[ids]
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6 * np.abs(want).max())


def test_embed_out_of_range_device_ids_give_nan(kernels):
    quant, cuda, upload = kernels
    _, w = upload(8, 2, 32)
    got = quant.embed(w, cuda.to_device(np.array([1, 2, -1], np.int32))).copy_to_host()
    assert np.isfinite(got[0]).all() and np.isnan(got[1:]).all()


def test_several_super_blocks_and_wide_rows(kernels):
    """K of four Q4_K super-blocks (32 units, more than the threads of a row) and a six-row weight."""
    quant, cuda, upload = kernels
    raw, w = upload(12, 6, 1024, seed=3)
    x = np.random.default_rng(3).standard_normal((2, 1024)).astype(np.float32)
    assert relative_error(quant.matmul(w, cuda.to_device(x)).copy_to_host(), reference.matmul(12, raw, x)) < 1e-5


def test_matmul_writes_out_in_place_and_checks_arguments(kernels):
    quant, cuda, upload = kernels
    raw, w = upload(3, 4, 64)
    x = np.random.default_rng(0).standard_normal((2, 64)).astype(np.float32)
    out = cuda.to_device(np.full((2, 4), np.nan, np.float32))
    assert quant.matmul(w, cuda.to_device(x), out) is out
    assert relative_error(out.copy_to_host(), reference.matmul(3, raw, x)) < 1e-5
    assert quant.matmul(w, cuda.to_device(np.zeros((0, 64), np.float32))).shape == (0, 4)
    with pytest.raises(ValueError):
        quant.matmul(w, cuda.to_device(np.zeros((2, 32), np.float32)))
    with pytest.raises(ValueError):
        quant.matmul(w, cuda.to_device(np.zeros((2, 64), np.float64)))
    with pytest.raises(ValueError):
        quant.matmul(w, cuda.to_device(x), cuda.to_device(np.zeros((2, 5), np.float32)))


def test_upload_rejects_what_the_kernels_cannot_take(kernels):
    quant, cuda, _ = kernels
    placeholder = cuda.to_device(np.zeros((1, 1), np.float32))
    with pytest.raises(quant.UnsupportedTensorType):
        quant.upload_weight(np.zeros(66, np.uint8), 21, 1, 256, placeholder)  # IQ3_S
    with pytest.raises(ValueError, match="multiple of the block size"):
        quant.upload_weight(np.zeros(34, np.uint8), 8, 1, 16, placeholder)
    with pytest.raises(ValueError, match="needs"):
        quant.upload_weight(np.zeros(30, np.uint8), 8, 1, 32, placeholder)


def test_nan_in_activations_propagates(kernels):
    quant, cuda, upload = kernels
    _, w = upload(3, 2, 64)
    x = np.ones((2, 64), np.float32)
    x[1, 3] = np.nan
    out = quant.matmul(w, cuda.to_device(x)).copy_to_host()
    assert np.isfinite(out[0]).all() and np.isnan(out[1]).all()
