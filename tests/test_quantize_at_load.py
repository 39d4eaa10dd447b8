"""`quantize: true` / --quantize: float matrices become Q8_0 at load and the model still computes the same."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from pantheon.config import ModelOptions, read_env
from pantheon.engine.loader import load_served_model
from pantheon.kernels.cpu.backend import CpuBackend
from pantheon.models.base import BatchRow
from tests.tiny_models import write_tiny_llama

pytestmark = pytest.mark.slow


def test_float_weights_are_quantized_and_logits_agree(tmp_path: Path, default_model_path: Path) -> None:
    path = write_tiny_llama(tmp_path / "tiny.gguf")
    env = read_env({"PANTHEON_HOME": str(tmp_path)})
    plain = load_served_model(ModelOptions(path=path, name="plain"), env, CpuBackend())
    quant = load_served_model(ModelOptions(path=path, name="q", quantize=True), env, CpuBackend())
    assert plain.model.blocks[0].wq.qtype == 0 and quant.model.blocks[0].wq.qtype == 8
    assert quant.model.blocks[0].wq.data.nbytes < plain.model.blocks[0].wq.data.nbytes / 3
    tokens = np.array(plain.tokenizer.encode("Hello there, how are you today?"), np.int32)
    a = plain.model.forward(plain.model.new_state(1, 64), [BatchRow(0, tokens, 0, "all")])
    b = quant.model.forward(quant.model.new_state(1, 64), [BatchRow(0, tokens, 0, "all")])
    cos = (a * b).sum(1) / np.linalg.norm(a, axis=1) / np.linalg.norm(b, axis=1)
    assert cos.min() > 0.999


def test_quantized_weights_have_their_own_weights_version(tmp_path: Path, default_model_path: Path) -> None:
    """A session blob carries the weights version it was captured under: quantizing at load changes the
    weights, so it changes the version (a blob from the float model gets 409 on the quantized one). A file
    with nothing to quantize keeps its version."""
    path = write_tiny_llama(tmp_path / "tiny.gguf")
    env = read_env({"PANTHEON_HOME": str(tmp_path)})
    plain = load_served_model(ModelOptions(path=path, name="plain"), env, CpuBackend())
    quant = load_served_model(ModelOptions(path=path, name="q", quantize=True), env, CpuBackend())
    assert plain.weights_version != quant.weights_version
    again = load_served_model(ModelOptions(path=path, name="q2", quantize=True), env, CpuBackend())
    assert again.weights_version == quant.weights_version
    default_q = load_served_model(ModelOptions(path=default_model_path, name="dq", quantize=True), env, CpuBackend())
    default = load_served_model(ModelOptions(path=default_model_path, name="d"), env, CpuBackend())
    assert default_q.weights_version == default.weights_version


def test_hybrid_models_are_quantized_too(tmp_path: Path) -> None:
    """The hybrids compute with float activations (`without_int8`) on the int8-path backend; `quantize: true`
    must still reach their loader: the fixture's float matrices become Q8_0, and the logits stay close."""
    fixture = Path(__file__).parent / "fixtures" / "qwen35" / "qwen35.gguf"
    env = read_env({"PANTHEON_HOME": str(tmp_path)})
    backend = CpuBackend(int8=True)
    plain = load_served_model(ModelOptions(path=fixture, name="plain"), env, backend)
    quant = load_served_model(ModelOptions(path=fixture, name="q", quantize=True), env, backend)
    assert plain.model.output.qtype == 0 and quant.model.output.qtype == 8
    assert quant.weights_version != plain.weights_version
    tokens = np.array([5, 17, 3, 99, 42, 7], np.int32)
    a = plain.model.forward(plain.model.new_state(1, 64), [BatchRow(0, tokens, 0, "all")])
    b = quant.model.forward(quant.model.new_state(1, 64), [BatchRow(0, tokens, 0, "all")])
    assert not np.array_equal(a, b)
    cos = (a * b).sum(1) / np.linalg.norm(a, axis=1) / np.linalg.norm(b, axis=1)
    assert cos.min() > 0.99  # random weights: Q8_0's error shows more than in a trained model


def test_a_file_with_nothing_to_quantize_keeps_its_compiled_decode_path(tmp_path: Path,
                                                                        default_model_path: Path) -> None:
    """`quantize: true` on an already quantized file (the default model) changes nothing: the same stacked
    matrices and compiled decode step (seen over HTTP: it had lost them, decoding through the per-op path), and
    the same logits bit for bit."""
    env = read_env({"PANTHEON_HOME": str(tmp_path)})
    plain = load_served_model(ModelOptions(path=default_model_path, name="d"), env, CpuBackend(2))
    quant = load_served_model(ModelOptions(path=default_model_path, name="dq", quantize=True), env, CpuBackend(2))
    assert (quant.model._decode_plan is None) == (plain.model._decode_plan is None)
    assert (quant.model.blocks[0].w_qkv is None) == (plain.model.blocks[0].w_qkv is None)
    tokens = np.array(plain.tokenizer.encode("Hello there, how are you today?"), np.int32)
    logits = []
    for served in (plain, quant):
        state = served.model.new_state(2, 64)
        rows = [BatchRow(0, tokens, 0), BatchRow(1, tokens[:5], 0)]
        first = served.model.forward(state, rows)
        step = served.model.forward(state, [BatchRow(0, np.array([7], np.int32), len(tokens)),
                                            BatchRow(1, np.array([9], np.int32), 5)])
        logits.append((first, step))
    np.testing.assert_array_equal(logits[0][0], logits[1][0])
    np.testing.assert_array_equal(logits[0][1], logits[1][1])
