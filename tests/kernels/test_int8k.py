"""pantheon.kernels.cpu.int8k (int8 activations x Q3_K / Q4_K / Q5_K / Q6_K / Q5_0 / Q5_1 / IQ4 weights) and int8dot's
Q4_0 (run as Q4_1) against the numpy reference."""

from __future__ import annotations

import numpy as np
import pytest

from pantheon.kernels.cpu import int8dot, int8k, quant
from pantheon.kernels.reference import quant as reference
from tests.kernels.test_int8dot import activations, weight

pytestmark = pytest.mark.skipif(int8dot.INT8_ISA is None, reason="no VNNI or AVX2 on this CPU: no int8 path")

Q4_0, Q4_1, Q5_0, Q5_1, Q3_K, Q4_K, Q5_K, Q6_K, IQ4_NL, IQ4_XS = 2, 3, 6, 7, 11, 12, 13, 14, 20, 23
TYPES = [Q4_0, Q5_0, Q5_1, Q3_K, Q4_K, Q5_K, Q6_K, IQ4_NL, IQ4_XS]
IDS = ["Q4_0", "Q5_0", "Q5_1", "Q3_K", "Q4_K", "Q5_K", "Q6_K", "IQ4_NL", "IQ4_XS"]
PACKED = [Q5_1, Q4_K, Q5_K, Q6_K, IQ4_NL, IQ4_XS]  # int8k's own layouts
PACKED_IDS = ["Q5_1", "Q4_K", "Q5_K", "Q6_K", "IQ4_NL", "IQ4_XS"]


@pytest.mark.parametrize("qtype", TYPES, ids=IDS)
@pytest.mark.parametrize("cols", [256, 768, 2048])  # 1, 3, 8 superblocks
@pytest.mark.parametrize("batch", [1, 3, 4, 5, 8, 13])
def test_matmul_matches_reference(qtype: int, cols: int, batch: int) -> None:
    """37 rows: four whole groups of 8 and one of 5. Every row and block has its own scales (random bytes, so
    every 6-bit scale and min, nibble and 2-bit plane pattern occurs)."""
    w = weight(qtype, 37, cols, seed=cols)
    x = activations(batch, cols, seed=batch)
    out = np.full((batch, 37), np.nan, dtype=np.float32)
    quant.matmul(w, x, out, int8=True)
    expected = reference.matmul_int8(qtype, w.data, x)
    err = np.linalg.norm(out - expected) / np.linalg.norm(expected)
    assert err < 2e-6, err
    exact = reference.matmul(qtype, w.data, x)
    assert np.linalg.norm(out - exact) / np.linalg.norm(exact) < 0.02


@pytest.mark.parametrize("qtype", TYPES, ids=IDS)
def test_the_int8_path_is_not_the_float_path(qtype: int) -> None:
    """These types really take the integer kernels with int8=True (the activations' rounding shows)."""
    assert qtype in quant.INT8_KERNEL_TYPES
    w = weight(qtype, 16, 512)
    x = activations(2, 512)
    assert not np.array_equal(quant.matmul(w, x, int8=True), quant.matmul(w, x))


@pytest.mark.parametrize("qtype", TYPES, ids=IDS)
def test_a_row_does_not_depend_on_its_batch(qtype: int) -> None:
    """Bit for bit: rows 0..7 go through the eight-row variant, 8..11 the four-row one, 12 the one-row one."""
    w = weight(qtype, 24, 512)
    x = activations(13, 512)
    batched = quant.matmul(w, x, int8=True)
    for b in range(13):
        alone = quant.matmul(w, np.ascontiguousarray(x[b : b + 1]), int8=True)
        assert np.array_equal(alone[0], batched[b]), b


@pytest.mark.parametrize("qtype", PACKED, ids=PACKED_IDS)
def test_rows_not_a_multiple_of_8_write_only_their_outputs(qtype: int) -> None:
    w = weight(qtype, 13, 256)
    x = activations(9, 256)
    buffer = np.full((9 * 13 + 16,), 7.0, dtype=np.float32)
    out = buffer[: 9 * 13].reshape(9, 13)
    quant.matmul(w, x, out, int8=True)
    assert (buffer[9 * 13 :] == 7.0).all()
    expected = reference.matmul_int8(qtype, w.data, x)
    assert np.linalg.norm(out - expected) / np.linalg.norm(expected) < 2e-6


@pytest.mark.parametrize("qtype", [Q5_0, Q3_K, *PACKED], ids=["Q5_0", "Q3_K", *PACKED_IDS])
@pytest.mark.parametrize("isa", ["avx2", "vnni"])
def test_the_other_kernels_give_the_same_bits(isa: str, qtype: int) -> None:
    """The AVX2 variant runs on a VNNI machine too, serially, and the 8-lane VNNI one on a machine whose host
    kernels are the 16-lane ones (`int8dot.INT8_WIDE`); the integer sums are exact on all, so every output
    matches the host's kernels bit for bit. 21 rows: one pair of groups for the wide kernels, then a group of 5
    rows on 8 lanes; 9 activation rows, so that the host takes its wide kernels (`int8dot.WIDE_MIN_ROWS`)."""
    if isa == "vnni" and int8dot.INT8_ISA != "vnni":
        pytest.skip("no VNNI on this CPU")
    assert int8dot.WIDE_MIN_ROWS <= 9
    w = weight(qtype, 21, 768)
    x = activations(9, 768)
    host = quant.matmul(w, x, int8=True)
    out = np.full((9, 21), np.nan, dtype=np.float32)
    int8k.matmul_with_isa(isa, qtype, w.int8_packed, x, out)
    np.testing.assert_array_equal(out, host)


