"""What only a real GPU can show (skipped elsewhere; bench/gpu_check.py runs them): the driver sees the dies,
CUDA-graph capture through the driver API replays real kernels, and a backend's die context follows its steps onto
worker threads."""

from __future__ import annotations

import threading

import numpy as np
import pytest

pytestmark = pytest.mark.gpu


def test_the_die_manager_sees_the_device():
    from pantheon.kernels.cuda.dies import DieManager

    manager = DieManager.probe(reserve_bytes=1 << 20)
    assert manager.count() >= 1
    assert manager.budget(0) > 0 and manager.info(0).total_bytes > manager.budget(0)
    assert manager.status()[0]["card"] == 0


def test_driver_capture_replays_a_kernel():
    from numba import cuda

    from pantheon.kernels.cuda import ops
    from pantheon.kernels.cuda.graphs import DriverCapture, GraphResidency, RetryPolicy

    stream = cuda.stream()
    buf = cuda.device_array(4096, np.float32)
    residency = GraphResidency(DriverCapture(), RetryPolicy(warmup_runs=1))

    def body() -> None:
        ops.fill(buf, 3.0, stream)

    assert residency.run("fill", "segment", body, stream) is False  # warm-up: compiles and loads the kernel
    assert residency.run("fill", "segment", body, stream) is True  # captured, then launched
    stream.synchronize()
    assert (buf.copy_to_host() == 3.0).all()
    ops.fill(buf, 0.0, stream)
    assert residency.run("fill", "segment", body, stream) is True  # a replay
    stream.synchronize()
    assert (buf.copy_to_host() == 3.0).all()
    counters = residency.counters()
    assert counters["live"] == 1 and counters["captures"] == 1 and counters["capture_failures"] == 0


def test_steps_run_on_worker_threads():
    from pantheon.kernels.cuda.backend import CudaBackend
    from pantheon.kernels.reference import quant as reference

    backend = CudaBackend()
    rng = np.random.default_rng(0)
    raw = reference.random_weight_bytes(8, 64, 256, rng)
    w = backend.weight_from_raw(raw, 8, 64, 256)
    x = rng.standard_normal((3, 256)).astype(np.float32)
    results: list[np.ndarray] = []

    def step() -> None:
        backend.begin_step()
        results.append(backend.to_host(backend.matmul(w, backend.upload(x))))

    worker = threading.Thread(target=step)
    worker.start()
    worker.join()
    want = reference.matmul(8, raw, x)
    assert np.linalg.norm(results[0] - want) / np.linalg.norm(want) < 1e-5
