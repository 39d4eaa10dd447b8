"""Open a GGUF file: metadata as plain Python values, tensors as zero-copy views of the mmapped file.

The header (metadata and the tensor table) of a plain file, little-endian GGUF v2 or v3 with flat metadata
arrays, is read here with `struct` (`_read_plain`): ~0.1 s for a 49k vocabulary. `gguf.GGUFReader`, which builds
a numpy view per value (~1M for that vocabulary) and took ~3 s for it, reads the rest (big-endian files, nested
arrays, and every malformed header, whose errors it reports), in a child process when there is a cache to fill.
What we derive (metadata and the tensor table) is cached as one JSON file keyed by the file's identity (real
path, size, mtime, inode): a cache hit reads no header at all. Either way we mmap the file ourselves and slice
the tensors out of it at their offsets.
"""

from __future__ import annotations

import hashlib
import math
import os
import struct
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


class _NotPlain(Exception):
    """The header is not one `_read_plain` reads (or is malformed): GGUFReader reads it, or says what is wrong."""


# GGUF metadata value types (gguf.GGUFValueType) with a fixed size: their struct format, little-endian.
_SCALAR_FORMATS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
_STRING, _ARRAY, _UINT32 = 8, 9, 4
_PLAIN_VERSIONS = (2, 3)
_DEFAULT_ALIGNMENT = 32  # gguf.GGUF_DEFAULT_ALIGNMENT


class _Cursor:
    """Little-endian reads from a buffer, front to back; running past its end raises _NotPlain."""

    def __init__(self, buf: Any) -> None:
        self.buf = buf
        self.pos = 0

    def unpack(self, fmt: str) -> Any:
        try:
            values = struct.unpack_from(fmt, self.buf, self.pos)
        except struct.error:
            raise _NotPlain("past the end of the file") from None
        self.pos += struct.calcsize(fmt)
        return values[0] if len(values) == 1 else values

    def string(self) -> str:
        n = self.unpack("<Q")
        end = self.pos + n
        if end > len(self.buf):
            raise _NotPlain("a string runs past the end of the file")
        try:
            text = str(self.buf[self.pos:end], "utf-8")
        except UnicodeDecodeError:
            raise _NotPlain("a string is not UTF-8") from None
        self.pos = end
        return text

    def value(self, vtype: int) -> Any:
        """One metadata value as `_plain(ReaderField.contents())` gives it: a Python scalar, str, or flat list."""
        fmt = _SCALAR_FORMATS.get(vtype)
        if fmt is not None:
            return self.unpack("<" + fmt)
        if vtype == _STRING:
            return self.string()
        if vtype != _ARRAY:
            raise _NotPlain(f"unknown value type {vtype}")
        itype, count = self.unpack("<IQ")
        if itype == _STRING:
            return [self.string() for _ in range(count)]
        fmt = _SCALAR_FORMATS.get(itype)
        if fmt is None:  # nested arrays (flattened by GGUFReader) or an unknown type
            raise _NotPlain(f"array of value type {itype}")
        dtype = np.dtype("<" + fmt if fmt != "?" else "?")
        if self.pos + count * dtype.itemsize > len(self.buf):
            raise _NotPlain("an array runs past the end of the file")
        items = np.frombuffer(self.buf, dtype=dtype, count=count, offset=self.pos).tolist()
        self.pos += count * dtype.itemsize
        return items


