"""pantheon/engine/side_compile.py: a first load compiles the prefill path's kernels in a child process, whose
cache entries are then copied into the kernel cache, where this process finds them."""

from __future__ import annotations

import importlib
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import numba
import pytest

from pantheon.config import ModelOptions, read_env
from pantheon.engine import loader, side_compile
from pantheon.kernels.cpu import int8dot
from pantheon.kernels.cpu.backend import CpuBackend


def _write(path: Path, data: bytes) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data)
    return path


def test_merge_copies_only_the_functions_the_cache_has_no_index_for(tmp_path: Path) -> None:
    scratch, cache = tmp_path / "scratch", tmp_path / "cache"
    _write(scratch / "cpu_x" / "ops.a-10.py311.nbi", b"child index a")
    _write(scratch / "cpu_x" / "ops.a-10.py311.1.nbc", b"child a1")
    _write(scratch / "cpu_x" / "ops.a-10.py311.2.nbc", b"child a2")
    _write(scratch / "cpu_x" / "ops.b-20.py311.nbi", b"child index b")
    _write(scratch / "cpu_x" / "ops.b-20.py311.1.nbc", b"child b1")
    _write(scratch / "cpu_x" / "ops.b-20.py311.2.nbc", b"child b2")
    _write(cache / "cpu_x" / "ops.b-20.py311.nbi", b"own index b")
    _write(cache / "cpu_x" / "ops.b-20.py311.1.nbc", b"own b1")

    assert side_compile.merge_cache(scratch, cache) == 1
    copied = sorted(p.name for p in (cache / "cpu_x").iterdir())
    assert copied == ["ops.a-10.py311.1.nbc", "ops.a-10.py311.2.nbc", "ops.a-10.py311.nbi",
                      "ops.b-20.py311.1.nbc", "ops.b-20.py311.nbi"]
    assert (cache / "cpu_x" / "ops.a-10.py311.2.nbc").read_bytes() == b"child a2"
    # b is this process's: its index and data stay as they were, and the child's second entry is not added
    # (its index would not name it, and it could be another signature's number here).
    assert (cache / "cpu_x" / "ops.b-20.py311.nbi").read_bytes() == b"own index b"
    assert (cache / "cpu_x" / "ops.b-20.py311.1.nbc").read_bytes() == b"own b1"


_KERNELS = """
import numba

@numba.njit(cache=True)
def child_part(x):
    return x + 1

@numba.njit(cache=True)
def own_part(x):
    return x * 2
"""


def test_a_function_the_child_compiled_is_loaded_from_the_cache_here(tmp_path: Path, monkeypatch) -> None:
    """The premise of the whole scheme, with numba's real cache: an entry saved under another cache folder and
    copied in is found by this process (a cache hit, no compile)."""
    module = f"side_compile_kernels_{os.getpid()}"
    (tmp_path / f"{module}.py").write_text(_KERNELS)
    cache = tmp_path / "cache"
    cache.mkdir()
    # numba reads its cache folder when a function is decorated, and the environment again at every compile.
    monkeypatch.setenv("NUMBA_CACHE_DIR", str(cache))
    monkeypatch.setattr(numba.config, "CACHE_DIR", str(cache))
    monkeypatch.syspath_prepend(str(tmp_path))
    kernels = importlib.import_module(module)

    scratch = Path(tempfile.mkdtemp(prefix="side-compile-", dir=cache))
    env = {**os.environ, "NUMBA_CACHE_DIR": str(scratch / "cache"),
           "PYTHONPATH": os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")])}
    errors = scratch / "child.log"
    with open(errors, "wb") as err:
        child = subprocess.Popen([sys.executable, "-c", f"import {module}; {module}.child_part(1)"], env=env,
                                 stdout=subprocess.DEVNULL, stderr=err)
    assert kernels.own_part(3) == 6  # compiled here meanwhile, into the cache itself

    copied = side_compile.SideCompile(child, scratch, errors).finish(decode_s=side_compile.FROM_CACHE_S + 1)
    assert copied == 1, errors.read_text() if errors.exists() else ""
    assert not scratch.exists()
    assert kernels.child_part(1) == 2
    assert sum(kernels.child_part.stats.cache_hits.values()) == 1
    assert not kernels.child_part.stats.cache_misses


def test_a_failed_child_copies_nothing_and_says_why(tmp_path: Path, monkeypatch, caplog) -> None:
    monkeypatch.setenv("NUMBA_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(numba.config, "CACHE_DIR", str(tmp_path))
    scratch = Path(tempfile.mkdtemp(prefix="side-compile-", dir=tmp_path))
    errors = scratch / "child.log"
    with open(errors, "wb") as err:
        child = subprocess.Popen([sys.executable, "-c", "raise SystemExit('no model here')"], stderr=err)
    assert side_compile.SideCompile(child, scratch, errors).finish(decode_s=60.0) == 0
    assert "the child failed (exit 1)" in caplog.text and "no model here" in caplog.text
    assert not scratch.exists()


@pytest.mark.slow
def test_a_load_whose_kernels_are_cached_stops_its_child_and_marks_the_model_warm(
        tmp_path: Path, default_model_path: Path, monkeypatch) -> None:
    """The default model loaded once here without a child (its kernels then compiled or cached in this process),
    then a copy of its file (a file the marker has not seen) with one: the decode step warms up at once, so the
    child is stopped rather than waited for; the load leaves the marker, and loading the copy again starts none."""
    backend = CpuBackend(int8=int8dot.INT8_ISA is not None)
    loader.load_served_model(ModelOptions(path=default_model_path, name="plain"), read_env(), backend)
    copy = tmp_path / "copy.gguf"
    shutil.copyfile(default_model_path, copy)
    started: list[side_compile.SideCompile | None] = []

    def spy(*args):  # type: ignore[no-untyped-def]
        started.append(side_compile.start(*args))
        return started[-1]

    monkeypatch.setattr(loader, "start_side_compile", spy)
    options = ModelOptions(path=copy, name="copy")
    served = loader.load_served_model(options, read_env(), backend, side_compile=True)
    child = started[0]
    assert child is not None and child.process.returncode is not None and not child.scratch.exists()
    settings = side_compile.CpuSettings(int8=backend.int8, threads=backend.threads, quantize=False)
    assert (side_compile.cache_folder() / "warm" / side_compile.warm_key(copy, settings)).exists()
    assert served.model.vocab_size > 0

    loader.load_served_model(options, read_env(), backend, side_compile=True)
    assert started[1] is None


def test_the_child_is_started_only_on_the_cpu_backend(tmp_path: Path) -> None:
    options = ModelOptions(path=tmp_path / "absent.gguf", name="x")
    assert loader._side_compile(options, read_env(), object()) == (None, None)
