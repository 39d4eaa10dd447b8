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

Only the shape of model that the int8 path serves whole takes it: every layer's q|k|v and gate|up stacked,
all four matrices Q4_1 or Q8_0 (`int8dot.INT8_TYPES`) on a CPU with the int8 kernels, a head dim that is a
multiple of 16 (the attention intrinsics). Anything else keeps the Python loop. When the embedding is
quantized and the output matrix is an int8-path type too (the default model), `decode_step` also takes
the embedding rows, the first norm and the output matmul: token ids in, logits out, one GIL round trip.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import numba
import numpy as np
from numba.typed import List

from pantheon.kernels.cpu import attend_ir, int8dot, ops, quant, team

log = logging.getLogger("pantheon.kernels")

# The matrices of a layer, in the order of `DecodePlan.qtypes` / `rows` columns.
QKV, OUT, GATE_UP, DOWN = 0, 1, 2, 3
# Claimed phases of a layer in `_team_layers`: its four matmuls, phase _PHASES * layer + the matrix's column
# above; the output matmul is phase _PHASES * n_layers. (The attention's items are claimed part by part, from
# `part_claims`, a row per layer.)
_PHASES = 4


@numba.njit(cache=True, nogil=True, error_model="numpy")
def _matmul(qtype, packed, rows, x, flip, n_chunks):
    out = np.empty((x.shape[0], rows), dtype=np.float32)
    int8dot._matmul(qtype, packed, x, out, flip, n_chunks)
    return out


@numba.njit(cache=True, nogil=True, error_model="numpy")
def _layers(x, h, qtypes, rows, flips, w_qkv, w_out, w_gate_up, w_down, ffn_norms, next_norms, eps, k_pools,
            v_pools, slots, positions, cos_table, sin_table, scale, n_q_heads, n_chunks):
    n_seqs = x.shape[0]
    head_dim = k_pools[0].shape[3]
    for li in range(len(w_qkv)):
        qkv = _matmul(qtypes[li, QKV], w_qkv[li], rows[li, QKV], h, flips[li, QKV], n_chunks)
        attn = np.empty((n_seqs, n_q_heads, head_dim), dtype=np.float32)
        ops._attention_decode_qkv_kernel(qkv, False, cos_table, sin_table, k_pools[li], v_pools[li], slots,
                                         positions, scale, attn)
        o = _matmul(qtypes[li, OUT], w_out[li], rows[li, OUT], attn.reshape(n_seqs, n_q_heads * head_dim),
                    flips[li, OUT], n_chunks)
        ops._add_rmsnorm_rows(x, o, ffn_norms[li], eps, h)
        ff = ops._swiglu_stacked_rows(_matmul(qtypes[li, GATE_UP], w_gate_up[li], rows[li, GATE_UP], h,
                                     flips[li, GATE_UP], n_chunks))
        d = _matmul(qtypes[li, DOWN], w_down[li], rows[li, DOWN], ff, flips[li, DOWN], n_chunks)
        ops._add_rmsnorm_rows(x, d, next_norms[li], eps, h)


@numba.njit(cache=True, nogil=True, error_model="numpy")
def _quantize_blocks(x, xq, xd, xs, flip, row, b_lo, b_hi):
    """`int8dot._quantize`'s blocks b_lo .. b_hi - 1 of row `row` of x."""
    for block in range(b_lo, b_hi):
        int8dot._quantize_block(x, xq, xd, xs, row, block, flip)


@numba.njit(cache=True, nogil=True, error_model="numpy")
def _quantize_rows(x, xq, xd, xs, flip, r_lo, r_hi):
    """`int8dot._quantize`'s blocks of rows r_lo .. r_hi - 1 of x."""
    int8dot._quantize_rows_serial(x[r_lo:r_hi], xq[r_lo:r_hi], xd[r_lo:r_hi], xs[r_lo:r_hi], flip)


@numba.njit(cache=True, nogil=True, error_model="numpy")
def _swiglu_quantize_span(gate_up, ff, xq, xd, xs, flip, part, parts):
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
        _quantize_blocks(ff, xq, xd, xs, flip, row, first, end)
        i += end - first


@numba.njit(cache=True, nogil=True, error_model="numpy")
def _add_rmsnorm_quantize_rows(residual, delta, weight, eps, out, xq, xd, xs, flip, r_lo, r_hi):
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
        _quantize_rows(out, xq, xd, xs, flip, r, r + 1)


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


