"""The compiled decode path (kernels/cpu/decode_layers.py) against the Python loop it replaces: the same bits."""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import pytest

from pantheon.io.gguf_file import open_gguf
from pantheon.kernels.cpu import int8dot
from pantheon.kernels.cpu.decode_layers import K, UP
from pantheon.kernels.cpu.backend import CpuBackend
from pantheon.models.base import BatchRow
from pantheon.models.registry import load_model
from tests.tiny_models import write_tiny_llama

pytestmark = pytest.mark.skipif(int8dot.INT8_ISA is None, reason="no int8 kernels on this CPU")

Q = gguf.GGMLQuantizationType


_WRITTEN: dict[tuple, Path] = {}


def tiny(tmp_path: Path, qtype: Q, d: int = 64, heads: int = 4, kv_heads: int = 2, int8: bool = True):
    """A 3-layer random llama (each shape written once per test session: quantizing its 49k-row embedding in
    Python takes seconds), loaded afresh."""
    key = (qtype, d, heads, kv_heads)
    if key not in _WRITTEN or not _WRITTEN[key].exists():
        _WRITTEN[key] = write_tiny_llama(tmp_path / f"tiny-{qtype.name}-{d}-{heads}-{kv_heads}.gguf", n_layers=3,
                                         d=d, heads=heads, kv_heads=kv_heads, ffn=128, ctx=2048, qtype=qtype)
    return load_model(open_gguf(_WRITTEN[key], None), CpuBackend(2, int8=int8))


def _same_prefills(model, starts: list[int], n_states: int, seed: int):
    """n_states caches holding the same random prompts (lengths `starts`) on the same random slots."""
    rng = np.random.default_rng(seed)
    states = [model.new_state(6, 1200) for _ in range(n_states)]
    slots = rng.permutation(6)[: len(starts)]
    prompts = [rng.integers(0, 500, start).astype(np.int32) for start in starts]
    for state in states:
        for slot, prompt in zip(slots, prompts):
            model.forward(state, [BatchRow(int(slot), prompt, 0)])
    return states, slots


@pytest.mark.parametrize("qtype", [Q.Q8_0, Q.Q4_1, Q.Q4_0])  # Q4_0: packed as Q4_1 (int8dot.kernel_qtype)
# Head dims 16 and 32, both with 2 kv heads: with one, the head-major cache pools are C-contiguous rather than
# strided, and every kernel of the step compiles again for that layout (~75 s of a cold test run).
@pytest.mark.parametrize(("heads", "kv_heads"), [(4, 2), (2, 2)])
@pytest.mark.parametrize("starts", [[7], [600], [3, 530, 40, 90]])
@pytest.mark.parametrize("whole_step", [True, False])
def test_compiled_decode_gives_the_bits_of_the_python_loop(tmp_path, qtype, heads, kv_heads, starts,
                                                           whole_step) -> None:
    """Logits and caches after several decode steps, one sequence or four (a context past 512 keys among
    them), equal bit for bit with and without the compiled path: the whole step (embedding to logits) or its
    layers only (the plan of a model whose embedding or output matrix it does not take)."""
    model = tiny(tmp_path, qtype, heads=heads, kv_heads=kv_heads)
    plan = model._decode_plan
    assert plan is not None and plan.ends is not None
    if not whole_step:
        plan.ends = None
    states, slots = _same_prefills(model, starts, 2, len(starts) + heads)
    tokens = [3] * len(starts)
    for step in range(5):
        rows = [BatchRow(int(slot), np.array([t], np.int32), start + step)
                for slot, start, t in zip(slots, starts, tokens)]
        model._decode_plan = plan
        compiled = model.forward(states[0], rows)
        model._decode_plan = None
        python = model.forward(states[1], rows)
        np.testing.assert_array_equal(compiled, python)
        tokens = [int(np.argmax(row)) for row in compiled]
    for a, b in zip(states[0].k + states[0].v, states[1].k + states[1].v):
        np.testing.assert_array_equal(a, b)


