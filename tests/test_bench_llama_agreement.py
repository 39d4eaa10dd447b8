"""bench/llama_agreement.py's comparisons, on a made-up engine whose next token is known: a free run decodes
greedily with the end tokens forbidden, a teacher-forced run is fed the given tokens whatever the engine
predicts, and the first difference of two runs is where they part (their length when they never do)."""

from __future__ import annotations

import numpy as np

from bench.llama_agreement import first_difference, free_run, teacher_forced

VOCAB = 8


class Counter:
    """An engine whose logits favour (last token + 1) % VOCAB, then (last token + 2): fed tokens are recorded."""

    def __init__(self) -> None:
        self.fed: list[int] = []

    def _logits(self, last: int) -> np.ndarray:
        row = np.zeros(VOCAB, dtype=np.float32)
        row[(last + 1) % VOCAB] = 2.0
        row[(last + 2) % VOCAB] = 1.0
        return row

    def prefill(self, prompt: list[int]) -> np.ndarray:
        self.fed = list(prompt)
        return self._logits(prompt[-1])

    def step(self, token: int) -> np.ndarray:
        self.fed.append(token)
        return self._logits(token)


def test_free_run_is_greedy_with_the_end_tokens_forbidden() -> None:
    engine = Counter()
    assert free_run(engine, [0], 5, forbidden=[]) == [1, 2, 3, 4, 5]
    # 2 forbidden: after 1 the engine's first choice (2) is out, and its second (3) is taken.
    assert free_run(engine, [0], 4, forbidden=[2]) == [1, 3, 4, 5]
    assert engine.fed == [0, 1, 3, 4]  # the last token is predicted, never fed


def test_teacher_forced_feeds_the_given_tokens() -> None:
    engine = Counter()
    rows = teacher_forced(engine, [0], [5, 0, 7])
    assert rows.shape == (3, VOCAB)
    assert rows.argmax(-1).tolist() == [1, 6, 1]  # after the prompt's 0, after 5, after 0
    assert engine.fed == [0, 5, 0]


def test_first_difference() -> None:
    assert first_difference([1, 2, 3], [1, 2, 3]) == 3
    assert first_difference([1, 2, 3], [1, 4, 3]) == 1
    assert first_difference([9, 2], [1, 2]) == 0
