"""bench/http_ab.py's pure parts: its environment flags and the summary of the alternating rounds."""

from __future__ import annotations

import pytest

from bench.http_ab import block_sizes, parse_env, summarize


def test_env_flags_are_comma_separated_pairs() -> None:
    assert parse_env("") == {}
    assert parse_env("PANTHEON_STREAM_INTERVAL_MS=30") == {"PANTHEON_STREAM_INTERVAL_MS": "30"}
    assert parse_env("A=1,B=x=y") == {"A": "1", "B": "x=y"}
    with pytest.raises(SystemExit, match="K=V"):
        parse_env("A")


def test_summary_compares_pair_by_pair() -> None:
    rates = {"A": {1: [100.0, 200.0, 100.0], 8: [400.0, 800.0, 400.0]},
             "B": {1: [110.0, 190.0, 105.0], 8: [440.0, 800.0, 480.0]}}
    summary = summarize(rates)
    one, eight = summary["levels"][1], summary["levels"][8]
    # Per-pair ratios 1.10, 0.95, 1.05: B ahead in two pairs, median 1.05.
    assert one["b_over_a"] == pytest.approx(1.05)
    assert (one["b_won"], one["pairs"]) == (2, 3)
    assert one["a_median"] == 100.0 and one["b_median"] == 110.0
    assert eight["b_over_a"] == pytest.approx(1.1) and eight["b_won"] == 2  # 1.10, 1.00 (a tie is not a win), 1.20
    # 8 / 1 per pair: A 4, 4, 4; B 4, 4.21, 4.57.
    assert summary["high_over_low"]["A"] == pytest.approx(4.0)
    assert summary["high_over_low"]["B"] == pytest.approx(800 / 190)


def test_pairs_split_into_blocks_of_their_own_server_starts() -> None:
    assert block_sizes(16, 3) == [6, 5, 5]
    assert block_sizes(12, 3) == [4, 4, 4]
    assert block_sizes(2, 3) == [1, 1]  # never an empty block: one start per pair at most
    assert block_sizes(5, 1) == [5]
    assert block_sizes(5, 0) == [5]
    assert sum(block_sizes(31, 4)) == 31