# A llama of the mixes llama.cpp's K-quant files have (mixes per layer, like Q4_K_M's attn_v and ffn_down), every
# int8k kernel type among them: layer 0 q and k Q4_K beside a Q6_K v (apart), gate|up stacked; layer 1 a Q8_0 v
# beside Q5_0 (on VNNI, two kinds of sums of one phase's input) and gate IQ4_XS apart from up Q4_K; layer 2 q|k|v
# stacked Q5_1, an IQ4_NL out. Downs Q6_K, Q3_K, Q5_K; the embedding, tied, Q6_K (the output matmul's halves' sums
# from the last norm's input).
K_MIX = {
    "blk.0.attn_q.weight": Q.Q4_K, "blk.0.attn_k.weight": Q.Q4_K, "blk.0.attn_v.weight": Q.Q6_K,
    "blk.0.attn_output.weight": Q.Q5_K, "blk.0.ffn_gate.weight": Q.Q4_K, "blk.0.ffn_up.weight": Q.Q4_K,
    "blk.0.ffn_down.weight": Q.Q6_K,
    "blk.1.attn_q.weight": Q.Q5_0, "blk.1.attn_k.weight": Q.Q5_0, "blk.1.attn_v.weight": Q.Q8_0,
    "blk.1.attn_output.weight": Q.IQ4_XS, "blk.1.ffn_gate.weight": Q.IQ4_XS, "blk.1.ffn_up.weight": Q.Q4_K,
    "blk.1.ffn_down.weight": Q.Q3_K,
    "blk.2.attn_q.weight": Q.Q5_1, "blk.2.attn_k.weight": Q.Q5_1, "blk.2.attn_v.weight": Q.Q5_1,
    "blk.2.attn_output.weight": Q.IQ4_NL, "blk.2.ffn_gate.weight": Q.Q4_K, "blk.2.ffn_up.weight": Q.Q4_K,
    "blk.2.ffn_down.weight": Q.Q5_K,
    "token_embd.weight": Q.Q6_K,  # tied: the output matrix too
}


def k_mix(tmp_path: Path):
    """A 3-layer llama of the K_MIX types (D 256, FFN 256: whole 256-value superblocks), loaded afresh."""
    key = ("k_mix",)
    if key not in _WRITTEN or not _WRITTEN[key].exists():
        _WRITTEN[key] = write_tiny_llama(tmp_path / "tiny-k-mix.gguf", n_layers=3, d=256, heads=4, kv_heads=2,
                                         ffn=256, ctx=2048, qtype=Q.Q8_0, types=K_MIX)
    return load_model(open_gguf(_WRITTEN[key], None), CpuBackend(2, int8=True))


@pytest.mark.slow
@pytest.mark.parametrize("starts", [[7], [3, 530, 40, 90]])
def test_a_k_quant_mix_runs_compiled_with_the_bits_of_the_python_loop(tmp_path, starts) -> None:
    """A model of K-quant and 5-bit matrices, types mixed within a layer, takes the compiled whole step (int8k's
    kernels dispatched per matrix, q / k / v and gate / up apart where their types differ) and gives the logits
    and caches of the Python loop, bit for bit, over several steps; with a team of two and of one alike."""
    from pantheon.kernels.cpu import decode_layers as dl
    from pantheon.kernels.cpu import team

    model = k_mix(tmp_path)
    plan, c = model._decode_plan, model.config
    assert plan is not None and plan.ends is not None and plan.k_quants and not plan.layers_path
    assert plan.rows[0, K] > 0 and plan.rows[1, UP] > 0 and plan.rows[2, K] == 0  # apart, apart, stacked
    # On VNNI Q6_K and IQ4 read the halves' sums, Q8_0 the corrections: a Q8_0 attn_v beside Q5_0 q and k, a Q6_K
    # output matrix, an IQ4_XS gate, so the input of width D carries both; the out matmul's (IQ4_XS, Q5_K, IQ4_NL)
    # the halves, the down matmul's (Q6_K, Q3_K, Q5_K) the halves.
    vnni = int(int8dot.INT8_ISA == "vnni")
    assert plan.sums.tolist() == [[1, vnni, vnni], [1, vnni, 0], [1, vnni, 0]]
    states, slots = _same_prefills(model, starts, 3, len(starts))
    tokens = [3] * len(starts)
    for step in range(4):
        rows = [BatchRow(int(slot), np.array([t], np.int32), start + step)
                for slot, start, t in zip(slots, starts, tokens)]
        model._decode_plan = plan
        compiled = model.forward(states[0], rows)
        args = dl.step_args(plan, np.array(tokens), c.rms_eps, dl.kernel_pools(states[2].k),
                            dl.kernel_pools(states[2].v), slots.astype(np.int32),
                            np.array(starts, dtype=np.int32) + step, c.n_heads, c.rope_dim, c.rope_base, c.rope_scale,
                            1 / np.sqrt(c.head_dim))
        alone, completed = dl._team_step(1, team.SPIN_LIMIT, *args)
        assert completed
        model._decode_plan = None
        python = model.forward(states[1], rows)
        assert np.isfinite(python).all()
        np.testing.assert_array_equal(compiled, python)
        np.testing.assert_array_equal(alone[:, : c.vocab_size], python)
        tokens = [int(np.argmax(row)) for row in compiled]
    for a, b, d in zip(states[0].k + states[0].v, states[1].k + states[1].v, states[2].k + states[2].v):
        np.testing.assert_array_equal(a, b)
        np.testing.assert_array_equal(d, b)


