"""GGUF loading: metadata and tensor views, the derived-data cache, and load errors that name the problem."""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import pytest

from pantheon.errors import ModelLoadError
from pantheon.io.gguf_file import open_gguf


def write_gguf(path: Path, *, arch: str = "llama", tensors: dict[str, np.ndarray] | None = None,
               raw: dict[str, tuple[np.ndarray, gguf.GGMLQuantizationType]] | None = None) -> Path:
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(1)
    w.add_string("general.name", "tiny")
    for name, arr in (tensors or {}).items():
        w.add_tensor(name, arr)
    for name, (data, qtype) in (raw or {}).items():
        w.add_tensor(name, data, raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def test_metadata_and_tensor_views(tmp_path: Path) -> None:
    a = np.arange(64 * 3, dtype=np.float32).reshape(3, 64)
    q = gguf.quants.quantize(np.linspace(-1, 1, 4 * 64, dtype=np.float32).reshape(4, 64), gguf.GGMLQuantizationType.Q8_0)
    path = write_gguf(tmp_path / "t.gguf", tensors={"a": a}, raw={"q": (q, gguf.GGMLQuantizationType.Q8_0)})
    f = open_gguf(path, tmp_path / "cache")
    assert f.architecture == "llama"
    assert f.metadata["llama.block_count"] == 1 and f.metadata["general.name"] == "tiny"
    ta = f.tensors["a"]
    assert (ta.shape, ta.rows, ta.cols, ta.qtype) == ((64, 3), 3, 64, 0)
    assert np.array_equal(f.tensor_bytes("a").view(np.float32).reshape(3, 64), a)
    tq = f.tensors["q"]
    assert tq.qtype == int(gguf.GGMLQuantizationType.Q8_0) and tq.nbytes == 4 * 2 * 34
    assert np.array_equal(f.tensor_bytes("q"), q.reshape(-1))


def test_cache_hit_gives_the_same_result_without_gguf_reader(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = write_gguf(tmp_path / "t.gguf", tensors={"a": np.ones((2, 32), np.float32)})
    first = open_gguf(path, tmp_path / "cache")

    def boom(*a: object, **k: object) -> None:
        raise AssertionError("GGUFReader must not run on a cache hit")

    monkeypatch.setattr(gguf, "GGUFReader", boom)
    second = open_gguf(path, tmp_path / "cache")
    assert second.metadata == first.metadata and second.tensors == first.tensors


def test_missing_file(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError):
        open_gguf(tmp_path / "nope.gguf")


def test_not_a_gguf(tmp_path: Path) -> None:
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"NOPE" + b"\0" * 100)
    with pytest.raises(ModelLoadError, match="not a readable GGUF"):
        open_gguf(bad)


def test_truncated_file_names_the_tensor(tmp_path: Path) -> None:
    path = write_gguf(tmp_path / "t.gguf", tensors={"big": np.ones((64, 64), np.float32)})
    data = path.read_bytes()
    path.write_bytes(data[: len(data) - 1000])
    with pytest.raises(ModelLoadError, match="big|truncated|not a readable"):
        open_gguf(path)
