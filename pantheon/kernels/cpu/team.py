"""A team of threads kept inside one parallel region, with spin barriers between its phases.

A numba `prange` is a fork and a join of the thread pool: ~1.1 us warm, more when the step's weights have
evicted the pool's state from the caches. A llama decode step written as kernels is ~150 of them (four
matmuls and the attention per layer), and between them runs the serial work no launch pays for: quantizing
a matmul's input rows, the norms, the SwiGLU, while the other thread waits. `prange(n_threads)` with one
iteration per thread, and these barriers between the phases, keeps the team in one region for the whole
step, and lets each phase split its work over the team.

The barrier is a shared counter: each arrival adds one (an atomic add), and a member's k-th barrier lets it
go once the counter reaches k * n_threads (spinning with `pause` until then). The counter
only grows, so no reset races with late leavers. A thread that waits for longer than `SPIN_LIMIT` pauses
(a team member that never came: numba ran two iterations on one thread, or the machine stalled it for
a second) sets the abort word and leaves; every waiter sees it and leaves too, and the caller redoes the
work another way. Atomic operations are sequentially consistent: what a thread wrote before a barrier is
visible to every thread after it.

A phase split into equal static parts waits at its next barrier for its slowest member, and on a 2-core
machine that also serves HTTP the event loop takes a member's core now and then. Phases made of independent
pieces (matmul weight groups, attention items) are claimed instead: each member has a part of the phase and a
counter of its own, taken with an atomic add, and helps with another's part once its own is done
(`claim_own_first` for single items, `claim_own_chunk` for chunks that shrink toward a part's end).
"""

from __future__ import annotations

import numba
import numpy as np
from llvmlite import ir
from numba import types
from numba.extending import intrinsic

# sync words: [arrivals, abort, then one per thread: the barriers it has passed (written by that thread only)]
ARRIVALS, ABORT, PASSED = 0, 1, 2
# Pauses before a waiter gives the team up: ~1-2 s at 30-60 ns a pause, far past any real phase.
SPIN_LIMIT = 30_000_000

_i64 = ir.IntType(64)


def _word_ptr(context, builder, arr_type, arr, index):  # type: ignore[no-untyped-def]
    array = context.make_array(arr_type)(context, builder, arr)
    return builder.gep(array.data, [index])


@intrinsic
def _atomic_add(typingctx, words, index, value):  # type: ignore[no-untyped-def]
    """words[index] += value atomically (sequentially consistent); the value before."""

    def codegen(context, builder, signature, args):  # type: ignore[no-untyped-def]
        ptr = _word_ptr(context, builder, signature.args[0], args[0], args[1])
        return builder.atomic_rmw("add", ptr, args[2], "seq_cst")

    return types.int64(words, index, value), codegen


@intrinsic
def _atomic_load(typingctx, words, index):  # type: ignore[no-untyped-def]
    """words[index], read atomically (sequentially consistent)."""

    def codegen(context, builder, signature, args):  # type: ignore[no-untyped-def]
        ptr = _word_ptr(context, builder, signature.args[0], args[0], args[1])
        return builder.load_atomic(ptr, "seq_cst", 8)

    return types.int64(words, index), codegen


@intrinsic
def _atomic_store(typingctx, words, index, value):  # type: ignore[no-untyped-def]
    """words[index] = value, atomically (sequentially consistent)."""

    def codegen(context, builder, signature, args):  # type: ignore[no-untyped-def]
        ptr = _word_ptr(context, builder, signature.args[0], args[0], args[1])
        builder.store_atomic(args[2], ptr, "seq_cst", 8)
        return context.get_dummy_value()

    return types.void(words, index, value), codegen


@intrinsic
def _pause(typingctx):  # type: ignore[no-untyped-def]
    """The spin-wait hint (x86 `pause`): the waiting core yields its pipeline to its sibling and the bus."""

    def codegen(context, builder, signature, args):  # type: ignore[no-untyped-def]
        fn = builder.module.declare_intrinsic("llvm.x86.sse2.pause", fnty=ir.FunctionType(ir.VoidType(), []))
        builder.call(fn, [])
        return context.get_dummy_value()

    return types.void(), codegen


@intrinsic
def unowned(typingctx, array):  # type: ignore[no-untyped-def]
    """The same array (data, shape, strides) without its owner: a view whose reference counting does nothing.

    numba counts references to an array's owner (an atomic add on its meminfo) for every array argument at
    the entry and exit of every compiled call, and for every view made of it. Inside a team the shared arrays
    (the activations, the caches, the weights, the barrier's words) are passed down to a call per attention
    item and per claimed chunk of a matmul by both threads, so both kept writing the same reference-count
    words. A view without an owner turns those into a test of a null pointer. It must not outlive the array
    it came from: the team makes them from its own arguments, alive until the region ends."""
    if not isinstance(array, types.Array):
        return None

    def codegen(context, builder, signature, args):  # type: ignore[no-untyped-def]
        view = context.make_array(signature.args[0])(context, builder, args[0])
        view.meminfo = ir.Constant(view.meminfo.type, None)
        view.parent = ir.Constant(view.parent.type, None)
        return view._getvalue()

    return array(array), codegen


@numba.njit(cache=True, nogil=True)
def new_sync(n_threads):  # type: ignore[no-untyped-def]
    return np.zeros(PASSED + n_threads, dtype=np.int64)


