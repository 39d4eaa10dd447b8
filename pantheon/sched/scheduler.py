"""One scheduler task per served model instance: slots, FIFO queue, admission, and the batched step.

The loop admits queued jobs into slots (the session table picks the slot and how much of the prompt it
already holds), then runs one step in a worker thread: either prefill chunks (of as many waiting prompts as
fit in `prefill_chunk` tokens, taking turns: least recently served first, never-served ones in admission order
(`_plan`); one prompt a step for recurrent models) or one decode token for
every decoding job — one forward pass, weights read once for the whole batch — and samples. For attention
(rewindable) models decode steps then go on back to back on the forward thread while nothing needs a new
plan (`_decode_run`), each step's tokens delivered here while the next one computes.

Prefill and decode steps alternate while both kinds of work exist, so a long prompt never freezes the
streams that are decoding: they get a token between any two chunks. A chunk is `prefill_chunk` tokens
(256): large enough that the prefill matmuls run near full speed, small enough that one chunk takes well
under a second of a 2-core machine on the default model. Prefill rows and decode rows are never mixed in one
forward, a row's numbers never depend on the other rows of its step, and chunks always start at multiples of
the chunk size, so a sequence's numbers do not depend on what else is running (greedy output alone equals
greedy output under load) or on whether a turn reused a cached prefix.

Jobs arrive through `submit()`; each gets its own unbounded event channel, so a slow reader never stalls
the batch, and a reader that closes its channel (client gone) frees its slot at the next step.
"""

from __future__ import annotations

import logging
import math
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import numpy as np
import trio

from pantheon.engine.loader import LoadedModel
from pantheon.engine.repetition import RepetitionDetector
from pantheon.engine.sampling import NoTokenAllowed, SampledToken, Sampler, sample_rows
from pantheon.engine.sessions import SessionTable, SlotInfo
from pantheon.errors import ApiError, shutting_down
from pantheon.metrics import Metrics
from pantheon.models.base import BatchRow
from pantheon.sched.forward_thread import ForwardThread
from pantheon.sched.jobs import ErrorEvent, Event, FinishEvent, GenerationJob, TokenEvent, Usage

log = logging.getLogger("pantheon.sched")

QUEUE_TIMEOUT_S = 30.0
# Sequences one step decodes at most (spec: the batched path serves up to 8 concurrent users); a larger
# --max-concurrent is reported as configured and served as 8.
MAX_BATCH = 8
# Recurrent models: snapshots kept per slot (the end of the history and of the prompt, for the last turns).
MAX_CHECKPOINTS = 4
PREFILL_CHUNK = 256
# Before a rate has been measured (spec: "a fixed fallback before one is measured").
FALLBACK_PREFILL_TOK_S = 100.0
FALLBACK_DECODE_TOK_S = 20.0
# Recurrent models: scheduling rounds a step waits for its consumers to read its tokens (`_let_consumers_catch_up`).
CATCH_UP_ROUNDS = 4
# How often a watch's grace, up while a turn of its session runs, looks whether the turn has ended.
WATCH_RELEASE_POLL_S = 0.25


@dataclass
class Active:
    job: GenerationJob
    events: trio.MemorySendChannel[Event]
    slot: SlotInfo
    sampler: Sampler
    prompt_done: int = 0  # prompt tokens already in the slot's state
    cached_tokens: int = 0
    conflict: bool = False
    generated: list[int] = field(default_factory=list)
    pending: int | None = None  # last sampled token, fed at the next decode step
    repetition: RepetitionDetector = field(default_factory=RepetitionDetector)
    submitted_at: float = 0.0
    last_token_at: float | None = None
    restore: Any = None  # recurrent models: a checkpoint to reinstall before the first prefill step
    copy_from: tuple[int, int] | None = None  # (slot, n): that slot's first n positions, copied in first
    pinned: int | None = None  # the copy's source slot, pinned in the session table until the copy is done
    checkpoint: Any = None  # a snapshot taken at the end of this step, to keep on the slot
    last_prefill_step: int = -1  # the scheduler's prefill step that last took a chunk of this prompt (-1: none)
    released: bool = False  # the turn is over (steps already running for it count for nothing)
    # Why the server ended the turn early (the drain's deadline): sent as the turn's ErrorEvent, with its usage.
    cut_by: ApiError | None = None

    @property
    def prefilling(self) -> bool:
        return self.prompt_done < len(self.job.prompt)


# A row's outcome of a step: its token, None (a prefill row that made no logits), or NoTokenAllowed (its scores
# allowed none: only its own turn fails).
Sample = SampledToken | NoTokenAllowed | None


