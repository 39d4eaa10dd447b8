"""Attention residency: the bookkeeping (pure Python), and on the simulated backend a tiny llama whose KV rings do
not all fit on the die: those layers run on the host with the same logits, are reported, and move back to the
die once their retry finds room."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from pantheon.kernels.cuda.residency import RING_ALLOC_FAILED, AttentionResidency, RingRetry


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_nothing_is_reported_before_a_layer_is_reached() -> None:
    residency = AttentionResidency()
    residency.ring_failed(np.zeros(4))
    assert residency.counters() is None and residency.counters(operator=True) is None


def test_layers_on_the_die_and_on_the_host() -> None:
    clock = Clock()
    residency = AttentionResidency(RingRetry(max_attempts=2, backoff_s=1.0, backoff_max_s=3.0), clock)
    die_pool, host_pool = object.__new__(type("Ring", (), {})), np.zeros(4)
    residency.ring_failed(host_pool)
    for _ in range(3):  # every forward reaches both layers
        residency.reached(die_pool, False)
        residency.reached(host_pool, True)
    assert residency.counters() == {"ondie": 1, "host": 1, "total": 2}
    assert residency.counters(operator=True) == {
        "ondie": 1, "host": 1, "total": 2, "gave_up": 0, "impossible": 0, "host_engagements": 1,
        "ring_alloc_failures": 1, "reasons": {RING_ALLOC_FAILED: 1}}
    # Bounded retry: not before the backoff, then doubling, then giving up.
    assert not residency.due_for_retry(host_pool)
    clock.now += 1.0
    assert residency.due_for_retry(host_pool)
    residency.retry_failed(host_pool)
    assert not residency.due_for_retry(host_pool)
    clock.now += 2.0
    assert residency.due_for_retry(host_pool)
    residency.retry_failed(host_pool)
    clock.now += 1000.0
    assert not residency.due_for_retry(host_pool)  # gave up
    counters = residency.counters(operator=True)
    assert counters["gave_up"] == 1 and counters["ring_alloc_failures"] == 3


def test_a_ring_that_moves_to_the_die_leaves_the_host_count() -> None:
    residency = AttentionResidency()
    host_pool, device_pool = np.zeros(4), np.ones(4)
    residency.ring_failed(host_pool)
    residency.reached(host_pool, True)
    residency.moved_to_die(host_pool, device_pool)
    residency.reached(device_pool, False)
    assert residency.counters(operator=True) == {
        "ondie": 1, "host": 0, "total": 1, "gave_up": 0, "impossible": 0, "host_engagements": 1,
        "ring_alloc_failures": 1}


def test_released_state_is_forgotten() -> None:
    residency = AttentionResidency()
    pool = np.zeros(4)
    residency.reached(pool, False)
    del pool
    assert residency.counters() is None


@pytest.mark.cuda_kernels
@pytest.mark.slow
def test_rings_that_do_not_fit_run_on_the_host_with_the_same_logits(tmp_path: Path) -> None:
    from pantheon.io.gguf_file import open_gguf
    from pantheon.kernels.cpu.backend import CpuBackend
    from pantheon.kernels.cuda.backend import CudaBackend
    from pantheon.kernels.cuda.dies import DieInfo, DieManager
    from pantheon.models.base import BatchRow
    from pantheon.models.llama import LlamaModel
    from tests.cuda.test_llama_forward import CTX, assert_logits_close, write_model

    gguf_file = open_gguf(write_model(tmp_path / "tiny.gguf"))
    dies = DieManager([DieInfo(0, "fake", 1 << 40, 0)])
    backend = CudaBackend(die=0, die_manager=dies, owner="tiny")
    gpu, cpu = LlamaModel.from_gguf(gguf_file, backend), LlamaModel.from_gguf(gguf_file, CpuBackend(int8=False))
    ring = 2 * CTX * gpu.config.n_kv_heads * gpu.config.head_dim * 4
    # Room for three of the four rings (k0, k1, v0 fit; v1 does not): layer 1 runs on the host.
    dies.reserve_bytes = (1 << 40) - dies.used(0) - 3 * ring
    clock = Clock()
    backend.attention_residency.clock = clock
    states = [gpu.new_state(2, CTX), cpu.new_state(2, CTX)]
    assert isinstance(states[0].v[1], np.ndarray) and not isinstance(states[0].k[0], np.ndarray)

    def step(rows: list[BatchRow]) -> np.ndarray:
        got, want = (m.forward(s, rows) for m, s in zip((gpu, cpu), states))
        assert_logits_close(got, want)
        return want

    logits = step([BatchRow(0, np.array([5, 17, 99, 3], np.int32), 0, logits="all")])
    assert isinstance(states[0].k[1], np.ndarray)  # moved to join its layer's other ring on the host
    assert backend.attention_residency.counters(operator=True) == {
        "ondie": 1, "host": 1, "total": 2, "gave_up": 0, "impossible": 0, "host_engagements": 1,
        "ring_alloc_failures": 1, "reasons": {RING_ALLOC_FAILED: 1}}
    tokens, pos = [int(np.argmax(logits[-1])), 7], [4, 0]
    logits = step([BatchRow(0, np.array([tokens[0]], np.int32), pos[0]), BatchRow(1, np.array([7, 8], np.int32), 0)])
    # Room again, and the retry is due: the layer's rings move back to the die with their contents.
    dies.reserve_bytes = 0
    clock.now += 10.0
    tokens, pos = [int(np.argmax(logits[0])), int(np.argmax(logits[1]))], [5, 2]
    step([BatchRow(s, np.array([tokens[s]], np.int32), pos[s]) for s in (0, 1)])
    assert not any(isinstance(p, np.ndarray) for p in (*states[0].k, *states[0].v))
    counters = backend.attention_residency.counters(operator=True)
    assert counters["ondie"] == 2 and counters["host"] == 0 and "reasons" not in counters
    assert dies.used(0) > 4 * ring  # the weights and all four rings are charged to the die


@pytest.mark.cuda_kernels
def test_a_head_dim_the_die_kernels_do_not_take_attends_on_the_host() -> None:
    from pantheon.kernels.cpu import ops as host_ops
    from pantheon.kernels.cuda.backend import CudaBackend
    from pantheon.kernels.cuda.launch import MAX_HEAD_DIM
    from pantheon.kernels.cuda.residency import NO_FLASH_KERNELS

    backend = CudaBackend()
    hd = MAX_HEAD_DIM + 64
    k, v = (backend.kv_pool(2, 8, 1, hd, np.float32) for _ in range(2))
    assert isinstance(k, np.ndarray) and isinstance(v, np.ndarray)
    backend.heal_rings([k], [v])  # never retried onto the die
    rng = np.random.default_rng(0)
    values = rng.standard_normal((2, 1, hd)).astype(np.float32)
    slots, positions = np.array([1, 1], np.int32), np.array([0, 1], np.int32)
    backend.kv_write(k, slots, positions, backend.upload(values))
    backend.kv_write(v, slots, positions, backend.upload(values[::-1].copy()))
    q = rng.standard_normal((1, 2, hd)).astype(np.float32)
    got = backend.to_host(backend.attention_decode_batch(backend.upload(q), k, v, np.array([1], np.int32), 0.1,
                                                         slot_ids=np.array([1], np.int32)))
    want = host_ops.attention_decode_batch(q, k, v, np.array([1], np.int32), 0.1, slot_ids=np.array([1], np.int32))
    np.testing.assert_array_equal(got, want)
    assert backend.attention_residency.counters(operator=True) == {
        "ondie": 0, "host": 1, "total": 1, "gave_up": 0, "impossible": 1, "host_engagements": 1,
        "ring_alloc_failures": 0, "reasons": {NO_FLASH_KERNELS: 1}}
