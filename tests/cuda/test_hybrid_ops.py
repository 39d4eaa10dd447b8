"""The Gated DeltaNet and MoE ops of CudaBackend against CpuBackend (itself tested against the numpy references in
tests/kernels), plus the load-time weight helpers, on tiny shapes."""

from __future__ import annotations

import gguf
import numpy as np
import pytest

from pantheon.kernels.cpu.backend import CpuBackend
from pantheon.kernels.reference import quant as reference

pytestmark = pytest.mark.cuda_kernels


def random(rng: np.random.Generator, shape, scale: float = 1.0) -> np.ndarray:
    return (rng.standard_normal(shape) * scale).astype(np.float32)


def assert_close(actual: np.ndarray, expected: np.ndarray, rel: float = 2e-5) -> None:
    assert actual.shape == expected.shape
    scale = float(np.max(np.abs(expected)))
    err = float(np.max(np.abs(actual.astype(np.float64) - expected)))
    assert err <= rel * scale, f"max abs diff {err:.3g} > {rel} * output scale {scale:.3g}"


@pytest.fixture(scope="module")
def be():
    from pantheon.kernels.cuda.backend import CudaBackend

    return CudaBackend(), CpuBackend(int8=False)  # the cuda kernels compute in float32


@pytest.mark.parametrize("length", [2, 5], ids=["shorter-than-taps", "longer"])
def test_causal_conv1d(be, length):
    gpu, cpu = be
    rng = np.random.default_rng(length)
    x, weight = random(rng, (2, length, 6)), random(rng, (6, 4))
    states = random(rng, (3, 3, 6))
    slots = np.array([2, 0], np.int32)
    want_states = states.copy()
    want = cpu.causal_conv1d(x, want_states, weight, slots)
    dev_states = gpu.upload(states)
    got = gpu.causal_conv1d(gpu.upload(x), dev_states, gpu.upload(weight), slots)
    assert_close(gpu.to_host(got), want)
    assert np.array_equal(gpu.to_host(dev_states), want_states)
    with pytest.raises(ValueError):
        gpu.causal_conv1d(gpu.upload(x), dev_states, gpu.upload(weight), np.array([1, 1], np.int32))


def test_gates_norms_and_sigmoid(be):
    gpu, cpu = be
    rng = np.random.default_rng(1)
    b, alpha = random(rng, (3, 4), 3.0), random(rng, (3, 4), 10.0)
    a, dt_bias = -np.exp(random(rng, 4)), random(rng, 4)
    for got, want in zip(gpu.gdn_gates(*map(gpu.upload, (b, alpha, a, dt_bias))), cpu.gdn_gates(b, alpha, a, dt_bias)):
        assert_close(gpu.to_host(got), want, 1e-6)
    x, z, w = random(rng, (4, 8), 2.0), random(rng, (4, 8), 3.0), random(rng, 8)
    assert_close(gpu.to_host(gpu.gated_rmsnorm(gpu.upload(x), gpu.upload(z), gpu.upload(w), 1e-6)),
                 cpu.gated_rmsnorm(x, z, w, 1e-6))
    for gate in (random(rng, (4, 8), 4.0), random(rng, (4, 1), 4.0)):
        assert_close(gpu.to_host(gpu.sigmoid_mul(gpu.upload(x), gpu.upload(gate))), cpu.sigmoid_mul(x, gate))
        in_place = gpu.upload(x)
        gpu.sigmoid_mul(in_place, gpu.upload(gate), out=in_place)
        assert_close(gpu.to_host(in_place), cpu.sigmoid_mul(x, gate))


@pytest.mark.parametrize("form", ["gated_delta_recurrent", "gated_delta_chunked"])
def test_gated_delta_rule(be, form):
    """q and k as strided head slices of one array (as the model slices the conv output), dk != dv, two sequences
    in slots 2 and 0, two value heads sharing one key head."""
    gpu, cpu = be
    rng = np.random.default_rng(3)
    n_seq, length, nk, nv, dk, dv = 2, 3, 1, 2, 8, 4
    qk = random(rng, (n_seq, length, 2 * nk, dk))
    v = random(rng, (n_seq, length, nv, dv))
    g = -np.abs(random(rng, (n_seq, length, nv), 0.5))
    beta = (1 / (1 + np.exp(-random(rng, (n_seq, length, nv))))).astype(np.float32)
    states = random(rng, (3, nv, dv, dk), 0.3)  # (S, Nv, dv, dk): transposed, row j is column j of S
    slots, key_head = np.array([2, 0], np.int32), np.array([0, 0], np.int32)
    want_states = states.copy()
    want = getattr(cpu, form)(qk[:, :, :nk], qk[:, :, nk:], v, g, beta, want_states, slots, key_head, 0.3, 1e-6)
    dqk, dstates = gpu.upload(qk), gpu.upload(states)
    got = getattr(gpu, form)(dqk[:, :, :nk], dqk[:, :, nk:], gpu.upload(v), gpu.upload(g), gpu.upload(beta),
                             dstates, slots, key_head, 0.3, 1e-6)
    assert_close(gpu.to_host(got), want, 1e-4)
    assert_close(gpu.to_host(dstates), want_states, 1e-4)
    with pytest.raises(ValueError):
        getattr(gpu, form)(dqk[:, :, :nk], dqk[:, :, nk:], gpu.upload(v), gpu.upload(g), gpu.upload(beta),
                           gpu.upload(np.zeros((3, nv, dk, dv), np.float32)), slots, key_head, 0.3, 1e-6)