def _unpacked(qtype: int, packed: np.ndarray, rows: int) -> np.ndarray:
    """The float32 (rows, K) weight read back from int8k's packed layout as its docstring describes it."""
    group = int8k.GROUP[qtype]
    block_values = 32 if qtype in (Q5_1, IQ4_NL) else 256
    n_blocks = packed.shape[1] // group
    out = np.zeros((rows, n_blocks * block_values), np.float32)

    def f16(block: np.ndarray, at: int) -> np.float32:
        return np.float32(block[at : at + 2].view(np.float16)[0])

    for n in range(rows):
        g, lane = divmod(n, 8)
        for s in range(n_blocks):
            sb = packed[g, s * group : (s + 1) * group]
            d = f16(sb, 2 * lane)
            for j in range(1 if block_values == 32 else 8):
                at = {Q5_1: 32, Q4_K: 160 + 128 * j, Q5_K: 160 + 160 * j, Q6_K: 144 + 192 * j,
                      IQ4_NL: 16, IQ4_XS: 80 + 128 * j}[qtype]
                nib, planes = sb[at : at + 128], sb[at + 128 : at + 192]
                for v in range(32):
                    k, (u, p) = v % 16, divmod(v, 4)
                    byte = nib[32 * (k // 4) + 4 * lane + k % 4]
                    q = int(byte & 15) if v < 16 else int(byte >> 4)
                    if qtype in (Q5_1, Q5_K):
                        q |= ((int(planes[4 * lane + p]) >> u) & 1) << 4
                    if qtype == Q5_1:
                        value = d * np.float32(q) + f16(sb, 16 + 2 * lane)
                    elif qtype == IQ4_NL:
                        value = d * np.float32(int8dot.IQ4_VALUES[q])
                    elif qtype == IQ4_XS:
                        sc = int(sb[16 + 8 * j + lane].view(np.int8))
                        value = d * np.float32(sc) * np.float32(int8dot.IQ4_VALUES[q])
                    elif qtype == Q6_K:
                        high = (int(planes[32 * (u // 4) + 4 * lane + p]) >> (2 * (u % 4))) & 3
                        sc = int(sb[16 + 8 * (2 * j + v // 16) + lane].view(np.int8))
                        value = d * np.float32(sc) * np.float32((q | high << 4) - 32)
                    else:
                        sc, mn = int(sb[32 + 8 * j + lane]), int(sb[96 + 8 * j + lane])
                        value = d * np.float32(sc) * np.float32(q) - f16(sb, 16 + 2 * lane) * np.float32(mn)
                    out[n, block_values * s + 32 * j + v] = value
    return out


@pytest.mark.parametrize("qtype", [*PACKED, Q3_K], ids=[*PACKED_IDS, "Q3_K"])
def test_weight_layout(qtype: int) -> None:
    """pack_weight's layout read back value by value gives the GGUF weight (gguf's own dequantization), and the
    lanes past the last row are zero; the packed size is within 3% of the file's (Q3_K: packed as Q6_K)."""
    w = weight(qtype, 11, 512)
    packed = int8k.pack_weight(qtype, w.data)
    layout = int8k.kernel_qtype(qtype)
    n_blocks = 16 if qtype in (Q5_1, IQ4_NL) else 2
    assert packed.shape == (2, n_blocks * int8k.GROUP[layout]) and packed.dtype == np.uint8
    np.testing.assert_allclose(_unpacked(layout, packed, 11), reference.dequantize(qtype, w.data), rtol=1e-6,
                               atol=1e-7)
    empty = _unpacked(layout, packed, 16)[11:]
    assert not empty.any()
    if qtype != Q3_K:
        assert packed.nbytes / 2 <= 1.03 * w.data.nbytes / 11 * 8


@pytest.mark.parametrize("low, high, factor", [(Q4_0, Q4_1, -8), (Q5_0, Q5_1, -16)], ids=["Q4_0", "Q5_0"])
def test_a_type_without_m_is_packed_as_the_weight_with_m_it_equals(low: int, high: int, factor: int) -> None:
    """Q4_0 / Q5_0 blocks become Q4_1 / Q5_1 ones with m = -8 d / -16 d (exact), the same other bytes: the packed
    bytes are those of that weight, and the kernels are its type's."""
    w = weight(low, 13, 96)
    blocks = w.data.reshape(13, 3, -1)
    d = np.ascontiguousarray(blocks[:, :, :2]).view(np.float16)
    with_m = np.concatenate([blocks[:, :, :2], (d * np.float16(factor)).view(np.uint8), blocks[:, :, 2:]], axis=2)
    as_high = np.ascontiguousarray(with_m.reshape(13, -1))
    np.testing.assert_array_equal(reference.dequantize(high, as_high), reference.dequantize(low, w.data))
    if low == Q4_0:
        assert np.array_equal(int8dot.pack_weight(low, w.data), int8dot.pack_weight(high, as_high))
        assert int8dot.kernel_qtype(low) == high and int8dot.kernel_qtype(high) == high
    else:
        assert np.array_equal(int8k.pack_weight(low, w.data), int8k.pack_weight(high, as_high))
        assert int8k.kernel_qtype(low) == high and int8k.kernel_qtype(high) == high
