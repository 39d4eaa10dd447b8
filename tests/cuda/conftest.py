"""The cuda tests run the kernels on numba's CUDA simulator, in this same pytest process, or on a real GPU.

numba.cuda picks the simulator or the real driver once, at its first import, from NUMBA_ENABLE_CUDASIM. Unless
the variable is already set (bench/gpu_check.py sets it to 0 to run these tests on the device), it is set to 1
here, before any test module of this folder imports pantheon.kernels.cuda. It then stays set for the rest of the
session: numba re-reads its config at every compile, so unsetting it would flip numba.cuda's own config back.
The cpu kernels and the server are unaffected by it, and the die manager reports dies from the driver, never
from the simulator.

Markers: `cuda_kernels` tests run on the simulator or a GPU; `gpu` tests need a real device. Without
numba-cuda installed (a cpu-only environment) only the die-manager, graph-bookkeeping and bench-script tests run. If numba.cuda was already imported
without the simulator and there is no GPU, the kernel tests skip with a note: run
`NUMBA_ENABLE_CUDASIM=1 python -m pytest tests/cuda` instead.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator

import pytest

from pantheon.kernels.cuda import numba_cuda_installed

HAVE_NUMBA_CUDA = numba_cuda_installed()
if HAVE_NUMBA_CUDA and "numba.cuda" not in sys.modules:
    os.environ.setdefault("NUMBA_ENABLE_CUDASIM", "1")

# Without the extra only the bookkeeping tests (dies, graphs, the bench script's no-GPU exit) can run.
NEEDS_NUMBA_CUDA = ["test_backend.py", "test_hybrid_ops.py", "test_llama_forward.py", "test_ops.py", "test_ptx.py",
                    "test_quant.py", "test_simulator_shared.py"]
collect_ignore = [] if HAVE_NUMBA_CUDA else NEEDS_NUMBA_CUDA


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "cuda_kernels: runs CUDA kernels (on the simulator or a real GPU)")


def simulator_active() -> bool:
    if not HAVE_NUMBA_CUDA:
        return False
    from pantheon.kernels.cuda.launch import SIMULATOR

    return SIMULATOR


@pytest.fixture(autouse=True, scope="session")
def _shared_arrays_made_once() -> None:
    """The simulator's shared arrays under a lock (see tests/cuda/simulator_shared.py): without it a block's
    threads now and then get arrays of their own and the kernels' reductions come out wrong."""
    if simulator_active():
        from tests.cuda import simulator_shared

        simulator_shared.install()


def real_gpu() -> bool:
    if not HAVE_NUMBA_CUDA or simulator_active():
        return False
    from numba import cuda

    return bool(cuda.is_available())


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    gpu = real_gpu()
    kernels = gpu or simulator_active()
    for item in items:
        if "tests/cuda/" not in str(item.path).replace(os.sep, "/"):
            continue
        if item.get_closest_marker("gpu") and not gpu:
            item.add_marker(pytest.mark.skip(reason="needs a real NVIDIA GPU"))
        elif item.get_closest_marker("cuda_kernels") and not kernels:
            item.add_marker(pytest.mark.skip(
                reason="numba-cuda is not installed" if not HAVE_NUMBA_CUDA else
                "numba.cuda was imported without the simulator and there is no GPU; "
                "run NUMBA_ENABLE_CUDASIM=1 python -m pytest tests/cuda"))


@pytest.fixture(autouse=True)
def _fast_thread_switching() -> Iterator[None]:
    """The simulator runs a Python thread per CUDA thread and polls them at every syncthreads; a shorter switch
    interval makes those hand-offs ~2-4x faster. Restored after each test."""
    old = sys.getswitchinterval()
    sys.setswitchinterval(5e-4)
    yield
    sys.setswitchinterval(old)
