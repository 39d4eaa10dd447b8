"""One llama model over two dies (pantheon/kernels/cuda/segments.py): the layer split, the counters added over the
dies, and on the simulator (where two backends stand for two dies) a tiny llama whose two layers sit on different
dies giving the cpu backend's logits, with each die charged for its own layers, rings and output, each die's
launches reading only its own arrays, and decode steps replayed from each die's graphs (class "segment")."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from pantheon.kernels.cuda.segments import _added, segment_of


def test_layers_go_to_the_dies_in_contiguous_runs() -> None:
    assert [segment_of(li, 5, 3) for li in range(5)] == [0, 0, 1, 1, 2]
    assert [segment_of(li, 30, 2) for li in range(30)] == [0] * 15 + [1] * 15
    assert [segment_of(li, 2, 4) for li in range(2)] == [0, 2]  # more dies than layers: some hold none


def test_counters_add_up_over_the_dies() -> None:
    a = {"live": 2, "total": 3, "batched_attn": {"live": 2, "total": 3}}
    b = {"live": 1, "total": 1, "gave_up": 1, "batched_attn": {"live": 1, "total": 1}, "single_ssm": {"total": 4}}
    assert _added([a, b]) == {"live": 3, "total": 4, "gave_up": 1, "batched_attn": {"live": 3, "total": 4},
                              "single_ssm": {"total": 4}}


@pytest.mark.cuda_kernels
@pytest.mark.slow
def test_a_llama_split_over_two_dies_gives_the_cpu_logits(tmp_path: Path) -> None:
    from pantheon.io.gguf_file import open_gguf
    from pantheon.kernels.cpu.backend import CpuBackend
    from pantheon.kernels.cuda.backend import CudaBackend
    from pantheon.kernels.cuda.dies import DieInfo, DieManager
    from pantheon.kernels.cuda.segments import DieSegments
    from pantheon.models.base import BatchRow
    from pantheon.models.llama import LlamaModel
    from tests.cuda.test_llama_forward import CTX, LAYERS, assert_logits_close, write_model

    gguf_file = open_gguf(write_model(tmp_path / "tiny.gguf"))
    dies = DieManager([DieInfo(0, "fake", 1 << 40, 0), DieInfo(1, "fake", 1 << 40, 1)])
    segments = DieSegments([CudaBackend(die=d, die_manager=dies, owner="tiny") for d in (0, 1)])
    gpu, cpu = LlamaModel.from_gguf(gguf_file, segments), LlamaModel.from_gguf(gguf_file, CpuBackend(int8=False))
    assert LAYERS == 2 and gpu.layer_backends == segments.dies and gpu.output_backend is segments.dies[1]
    assert [(be, layers) for be, layers in gpu._decode_plan.segments] == [(segments.dies[0], [0]),
                                                                          (segments.dies[1], [1])]
    weights = [dies.used(0), dies.used(1)]
    states = [gpu.new_state(2, CTX), cpu.new_state(2, CTX)]
    ring = 2 * CTX * gpu.config.n_kv_heads * gpu.config.head_dim * 4
    assert [dies.used(0) - weights[0], dies.used(1) - weights[1]] == [2 * ring, 2 * ring]  # each layer's k and v
    embedding = gguf_file.tensors["token_embd.weight"].nbytes
    assert weights[0] > embedding and weights[1] > embedding  # the tied output is a copy on the last die

    def step(rows: list[BatchRow]) -> np.ndarray:
        got, want = (m.forward(s, rows) for m, s in zip((gpu, cpu), states))
        assert_logits_close(got, want)
        return want

    logits = step([BatchRow(0, np.array([5, 17, 99, 3], np.int32), 0),
                   BatchRow(1, np.array([42, 8], np.int32), 0, logits="all")])
    tokens, pos = [int(np.argmax(logits[0])), int(np.argmax(logits[-1]))], [4, 2]
    for _ in range(2):
        logits = step([BatchRow(s, np.array([tokens[s]], np.int32), pos[s]) for s in (0, 1)])
        tokens, pos = [int(np.argmax(logits[s])) for s in (0, 1)], [p + 1 for p in pos]
    assert segments.attention_residency.counters() == {"ondie": 2, "host": 0, "total": 2}
    # A session's state reads back from both dies as the cpu model's does.
    got, want = gpu.read_slot(states[0], 1, 3), cpu.read_slot(states[1], 1, 3)
    assert [name for name, _ in got] == [name for name, _ in want]
    for (_, a), (_, b) in zip(got, want):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-4)


@pytest.mark.cuda_kernels
async def test_the_manager_splits_llama_models_and_refuses_several_dies_for_the_others(tmp_path: Path) -> None:
    from pantheon.config import ModelOptions, read_env
    from pantheon.errors import ApiError
    from pantheon.kernels.cpu.backend import CpuBackend
    from pantheon.kernels.cuda.dies import DieInfo, DieManager
    from pantheon.kernels.cuda.segments import DieSegments
    from pantheon.sched.manager import ModelManager
    from pantheon.sched.registry import Registry
    from tests.cuda.test_qwen35_forward import FIXTURE

    dies = DieManager([DieInfo(0, "fake", 1 << 40, 0), DieInfo(1, "fake", 1 << 40, 1)])
    manager = ModelManager(Registry(), read_env(), CpuBackend(int8=False), die_manager=dies)
    options = ModelOptions(path=tmp_path / "tiny.gguf", name="tiny", dies=(1, 0))
    backend = manager._backend_for(options)
    assert isinstance(backend, DieSegments) and [be.die for be in backend.dies] == [1, 0]
    with pytest.raises(ApiError) as refused:
        await manager.load(ModelOptions(path=FIXTURE, name="hybrid", dies=(0, 1)))
    assert refused.value.status == 400 and refused.value.error_type == "load_failed"
    assert "one die" in str(refused.value) and not manager.registry.instances


@pytest.mark.cuda_kernels
@pytest.mark.slow
@pytest.mark.parametrize("n_dies", [2, 3])
def test_each_die_launches_only_on_its_own_arrays(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                  n_dies: int) -> None:
    """Load and steps of a two-layer llama over two dies (or three, the last holding only the output): every
    array a layer's weights, rings and norms use is made while its die is current, and every launch reads only
    arrays of the die current at launch (die_ownership.py) — the boundary layer's closing norm included, which
    is the next layer's (or the output's) and so lives on another die."""
    from pantheon.io.gguf_file import open_gguf
    from pantheon.kernels.cpu.backend import CpuBackend
    from pantheon.kernels.cuda.backend import CudaBackend
    from pantheon.kernels.cuda.dies import DieInfo, DieManager
    from pantheon.kernels.cuda.segments import DieSegments
    from pantheon.models.base import BatchRow
    from pantheon.models.llama import LlamaModel
    from tests.cuda.die_ownership import DieOwnership
    from tests.cuda.test_llama_forward import CTX, assert_logits_close, write_model

    gguf_file = open_gguf(write_model(tmp_path / "tiny.gguf"))
    ownership = DieOwnership(monkeypatch)
    dies = DieManager([DieInfo(d, "fake", 1 << 40, d) for d in range(n_dies)])
    segments = DieSegments([CudaBackend(die=d, die_manager=dies, owner="tiny") for d in range(n_dies)])
    model = LlamaModel.from_gguf(gguf_file, segments)
    state = model.new_state(2, CTX)
    for li, blk in enumerate(model.blocks):
        for array in (blk.attn_norm, blk.next_norm, blk.wo.data, blk.w_down.data, state.k[li], state.v[li]):
            assert ownership.die_of(array) == li
    assert ownership.die_of(model.tok_embd.data) == 0 and ownership.die_of(model.output.data) == n_dies - 1
    assert model.blocks[0].next_norm is not model.blocks[1].attn_norm  # its copy on die 0
    assert (model.blocks[1].next_norm is model.output_norm) == (n_dies == 2)
    cpu = LlamaModel.from_gguf(gguf_file, CpuBackend(int8=False))
    cpu_state = cpu.new_state(2, CTX)

    def step(rows: list[BatchRow]) -> np.ndarray:
        got, want = model.forward(state, rows), cpu.forward(cpu_state, rows)
        assert_logits_close(got, want)
        return want

    logits = step([BatchRow(0, np.array([5, 17, 99], np.int32), 0), BatchRow(1, np.array([42], np.int32), 0)])
    tokens = [int(np.argmax(row)) for row in logits]
    step([BatchRow(0, np.array([tokens[0]], np.int32), 3), BatchRow(1, np.array([tokens[1]], np.int32), 1)])
    step([BatchRow(1, np.array([tokens[1]], np.int32), 2)])
    assert ownership.violations == []
    assert ownership.launches[0] > 10 and ownership.launches[1] > 10
    assert ownership.launches[n_dies - 1] > 2  # the output matrix, at least


@pytest.mark.cuda_kernels
@pytest.mark.slow
def test_decode_steps_over_two_dies_replay_each_dies_graphs(tmp_path: Path) -> None:
    """With a replaying capture layer (replaying_capture.py) on both dies: each die captures its segment of
    layers (here one each) as one graph per batch size, under the class "segment", and replays it in later
    steps with the cpu backend's logits."""
    from pantheon.io.gguf_file import open_gguf
    from pantheon.kernels.cpu.backend import CpuBackend
    from pantheon.kernels.cuda.backend import CudaBackend
    from pantheon.kernels.cuda.segments import DieSegments
    from pantheon.models.base import BatchRow
    from pantheon.models.llama import LlamaModel
    from tests.cuda.replaying_capture import ReplayingCapture
    from tests.cuda.test_llama_forward import CTX, assert_logits_close, write_model

    gguf_file = open_gguf(write_model(tmp_path / "tiny.gguf"))
    captures = [ReplayingCapture(), ReplayingCapture()]
    segments = DieSegments([CudaBackend(die=d, capture=captures[d]) for d in (0, 1)])
    gpu, cpu = LlamaModel.from_gguf(gguf_file, segments), LlamaModel.from_gguf(gguf_file, CpuBackend(int8=False))
    states = [gpu.new_state(2, CTX), cpu.new_state(2, CTX)]

    def step(rows: list[BatchRow]) -> np.ndarray:
        got, want = (m.forward(s, rows) for m, s in zip((gpu, cpu), states))
        assert_logits_close(got, want)
        return want

    logits = step([BatchRow(0, np.array([5, 17, 99, 3], np.int32), 0), BatchRow(1, np.array([42, 8], np.int32), 0)])
    tokens, pos = [int(np.argmax(logits[s])) for s in (0, 1)], [4, 2]
    for slots in [(0, 1)] * 4 + [(1,)] * 3:  # batch 2: warm-up, capture, two replays; batch 1: warm-up, capture, replay
        got = step([BatchRow(s, np.array([tokens[s]], np.int32), pos[s]) for s in slots])
        for row, s in enumerate(slots):
            tokens[s], pos[s] = int(np.argmax(got[row])), pos[s] + 1
    for die, capture in enumerate(captures):
        assert (capture.captures, capture.replays) == (2, 3)
        assert set(segments.dies[die].graphs.slots) == {("segment", die, 2), ("segment", die, 1)}
    counters = segments.graphs.counters()
    assert counters is not None
    assert (counters["live"], counters["total"], counters["captures"], counters["failed"]) == (4, 4, 4, 0)
    assert counters["segment"] == {"live": 4, "total": 4, "failed": 0, "ineligible": 0, "pending": 0}
    assert "batched_attn" not in counters  # a class never exercised is omitted