def test_a_k_quant_plan_without_its_ends_is_not_made(tmp_path) -> None:
    """The layers-only path runs int8dot's stacked plans; a K-quant model whose output matrix the step cannot take
    (float here) keeps the Python loop."""
    from pantheon.kernels.cpu import decode_layers as dl

    model = k_mix(tmp_path)
    assert dl.build_plan(model.blocks, model.output_norm, model.config.head_dim, True, model.tok_embd,
                         None) is None
    plan = model._decode_plan
    plan_ends, plan.ends = plan.ends, None
    try:
        with pytest.raises(ValueError):
            dl.decode_layers(plan, *([None] * 12), 2)
    finally:
        plan.ends = plan_ends


def test_models_the_compiled_path_does_not_serve_keep_the_python_loop(tmp_path) -> None:
    assert tiny(tmp_path, Q.F32)._decode_plan is None  # float matrices
    assert tiny(tmp_path, Q.Q8_0, int8=False)._decode_plan is None  # float32 activations asked for
    assert tiny(tmp_path, Q.Q8_0, d=96, heads=4)._decode_plan is None  # head dim 24: not a multiple of 16
    assert tiny(tmp_path, Q.Q8_0)._decode_plan is not None


def test_a_refused_step_writes_nothing(tmp_path) -> None:
    """Two rows on one slot, or a position past the cache, raise before any layer runs."""
    model = tiny(tmp_path, Q.Q8_0)
    state = model.new_state(2, 64)
    model.forward(state, [BatchRow(0, np.arange(1, 6, dtype=np.int32), 0)])
    before = [a.copy() for a in state.k + state.v]
    with pytest.raises(ValueError):
        model.forward(state, [BatchRow(0, np.array([1], np.int32), 5), BatchRow(0, np.array([2], np.int32), 6)])
    with pytest.raises(ValueError):
        model.forward(state, [BatchRow(1, np.array([1], np.int32), 64)])
    with pytest.raises(IndexError):  # a token id past the vocabulary
        model.forward(state, [BatchRow(1, np.array([model.vocab_size + 5], np.int32), 5)])
    for a, b in zip(before, state.k + state.v):
        np.testing.assert_array_equal(a, b)


def test_the_step_is_called_with_no_tuple_of_typed_lists(tmp_path) -> None:
    """numba's dispatcher types a tuple holding typed lists in Python, element by element, on every call, and the
    step's call runs cache-cold: the seven matrix lists as one tuple cost 130-165 us a step from the Python call
    to the step's first instruction, as seven arguments 32-40 us (`_team_step`). They stay seven arguments."""
    from numba.typed import List

    from pantheon.kernels.cpu import decode_layers as dl

    model = tiny(tmp_path, Q.Q4_1)
    plan, c = model._decode_plan, model.config
    state = model.new_state(1, 64)
    args = dl.step_args(plan, np.array([3]), c.rms_eps, dl.kernel_pools(state.k), dl.kernel_pools(state.v),
                        np.array([0], np.int32), np.array([0], np.int32), c.n_heads, c.rope_dim, c.rope_base,
                        c.rope_scale, 1 / np.sqrt(c.head_dim))

    def holds_lists(value) -> bool:
        return isinstance(value, tuple) and any(isinstance(v, List) or holds_lists(v) for v in value)

    assert not any(holds_lists(a) for a in args)
    assert sum(isinstance(a, List) for a in args) == 9  # the seven matrix lists and the two caches'


def _prefilled(model, starts: list[int], seed: int):
    rng = np.random.default_rng(seed)
    state = model.new_state(6, 1200)
    slots = rng.permutation(6)[: len(starts)].astype(np.int32)
    for slot, start in zip(slots, starts):
        model.forward(state, [BatchRow(int(slot), rng.integers(0, 500, start).astype(np.int32), 0)])
    return state, slots


