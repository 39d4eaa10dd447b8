"""bench/weights_in_cache.py: its swaps put layer 0's matrices in every layer of the compiled decode step's plan, or
an alias of the output matrix whose pages all map its first bytes, so the step computes with them, and put the real
ones back, so the step computes what it did before."""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import pytest

from bench.weights_in_cache import CACHED, REAL, LayerSwap, OutputSwap, alias_bytes_for, aliased_like
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


def test_the_alias_repeats_the_first_bytes_over_the_whole_shape_and_shares_them() -> None:
    real = (np.arange(3 * 4096 + 40, dtype=np.int64) * 7919 % 251).astype(np.uint8).reshape(-1, 4)
    assert alias_bytes_for(real, 1) == 4096 and alias_bytes_for(np.zeros((3000, 12), np.uint8), 4097) == 12288
    alias = aliased_like(real, 4096)
    assert alias.shape == real.shape and alias.dtype == real.dtype and alias.flags.c_contiguous
    flat = alias.reshape(-1)
    for start in range(0, real.nbytes, 4096):
        end = min(start + 4096, real.nbytes)
        np.testing.assert_array_equal(flat[start:end], real.reshape(-1)[:end - start])
    flat[5] = 255 - flat[5]  # one buffer behind every page
    assert flat[4096 + 5] == flat[5] == flat[2 * 4096 + 5]
    with pytest.raises(ValueError):
        aliased_like(real, 1000)  # not whole pages
    with pytest.raises(ValueError):
        aliased_like(np.zeros((3000, 12), np.uint8), 4096)  # not whole rows


def test_the_output_swap_reads_the_alias_and_puts_the_real_matrix_back(tmp_path: Path) -> None:
    path = write_tiny_llama(tmp_path / "tiny.gguf", n_layers=2, d=64, heads=4, kv_heads=2, ffn=128, ctx=256,
                            qtype=gguf.GGMLQuantizationType.Q4_1)
    model = load_model(open_gguf(path, None), CpuBackend(2, int8=True))
    plan = model._decode_plan
    assert plan is not None and plan.ends is not None
    prompts = [np.arange(9, dtype=np.int32) % 200, (np.arange(23, dtype=np.int32) * 7) % 200]
    real = _decode_logits(model, prompts, 17)
    real_matrix = plan.ends.out_packed

    swap = OutputSwap(plan, 4096)
    assert real_matrix.nbytes > 2 * swap.alias_bytes
    swap.use(CACHED)
    assert plan.ends.out_packed is not real_matrix and plan.ends.out_packed.shape == real_matrix.shape
    cached = _decode_logits(model, prompts, 17)
    assert np.isfinite(cached).all()
    n_groups, group_bytes = real_matrix.shape  # groups of output rows, one after another
    first_rows = swap.alias_bytes // group_bytes * (plan.ends.out_rows // n_groups)  # rows in the first alias
    assert first_rows > 0
    np.testing.assert_array_equal(cached[:, :first_rows], real[:, :first_rows])
    assert not np.array_equal(cached, real)  # later rows read the first page's bytes again

    swap.use(REAL)
    assert plan.ends.out_packed is real_matrix
    np.testing.assert_array_equal(_decode_logits(model, prompts, 17), real)
