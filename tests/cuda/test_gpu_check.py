"""bench/gpu_check.py stays runnable: it stops cleanly without a GPU, and its kernel-bandwidth step runs end to end
on the simulator at tiny sizes (the timings there are meaningless; the point is that the code path works)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def test_stops_at_no_gpu_found():
    from bench import gpu_check

    if gpu_check.find_gpu() is not None:
        pytest.skip("this machine has a GPU")
    result = subprocess.run([sys.executable, str(ROOT / "bench" / "gpu_check.py")], capture_output=True, text=True,
                            timeout=120)
    assert result.returncode == gpu_check.NO_GPU_EXIT
    assert "no GPU found" in result.stdout


@pytest.mark.cuda_kernels
def test_kernel_bandwidth_step_runs():
    from bench import gpu_check
    from pantheon.kernels.cuda.launch import SIMULATOR

    if not SIMULATOR:
        pytest.skip("the tiny smoke run is for the simulator; on a GPU run bench/gpu_check.py itself")
    from pantheon.kernels.cuda.quant import SUPPORTED_TYPES

    result = gpu_check.inner_kernels(True, tiny=True)
    assert len(result["kernels"]) == 2 * len(SUPPORTED_TYPES) + 4  # every type at two batch sizes, and 4 others
