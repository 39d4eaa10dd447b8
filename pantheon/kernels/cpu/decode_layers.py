"""A llama decode step's layers in one compiled call: no Python, and no GIL, between its kernels.

Driven from Python, a decode step of the default model is ~270 kernel calls (four matmuls, the attention, two
norms and the SwiGLU per layer), each paying its wrapper's checks, numba's argument unboxing and a release
and re-acquire of the GIL: about 1 ms of a 4-5 ms batch-1 step on the 2-core test VM. Under the server the
re-acquires also wait on the event loop, which holds the GIL while it sends the tokens of the step before.
`decode_layers` runs the same kernels, with the same arguments, in the same order, from one nogil function,
so the numbers are the bits of the Python path (tests/kernels/test_decode_layers.py).

The whole step (`decode_step`) runs as one team of threads (`team.py`): a single parallel region for every
layer and the output matmul, the threads splitting each phase (a matmul's weight groups, the attention's work
items, the quantization's blocks, the norms' rows) and meeting at a barrier where a phase reads what another
wrote. That saves the ~150 launches of a launch-per-kernel step (~1.1 us each warm) and splits the work that
ran on one thread between them: on the 2-core test VM 7-10% faster at 1 and at 8 sequences. Every value is
computed by the same compiled function whatever the team's size, so a team of one (one thread, or the
recovery from a team given up) gives the same bits. During each layer's down matmul the team also asks for
the next layer's keys and values (`_gemm_claimed`), which the weights' stream has evicted by then:
`bench/batch_ab.py` against the step without it, 2026-12-02 on the 2-core Zen 5 VM (36 and 48 rounds a
tree): batch-8 medians 968 -> 1025 and 1084 -> 1126 tok/s, batch 1 unchanged within noise (248 / 245, 261 /
252). (A first version, every row asked for at once before the down matmul, in a phase profile of the team
step, three processes each: batch-8 attention 2.28, 1.84 and 1.77 ms a step against 2.20, 2.34 and 2.23
without, the down matmul 0.1-0.35 ms longer.)

It serves the llama models whose matrices all have int8 kernels, on a CPU that has them, with a head dim that is
a multiple of 16 (the attention intrinsics); anything else keeps the Python loop. When the embedding is
quantized and the output matrix has int8 kernels too (the default model), `decode_step` also takes the
embedding rows, the first norm and the output matmul: token ids in, logits out, one GIL round trip. Models of
int8dot's types (Q4_0, Q4_1, Q8_0) with q|k|v and gate|up stacked at load also run their layers alone this way
(`decode_layers`, when the ends are not taken). The K-quant, 5-bit and IQ4 types (`int8k`: most files people
download, Q4_K_M / Q5_K_M) run as whole steps only, each matrix on its own type's kernels (`gemm_call`: the step
calls them through a pointer, so that one compiled step serves every model),
and their mixes within a layer (Q4_K_M's Q6_K attn_v beside Q4_K q and k, SmolLM2's Q8_0 attn_v beside Q5_0)
keep q, k and v apart, each written into its columns of one q|k|v output: the attention then reads it as it
reads a stacked one's. A phase's input is quantized once; where some matrix reads other sums of it in place of
xs (the halves' sums: Q6_K, IQ4 on VNNI; the corrections: Q8_0 on VNNI), the quantizing member writes those
beside it (`DecodePlan.sums`). Every output is computed by the same kernel on the same bytes as the Python
loop's matmul of that matrix: the same bits (tests/kernels/test_decode_layers.py).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

import numba
import numpy as np
from numba.typed import List

from pantheon.kernels.cpu import attend_ir, gemm_call, int8dot, int8k, ops, quant, team

log = logging.getLogger("pantheon.kernels")

# The matrices of a layer, in the order of `DecodePlan.qtypes` / `rows` / `cols` columns and of its
# `weights` lists. Where q, k and v have one type they are stacked at load into one matrix (LlamaBlock.w_qkv) that
# stands as Q, K and V then empty (no rows); gate and up likewise as GATE.
Q, K, V, OUT, GATE, UP, DOWN = range(7)
# Claimed phases of a layer in `_team_step` (`claims`: a counter per phase and member): one a matrix, phase
# _PHASES * layer + its column above, and the attention's items, phase _PHASES * layer + ATTN; the output matmul
# is phase _PHASES * n_layers.
ATTN = 7
_PHASES = 8


@numba.njit(cache=True, nogil=True, error_model="numpy")
def _matmul(gemm, qtype, packed, rows, x, n_chunks):
    out = np.empty((x.shape[0], rows), dtype=np.float32)
    int8dot._matmul(gemm, qtype, packed, x, out, n_chunks)
    return out


@numba.njit(cache=True, nogil=True, error_model="numpy")
def _layers(gemm, x, h, qtypes, rows, w_qkv, w_out, w_gate_up, w_down, ffn_norms, next_norms, eps, k_pools,
            v_pools, slots, positions, cos_table, sin_table, scale, n_q_heads, n_chunks):
    """The layers one matmul at a time, for plans of stacked q|k|v and gate|up matrices of int8dot's types (gemm:
    `int8dot.gemm_address`)."""
    n_seqs = x.shape[0]
    head_dim = k_pools[0].shape[3]
    for li in range(len(w_qkv)):
        qkv = _matmul(gemm, qtypes[li, Q], w_qkv[li], rows[li, Q], h, n_chunks)
        attn = np.empty((n_seqs, n_q_heads, head_dim), dtype=np.float32)
        ops._attention_decode_qkv_kernel(qkv, False, cos_table, sin_table, k_pools[li], v_pools[li], slots,
                                         positions, scale, attn)
        o = _matmul(gemm, qtypes[li, OUT], w_out[li], rows[li, OUT], attn.reshape(n_seqs, n_q_heads * head_dim),
                    n_chunks)
        ops._add_rmsnorm_rows(x, o, ffn_norms[li], eps, h)
        gate_up = _matmul(gemm, qtypes[li, GATE], w_gate_up[li], rows[li, GATE], h, n_chunks)
        ff = ops._swiglu_stacked_rows(gate_up)
        d = _matmul(gemm, qtypes[li, DOWN], w_down[li], rows[li, DOWN], ff, n_chunks)
        ops._add_rmsnorm_rows(x, d, next_norms[li], eps, h)


@numba.njit(cache=True, nogil=True, error_model="numpy")
def _quantize_blocks(x, q, row, b_lo, b_hi):
    """`int8dot._quantize`'s blocks b_lo .. b_hi - 1 of row `row` of x into q = (xq, xd, (xs, xh, xc)), the halves'
    sums and the corrections too where xh and xc have room for them (`_quantized`)."""
    xs, xh, xc = q[2]
    for block in range(b_lo, b_hi):
        int8dot._quantize_block(x, q[0], q[1], xs, xh, xc, row, block)


@numba.njit(cache=True, nogil=True, error_model="numpy")
def _quantize_rows(x, q, r_lo, r_hi):
    """`int8dot._quantize`'s blocks of rows r_lo .. r_hi - 1 of x into q (`_quantize_blocks`)."""
    for row in range(r_lo, r_hi):
        _quantize_blocks(x, q, row, 0, x.shape[1] // int8dot.QK)


@numba.njit(cache=True, nogil=True, error_model="numpy")
def _swiglu_quantize_span(gate_up, ff, q, part, parts):
    """This member's share (`team.span`) of the (row, block) pairs of ff = SwiGLU(gate_up), in row-major order:
    each block's SwiGLU, then its quantization for the down matmul (`int8dot._quantize_block`), by the same
    member: one phase and one barrier for what were two (the SwiGLU's rows, then their blocks), and the
    block is still in L1 when it is quantized. The same functions on the same values: the same bits.
    `bench/batch_ab.py --pairs 6 --rounds 6` against the two phases (2026-12-02, 2-core Zen 5 VM, two runs of
    36 rounds a tree): batch-1 medians 260 -> 295 and 268 -> 289 tok/s, batch 8 1271 -> 1317 and 1232 -> 1257.
    (Before `ops._swiglu_stacked_cols` indexed its slices from 0, this loop ran 2x slower than the two.)"""
    qk = int8dot.QK
    n_blocks = ff.shape[1] // qk
    lo, hi = team.span(ff.shape[0] * n_blocks, part, parts)
    i = lo
    while i < hi:  # a row's run of this member's blocks at a time
        row, first = i // n_blocks, i % n_blocks
        end = min(n_blocks, first + hi - i)
        ops._swiglu_stacked_cols(gate_up, ff, row, first * qk, end * qk)
        _quantize_blocks(ff, q, row, first, end)
        i += end - first


@numba.njit(cache=True, nogil=True, error_model="numpy")
def _add_rmsnorm_quantize_rows(residual, delta, weight, eps, out, q, r_lo, r_hi):
    """`ops._add_rmsnorm_row` of rows r_lo .. r_hi - 1, each row's blocks quantized for the next matmul right
    after its norm (`int8dot._quantize_block`), by the member that owns the rows: no barrier between the norm
    and the quantization, which the team needed when the quantization's blocks were shared out apart from the
    norm's rows. The same functions on the same values: the same bits. With the attention items' own
    quantization (`_team_member`), 3 of a layer's 11 barriers gone (8 remain, 9 with split key runs):
    `bench/batch_ab.py --pairs 6 --rounds 6` against the step with them (2026-12-02, 2-core Zen 5 VM, two
    runs): batch-8 medians 1207 -> 1237 and 1197 -> 1217 tok/s, batch 1 252 -> 267 and 289 -> 276; within
    this VM's noise, at most a few percent. (The norms' alone, one run: batch 8 1292 -> 1265, batch 1 272 -> 273.)"""
    for r in range(r_lo, r_hi):
        ops._add_rmsnorm_row(residual, delta, weight, eps, out, r)
        _quantize_rows(out, q, r, r + 1)


# Keys (and as many values) per sequence and kv head that the down matmul asks for: 128 rows of SmolLM2's
# float16 kv heads are 16 KB each, 24 (sequence, kv head) pairs at batch 8 ~390 KB a core, well inside its L2
# beside the down matrix's stream; longer contexts get their first rows ahead and the rest from the
# attention's own prefetches (`ops._attend_group`).
PREFETCH_KV_ROWS = 128
_prefetch_rows_l2 = attend_ir.prefetch_rows_intrinsic(locality=2)


@numba.njit(cache=True, nogil=True, error_model="numpy")
def _prefetch_kv_pairs(k_pool, v_pool, slots, positions, first, end):
    """Prefetch into L2 the first PREFETCH_KV_ROWS keys and values that a decode attention reads for the
    (sequence, kv head) pairs first .. end - 1 (pair = sequence * n_kv_heads + kv head)."""
    n_kv_heads = k_pool.shape[2]
    for pair in range(first, end):
        b = pair // n_kv_heads
        kvh = np.int64(pair % n_kv_heads)
        rows = np.int64(min(positions[b], PREFETCH_KV_ROWS))
        _prefetch_rows_l2(k_pool[slots[b]], kvh, np.int64(0), rows)
        _prefetch_rows_l2(v_pool[slots[b]], kvh, np.int64(0), rows)


# Inlined: a compiled call counts references to the arrays it is passed, atomics on words both threads share.
@numba.njit(cache=True, nogil=True, error_model="numpy", inline="always")
def _prefetch_item_kv(item, first_item, per_subgroup, n_subgroups, group, k_pool, v_pool, slots, positions):
    """Prefetch into L2 the keys and values of attention item `item` (`ops._decode_item`): a member asks for its
    next item's before it computes the current one, which is usually the one it claims next (its own part goes
    in order: `team.claim_own_first`). What the down and q|k|v matmuls asked for ahead (`_gemm_claimed`) is
    only the first PREFETCH_KV_ROWS rows of a pair, and part of it is gone by the time the items run.
    `bench/step_ab.py` against the step without it (2-core Zen 4 VM, 2026-12-06, both in one process taking
    turns, 12-14 rounds a run): batch 8 +2.0% and +1.5% (per-round ratios 0.88-1.21: the VM was in its slow
    phase), batch 1 -0.2% and +2.1%; the same lines written in the loop, three runs: batch 8 +1.7%, +2.6%, +2.6%
    (0.98-1.11), batch 1 +1.4%, +0.8%, -0.4%. Not inlined, the call's reference counting took it all back
    (+0.3%, batch 1 -1.2%). One item further ahead (item + 2) measured +0.5% at batch 8."""
    n_kv_heads = k_pool.shape[2]
    b, _, kvh, _, _, k_lo, k_hi = ops._decode_item(item, first_item, per_subgroup, n_subgroups, group, n_kv_heads,
                                                   positions)
    _prefetch_rows_l2(k_pool[slots[b]], np.int64(kvh), k_lo, k_hi)
    _prefetch_rows_l2(v_pool[slots[b]], np.int64(kvh), k_lo, k_hi)


@numba.njit(cache=True, nogil=True, error_model="numpy")
def _gemm_claimed(gemm, qtype, packed, q, out, col0, claims, phase, t, n_threads, kv):
    """Member t's share of a matmul the team shares out by claiming chunks of pairs of weight groups, its own
    part first (`team.claim_own_chunk`). An output's bits do not depend on who computes it. The smallest chunk
    is about a microsecond of work. gemm: the address of the kernels' gemm (`int8dot.gemm_address`,
    `int8k.gemm_address`). The matrix reads in the xs slot what its kernels take there (`int8k.xs_kind`).

    kv = (k_pool, v_pool, slots, positions, first, end): before each chunk of its own part the member also asks for
    the keys and values of (sequence, kv head) pairs first .. end - 1 (`_prefetch_kv_pairs`), as far as that chunk
    takes it through its part; an empty run asks for nothing. The layers' down matmul passes the member's part of
    the next layer's, and the q|k|v matmul that layer's again: the weights stream through every cache level during a
    step and evict the caches' keys and values, so decode attention waited on memory for them (a lone launch at
    batch 8, context ~110, 2 threads: 40 us a layer with its data in cache, 82 us with it evicted), and at batch 8
    those matmuls are bound by their arithmetic, not their weights, which leaves the memory bus room. (The q|k|v
    matmul's asking, with the attention items taken by their owner first: `bench/phase_profile.py --levels 8
    --attention-twice` on the 2-core Zen 4 VM, 2026-12-05, two processes a tree, alternating: the attention
    2640-3050 k cycles a step against 3170-3360 without both, the q|k|v matmul 1700-1960 against 1630-1710; the
    owner-first claiming alone, in another such run, 2940-3115 against 3045-3283.)"""
    k_pool, v_pool, slots, positions, kv_first, kv_end = kv
    n_groups = packed.shape[0]
    xs = q[2][int8k.xs_kind(qtype, int8k._UNSIGNED)]
    min_chunk = max(2, 16 // q[0].shape[0])
    # Claimed in pairs of groups: the wide kernels take two a call (int8dot.INT8_WIDE).
    n_pairs = (n_groups + 1) // 2
    part_lo, part_hi = team.span(n_pairs, t, n_threads)
    asked = kv_first
    while True:
        lo, hi, own = team.claim_own_chunk(claims, phase, t, n_threads, n_pairs, (min_chunk + 1) // 2)
        if lo >= hi:
            break
        if own:  # up to the same fraction of the pairs as of its part claimed so far
            upto = kv_first + (kv_end - kv_first) * (hi - part_lo) // (part_hi - part_lo)
            _prefetch_kv_pairs(k_pool, v_pool, slots, positions, asked, upto)
            asked = upto
        gemm_call.call_gemm(gemm, qtype, packed, q[0], q[1], xs, out, 2 * lo, min(n_groups, 2 * hi), col0)
    _prefetch_kv_pairs(k_pool, v_pool, slots, positions, asked, kv_end)


@numba.njit(cache=True, nogil=True, error_model="numpy")
def _gemm_phases(gemm, q, qtype, packed, out, claims, phase, sync, t, n_threads, spin_limit, kv):
    """A team's matmul of an input every member has quantized its part of into q (xq, xd, xs, ..): meet, then
    claim chunks of the weight groups and meet again (out is whole after it), asking for kv's keys and values
    between chunks (`_gemm_claimed`). False when the team was given up at a barrier: leave the region then."""
    if not team.barrier(sync, t, n_threads, spin_limit):
        return False
    _gemm_claimed(gemm, qtype, packed, q, out, 0, claims, phase, t, n_threads, kv)
    return team.barrier(sync, t, n_threads, spin_limit)


@numba.njit(cache=True, nogil=True, error_model="numpy")
def _layer_matmuls(gemm, q, li, m_lo, m_hi, qtypes, cols, w_layer, out, claims, sync, t, n_threads, spin_limit,
                   kv):
    """A layer's matrices m_lo .. m_hi - 1 (one phase: q, k and v, or gate and up, or one) times the input the
    members quantized into q, each into its columns of out: meet, claim chunks of one matrix after another (an
    empty matrix has none), meet again. The first asks for kv's keys and values as it goes (`_gemm_claimed`).
    False when the team was given up."""
    if not team.barrier(sync, t, n_threads, spin_limit):
        return False
    run = kv
    for m in range(m_lo, m_hi):
        packed = w_layer[m]
        if packed.shape[0] == 0:
            continue
        _gemm_claimed(gemm, qtypes[li, m], packed, q, out, cols[li, m], claims, _PHASES * li + m, t, n_threads,
                      run)
        run = (kv[0], kv[1], kv[2], kv[3], kv[5], kv[5])  # asked for once
    return team.barrier(sync, t, n_threads, spin_limit)


# The step's quantized inputs, rows of `DecodePlan.sums`: of the q|k|v, gate|up and output matmuls (width D), of
# the out matmul, of the down matmul.
SUMS_D, SUMS_A, SUMS_F = range(3)


@numba.njit(cache=True, nogil=True, error_model="numpy")
def _quantized(n_seqs, width, sums):
    """Buffers (xq, xd, xs, xh, xc) for n_seqs rows of `width` values quantized (`_quantize_blocks`): xh the halves'
    sums and xc the corrections, each empty where sums (a row of `DecodePlan.sums`) does not ask for it. Flat: a
    parallel region takes no tuple within a tuple (`_member_quantized` nests them inside it)."""
    qk = int8dot.QK
    return (np.empty((n_seqs, width), dtype=np.int8), np.empty((n_seqs, width // qk), dtype=np.float32),
            np.empty((n_seqs, width // qk), dtype=np.float32),
            np.empty((n_seqs, width // 16 if sums[int8dot.XS_HALVES] else 0), dtype=np.float32),
            np.empty((n_seqs, width // qk if sums[int8dot.XS_CORRECTIONS] else 0), dtype=np.float32))


@numba.njit(cache=True, nogil=True, error_model="numpy", inline="always")
def _member_quantized(q):
    """q (`_quantized`) as a member takes it: (xq, xd, (xs, xh, xc)), the sums indexed by their kind
    (`int8dot.XS_SCALED` ..), each a view without an owner (`team.unowned`)."""
    u = team.unowned
    return u(q[0]), u(q[1]), (u(q[2]), u(q[3]), u(q[4]))


@numba.njit(cache=True, nogil=True, error_model="numpy")
def _team_member(gemm, t, n_threads, spin_limit, sync, claims, x, h, qtypes, cols, weights, ffn_norms,
                 next_norms, eps, k_pools, v_pools, slots, positions, cos_table, sin_table, scale, first_item,
                 per_subgroup, n_subgroups, max_splits, part_max, part_sum, part_acc, qkv, attn, o, gate_up, ff, d, q_d,
                 q_a, q_f, out_qtype, out_packed, logits):
    """Member t's part of `_team_step`'s layers and output matmul: each phase does its share (`team.span`, or
    what it claims: `_gemm_claimed`, the attention items) and a barrier separates phases that read what another
    wrote."""
    n_seqs = x.shape[0]
    n_items = first_item[n_seqs]
    scale32 = np.float32(scale)
    attn_rows = attn.reshape(n_seqs, attn.shape[1] * attn.shape[2])
    r_lo, r_hi = team.span(n_seqs, t, n_threads)
    scratch = ops._item_scratch(per_subgroup, attn.shape[2])  # this member's, for all its attention items
    # Every phase ends at a barrier; one that fails (the team given up) leaves the layers, and every later
    # barrier fails at once.
    u = team.unowned
    # The attention items are cut by sequence into one part per member (member u's: those of sequences
    # span(n_seqs, u)), each taken by its owner first (`team.claim_own_first`); the down and q|k|v matmuls ask
    # for the owner's keys and values ahead (`_gemm_claimed`), so that its items find them in its own caches.
    # The empty run is for the other matmuls.
    item_starts = np.empty(n_threads + 1, dtype=np.int64)
    for part in range(n_threads + 1):  # span(n, parts, parts) starts at n: the end of the last part
        item_starts[part] = first_item[team.span(n_seqs, part, n_threads)[0]]
    n_kv_heads = k_pools[0].shape[2]
    group = attn.shape[1] // n_kv_heads  # query heads per kv head
    kv_lo, kv_hi = r_lo * n_kv_heads, r_hi * n_kv_heads
    no_kv = (u(k_pools[0]), u(v_pools[0]), slots, positions, kv_hi, kv_hi)
    head_dim = attn.shape[2]
    # With no sequence's keys split into runs, an item's output rows are final when it ends, and it quantizes
    # them for the out matmul itself (whole blocks of QK values: head_dim a multiple of QK): no barrier between
    # the attention and that quantization.
    items_quantize = max_splits == 1 and head_dim % int8dot.QK == 0
    head_blocks = head_dim // int8dot.QK
    # h (B, D), the input of a layer's q|k|v and gate|up matmuls and of the output matmul, is quantized by the
    # member that computed its rows (`_add_rmsnorm_quantize_rows`); the first layer's came normed from outside.
    n_layers = len(weights[Q])
    _quantize_rows(h, q_d, r_lo, r_hi)
    for li in range(n_layers):
        phase = _PHASES * li
        # Taken from the lists once a layer, as views without an owner: each list access increments and
        # decrements the array's reference count, an atomic on a word both threads share.
        k_pool, v_pool = u(k_pools[li]), u(v_pools[li])
        w_layer = (u(weights[Q][li]), u(weights[K][li]), u(weights[V][li]), u(weights[OUT][li]),
                   u(weights[GATE][li]), u(weights[UP][li]), u(weights[DOWN][li]))
        this_kv = (k_pool, v_pool, slots, positions, kv_lo, kv_hi)
        if not _layer_matmuls(gemm, q_d, li, Q, V + 1, qtypes, cols, w_layer, qkv, claims, sync, t,
                              n_threads, spin_limit, this_kv):
            break
        while True:  # items differ in length (each sequence its own context): claimed one by one
            item = team.claim_own_first(claims, phase + ATTN, t, n_threads, item_starts)
            if item >= n_items:
                break
            if item + 1 < n_items:
                _prefetch_item_kv(item + 1, first_item, per_subgroup, n_subgroups, group, k_pool, v_pool, slots,
                                  positions)
            b, h0, n_heads = ops._attention_qkv_item(item, qkv, False, cos_table, sin_table, k_pool, v_pool, slots,
                                                     positions, scale32, attn, first_item, per_subgroup, n_subgroups,
                                                     part_max, part_sum, part_acc, scratch, False)
            if items_quantize:  # the item's output rows are whole: quantized for the out matmul at once
                _quantize_blocks(attn_rows, q_a, b, h0 * head_blocks, (h0 + n_heads) * head_blocks)
        if not items_quantize:  # a member's rows once every item is done: merged (split runs), then quantized
            if not team.barrier(sync, t, n_threads, spin_limit):
                break
            if max_splits > 1:
                ops._merge_split_rows(positions, part_max, part_sum, part_acc, attn, r_lo, r_hi)
            _quantize_rows(attn_rows, q_a, r_lo, r_hi)
        if not _layer_matmuls(gemm, q_a, li, OUT, OUT + 1, qtypes, cols, w_layer, o, claims, sync, t,
                              n_threads, spin_limit, no_kv):
            break
        _add_rmsnorm_quantize_rows(x, o, ffn_norms[li], eps, h, q_d, r_lo, r_hi)
        if not _layer_matmuls(gemm, q_d, li, GATE, UP + 1, qtypes, cols, w_layer, gate_up, claims, sync, t,
                              n_threads, spin_limit, no_kv):
            break
        # The down matmul's input: the SwiGLU of gate|up, computed block by block as it is quantized.
        _swiglu_quantize_span(gate_up, ff, q_f, t, n_threads)
        # The down matmul asks for this member's share of the next layer's keys and values as it goes.
        next_kv = no_kv if li + 1 == n_layers else (u(k_pools[li + 1]), u(v_pools[li + 1]), slots, positions,
                                                     kv_lo, kv_hi)
        if not _layer_matmuls(gemm, q_f, li, DOWN, DOWN + 1, qtypes, cols, w_layer, d, claims, sync, t,
                              n_threads, spin_limit, next_kv):
            break
        _add_rmsnorm_quantize_rows(x, d, next_norms[li], eps, h, q_d, r_lo, r_hi)
    _gemm_phases(gemm, q_d, out_qtype, out_packed, logits, claims, _PHASES * n_layers, sync, t, n_threads,
                 spin_limit, no_kv)


@numba.njit(parallel=True, cache=True, nogil=True, error_model="numpy")
def _team_step(n_threads, spin_limit, tokens, embd_qtype, embd_data, first_norm, out_qtype, out_packed, out_rows,
               gemm, sums, qtypes, rows, cols, w_q, w_k, w_v, w_out, w_gate, w_up, w_down, ffn_norms, next_norms, eps,
               k_pools, v_pools, slots, positions, n_rot, freq_base, freq_scale, scale, n_q_heads):
    """The whole decode step: the rotation's angles, embedding rows and the first norm here, then the layers and
    the output matrix by a team of n_threads in one parallel region, iteration t of its prange member t
    (`_team_member`). Returns (logits (B, out_rows), completed): not completed when the team was given up (a
    member never reached a barrier); a team of one, run again, then rewrites every cache row this one may have
    written, with the same values. Every value is computed by the same function, with the same arguments,
    whatever n_threads and whoever computes it: the same bits. gemm: the address of the matmuls' kernels
    (`int8dot.gemm_address`, `int8k.gemm_address`).

    One compiled level, not two (the region was a function of its own, `_team_layers`): numba compiles the
    region's body again into the function that holds it, so each level above the member recompiled all of it
    (`gemm_call`); the default model's first decode step compiled ~5 s sooner this way on the 2-core Zen 4 VM
    (`bench/cold_start.py`, 2026-12-05: 53.6 and 51.4 s against 58.7 and 56.0 s).

    The seven matrix lists come as seven arguments (w_q .. w_down), not as one tuple: numba types a tuple of
    typed lists in Python, on every call, and this call runs cache-cold (the step before evicted the
    interpreter's data). From the Python call to the body's first instruction, the default model on the 2-core
    Zen 4 VM (2026-12-05, cycle counter read on both sides): 130-165 us a step with the tuple, 32-40 us with the
    seven lists. `bench/batch_ab.py --pairs 4 --rounds 4`, two runs against the tuple: batch 1 239 -> 258 and
    251 -> 262 tok/s, batch 8 1001 -> 1044 and 1027 -> 1009.

    The buffers: q_d / q_a / q_f (xq, xd, xs, xh, xc) for inputs of width D, n_q_heads * head_dim and the FFN
    width (xh, the halves' sums, and xc, the corrections, empty where no matrix reads them: `sums`). Each member
    gets the shared arrays as views without an owner (`team.unowned`: no reference counting on the words both
    threads would write, per call)."""
    weights = (w_q, w_k, w_v, w_out, w_gate, w_up, w_down)
    n_seqs = tokens.shape[0]
    for t in range(n_seqs):
        if tokens[t] < 0 or tokens[t] >= embd_data.shape[0]:
            raise IndexError("token id out of range for the embedding")
    k0 = k_pools[0]
    n_kv_heads, head_dim = k0.shape[2], k0.shape[3]
    # The attention's work items are the same in every layer (same positions): laid out, and checked, once.
    first_item, per_subgroup, n_subgroups, max_splits = ops._decode_layout(
        n_seqs, n_q_heads, n_kv_heads, k0.shape[0], k0.shape[1], slots, positions, True)
    for li in range(1, len(k_pools)):
        if k_pools[li].shape != k0.shape or v_pools[li].shape != k0.shape:
            raise ValueError("the layers' caches differ in shape")
    part_max, part_sum, part_acc = ops._split_states(n_seqs, n_q_heads, head_dim, max_splits)
    cos_table = np.empty((n_seqs, n_rot // 2), dtype=np.float32)
    sin_table = np.empty((n_seqs, n_rot // 2), dtype=np.float32)
    ops._rope_angles(positions, n_rot, freq_base, freq_scale, cos_table, sin_table)
    dim = first_norm.shape[0]
    x = np.empty((n_seqs, dim), dtype=np.float32)
    quant._dequant_rows(embd_qtype, embd_data, tokens, x, quant._N16)
    h = np.empty_like(x)
    ops._rmsnorm_rows(x, first_norm, eps, h)
    width = rows[0, DOWN]
    qkv_rows = rows[0, Q] + rows[0, K] + rows[0, V]
    ffn = (rows[0, GATE] + rows[0, UP]) // 2
    q_d = _quantized(n_seqs, dim, sums[SUMS_D])
    q_a = _quantized(n_seqs, n_q_heads * head_dim, sums[SUMS_A])
    q_f = _quantized(n_seqs, ffn, sums[SUMS_F])
    logits = np.empty((n_seqs, out_rows), dtype=np.float32)
    sync = team.new_sync(n_threads)
    n_layers = len(weights[Q])
    claims = team.new_part_claims(_PHASES * n_layers + 1, n_threads)
    qkv = np.empty((n_seqs, qkv_rows), dtype=np.float32)
    attn = np.empty((n_seqs, n_q_heads, head_dim), dtype=np.float32)
    o = np.empty((n_seqs, width), dtype=np.float32)
    gate_up = np.empty((n_seqs, 2 * ffn), dtype=np.float32)
    ff = np.empty((n_seqs, ffn), dtype=np.float32)
    d = np.empty((n_seqs, width), dtype=np.float32)
    u = team.unowned
    for t in numba.prange(n_threads):
        # np.int64(t): one compiled `_team_member`, not two (see ops._njit_parallel).
        _team_member(gemm, np.int64(t), n_threads, spin_limit, u(sync), u(claims), u(x), u(h),
                     u(qtypes), u(cols), weights, u(ffn_norms), u(next_norms), eps, k_pools, v_pools,
                     u(slots), u(positions), u(cos_table), u(sin_table), scale, u(first_item), per_subgroup,
                     n_subgroups, max_splits, u(part_max), u(part_sum), u(part_acc), u(qkv), u(attn), u(o), u(gate_up),
                     u(ff), u(d), _member_quantized(q_d), _member_quantized(q_a), _member_quantized(q_f),
                     out_qtype, u(out_packed), u(logits))
    return logits, sync[team.ABORT] == 0


@dataclass
class DecodeEnds:
    """The embedding and the output matrix, when the compiled step can take them too: a quantized embedding
    (dequantized row by row as `quant.dequantize_rows` does) and an int8-path output matrix."""

    embd_qtype: int
    embd_data: np.ndarray
    first_norm: np.ndarray
    out_qtype: int
    out_packed: np.ndarray
    out_rows: int


@dataclass
class DecodePlan:
    """A model's weights as `decode_layers` takes them, built once. Columns and lists in the order Q, K, V, OUT,
    GATE, UP, DOWN; a matrix stacked at load (q|k|v, gate|up) stands in the first of its columns, the others
    empty (no rows, no packed groups)."""

    qtypes: np.ndarray  # int64 (L, 7): the kernel type of each matrix (`_kernel_of`)
    rows: np.ndarray  # int64 (L, 7): each matrix's output features
    cols: np.ndarray  # int64 (L, 7): where its outputs start in its phase's output (q|k|v, gate|up side by side)
    weights: tuple[Any, ...]  # seven typed lists of the packed matrices (`QWeight.int8_packed`)
    ffn_norms: np.ndarray  # float32 (L, D)
    next_norms: np.ndarray  # float32 (L, D): the next layer's attention norm, the output norm after the last
    head_dim: int
    # Whether some matrix takes int8k's kernels, not int8dot's (the step then calls the gemm of every type:
    # `int8k.gemm_address`).
    k_quants: bool = False
    # int64 (3, 3): whether quantized input i (`SUMS_D` ..) carries sums of kind k (`int8dot.XS_SCALED` ..): the
    # kinds its matrices read in the xs slot (`int8k.xs_kind`; d * sum(q) always).
    sums: np.ndarray = field(default_factory=lambda: np.array([[1, 0, 0]] * 3, dtype=np.int64))
    ends: DecodeEnds | None = None  # set when the whole step, embedding to logits, runs compiled

    def gemm_address(self) -> int:
        """The address of the gemm that runs this plan's matrices: int8k's (every type) where some matrix takes its
        kernels, else int8dot's (`gemm_call`). Compiled on first use, not when the plan is built: the side
        process that compiles the prefill path builds plans too."""
        return int8k.gemm_address() if self.k_quants else int8dot.gemm_address()

    @property
    def layers_path(self) -> bool:
        """Whether `decode_layers` (the layers alone, matmul by matmul, each quantizing its own input) can run this
        plan: int8dot's types, q|k|v and gate|up stacked. Other plans run as whole steps only."""
        empty = self.rows[:, [K, V, UP]]
        return not self.k_quants and not empty.any()


def _kernel_of(w: Any) -> int:
    """The type whose kernels (int8dot's or int8k's) run w's packed rows (`kernel_qtype`)."""
    return int8k.kernel_qtype(w.qtype) if w.qtype in int8k.TYPES else int8dot.kernel_qtype(w.qtype)


def _xs_kind(qtype: int) -> int:
    """What the kernels of kernel type `qtype` read in the xs slot of their input (`int8k.xs_kind`)."""
    return int(int8k.xs_kind(int(qtype), int8k._UNSIGNED))


# A stand-in for the empty columns (K and V, UP) of a stacked matrix: no groups to claim.
_NO_MATRIX = np.zeros((0, 1), dtype=np.uint8)
_NO_MATRIX.flags.writeable = False


def _layer_matrices(blk: Any) -> list[Any] | None:
    """A layer's seven matrices in plan order (None for the empty columns of a stacked one), or None when a
    matrix is missing or of a type without int8 kernels, or q, k, v or gate, up apart with rows that are not a
    multiple of 8 (side by side in one output, a last partial group would write into the next matrix's)."""
    qkv = [blk.w_qkv, None, None] if blk.w_qkv is not None else [blk.wq, blk.wk, blk.wv]
    gate_up = [blk.w_gate_up, None] if blk.w_gate_up is not None else [blk.w_gate, blk.w_up]
    layer = [*qkv, blk.wo, *gate_up, blk.w_down]
    apart = [*qkv[1:], *gate_up[1:]]
    if any(w is not None for w in apart) and any(w is not None and w.rows % int8dot.LANES for w in qkv + gate_up):
        return None
    for column, w in enumerate(layer):
        if w is None and column not in (K, V, UP):
            return None
        if w is not None and getattr(w, "qtype", None) not in int8dot.INT8_TYPES | int8k.TYPES:
            return None
    return layer


def build_plan(blocks: list[Any], output_norm: np.ndarray, head_dim: int, int8: bool, tok_embd: Any = None,
               output: Any = None) -> DecodePlan | None:
    """The plan for a llama model's blocks, or None when they are not all of the shape this path serves. With
    the embedding and output matrices given and of a shape it takes, the plan covers the whole step. A model
    whose matrices are not all int8dot's types, or not all stacked, runs whole steps only (`layers_path`):
    None when its embedding or output matrix is not of a shape the step takes."""
    if not int8 or int8dot.INT8_ISA is None or head_dim % ops.LANES or not blocks:
        return None
    layers = [_layer_matrices(blk) for blk in blocks]
    if any(layer is None for layer in layers):
        return None
    # The matrices every step reads, packed side by side on huge pages (the output matrix too, where the step
    # takes it: it is read as often).
    matrices = [w for layer in layers for w in layer if w is not None]
    if getattr(output, "qtype", None) in quant.INT8_KERNEL_TYPES:
        matrices.append(output)
    quant.pack_on_huge_pages(matrices)
    lists = tuple(List() for _ in range(7))
    qtypes = np.zeros((len(blocks), 7), dtype=np.int64)
    rows = np.zeros((len(blocks), 7), dtype=np.int64)
    for li, layer in enumerate(layers):
        for column, w in enumerate(layer):
            lists[column].append(_NO_MATRIX if w is None else w.int8_packed)
            if w is not None:
                qtypes[li, column] = _kernel_of(w)
                rows[li, column] = w.rows
            else:  # an empty column takes its phase's first matrix's type: it asks for no sums of its own
                qtypes[li, column] = qtypes[li, column - 1]
    ends = None
    if (tok_embd is not None and output is not None and getattr(tok_embd, "qtype", quant.F32) != quant.F32
            and tok_embd.qtype in quant.SUPPORTED_TYPES
            and getattr(output, "qtype", None) in int8dot.INT8_TYPES | int8k.TYPES):
        out_qtype = _kernel_of(output)
        ends = DecodeEnds(embd_qtype=tok_embd.qtype, embd_data=tok_embd.data,
                          first_norm=np.asarray(blocks[0].attn_norm, dtype=np.float32),
                          out_qtype=out_qtype, out_packed=output.int8_packed, out_rows=output.rows)
    cols = np.zeros_like(rows)
    cols[:, K], cols[:, V], cols[:, UP] = rows[:, Q], rows[:, Q] + rows[:, K], rows[:, GATE]
    kinds = np.vectorize(_xs_kind, otypes=[np.int64])(qtypes)
    readers = [np.concatenate([kinds[:, [Q, K, V, GATE, UP]].ravel(), [_xs_kind(ends.out_qtype)] if ends else []]),
               kinds[:, OUT], kinds[:, DOWN]]  # the kinds each input's matrices read (SUMS_D, SUMS_A, SUMS_F)
    sums = np.array([[kind == int8dot.XS_SCALED or (read == kind).any() for kind in range(3)] for read in readers],
                    dtype=np.int64)
    all_int8dot = all(w is None or w.qtype in int8dot.INT8_TYPES for layer in layers for w in layer) and (
        ends is None or output.qtype in int8dot.INT8_TYPES)
    plan = DecodePlan(
        ends=ends, qtypes=qtypes, rows=rows, cols=cols, weights=lists, sums=sums,
        k_quants=not all_int8dot,
        ffn_norms=np.stack([np.asarray(blk.ffn_norm, dtype=np.float32) for blk in blocks]),
        next_norms=np.stack([np.asarray(b.attn_norm, dtype=np.float32) for b in blocks[1:]]
                            + [np.asarray(output_norm, dtype=np.float32)]),
        head_dim=head_dim,
    )
    return plan if ends is not None or plan.layers_path else None


def kernel_pools(pools: list[np.ndarray]) -> Any:
    """One layer list of KV caches as the kernels take them (a typed list of `ops.kernel_view`s)."""
    views = List()
    for pool in pools:
        views.append(ops.kernel_view(pool))
    return views


def _rows(head_dim: int, slots: np.ndarray, positions: np.ndarray, n_rot: int, freq_base: float,
          freq_scale: float) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """A step's slots and positions as int32, and the rotation's angle tables for them."""
    ops._check_n_rot(n_rot, head_dim)
    slots, positions = np.asarray(slots, dtype=np.int32), np.asarray(positions, dtype=np.int32)
    return (slots, positions, *ops._angle_tables(positions, n_rot, float(freq_base), float(freq_scale)))


def decode_layers(plan: DecodePlan, x: np.ndarray, h: np.ndarray, eps: float, k_pools: Any, v_pools: Any,
                  slots: np.ndarray, positions: np.ndarray, n_q_heads: int, n_rot: int, freq_base: float,
                  freq_scale: float, scale: float, threads: int) -> None:
    """Every layer of a decode step (one token per sequence, distinct slots): x (B, D) the residual stream and
    h (B, D) its first attention norm on entry; on return x is the last layer's residual and h its output
    norm. k_pools / v_pools from `kernel_pools`. Rotation as `ops.rope_qkv_into_cache` with neox False. Plans
    of `DecodePlan.layers_path` only."""
    if not plan.layers_path:
        raise ValueError("this plan runs as whole decode steps only")
    slots, positions, cos_table, sin_table = _rows(plan.head_dim, slots, positions, n_rot, freq_base, freq_scale)
    w = plan.weights
    _layers(plan.gemm_address(), x, h, plan.qtypes, plan.rows, w[Q], w[OUT], w[GATE], w[DOWN],
            plan.ffn_norms, plan.next_norms, float(eps), k_pools, v_pools, slots, positions, cos_table, sin_table,
            float(scale), n_q_heads, 4 * threads)


def _team_size(threads: int) -> int:
    """Threads for `_team_step`, or 1 where it must not run: its barriers need every iteration of its prange on
    a thread of its own, at once, which OpenMP's static schedule gives (one iteration per thread when there are
    as many as threads); a work-stealing layer (tbb) may run two on one thread, and numba may have fewer
    threads than asked."""
    global _omp
    if _omp is None:
        try:
            _omp = numba.threading_layer() == "omp"
        except ValueError:  # no parallel kernel has run yet: ask again next time
            return 1
    return min(threads, numba.get_num_threads()) if _omp else 1


_omp: bool | None = None
# Steps a team gave up on (a member never reached a barrier) and a team of one redid; the tests read it.
team_fallbacks = 0


def step_args(plan: DecodePlan, tokens: np.ndarray, eps: float, k_pools: Any, v_pools: Any, slots: np.ndarray,
              positions: np.ndarray, n_q_heads: int, n_rot: int, freq_base: float, freq_scale: float, scale: float
              ) -> tuple[Any, ...]:
    """`_team_step`'s arguments after its first two."""
    ends = plan.ends
    ops._check_n_rot(n_rot, plan.head_dim)
    # The angle tables are made inside the compiled step: this Python runs cache-cold after every step.
    return (np.ascontiguousarray(tokens, dtype=np.int64), ends.embd_qtype, ends.embd_data, ends.first_norm,
            ends.out_qtype, ends.out_packed, ends.out_rows, plan.gemm_address(), plan.sums,
            plan.qtypes, plan.rows, plan.cols, *plan.weights, plan.ffn_norms, plan.next_norms, float(eps),
            k_pools, v_pools, np.asarray(slots, dtype=np.int32), np.asarray(positions, dtype=np.int32), n_rot,
            float(freq_base), float(freq_scale), float(scale), n_q_heads)


def decode_step(plan: DecodePlan, tokens: np.ndarray, eps: float, k_pools: Any, v_pools: Any, slots: np.ndarray,
                positions: np.ndarray, n_q_heads: int, n_rot: int, freq_base: float, freq_scale: float, scale: float,
                threads: int) -> np.ndarray:
    """A whole decode step in one compiled call (plan.ends set): token ids (B,) -> logits (B, output rows), as
    the embedding, `decode_layers` and the output matmul give them. Raises IndexError for a token id outside the
    embedding, ValueError for a slot or position outside the caches or two rows on one slot.

    The step runs as one team of `threads` threads (`_team_step`: one parallel region, barriers between its
    phases), or of one where the threading layer cannot promise a thread per member (`_team_size`)."""
    global team_fallbacks
    args = step_args(plan, tokens, eps, k_pools, v_pools, slots, positions, n_q_heads, n_rot, freq_base, freq_scale,
                     scale)
    logits, completed = _team_step(_team_size(threads), team.SPIN_LIMIT, *args)
    if completed:
        return logits
    # A member never reached a barrier. A team of one always completes, and writes every cache row the team
    # may have written, with the same values.
    team_fallbacks += 1
    log.warning("decode step: the thread team was given up (%d so far); redone on one thread", team_fallbacks)
    return _team_step(1, team.SPIN_LIMIT, *args)[0]
