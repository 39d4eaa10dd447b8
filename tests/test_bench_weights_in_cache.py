"""bench/weights_in_cache.py: its swap puts layer 0's matrices in every layer of the compiled decode step's plan, so
the step computes with them, and puts the real ones back, so the step computes what it did before."""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import pytest

from bench.weights_in_cache import CACHED, REAL, LayerSwap
from pantheon.io.gguf_file import open_gguf
from pantheon.kernels.cpu import int8dot
from pantheon.kernels.cpu.backend import CpuBackend
from pantheon.models.base import BatchRow
from pantheon.models.registry import load_model
from tests.tiny_models import write_tiny_llama

pytestmark = [pytest.mark.slow, pytest.mark.skipif(int8dot.INT8_ISA is None, reason="no int8 kernels on this CPU")]


def _decode_logits(model, prompts: list[np.ndarray], token: int) -> np.ndarray:  # type: ignore[no-untyped-def]
    state = model.new_state(len(prompts), 64)
    for slot, prompt in enumerate(prompts):
        model.forward(state, [BatchRow(slot, prompt, 0)])
    return model.forward(state, [BatchRow(slot, np.array([token], dtype=np.int32), len(prompt))
                                 for slot, prompt in enumerate(prompts)])


def test_the_swap_runs_every_layer_on_layer_0s_matrices_and_puts_the_real_ones_back(tmp_path: Path) -> None:
    # Two kv heads, as tests/test_bench_phase_profile.py: the compiled step the other tests use.
    path = write_tiny_llama(tmp_path / "tiny.gguf", n_layers=2, d=64, heads=4, kv_heads=2, ffn=128, ctx=256,
                            qtype=gguf.GGMLQuantizationType.Q4_1)
    model = load_model(open_gguf(path, None), CpuBackend(2, int8=True))
    plan = model._decode_plan
    assert plan is not None and plan.ends is not None  # the whole step is the compiled one the bench times
    prompts = [np.arange(9, dtype=np.int32) % 200, (np.arange(23, dtype=np.int32) * 7) % 200]
    real = _decode_logits(model, prompts, 17)

    swap = LayerSwap(plan)
    swap.use(CACHED)
    for column in plan.weights:
        assert all(column[li].ctypes.data == column[0].ctypes.data for li in range(len(column)))
    cached = _decode_logits(model, prompts, 17)
    assert np.isfinite(cached).all()
    assert not np.array_equal(cached, real)  # layer 1 computed with layer 0's matrices

    swap.use(REAL)
    assert plan.weights[0][1].ctypes.data != plan.weights[0][0].ctypes.data
    np.testing.assert_array_equal(_decode_logits(model, prompts, 17), real)
