"""The llama decode step on the cuda backend through its graph slots (pantheon/kernels/cuda/decode_step.py), on
the simulator with a capture layer that replays: each layer is captured once per batch size and replayed in
later steps with new tokens, slots and positions, and the logits stay the cpu backend's. A layer whose KV ring
is in host memory stays ineligible until the ring is back on the die, then is captured too.

The simulator cannot capture kernel launches: `ReplayingCapture` (see its module) runs the captured body again
at each replay, so a body that bound anything of the step it was captured in would give wrong logits.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from tests.cuda.replaying_capture import ReplayingCapture
from tests.cuda.test_llama_forward import CTX, assert_logits_close, write_model
from tests.cuda.test_residency import Clock

pytestmark = [pytest.mark.cuda_kernels, pytest.mark.slow]


def test_decode_layers_replay_as_graphs_with_the_cpu_logits(tmp_path: Path) -> None:
    from pantheon.io.gguf_file import open_gguf
    from pantheon.kernels.cpu.backend import CpuBackend
    from pantheon.kernels.cuda.backend import CudaBackend
    from pantheon.kernels.cuda.decode_step import HOST_RING
    from pantheon.kernels.cuda.dies import DieInfo, DieManager
    from pantheon.models.base import BatchRow
    from pantheon.models.llama import LlamaModel

    gguf_file = open_gguf(write_model(tmp_path / "tiny.gguf"))
    dies = DieManager([DieInfo(0, "fake", 1 << 40, 0)])
    capture = ReplayingCapture()
    backend = CudaBackend(die=0, die_manager=dies, owner="tiny", capture=capture)
    gpu, cpu = LlamaModel.from_gguf(gguf_file, backend), LlamaModel.from_gguf(gguf_file, CpuBackend(int8=False))
    ring = 2 * CTX * gpu.config.n_kv_heads * gpu.config.head_dim * 4
    dies.reserve_bytes = (1 << 40) - dies.used(0) - 3 * ring  # layer 1's v ring does not fit: it runs on the host
    clock = Clock()
    backend.attention_residency.clock = clock
    states = [gpu.new_state(2, CTX), cpu.new_state(2, CTX)]
    graphs = backend.graphs

    def step(rows: list[BatchRow]) -> np.ndarray:
        got, want = (m.forward(s, rows) for m, s in zip((gpu, cpu), states))
        assert_logits_close(got, want)
        return want

    prompts = [np.array([5, 17, 99, 3], np.int32), np.array([42, 8], np.int32)]
    logits = step([BatchRow(s, prompts[s], 0) for s in (0, 1)])
    tokens, pos = [int(np.argmax(logits[s])) for s in (0, 1)], [4, 2]

    def decode(slots: tuple[int, ...]) -> None:
        got = step([BatchRow(s, np.array([tokens[s]], np.int32), pos[s]) for s in slots])
        for row, s in enumerate(slots):
            tokens[s], pos[s] = int(np.argmax(got[row])), pos[s] + 1

    for _ in range(2):  # a warm-up run, then the capture
        decode((1, 0))
    assert graphs.slots[("decode", 0, 2)].state.value == "live"
    host_slot = graphs.slots[("decode", 1, 2)]
    assert host_slot.state.value == "ineligible" and host_slot.reason == HOST_RING
    assert capture.captures == 1 and capture.replays == 0

    dies.reserve_bytes = 0  # room again: the next forward moves layer 1's rings to the die
    clock.now += 10.0
    for _ in range(2):  # eligible again: a warm-up run, then its capture (layer 0 replays meanwhile)
        decode((0, 1))
    assert not any(isinstance(p, np.ndarray) for p in (*states[0].k, *states[0].v))
    assert graphs.slots[("decode", 1, 2)].state.value == "live"
    for _ in range(3):  # another batch size has graphs of its own: warm-up, capture, replay
        decode((0,))
    counters = graphs.counters()
    assert counters is not None
    assert (counters["live"], counters["total"], counters["captures"], counters["capture_failures"]) == (4, 4, 4, 0)
    assert counters["batched_attn"] == {"live": 4, "total": 4, "failed": 0, "ineligible": 0, "pending": 0}
    assert capture.replays == 2 + 2  # layer 0 in the two steps after the move, each layer once at batch 1


def test_a_decode_step_refuses_what_the_cpu_step_refuses(tmp_path: Path) -> None:
    from pantheon.io.gguf_file import open_gguf
    from pantheon.kernels.cuda.backend import CudaBackend
    from pantheon.models.base import BatchRow
    from pantheon.models.llama import LlamaModel

    model = LlamaModel.from_gguf(open_gguf(write_model(tmp_path / "tiny.gguf")), CudaBackend())
    state = model.new_state(2, CTX)
    with pytest.raises(IndexError):
        model.forward(state, [BatchRow(0, np.array([10_000], np.int32), 0)])
    with pytest.raises(ValueError, match="one slot"):
        model.forward(state, [BatchRow(1, np.array([1], np.int32), 0), BatchRow(1, np.array([2], np.int32), 1)])
    with pytest.raises(ValueError):
        model.forward(state, [BatchRow(5, np.array([1], np.int32), 0)])
    assert model.backend.graphs.summary() is None  # nothing ran


@pytest.mark.gpu
def test_driver_graphs_give_the_direct_launches_logits(tmp_path: Path) -> None:
    """On a real GPU: the decode layers captured through the driver API replay the bits of direct launches."""
    from pantheon.io.gguf_file import open_gguf
    from pantheon.kernels.cuda.backend import CudaBackend
    from pantheon.kernels.cuda.graphs import DriverCapture, UnsupportedCapture
    from pantheon.models.base import BatchRow
    from pantheon.models.llama import LlamaModel

    gguf_file = open_gguf(write_model(tmp_path / "tiny.gguf"))
    backends = [CudaBackend(capture=DriverCapture()), CudaBackend(capture=UnsupportedCapture("direct launches"))]
    models = [LlamaModel.from_gguf(gguf_file, be) for be in backends]
    states = [m.new_state(2, CTX) for m in models]
    prompts = [np.array([5, 17, 99, 3], np.int32), np.array([42, 8], np.int32)]
    for m, s in zip(models, states):
        m.forward(s, [BatchRow(i, prompts[i], 0) for i in (0, 1)])
    tokens, pos = [3, 9], [4, 2]
    for _ in range(5):
        rows = [BatchRow(i, np.array([tokens[i]], np.int32), pos[i]) for i in (0, 1)]
        captured, direct = (m.forward(s, rows) for m, s in zip(models, states))
        np.testing.assert_array_equal(captured, direct)
        tokens, pos = [int(np.argmax(direct[i])) for i in (0, 1)], [p + 1 for p in pos]
    counters = backends[0].graphs.counters()
    assert counters is not None and counters["failed"] == 0, counters
    assert counters["live"] == counters["total"] == 2 and counters["captures"] == 2
