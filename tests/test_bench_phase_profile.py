"""bench/phase_profile.py: its instrumented copy of the compiled decode step still applies to decode_layers's
source, computes the same bits as the step it copies (the attention run twice too: the second run rewrites the
same values), and counts cycles in every phase that does work and in the barriers."""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import pytest

from bench import phase_profile
from pantheon.io.gguf_file import open_gguf
from pantheon.kernels.cpu import int8dot
from pantheon.kernels.cpu.backend import CpuBackend
from pantheon.models.base import BatchRow
from pantheon.models.registry import load_model
from tests.tiny_models import write_tiny_llama

pytestmark = [pytest.mark.slow, pytest.mark.skipif(int8dot.INT8_ISA is None, reason="no int8 kernels on this CPU")]


def test_the_instrumented_step_gives_the_steps_bits_and_counts_each_phase(tmp_path: Path) -> None:
    from pantheon.kernels.cpu import decode_layers as dl
    from pantheon.kernels.cpu import team

    # Two kv heads: the strided cache layout the served models have, so dl._team_step is the compiled one the
    # other tests use (with one, the pools are C-contiguous and the whole step compiles again, ~50 s).
    path = write_tiny_llama(tmp_path / "tiny.gguf", n_layers=2, d=64, heads=4, kv_heads=2, ffn=128, ctx=256,
                            qtype=gguf.GGMLQuantizationType.Q4_1)
    model = load_model(open_gguf(path, None), CpuBackend(2, int8=True))
    plan, c = model._decode_plan, model.config
    assert plan is not None and plan.ends is not None
    phases = phase_profile.load_instrumented(attention_twice=True)
    rng = np.random.default_rng(0)
    starts, slots = [5, 40], np.array([1, 0], dtype=np.int32)
    states = [model.new_state(2, 128) for _ in range(2)]
    for state in states:
        for slot, start in zip(slots, starts):
            model.forward(state, [BatchRow(int(slot), np.arange(start, dtype=np.int32) % 200, 0)])
    tokens = rng.integers(0, 200, 2)
    logits = []
    prof = np.zeros((2, len(phase_profile.PHASES)), np.int64)
    for state, step, extra in zip(states, (dl._team_step, phases._team_step), ((), (prof,))):
        args = dl.step_args(plan, tokens, c.rms_eps, dl.kernel_pools(state.k), dl.kernel_pools(state.v), slots,
                            np.array(starts, dtype=np.int32), c.n_heads, c.rope_dim, c.rope_base, c.rope_scale,
                            1 / np.sqrt(c.head_dim))
        out, completed = step(2, team.SPIN_LIMIT, *args, *extra)
        assert completed
        logits.append(out)
    np.testing.assert_array_equal(logits[0], logits[1])
    for a, b in zip(states[0].k + states[0].v, states[1].k + states[1].v):
        np.testing.assert_array_equal(a, b)
    names = phase_profile.PHASES
    for name in ("qkv", "attn", "out", "gate_up", "down", "output", "attention_again", "barrier_wait"):
        assert prof[:, names.index(name)].sum() > 0, name
    # The barriers' cycles are a part of the phases' (every barrier is inside one).
    assert (prof[:, names.index("barrier_wait")] < prof[:, :phase_profile.TEAM_PHASES].sum(axis=1)).all()