def _read_plain(path: Path) -> tuple[dict[str, Any], dict[str, TensorInfo]]:
    """The metadata and tensor table of a little-endian GGUF v2 / v3 file with flat metadata arrays: what
    `_read_with_gguf` returns for it, the same values, read in one pass. _NotPlain for any other file, and for
    anything GGUFReader would refuse (duplicate keys or tensor names, an unknown tensor type, a quantized row
    that is not whole blocks, a bad alignment), so that it reports those. A tensor whose data lies past the end
    of the file is returned as it is: `open_gguf` names it."""
    import gguf  # its tables of tensor types

    try:
        at = _Cursor(memoryview(np.memmap(path, dtype=np.uint8, mode="r")))
    except ValueError:  # an empty file: numpy maps none
        raise _NotPlain("an empty file") from None
    if at.unpack("<I") != gguf.GGUF_MAGIC:
        raise _NotPlain("no GGUF magic")
    if at.unpack("<I") not in _PLAIN_VERSIONS:
        raise _NotPlain("a version (or byte order) read by GGUFReader only")
    n_tensors, n_keys = at.unpack("<QQ")
    metadata: dict[str, Any] = {}
    types: dict[str, int] = {}
    for _ in range(n_keys):
        key = at.string()
        if key in metadata:
            raise _NotPlain(f"duplicate key {key!r}")
        types[key] = at.unpack("<I")
        metadata[key] = at.value(types[key])
    table = []
    for _ in range(n_tensors):
        name = at.string()
        n_dims = at.unpack("<I")
        dims = tuple(at.unpack("<Q") for _ in range(n_dims))
        qtype, offset = at.unpack("<IQ")
        table.append((name, dims, qtype, offset))
    alignment = _DEFAULT_ALIGNMENT
    if "general.alignment" in metadata:
        alignment = metadata["general.alignment"]
        if types["general.alignment"] != _UINT32 or alignment == 0 or alignment & (alignment - 1):
            raise _NotPlain("general.alignment is not a uint32 power of two")
    data_start = -(-at.pos // alignment) * alignment
    tensors: dict[str, TensorInfo] = {}
    for name, dims, qtype, offset in table:
        if name in tensors:
            raise _NotPlain(f"duplicate tensor {name!r}")
        try:
            block, type_bytes = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType(qtype)]
        except (ValueError, KeyError):
            raise _NotPlain(f"tensor {name!r} has an unknown type {qtype}") from None
        if block > 1 and dims and dims[0] % block:
            raise _NotPlain(f"tensor {name!r}: rows of {dims[0]} are not whole blocks of {block}")
        tensors[name] = TensorInfo(name=name, qtype=qtype, shape=dims, offset=data_start + offset,
                                   nbytes=math.prod(dims) * type_bytes // block)
    return metadata, tensors


def _read_header(path: Path, cache_file: Path | None = None) -> tuple[dict[str, Any], dict[str, TensorInfo]]:
    """The metadata and tensor table of a file no cache holds. A plain header is read here (`_read_plain`,
    ~0.1 s); any other by GGUFReader, which holds the GIL for seconds: in a child process when there is a cache
    file for it to fill (`_build_cache_in_subprocess`), here when there is none or the child failed (a
    malformed file, whose error GGUFReader reports)."""
    try:
        return _read_plain(path)
    except _NotPlain:
        pass
    if cache_file is not None:
        _build_cache_in_subprocess(path, cache_file)
        cached = _load_cache(cache_file)
        if cached is not None:
            return cached
    return _read_with_gguf(path)


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
    """GGUFReader is pure Python and holds the GIL for seconds on a large vocabulary; running it in a child
    process keeps the serving threads of this one responsive while a model loads. (A plain header takes ~0.1 s
    in this process, against ~0.3 s to start the child: `_read_header` only sends the others here.)"""
    subprocess.run([sys.executable, "-m", "pantheon.io.gguf_file", str(path), str(cache_file)],
                   capture_output=True, timeout=600, check=False)


def open_gguf(path: str | os.PathLike[str], cache_dir: Path | None = None) -> GGUFFile:
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"model file not found: {path}")
    identity = file_identity(path)
    cache_file = cache_dir / f"{identity}.gguf.json" if cache_dir else None
    cached = _load_cache(cache_file) if cache_file else None
    if cached is None:
        metadata, tensors = _read_header(path, cache_file)
        if cache_file is not None:
            _store_cache(cache_file, metadata, tensors)  # (after a child's read, the same file again)
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
