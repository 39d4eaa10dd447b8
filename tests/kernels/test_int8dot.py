"""pantheon.kernels.cpu.int8dot (int8 activations x Q4_1 / Q8_0 weights) against its numpy reference."""

from __future__ import annotations

import numpy as np
import pytest

from pantheon.kernels.cpu import HOST_CPU_VENDOR, int8dot, quant
from pantheon.kernels.cpu.backend import CpuBackend
from pantheon.kernels.reference import quant as reference

pytestmark = pytest.mark.skipif(int8dot.INT8_ISA is None, reason="no VNNI or AVX2 on this CPU: no int8 path")

Q4_1, Q8_0, Q2_K = 3, 8, 10
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
    q, d, s = reference.quantize_rows_q8(x)
    assert np.array_equal(xq, q)
    assert np.array_equal(xd, d) and np.array_equal(xs, s)
    # d and s as llama.cpp's Q8_1 blocks hold them: float16 values, s within a float16 rounding of d * sum(q)
    assert np.array_equal(xd.astype(np.float16).astype(np.float32), xd)
    assert np.array_equal(xs.astype(np.float16).astype(np.float32), xs)
    sums = q.reshape(5, 3, 32).astype(np.int64).sum(axis=2)
    np.testing.assert_allclose(xs, d * sums, rtol=2.0**-10)
    assert xd[2, 1] == 0.0 and xs[2, 1] == 0.0 and not xq[2, 32:64].any()
    assert np.abs(xq.astype(np.int16)).max() == 127


def test_scales_past_float16s_range_stay_finite() -> None:
    """A block whose s (scale * sum(q)) or scale would overflow float16 keeps the float32 value: llama.cpp's
    float16 makes it an infinity (and the logits NaN); s overflows at max|x| ~2000 when the block has one sign."""
    x = activations(2, 96)
    x[0, :32] = 5000.0  # s = 5000 / 127 * 32 * 127 = 160000
    x[1, 32:64] = -1e7  # d = 78740 too
    x[1, 64:96] = 1.0
    xq, xd, xs = int8dot.quantize_rows(x)
    q, d, s = reference.quantize_rows_q8(x)
    assert np.array_equal(xq, q) and np.array_equal(xd, d) and np.array_equal(xs, s)
    assert np.isfinite(xd).all() and np.isfinite(xs).all()
    assert xs[0, 0] == np.float32(5000.0) / np.float32(127.0) * np.float32(4064.0)
    assert xd[1, 1] == np.float32(1e7) / np.float32(127.0) and xs[1, 1] == -xd[1, 1] * 4064
    assert xd[1, 2] == np.float32(np.float16(1 / 127))
    assert xs[1, 2] == np.float32(np.float16(np.float32(1 / 127) * 4064))


@pytest.mark.parametrize("qtype", TYPES, ids=["Q4_1", "Q8_0"])
# blocks: 1, 3, 8, 18 (the default model's K), 25; 37 rows: 4 whole groups of 8 and one of 5
@pytest.mark.parametrize("cols", [32, 96, 256, 576, 800])
@pytest.mark.parametrize("batch", [1, 3, 4, 5, 8, 13, 33])
def test_matmul_matches_reference(qtype: int, cols: int, batch: int) -> None:
    w = weight(qtype, 37, cols, seed=cols)
    x = activations(batch, cols, seed=batch)
    out = np.full((batch, 37), np.nan, dtype=np.float32)
    int8dot.matmul(qtype, int8dot.pack_weight(qtype, w.data), x, out)
    expected = reference.matmul_int8(qtype, w.data, x)
    err = np.linalg.norm(out - expected) / np.linalg.norm(expected)
    assert err < 2e-6, err
    # ... and the rounding is what moves it from the exact product, by about 1% at most.
    exact = reference.matmul(qtype, w.data, x)
    assert np.linalg.norm(out - exact) / np.linalg.norm(exact) < 0.02