@numba.njit(cache=True, nogil=True)
def barrier(sync, t, n_threads, spin_limit):  # type: ignore[no-untyped-def]
    """Member t's next barrier in a team of n_threads sharing `sync` (`new_sync`). False when the team was
    given up (by this thread, after spin_limit pauses, or by another): leave the region then; every later
    barrier returns False at once."""
    passed = sync[PASSED + t] + 1
    sync[PASSED + t] = passed
    _atomic_add(sync, ARRIVALS, np.int64(1))
    target = passed * n_threads
    spins = 0
    while _atomic_load(sync, ARRIVALS) < target:
        if _atomic_load(sync, ABORT) != 0:
            return False
        _pause()
        spins += 1
        if spins > spin_limit:
            _atomic_store(sync, ABORT, np.int64(1))
            return False
    return _atomic_load(sync, ABORT) == 0


@numba.njit(cache=True, nogil=True)
def span(total, part, parts):  # type: ignore[no-untyped-def]
    """Part `part` of `parts` near-equal contiguous pieces of range(total): (lo, hi)."""
    return total * part // parts, total * (part + 1) // parts


# int64 words of a cache line: counters that different members write each get a line of their own.
LINE_WORDS = 8


@numba.njit(cache=True, nogil=True)
def new_part_claims(n_phases, n_threads):  # type: ignore[no-untyped-def]
    """Counters for phases whose work is cut into one part per member (`claim_own_first`, `claim_own_chunk`):
    one per phase and member, each on a cache line of its own."""
    return np.zeros(n_phases * n_threads * LINE_WORDS, dtype=np.int64)


@numba.njit(cache=True, nogil=True)
def claim_own_first(part_claims, phase, t, n_threads, starts):  # type: ignore[no-untyped-def]
    """The next index of phase `phase`'s range(starts[n_threads]) for member t, where member u's part is
    starts[u] .. starts[u + 1] - 1 (`new_part_claims`): the next of its own part while there is one, then the
    next of another member's (t + 1, t + 2, ... in turn); starts[n_threads] when every index is taken. Each index
    goes to one member only. A member's own part is the work whose memory it asked for ahead (its caches hold
    it), and its own counter stays in its cache until another member, done with its own part, helps with it:
    one shared counter sent every other item to the other core, and the cache line of the counter with it."""
    for k in range(n_threads):
        u = t + k - n_threads if t + k >= n_threads else t + k
        lo, hi = starts[u], starts[u + 1]
        word = np.int64((phase * n_threads + u) * LINE_WORDS)
        if lo + _atomic_load(part_claims, word) >= hi:
            continue  # taken already: asked without adding, so that the counter's line is not written
        index = lo + _atomic_add(part_claims, word, np.int64(1))
        if index < hi:
            return index
    return starts[n_threads]


@numba.njit(cache=True, nogil=True)
def own_chunk(c, total, min_chunk):  # type: ignore[no-untyped-def]
    """Chunk c of a member's own part of `total` pieces (`claim_own_chunk`): the first three quarters of it
    (at least min_chunk) as chunk 0, then each chunk half of what is left (at least min_chunk), so that a
    member that finishes its part early can help with the other's last small chunks: (lo, hi), empty once c is
    past the end."""
    first = min(total, max(min_chunk, total * 3 // 4))
    if c == 0:
        return 0, first
    lo, k = first, 1
    while lo < total:
        size = max(min_chunk, (total - lo) // 2)
        if k == c:
            return lo, min(total, lo + size)
        lo += size
        k += 1
    return total, total


@numba.njit(cache=True, nogil=True)
def claim_own_chunk(part_claims, phase, t, n_threads, total, min_chunk):  # type: ignore[no-untyped-def]
    """The next chunk of phase `phase`'s range(total) for member t, where member u's part is span(total, u,
    n_threads), each cut by `own_chunk` and counted in `new_part_claims`: the next of its own part while there
    is one, then the next of another member's (t + 1, t + 2, ... in turn). (lo, hi, own): own when the chunk is
    of t's part; empty when every chunk is taken. Each chunk goes to one member only.

    A member's part is one contiguous run of the phase's pieces (for a matmul, of its weights), taken in order:
    its chunks follow one another in memory, so a kernel's prefetch of the next weights at the end of a chunk
    asks for the member's own next chunk, and its counter stays in its cache. One shared counter of guided
    chunks sent every other chunk to the other member, and each claim moved the counter's cache line between
    the cores. On the 2-core Zen 4 VM (2026-12-06, `bench/step_ab.py`, in-process decode, the default model):
    against that shared counter, own parts cut in halves (1/2, 1/4, ...) measured batch 1 +4.5%, batch 8 +3.4%
    (12 rounds); against those halves, own parts taken whole (no help at all) batch 1 +6.2%, batch 8 +2.4%; and
    against whole parts, this cut (3/4 first) batch 1 +0.8%, batch 8 -1.3% (10 rounds each): as fast as whole
    parts, while a member that the machine stalls still leaves the end of its part to the other."""
    for k in range(n_threads):
        u = t + k - n_threads if t + k >= n_threads else t + k
        p_lo, p_hi = span(total, u, n_threads)
        word = np.int64((phase * n_threads + u) * LINE_WORDS)
        if own_chunk(_atomic_load(part_claims, word), p_hi - p_lo, min_chunk)[0] >= p_hi - p_lo:
            continue  # taken already: asked without adding, so that the counter's line is not written
        lo, hi = own_chunk(_atomic_add(part_claims, word, np.int64(1)), p_hi - p_lo, min_chunk)
        if lo < hi:
            return p_lo + lo, p_lo + hi, u == t
    return total, total, False
