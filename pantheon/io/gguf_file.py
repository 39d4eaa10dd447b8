"""Open a GGUF file: metadata as plain Python values, tensors as zero-copy views of the mmapped file.

`gguf.GGUFReader` is the parser, but it spends seconds building ~1M tiny numpy views for a 49k vocab, so what
we derive from it (metadata and the tensor table) is cached as one JSON file keyed by the file's identity
(real path, size, mtime, inode). A cache hit skips GGUFReader entirely: we mmap the file ourselves and slice
the tensors out of it at the recorded offsets.
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import orjson

from pantheon.errors import ModelLoadError

# Bump when the cached layout changes, so stale caches are ignored rather than misread.
_CACHE_FORMAT = 1


@dataclass(frozen=True)
class TensorInfo:
    name: str
    qtype: int  # ggml type id (gguf.GGMLQuantizationType value)
    shape: tuple[int, ...]  # ggml order: ne0 (the contiguous dimension) first
    offset: int  # absolute byte offset of the data in the file
    nbytes: int

    @property
    def rows(self) -> int:
        """Number of ne0-long rows (product of every dimension but the first)."""
        n = 1
        for d in self.shape[1:]:
            n *= d
        return n

    @property
    def cols(self) -> int:
        return self.shape[0]


@dataclass
class GGUFFile:
    path: Path
    identity: str  # stable for one file version; used as a cache key and in weights_version
    metadata: dict[str, Any]
    tensors: dict[str, TensorInfo]
    _mmap: np.ndarray

    @property
    def architecture(self) -> str:
        arch = self.metadata.get("general.architecture")
        if not isinstance(arch, str):
            raise ModelLoadError(f"{self.path}: missing general.architecture")
        return arch

    def tensor_bytes(self, name: str) -> np.ndarray:
        """The tensor's raw bytes (uint8, read-only view into the mmap; never a copy)."""
        info = self.tensors[name]
        return self._mmap[info.offset : info.offset + info.nbytes]

    def close(self) -> None:
        mm = getattr(self._mmap, "_mmap", None)
        self._mmap = np.empty(0, np.uint8)
        if mm is not None:
            try:
                mm.close()
            except (BufferError, ValueError):
                pass  # views still alive (weights in use); the OS unmaps when they go


def file_identity(path: Path) -> str:
    st = path.stat()
    key = f"{path.resolve()}|{st.st_size}|{st.st_mtime_ns}|{st.st_ino}"
    return hashlib.sha256(key.encode()).hexdigest()[:24]


def _plain(value: Any) -> Any:
    if isinstance(value, np.generic):
        return value.item()
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return value


def _read_with_gguf(path: Path) -> tuple[dict[str, Any], dict[str, TensorInfo]]:
    import gguf  # imported lazily: only the slow path needs it

    try:
        reader = gguf.GGUFReader(path)
    except Exception as exc:  # the gguf package raises ValueError/IndexError/struct errors on bad files
        raise ModelLoadError(f"{path}: not a readable GGUF file ({type(exc).__name__}: {exc})") from None
    metadata: dict[str, Any] = {}
    for key, field in reader.fields.items():
        if key.startswith("GGUF."):
            continue
        try:
            metadata[key] = _plain(field.contents())
        except Exception as exc:
            raise ModelLoadError(f"{path}: metadata key {key!r} is corrupt ({exc})") from None
    tensors: dict[str, TensorInfo] = {}
    for t in reader.tensors:
        tensors[t.name] = TensorInfo(
            name=t.name,
            qtype=int(t.tensor_type),
            shape=tuple(int(d) for d in t.shape),
            offset=int(t.data_offset),
            nbytes=int(t.n_bytes),
        )
    return metadata, tensors


def _load_cache(cache_file: Path) -> tuple[dict[str, Any], dict[str, TensorInfo]] | None:
    try:
        raw = orjson.loads(cache_file.read_bytes())
    except (OSError, orjson.JSONDecodeError):
        return None
    if raw.get("format") != _CACHE_FORMAT:
        return None
    tensors = {t["name"]: TensorInfo(t["name"], t["qtype"], tuple(t["shape"]), t["offset"], t["nbytes"])
               for t in raw["tensors"]}
    return raw["metadata"], tensors


def _store_cache(cache_file: Path, metadata: dict[str, Any], tensors: dict[str, TensorInfo]) -> None:
    payload = {
        "format": _CACHE_FORMAT,
        "metadata": metadata,
        "tensors": [t.__dict__ for t in tensors.values()],
    }
    try:
        cache_file.parent.mkdir(parents=True, exist_ok=True)
        tmp = cache_file.with_suffix(f".tmp{os.getpid()}")
        tmp.write_bytes(orjson.dumps(payload))
        os.replace(tmp, cache_file)
    except OSError:
        pass  # a cache we cannot write only costs speed


def _build_cache_in_subprocess(path: Path, cache_file: Path) -> None:
    """GGUFReader is pure Python and holds the GIL for seconds on a large vocabulary; parsing in a child
    process keeps the serving threads of this one responsive while a model loads."""
    subprocess.run([sys.executable, "-m", "pantheon.io.gguf_file", str(path), str(cache_file)],
                   capture_output=True, timeout=600, check=False)


def open_gguf(path: str | os.PathLike[str], cache_dir: Path | None = None) -> GGUFFile:
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"model file not found: {path}")
    identity = file_identity(path)
    cache_file = cache_dir / f"{identity}.gguf.json" if cache_dir else None
    cached = _load_cache(cache_file) if cache_file else None
    if cached is None and cache_file is not None:
        _build_cache_in_subprocess(path, cache_file)
        cached = _load_cache(cache_file)
    if cached is None:
        # No cache dir, or the child failed (a corrupt file): parse here, which reports what is wrong.
        metadata, tensors = _read_with_gguf(path)
        if cache_file is not None:
            _store_cache(cache_file, metadata, tensors)
    else:
        metadata, tensors = cached
    size = path.stat().st_size
    for t in tensors.values():
        if t.offset + t.nbytes > size:
            raise ModelLoadError(
                f"{path}: truncated file: tensor {t.name!r} needs bytes up to {t.offset + t.nbytes}, file has {size}"
            )
    mm = np.memmap(path, dtype=np.uint8, mode="r")
    return GGUFFile(path=path, identity=identity, metadata=metadata, tensors=tensors, _mmap=mm)


if __name__ == "__main__":  # python -m pantheon.io.gguf_file MODEL CACHE_FILE (see _build_cache_in_subprocess)
    _metadata, _tensors = _read_with_gguf(Path(sys.argv[1]))
    _store_cache(Path(sys.argv[2]), _metadata, _tensors)