def test_the_other_sums_are_those_of_the_quantized_values() -> None:
    """What the kernels may read in place of d * sum(q): the same bytes and scales, and the sums of each block's
    two 16-value halves of q (Q6_K's and IQ4's operand on VNNI) or -128 * sum(q) per block (Q8_0's), exact."""
    x = activations(3, 800)
    plain = int8dot.quantize_rows(x)
    halves = int8dot.quantize_rows(x, int8dot.XS_HALVES)
    corrections = int8dot.quantize_rows(x, int8dot.XS_CORRECTIONS)
    assert halves[2].shape == (3, 50) and corrections[2].shape == (3, 25)
    for other in (halves, corrections):
        assert other[2].dtype == np.float32
        assert np.array_equal(other[0], plain[0]) and np.array_equal(other[1], plain[1])
    q = plain[0].astype(np.int64)
    assert np.array_equal(halves[2], q.reshape(3, 50, 16).sum(axis=2).astype(np.float32))
    whole = q.reshape(3, 25, 32).sum(axis=2)
    assert np.array_equal(corrections[2], (-128 * whole).astype(np.float32))
    assert np.array_equal(plain[2], reference.quantize_rows_q8(x)[2])  # d * sum(q), as Q8_1's s is rounded


@pytest.mark.parametrize("qtype", TYPES, ids=["Q4_1", "Q8_0"])
def test_weight_layout(qtype: int) -> None:
    """pack_weight: groups of 8 rows, block by block: the 8 rows' scales side by side, then the values lane by
    lane; 13 rows leave a last group of 5 real rows and 3 zero lanes. No padding of K (25 blocks stay 25)."""
    w = weight(qtype, 13, 800)
    packed = int8dot.pack_weight(qtype, w.data)
    group = 160 if qtype == Q4_1 else 272
    assert packed.shape == (2, 25 * group) and packed.dtype == np.uint8
    block = 20 if qtype == Q4_1 else 34
    for n in (0, 5, 9, 12):
        g, lane = divmod(n, 8)
        row = w.data[n]
        for blk in (0, 11, 24):
            src, dst = row[blk * block :], packed[g, blk * group :]
            assert bytes(dst[2 * lane : 2 * lane + 2]) == bytes(src[:2])  # d
            if qtype == Q4_1:
                assert bytes(dst[16 + 2 * lane : 18 + 2 * lane]) == bytes(src[2:4])  # m
                for j in (0, 7, 15):
                    assert dst[32 + 32 * (j // 4) + 4 * lane + j % 4] == src[4 + j]
            else:
                flip = 128 if int8dot.OFFSET_Q8_0 else 0  # q + 128 as unsigned bytes where the kernels take that
                for j in (0, 13, 31):
                    assert dst[16 + 32 * (j // 4) + 4 * lane + j % 4] == src[2 + j] ^ flip
    lanes = packed[1].reshape(25, group)
    if qtype == Q4_1:
        empty = [lanes[:, 10:16], lanes[:, 26:32]] + [lanes[:, 32 + 32 * t + 20 : 64 + 32 * t] for t in range(4)]
    else:
        empty = [lanes[:, 10:16]] + [lanes[:, 16 + 32 * u + 20 : 48 + 32 * u] for u in range(8)]
    assert not any(part.any() for part in empty)  # lanes 5..7 of the last group: zero


def test_rows_not_a_multiple_of_8_write_only_their_outputs() -> None:
    """The last group of 13 rows has 3 empty lanes: the outputs past row 13 are not written (out is exactly
    (B, 13) and nothing beyond it changes)."""
    w = weight(Q4_1, 13, 96)
    x = activations(9, 96)
    buffer = np.full((9 * 13 + 16,), 7.0, dtype=np.float32)
    out = buffer[: 9 * 13].reshape(9, 13)
    quant.matmul(w, x, out, int8=True)
    assert (buffer[9 * 13 :] == 7.0).all()
    expected = reference.matmul_int8(Q4_1, w.data, x)
    assert np.linalg.norm(out - expected) / np.linalg.norm(expected) < 2e-6


@pytest.mark.parametrize("qtype", TYPES, ids=["Q4_1", "Q8_0"])
def test_a_row_does_not_depend_on_its_batch(qtype: int) -> None:
    """Bit for bit: rows 0..7 go through the eight-row variant, 8..11 the four-row one, 12 the one-row one."""
    w = weight(qtype, 64, 576)
    x = activations(13, 576)
    batched = quant.matmul(w, x, int8=True)
    for b in range(13):
        alone = quant.matmul(w, np.ascontiguousarray(x[b : b + 1]), int8=True)
        assert np.array_equal(alone[0], batched[b]), b


def test_types_without_an_int8_kernel_use_the_float_path() -> None:
    w = weight(Q2_K, 16, 256)
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


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_a_non_finite_activation_makes_its_row_nan(bad: float) -> None:
    w = weight(Q4_1, 8, 64)
    x = activations(2, 64)
    x[1, 5] = bad
    out = quant.matmul(w, x, int8=True)
    assert np.isfinite(out[0]).all()
    assert np.isnan(out[1]).all()


def test_quantize_rows_of_a_prefill_batch_match_reference() -> None:
    """Past `_PARALLEL_QUANTIZE_MIN` values the rows are quantized on all threads: same bytes."""
    x = activations(70, 576)
    assert x.size >= int8dot._PARALLEL_QUANTIZE_MIN
    x[3, :32] = np.arange(32, dtype=np.float32) + np.float32(0.5)  # halves: rounding ties, to even
    x[3, 31] = 127.0  # so that the block's scale is exactly 1
    xq, xd, xs = int8dot.quantize_rows(x)
    q, d, s = reference.quantize_rows_q8(x)
    assert np.array_equal(xq, q) and np.array_equal(xd, d) and np.array_equal(xs, s)
    assert xd[3, 0] == 1.0 and list(xq[3, :4]) == [0, 2, 2, 4]


@pytest.mark.parametrize("qtype", TYPES, ids=["Q4_1", "Q8_0"])
@pytest.mark.parametrize("cols", [96, 800])
@pytest.mark.parametrize("isa", ["avx2", "vnni"])
def test_the_other_kernels_give_the_same_bits(isa: str, qtype: int, cols: int) -> None:
    """The AVX2 variant (vpmaddubsw; Q8_0 with the signs moved onto the activations) runs on a VNNI machine too,
    and the 8-lane VNNI one on a machine whose host kernels are the 16-lane ones (INT8_WIDE); their integer sums
    are exact like the host's, so every output matches the host kernels bit for bit. 21 rows: one pair of
    groups for the wide kernels, then a group of 5 rows on 8 lanes; 9 activation rows, so that the host takes
    its wide kernels (`WIDE_MIN_ROWS`)."""
    if isa == "vnni" and int8dot.INT8_ISA != "vnni":
        pytest.skip("no VNNI on this CPU")
    assert int8dot.WIDE_MIN_ROWS <= 9
    w = weight(qtype, 21, cols, seed=cols)
    x = activations(9, cols)
    host = quant.matmul(w, x, int8=True)
    out = np.full((9, 21), np.nan, dtype=np.float32)
    int8dot.matmul_with_isa(isa, qtype, w.int8_packed, x, out)
    np.testing.assert_array_equal(out, host)
    err = np.linalg.norm(out - reference.matmul_int8(qtype, w.data, x)) / np.linalg.norm(host)
    assert err < 2e-6, err


def _inner_loops(asm: str) -> list[list[str]]:
    """The instructions of each innermost loop in `asm` (from a label to a jump back to it, with no such loop
    inside)."""
    lines = [line.strip() for line in asm.splitlines()]
    labels = {line[:-1]: i for i, line in enumerate(lines) if line.startswith(".LBB") and line.endswith(":")}
    spans = []
    for i, line in enumerate(lines):
        parts = line.split()
        if len(parts) == 2 and parts[0].startswith("j") and labels.get(parts[1], i) < i:
            spans.append((labels[parts[1]], i))
    inner = [(a, b) for a, b in spans if not any(a <= c and d <= b and (c, d) != (a, b) for c, d in spans)]
    return [[x for x in lines[a:b + 1] if x and not x.startswith((".", "#"))] for a, b in inner]


@pytest.mark.parametrize("qtype", TYPES, ids=["Q4_1", "Q8_0"])
def test_the_eight_row_block_loop_is_dot_instructions_in_registers(qtype: int) -> None:
    """numba's assembly for the host's 8-row kernel, as `_gemm_groups` runs it (the 16-lane kernel with AVX-512
    VNNI, else the 8-lane one): its loop over the blocks does the products with the ISA's integer dot instruction
    (VNNI's vpdpbusd, 8 a row and block; AVX2's vpmaddubsw / vpmaddwd), and on AVX-512 VNNI it keeps its vectors
    in the 32 registers: no vector load or store of the stack (two chains of four dot products a row spilled
    there, 14 accesses a block at 16 lanes; and Q8_0's, on the Xeon VM, when its activations were the unsigned
    operand: `int8dot._offset_q8_0`). At 16 lanes Q4_1's high nibbles come from a 32-bit shift and a mask, not
    `vgf2p8affineqb` (`int8dot._high_nibbles`)."""
    import numba

    # `_gemm_groups` with the weight type a constant (numba freezes a closure's variables), compiled here
    # without the on-disk cache so that its assembly is at hand and holds that type's kernels only.
    gemm_groups = numba.njit(int8dot._gemm_groups.py_func)
    kernel_qtype = int8dot.kernel_qtype(qtype)

    @numba.njit
    def probe(packed, xq, xd, xs, out):  # type: ignore[no-untyped-def]
        gemm_groups(kernel_qtype, packed, xq, xd, xs, out, 0, packed.shape[0], 0)

    w = weight(qtype, 16, 96)
    x = activations(8, 96)
    xq, xd, xs = int8dot.quantize_rows(x, int8dot.xs_kind(kernel_qtype, int8dot.OFFSET_Q8_0))
    out = np.zeros((8, 16), dtype=np.float32)
    probe(w.int8_packed, xq, xd, xs, out)
    np.testing.assert_allclose(out, quant.matmul(w, x, int8=True), rtol=1e-6, atol=1e-6)
    asm = probe.inspect_asm(probe.signatures[0])
    dot = "vpdpbusd" if int8dot.INT8_ISA == "vnni" else "vpmadd"  # AVX2: vpmaddubsw, vpmaddwd
    wide = int8dot.INT8_WIDE  # the 8-row calls on 512-bit vectors
    loops = [loop for loop in _inner_loops(asm)
             if any(dot in ins and ("zmm" in ins) == wide for ins in loop)]
    assert loops, f"no loop with {dot} in the kernels"
    # The loop with the most dot instructions is the 8-row kernel's loop over the blocks.
    inner = max(loops, key=lambda loop: sum(dot in ins for ins in loop))
    most = sum(dot in ins for ins in inner)
    if int8dot.INT8_ISA == "vnni":
        assert most == 64, most
        spills = [ins for ins in inner if ins.startswith("v") and "(%rsp)" in ins]  # vector registers only
        assert not spills, f"the block loop spills vector registers to the stack: {spills}"
    if wide and kernel_qtype == int8dot.Q4_1:  # high nibbles by a 32-bit shift, off the dot products' pipes
        assert not [ins for ins in inner if "vgf2p8affineqb" in ins]
        assert sum("vpsrld" in ins for ins in inner) == 4


def test_cpu_vendor_is_read_from_cpuinfo(tmp_path) -> None:
    """`cpuinfo_field` (HOST_CPU_VENDOR, bench.common.machine): a field's first value in /proc/cpuinfo, names with a
    space too; "" where the file is missing or has none."""
    from pantheon.kernels.cpu import cpuinfo_field

    info = tmp_path / "cpuinfo"
    info.write_text("processor\t: 0\nvendor_id\t: GenuineIntel\ncpu family\t: 6\n\nprocessor\t: 1\n"
                    "vendor_id\t: GenuineIntel\n")
    assert cpuinfo_field("vendor_id", info) == "GenuineIntel"
    info.write_text("processor\t: 0\nmodel name\t: something\n")
    assert cpuinfo_field("vendor_id", info) == ""
    assert cpuinfo_field("model name", info) == "something"
    assert cpuinfo_field("vendor_id", tmp_path / "missing") == ""


def test_the_one_row_kernel_prefetches_into_the_caches_its_vendor_takes() -> None:
    """The batch-1 kernel's prefetch of the next weight group: prefetcht1 on Intel, where prefetchnta's lines
    skip L2 and the last level (the step from memory every time: batch 1 x2.33 slower on the Xeon VM),
    prefetchnta elsewhere (the weights read once a step pass by the caches)."""
    import numba

    gemm_groups = numba.njit(int8dot._gemm_groups.py_func)

    @numba.njit
    def probe(packed, xq, xd, xs, out):  # type: ignore[no-untyped-def]
        gemm_groups(Q4_1, packed, xq, xd, xs, out, 0, packed.shape[0], 0)

    w = weight(Q4_1, 16, 96)
    xq, xd, xs = int8dot.quantize_rows(activations(1, 96))
    probe(w.int8_packed, xq, xd, xs, np.zeros((1, 16), dtype=np.float32))
    asm = probe.inspect_asm(probe.signatures[0])
    # The probe holds the 16-lane kernels too (prefetcht1 on every vendor), though batch 1 never runs them.
    assert ("prefetchnta" in asm) == (HOST_CPU_VENDOR != "GenuineIntel")
    assert "prefetcht1" in asm or HOST_CPU_VENDOR != "GenuineIntel"
