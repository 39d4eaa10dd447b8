"""Run by tests/kernels/test_cache_consistency.py in a child process: every cpu op once on fixed inputs, then
one line of output hashes. Run twice against one NUMBA_CACHE_DIR, the first run compiles every kernel and the
second loads them from the cache: the lines must be equal."""

from __future__ import annotations

import hashlib

import numpy as np

from pantheon.kernels.cpu import int8dot, ops, quant
from pantheon.kernels.reference import quant as reference


def digest(a: np.ndarray) -> str:
    return hashlib.blake2b(np.ascontiguousarray(a).tobytes(), digest_size=6).hexdigest()


def main() -> None:
    rng = np.random.default_rng(0)
    x = rng.standard_normal((40, 576)).astype(np.float32)
    w = rng.standard_normal(576).astype(np.float32)
    out = {"rmsnorm": digest(ops.rmsnorm(x, w, 1e-5))}
    residual, normed = x.copy(), np.empty_like(x)
    ops.add_rmsnorm(residual, x * 0.5, w, 1e-5, normed)
    out["add_rmsnorm"] = digest(normed) + digest(residual)
    gate, up = rng.standard_normal((2, 40, 1536)).astype(np.float32)
    out["swiglu"] = digest(ops.swiglu(gate, up))
    q = rng.standard_normal((40, 9, 64)).astype(np.float32)
    k, v = rng.standard_normal((2, 64, 3, 64)).astype(np.float32)
    out["attention"] = digest(ops.attention(q, k, v, 0, 0.125))
    for n in (40, 3):  # the parallel and the serial rope kernels
        rotated = q[:n].copy()
        ops.rope_inplace(rotated, np.arange(100, 100 + n, dtype=np.int32), 64, 10000.0, False)
        out[f"rope{n}"] = digest(rotated)
    for qtype in (3, 8, 12):  # Q4_1, Q8_0, Q4_K
        weight = quant.prepare_weight(reference.random_weight_bytes(qtype, 64, 768, rng), qtype, 64, 768)
        xs = rng.standard_normal((9, 768)).astype(np.float32)
        out[f"matmul{qtype}"] = digest(quant.matmul(weight, xs))
        if int8dot.INT8_ISA is not None and qtype in int8dot.INT8_TYPES:
            out[f"int8_{qtype}"] = digest(quant.matmul(weight, xs, int8=True))
    print(" ".join(f"{name}={value}" for name, value in out.items()))


if __name__ == "__main__":
    main()
