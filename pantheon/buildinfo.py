"""What this process is: the backend it was installed with and the commit its code came from.

Both are computed once at import and never probed per request.
"""

from __future__ import annotations

import functools
import subprocess
from pathlib import Path

_SOURCE_ROOT = Path(__file__).resolve().parent.parent


def _git(*args: str) -> str | None:
    try:
        result = subprocess.run(["git", "-C", str(_SOURCE_ROOT), *args], capture_output=True, text=True, timeout=5)
    except (OSError, subprocess.SubprocessError):
        return None
    return result.stdout.strip() if result.returncode == 0 else None


@functools.cache
def build_id() -> str:
    """Short commit of the code that is running, '-dirty' when its tree has uncommitted changes to tracked
    files, 'unknown' when the code does not come from a git checkout (e.g. an installed wheel)."""
    if not (_SOURCE_ROOT / ".git").exists():
        return "unknown"
    commit = _git("rev-parse", "--short=12", "HEAD")
    if not commit:
        return "unknown"
    status = _git("status", "--porcelain", "--untracked-files=no")
    return commit + ("-dirty" if status else "")


@functools.cache
def compiled_backend() -> str:
    """`cuda` when the cuda extra (numba-cuda) is installed, else `cpu`. A property of the installation,
    not a probe of the hardware: a cuda install on a machine without a driver still reports cuda."""
    try:
        import importlib.util

        if importlib.util.find_spec("numba_cuda") is not None:
            return "cuda"
    except (ImportError, ValueError):
        pass
    return "cpu"
