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


def _typed(value: object) -> object:
    """value with each scalar's type beside it (True == 1 in Python, and a float 1.0 == 1)."""
    if isinstance(value, list):
        return [_typed(v) for v in value]
    return (type(value).__name__, value)


def _write_every_kind(path: Path, endianess: gguf.GGUFEndian = gguf.GGUFEndian.LITTLE,
                      nested: bool = False) -> Path:
    """A GGUF file with a value of every metadata type, arrays of each, and float and quantized tensors (the
    float32 one is 0 .. 191 in order)."""
    V = gguf.GGUFValueType
    w = gguf.GGUFWriter(str(path), "llama", endianess=endianess)
    w.add_custom_alignment(64)
    scalars = {V.UINT8: 250, V.INT8: -7, V.UINT16: 65000, V.INT16: -30000, V.UINT32: 4_000_000_000,
               V.INT32: -2_000_000_000, V.UINT64: 2**63 + 5, V.INT64: -(2**62), V.FLOAT32: 0.1, V.FLOAT64: 0.1,
               V.BOOL: True}
    for vtype, value in scalars.items():
        w.add_key_value(f"t.scalar.{vtype.name.lower()}", value, vtype)
        w.add_key_value(f"t.array.{vtype.name.lower()}", [value, value, value], V.ARRAY, sub_type=vtype)
    w.add_key_value("t.bool.false", False, V.BOOL)
    w.add_string("t.string", "héllo ✓ 𝄞")
    w.add_string("t.empty_string", "")
    w.add_array("t.strings", ["a", "", "ünï", "<|im_end|>"])
    if nested:
        w.add_array("t.nested", [[1, 2], [3, 4]])
    rng = np.random.default_rng(0)
    w.add_tensor("f32", np.arange(3 * 64, dtype=np.float32).reshape(3, 64))
    w.add_tensor("f16", rng.standard_normal((2, 5, 32)).astype(np.float16))
    for qtype in (gguf.GGMLQuantizationType.Q8_0, gguf.GGMLQuantizationType.Q4_1):
        q = gguf.quants.quantize(rng.standard_normal((4, 64)).astype(np.float32), qtype)
        w.add_tensor(qtype.name.lower(), q, raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def test_plain_reader_gives_what_gguf_reader_gives(tmp_path: Path, default_model_path: Path) -> None:
    """`_read_plain` (struct, one pass) and GGUFReader agree on every metadata value, with its Python type, and
    on the tensor table: every value type, arrays of each, strings beyond ASCII, an empty one, an alignment of
    64, float and quantized tensors; and the default model (its 49k-token vocabulary and merges)."""
    from pantheon.io.gguf_file import _read_plain, _read_with_gguf

    for path in (_write_every_kind(tmp_path / "every.gguf"), default_model_path):
        plain_meta, plain_tensors = _read_plain(path)
        want_meta, want_tensors = _read_with_gguf(path)
        assert list(plain_meta) == list(want_meta)
        for key in want_meta:
            assert _typed(plain_meta[key]) == _typed(want_meta[key]), key
        assert plain_tensors == want_tensors
    assert plain_meta["general.architecture"] == "llama" and len(plain_meta["tokenizer.ggml.tokens"]) == 49152


def test_files_the_plain_reader_leaves_to_gguf_reader(tmp_path: Path) -> None:
    """A big-endian file and nested arrays are GGUFReader's to read; open_gguf gives its result for them."""
    from pantheon.io.gguf_file import _NotPlain, _read_header, _read_plain, _read_with_gguf

    for path in (_write_every_kind(tmp_path / "big.gguf", endianess=gguf.GGUFEndian.BIG),
                 _write_every_kind(tmp_path / "nested.gguf", nested=True)):
        with pytest.raises(_NotPlain):
            _read_plain(path)
        assert _read_header(path) == _read_with_gguf(path)
        assert open_gguf(path).metadata == _read_with_gguf(path)[0]


def test_a_plain_file_opens_without_gguf_reader(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = _write_every_kind(tmp_path / "every.gguf")

    def boom(*a: object, **k: object) -> None:
        raise AssertionError("GGUFReader must not run on a plain file")

    monkeypatch.setattr(gguf, "GGUFReader", boom)
    f = open_gguf(path)
    assert f.metadata["t.string"] == "héllo ✓ 𝄞" and f.metadata["t.array.bool"] == [True, True, True]
    t = f.tensors["f32"]
    assert t.shape == (64, 3) and t.offset % 64 == 0
    assert np.array_equal(f.tensor_bytes("f32").view(np.float32), np.arange(3 * 64, dtype=np.float32))


def test_only_headers_gguf_reader_reads_go_to_the_child_process(tmp_path: Path,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """With a cache to fill, a plain header is read in this process (~0.1 s, against ~0.3 s to start a child);
    a big-endian one goes to the child (GGUFReader's seconds off this process's GIL), which fills the cache."""
    from pantheon.io import gguf_file

    children = []
    real_child = gguf_file._build_cache_in_subprocess
    monkeypatch.setattr(gguf_file, "_build_cache_in_subprocess",
                        lambda path, cache_file: (children.append(path), real_child(path, cache_file)))
    plain = _write_every_kind(tmp_path / "every.gguf")
    assert open_gguf(plain, tmp_path / "cache").metadata == gguf_file._read_with_gguf(plain)[0]
    assert children == []
    big = _write_every_kind(tmp_path / "big.gguf", endianess=gguf.GGUFEndian.BIG)
    assert open_gguf(big, tmp_path / "cache").metadata == gguf_file._read_with_gguf(big)[0]
    assert children == [big]
    assert len(list((tmp_path / "cache").glob("*.gguf.json"))) == 2