@pytest.mark.parametrize("qtype", [Q.Q8_0, Q.Q4_1])
@pytest.mark.parametrize("starts", [[9], [3, 530, 40], [5, 6, 7, 8, 9, 600]])
def test_a_team_of_two_gives_the_bits_of_a_team_of_one(tmp_path, qtype, starts) -> None:
    """`_team_step` with its work shared by two threads meeting at barriers, and by one: the same logits and
    caches, bit for bit, with fewer rows than threads and more, and keys split into runs (a phase that read
    before another's writes were done, or a share written twice or never, would show here)."""
    from pantheon.kernels.cpu import decode_layers as dl
    from pantheon.kernels.cpu import team

    model = tiny(tmp_path, qtype, heads=4, kv_heads=2)
    plan, c = model._decode_plan, model.config
    (team_state, slots), (plain_state, _) = _prefilled(model, starts, 1), _prefilled(model, starts, 1)
    tokens = np.full(len(starts), 3)
    for step in range(3):
        positions = np.array(starts, dtype=np.int32) + step
        logits = []
        for state in (team_state, plain_state):
            args = dl.step_args(plan, tokens, c.rms_eps, dl.kernel_pools(state.k), dl.kernel_pools(state.v), slots,
                                positions, c.n_heads, c.rope_dim, c.rope_base, c.rope_scale, 1 / np.sqrt(c.head_dim))
            out, completed = dl._team_step(2 if state is team_state else 1, team.SPIN_LIMIT, *args)
            assert completed
            logits.append(out)
        np.testing.assert_array_equal(logits[0], logits[1])
        tokens = np.argmax(logits[0], axis=1)
    for a, b in zip(team_state.k + team_state.v, plain_state.k + plain_state.v):
        np.testing.assert_array_equal(a, b)


def test_a_team_that_never_meets_gives_up_and_the_plain_step_redoes_it(tmp_path, monkeypatch) -> None:
    """With one numba thread for a team of two, both iterations run on it one after the other: the first waits
    at its first barrier for spin_limit pauses, gives the team up, and the second leaves at once. decode_step
    then runs a team of one, whose logits and caches are those of a step that was never given up."""
    import numba

    from pantheon.kernels.cpu import decode_layers as dl
    from pantheon.kernels.cpu import team

    model = tiny(tmp_path, Q.Q4_1, heads=4, kv_heads=2)
    plan, c = model._decode_plan, model.config
    (state, slots), (plain_state, _) = _prefilled(model, [4, 70], 2), _prefilled(model, [4, 70], 2)
    positions = np.array([4, 70], dtype=np.int32)

    def run(s, **kw):
        return dl.decode_step(plan, np.array([3, 5]), c.rms_eps, dl.kernel_pools(s.k), dl.kernel_pools(s.v), slots,
                              positions, c.n_heads, c.rope_dim, c.rope_base, c.rope_scale, 1 / np.sqrt(c.head_dim),
                              **kw)

    before = numba.get_num_threads()
    numba.set_num_threads(1)
    try:
        args = dl.step_args(plan, np.array([3, 5]), c.rms_eps, dl.kernel_pools(state.k), dl.kernel_pools(state.v),
                            slots, positions, c.n_heads, c.rope_dim, c.rope_base, c.rope_scale,
                            1 / np.sqrt(c.head_dim))
        assert not dl._team_step(2, 2000, *args)[1]
        monkeypatch.setattr(dl, "_team_size", lambda threads: 2)
        monkeypatch.setattr(team, "SPIN_LIMIT", 2000)
        fallbacks = dl.team_fallbacks
        logits = run(state, threads=2)
        assert dl.team_fallbacks == fallbacks + 1
    finally:
        numba.set_num_threads(before)
    monkeypatch.undo()
    np.testing.assert_array_equal(logits, run(plain_state, threads=1))
    for a, b in zip(state.k + state.v, plain_state.k + plain_state.v):
        np.testing.assert_array_equal(a, b)


def test_the_team_runs_with_openmp(tmp_path, monkeypatch) -> None:
    """On a machine with OpenMP (the test VM, CI) a 2-thread decode step is run by a team of two, once."""
    from pantheon.kernels.cpu import decode_layers as dl

    model = tiny(tmp_path, Q.Q8_0)
    state, slots = _prefilled(model, [5], 3)
    if dl._team_size(2) == 1:
        pytest.skip(f"threading layer {__import__('numba').threading_layer()}: no team")
    sizes = []
    team_step = dl._team_step

    def recorded(n_threads, *args):
        sizes.append(n_threads)
        return team_step(n_threads, *args)

    monkeypatch.setattr(dl, "_team_step", recorded)
    logits = model.forward(state, [BatchRow(int(slots[0]), np.array([3], np.int32), 5)])
    assert sizes == [2] and logits.shape == (1, model.vocab_size) and np.isfinite(logits).all()