def _flush(owners: list[Active]) -> None:
    """After a delivery: each consumer that took tokens at once sends what it holds (`on_flush`; a consumer
    holding nothing sends nothing)."""
    for active in owners:
        on_flush = active.job.on_flush
        if on_flush is not None:
            on_flush()


def _caught_up(active: Active) -> bool:
    """Whether the consumer of `active` has read every event sent to it and waits for the next (or the turn is
    over, or nobody reads any more)."""
    if active.released or active.job.cancelled:
        return True
    stats = active.events.statistics()
    return stats.current_buffer_used == 0 and (stats.tasks_waiting_receive > 0 or stats.open_receive_channels == 0)


@dataclass
class StepResult:
    """One step of a decode run, as the forward thread hands it back."""

    rows: list[BatchRow]
    owners: list[Active]
    samples: list[Sample]
    seconds: float
    error: Exception | None = None


@dataclass
class Waiting:
    job: GenerationJob
    events: trio.MemorySendChannel[Event]
    enqueued_at: float
    # Built at submit, in the request's own task: whatever a job's sampling parameters make it raise is that
    # request's error there, never an exception of the scheduler's loop (which would end the server).
    sampler: Sampler


class Scheduler:
    def __init__(self, served: LoadedModel, *, max_sessions: int, max_concurrent: int, queue_depth: int,
                 batched: bool = True, idle_ttl_s: float = 12 * 3600.0,
                 prefill_chunk: int = PREFILL_CHUNK, metrics: Metrics | None = None,
                 forward_thread: ForwardThread | None = None, stream_interval_s: float = 0.0) -> None:
        self.served = served
        # A decode run hands its steps to the event loop at most this often (several steps in one wake-up):
        # see `_decode_chain`.
        self.stream_interval_s = stream_interval_s
        # Every forward pass on one thread (see forward_thread.py); the model manager shares one per backend.
        self._owns_forward_thread = forward_thread is None
        self.forward_thread = forward_thread if forward_thread is not None else ForwardThread()
        self.metrics = metrics or Metrics()
        self.batched = batched
        # Legacy path (no batch scheduler): one generation at a time; only a request's later choices (n > 1)
        # queue, behind its own earlier ones.
        self.max_concurrent_configured = max(1, max_concurrent)
        self.max_concurrent = self.concurrency_cap
        self.queue_depth = queue_depth if batched else 0
        self.prefill_chunk = prefill_chunk
        self.ctx_window_configured = served.ctx_cap
        self.ctx_window = served.ctx_cap  # effective: after the memory ladder's clamp
        self.memory_critical = False
        # Sessions own up to 2 slots each; stateless turns always find one of the remaining max_concurrent.
        n_slots = max_sessions * 2 + self.max_concurrent_configured
        # Recurrent (SSM) state cannot be rewound to a shorter prefix: such models resume from checkpoints.
        self.rewindable = getattr(served.model, "supports_prefix_rewind", True)
        self.sessions = SessionTable(n_slots=n_slots, max_sessions=max_sessions, idle_ttl_s=idle_ttl_s,
                                     rewindable=self.rewindable,
                                     copy_prefixes=getattr(served.model, "supports_prefix_copy", False))
        self.state = served.model.new_state(n_slots, served.ctx_cap)
        self._waiting: deque[Waiting] = deque()
        self._active: list[Active] = []
        self._wakeup = trio.Event()
        self._last_step_prefill = False
        self._prefill_steps = 0  # prefill steps planned so far (`Active.last_prefill_step`)
        self.prefill_tok_per_s: float | None = None
        self.decode_step_s: float | None = None
        self._nursery: trio.Nursery | None = None
        self.steps_run = 0
        self.closed = trio.Event()  # set when the instance is unloaded: its sessions are gone
        self.stopping = trio.Event()  # set when the server stops after its drain (sessions saved, if asked)
        self._watch_graces: dict[str, int] = {}  # session id -> the number of its latest watch grace

    # -- capacity ------------------------------------------------------------------------------------------
    @property
    def concurrency_cap(self) -> int:
        """What this scheduler serves with no memory pressure: the configured count, at most MAX_BATCH, or 1 on
        the legacy path."""
        return min(self.max_concurrent_configured, MAX_BATCH) if self.batched else 1

    @property
    def kv_cap(self) -> int:
        return self.ctx_window

    @property
    def n_active(self) -> int:
        return len(self._active)

    @property
    def n_waiting(self) -> int:
        return len(self._waiting)

    @property
    def idle(self) -> bool:
        return not self._active and not self._waiting

    def release_state(self) -> None:
        """Drop the sequence state (the instance was unloaded)."""
        self.state = None
        self.closed.set()
        if self._owns_forward_thread:
            self.forward_thread.close()

    def apply_limits(self, concurrency: int, window: int, critical: bool) -> None:
        """Called by the memory monitor; takes effect at once for admission and advertised numbers."""
        self.max_concurrent = max(1, min(concurrency, self.concurrency_cap))
        self.ctx_window = max(1, min(window, self.ctx_window_configured))
        self.memory_critical = critical
        self.poke()

    def retry_after_s(self) -> int:
        """Seconds until a slot is likely free, from the work ahead and the measured decode step time."""
        step = self.decode_step_s or 1.0 / FALLBACK_DECODE_TOK_S
        remaining = [a.job.max_tokens - len(a.generated) for a in self._active]
        soonest = min(remaining, default=0) * step
        queued = len(self._waiting) / max(1, self.max_concurrent)
        return int(max(1, min(120, math.ceil(soonest * (1 + queued)))))

    def reprefill_estimate_s(self, n_tokens: int) -> float:
        return n_tokens / (self.prefill_tok_per_s or FALLBACK_PREFILL_TOK_S)

    @staticmethod
    def reprefill_estimate_fallback() -> float:
        return FALLBACK_PREFILL_TOK_S

    @property
    def watch_nursery(self) -> trio.Nursery | None:
        return self._nursery

    def over_window(self, n_tokens: int, *, at_least: bool = False) -> ApiError:
        """422 context_over_budget for a prompt of n_tokens (or at least that many) tokens."""
        size = f"at least {n_tokens}" if at_least else f"{n_tokens}"
        return ApiError(422, "context_over_budget",
                        f"prompt is {size} tokens but the context window is {self.kv_cap} tokens, which "
                        f"must also hold at least one completion token "
                        f"(kv_used={n_tokens}, kv_cap={self.kv_cap}); this model's maximum context "
                        f"length is {self.kv_cap} tokens",
                        extra={"kv_used": n_tokens, "kv_cap": self.kv_cap})

    # -- admission (event loop) ----------------------------------------------------------------------------
    def submit(self, job: GenerationJob) -> trio.MemoryReceiveChannel[Event]:
        """Queue a job; returns its event channel. Raises ApiError when it cannot be accepted."""
        if self.closed.is_set():  # unloaded: no task would ever run the job (unloads wait for routed requests)
            raise ApiError(404, "model_not_found", f"model {self.served.name!r} was unloaded")
        if len(job.prompt) >= self.kv_cap:
            raise self.over_window(len(job.prompt))
        self.sessions.check_capacity(job.session_key, self.reprefill_estimate_s(len(job.prompt)))
        busy = len(self._active) + len(self._waiting)
        if busy >= self.max_concurrent:
            if not self.batched:
                if not self._only_own_request(job):
                    raise ApiError(429, "server_busy", "a generation is already running on this model",
                                   headers={"Retry-After": str(self.retry_after_s())})
            elif len(self._waiting) >= self.queue_depth:
                if self.memory_critical:
                    raise ApiError(503, "server_memory_constrained",
                                   "host memory is critically low and the queue is full",
                                   headers={"Retry-After": str(self.retry_after_s())})
                raise ApiError(429, "server_busy", "all decode slots are busy and the queue is full",
                               headers={"Retry-After": str(self.retry_after_s())})
        if self.memory_critical and job.session_key and self.sessions.get(job.session_key) is None:
            raise ApiError(503, "server_memory_constrained",
                           "host memory is critically low: new sessions are refused", headers={"Retry-After": "30"})
        sampler = Sampler(job.sampling, self.served.model.vocab_size)
        send, receive = trio.open_memory_channel[Event](math.inf)
        job.on_cancel = self.poke
        self._waiting.append(Waiting(job, send, time.monotonic(), sampler))
        self.poke()
        return receive

    def _only_own_request(self, job: GenerationJob) -> bool:
        """Legacy path: everything running or queued is a choice of job's own request (n > 1), which it
        waits behind; another user's generation makes it busy."""
        if job.request is None:
            return False
        return all(other.job.request is job.request for other in (*self._active, *self._waiting))

    def end_turns_now(self) -> None:
        """The shutdown drain's deadline: each running turn ends at its next step as a failed generation (an
        ErrorEvent of 503 server_shutting_down, with its usage: a stream closes its choice with finish_reason
        "stop", a non-streamed answer with no token yet is that 503, not an empty answer that looks whole), and
        each queued one is refused with the same 503, so no client is cut off mid-stream."""
        for active in self._active:
            if not active.job.cancelled:  # a turn its consumer already ended (a stop string) ends as it was
                active.cut_by = shutting_down()
            active.job.cancel()
        while self._waiting:
            self._refuse(self._waiting.popleft(), shutting_down())
        self.poke()

    def _refuse(self, waiting: Waiting, error: ApiError) -> None:
        """A queued turn ends with `error` before it ran."""
        self._send(waiting.events, ErrorEvent(error))
        waiting.events.close()

    def poke(self) -> None:
        """Wake the loop: something a waiting job may need (a job, a slot, a cancellation) changed."""
        self._wakeup.set()

    # -- the loop ------------------------------------------------------------------------------------------
    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        async with trio.open_nursery() as nursery:
            # Session watch grace timers live here, under the model instance (and so the root nursery).
            self._nursery = nursery
            task_status.started()
            await self._loop()

    def start_watch_grace(self, session_id: str, grace_s: float) -> None:
        """The last watch on `session_id` closed: release the session after the grace period unless a new
        watch arrives first. Only the latest grace counts: one started when an earlier watch closed is void
        once a later watch has come and gone (it would release the session before the later grace is up)."""
        started = self._watch_graces[session_id] = self._watch_graces.get(session_id, 0) + 1

        def void() -> bool:  # a later watch came (and maybe went): that one's grace decides
            return self._watch_graces.get(session_id) != started or bool(self.sessions.watches.get(session_id))

        async def grace() -> None:
            await trio.sleep(grace_s)
            # A turn running when the grace is up ends first; the session goes as soon as it has (it was kept
            # until the idle timeout).
            while self.session_busy(session_id) and not void():
                await trio.sleep(WATCH_RELEASE_POLL_S)
            if self._watch_graces.get(session_id) != started:
                return
            del self._watch_graces[session_id]
            if not self.sessions.watches.get(session_id):
                self.sessions.release(session_id)

        assert self._nursery is not None, "the scheduler task is not running"
        self._nursery.start_soon(grace)

    async def _loop(self) -> None:
        while True:
            self._drop_cancelled()
            self._admit()
            if not self._active:
                self._wakeup = trio.Event()
                # With jobs queued but no slot usable, re-check often enough to honour the queue timeout.
                with trio.move_on_after(0.5 if self._waiting else math.inf):
                    await self._wakeup.wait()
                continue
            rows, owners, prefill = self._plan()
            if not prefill and self.rewindable:
                await self._decode_run(rows, owners)
                continue
            started = time.monotonic()
            try:
                samples = await self.forward_thread.run(self._execute, rows, owners)
            except Exception as exc:  # a failed forward fails its jobs, never the scheduler
                log.exception("forward step failed")
                self._fail(owners, exc)
                continue
            self.steps_run += 1
            self._note_timing(rows, prefill, time.monotonic() - started)
            self._deliver(rows, owners, samples)
            _flush(owners)
            if not self.rewindable:
                await self._let_consumers_catch_up(owners)

    async def _let_consumers_catch_up(self, owners: list[Active]) -> None:
        """A recurrent state cannot drop a fed token, so the consumers read a step's tokens before the next step
        is planned: a cancel they make (a stop string, a client gone) then comes before the token is fed, and a
        turn's usage (kv_used) does not depend on who ran first. One checkpoint was not enough: trio runs a
        batch of ready tasks in random order, and this task could plan again before a consumer had read.
        Waits until each live consumer is back in `receive` with nothing left to read; a consumer busy
        elsewhere (a stream writing to a slow client) is given up on after a few rounds."""
        for _ in range(CATCH_UP_ROUNDS):
            await trio.lowlevel.checkpoint()
            if all(_caught_up(active) for active in owners):
                return

    async def _decode_run(self, rows: list[BatchRow], owners: list[Active]) -> None:
        """Decode steps of a rewindable model, run back to back by the forward thread (`_decode_chain`) for as
        long as nothing needs a new plan, the steps' tokens delivered (`_take_steps`, several steps at a time: see
        `_decode_chain`) while later steps compute.

        Handing every step back to this loop and waiting for it to submit the next one cost ~0.6 ms of a ~4 ms
        batch-1 step on the 2-core test VM (the wake-up of the event loop, this loop's turn, then the forward
        thread waiting for the GIL while the consumers sent tokens). A job that ends here while later steps ran
        (a stop string, repetition, a client gone: seen up to a stream interval and a step late) has their
        tokens dropped by `_deliver`: not in its slot's history, so the positions they wrote count for
        nothing."""
        made = [len(a.generated) for a in owners]
        stream = self.forward_thread.stream(self._decode_chain, rows, owners, made, on_value=self._take_steps)
        try:
            while await stream.next() is not None:
                pass  # the steps are taken by _take_steps as they arrive; this waits for the run's end
        finally:
            await stream.close()

    def _take_steps(self, steps: tuple[StepResult, ...]) -> None:
        """Event loop, in the wake-up that brings a decode run's steps (one or more, in order): their tokens go
        out to the jobs, then each consumer that took tokens at once sends them, one write for all of them.
        Done there rather than in this scheduler's task saves the loop a scheduling round per wake-up (A/B over
        HTTP on the 2-core VM: +0.8% at 1 and at 8 streams, 10 rounds; small, but it is work taken off the
        loop)."""
        try:
            for step in steps:
                self._take_step(step)
        finally:
            _flush(steps[0].owners)  # a later step's rows are some of the first's

    def _take_step(self, step: StepResult) -> None:
        if step.error is not None:  # a failed forward fails its jobs, never the scheduler
            log.error("forward step failed", exc_info=step.error)
            self._fail([a for a in step.owners if not a.released], step.error)
            return
        self.steps_run += 1
        self._note_timing(step.rows, False, step.seconds)
        self._deliver(step.rows, step.owners, step.samples)
        self._drop_cancelled()

    def _decode_chain(self, emit: Any, stream: Any, rows: list[BatchRow], owners: list[Active],
                      made: list[int]) -> None:
        """Forward thread: a decode step, then the next step for the rows that go on (`_next_decode`), until none
        does or the event loop needs a new plan. Finished steps go to the event loop once the next step's inputs
        are built, as its compute starts (`_execute`'s handover): the loop then wakes while this thread runs
        without the GIL, rather than while it still needs it for sampling and the next inputs (with two cores,
        each such wait cost the step up to a GIL switch interval and a hand-off). The run's last results go out
        at once.

        They go out together, at most every `stream_interval_s` (PANTHEON_STREAM_INTERVAL_MS): a wake-up of the
        loop, its delivery and each stream's socket write cost CPU time that two cores can only take from the
        step's thread team. Measured on the 2-core Zen 5 VM over HTTP (2026-12-01; schedstat CPU time of the
        server's threads, 128 tokens a stream, 2 runs each): the event loop took 0.124-0.167 ms per token at 1
        stream and 0.049-0.050 at 8 with every step on its own, 0.088-0.099 and 0.042-0.044 with 10 ms, and
        the client's CPU at 8 streams went from 0.018 to 0.013-0.014 s per 1024 tokens. HTTP / in-process
        decode, 8 adjacent pairs each: 0.914 -> 0.961 at 1 stream, 0.959 -> 0.965 at 8. At 8 streams a stream's
        write costs the event loop more than its tokens' Python: on the 2-core Zen 4 VM (2026-12-05, schedstat,
        256 tokens a stream) the loop took 0.052-0.059 ms of CPU per token with 10 ms (~1.5 tokens a write) and
        0.030-0.033 with 30 ms (~4), the default since (`config.STREAM_INTERVAL_MS`)."""
        pending: list[StepResult] = []
        last_handover = -math.inf

        def handover() -> None:
            nonlocal last_handover
            now = time.monotonic()
            if pending and now - last_handover >= self.stream_interval_s:
                emit(tuple(pending))
                pending.clear()
                last_handover = now

        while True:
            started = time.monotonic()
            try:
                samples = self._execute(rows, owners, handover)
            except Exception as exc:
                emit((*pending, StepResult(rows, owners, [], 0.0, exc)))
                return
            result = StepResult(rows, owners, samples, time.monotonic() - started)
            following = None if stream.stop else self._next_decode(rows, owners, samples, made)
            pending.append(result)
            if following is None:
                emit(tuple(pending))
                return
            rows, owners, made = following

    def _next_decode(self, rows: list[BatchRow], owners: list[Active], samples: list[Sample],
                     made: list[int]) -> tuple[list[BatchRow], list[Active], list[int]] | None:
        """Forward thread: the next decode step's rows, as `_accept` and `_plan` will see them once this step's
        tokens are delivered, or None when the event loop should plan instead: a queued job can be admitted, a
        job waits to prefill, another job waits for the forward thread, or a grammar-constrained job needs its
        controller advanced first. A row is left out when its turn ends with this token (an end token,
        max_tokens, a full window); `made` counts each job's tokens before this step's. What only the event loop
        sees (a stop string, a repetition loop, a client gone) is settled there: that row's next token is
        dropped."""
        if (self._waiting and len(self._active) < self.max_concurrent) or self.forward_thread.has_queued():
            return None
        if any(a.prefilling or a.job.constraint is not None for a in list(self._active)):
            return None
        following: tuple[list[BatchRow], list[Active], list[int]] = ([], [], [])
        for row, active, sampled, count in zip(rows, owners, samples, made):
            if (not isinstance(sampled, SampledToken) or active.released or active.job.cancelled
                    or active.job.constraint is not None):
                continue
            count += 1
            position = row.start_pos + 1  # what the slot holds once this step's token is delivered
            if sampled.token_id in active.job.stop_ids or self._out_of_budget(active.job, count, position):
                continue
            following[0].append(BatchRow(row.slot, np.asarray([sampled.token_id], dtype=np.int32), position))
            following[1].append(active)
            following[2].append(count)
        return following if following[0] else None

    def _drop_cancelled(self) -> None:
        for active in list(self._active):
            if active.cut_by is not None:
                self._end_with_error(active, active.cut_by, keep_state=True)  # what it holds is whole
            elif active.job.cancelled:
                # The consumer stopped it (a stop string, or the client left): the turn ends here, and its
                # usage still goes back (a closed channel just drops it).
                self._finish(active, "stop")
        kept: deque[Waiting] = deque()
        now = time.monotonic()
        for waiting in self._waiting:
            if waiting.job.cancelled:
                waiting.events.close()
            # The legacy path queues only a request's later choices, behind its own earlier ones: no timeout.
            elif now - waiting.enqueued_at > QUEUE_TIMEOUT_S and self.batched:
                self._refuse(waiting, ApiError(
                    429, "server_busy", f"waited {QUEUE_TIMEOUT_S:.0f} s in the queue without a free slot",
                    headers={"Retry-After": str(self.retry_after_s())}))
            else:
                kept.append(waiting)
        self._waiting = kept

    def _admit(self) -> None:
        """FIFO: the head of the queue is admitted first; if it cannot get a slot yet, nobody passes it."""
        while self._waiting and len(self._active) < self.max_concurrent:
            waiting = self._waiting[0]
            job = waiting.job
            if len(job.prompt) >= self.kv_cap:  # the memory ladder cut the window while it waited: as at submit
                self._refuse(self._waiting.popleft(), self.over_window(len(job.prompt)))
                continue
            try:
                assignment = self.sessions.assign(job.session_key, job.prompt, anchor=job.history_end,
                                                  reuse=job.cache_prompt)
            except ApiError as exc:  # the id's session capacity filled up while it waited
                self._refuse(self._waiting.popleft(), exc)
                continue
            if assignment is None:
                return
            self._waiting.popleft()
            cached = assignment.cached_tokens
            self._active.append(Active(job=job, events=waiting.events, slot=assignment.slot,
                                       sampler=waiting.sampler,
                                       prompt_done=cached, cached_tokens=cached, conflict=assignment.conflict,
                                       submitted_at=waiting.enqueued_at, restore=assignment.restore,
                                       copy_from=assignment.copy_from,
                                       pinned=assignment.copy_from[0] if assignment.copy_from else None))
            if cached:
                self.metrics.inc("pantheon_tokens_cached_total", cached, model=self.served.name)

    def _plan(self) -> tuple[list[BatchRow], list[Active], bool]:
        prefilling = [a for a in self._active if a.prefilling]
        decoding = [a for a in self._active if not a.prefilling]
        if prefilling and (not decoding or not self._last_step_prefill):
            self._last_step_prefill = True
            # Prompts take turns, least recently served first (never served first, then in admission order), so
            # that a short prompt admitted while a long one prefills waits for one chunk, not for the whole long
            # prompt (seen: a 4-token chat request waited 22 s behind a ~4k-token prompt with FIFO chunks).
            # Prompts that arrived together share a step, up to prefill_chunk tokens in all: the weights are read
            # once for all of them (8 short chat prompts: one step instead of eight). The first always gets its
            # whole chunk; the first that does not fit what is left ends the step, so that prompts never served
            # start in admission order (a turn's prefix copy, `_execute`, runs before a later-admitted turn can
            # rewind the source slot). A row's numbers do not depend on the other rows of a step, nor on when its
            # chunks run (chunk boundaries are fixed, `_prefill_row`). A recurrent model prefills one sequence per
            # step (its checkpoints are taken per step).
            self._prefill_steps += 1
            rows: list[BatchRow] = []
            owners: list[Active] = []
            budget = self.prefill_chunk
            for active in sorted(prefilling, key=lambda a: a.last_prefill_step):
                row = self._prefill_row(active)
                if rows and len(row.tokens) > budget:
                    break
                rows.append(row)
                owners.append(active)
                active.last_prefill_step = self._prefill_steps
                budget -= len(row.tokens)
                if budget <= 0 or not self.rewindable:
                    break
            return rows, owners, True
        self._last_step_prefill = False
        rows = [BatchRow(a.slot.index, np.asarray([a.pending], dtype=np.int32), len(a.slot.tokens))
                for a in decoding]
        return rows, decoding, False

    def _prefill_row(self, active: Active) -> BatchRow:
        """The next prefill chunk of `active`. Chunk boundaries at multiples of the chunk size: the same whatever
        was cached. A recurrent model also stops a chunk where the job wants a checkpoint (the end of the
        conversation history)."""
        start = active.prompt_done
        end = min(len(active.job.prompt), (start // self.prefill_chunk + 1) * self.prefill_chunk)
        if not self.rewindable:
            h = active.job.history_end
            if h is not None and start < h < end:
                end = h
        last = end == len(active.job.prompt)
        chunk = np.asarray(active.job.prompt[start:end], dtype=np.int32)
        return BatchRow(active.slot.index, chunk, start, "last" if last else "none")

    def _execute(self, rows: list[BatchRow], owners: list[Active], handover: Callable[[], None] | None = None
                 ) -> list[Sample]:
        """Worker thread: one forward pass, then sampling for every row that produced logits. `handover` is
        called once the pass's inputs are built, right before it computes (models without `prepare_forward`:
        before the pass)."""
        model = self.served.model
        for row, active in zip(rows, owners):
            if active.restore is not None:
                model.restore_slot(self.state, row.slot, active.restore)
                active.restore = None
            if active.copy_from is not None:
                # Before this step writes anything: the source's first n positions do not change meanwhile (its
                # own turns write past them, and a turn that rewinds it is admitted after this one).
                source, n = active.copy_from
                model.copy_prefix(self.state, source, row.slot, n)
                active.copy_from = None
        prepare = getattr(model, "prepare_forward", None)
        compute = prepare(self.state, rows) if prepare is not None else partial(model.forward, self.state, rows)
        if handover is not None:
            handover()
        logits = compute()
        if not self.rewindable:
            for row, active in zip(rows, owners):
                end = row.start_pos + len(row.tokens)
                if active.prefilling and end in (active.job.history_end, len(active.job.prompt)):
                    active.checkpoint = model.snapshot_slot(self.state, row.slot)
        samples: list[Sample] = []
        picks: list[tuple[int, Sampler, np.ndarray | None]] = []  # (logits row, sampler, mask) to sample
        picked_at: list[int] = []  # where each pick's token goes in samples
        li = 0
        for row, active in zip(rows, owners):
            if row.logits == "none":
                samples.append(None)
                continue
            controller = active.job.constraint
            forced = controller.forced() if controller is not None else None
            if forced is not None:
                samples.append(SampledToken(forced))
            else:
                picks.append((li, active.sampler, controller.mask() if controller is not None else None))
                picked_at.append(len(samples))
                samples.append(None)
            li += 1
        for at, sampled in zip(picked_at, sample_rows(logits, picks)):
            samples[at] = sampled
        return samples

    def _note_timing(self, rows: list[BatchRow], prefill: bool, seconds: float) -> None:
        if seconds <= 0:
            return
        if prefill:
            n = sum(len(r.tokens) for r in rows)
            if n >= 32:
                rate = n / seconds
                self.prefill_tok_per_s = rate if self.prefill_tok_per_s is None \
                    else 0.7 * self.prefill_tok_per_s + 0.3 * rate
        else:
            self.decode_step_s = seconds if self.decode_step_s is None else 0.8 * self.decode_step_s + 0.2 * seconds

    def _deliver(self, rows: list[BatchRow], owners: list[Active], samples: list[Sample]) -> None:
        now = time.monotonic()
        model = self.served.name
        for row, active, sampled in zip(rows, owners, samples):
            if active.copy_from is None:
                self._unpin(active)  # the step copied the source's prefix: it may be written again
            if active.released or (active.job.cancelled and self.rewindable):
                # The turn ended while the step ran (a stop string, the client left, or its last token came in
                # the step before): it ended before these tokens. They stay out of the slot's history, so the
                # positions they wrote count for nothing.
                continue
            if len(row.tokens) == 1:  # a decode step's row
                active.slot.tokens.append(int(row.tokens[0]))
            else:
                active.slot.tokens.extend(row.tokens.tolist())
            if active.prefilling:
                active.prompt_done += len(row.tokens)
                self.metrics.inc("pantheon_tokens_prefilled_total", len(row.tokens), model=model)
            if active.checkpoint is not None:
                checkpoints = active.slot.checkpoints
                checkpoints.append(active.checkpoint)
                del checkpoints[:-MAX_CHECKPOINTS]
                active.checkpoint = None
            if sampled is None:
                continue
            if isinstance(sampled, NoTokenAllowed):
                self._fail([active], sampled)  # this turn alone: the rows batched with it go on
                continue
            if active.last_token_at is None:
                self.metrics.observe("pantheon_time_to_first_token_seconds", now - active.submitted_at, model=model)
            else:
                self.metrics.observe("pantheon_inter_token_latency_seconds", now - active.last_token_at, model=model)
            active.last_token_at = now
            self._accept(active, sampled)

    def _accept(self, active: Active, sampled: SampledToken) -> None:
        """One new token for `active`: end its turn, or send it out and queue it to be fed next step."""
        token = sampled.token_id
        controller = active.job.constraint
        if token in active.job.stop_ids:
            if controller is None or controller.stop_requested(token):
                self._finish(active, "stop", end_token=True)
                return
            # The controller appends closing text instead (a constrained call the model ended inside of):
            # its first forced token replaces the end token; the rest are forced at the next steps.
            forced = controller.forced()
            if forced is None:
                self._finish(active, "stop", end_token=True)
                return
            sampled = SampledToken(forced)
            token = forced
        active.generated.append(token)
        self.metrics.inc("pantheon_tokens_decoded_total", model=self.served.name)
        if controller is not None:
            controller.advance(token)
        on_token = active.job.on_token
        taken = on_token is not None and on_token(sampled)  # the consumer took it at once (completion.py)
        if not taken and not self._send(active.events, TokenEvent(sampled)):
            self._release(active)
            return
        if active.repetition.push(token):
            self._finish(active, "repetition_loop")
        elif controller is not None and controller.is_finished():
            self._finish(active, "stop")
        elif self._out_of_budget(active.job, len(active.generated), len(active.slot.tokens)):
            self._finish(active, "length")
        else:
            active.pending = token

    def _out_of_budget(self, job: GenerationJob, n_generated: int, n_held: int) -> bool:
        """A turn with n_generated tokens, whose slot holds n_held, ends here with "length": max_tokens is a hard
        cap (a constrained call cut short is reported in tool_call_error, not completed), and the window must
        keep room for the token to be fed. `_accept` decides with it; `_next_decode` foresees the same."""
        return n_generated >= job.max_tokens or n_held + 1 >= self.kv_cap

    def _usage(self, active: Active) -> Usage:
        return Usage(prompt_tokens=len(active.job.prompt), cached_tokens=active.cached_tokens,
                     completion_tokens=len(active.generated), kv_used=len(active.slot.tokens),
                     kv_cap=self.kv_cap, session_conflict=active.conflict)

    def _finish(self, active: Active, reason: str, end_token: bool = False) -> None:
        """End a turn; `end_token`: on an end-of-generation token (counted as decoded, never fed)."""
        if end_token:
            self.metrics.inc("pantheon_tokens_decoded_total", model=self.served.name)
        self._send(active.events, FinishEvent(reason, self._usage(active), end_token))
        self._release(active)

    def _fail(self, owners: list[Active], exc: Exception) -> None:
        error = ApiError(500, "server_error", f"generation failed: {type(exc).__name__}: {exc}")
        for active in owners:
            self._end_with_error(active, error, keep_state=False)  # its state may be half-written

    def _end_with_error(self, active: Active, error: ApiError, *, keep_state: bool) -> None:
        """End a turn as a failed generation: its consumer gets `error` with the turn's usage."""
        self._send(active.events, ErrorEvent(error, self._usage(active)))
        self._release(active, keep_state=keep_state)

    def _unpin(self, active: Active) -> None:
        if active.pinned is not None:
            self.sessions.unpin(active.pinned)
            active.pinned = None

    def _release(self, active: Active, *, keep_state: bool = True) -> None:
        active.released = True
        # A turn that ends before its first step ran its prefix copy (or checkpoint restore) leaves a slot whose
        # tokens promise state it never got: emptied, so that no later turn resumes from them.
        keep_state = keep_state and active.copy_from is None and active.restore is None
        self._unpin(active)  # a turn that ends before its copy no longer needs the source
        if active in self._active:
            self._active.remove(active)
            self.sessions.finish(active.slot, keep=keep_state)
        active.events.close()
        self.poke()

    @staticmethod
    def _send(channel: trio.MemorySendChannel[Event], event: Event) -> bool:
        try:
            channel.send_nowait(event)
            return True
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            return False

    # -- sessions (event loop; the slot must not be mid-turn) ----------------------------------------------
    def session_busy(self, session_id: str) -> bool:
        session = self.sessions.get(session_id)
        return session is not None and session.busy

    async def run_in_worker(self, fn: Any, *args: Any) -> Any:
        return await trio.to_thread.run_sync(fn, *args)
