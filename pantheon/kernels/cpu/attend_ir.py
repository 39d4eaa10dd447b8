"""LLVM IR for the two inner loops of decode attention, over the query heads that share one kv head.

Grouped-query attention gives several query heads (SmolLM2: 3) the same keys and values, so decode attention
works on a kv head's whole group at once: each key or value row is loaded and widened to float32 once and
used by every head of the group. Written as numba loops, that still cost a horizontal sum per key and head
(a dot product's 16 lanes folded down to one) and a load and store of each head's accumulator per value
row, because numba's arrays give LLVM no way to keep them in registers. These intrinsics emit the loops
on 16-lane float32 vectors instead:

- `key_scores_intrinsic(width)`: the scaled dot products of `width` query rows with 16 consecutive key rows.
  Each key leaves one 16-lane partial sum per head; the 16 partials of a head are folded together pairwise
  (two shuffles and an add per pair, 15 pairs), which ends with key i's full sum in lane i. About 3
  operations per key and head instead of ~11 for folding each key alone. It also raises each head's running
  max over the 16 scores, folded in registers, which the softmax needs next.
- `value_accumulate_intrinsic(width)`: acc[h] += w[h, i] * v[i] over a run of value rows, with the
  accumulators held in registers across the whole run (4 chunks of 16 lanes of every head at a time). The
  caller zeroes the negligible weights; 0 * v adds nothing to an accumulator (for finite v), which is what
  skipping the row did.
- `prefetch_rows_intrinsic()`: software prefetches of a run of key or value rows, asked for a tile ahead.

Measured on the 2-core Zen 4 VM (SmolLM2's 9 query heads on 3 kv heads, head dim 64, float16 cache):
batch 8 at context 100, 43 -> 30 us per layer with data in cache, 1.6x on one thread; at
context 1000, 1.6x; 32 query heads on 8 (head dim 128) 2.5x. Inside a decode step the caches come from
memory (the step's weights evict them) and the gain shrinks to 5-10% at short contexts.

The head dimension must be a multiple of 16 (the caller checks; other sizes take the plain numba loops).
A float16 cache is read as its uint16 bits and widened with F16C's vcvtph2ps; a float32 cache as it is.
The fma per value row and head is the same operation, in the same order, as the numba loop it replaces.
"""

from __future__ import annotations

from typing import Any

from llvmlite import ir
from numba import types
from numba.extending import intrinsic

from pantheon.kernels.cpu import HOST_CPU_FEATURES
from pantheon.kernels.cpu.llvm_ir import byte_ptr, call, counted_loop, fma, splat

LANES = 16  # float32 lanes per vector (one zmm; two ymm on AVX2, which LLVM splits it into)
MAX_WIDTH = 4  # query heads per call
# Key rows per pass over the head dimension (KEYS_PER_LOOP x width 16-lane accumulators), and 16-lane chunks
# of the head dimension per pass over the value rows (CHUNKS_PER_BLOCK x width accumulators). AVX-512 has 32
# registers of 16 lanes; AVX2 has 16 of 8, where 4 and 4 spilled: at context ~450, batch 8, 2 threads on
# Zen 3, the decode step took 18.9 ms with 4 and 4, 17.1 with 2 and 2, 16.0 with 2 and 1 (3 runs each). The
# counts change no result: each key's sum and each accumulator's rows go in the same order.
_WIDE = "+avx512f" in HOST_CPU_FEATURES
KEYS_PER_LOOP = 4 if _WIDE else 2
CHUNKS_PER_BLOCK = 4 if _WIDE else 1

_LINE = 64  # bytes per cache line (x86)
_i32, _i64 = ir.IntType(32), ir.IntType(64)
_f32 = ir.FloatType()
_vf = ir.VectorType(_f32, LANES)


