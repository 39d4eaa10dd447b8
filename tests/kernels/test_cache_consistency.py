"""A kernel loaded from numba's on-disk cache computes the same bits as the same kernel freshly compiled.

Not a given: with fast-math flags the rope kernels once differed (first start vs restarts of a server gave
different logits). A child process compiles into an empty NUMBA_CACHE_DIR, a second one loads from it. The
probe's three parts run side by side (compiling is single-threaded: 75-110 s of one core a part, cold), each
with its own cache directory (two processes writing one function's cache entries could mismatch its index and
its data files)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.kernels.cache_probe import PARTS

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]


def probe(cache_root: Path) -> dict[str, str]:
    """Each part's output line, the parts run concurrently, each with the cache directory cache_root / part."""
    children = {part: subprocess.Popen([sys.executable, "-m", "tests.kernels.cache_probe", part], cwd=ROOT,
                                       env={**os.environ, "NUMBA_CACHE_DIR": str(cache_root / part)},
                                       stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for part in PARTS}
    lines = {}
    for part, child in children.items():
        stdout, stderr = child.communicate(timeout=900)
        assert child.returncode == 0, f"{part}: {stderr[-2000:]}"
        lines[part] = stdout.strip()
    return lines


def test_cached_kernels_compute_what_fresh_ones_do(tmp_path: Path) -> None:
    fresh = probe(tmp_path)
    assert fresh["ops"] and fresh["hybrid"], fresh  # decode's is empty without the default model or int8 kernels
    for part, line in fresh.items():
        assert not line or any((tmp_path / part).rglob("*.nbc")), f"the first {part} run wrote no cache"
    cached = probe(tmp_path)
    assert cached == fresh
