"""A whole tiny Qwen3.5-MoE hybrid on CudaBackend gives CpuBackend's logits (under the simulator or on a GPU):
two slots prefilling in one step (the chunked delta rule, two slots' conv states, routed experts over a batch),
then both decoding together (the recurrent form) through the decode step's graph slots (hybrid_step.py), which
the replaying capture layer (tests/cuda/replaying_capture.py) captures at the second step and replays at the
third, with new tokens and positions.

The model is tests/fixtures/qwen35/qwen35moe.gguf (8 layers, 6 DeltaNet + 2 gated attention, 6 experts with
top-2 and a shared expert; see tests/test_qwen35.py for how it matches transformers on the cpu backend).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from pantheon.io.gguf_file import open_gguf
from pantheon.kernels.cpu.backend import CpuBackend
from pantheon.models.base import BatchRow
from pantheon.models.registry import load_model
from tests.cuda.replaying_capture import ReplayingCapture
from tests.cuda.test_llama_forward import assert_logits_close

pytestmark = [pytest.mark.cuda_kernels, pytest.mark.slow]

FIXTURE = Path(__file__).resolve().parents[1] / "fixtures" / "qwen35" / "qwen35moe.gguf"


def test_tiny_qwen35moe_matches_cpu() -> None:
    from pantheon.kernels.cuda.backend import CudaBackend

    gguf_file = open_gguf(FIXTURE, None)
    capture = ReplayingCapture()
    models = [load_model(gguf_file, CpuBackend(int8=False)), load_model(gguf_file, CudaBackend(capture=capture))]
    config = models[0].config
    assert config.recurrent.count(True) > 0 and config.n_experts > 1
    states = [m.new_state(2, 32) for m in models]

    def step(batch: list[BatchRow]) -> np.ndarray:
        cpu, gpu = (m.forward(s, batch) for m, s in zip(models, states))
        assert_logits_close(np.asarray(models[1].backend.to_host(gpu)), cpu)
        return cpu

    # Two prefills in one step (the chunked delta rule, each slot's conv state), then both slots decode together
    # (the recurrent form), in reverse slot order: a warm-up step, the capture, a replay.
    logits = step([BatchRow(slot=0, tokens=np.array([5, 17, 99], np.int32), start_pos=0),
                   BatchRow(slot=1, tokens=np.array([42, 8], np.int32), start_pos=0)])
    tokens, pos = [int(np.argmax(logits[0])), int(np.argmax(logits[1]))], [3, 2]
    for _ in range(3):
        logits = step([BatchRow(slot=s, tokens=np.array([tokens[s]], np.int32), start_pos=pos[s]) for s in (1, 0)])
        tokens, pos = [int(np.argmax(logits[1])), int(np.argmax(logits[0]))], [pos[0] + 1, pos[1] + 1]
    n_layers, n_ssm = config.n_layers, config.recurrent.count(True)
    counters = models[1].backend.graphs.counters()
    assert counters is not None
    assert (counters["live"], counters["total"], counters["captures"], counters["failed"]) == (n_layers,) * 3 + (0,)
    assert counters["batched_ssm"]["live"] == n_ssm and counters["batched_attn"]["live"] == n_layers - n_ssm
    assert capture.replays == n_layers
