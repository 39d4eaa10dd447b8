"""pantheon.kernels.cpu.quant against the numpy reference (gguf.quants dequantization, float64 products)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

from pantheon.kernels.cpu import quant
from pantheon.kernels.reference import quant as reference

ALL_TYPES = sorted(quant.SUPPORTED_TYPES)
BATCHES = (1, 3, 8, 33, 100)
ROWS = (1, 7, 64, 300)
MODEL = Path.home() / ".cache/pantheon/SmolLM2-135M-Instruct.Q4_1.gguf"


def type_id(qtype: int) -> str:
    return GGMLQuantizationType(qtype).name


def block_size(qtype: int) -> int:
    return GGML_QUANT_SIZES[GGMLQuantizationType(qtype)][0]


def widths(qtype: int) -> tuple[int, ...]:
    """K values: one block, several blocks, and for 32-blocks a K that is not a multiple of 256."""
    if block_size(qtype) == 256:
        return (256, 768)
    return (32, 96, 576)


def relative_error(got: np.ndarray, ref: np.ndarray) -> float:
    return float(np.linalg.norm(got.astype(np.float64) - ref) / max(np.linalg.norm(ref), 1e-30))


def make_weight(qtype: int, rows: int, cols: int, seed: int = 0) -> tuple[np.ndarray, quant.QWeight]:
    raw = reference.random_weight_bytes(qtype, rows, cols, np.random.default_rng(seed))
    return raw, quant.prepare_weight(raw, qtype, rows, cols)


@pytest.mark.parametrize("qtype", ALL_TYPES, ids=type_id)
def test_matmul_matches_reference(qtype):
    rng = np.random.default_rng(qtype)
    for cols in widths(qtype):
        for rows in ROWS:
            raw, w = make_weight(qtype, rows, cols, seed=rows + cols)
            dense = reference.dequantize(qtype, raw).astype(np.float64)
            for batch in BATCHES:
                x = rng.standard_normal((batch, cols)).astype(np.float32)
                err = relative_error(quant.matmul(w, x), x.astype(np.float64) @ dense.T)
                assert err < 1e-5, f"B={batch} N={rows} K={cols}: relative error {err:.2e}"


@pytest.mark.parametrize("qtype", ALL_TYPES, ids=type_id)
def test_batch_blocks(qtype):
    """A K wide enough that the rows kernel walks the batch in several blocks (blocks of 32 rows at K=8192)."""
    rng = np.random.default_rng(qtype)
    raw, w = make_weight(qtype, 7, 8192)
    x = rng.standard_normal((33, 8192)).astype(np.float32)
    assert relative_error(quant.matmul(w, x), reference.matmul(qtype, raw, x)) < 1e-5


@pytest.mark.parametrize("qtype", ALL_TYPES, ids=type_id)
def test_a_row_does_not_depend_on_its_batch(qtype):
    """Batch invariance: each output row is bit-identical whether computed alone, in a small batch or in a large
    one (greedy output under load equals output alone; a cached prefix gives the numbers of a cold prefill)."""
    rng = np.random.default_rng(100 + qtype)
    raw, w = make_weight(qtype, 37, widths(qtype)[-1])
    x = rng.standard_normal((45, w.cols)).astype(np.float32)
    whole = quant.matmul(w, x)
    for lo, hi in ((0, 1), (3, 4), (5, 7), (10, 19), (44, 45)):
        assert np.array_equal(quant.matmul(w, np.ascontiguousarray(x[lo:hi])), whole[lo:hi])


@pytest.mark.parametrize("qtype", ALL_TYPES, ids=type_id)
def test_dequantize_rows_matches_reference(qtype):
    raw, w = make_weight(qtype, 64, widths(qtype)[-1])
    dense = reference.dequantize(qtype, raw)
    for ids in (np.array([5], np.int32), np.array([63, 0, 5, 5, 31], np.int64), np.arange(64)):
        got = quant.dequantize_rows(w, ids)
        assert got.dtype == np.float32 and got.shape == (len(ids), w.cols)
        # Exact but for one rounding where the compiler fuses d*q + m into an FMA.
        np.testing.assert_allclose(got, dense[ids], rtol=1e-6, atol=1e-6 * np.abs(dense).max())
    assert quant.dequantize_rows(w, np.array([], np.int64)).shape == (0, w.cols)


def test_dequantize_rows_rejects_bad_ids():
    _, w = make_weight(quant.Q8_0, 4, 32)
    for ids in (np.array([4]), np.array([-1]), np.array([0, 1, 7])):
        with pytest.raises(IndexError):
            quant.dequantize_rows(w, ids)
    with pytest.raises(ValueError):
        quant.dequantize_rows(w, np.array([0.0, 1.0]))
    with pytest.raises(ValueError):
        quant.dequantize_rows(w, np.zeros((2, 2), np.int64))


def test_matmul_writes_out_in_place():
    raw, w = make_weight(quant.Q4_1, 64, 576)
    x = np.random.default_rng(0).standard_normal((3, 576)).astype(np.float32)
    out = np.full((3, 64), np.nan, np.float32)
    assert quant.matmul(w, x, out) is out
    assert relative_error(out, reference.matmul(quant.Q4_1, raw, x)) < 1e-5
    assert quant.matmul(w, np.zeros((0, 576), np.float32)).shape == (0, 64)


def test_matmul_rejects_bad_arguments():
    _, w = make_weight(quant.Q4_0, 8, 64)
    good = np.zeros((2, 64), np.float32)
    wide = np.zeros((64, 2), np.float32).T  # right shape, not C-contiguous
    for x in (np.zeros((2, 64)), np.zeros((2, 32), np.float32), np.zeros(64, np.float32), wide):
        with pytest.raises(ValueError):
            quant.matmul(w, x)
    for out in (np.zeros((2, 7), np.float32), np.zeros((2, 8), np.float64), np.zeros((8, 2), np.float32).T):
        with pytest.raises(ValueError):
            quant.matmul(w, good, out)


def test_nan_in_activations_propagates():
    _, w = make_weight(quant.Q4_1, 8, 64)
    x = np.ones((2, 64), np.float32)
    x[1, 3] = np.nan
    out = quant.matmul(w, x)
    assert np.isfinite(out[0]).all() and np.isnan(out[1]).all()


def test_prepare_weight_views_without_copy(tmp_path):
    raw, _ = make_weight(quant.Q4_1, 6, 64)
    for source in (raw, raw.reshape(-1), raw.view(np.uint16)):
        w = quant.prepare_weight(source, quant.Q4_1, 6, 64)
        assert np.shares_memory(w.data, raw) and w.data.shape == (6, 40) and w.data.dtype == np.uint8
        assert not w.data.flags.writeable and raw.flags.writeable
    path = tmp_path / "w.bin"
    raw.tofile(path)
    mapped = np.memmap(path, dtype=np.uint8, mode="r", shape=raw.shape)
    w = quant.prepare_weight(mapped, quant.Q4_1, 6, 64)
    assert np.shares_memory(w.data, mapped) and type(w.data) is np.ndarray
    assert np.array_equal(quant.dequantize_rows(w, np.arange(6)), reference.dequantize(quant.Q4_1, raw))
    f32 = np.random.default_rng(0).standard_normal((3, 5)).astype(np.float32)
    w = quant.prepare_weight(f32, quant.F32, 3, 5)
    assert np.shares_memory(w.data, f32)
    assert np.array_equal(quant.dequantize_rows(w, np.array([2, 0])), f32[[2, 0]])


def test_pack_on_huge_pages_moves_the_packed_rows_into_one_mapping():
    """Each int8-kernel weight's packed rows move into one mapping, side by side from a 2 MiB boundary, each on a
    cache line: the same bytes, read-only, the same products; a weight given twice is placed once, and types
    without int8 kernels are left alone."""
    rng = np.random.default_rng(7)
    int8_types = sorted(quant.INT8_KERNEL_TYPES)
    weights = [make_weight(qtype, 37, 768 if block_size(qtype) == 256 else 96, seed)[1]
               for seed, qtype in enumerate(int8_types)]
    _, plain = make_weight(GGMLQuantizationType.F16, 37, 96)
    xs = [rng.standard_normal((3, w.cols)).astype(np.float32) for w in weights]
    packed_before = [np.array(w.int8_packed) for w in weights]
    products_before = [quant.matmul(w, x, int8=True) for w, x in zip(weights, xs)]
    placed = quant.pack_on_huge_pages([*weights, weights[0], plain])
    if placed == 0:
        pytest.skip("no anonymous mapping with madvise here")
    assert "int8_packed" not in plain.__dict__
    starts = [w.int8_packed.ctypes.data for w in weights]
    assert starts[0] % quant.HUGE_PAGE == 0
    sizes = [-(-p.nbytes // 64) * 64 for p in packed_before]
    assert [b - a for a, b in zip(starts, starts[1:])] == sizes[:-1]
    assert placed == sum(sizes)
    for w, x, packed, product in zip(weights, xs, packed_before, products_before):
        assert not w.int8_packed.flags.writeable
        np.testing.assert_array_equal(w.int8_packed, packed)
        np.testing.assert_array_equal(quant.matmul(w, x, int8=True), product)


def test_prepare_weight_rejects_bad_sizes():
    raw, _ = make_weight(quant.Q4_K, 2, 256)
    with pytest.raises(ValueError, match="multiple of the block size 256"):
        quant.prepare_weight(raw, quant.Q4_K, 2, 128)
    with pytest.raises(ValueError, match="needs 288 bytes"):
        quant.prepare_weight(raw[:1], quant.Q4_K, 2, 256)
    with pytest.raises(ValueError, match="needs"):
        quant.prepare_weight(raw, quant.Q4_K, 1, 256)
    with pytest.raises(ValueError, match="C-contiguous"):
        quant.prepare_weight(np.zeros((288, 2), np.uint8)[:, 0], quant.Q4_K, 2, 256)
    with pytest.raises(ValueError):
        quant.prepare_weight(raw, quant.Q4_K, 0, 256)
    with pytest.raises(ValueError):
        quant.QWeight(quant.Q4_K, 2, 256, raw.view(np.int8))
    with pytest.raises(ValueError):
        quant.QWeight(quant.Q4_K, 2, 512, raw)


@pytest.mark.parametrize("qtype", [9, 15, 16, 21, 39, 999], ids=lambda t: f"type{t}")
def test_unsupported_types_are_named(qtype):
    name = type_id(qtype) if qtype in GGMLQuantizationType._value2member_map_ else "unknown"
    with pytest.raises(quant.UnsupportedTensorType, match=name) as info:
        quant.prepare_weight(np.zeros(1024, np.uint8), qtype, 1, 256)
    assert isinstance(info.value, ValueError)
    w = quant.QWeight(quant.Q8_0, 1, 32, np.zeros((1, 34), np.uint8))
    object.__setattr__(w, "qtype", qtype)  # a QWeight built around the checks still fails cleanly
    with pytest.raises(quant.UnsupportedTensorType):
        quant.matmul(w, np.zeros((1, 32), np.float32))
    with pytest.raises(quant.UnsupportedTensorType):
        quant.dequantize_rows(w, np.array([0]))


def test_supported_types_and_block_sizes():
    assert quant.SUPPORTED_TYPES == {0, 1, 30, 8, 2, 3, 6, 7, 10, 11, 12, 13, 14, 20, 23}
    for qtype in ALL_TYPES:
        block, block_bytes = GGML_QUANT_SIZES[GGMLQuantizationType(qtype)]
        raw = np.zeros(3 * block_bytes * 2, np.uint8)
        assert quant.prepare_weight(raw, qtype, 3, 2 * block).data.shape == (3, 2 * block_bytes)


GGUF_QUANTIZABLE = [quant.Q8_0, quant.Q4_0, quant.Q4_1, quant.Q5_0, quant.Q5_1, quant.F16, quant.BF16]


@pytest.mark.parametrize("qtype", GGUF_QUANTIZABLE, ids=type_id)
def test_reference_roundtrips_gguf_quantize(qtype):
    """Weights quantized by gguf (not random bytes) come back close to the originals, through both paths."""
    from gguf.quants import quantize

    values = np.random.default_rng(0).standard_normal((16, 96)).astype(np.float32)
    raw = np.ascontiguousarray(quantize(values, GGMLQuantizationType(qtype))).view(np.uint8).reshape(16, -1)
    dense = reference.dequantize(qtype, raw)
    assert relative_error(dense, values.astype(np.float64)) < 0.2
    w = quant.prepare_weight(raw, qtype, 16, 96)
    np.testing.assert_allclose(quant.dequantize_rows(w, np.arange(16)), dense, rtol=1e-6, atol=1e-6)


def test_kernels_release_the_gil():
    for kernel in (quant._gemm_rows, quant._dequant_rows):
        assert kernel.targetoptions["nogil"] and kernel.targetoptions["parallel"]


@pytest.mark.slow
@pytest.mark.skipif(not MODEL.exists(), reason="default model not downloaded")
def test_real_model_tensors():
    from gguf import GGUFReader

    tensors = {t.name: t for t in GGUFReader(MODEL).tensors}
    rng = np.random.default_rng(0)
    for name in ("blk.0.ffn_down.weight", "token_embd.weight"):
        t = tensors[name]
        cols, rows = (int(n) for n in t.shape)
        w = quant.prepare_weight(t.data, int(t.tensor_type), rows, cols)
        assert np.shares_memory(w.data, t.data)
        x = rng.standard_normal((2, cols)).astype(np.float32)
        assert relative_error(quant.matmul(w, x), reference.matmul(w.qtype, t.data, x)) < 1e-5
        ids = np.array([0, 1, rows - 1])
        np.testing.assert_allclose(
            quant.dequantize_rows(w, ids), reference.dequantize(w.qtype, t.data[ids]), rtol=1e-6, atol=1e-6
        )
