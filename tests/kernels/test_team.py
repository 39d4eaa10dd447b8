"""The team's shared-out work: a member's chunks cover its part exactly once, and claims (of each member's own
part first, by items or by chunks) hand each piece to one member only, also when members race for them."""

from __future__ import annotations

import numba
import numpy as np
import pytest

from pantheon.kernels.cpu import team


@pytest.mark.parametrize("total", [0, 1, 2, 7, 60, 120, 384, 6144])
@pytest.mark.parametrize("min_chunk", [1, 2, 16])
def test_own_chunks_cover_the_part_once_in_order_and_shrink(total: int, min_chunk: int) -> None:
    chunks = []
    for c in range(total + 3):
        lo, hi = team.own_chunk(c, total, min_chunk)
        if lo >= hi:
            assert lo == hi
            continue
        chunks.append((lo, hi))
    if total == 0:
        assert chunks == []
        return
    assert [lo for lo, _ in chunks] == [0] + [hi for _, hi in chunks[:-1]]  # contiguous, in claim order
    assert chunks[-1][1] == total
    sizes = [hi - lo for lo, hi in chunks]
    assert all(a >= b for a, b in zip(sizes, sizes[1:]))  # large first, small last
    assert all(s >= min_chunk for s in sizes[:-1])
    assert sizes[0] >= min(total, max(min_chunk, total * 3 // 4))  # most of the part in one go
    if total >= 8 * min_chunk:  # what is left after it is cut smaller, for another member to help with
        assert len(chunks) >= 2 and sizes[-1] <= max(min_chunk, total // 8)
    assert team.own_chunk(total + 5, total, min_chunk)[0] == team.own_chunk(total + 5, total, min_chunk)[1]


@numba.njit(parallel=True, cache=False)
def _race_chunks(part_claims, taken_by, wrong_own, n_threads, min_chunk):  # type: ignore[no-untyped-def]
    total = taken_by.shape[0]
    for t in numba.prange(n_threads):
        while True:
            lo, hi, own = team.claim_own_chunk(part_claims, 1, np.int64(t), n_threads, total, min_chunk)
            if lo >= hi:
                break
            p_lo, p_hi = team.span(total, t, n_threads)
            if own != (p_lo <= lo and hi <= p_hi):
                wrong_own[t] -= 1_000_000  # "own" must say whether the chunk lies in t's part
            for i in range(lo, hi):
                taken_by[i] = taken_by[i] * 10 + t + 1  # a second taker would show as a second digit


@pytest.mark.parametrize("total", [1, 5, 97, 5000])
@pytest.mark.parametrize("min_chunk", [1, 8])
def test_racing_members_claim_every_chunk_exactly_once(total: int, min_chunk: int) -> None:
    n_threads = max(2, min(4, numba.config.NUMBA_NUM_THREADS))
    taken_by = np.zeros(total, dtype=np.int64)
    wrong_own = np.zeros(n_threads, dtype=np.int64)
    part_claims = team.new_part_claims(2, n_threads)
    _race_chunks(part_claims, taken_by, wrong_own, n_threads, min_chunk)
    assert np.all((taken_by >= 1) & (taken_by <= n_threads)), "a piece of a chunked phase done twice or never"
    assert not wrong_own.any(), "a chunk said to be of the member's own part was not, or the reverse"
    assert not part_claims[:n_threads * team.LINE_WORDS].any(), "phase 0's counters were touched"


def test_a_member_takes_its_own_chunks_in_order_then_helps_the_next() -> None:
    """One member alone: its own part's chunks first, in order, then the other members' from t + 1 on."""
    part_claims = team.new_part_claims(1, 3)
    total = 30  # parts of 10: member 0 0..9, member 1 10..19, member 2 20..29
    got = []
    while True:
        lo, hi, own = team.claim_own_chunk(part_claims, 0, 1, 3, total, 2)
        if lo >= hi:
            break
        got.append((lo, hi, own))
    assert got == [(10, 17, True), (17, 19, True), (19, 20, True), (20, 27, False), (27, 29, False),
                   (29, 30, False), (0, 7, False), (7, 9, False), (9, 10, False)]
    # Another member now finds every part taken.
    assert team.claim_own_chunk(part_claims, 0, 0, 3, total, 2)[:2] == (total, total)


@numba.njit(parallel=True, cache=False)
def _race_in_parts(part_claims, starts, taken_by, n_threads):  # type: ignore[no-untyped-def]
    total = starts[n_threads]
    for t in numba.prange(n_threads):
        while True:
            index = team.claim_own_first(part_claims, 1, np.int64(t), n_threads, starts)
            if index >= total:
                break
            taken_by[index] = taken_by[index] * 10 + t + 1  # a second taker would show as a second digit


@pytest.mark.parametrize("parts", [[0, 0], [0, 5], [3, 0], [4, 4], [1, 7, 0, 3], [50, 2000, 1]])
def test_parts_are_claimed_exactly_once_by_racing_members(parts: list[int]) -> None:
    n_threads = len(parts)
    starts = np.concatenate([[0], np.cumsum(parts)]).astype(np.int64)
    taken_by = np.zeros(starts[-1], dtype=np.int64)
    part_claims = team.new_part_claims(2, n_threads)
    _race_in_parts(part_claims, starts, taken_by, n_threads)
    assert np.all((taken_by >= 1) & (taken_by <= n_threads)), "an index taken twice or never"
    assert not part_claims[:n_threads * team.LINE_WORDS].any(), "phase 0's counters were touched"


def test_a_member_takes_its_own_part_in_order_then_helps_the_next() -> None:
    """One member alone: its own part first, in order, then the other members' from t + 1 on, each in order."""
    starts = np.array([0, 3, 5, 9], dtype=np.int64)  # member 0: 0..2, member 1: 3..4, member 2: 5..8
    part_claims = team.new_part_claims(1, 3)
    order = [team.claim_own_first(part_claims, 0, 1, 3, starts) for _ in range(11)]
    assert order == [3, 4, 5, 6, 7, 8, 0, 1, 2, 9, 9]
    # Another member now finds every part taken.
    assert team.claim_own_first(part_claims, 0, 0, 3, starts) == 9


@numba.extending.intrinsic
def _meminfo_address(typingctx, array):  # type: ignore[no-untyped-def]
    """The address of an array's owner (its meminfo), 0 for none."""

    def codegen(context, builder, signature, args):  # type: ignore[no-untyped-def]
        view = context.make_array(signature.args[0])(context, builder, args[0])
        return builder.ptrtoint(view.meminfo, numba.core.cgutils.intp_t)

    return numba.types.intp(array), codegen


@numba.njit(cache=False)
def _through_unowned(a):  # type: ignore[no-untyped-def]
    view = team.unowned(a)
    part = view[1:3]  # views of it have no owner either
    part[0] = 5.0  # row 1
    return (_meminfo_address(a), _meminfo_address(view), _meminfo_address(part), view.ctypes.data == a.ctypes.data,
            view.shape == a.shape, view.strides == a.strides, view.sum())


def test_unowned_views_share_the_memory_without_an_owner() -> None:
    """The team passes its shared arrays down as views without an owner, so that reference counting does
    nothing on them; they must read and write the same memory, with the same shape and strides."""
    a = np.arange(12.0).reshape(4, 3)[:, ::2]  # strided
    owner, view_owner, part_owner, same_data, same_shape, same_strides, total = _through_unowned(a)
    assert owner != 0 and view_owner == 0 and part_owner == 0
    assert same_data and same_shape and same_strides
    assert (a[1] == 5.0).all() and a[2, 0] == 6.0
    assert total == a.sum()
