"""The cpu backend's numba kernels.

numba's threading layer is chosen here, before any parallel kernel runs: OpenMP first. Measured on the 2-core
test VM (`bench/concurrency.py --levels 1,8`, 2026-11-29): omp 146 tok/s single-stream over HTTP and 405 with 8
streams; workqueue 43 and 211 (its threads sleep between launches, and a decode step launches a few hundred
kernels); tbb is not installed there and untested, so it comes after omp instead of numba's default first.
NUMBA_THREADING_LAYER, when set, still wins.

HOST_CPU_FEATURES: LLVM's names of this CPU's features ("+avx2", "+f16c", ...), which decide the int8
kernels' instruction set and whether a float16 KV cache can be converted in registers. HOST_CPU_VENDOR: the
CPUID vendor string ("AuthenticAMD", "GenuineIntel"; "" where /proc/cpuinfo does not say), which decides
where the int8 kernels' prefetches put the weights (`int8dot._PREFETCH_LOCALITY`).
"""

from pathlib import Path

import llvmlite.binding as llvm_binding
import numba

from pantheon import jit_cache

jit_cache.configure()  # before any kernel module is imported (see pantheon/jit_cache.py)

numba.config.THREADING_LAYER_PRIORITY = ["omp", "tbb", "workqueue"]

HOST_CPU_FEATURES: frozenset[str] = frozenset(llvm_binding.get_host_cpu_features().flatten().split(","))


def cpuinfo_field(name: str, cpuinfo: Path = Path("/proc/cpuinfo")) -> str:
    """The first value of field `name` ("vendor_id", "model name", ...) in /proc/cpuinfo, or "" where there is none
    (not Linux, or not x86)."""
    try:
        for line in cpuinfo.read_text().splitlines():
            key, sep, value = line.partition(":")
            if sep and key.strip() == name:
                return value.strip()
    except OSError:
        pass
    return ""


HOST_CPU_VENDOR: str = cpuinfo_field("vendor_id")
