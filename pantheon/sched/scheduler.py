"""One scheduler task per served model instance: slots, FIFO queue, admission, and the batched step.

Every step runs one forward pass over all active sequences — prefill chunks and single decode tokens mixed
— in a worker thread, then samples each sequence that needs a token. Jobs arrive through `submit()`; each
gets its own unbounded event channel, so a slow reader never stalls the batch, and a reader that closes its
channel (client gone) frees its slot at the next step.

Prefill chunking: a step carries at most `step_token_budget` prompt tokens in total, so a long prompt is
spread over several steps and every decoding stream still gets a token per step. The budget (256) is the
batch size at which the prefill matmuls reach most of their throughput on the cpu backend while one step
stays around 1 s at worst on a 2-core machine.
"""

from __future__ import annotations

import math
import time
from collections import deque
from dataclasses import dataclass, field

import numpy as np
import trio

from pantheon.engine.loader import LoadedModel
from pantheon.engine.repetition import RepetitionDetector
from pantheon.engine.sampling import SampledToken, Sampler
from pantheon.errors import ApiError
from pantheon.models.base import BatchRow
from pantheon.sched.jobs import ErrorEvent, Event, FinishEvent, GenerationJob, TokenEvent, Usage

QUEUE_TIMEOUT_S = 30.0


@dataclass
class Slot:
    index: int
    tokens: list[int] = field(default_factory=list)  # tokens whose KV this slot holds, in order
    busy: bool = False


@dataclass
class Active:
    job: GenerationJob
    events: trio.MemorySendChannel[Event]
    slot: Slot
    sampler: Sampler
    prompt_done: int = 0  # prompt tokens already in the slot's KV
    cached_tokens: int = 0
    generated: list[int] = field(default_factory=list)
    pending: int | None = None  # last sampled token, to be fed at the next step
    repetition: RepetitionDetector = field(default_factory=RepetitionDetector)

    @property
    def prefilling(self) -> bool:
        return self.prompt_done < len(self.job.prompt)


@dataclass
class Waiting:
    job: GenerationJob
    events: trio.MemorySendChannel[Event]
    enqueued_at: float