def _load_f32(builder: ir.IRBuilder, ptr: ir.Value, half: bool) -> ir.Value:
    """16 cache values at the i8* `ptr` as float32."""
    if half:
        raw = builder.load(builder.bitcast(ptr, ir.VectorType(ir.IntType(16), LANES).as_pointer()), align=2)
        return builder.fpext(builder.bitcast(raw, ir.VectorType(ir.HalfType(), LANES)), _vf)
    return builder.load(builder.bitcast(ptr, _vf.as_pointer()), align=4)


def _fold(builder: ir.IRBuilder, x: ir.Value, y: ir.Value, level: int) -> ir.Value:
    """x and y each hold 2**level keys of LANES >> level partial lanes; the result holds x's keys then y's,
    each folded to half as many lanes (its first half of lanes plus its second)."""
    width = LANES >> level
    lo, hi = [], []
    for offset in (0, LANES):  # x's lanes, then y's in the concatenated shuffle input
        for key in range(1 << level):
            first = offset + key * width
            lo += range(first, first + width // 2)
            hi += range(first + width // 2, first + width)
    mask = ir.VectorType(_i32, LANES)
    return builder.fadd(builder.shuffle_vector(x, y, ir.Constant(mask, lo)),
                        builder.shuffle_vector(x, y, ir.Constant(mask, hi)))


def _larger(builder: ir.IRBuilder, a: ir.Value, b: ir.Value) -> ir.Value:
    """b > a ? b : a (numba's max(a, b) on floats): a NaN b leaves a."""
    return builder.select(builder.fcmp_ordered(">", b, a), b, a)


def _raise_max(builder: ir.IRBuilder, current: ir.Value, values: ir.Value) -> ir.Value:
    """The scalar max(current, values[0], ..., values[15]) with numba's max, NaN values ignored; the lanes are
    folded pairwise (every value not NaN, the order changes nothing)."""
    values = builder.select(builder.fcmp_ordered("ord", values, values), values,
                            ir.Constant(_vf, [float("-inf")] * LANES))
    width = LANES // 2
    while width:
        mask = ir.Constant(ir.VectorType(_i32, LANES), [(i + width) % LANES for i in range(LANES)])
        values = _larger(builder, values, builder.shuffle_vector(values, values, mask))
        width //= 2
    return _larger(builder, current, builder.extract_element(values, ir.Constant(_i32, 0)))


def key_scores_operands(context: Any, builder: ir.IRBuilder, signature: Any, args: Any) -> tuple[Any, ...]:
    """A key-scores intrinsic's arguments (q_rows, h0, keys, kvh, j0, n, scale, scores, col, maxes) in its codegen:
    (q_rows, keys, scores, maxes as numba array structs, (h0, kvh, j0, n, scale, col), whether the keys are
    float16 bits)."""
    q_t, _, keys_t, _, _, _, _, scores_t, _, maxes_t = signature.args
    arrays = [context.make_array(t)(context, builder, args[i]) for t, i in ((q_t, 0), (keys_t, 2), (scores_t, 7),
                                                                              (maxes_t, 9))]
    scalars = (args[1], args[3], args[4], args[5], args[6], args[8])
    return (*arrays, scalars, keys_t.dtype == types.uint16)


def key_scores_intrinsic(width: int) -> Any:
    """An intrinsic (q_rows, h0, keys, kvh, j0, n, scale, scores, col, maxes): for query rows
    q_rows[h0 : h0 + width] (float32 (G, hd)) and key rows keys[j0 + i, kvh] (a cache (ctx, Hkv, hd), any strides
    but a contiguous last axis), i < n <= 16, stores scale * dot into scores[h0 + h, col + i] (float32
    (G, >= col + 16)), and raises maxes[h0 + h] (float32 (G,)) to the largest of those n scores. Lanes i >= n
    repeat key n - 1 and are stored too: the caller leaves them unread.

    The max ignores NaN scores, as `new = max(new, score)` over them does in numba (b > a ? b : a): it is
    the same number in any order, folded here in registers (4 shuffles) instead of a serial scalar chain
    over the stored scores, which took ~3 cycles a key and head."""

    def key_scores(typingctx, q_rows, h0, keys, kvh, j0, n, scale, scores, col, maxes):
        return types.void(q_rows, h0, keys, kvh, j0, n, scale, scores, col, maxes), codegen

    def codegen(context, builder, signature, args):
        q, k, s, m, (h0, kvh, j0, n, scale, col), half = key_scores_operands(context, builder, signature, args)
        item = 2 if half else 4
        q_stride, s_stride = (builder.extract_value(a.strides, 0) for a in (q, s))
        k_row_stride = builder.extract_value(k.strides, 0)
        k_head = builder.mul(kvh, builder.extract_value(k.strides, 1))
        n_chunks = builder.sdiv(builder.extract_value(q.shape, 1), ir.Constant(_i64, LANES))
        q_rows = [byte_ptr(builder, q.data, builder.mul(builder.add(h0, ir.Constant(_i64, h)), q_stride))
                  for h in range(width)]
        last = builder.sub(n, ir.Constant(_i64, 1))
        pending: list[dict[int, ir.Value]] = [{} for _ in range(width)]
        for first in range(0, LANES, KEYS_PER_LOOP):
            rows = []
            for i in range(first, first + KEYS_PER_LOOP):
                key = builder.add(j0, builder.select(builder.icmp_signed(">", n, ir.Constant(_i64, i)),
                                                     ir.Constant(_i64, i), last))
                rows.append(byte_ptr(builder, k.data, builder.add(builder.mul(key, k_row_stride), k_head)))

            def chunk(c, accs, rows=rows):
                k_at = builder.mul(c, ir.Constant(_i64, LANES * item))
                q_at = builder.mul(c, ir.Constant(_i64, LANES * 4))
                qs = [builder.load(builder.bitcast(builder.gep(q_rows[h], [q_at]), _vf.as_pointer()), align=4)
                      for h in range(width)]
                updated = []
                for r, row in enumerate(rows):
                    kv = _load_f32(builder, builder.gep(row, [k_at]), half)
                    updated += [fma(builder, qs[h], kv, accs[r * width + h]) for h in range(width)]
                return updated

            partials = counted_loop(builder, n_chunks, [ir.Constant(_vf, None)] * (KEYS_PER_LOOP * width), chunk)
            for r in range(KEYS_PER_LOOP):
                for h in range(width):  # a binary counter of folded groups: keys 2m and 2m + 1 meet first
                    value, level = partials[r * width + h], 0
                    while level in pending[h]:
                        value = _fold(builder, pending[h].pop(level), value, level)
                        level += 1
                    pending[h][level] = value
        scale_v = splat(builder, scale, LANES)
        for h in range(width):
            (total,) = pending[h].values()
            at = builder.add(builder.mul(builder.add(h0, ir.Constant(_i64, h)), s_stride),
                             builder.mul(col, ir.Constant(_i64, 4)))
            scaled = builder.fmul(total, scale_v)
            builder.store(scaled, builder.bitcast(byte_ptr(builder, s.data, at), _vf.as_pointer()), align=4)
            head_max = builder.bitcast(byte_ptr(builder, m.data, builder.mul(builder.add(h0, ir.Constant(
                _i64, h)), builder.extract_value(m.strides, 0))), _f32.as_pointer())
            builder.store(_raise_max(builder, builder.load(head_max), scaled), head_max)
        return context.get_dummy_value()

    key_scores.__name__ = key_scores.__qualname__ = f"attend_key_scores_{width}"
    return intrinsic(key_scores)


def value_accumulate_intrinsic(width: int) -> Any:
    """An intrinsic (acc, h0, weights, values, kvh, j0, n): for h < width and i < n (n >= 1),
    acc[h0 + h] += weights[h0 + h, i] * values[j0 + i, kvh], in order of i; acc float32 (G, hd), weights
    float32 (G, >= n), values a cache (ctx, Hkv, hd) with any strides but a contiguous last axis."""

    def value_accumulate(typingctx, acc, h0, weights, values, kvh, j0, n):
        return types.void(acc, h0, weights, values, kvh, j0, n), codegen

    def codegen(context, builder, signature, args):
        acc_t, _, w_t, values_t, _, _, _ = signature.args
        a = context.make_array(acc_t)(context, builder, args[0])
        w = context.make_array(w_t)(context, builder, args[2])
        v = context.make_array(values_t)(context, builder, args[3])
        h0, kvh, j0, n = args[1], args[4], args[5], args[6]
        half = values_t.dtype == types.uint16
        item = 2 if half else 4
        a_stride, w_stride = (builder.extract_value(x.strides, 0) for x in (a, w))
        v_row_stride = builder.extract_value(v.strides, 0)
        first_row = builder.add(builder.mul(j0, v_row_stride), builder.mul(kvh, builder.extract_value(v.strides, 1)))
        heads = [builder.add(h0, ir.Constant(_i64, h)) for h in range(width)]
        w_rows = [byte_ptr(builder, w.data, builder.mul(head, w_stride)) for head in heads]
        n_chunks = builder.sdiv(builder.extract_value(a.shape, 1), ir.Constant(_i64, LANES))

        def block(first_chunk, n_block):
            """acc[h, chunks first_chunk .. + n_block] += the weighted rows, keys in order."""
            lane0 = builder.mul(first_chunk, ir.Constant(_i64, LANES))
            acc_ptrs = [builder.bitcast(byte_ptr(builder, a.data, builder.add(
                builder.mul(head, a_stride), builder.mul(builder.add(lane0, ir.Constant(_i64, b * LANES)),
                                                         ir.Constant(_i64, 4)))), _vf.as_pointer())
                for head in heads for b in range(n_block)]
            start = [builder.load(ptr, align=4) for ptr in acc_ptrs]
            offset = builder.add(first_row, builder.mul(lane0, ir.Constant(_i64, item)))

            def row(i, accs):
                at = builder.add(offset, builder.mul(i, v_row_stride))
                vals = [_load_f32(builder, byte_ptr(builder, v.data,
                                                    builder.add(at, ir.Constant(_i64, b * LANES * item))), half)
                        for b in range(n_block)]
                updated = []
                for h in range(width):
                    weight = builder.load(builder.gep(builder.bitcast(w_rows[h], _f32.as_pointer()), [i]))
                    weight = splat(builder, weight, LANES)
                    updated += [fma(builder, weight, vals[b], accs[h * n_block + b]) for b in range(n_block)]
                return updated

            for ptr, value in zip(acc_ptrs, counted_loop(builder, n, start, row)):
                builder.store(value, ptr, align=4)

        # Blocks of CHUNKS_PER_BLOCK chunks (width * CHUNKS_PER_BLOCK accumulators in registers), then the rest
        # 2 and 1 at a time.
        n_blocks = builder.sdiv(n_chunks, ir.Constant(_i64, CHUNKS_PER_BLOCK))

        def whole_block(bi, _):
            block(builder.mul(bi, ir.Constant(_i64, CHUNKS_PER_BLOCK)), CHUNKS_PER_BLOCK)
            return []

        counted_loop(builder, n_blocks, [], whole_block, may_be_empty=True)
        done = builder.mul(n_blocks, ir.Constant(_i64, CHUNKS_PER_BLOCK))
        for size in (2, 1):
            left = builder.sub(n_chunks, done)
            with builder.if_then(builder.icmp_signed(">=", left, ir.Constant(_i64, size))):
                block(done, size)
            done = builder.select(builder.icmp_signed(">=", left, ir.Constant(_i64, size)),
                                  builder.add(done, ir.Constant(_i64, size)), done)
        return context.get_dummy_value()

    value_accumulate.__name__ = value_accumulate.__qualname__ = f"attend_value_accumulate_{width}"
    return intrinsic(value_accumulate)


def prefetch_rows_intrinsic(locality: int = 3) -> Any:
    """An intrinsic (cache, kvh, j0, j1): a software prefetch of every cache line of the rows cache[j, kvh] for
    j0 <= j < j1, a cache (ctx, Hkv, hd) with any strides but a contiguous last axis. An empty range prefetches
    nothing. It changes no value: an x86 prefetch never faults or writes. `locality` is llvm.prefetch's: 3
    (prefetcht0) into every level down to L1, for what is read next; 2 (prefetcht1) into L2, for what is read
    after other work that L1 holds (`decode_layers._gemm_claimed`).

    Why: inside a decode step a sequence's keys and values come from memory (the step's weights evicted
    them), in runs of 4 KB pages that the hardware prefetchers do not cross, and each item's first loads
    wait. `_attend_group` asks for each key tile's values and the next tile's keys before it computes the
    current tile's scores. Measured on the 2-core Zen 5 VM (2 threads, batch 8, 128 tokens from prompts of
    41, 30 rounds in alternating processes of bench/batched.py's decoder), together with the per-thread
    scratch of `ops._item_scratch`: batch-8 decode 1086 -> 1222 tok/s at the 90th percentile of rounds,
    medians 895 -> 935; but later A/Bs of this with the other changes of the same stop (the tile max,
    `team.unowned`) against the tree before them found no difference in medians (1109 vs 1115, 30 rounds a
    tree; 1086 vs 1076, 60 rounds). The VM's speed varies +-15% between processes. Over C-ordered caches
    (rows a head apart) a lone launch over caches just evicted took 54 us a layer instead of 102; over the
    backend's head-major pools it moved within the noise (52-81 us either way).
    """

    def prefetch_rows(typingctx, cache, kvh, j0, j1):
        return types.void(cache, kvh, j0, j1), codegen

    def codegen(context, builder, signature, args):
        c = context.make_array(signature.args[0])(context, builder, args[0])
        kvh, j0, j1 = args[1], args[2], args[3]
        row_stride = builder.extract_value(c.strides, 0)
        item = context.get_abi_sizeof(context.get_data_type(signature.args[0].dtype))
        row_bytes = builder.mul(builder.extract_value(c.shape, 2), ir.Constant(_i64, item))
        first = builder.add(builder.mul(j0, row_stride), builder.mul(kvh, builder.extract_value(c.strides, 1)))
        n_rows = builder.sub(j1, j0)
        # llvm.prefetch(address, rw=0 read, locality, cache type=1 data)
        flags = [ir.Constant(_i32, 0), ir.Constant(_i32, locality), ir.Constant(_i32, 1)]

        def lines(start, count):
            def line(m, _):
                ptr = byte_ptr(builder, c.data, builder.add(start, builder.mul(m, ir.Constant(_i64, _LINE))))
                call(builder, "llvm.prefetch.p0i8", ir.VoidType(), [ptr, *flags])
                return []

            counted_loop(builder, count, [], line, may_be_empty=True)

        def line_count(nbytes):
            return builder.sdiv(builder.add(nbytes, ir.Constant(_i64, _LINE - 1)), ir.Constant(_i64, _LINE))

        # Rows one after another (the cpu backend's head-major pools): one run of lines; else row by row.
        with builder.if_else(builder.icmp_signed("==", row_stride, row_bytes)) as (adjacent, apart):
            with adjacent:
                lines(first, line_count(builder.mul(n_rows, row_bytes)))
            with apart:
                def row(j, _):
                    lines(builder.add(first, builder.mul(j, row_stride)), line_count(row_bytes))
                    return []

                counted_loop(builder, n_rows, [], row, may_be_empty=True)
        return context.get_dummy_value()

    prefetch_rows.__name__ = prefetch_rows.__qualname__ = f"attend_prefetch_rows_{locality}"
    return intrinsic(prefetch_rows)