def test_kv_prefetch_for_the_next_layer_reads_into_l2_and_changes_nothing():
    """The down matmul asks for the next layer's keys and values (`_gemm_claimed`): any run of (sequence,
    kv head) pairs, the empty one included, positions below and past PREFETCH_KV_ROWS and at 0, leaves the
    pools as they were; and the prefetch is prefetcht1 (into L2: L1 holds the matmul's own data), no
    prefetcht0."""
    import numba

    from pantheon.kernels.cpu import decode_layers, ops

    n_seqs, ctx, n_kv, head_dim = 3, 300, 2, 64
    rng = np.random.default_rng(7)
    pools = []
    for _ in range(2):
        pool = CpuBackend.kv_pool(4, ctx, n_kv, head_dim, np.float16)
        pool[...] = rng.standard_normal(pool.shape).astype(np.float16)
        pools.append(pool)
    before = [pool.copy() for pool in pools]
    slots = np.array([2, 0, 3], dtype=np.int32)
    positions = np.array([0, 57, decode_layers.PREFETCH_KV_ROWS + 90], dtype=np.int32)
    probe = numba.njit(decode_layers._prefetch_kv_pairs.py_func)  # uncached: its assembly is at hand
    views = [ops.kernel_view(pool) for pool in pools]
    for first, end in [(0, 0), (0, n_seqs * n_kv), (1, 4), (5, 6)]:
        probe(views[0], views[1], slots, positions, first, end)
    for pool, old in zip(pools, before):
        np.testing.assert_array_equal(pool, old)
    asm = probe.inspect_asm(probe.signatures[0])
    assert "prefetcht1" in asm and "prefetcht0" not in asm


@pytest.mark.parametrize("n_rows", [1, 3, 8])
def test_swiglu_fused_into_the_quantization_gives_the_bits_of_the_two_phases(n_rows):
    """The team's SwiGLU is computed block by block by the member that quantizes the block for the down matmul
    (`_swiglu_quantize_span`): for any team size (spans that cut a row in the middle, members with nothing),
    the members' parts together give the SwiGLU rows and the quantized blocks of the SwiGLU then
    `quantize_rows`, bit for bit, and every block is written by one member only. With room for the halves' sums
    and the corrections, each block's are the ones `quantize_rows` gives of those kinds."""
    from pantheon.kernels.cpu import decode_layers, ops

    ffn = 160  # 5 blocks a row: most team sizes cut rows
    rng = np.random.default_rng(n_rows)
    gate_up = (rng.standard_normal((n_rows, 2 * ffn)) * 3).astype(np.float32)
    want_ff = ops.swiglu_stacked(gate_up)
    want = int8dot.quantize_rows(want_ff)
    want_halves = int8dot.quantize_rows(want_ff, int8dot.XS_HALVES)[2]
    want_corrections = int8dot.quantize_rows(want_ff, int8dot.XS_CORRECTIONS)[2]
    for extras in (False, True):
        for parts in (1, 2, 3, 7, 2 * n_rows * ffn // int8dot.QK + 1):
            ff = np.full((n_rows, ffn), np.nan, dtype=np.float32)
            xq = np.zeros_like(want[0])
            xd = np.full_like(want[1], np.nan)
            xs = np.full_like(want[2], np.nan)
            halves = np.full((n_rows, ffn // 16 if extras else 0), np.nan, dtype=np.float32)
            corrections = np.full((n_rows, ffn // int8dot.QK if extras else 0), np.nan, dtype=np.float32)
            written = 0
            for part in range(parts):
                mine = np.full_like(xd, np.nan)
                decode_layers._swiglu_quantize_span(gate_up, ff, (xq, mine, (xs, halves, corrections)), part, parts)
                assert np.isnan(xd[~np.isnan(mine)]).all()  # no block another member wrote
                xd = np.where(np.isnan(mine), xd, mine)
                written += int((~np.isnan(mine)).sum())
            assert written == xd.size
            np.testing.assert_array_equal(ff, want_ff)
            for got, expected in zip((xq, xd, xs), want):
                np.testing.assert_array_equal(got, expected)
            if extras:
                np.testing.assert_array_equal(halves, want_halves)
                np.testing.assert_array_equal(corrections, want_corrections)
