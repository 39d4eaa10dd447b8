"""The scheduler in-process, on a tiny model: a turn whose sampling fails ends alone, while the turns batched
with it go on and decode what they decode without it."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import trio

from pantheon.config import ModelOptions, read_env
from pantheon.engine.loader import load_served_model
from pantheon.engine.sampling import SamplingParams
from pantheon.kernels.cpu.backend import CpuBackend
from pantheon.sched.jobs import ErrorEvent, FinishEvent, GenerationJob, TokenEvent
from pantheon.sched.scheduler import Scheduler
from tests.tiny_models import write_tiny_llama

pytestmark = pytest.mark.slow


class AllowsNothing:
    """A token controller whose mask leaves no token: every sampled step of its turn allows none."""

    def __init__(self, vocab: int) -> None:
        self.vocab = vocab

    def forced(self) -> int | None:
        return None

    def mask(self) -> np.ndarray:
        return np.zeros(self.vocab, dtype=bool)

    def advance(self, token: int) -> None:
        raise AssertionError("no token can be accepted")

    def stop_requested(self, token: int) -> bool:
        return True

    def is_finished(self) -> bool:
        return False


async def run_turns(served: Any, jobs: list[GenerationJob]) -> list[list[Any]]:
    """Every job submitted at once (one prefill step for all, then batched decode); each one's events."""
    scheduler = Scheduler(served, max_sessions=2, max_concurrent=4, queue_depth=4)
    events: list[list[Any]] = [[] for _ in jobs]

    async def drain(i: int, channel: Any) -> None:
        async for event in channel:
            events[i].append(event)

    async with trio.open_nursery() as nursery:
        await nursery.start(scheduler.run)
        async with trio.open_nursery() as readers:
            for i, job in enumerate(jobs):
                readers.start_soon(drain, i, scheduler.submit(job))
        nursery.cancel_scope.cancel()
    scheduler.forward_thread.close()
    return events


def test_a_turn_whose_sampling_fails_fails_alone(tmp_path: Path) -> None:
    served = load_served_model(ModelOptions(path=write_tiny_llama(tmp_path / "tiny.gguf"), name="tiny"),
                               read_env({"PANTHEON_HOME": str(tmp_path)}), CpuBackend(1))
    vocab = served.model.vocab_size
    prompt = [int(t) for t in served.tokenizer.encode("Hello there, how are you today?")]

    def job(seed: int, constraint: Any = None) -> GenerationJob:
        return GenerationJob(prompt=prompt, sampling=SamplingParams(temperature=0.8, top_k=40, seed=seed),
                             max_tokens=12, stop_ids=frozenset(), constraint=constraint)

    alone = trio.run(run_turns, served, [job(1), job(2)])
    together = trio.run(run_turns, served, [job(1), job(3, AllowsNothing(vocab)), job(2)])
    (failure,) = together[1]
    assert isinstance(failure, ErrorEvent) and failure.error.status == 500, together[1]
    assert "no token is allowed" in failure.error.message
    for mine, solo in zip((together[0], together[2]), alone):
        tokens = [e.sampled.token_id for e in mine if isinstance(e, TokenEvent)]
        assert tokens == [e.sampled.token_id for e in solo if isinstance(e, TokenEvent)] and len(tokens) == 12
        assert isinstance(mine[-1], FinishEvent) and mine[-1].reason == "length", mine[-1]


def test_sampling_parameters_that_fail_are_the_submitting_requests_error(tmp_path: Path) -> None:
    """A job whose sampler cannot be built (here a penalty window past what a deque holds, which the request
    parser never lets through) fails at submit, in the submitting task: it never reaches the scheduler's loop,
    where the exception ended the server; the turn queued beside it runs."""
    served = load_served_model(ModelOptions(path=write_tiny_llama(tmp_path / "tiny.gguf"), name="tiny"),
                               read_env({"PANTHEON_HOME": str(tmp_path)}), CpuBackend(1))
    prompt = [int(t) for t in served.tokenizer.encode("Hello there")]
    bad = GenerationJob(prompt=prompt, sampling=SamplingParams(temperature=0.0, repeat_penalty=1.1,
                                                               repeat_last_n=1 << 64),
                        max_tokens=4, stop_ids=frozenset())
    good = GenerationJob(prompt=prompt, sampling=SamplingParams(temperature=0.0), max_tokens=4, stop_ids=frozenset())
    scheduler = Scheduler(served, max_sessions=2, max_concurrent=4, queue_depth=4)
    with pytest.raises(OverflowError):
        scheduler.submit(bad)
    scheduler.forward_thread.close()
    (events,) = trio.run(run_turns, served, [good])
    assert isinstance(events[-1], FinishEvent) and len(events) == 5, events
