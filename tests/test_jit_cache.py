"""pantheon/jit_cache.py: compiled kernels are cached in a folder named by a fingerprint of every jitted module's
source, so an edit to a module that others inline (int8dot into decode_layers) cannot leave stale machine code."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

from pantheon import jit_cache


def test_the_fingerprint_follows_every_jitted_source(tmp_path: Path) -> None:
    package = tmp_path / "pantheon"
    shutil.copytree(jit_cache._PACKAGE, package, ignore=shutil.ignore_patterns("__pycache__"))
    sources = {str(p.relative_to(package)) for p in jit_cache.jit_sources(package)}
    assert {"kernels/cpu/int8dot.py", "kernels/cpu/decode_layers.py", "engine/sampling.py"} <= sources
    assert "http/app.py" not in sources and "kernels/cuda/backend.py" not in sources
    before = jit_cache.fingerprint(package)
    assert jit_cache.fingerprint(package) == before
    app = package / "http" / "app.py"
    app.write_text(app.read_text() + "\n# an edit outside the kernels\n")
    assert jit_cache.fingerprint(package) == before
    int8dot = package / "kernels" / "cpu" / "int8dot.py"
    int8dot.write_text(int8dot.read_text() + "\n# an edit\n")
    assert jit_cache.fingerprint(package) != before


def test_the_cache_lives_under_pantheon_home_unless_numba_cache_dir_is_set(tmp_path: Path) -> None:
    code = "import os, numba, pantheon.kernels.cpu; print(os.environ['NUMBA_CACHE_DIR'], numba.config.CACHE_DIR)"
    env = {k: v for k, v in os.environ.items() if k != "NUMBA_CACHE_DIR"}
    run = lambda extra: subprocess.run([sys.executable, "-c", code], env={**env, **extra}, capture_output=True,  # noqa: E731
                                       text=True, check=True).stdout.split()
    chosen, in_numba = run({"PANTHEON_HOME": str(tmp_path)})
    assert chosen == in_numba == str(tmp_path / "numba" / jit_cache.fingerprint())
    assert run({"PANTHEON_HOME": str(tmp_path), "NUMBA_CACHE_DIR": str(tmp_path / "mine")}) == [
        str(tmp_path / "mine")] * 2
