"""Session blobs: one slot's sequence state, serialized so it can be restored bit for bit.

Layout (all integers little-endian):

    magic            8 bytes   b"PNSESS\\r\\n"
    format_version   u32       1
    header_length    u32       length of the JSON header that follows
    header           JSON      {"architecture", "dims" (the model's state geometry), "weights_version",
                                "n_tokens", "arrays": [{"name", "dtype", "shape"}, ...],
                                "checkpoints": [n, ...] (optional; positions of recurrent-state checkpoints),
                                "anchor": n (optional; where the last turn's history ended)}
    tokens           int32[n_tokens]
    arrays           each array's raw bytes, in header order (C order)
    checksum         32 bytes  BLAKE2b-256 over every byte above

The arrays are whatever the architecture's sequence state is: K and V of the first n_tokens positions for
each attention layer; conv and recurrent state for SSM layers (fixed size); for a recurrent model, also its
state at checkpoint positions (arrays named "checkpoint<j>.<name>"), which a resumed conversation needs:
that state cannot be rewound, and the next turn's prompt re-renders the last reply and leaves the blob's
tokens where that reply began. A restore checks, in order:
checksum, magic and version, architecture and dims, weights_version (a mismatch is the caller's 409), that
the tokens match the header and the request, and that every array has exactly the declared size and, if it
holds floats, only finite ones.
"""

from __future__ import annotations

import hashlib
import math
import struct
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import orjson

MAGIC = b"PNSESS\r\n"
FORMAT_VERSION = 1
_PREFIX = struct.Struct("<8sII")
_DIGEST_BYTES = 32


class BadBlob(ValueError):
    """The blob is not a valid snapshot for this model (HTTP 400 bad_session_blob)."""


class WeightsMismatch(ValueError):
    """The blob was captured under other weights (HTTP 409 weights_version_mismatch)."""


@dataclass
class Snapshot:
    architecture: str
    dims: dict[str, Any]
    weights_version: int
    tokens: list[int]
    arrays: list[tuple[str, np.ndarray]]
    checkpoints: list[int] = field(default_factory=list)  # token counts of the recurrent checkpoints, ascending
    # How much of the tokens a prompt must repeat to continue this conversation (the last turn's history end);
    # None: unknown (blobs that predate it).
    anchor: int | None = None


def _digest(data: bytes | memoryview) -> bytes:
    return hashlib.blake2b(data, digest_size=_DIGEST_BYTES).digest()


def encode(snapshot: Snapshot) -> bytes:
    header = {
        "architecture": snapshot.architecture,
        "dims": snapshot.dims,
        "weights_version": snapshot.weights_version,
        "n_tokens": len(snapshot.tokens),
        "arrays": [{"name": n, "dtype": a.dtype.str, "shape": list(a.shape)} for n, a in snapshot.arrays],
    }
    if snapshot.checkpoints:
        header["checkpoints"] = list(snapshot.checkpoints)
    if snapshot.anchor is not None:
        header["anchor"] = snapshot.anchor
    header_bytes = orjson.dumps(header)
    parts = [_PREFIX.pack(MAGIC, FORMAT_VERSION, len(header_bytes)), header_bytes,
             np.asarray(snapshot.tokens, dtype="<i4").tobytes()]
    parts.extend(np.ascontiguousarray(a).tobytes() for _, a in snapshot.arrays)
    body = b"".join(parts)
    return body + _digest(body)


def _array_spec(spec: Any) -> tuple[str, np.dtype, tuple[int, ...]]:
    """(name, dtype, shape) of a header's array entry. The checksum has no key, so the header may be forged:
    only plain numeric dtypes and non-negative integer dimensions pass (BadBlob otherwise)."""
    try:
        name = str(spec["name"])
        dtype = np.dtype(spec["dtype"])
        shape = tuple(spec["shape"])
    except (KeyError, TypeError, ValueError):
        raise BadBlob("blob header has a malformed array entry") from None
    if dtype.kind not in "biuf" or dtype.itemsize == 0 or dtype.fields is not None or dtype.subdtype is not None:
        raise BadBlob(f"array {name} has an unsupported dtype {spec['dtype']!r}")
    if not all(type(d) is int and d >= 0 for d in shape):
        raise BadBlob(f"array {name} has a dimension that is not a non-negative integer")
    return name, dtype, shape