class Scheduler:
    def __init__(self, served: LoadedModel, *, n_slots: int, max_concurrent: int, queue_depth: int,
                 step_token_budget: int = 256) -> None:
        self.served = served
        self.max_concurrent = max(1, min(max_concurrent, n_slots))
        self.queue_depth = queue_depth
        self.step_token_budget = step_token_budget
        self.slots = [Slot(i) for i in range(n_slots)]
        self.state = served.model.new_state(n_slots, served.ctx_cap)
        self._waiting: deque[Waiting] = deque()
        self._active: list[Active] = []
        self._wakeup = trio.Event()
        self.prefill_tok_per_s: float | None = None

    # -- admission (event loop) ----------------------------------------------------------------------------
    @property
    def kv_cap(self) -> int:
        return self.served.ctx_cap

    def submit(self, job: GenerationJob) -> trio.MemoryReceiveChannel[Event]:
        """Queue a job; returns its event channel. Raises ApiError when it cannot be accepted."""
        if len(job.prompt) >= self.kv_cap:
            raise ApiError(422, "context_over_budget",
                           f"prompt is {len(job.prompt)} tokens; the context window is {self.kv_cap} tokens "
                           f"(kv_used={len(job.prompt)}, kv_cap={self.kv_cap}); this model's maximum context "
                           f"length is {self.kv_cap} tokens",
                           extra={"kv_used": len(job.prompt), "kv_cap": self.kv_cap})
        if len(self._waiting) >= self.queue_depth and len(self._active) >= self.max_concurrent:
            raise ApiError(429, "server_busy", "all decode slots are busy and the queue is full",
                           headers={"Retry-After": str(self.retry_after_s())})
        send, receive = trio.open_memory_channel[Event](math.inf)
        self._waiting.append(Waiting(job, send, time.monotonic()))
        self._wakeup.set()
        return receive

    def retry_after_s(self) -> int:
        """Seconds until a slot is likely free: remaining tokens of the running jobs at the recent rate."""
        return max(1, min(60, 1 + len(self._waiting) // max(1, self.max_concurrent)))

    @property
    def n_active(self) -> int:
        return len(self._active)

    @property
    def n_waiting(self) -> int:
        return len(self._waiting)

    # -- the loop ------------------------------------------------------------------------------------------
    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        task_status.started()
        while True:
            self._drop_cancelled()
            self._admit()
            if not self._active:
                self._wakeup = trio.Event()
                if self._waiting:
                    with trio.move_on_after(0.5):
                        await self._wakeup.wait()
                else:
                    await self._wakeup.wait()
                continue
            rows, owners = self._plan()
            try:
                started = time.monotonic()
                samples = await trio.to_thread.run_sync(self._execute, rows, owners)
                self._note_rate(rows, owners, time.monotonic() - started)
            except Exception as exc:  # a failed forward fails its jobs, never the scheduler
                self._fail_all(owners, exc)
                continue
            self._deliver(rows, owners, samples)
            await trio.lowlevel.checkpoint()

    def _drop_cancelled(self) -> None:
        for active in list(self._active):
            if active.job.cancelled:
                self._release(active)
        kept = deque()
        now = time.monotonic()
        for waiting in self._waiting:
            if waiting.job.cancelled:
                waiting.events.close()
            elif now - waiting.enqueued_at > QUEUE_TIMEOUT_S:
                self._send(waiting.events, ErrorEvent(ApiError(
                    429, "server_busy", f"waited {QUEUE_TIMEOUT_S:.0f} s in the queue without a free slot",
                    headers={"Retry-After": str(self.retry_after_s())})))
                waiting.events.close()
            else:
                kept.append(waiting)
        self._waiting = kept

    def _admit(self) -> None:
        while self._waiting and len(self._active) < self.max_concurrent:
            slot = self._free_slot()
            if slot is None:
                return
            waiting = self._waiting.popleft()
            job = waiting.job
            slot.busy = True
            slot.tokens.clear()
            self._active.append(Active(job=job, events=waiting.events, slot=slot,
                                       sampler=Sampler(job.sampling, self.served.model.vocab_size)))

    def _free_slot(self) -> Slot | None:
        for slot in self.slots:
            if not slot.busy:
                return slot
        return None

    def _plan(self) -> tuple[list[BatchRow], list[Active]]:
        rows: list[BatchRow] = []
        owners: list[Active] = []
        budget = self.step_token_budget
        for active in self._active:
            start = len(active.slot.tokens)
            if active.prefilling:
                if budget <= 0:
                    continue
                chunk = active.job.prompt[active.prompt_done : active.prompt_done + budget]
                budget -= len(chunk)
                last = active.prompt_done + len(chunk) == len(active.job.prompt)
                rows.append(BatchRow(active.slot.index, np.asarray(chunk, dtype=np.int32), start,
                                     "last" if last else "none"))
            else:
                assert active.pending is not None
                rows.append(BatchRow(active.slot.index, np.asarray([active.pending], dtype=np.int32), start))
            owners.append(active)
        return rows, owners

    def _execute(self, rows: list[BatchRow], owners: list[Active]) -> list[SampledToken | None]:
        """Worker thread: one forward pass, then sampling for every row that produced logits."""
        logits = self.served.model.forward(self.state, rows)
        samples: list[SampledToken | None] = []
        li = 0
        for row, active in zip(rows, owners):
            if row.logits == "none":
                samples.append(None)
                continue
            mask = active.job.constraint.mask() if active.job.constraint is not None else None
            samples.append(active.sampler.sample(logits[li], mask))
            li += 1
        return samples

    def _note_rate(self, rows: list[BatchRow], owners: list[Active], seconds: float) -> None:
        prefill_tokens = sum(len(r.tokens) for r, a in zip(rows, owners) if a.prefilling)
        if prefill_tokens >= 32 and seconds > 0:
            rate = prefill_tokens / seconds
            self.prefill_tok_per_s = rate if self.prefill_tok_per_s is None else 0.7 * self.prefill_tok_per_s + 0.3 * rate

    def _deliver(self, rows: list[BatchRow], owners: list[Active], samples: list[SampledToken | None]) -> None:
        for row, active, sampled in zip(rows, owners, samples):
            active.slot.tokens.extend(int(t) for t in row.tokens)
            if active.prefilling:
                active.prompt_done += len(row.tokens)
            if sampled is None:
                continue
            token = sampled.token_id
            if token in active.job.stop_ids:
                self._finish(active, "stop")
                continue
            active.generated.append(token)
            if active.job.constraint is not None:
                active.job.constraint.advance(token)
            if not self._send(active.events, TokenEvent(sampled)):
                self._release(active)
                continue
            if active.repetition.push(token):
                self._finish(active, "repetition_loop")
            elif len(active.generated) >= active.job.max_tokens or len(active.slot.tokens) + 1 >= self.kv_cap:
                self._finish(active, "length")
            elif active.job.constraint is not None and active.job.constraint.is_finished():
                self._finish(active, "stop")
            else:
                active.pending = token

    def _usage(self, active: Active) -> Usage:
        return Usage(prompt_tokens=len(active.job.prompt), cached_tokens=active.cached_tokens,
                     completion_tokens=len(active.generated), kv_used=len(active.slot.tokens), kv_cap=self.kv_cap)

    def _finish(self, active: Active, reason: str) -> None:
        self._send(active.events, FinishEvent(reason, self._usage(active)))
        self._release(active)

    def _fail_all(self, owners: list[Active], exc: Exception) -> None:
        error = ApiError(500, "server_error", f"generation failed: {type(exc).__name__}: {exc}")
        for active in owners:
            self._send(active.events, ErrorEvent(error, self._usage(active)))
            active.slot.tokens.clear()  # its KV may be half-written
            self._release(active)

    def _release(self, active: Active) -> None:
        if active in self._active:
            self._active.remove(active)
        active.slot.busy = False
        active.events.close()
        self._wakeup.set()

    @staticmethod
    def _send(channel: trio.MemorySendChannel[Event], event: Event) -> bool:
        try:
            channel.send_nowait(event)
            return True
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            return False