@numba.njit(cache=True, nogil=True, error_model="numpy")
def _gemm_claimed(qtype, packed, xq, xd, xs, out, claims, phase, n_threads, kv):
    """This member's part of a matmul the team shares out by claiming chunks of weight groups (`team.claim_chunk`).
    An output's bits do not depend on who computes it. The smallest chunk is about a microsecond of work.

    kv = (k_pool, v_pool, slots, positions, first, end): between its chunks the member also asks for the keys
    and values of (sequence, kv head) pairs first .. end - 1 (`_prefetch_kv_pairs`), in step with the matmul's
    progress; an empty run asks for nothing. The layers' down matmul passes the member's part of the next
    layer's, and the q|k|v matmul that layer's again: the weights stream through every cache level during a
    step and evict the caches' keys and values, so decode attention waited on memory for them (a lone launch
    at batch 8, context ~110, 2 threads: 40 us a layer with its data in cache, 82 us with it evicted), and at
    batch 8 those matmuls are bound by their arithmetic, not their weights, which leaves the memory bus room.
    (The q|k|v matmul's asking, with the attention items taken by their owner first: `bench/phase_profile.py
    --levels 8 --attention-twice` on the 2-core Zen 4 VM, 2026-12-05, two processes a tree, alternating: the
    attention 2640-3050 k cycles a step against 3170-3360 without both, the q|k|v matmul 1700-1960 against
    1630-1710; the owner-first claiming alone, in another such run, 2940-3115 against 3045-3283.)"""
    k_pool, v_pool, slots, positions, kv_first, kv_end = kv
    n_groups = packed.shape[0]
    min_chunk = max(2, 16 // xq.shape[0])
    # Claimed in pairs of groups: the wide kernels take two a call (int8dot.INT8_WIDE).
    n_pairs = (n_groups + 1) // 2
    asked = kv_first
    while True:
        lo, hi = team.claim_chunk(claims, phase, n_pairs, n_threads, (min_chunk + 1) // 2)
        if lo >= hi:
            break
        # Up to the same fraction of the pairs as of the matmul claimed so far.
        upto = kv_first + (kv_end - kv_first) * hi // n_pairs
        _prefetch_kv_pairs(k_pool, v_pool, slots, positions, asked, upto)
        asked = max(asked, upto)
        int8dot._gemm_groups(qtype, packed, xq, xd, xs, out, 2 * lo, min(n_groups, 2 * hi))
    _prefetch_kv_pairs(k_pool, v_pool, slots, positions, asked, kv_end)


@numba.njit(cache=True, nogil=True, error_model="numpy")
def _gemm_phases(q, qtype, packed, out, claims, phase, sync, t, n_threads, spin_limit, kv):
    """A team's matmul of an input every member has quantized its part of into q (xq, xd, xs): meet, then
    claim chunks of the weight groups and meet again (out is whole after it), asking for kv's keys and values
    between chunks (`_gemm_claimed`). False when the team was given up at a barrier: leave the region then."""
    if not team.barrier(sync, t, n_threads, spin_limit):
        return False
    _gemm_claimed(qtype, packed, q[0], q[1], q[2], out, claims, phase, n_threads, kv)
    return team.barrier(sync, t, n_threads, spin_limit)


@numba.njit(parallel=True, cache=True, nogil=True, error_model="numpy")
def _team_layers(n_threads, spin_limit, sync, claims, part_claims, x, h, qtypes, rows, flips, w_qkv, w_out, w_gate_up,
                 w_down, ffn_norms, next_norms, eps, k_pools, v_pools, slots, positions, cos_table, sin_table, scale,
                 first_item, per_subgroup, n_subgroups, max_splits, part_max, part_sum, part_acc, qkv, attn, o, gate_up,
                 ff, d, q_d, q_a, q_f, out_qtype, out_packed, out_flip, logits):
    """`_layers` and the output matmul in one parallel region: iteration t of the prange is member t of the team
    (`_team_member`). Every value is computed by the same function, with the same arguments, whatever
    n_threads and whoever computes it: the same bits.
    q_d / q_a / q_f: (xq, xd, xs) buffers for inputs of width D, n_q_heads * head_dim, and the FFN width.

    Each member gets the shared arrays as views without an owner (`team.unowned`: no reference counting on
    the words both threads would write, per call below)."""
    u = team.unowned
    for t in numba.prange(n_threads):
        # np.int64(t): one compiled `_team_member`, not two (see ops._njit_parallel).
        _team_member(np.int64(t), n_threads, spin_limit, u(sync), u(claims), u(part_claims), u(x), u(h), u(qtypes),
                     u(rows), u(flips), w_qkv, w_out, w_gate_up, w_down, u(ffn_norms), u(next_norms), eps, k_pools,
                     v_pools, u(slots), u(positions), u(cos_table), u(sin_table), scale, u(first_item), per_subgroup,
                     n_subgroups, max_splits, u(part_max), u(part_sum), u(part_acc), u(qkv), u(attn), u(o), u(gate_up),
                     u(ff), u(d), (u(q_d[0]), u(q_d[1]), u(q_d[2])), (u(q_a[0]), u(q_a[1]), u(q_a[2])),
                     (u(q_f[0]), u(q_f[1]), u(q_f[2])), out_qtype, u(out_packed), out_flip, u(logits))


@numba.njit(cache=True, nogil=True, error_model="numpy")
def _team_member(t, n_threads, spin_limit, sync, claims, part_claims, x, h, qtypes, rows, flips, w_qkv, w_out,
                 w_gate_up, w_down, ffn_norms, next_norms, eps, k_pools, v_pools, slots, positions, cos_table,
                 sin_table, scale, first_item, per_subgroup, n_subgroups, max_splits, part_max, part_sum, part_acc, qkv,
                 attn, o, gate_up, ff, d, q_d, q_a, q_f, out_qtype, out_packed, out_flip, logits):
    """Member t's part of `_team_layers`: each phase does its share (`team.span`, or what it claims:
    `_gemm_claimed`, the attention items) and a barrier separates phases that read what another wrote."""
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
    _quantize_rows(h, q_d[0], q_d[1], q_d[2], flips[0, QKV] if len(w_qkv) else out_flip, r_lo, r_hi)
    for li in range(len(w_qkv)):
        phase = _PHASES * li
        # Taken from the lists once a layer, as views without an owner: each list access increments and
        # decrements the array's reference count, an atomic on a word both threads share.
        k_pool, v_pool = u(k_pools[li]), u(v_pools[li])
        w_layer = (u(w_qkv[li]), u(w_out[li]), u(w_gate_up[li]), u(w_down[li]))
        this_kv = (k_pool, v_pool, slots, positions, kv_lo, kv_hi)
        if not _gemm_phases(q_d, qtypes[li, QKV], w_layer[QKV], qkv, claims, phase + QKV, sync, t, n_threads,
                            spin_limit, this_kv):
            break
        while True:  # items differ in length (each sequence its own context): claimed one by one
            item = team.claim_own_first(part_claims, li, t, n_threads, item_starts)
            if item >= n_items:
                break
            b, h0, n_heads = ops._attention_qkv_item(item, qkv, False, cos_table, sin_table, k_pool, v_pool, slots,
                                                     positions, scale32, attn, first_item, per_subgroup, n_subgroups,
                                                     part_max, part_sum, part_acc, scratch)
            if items_quantize:  # the item's output rows are whole: quantized for the out matmul at once
                _quantize_blocks(attn_rows, q_a[0], q_a[1], q_a[2], flips[li, OUT], b, h0 * head_blocks,
                                 (h0 + n_heads) * head_blocks)
        if not items_quantize:  # a member's rows once every item is done: merged (split runs), then quantized
            if not team.barrier(sync, t, n_threads, spin_limit):
                break
            if max_splits > 1:
                ops._merge_split_rows(positions, part_max, part_sum, part_acc, attn, r_lo, r_hi)
            _quantize_rows(attn_rows, q_a[0], q_a[1], q_a[2], flips[li, OUT], r_lo, r_hi)
        if not _gemm_phases(q_a, qtypes[li, OUT], w_layer[OUT], o, claims, phase + OUT, sync, t, n_threads, spin_limit,
                            no_kv):
            break
        _add_rmsnorm_quantize_rows(x, o, ffn_norms[li], eps, h, q_d[0], q_d[1], q_d[2], flips[li, GATE_UP], r_lo,
                                   r_hi)
        if not _gemm_phases(q_d, qtypes[li, GATE_UP], w_layer[GATE_UP], gate_up, claims, phase + GATE_UP, sync, t,
                            n_threads, spin_limit, no_kv):
            break
        # The down matmul's input: the SwiGLU of gate|up, computed block by block as it is quantized.
        _swiglu_quantize_span(gate_up, ff, q_f[0], q_f[1], q_f[2], flips[li, DOWN], t, n_threads)
        # The down matmul asks for this member's share of the next layer's keys and values as it goes.
        next_kv = no_kv if li + 1 == len(w_qkv) else (u(k_pools[li + 1]), u(v_pools[li + 1]), slots, positions,
                                                       kv_lo, kv_hi)
        if not _gemm_phases(q_f, qtypes[li, DOWN], w_layer[DOWN], d, claims, phase + DOWN, sync, t, n_threads,
                            spin_limit, next_kv):
            break
        _add_rmsnorm_quantize_rows(x, d, next_norms[li], eps, h, q_d[0], q_d[1], q_d[2],
                                   out_flip if li + 1 == len(w_qkv) else flips[li + 1, QKV], r_lo, r_hi)
    _gemm_phases(q_d, out_qtype, out_packed, logits, claims, _PHASES * len(w_qkv), sync, t, n_threads, spin_limit,
                 no_kv)


@numba.njit(cache=True, nogil=True, error_model="numpy")
def _team_step(n_threads, spin_limit, tokens, embd_qtype, embd_data, first_norm, out_qtype, out_packed, out_rows,
               out_flip, qtypes, rows, flips, w_qkv, w_out, w_gate_up, w_down, ffn_norms, next_norms, eps, k_pools,
               v_pools, slots, positions, n_rot, freq_base, freq_scale, scale, n_q_heads):
    """The whole decode step (the rotation's angles, embedding rows, the first norm, the layers and the output
    matrix) by a team of n_threads in one parallel region (`_team_layers`). Returns (logits (B, out_rows),
    completed): not completed when the team was given up (a member never reached a barrier); a team of one,
    run again, then rewrites every cache row this one may have written, with the same values."""
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
    ffn = rows[0, GATE_UP] // 2
    qk = int8dot.QK
    q_d = (np.empty((n_seqs, dim), dtype=np.int8), np.empty((n_seqs, dim // qk), dtype=np.float32),
           np.empty((n_seqs, dim // qk), dtype=np.float32))
    a_dim = n_q_heads * head_dim
    q_a = (np.empty((n_seqs, a_dim), dtype=np.int8), np.empty((n_seqs, a_dim // qk), dtype=np.float32),
           np.empty((n_seqs, a_dim // qk), dtype=np.float32))
    q_f = (np.empty((n_seqs, ffn), dtype=np.int8), np.empty((n_seqs, ffn // qk), dtype=np.float32),
           np.empty((n_seqs, ffn // qk), dtype=np.float32))
    logits = np.empty((n_seqs, out_rows), dtype=np.float32)
    sync = team.new_sync(n_threads)
    claims = team.new_claims(_PHASES * len(w_qkv) + 1)
    part_claims = team.new_part_claims(len(w_qkv), n_threads)  # the layers' attention items
    _team_layers(n_threads, spin_limit, sync, claims, part_claims, x, h, qtypes, rows, flips, w_qkv, w_out, w_gate_up,
                 w_down, ffn_norms, next_norms, eps, k_pools, v_pools, slots, positions, cos_table, sin_table, scale,
                 first_item, per_subgroup, n_subgroups, max_splits, part_max, part_sum, part_acc,
                 np.empty((n_seqs, rows[0, QKV]), dtype=np.float32),
                 np.empty((n_seqs, n_q_heads, head_dim), dtype=np.float32),
                 np.empty((n_seqs, width), dtype=np.float32), np.empty((n_seqs, rows[0, GATE_UP]), dtype=np.float32),
                 np.empty((n_seqs, ffn), dtype=np.float32), np.empty((n_seqs, width), dtype=np.float32),
                 q_d, q_a, q_f, out_qtype, out_packed, out_flip, logits)
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
    out_flip: np.int32


@dataclass
class DecodePlan:
    """A model's weights as `decode_layers` takes them, built once."""

    qtypes: np.ndarray  # int64 (L, 4)
    rows: np.ndarray  # int64 (L, 4): each matrix's output features
    flips: np.ndarray  # int32 (L, 4): `int8dot._flip` of each matrix
    w_qkv: Any  # typed lists of the packed matrices (int8dot.pack_weight)
    w_out: Any
    w_gate_up: Any
    w_down: Any
    ffn_norms: np.ndarray  # float32 (L, D)
    next_norms: np.ndarray  # float32 (L, D): the next layer's attention norm, the output norm after the last
    head_dim: int
    ends: DecodeEnds | None = None  # set when the whole step, embedding to logits, runs compiled


def _kernel_of(w: Any) -> tuple[int, np.int32]:
    """The type whose int8dot kernels run w's packed rows (`int8dot.kernel_qtype`), and the activations' flip
    for them."""
    qtype = int8dot.kernel_qtype(w.qtype)
    return qtype, np.int32(int8dot._flip(qtype, int8dot.INT8_ISA))


def build_plan(blocks: list[Any], output_norm: np.ndarray, head_dim: int, int8: bool, tok_embd: Any = None,
               output: Any = None) -> DecodePlan | None:
    """The plan for a llama model's blocks, or None when they are not all of the shape this path serves. With
    the embedding and output matrices given and of a shape it takes, the plan covers the whole step."""
    if not int8 or int8dot.INT8_ISA is None or head_dim % ops.LANES or not blocks:
        return None
    matrices = []
    for blk in blocks:
        layer = (blk.w_qkv, blk.wo, blk.w_gate_up, blk.w_down)
        if any(w is None or getattr(w, "qtype", None) not in int8dot.INT8_TYPES for w in layer):
            return None
        matrices.append(layer)
    lists = [List() for _ in range(4)]
    for layer in matrices:
        for target, w in zip(lists, layer):
            target.append(w.int8_packed)
    kernels = [[_kernel_of(w) for w in layer] for layer in matrices]
    ends = None
    if (tok_embd is not None and output is not None and getattr(tok_embd, "qtype", quant.F32) != quant.F32
            and tok_embd.qtype in quant.SUPPORTED_TYPES and getattr(output, "qtype", None) in int8dot.INT8_TYPES):
        out_qtype, out_flip = _kernel_of(output)
        ends = DecodeEnds(embd_qtype=tok_embd.qtype, embd_data=tok_embd.data,
                          first_norm=np.asarray(blocks[0].attn_norm, dtype=np.float32),
                          out_qtype=out_qtype, out_packed=output.int8_packed, out_rows=output.rows, out_flip=out_flip)
    return DecodePlan(
        ends=ends,
        qtypes=np.array([[qtype for qtype, _ in layer] for layer in kernels], dtype=np.int64),
        rows=np.array([[w.rows for w in layer] for layer in matrices], dtype=np.int64),
        flips=np.array([[flip for _, flip in layer] for layer in kernels], dtype=np.int32),
        w_qkv=lists[0], w_out=lists[1], w_gate_up=lists[2], w_down=lists[3],
        ffn_norms=np.stack([np.asarray(blk.ffn_norm, dtype=np.float32) for blk in blocks]),
        next_norms=np.stack([np.asarray(b.attn_norm, dtype=np.float32) for b in blocks[1:]]
                            + [np.asarray(output_norm, dtype=np.float32)]),
        head_dim=head_dim,
    )


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
    norm. k_pools / v_pools from `kernel_pools`. Rotation as `ops.rope_qkv_into_cache` with neox False."""
    slots, positions, cos_table, sin_table = _rows(plan.head_dim, slots, positions, n_rot, freq_base, freq_scale)
    _layers(x, h, plan.qtypes, plan.rows, plan.flips, plan.w_qkv, plan.w_out, plan.w_gate_up, plan.w_down,
            plan.ffn_norms, plan.next_norms, float(eps), k_pools, v_pools, slots, positions, cos_table,
            sin_table, float(scale), n_q_heads, 4 * threads)


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
            ends.out_qtype, ends.out_packed, ends.out_rows, ends.out_flip, plan.qtypes, plan.rows, plan.flips,
            plan.w_qkv, plan.w_out, plan.w_gate_up, plan.w_down, plan.ffn_norms, plan.next_norms, float(eps),
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
