"""What chat/ asks the scheduler to run, and the events it gets back. Nothing else crosses this seam."""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np

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
    # May start from an anonymous cache or a prefix copied from another slot (the request's `cache_prompt`).
    cache_prompt: bool = True
    # Optional token controller (grammar constraint, reasoning budget): see TokenController.
    constraint: Any = None
    # Where the conversation history ends and this turn's generation prompt begins (None when unknown): the
    # next turn of this conversation repeats the prompt up to here, which is how the session table recognises
    # it, and where a recurrent model keeps a state checkpoint.
    history_end: int | None = None
    job_id: int = field(default_factory=lambda: next(_job_ids))
    # The request this job is a choice of (n > 1 share one): on the legacy path, which runs one generation at
    # a time, a request's later choices wait for its earlier ones instead of being refused as busy.
    request: object = None
    # Set by the consumer (stop string seen, client gone); the scheduler drops the job at its next step.
    cancelled: bool = False
    # The scheduler's wake-up hook, so a cancelled job leaves the queue at once.
    on_cancel: Any = None
    # The consumer's synchronous hand-off, tried before the events channel (event loop): on_token(sampled) is
    # True when it took the token there and then, False to have it sent as a TokenEvent.
    on_token: Any = None
    # With on_token: on_flush() sends what the consumer took and still holds. The scheduler calls it for every
    # job of a delivery once it has handed over all its tokens (a decode run may bring several steps in one
    # wake-up), before the event loop runs anything else.
    on_flush: Any = None

    def cancel(self) -> None:
        if not self.cancelled:
            self.cancelled = True
            if self.on_cancel is not None:
                self.on_cancel()


class TokenController(Protocol):
    """Steers one job's decode: masks (grammars), forced tokens (a reasoning budget closing </think>, the
    closing text of a constrained call). See pantheon/engine/constraints.py."""

    def forced(self) -> int | None:
        """A token to emit without sampling, or None."""

    def mask(self) -> np.ndarray | None:
        """Boolean (vocab,) array of the tokens allowed next, or None for no constraint."""

    def advance(self, token: int) -> None:
        """`token` was generated (sampled or forced)."""

    def stop_requested(self, token: int) -> bool:
        """An end token was sampled: True to end the turn, False when forced tokens come first."""

    def is_finished(self) -> bool:
        """The constraint is complete: end the turn."""


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
    # The turn ended on an end-of-generation token: a completion token like any other (as llama-server and vLLM
    # count it), though it has no text and is not kept in the session.
    end_token: bool = False


@dataclass(frozen=True)
class ErrorEvent:
    error: ApiError
    usage: Usage | None = None


Event = TokenEvent | FinishEvent | ErrorEvent
