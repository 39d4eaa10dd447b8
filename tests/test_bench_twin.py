"""bench/twin.py: a skeleton (metadata + tensor list) rebuilds into a model with the same metadata, tensor names,
shapes and types, whose random weights give finite logits; it is what bench/gpu_check.py serves on a GPU machine
that cannot carry the default model."""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import pytest

from bench.twin import build_twin, write_skeleton
from pantheon.io.gguf_file import open_gguf
from pantheon.kernels.cpu.backend import CpuBackend
from pantheon.models.base import BatchRow
from pantheon.models.registry import load_model
from tests.tiny_models import write_tiny_llama

pytestmark = pytest.mark.slow


def test_a_twin_has_the_models_shapes_metadata_and_finite_logits(tmp_path: Path) -> None:
    model = write_tiny_llama(tmp_path / "tiny.gguf", qtype=gguf.GGMLQuantizationType.Q4_1)
    skeleton = tmp_path / "skeleton.gguf"
    write_skeleton(model, skeleton)
    assert skeleton.stat().st_size < model.stat().st_size
    twin = build_twin(skeleton, tmp_path / "twin.gguf")

    original, copy = gguf.GGUFReader(str(model)), gguf.GGUFReader(str(twin))
    assert [(t.name, list(t.shape), t.tensor_type) for t in original.tensors] == \
           [(t.name, list(t.shape), t.tensor_type) for t in copy.tensors]
    for key in ("general.architecture", "llama.embedding_length", "tokenizer.ggml.tokens", "tokenizer.chat_template"):
        assert copy.fields[key].contents() == original.fields[key].contents()
    assert "pantheon.twin.tensors" not in copy.fields
    by_name = {t.name: np.asarray(t.data) for t in original.tensors}
    twin_up = next(np.asarray(t.data) for t in copy.tensors if t.name == "blk.0.ffn_up.weight")
    assert not np.array_equal(twin_up, by_name["blk.0.ffn_up.weight"])  # new weights, not a copy

    be = CpuBackend()
    twin_model = load_model(open_gguf(twin, tmp_path / "cache"), be)
    logits = twin_model.forward(twin_model.new_state(1, 32), [BatchRow(0, np.arange(5, 21, dtype=np.int32), 0)])
    assert np.isfinite(logits).all() and float(np.std(logits)) > 0.01


def test_types_without_a_generator_are_refused(tmp_path: Path) -> None:
    model = write_tiny_llama(tmp_path / "tiny.gguf", qtype=gguf.GGMLQuantizationType.Q5_0)
    skeleton = tmp_path / "skeleton.gguf"
    write_skeleton(model, skeleton)
    with pytest.raises(ValueError, match="no twin generator"):
        build_twin(skeleton, tmp_path / "twin.gguf")
