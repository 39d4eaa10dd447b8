"""Every CUDA kernel compiles for a real GPU (sm_90 PTX) with float32 arithmetic only, checked without a GPU.

The compile runs in a subprocess because this process has numba.cuda in simulator mode. It needs NVVM and NVRTC
(`pip install nvidia-nvvm nvidia-cuda-nvrtc`, or numba-cuda[cu13]); without them the test is skipped."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

SCRIPT = Path(__file__).with_name("ptx_check.py")


def test_kernels_compile_for_the_device():
    env = {k: v for k, v in os.environ.items() if k != "NUMBA_ENABLE_CUDASIM"}
    result = subprocess.run([sys.executable, str(SCRIPT)], capture_output=True, text=True, timeout=600, env=env,
                            cwd=Path(__file__).resolve().parents[2])
    output = result.stdout + result.stderr
    if result.stdout.startswith("SKIP"):
        pytest.skip(result.stdout.strip())
    assert result.returncode == 0, output
    assert "ok _matmul_kernel" in output
