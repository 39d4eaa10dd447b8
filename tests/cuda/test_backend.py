"""CudaBackend against the Backend protocol and CpuBackend's semantics: every method exists, host ids are checked
the way the cpu backend checks them, weights stay in their GGUF format and are charged to the die manager."""

from __future__ import annotations

import inspect
from pathlib import Path

import gguf
import numpy as np
import pytest

from pantheon.io.gguf_file import open_gguf
from pantheon.kernels.backend import Backend
from pantheon.kernels.cpu.backend import CpuBackend
from pantheon.kernels.cuda.dies import DieInfo, DieManager

pytestmark = pytest.mark.cuda_kernels


def protocol_methods() -> list[str]:
    return [name for name, value in vars(Backend).items() if not name.startswith("_") and callable(value)]


def write_small(path: Path) -> Path:
    rng = np.random.default_rng(0)
    w = gguf.GGUFWriter(str(path), "llama")
    q8 = gguf.GGMLQuantizationType.Q8_0
    w.add_tensor("q8", gguf.quants.quantize(rng.standard_normal((4, 64)).astype(np.float32), q8), raw_dtype=q8)
    w.add_tensor("f32", rng.standard_normal((3, 5)).astype(np.float32))
    w.add_tensor("norm", rng.standard_normal(64).astype(np.float32))
    w.add_tensor("norm16", rng.standard_normal(64).astype(np.float16))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


@pytest.fixture(scope="module")
def backends():
    from pantheon.kernels.cuda.backend import CudaBackend

    return CudaBackend(), CpuBackend(int8=False)  # the cuda kernels compute in float32


def test_every_protocol_method_with_the_same_signature(backends):
    cuda_be, cpu_be = backends
    assert cuda_be.name == "cuda" and cuda_be.accelerator is True
    for name in protocol_methods():
        assert callable(getattr(cuda_be, name, None)), name
        want = list(inspect.signature(getattr(Backend, name)).parameters)[1:]
        got = list(inspect.signature(getattr(cuda_be, name)).parameters)
        assert got == want, f"{name}: {got} != {want}"


def test_weights_vectors_and_memory(backends, tmp_path):
    cuda_be, cpu_be = backends
    gguf_file = open_gguf(write_small(tmp_path / "small.gguf"))
    w = cuda_be.weight(gguf_file, "q8")
    assert (w.rows, w.cols, w.qtype) == (4, 64, 8)
    assert w.data.shape == (4, 68) and w.data.dtype == np.uint8  # raw blocks, not floats
    assert np.array_equal(cuda_be.to_host(w.data).reshape(-1), np.asarray(gguf_file.tensor_bytes("q8")))
    ids = np.array([3, 1], np.int64)
    assert np.array_equal(cuda_be.to_host(cuda_be.embed(w, ids)), cpu_be.embed(cpu_be.weight(gguf_file, "q8"), ids))
    x = np.random.default_rng(1).standard_normal((2, 64)).astype(np.float32)
    np.testing.assert_allclose(cuda_be.to_host(cuda_be.matmul(w, cuda_be.upload(x))),
                               cpu_be.matmul(cpu_be.weight(gguf_file, "q8"), x), rtol=1e-5, atol=1e-5)
    f32 = cuda_be.weight(gguf_file, "f32")
    np.testing.assert_allclose(cuda_be.to_host(cuda_be.embed(f32, np.array([2, 0]))),
                               cpu_be.embed(cpu_be.weight(gguf_file, "f32"), np.array([2, 0])))
    for name in ("norm", "norm16"):
        np.testing.assert_array_equal(cuda_be.to_host(cuda_be.vector(gguf_file, name)), cpu_be.vector(gguf_file, name))
    zeros = cuda_be.zeros((2, 3, 4))
    assert zeros.shape == (2, 3, 4) and not cuda_be.to_host(zeros).any()
    assert cuda_be.empty((5,), np.int32).dtype == np.int32
    host = np.arange(6, dtype=np.int64)
    assert np.array_equal(cuda_be.to_host(cuda_be.upload(host)), host)
    assert cuda_be.to_host(host) is host


def test_host_ids_are_checked_like_the_cpu_backend(backends, tmp_path):
    cuda_be, cpu_be = backends
    gguf_file = open_gguf(write_small(tmp_path / "small.gguf"))
    w = cuda_be.weight(gguf_file, "q8")
    with pytest.raises(IndexError):
        cuda_be.embed(w, np.array([4]))
    with pytest.raises(IndexError):
        cpu_be.embed(cpu_be.weight(gguf_file, "q8"), np.array([4]))
    pool = cuda_be.zeros((2, 4, 1, 8))
    q = cuda_be.upload(np.ones((1, 1, 8), np.float32))
    with pytest.raises(ValueError):
        cuda_be.attention_decode_batch(q, pool, pool, np.array([4], np.int32), 1.0, slot_ids=np.array([0], np.int32))
    with pytest.raises(ValueError):
        cuda_be.attention_decode_batch(q, pool, pool, np.array([0], np.int32), 1.0, slot_ids=np.array([2], np.int32))
    with pytest.raises(IndexError):
        cuda_be.kv_write(pool, np.array([0]), np.array([4]), cuda_be.upload(np.ones((1, 1, 8), np.float32)))
    with pytest.raises(ValueError):
        cuda_be.attention(q, pool, pool, 0, 4, 1.0)


def test_weights_are_charged_to_the_die(tmp_path):
    from pantheon.kernels.cuda.backend import CudaBackend

    gguf_file = open_gguf(write_small(tmp_path / "small.gguf"))
    manager = DieManager([DieInfo(0, "fake", 1000, 0)], reserve_bytes=400)
    backend = CudaBackend(die=0, die_manager=manager, owner="small")
    backend.weight(gguf_file, "q8")  # 4 rows x 68 bytes
    backend.weight(gguf_file, "q8")
    assert manager.owners(0) == {"small": 544}
    with pytest.raises(MemoryError):  # a third copy would pass the budget of 1000 - 400 bytes
        backend.weight(gguf_file, "q8")
    assert backend.die_status() == [{"die": 0, "card": 0, "vram_budget": 600, "vram_used": 544}]
    backend.close()
    assert manager.used(0) == 0


def test_device_out_of_memory_is_a_memory_error(backends, monkeypatch):
    cuda_be, _ = backends
    from pantheon.kernels.cuda import backend as backend_module

    class CudaAPIError(Exception):
        code = 2  # CUDA_ERROR_OUT_OF_MEMORY

    def failing(*args, **kwargs):
        raise CudaAPIError("cuMemAlloc failed")

    monkeypatch.setattr(backend_module.cuda, "device_array", failing)
    with pytest.raises(MemoryError):
        cuda_be.zeros((1 << 20,))


def test_copy_kv_rows_copies_a_slots_prefix_like_the_cpu_backend(backends):
    cuda_be, cpu_be = backends
    rng = np.random.default_rng(3)
    host = rng.standard_normal((3, 10, 2, 16)).astype(np.float32)
    cpu_pool = cpu_be.kv_pool(3, 10, 2, 16, np.float32)
    cpu_pool[...] = host
    cuda_pool = cuda_be.upload(host)
    for be, pool in ((cpu_be, cpu_pool), (cuda_be, cuda_pool)):
        be.copy_kv_rows(pool, 2, 0, 6)
        be.copy_kv_rows(pool, 0, 1, 0)  # nothing to copy
    expected = host.copy()
    expected[0, :6] = host[2, :6]
    np.testing.assert_array_equal(np.asarray(cpu_pool), expected)
    np.testing.assert_array_equal(cuda_be.to_host(cuda_pool), expected)
