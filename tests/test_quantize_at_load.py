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
