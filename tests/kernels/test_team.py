"""The team's shared-out work: guided chunks cover a phase exactly once, and claims hand each piece to one
member only, also when members race for them."""

from __future__ import annotations

import numba
import numpy as np
import pytest

from pantheon.kernels.cpu import team


@pytest.mark.parametrize("total", [0, 1, 2, 7, 60, 120, 384, 6144])
@pytest.mark.parametrize("parts", [1, 2, 3, 8])
@pytest.mark.parametrize("min_chunk", [1, 2, 16])
def test_guided_chunks_cover_the_range_once_in_order_and_shrink(total: int, parts: int, min_chunk: int) -> None:
    chunks = []
    for c in range(total + parts + 2):
        lo, hi = team.guided_chunk(c, total, parts, min_chunk)
        if lo >= hi:
            assert (lo, hi) == (total, total) or lo == hi
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
    if total >= 4 * parts * min_chunk:  # the first round shares half of the range
        assert sum(sizes[:parts]) >= total // 2 - parts
    # past the end every claim is empty
    assert team.guided_chunk(total + parts + 5, total, parts, min_chunk)[0] >= team.guided_chunk(
        total + parts + 5, total, parts, min_chunk)[1]


@numba.njit(parallel=True, cache=False)
def _race(claims, in_chunks, as_items, n_threads, min_chunk):  # type: ignore[no-untyped-def]
    total = in_chunks.shape[0]
    for t in numba.prange(n_threads):
        while True:
            lo, hi = team.claim_chunk(claims, 0, total, n_threads, min_chunk)
            if lo >= hi:
                break
            for i in range(lo, hi):
                in_chunks[i] += 1
        while True:
            item = team.claim(claims, 1)
            if item >= total:
                break
            as_items[item] += 1


def test_racing_members_claim_every_piece_exactly_once() -> None:
    n_threads = max(2, min(4, numba.config.NUMBA_NUM_THREADS))
    for total in (1, 5, 97, 5000):
        in_chunks, as_items = np.zeros(total, dtype=np.int64), np.zeros(total, dtype=np.int64)
        claims = team.new_claims(2)
        _race(claims, in_chunks, as_items, n_threads, 1)
        assert np.all(in_chunks == 1), "a piece of a chunked phase done twice or never"
        assert np.all(as_items == 1), "an item done twice or never"
        assert claims[1] >= total  # every member asked once more and got nothing
