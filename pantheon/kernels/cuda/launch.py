"""What the cuda kernel modules share: numba.cuda itself, whether it is the simulator, and launch geometry.

Every kernel walks its work items with a grid-stride loop, so the grid size is a free choice: on hardware it
covers the work, under the simulator (one Python thread per CUDA thread, blocks run one after another, ~1 ms
per thread and per syncthreads) it is capped at two blocks of a few threads, which keeps a kernel test to
seconds while still running more than one block. The kernels read their block size from `cuda.blockDim`, so
the simulator checks the same code that hardware runs, only with smaller numbers.
"""

from __future__ import annotations

from dataclasses import dataclass

from numba import cuda

# The simulator's cuda.jit lives in numba.cuda.simulator; checking the module (not the env var) stays right
# even after numba re-reads its config.
SIMULATOR: bool = cuda.jit.__module__.startswith("numba.cuda.simulator")


# Compile-time sizes of shared and local arrays (numba needs them as globals). Kernels check their inputs
# against them on the host side.
MAX_HEAD_DIM = 256
KEY_TILE = 16 if not SIMULATOR else 4  # prefill attention: keys per shared-memory tile
BATCH_TILE = 8 if not SIMULATOR else 4  # matmul: activation rows per pass over a weight row
MM_SHARED = 32 * 8 * 8  # mm_threads * mm_rows * BATCH_TILE at most (hardware: 32 * 4 * 8)
NORM_SHARED = 1024
DEC_SHARED_THREADS = 32  # decode attention: dec_threads at most (32 x MAX_HEAD_DIM floats = 32 KiB)


@dataclass(frozen=True)
class Geometry:
    """Block sizes and grid caps. Every "threads" value that a kernel reduces over is a power of two."""

    mm_threads: int  # threads sharing one weight row (split K), power of two
    mm_rows: int  # weight rows per block
    norm_threads: int  # threads per row in rmsnorm, power of two
    ew_threads: int  # elementwise kernels
    attn_queries: int  # prefill attention: queries per block, one per thread
    dec_threads: int  # decode attention: threads sharing one query's keys
    split_keys: int  # decode attention: keys per split before the KV is split across blocks
    max_splits: int
    small_prefill: int  # prefill chunks of at most this many tokens use the decode (split-K) kernel
    max_blocks: int  # grid cap; 0 = as many blocks as work items

    def __post_init__(self) -> None:
        for name in ("mm_threads", "norm_threads", "dec_threads"):
            value = getattr(self, name)
            if value < 1 or value & (value - 1):
                raise ValueError(f"Geometry.{name} must be a power of two, got {value}")
        if self.mm_threads * self.mm_rows * BATCH_TILE > MM_SHARED or self.norm_threads > NORM_SHARED:
            raise ValueError("Geometry: a block needs more shared memory than the kernels reserve")
        if self.dec_threads > DEC_SHARED_THREADS:
            raise ValueError(f"Geometry.dec_threads must be at most {DEC_SHARED_THREADS}")


HARDWARE = Geometry(mm_threads=32, mm_rows=4, norm_threads=256, ew_threads=256, attn_queries=32, dec_threads=32,
                    split_keys=256, max_splits=32, small_prefill=4, max_blocks=0)
# Under the simulator a whole-model forward is mostly the matmuls' syncthreads (one per round of the split-K
# tree, each ~1 ms per thread): 2 threads per weight row keep a round of the tree and halve a tiny qwen35moe
# forward against 4 (71 -> 43 s for a two-slot prefill).
SIMULATED = Geometry(mm_threads=2, mm_rows=2, norm_threads=8, ew_threads=16, attn_queries=4, dec_threads=4,
                     split_keys=8, max_splits=4, small_prefill=2, max_blocks=2)
GEOMETRY = SIMULATED if SIMULATOR else HARDWARE


def blocks(items: int, threads: int = 1, geometry: Geometry = GEOMETRY) -> int:
    """Grid size for `items` work items, `threads` of them per block (1: an item is a whole block), capped by
    the geometry."""
    needed = max(1, -(-items // threads))
    if geometry.max_blocks:
        needed = min(needed, geometry.max_blocks)
    return min(needed, 1 << 30)


__all__ = ["BATCH_TILE", "DEC_SHARED_THREADS", "GEOMETRY", "Geometry", "HARDWARE", "KEY_TILE", "MAX_HEAD_DIM",
           "MM_SHARED", "NORM_SHARED", "SIMULATED", "SIMULATOR", "blocks", "cuda"]
