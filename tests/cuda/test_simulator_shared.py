"""The simulator's shared arrays stay one per block when its threads race to make them (simulator_shared.py)."""

from __future__ import annotations

import time

import numpy as np
import pytest
from numba import float32

from pantheon.kernels.cuda.launch import cuda
from tests.cuda import simulator_shared
from tests.cuda.conftest import simulator_active

pytestmark = pytest.mark.cuda_kernels


@cuda.jit
def _block_sum(out):
    """out[block] = 1 + 2 + ... + 8, summed by thread 0 from the block's shared array."""
    shared = cuda.shared.array(8, float32)
    tid = cuda.threadIdx.x
    shared[tid] = float32(tid + 1)
    cuda.syncthreads()
    if tid == 0:
        total = float32(0)
        for i in range(8):
            total += shared[i]
        out[cuda.blockIdx.x] = total


def test_a_block_shares_its_array_when_making_it_is_slow(monkeypatch: pytest.MonkeyPatch) -> None:
    if not simulator_active():
        pytest.skip("the simulator's shared arrays only")
    made: list[int] = []

    def slow_array(shape: int, dtype: np.dtype) -> np.ndarray:  # without the lock every thread would make one
        time.sleep(0.005)
        made.append(shape)
        return np.empty(shape, dtype)

    monkeypatch.setattr(simulator_shared, "new_array", slow_array)

    out = np.zeros(3, np.float32)
    _block_sum[3, 8](out)
    assert out.tolist() == [36.0, 36.0, 36.0]
    assert made == [8]  # one array for the launch: the simulator's blocks run one after another and reuse it
