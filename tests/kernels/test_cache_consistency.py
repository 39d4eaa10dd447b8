"""A kernel loaded from numba's on-disk cache computes the same bits as the same kernel freshly compiled.

Not a given: with fast-math flags the rope kernels once differed (first start vs restarts of a server gave
different logits). Two child processes share an empty NUMBA_CACHE_DIR; the first compiles, the second loads."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]


def probe(cache_dir: Path) -> str:
    env = {**os.environ, "NUMBA_CACHE_DIR": str(cache_dir)}
    done = subprocess.run([sys.executable, "-m", "tests.kernels.cache_probe"], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    return done.stdout.strip()


def test_cached_kernels_compute_what_fresh_ones_do(tmp_path: Path) -> None:
    fresh = probe(tmp_path)
    assert any(tmp_path.rglob("*.nbc")), "the first run wrote no cache"
    cached = probe(tmp_path)
    assert cached == fresh
