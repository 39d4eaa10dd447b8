"""A first load's kernel compilation in two processes: the decode step here, the prefill path beside it.

numba compiles on one thread. A cold load of the default model on the int8 path compiled for ~92 s on the
2-core Zen 3 VM before the server listened: ~52 s for the compiled decode step (`decode_layers`), ~40 s for
the prefill path (prefill attention, dequantization, rope, norms, the top-k sort), which share little. So when
the kernel cache (`jit_cache`) has not yet seen this model on this backend, a child process
(`python -m pantheon.engine.side_compile`) loads the same file the same way and runs the prefill half of the
warm-up (`loader.warm_prefill`) while this process compiles the decode step; when both are done, what the
child compiled is copied into the kernel cache, where this process's own prefill warm-up then finds it.

The child saves into a scratch folder of its own, not the shared cache: two processes saving entries of one
function into one folder can pair one's index with the other's data file. The copy takes only functions the
cache has no index for, each whole (data files first, then the index, each by an atomic rename), so an index
never names a file it lacks or one another process wrote. A function both compiled keeps this process's
entries.

A load that finished its warm-up leaves a marker (`warm/<key>` in the cache folder, keyed by the file's
identity and the backend's settings), and a later load of it starts no child: its kernels load from the cache
in a few seconds. No child either off the cpu backend, or where the machine's free memory is under three times
the file's size (the child holds its own copy of the weights while it runs). Should the child fail, the load
goes on and compiles what is missing itself, as it would without one.
"""

from __future__ import annotations

import argparse
import glob
import hashlib
import logging
import os
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

import numba

log = logging.getLogger("pantheon.models")

CHILD_TIMEOUT_S = 900.0  # a child not done by then is killed (the cold prefill path takes ~45 s on 2 cores)
# A decode step warmed up faster than this came from the cache (cold it compiles for ~50-70 s on the 2-core VM,
# from the cache in ~1-3 s): the prefill path most likely is there too, and the child is stopped, not waited for.
FROM_CACHE_S = 15.0


@dataclass(frozen=True)
class CpuSettings:
    """What the child needs to build the same kernels: the cpu backend's settings and the load's options."""

    int8: bool
    threads: int
    quantize: bool

    def args(self) -> list[str]:
        return [f"--threads={self.threads}"] + ["--int8"] * self.int8 + ["--quantize"] * self.quantize


def cache_folder() -> Path:
    return Path(numba.config.CACHE_DIR)


def warm_key(path: Path, settings: CpuSettings) -> str:
    """Names a model file (by path, size and modification time) loaded with these settings."""
    stat = path.stat()
    text = f"{path.resolve()}|{stat.st_size}|{stat.st_mtime_ns}|{settings}"
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def _marker(key: str) -> Path:
    return cache_folder() / "warm" / key


def mark_warm(key: str) -> None:
    try:
        _marker(key).parent.mkdir(parents=True, exist_ok=True)
        _marker(key).touch()
    except OSError as exc:  # a read-only cache folder: the next load starts a child again, nothing worse
        log.warning("cannot mark the kernel cache warm: %s", exc)


def _copy_atomic(source: Path, target: Path) -> None:
    partial = target.with_name(f"{target.name}.{os.getpid()}.partial")
    shutil.copyfile(source, partial)
    os.replace(partial, target)


def merge_cache(scratch: Path, cache: Path) -> int:
    """Copies into `cache` every function of the numba cache folder `scratch` that `cache` has no index for
    (its data files, then its index). The number of functions copied."""
    copied = 0
    for index in sorted(scratch.rglob("*.nbi")):
        target = cache / index.relative_to(scratch)
        if target.exists():
            continue
        target.parent.mkdir(parents=True, exist_ok=True)
        stem = index.name[: -len(".nbi")]
        for data in index.parent.glob(glob.escape(stem) + ".*.nbc"):
            _copy_atomic(data, target.parent / data.name)
        _copy_atomic(index, target)
        copied += 1
    return copied


class SideCompile:
    """The child compiling the prefill path into `scratch`; `finish` waits for it and merges its cache."""

    def __init__(self, process: subprocess.Popen[bytes], scratch: Path, errors: Path) -> None:
        self.process = process
        self.scratch = scratch
        self._errors = errors

    def finish(self, decode_s: float, timeout_s: float = CHILD_TIMEOUT_S) -> int:
        """Waits for the child (killing it after timeout_s) and copies what it compiled into the kernel cache:
        the number of functions copied (0 when it failed). decode_s: how long this process took to warm up its
        decode step; under FROM_CACHE_S the child is stopped instead (a model file new to the marker whose
        kernels are all in the cache already, e.g. a second copy of a model)."""
        if decode_s < FROM_CACHE_S:
            self.abandon()
            return 0
        try:
            try:
                code = self.process.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
                log.warning("side compile: the child took over %.0f s and was stopped", timeout_s)
                return 0
            if code != 0:
                tail = self._errors.read_text(errors="replace")[-2000:] if self._errors.exists() else ""
                log.warning("side compile: the child failed (exit %s); compiling here instead\n%s", code, tail)
                return 0
            try:
                return merge_cache(self.scratch / "cache", cache_folder())
            except OSError as exc:
                log.warning("side compile: cannot copy the child's kernels into the cache: %s", exc)
                return 0
        finally:
            shutil.rmtree(self.scratch, ignore_errors=True)

    def abandon(self) -> None:
        """Stops the child (the load failed, or the kernels were cached after all) and removes its folder."""
        if self.process.poll() is None:
            self.process.kill()
            self.process.wait()
        shutil.rmtree(self.scratch, ignore_errors=True)


def start(path: Path, settings: CpuSettings, key: str, available_bytes: int) -> SideCompile | None:
    """A child compiling the prefill path of `path`'s model, or None where there is no need or no room for one
    (see the module docstring; available_bytes: the host's free memory)."""
    if _marker(key).exists():
        return None
    if available_bytes < 3 * path.stat().st_size:
        return None
    try:
        cache_folder().mkdir(parents=True, exist_ok=True)
        scratch = Path(tempfile.mkdtemp(prefix="side-compile-", dir=cache_folder()))
    except OSError:
        return None
    errors = scratch / "child.log"
    env = {**os.environ, "NUMBA_CACHE_DIR": str(scratch / "cache")}
    with open(errors, "wb") as err:
        process = subprocess.Popen([sys.executable, "-m", "pantheon.engine.side_compile", str(path), *settings.args()],
                                   env=env, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=err)
    log.info("compiling the kernels for %s in two processes (first load with these settings)", path.name)
    return SideCompile(process, scratch, errors)


def _child(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m pantheon.engine.side_compile")
    parser.add_argument("path", type=Path)
    parser.add_argument("--threads", type=int, default=0)
    parser.add_argument("--int8", action="store_true")
    parser.add_argument("--quantize", action="store_true")
    args = parser.parse_args(argv)

    from pantheon.config import read_env
    from pantheon.engine.loader import QuantizeAtLoad, warm_prefill
    from pantheon.io.gguf_file import open_gguf
    from pantheon.kernels.cpu.backend import CpuBackend
    from pantheon.models.registry import load_model

    gguf = open_gguf(args.path, read_env().cache_dir)
    backend = CpuBackend(threads=args.threads, int8=args.int8)
    warm_prefill(load_model(gguf, QuantizeAtLoad(backend) if args.quantize else backend))
    return 0


if __name__ == "__main__":
    sys.exit(_child(sys.argv[1:]))
