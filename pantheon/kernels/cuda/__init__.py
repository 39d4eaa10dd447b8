"""The cuda backend: numba @cuda.jit kernels over GGUF blocks in device memory, a die manager and CUDA-graph
bookkeeping.

Importing this package never needs numba-cuda or a driver: it is how CPU-only installs ask "is the extra here?".
The kernel modules (`quant`, `ops`, `backend`) import numba.cuda and need the extra; `dies` and `graphs` do not
(without the extra or a driver the die manager reports 0 dies). Under `NUMBA_ENABLE_CUDASIM=1` the kernels run
on numba's simulator, which proves them correct, never fast.
"""

from __future__ import annotations

import importlib.util
from typing import Any


def numba_cuda_installed() -> bool:
    """True when the cuda extra (numba-cuda) is installed; says nothing about a driver or a GPU."""
    try:
        return importlib.util.find_spec("numba_cuda") is not None
    except (ImportError, ValueError):
        return False


def make_backend(die: int = 0, die_manager: Any = None, owner: str = "") -> Any:
    """A CudaBackend on `die` (imports the kernels; needs numba-cuda)."""
    from pantheon.kernels.cuda.backend import CudaBackend

    return CudaBackend(die=die, die_manager=die_manager, owner=owner)


__all__ = ["make_backend", "numba_cuda_installed"]
