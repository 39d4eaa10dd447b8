"""What chat/ asks the scheduler to run, and the events it gets back. Nothing else crosses this seam."""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from typing import Any

from pantheon.engine.sampling import SampledToken, SamplingParams
from pantheon.errors import ApiError

_job_ids = itertools.count(1)


@dataclass
class GenerationJob:
    prompt: list[int]
    sampling: SamplingParams
    max_tokens: int
    stop_ids: frozenset[int]
    session_key: str | None = None
    # Optional grammar constraint (engine/constraints): gives a boolean allowed-token mask per step.
    constraint: Any = None
    job_id: int = field(default_factory=lambda: next(_job_ids))
    # Set by the consumer (stop string seen, client gone); the scheduler drops the job at its next step.
    cancelled: bool = False

    def cancel(self) -> None:
        self.cancelled = True


@dataclass(frozen=True)
class Usage:
    prompt_tokens: int
    cached_tokens: int
    completion_tokens: int
    kv_used: int
    kv_cap: int
    session_conflict: bool = False


@dataclass(frozen=True)
class TokenEvent:
    sampled: SampledToken


@dataclass(frozen=True)
class FinishEvent:
    reason: str  # "stop" | "length" | "repetition_loop"
    usage: Usage


@dataclass(frozen=True)
class ErrorEvent:
    error: ApiError
    usage: Usage | None = None


Event = TokenEvent | FinishEvent | ErrorEvent
