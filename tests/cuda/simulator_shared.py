"""A block's shared arrays on numba-cuda's simulator, made once per block under a lock.

The simulator runs each CUDA thread of a block as a Python thread. `cuda.shared.array` (its
`FakeCUDAShared.array`) keys a block's arrays by the calling file and line, and makes a missing one in a
check-then-store without a lock: when the interpreter switches threads between a thread's check and its store,
two threads each make an array of their own, and from then on the block does not share that array. A
reduction over it then sums one thread's partials with garbage, and the step's logits come out wrong; it showed
as `tests/cuda/test_decode_graphs.py` failing about one run in twenty, at a different step each time. With the
interpreter switching threads every 20 us instead of the tests' 500 (`sys.setswitchinterval`), its replay test
met the race (a second array made for a key already stored) in 3 of 8 runs and failed in 2, both runs with a
race; with the lock it passed 12 of 12 at 20 us (2026-12-06).

`install` swaps in the same keys and the same arrays, made under a lock. The simulator only: on hardware shared
memory is the block's by construction.
"""

from __future__ import annotations

import sys
import threading
from typing import Any

import numpy as np

_LOCK = threading.Lock()


def new_array(shape: Any, dtype: np.dtype) -> np.ndarray:
    """One shared array's storage (a seam: the test of the lock slows it down to widen the race)."""
    return np.empty(shape, dtype)


def _shared_array(self: Any, shape: Any, dtype: Any, alignment: Any = None) -> np.ndarray:
    from numba.core import types
    from numba.np import numpy_support

    if alignment is not None:
        raise RuntimeError("Array alignment is not supported in cudasim")
    if isinstance(dtype, types.Type):
        dtype = numpy_support.as_dtype(dtype)
    if shape == 0:  # dynamic shared memory: one buffer made with the block, nothing to race on
        count = self._dynshared_size // dtype.itemsize
        return np.frombuffer(self._dynshared.data, dtype=dtype, count=count)
    caller = sys._getframe(1)
    key = (caller.f_code.co_filename, caller.f_lineno)  # the simulator's own key: file and line of the call
    with _LOCK:
        array = self._allocations.get(key)
        if array is None:
            array = self._allocations[key] = new_array(shape, dtype)
    return array


def install() -> None:
    """Replace the simulator's `FakeCUDAShared.array` (idempotent). Call only with the simulator active."""
    from numba.cuda.simulator import kernelapi

    kernelapi.FakeCUDAShared.array = _shared_array
