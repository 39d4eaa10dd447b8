"""Where numba keeps the compiled kernels: one folder per fingerprint of the kernel sources.

numba checks a cached function against its own source file only. A kernel that inlines another module's code
(decode_layers inlines int8dot's intrinsics and team's barriers) keeps its old machine code after that other
module changes, whether by an edit or an upgrade of the package: the process then runs stale kernels. Keying
the cache folder on every jitted module's source (and numba's version) makes any such change a fresh folder.

`configure()` runs before the first `@numba.njit(cache=True)` is decorated (pantheon.kernels.cpu and
pantheon.engine import it first). It sets NUMBA_CACHE_DIR as well as numba.config.CACHE_DIR: numba read the
environment at its import and reads it again at every compile. A NUMBA_CACHE_DIR set by the user is kept.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

from pantheon.config import pantheon_home

_PACKAGE = Path(__file__).resolve().parent


def jit_sources(package: Path = _PACKAGE) -> list[Path]:
    """The package's modules that mention numba: every module with cached functions, and those they inline
    (an edit elsewhere, say to the HTTP layer, keeps the compiled kernels). The cuda kernels are left out:
    nothing of theirs is cached on disk, and no cpu kernel inlines them."""
    cuda = package / "kernels" / "cuda"
    return [path for path in sorted(package.rglob("*.py"))
            if cuda not in path.parents and b"numba" in path.read_bytes()]


def fingerprint(package: Path = _PACKAGE) -> str:
    import llvmlite
    import numba

    digest = hashlib.sha256(f"{numba.__version__} {llvmlite.__version__}".encode())
    for path in jit_sources(package):
        digest.update(str(path.relative_to(package)).encode())
        digest.update(path.read_bytes())
    return digest.hexdigest()[:16]


def configure() -> None:
    import numba

    if not os.environ.get("NUMBA_CACHE_DIR"):
        os.environ["NUMBA_CACHE_DIR"] = str(pantheon_home() / "numba" / fingerprint())
    numba.config.CACHE_DIR = os.environ["NUMBA_CACHE_DIR"]  # numba read its environment at import