def in_precision(snap: Snapshot, dtype: np.dtype) -> Snapshot:
    """`snap` with its float arrays in `dtype`, the precision the model keeps its state in (a blob saved from
    float32 state restores into float16, as that prefill would have rounded it). A value finite in the blob
    but past `dtype`'s range (1e6 into float16) would become inf there, and a NaN the step after: BadBlob."""
    arrays = []
    for name, array in snap.arrays:
        if array.dtype.kind == "f" and array.dtype != dtype:
            with np.errstate(over="ignore"):
                array = array.astype(dtype)
            if not np.isfinite(array).all():
                raise BadBlob(f"array {name} holds values past the range of this model's {dtype} state")
        arrays.append((name, array))
    snap.arrays = arrays
    return snap


def decode(blob: bytes, *, architecture: str, dims: dict[str, Any], weights_version: int) -> Snapshot:
    if len(blob) < _PREFIX.size + _DIGEST_BYTES:
        raise BadBlob("blob is truncated (shorter than its fixed header)")
    body, digest = memoryview(blob)[:-_DIGEST_BYTES], blob[-_DIGEST_BYTES:]
    if _digest(body) != digest:
        raise BadBlob("blob checksum does not match (corrupt or truncated)")
    magic, version, header_len = _PREFIX.unpack_from(blob, 0)
    if magic != MAGIC:
        raise BadBlob("not a Pantheon session blob (bad magic)")
    if version != FORMAT_VERSION:
        raise BadBlob(f"unsupported blob format version {version} (this server reads {FORMAT_VERSION})")
    offset = _PREFIX.size
    try:
        header = orjson.loads(bytes(body[offset : offset + header_len]))
    except orjson.JSONDecodeError:
        raise BadBlob("blob header is not valid JSON") from None
    offset += header_len
    if not isinstance(header, dict):
        raise BadBlob("blob header is not an object")
    if header.get("architecture") != architecture:
        raise BadBlob(f"blob is for architecture {header.get('architecture')!r}, this model is {architecture!r}")
    if header.get("dims") != dims:
        raise BadBlob(f"blob state geometry {header.get('dims')} does not fit this model {dims}")
    if header.get("weights_version") != weights_version:
        raise WeightsMismatch(f"blob was captured under weights_version {header.get('weights_version')}, "
                              f"this model has {weights_version}")
    n_tokens = header.get("n_tokens")
    if not isinstance(n_tokens, int) or n_tokens < 0:
        raise BadBlob("blob header has no valid n_tokens")
    end = offset + 4 * n_tokens
    if end > len(body):
        raise BadBlob("blob is shorter than its token list")
    tokens = np.frombuffer(body[offset:end], dtype="<i4").tolist()
    offset = end
    specs = header.get("arrays", [])
    if not isinstance(specs, list):
        raise BadBlob("blob header's arrays is not a list")
    arrays: list[tuple[str, np.ndarray]] = []
    for spec in specs:
        name, dtype, shape = _array_spec(spec)
        # Python integers: a forged shape cannot overflow into a small (or negative) byte count.
        nbytes = math.prod(shape) * dtype.itemsize
        if offset + nbytes > len(body):
            raise BadBlob(f"blob is truncated inside array {name}")
        array = np.frombuffer(body[offset : offset + nbytes], dtype=dtype).reshape(shape)
        # Whoever can edit a blob can recompute its checksum: a NaN or inf in a session's state would make every
        # later turn of it sample from NaN logits (a 500 for its turns and for rows batched with them).
        if dtype.kind == "f" and not np.isfinite(array).all():
            raise BadBlob(f"array {name} holds values that are not finite")
        arrays.append((name, array))
        offset += nbytes
    if offset != len(body):
        raise BadBlob(f"blob has {len(body) - offset} unexpected trailing bytes")
    checkpoints = header.get("checkpoints", [])
    if not (isinstance(checkpoints, list) and all(type(c) is int and 0 < c <= n_tokens for c in checkpoints)
            and checkpoints == sorted(set(checkpoints))):
        raise BadBlob("blob header's checkpoints are not ascending positions within its tokens")
    anchor = header.get("anchor")
    if anchor is not None and not (type(anchor) is int and 0 <= anchor <= n_tokens):
        raise BadBlob("blob header's anchor is not a position within its tokens")
    return Snapshot(architecture, dims, weights_version, tokens, arrays, checkpoints, anchor)
