"""Detects a decode that keeps repeating the same span (`finish_reason: "repetition_loop"`).

Rule: the output ends in a span of period p (1 <= p <= max_period) repeated at least `min_repeats` times,
covering at least `min_span` tokens. For every period we keep the length of the current run of tokens that
equal the token p positions earlier; a run of r tokens means the last r + p tokens have period p. Each new
token updates all periods with one vectorized comparison, so the cost per token is O(max_period) in numpy
(a few microseconds), independent of the output length.
"""

from __future__ import annotations

import numpy as np


class RepetitionDetector:
    def __init__(self, max_period: int = 256, min_repeats: int = 4, min_span: int = 256) -> None:
        self.max_period = max_period
        periods = np.arange(1, max_period + 1)
        # Smallest run length that triggers, per period.
        self._threshold = np.maximum((min_repeats - 1) * periods, min_span - periods)
        self._history = np.full(max_period, -1, dtype=np.int64)  # history[p-1] = token p steps back
        self._runs = np.zeros(max_period, dtype=np.int64)

    def push(self, token: int) -> bool:
        """Record the next generated token; True when the output is now looping."""
        same = self._history == token
        self._runs = np.where(same, self._runs + 1, 0)
        self._history[1:] = self._history[:-1]
        self._history[0] = token
        return bool(np.any(self._runs >= self._threshold))
