from __future__ import annotations

import numpy as np

from pantheon.engine.repetition import RepetitionDetector


def first_trigger(tokens: list[int], **kw: int) -> int | None:
    d = RepetitionDetector(**kw)
    for i, t in enumerate(tokens):
        if d.push(t):
            return i
    return None


def test_varied_text_never_triggers() -> None:
    rng = np.random.default_rng(0)
    assert first_trigger(rng.integers(0, 5000, 3000).tolist()) is None


def test_repeated_span_triggers_after_enough_copies() -> None:
    span = list(range(100, 150))  # period 50
    out = list(range(1000, 1020)) + span * 10
    hit = first_trigger(out)
    assert hit is not None
    # 256 periodic tokens are needed: the span's 5th copy plus a few tokens.
    assert 20 + 50 * 5 <= hit + 1 <= 20 + 50 * 6


def test_single_token_run_needs_min_span() -> None:
    assert first_trigger([7] * 255) is None
    assert first_trigger([7] * 300) == 255


def test_short_repeats_below_threshold_do_not_trigger() -> None:
    assert first_trigger([1, 2, 3] * 30) is None  # 90 tokens < min_span