def stacked_q8(rng, n_experts: int, rows: int, cols: int) -> np.ndarray:
    dense = random(rng, (n_experts * rows, cols))
    return gguf.quants.quantize(dense, gguf.GGMLQuantizationType.Q8_0)


def test_moe_route_and_ffn(be):
    gpu, cpu = be
    rng = np.random.default_rng(4)
    n_experts, k, d, ff, n_tok = 4, 2, 32, 32, 5
    logits = random(rng, (n_tok, n_experts), 2.0)
    logits[1, :] = 0.5  # a tie: the lower ids win
    ids_c, w_c = cpu.moe_route(logits, k)
    ids_g, w_g = gpu.moe_route(gpu.upload(logits), k)
    assert np.array_equal(gpu.to_host(ids_g), ids_c)
    assert_close(gpu.to_host(w_g), w_c, 1e-6)

    gate_up = stacked_q8(rng, n_experts, 2 * ff, d)  # fused gate_up: each expert's rows are [gate | up]
    down = stacked_q8(rng, n_experts, d, ff)
    x, base = random(rng, (n_tok, d)), random(rng, (n_tok, d))
    experts = {}
    for name, backend in (("cpu", cpu), ("gpu", gpu)):
        gu = backend.weight_from_raw(gate_up.view(np.uint8), 8, n_experts * 2 * ff, d)
        dn = backend.weight_from_raw(down.view(np.uint8), 8, n_experts * d, ff)
        experts[name] = (backend.experts(gu, n_experts, 2, 0), backend.experts(gu, n_experts, 2, 1),
                         backend.experts(dn, n_experts))
    want = cpu.moe_ffn(x, *experts["cpu"], ids_c, w_c, base.copy())
    out = gpu.upload(base)
    assert gpu.moe_ffn(gpu.upload(x), *experts["gpu"], ids_g, w_g, out) is out
    assert_close(gpu.to_host(out), want)
    # Batch invariance: token 3 alone gets the same bits.
    alone = gpu.upload(base[3:4])
    gpu.moe_ffn(gpu.upload(x[3:4]), *experts["gpu"], gpu.upload(ids_c[3:4]), gpu.upload(w_c[3:4]), alone)
    assert np.array_equal(gpu.to_host(alone)[0], gpu.to_host(out)[3])
    # The decode step's form (a tile per pair, experts read on the device): the same bits.
    from pantheon.kernels.cuda import moe

    pairs = gpu.upload(base)
    bufs = moe.pair_buffers(n_tok, k, d, ff, gpu.stream)
    assert moe.moe_ffn_pairs(gpu.upload(x), *experts["gpu"], ids_g, w_g, pairs, bufs, gpu.stream) is pairs
    assert np.array_equal(gpu.to_host(pairs), gpu.to_host(out))


def test_weight_rows_and_weight_from_raw(be):
    gpu, cpu = be
    rng = np.random.default_rng(5)
    raw = reference.random_weight_bytes(12, 6, 256, rng)  # Q4_K
    w_g, w_c = gpu.weight_from_raw(raw, 12, 6, 256), cpu.weight_from_raw(raw, 12, 6, 256)
    x = random(rng, (2, 256))
    for rows in (np.array([2, 3, 4]), np.array([5, 0, 5])):
        sub_g, sub_c = gpu.weight_rows(w_g, rows), cpu.weight_rows(w_c, rows)
        assert (sub_g.rows, sub_g.cols) == (3, 256)
        assert_close(gpu.to_host(gpu.matmul(sub_g, gpu.upload(x))), cpu.matmul(sub_c, x))
    from pantheon.errors import ModelLoadError

    with pytest.raises(ModelLoadError):
        gpu.weight_rows(w_g, np.array([6]))
    with pytest.raises(ModelLoadError):
        gpu.experts(w_g, 4)
