"""Run a chat completion against a model instance: jobs per choice, then a body or a stream of chunks."""

from __future__ import annotations

import math
import secrets
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import orjson
import trio

from pantheon.chat.output import ChoiceOutput, Delta
from pantheon.chat import structure
from pantheon.chat.prompt import Prompt, PromptOverWindow, build_prompt
from pantheon.chat.structure import Structure
from pantheon.chat.request import ChatRequest
from pantheon.config import EnvKnobs
from pantheon.engine.constraints import Controllers, ReasoningBudget
from pantheon.engine.loader import LoadedModel
from pantheon.engine.sampling import SampledToken, SamplingParams
from pantheon.errors import ApiError, invalid_request
from pantheon.sched.jobs import ErrorEvent, FinishEvent, GenerationJob, TokenEvent, Usage
from pantheon.sched.registry import ModelInstance


@dataclass
class ChoiceResult:
    index: int
    output: ChoiceOutput
    finish_reason: str = "stop"
    usage: Usage | None = None
    controller: Any = None  # the choice's grammar controller, when one was armed
    error: ApiError | None = None  # what ended the choice, when the scheduler failed or refused it

    @property
    def never_ran(self) -> bool:
        """Refused (a queue timeout) or failed before its first token: a choice that did not come back."""
        return self.error is not None and not self.output.completion_tokens

    @property
    def final_reason(self) -> str:
        """repetition_loop outranks tool_calls, which outranks stop and length.

        The spec: "`tool_calls` present when a call was parsed; `finish_reason` is then "tool_calls"", also for a
        turn max_tokens cut after a finished call (llama-server and OpenAI report "length" there); a call the limit
        cut is no parsed call (it is in tool_call_error), so a turn with none finished is "length"."""
        if self.finish_reason != "repetition_loop" and self.output.tool_calls:
            return "tool_calls"
        return self.finish_reason


@dataclass
class Completion:
    """One request in flight: its prompt, its jobs (one per choice) and their event channels."""

    instance: ModelInstance
    request: ChatRequest
    prompt: Prompt
    id: str = field(default_factory=lambda: "chatcmpl-" + secrets.token_hex(12))
    created: int = field(default_factory=lambda: int(time.time()))
    jobs: list[GenerationJob] = field(default_factory=list)
    channels: list[trio.MemoryReceiveChannel[Any]] = field(default_factory=list)
    grammars: list[Any] = field(default_factory=list)  # per choice: its (Lazy)GrammarController or None
    # Events already taken from a choice's channel (the first one, to learn whether it started) and not
    # yet consumed.
    early_events: dict[int, list[Any]] = field(default_factory=dict)
    n_status: str | None = None
    structure: Structure | None = None

    @property
    def model_name(self) -> str:
        return self.instance.name


def _sampling(request: ChatRequest, choice: int, never: frozenset[int] = frozenset()) -> SamplingParams:
    """`never`: token ids no draw may take (ignore_eos' end tokens)."""
    bias = {**request.logit_bias, **{t: -math.inf for t in never}} if never else request.logit_bias
    return SamplingParams(
        temperature=request.temperature,
        top_p=request.top_p,
        top_k=request.top_k,
        min_p=request.min_p,
        seed=None if request.seed is None else request.seed + choice,
        presence_penalty=request.presence_penalty,
        frequency_penalty=request.frequency_penalty,
        repeat_penalty=request.repeat_penalty,
        repeat_last_n=request.repeat_last_n,
        logit_bias=bias,
        top_logprobs=request.top_logprobs if request.logprobs else None,
    )


def _context_error(exc: ApiError, request: ChatRequest) -> ApiError:
    """`exc` as the request hears it: a non-streamed context_over_budget has kv_used/kv_cap in its message text
    only (spec), wherever it came from (at submit, or while the job waited in the queue and the memory ladder
    cut the window)."""
    if not request.stream and exc.error_type == "context_over_budget":
        exc.extra = {}
    return exc


async def start_completion(instance: ModelInstance, request: ChatRequest, env: EnvKnobs) -> Completion:
    """Build the prompt and submit one job per choice. Errors for the first choice are the request's errors;
    a later choice that cannot be queued is dropped with n_status."""
    served = instance.served
    scheduler = instance.scheduler

    def prepare() -> tuple[Prompt, Structure]:
        dialect, tools = structure.offered_tools(served, request)
        prompt = build_prompt(served, request, no_think_default=env.no_think, dialect=dialect, tools=tools,
                              window=scheduler.kv_cap)
        return prompt, structure.plan(served, request, env, dialect, tools, prompt.think_mode)

    try:
        # On a worker thread: rendering and encoding an agent's ~8k-token prompt takes ~10 ms, a multi-megabyte
        # one seconds, and the event loop keeps serving the streams meanwhile (the encoder lets go of the GIL).
        prompt, plan = await trio.to_thread.run_sync(prepare)
    except PromptOverWindow as exc:
        raise _context_error(scheduler.over_window(exc.n_tokens, at_least=True), request) from None
    except RecursionError:
        # A tool's parameters (or another part of the request) nested deeper than the schema code's recursion
        # goes: JSON the parser took (it stops at 1024 levels) but no schema needs; the client's error, not a 500.
        raise invalid_request("the request nests its JSON too deeply (tool parameters, schemas)") from None
    completion = Completion(instance, request, prompt, structure=plan)
    if request.n_capped:
        completion.n_status = "capped_to_8"
    stop_ids = served.tokenizer.stop_ids
    # ignore_eos bans the end tokens as llama.cpp does (a bias of -inf), where no grammar is armed: a grammar
    # ends its text with one, and banning it there would leave no token to draw. A lazy ("auto") grammar's text
    # may always go on, inside a call too, and before an opener the turn must decode as without the grammar.
    never = stop_ids if request.ignore_eos and (plan.grammar is None or plan.lazy) else frozenset()
    for i in range(request.n):
        grammar = structure.grammar_controller(served, plan, think=prompt.think, opens_think=prompt.opens_think)
        job = GenerationJob(prompt=prompt.tokens, sampling=_sampling(request, i, never), max_tokens=request.max_tokens,
                            stop_ids=stop_ids, session_key=request.session_id if i == 0 else None,
                            cache_prompt=request.cache_prompt,
                            constraint=_controller(served, request, prompt, grammar),
                            history_end=prompt.history_end, request=completion)
        try:
            channel = instance.scheduler.submit(job)
        except ApiError as exc:
            if i == 0:
                raise _context_error(exc, request)
            # Fewer than the 8 a cap would leave: the slots are the reason the client must hear.
            completion.n_status = "partial_slot_unavailable"
            break
        completion.jobs.append(job)
        completion.channels.append(channel)
        completion.grammars.append(grammar)
    return completion


def _controller(served: LoadedModel, request: ChatRequest, prompt: Prompt, grammar: Any) -> Any:
    """The token controllers of one choice: the reasoning budget (request, else the model's --reasoning-budget;
    0 or negative disables it) and the grammar."""
    parts: list[Any] = []
    budget = request.reasoning_budget if request.reasoning_budget is not None else served.options.reasoning_budget
    if budget > 0 and prompt.think and prompt.thinking:
        tokenizer = served.tokenizer
        parts.append(ReasoningBudget(budget, tokenizer.encode("\n</think>\n\n"), tokenizer.token_bytes,
                                     starts_inside=prompt.opens_think))
    if grammar is not None:
        parts.append(grammar)
    if not parts:
        return None
    return parts[0] if len(parts) == 1 else Controllers(parts)


def _new_output(completion: Completion) -> ChoiceOutput:
    r = completion.request
    plan = completion.structure
    parser = plan.dialect.parser(plan.tools) if plan is not None and plan.tools else None
    if parser is not None:
        parser.call_forced = plan.call_forced
    return ChoiceOutput(completion.instance.served.tokenizer, stops=r.stop, think=completion.prompt.think,
                        prompt_opens_think=completion.prompt.opens_think, want_logprobs=r.logprobs,
                        tool_parser=parser, max_calls=None if r.parallel_tool_calls else 1)


def _response_format_status(completion: Completion, results: list[ChoiceResult]) -> str | None:
    plan = completion.structure
    if plan is None or plan.response_format_status is None:
        return None
    if plan.json_constrained and any(not _closed_json(r) for r in results):
        return "not_enforced"
    return plan.response_format_status


def _closed_json(result: ChoiceResult) -> bool:
    """The choice's answer closed a complete JSON value: its grammar completed, and no stop string cut the
    text afterwards (the grammar sees the tokens of a stop string, which the content then drops)."""
    if result.controller is None or not result.controller.completed:
        return False
    if not result.output.stopped:
        return True
    try:
        orjson.loads(result.output.content)
    except orjson.JSONDecodeError:
        return False
    return True


def _choice_extras(result: ChoiceResult) -> dict[str, Any]:
    """Fields beside `finish_reason` on a choice: tool_call_error for a call started and not finished."""
    if result.output.tool_call_errors:
        return {"tool_call_error": result.output.tool_call_errors[0]}
    return {}


async def wait_until_started(completion: Completion) -> None:
    """Wait for the first choice's first event: a stream's status line is only sent once the request has
    left the queue and produced something, so a refusal while queued (429 after the queue timeout, a
    session-capacity error) is still a proper HTTP error, not an empty stream."""
    channel = completion.channels[0]
    try:
        event = await channel.receive()
    except trio.EndOfChannel:
        return
    completion.early_events.setdefault(0, []).append(event)
    if isinstance(event, ErrorEvent):
        raise _context_error(event.error, completion.request)


async def _events(completion: Completion, index: int) -> AsyncIterator[Any]:
    for event in completion.early_events.pop(index, []):
        yield event
    async for event in completion.channels[index]:
        yield event


async def _run_choice(completion: Completion, index: int, on_delta: Any = None, now: NowSink | None = None
                      ) -> ChoiceResult:
    """Consume one job's events into a ChoiceResult; `on_delta(delta)` sees every non-empty delta.

    With `now`, a token can skip the events channel: while this task waits on an empty channel and the sink
    is ready, the scheduler hands the token to `job.on_token` in the wake-up that brings its step, which does
    what this loop would do with it (push, `now.send` the delta's chunks) there and then. That saves the loop
    a scheduling round and the channel per token (~45 us of the ~300 us a streamed token cost the event loop
    in a 1-stream decode on the 2-core VM), and a stop string ends the turn before the scheduler's next step. A
    whole (non-streamed) choice passes a sink that sends nothing (`_KEEP_AT_ONCE`): on_delta is None there, and
    the deltas only accumulate in the result. Everything else (a sink that is not ready, a token behind queued
    events, the finish) takes the channel, in order."""
    job, channel = completion.jobs[index], completion.channels[index]
    result = ChoiceResult(index, _new_output(completion), controller=completion.grammars[index])
    failed: list[Exception] = []  # what taking a token at once raised: raised here, in this task

    def take(sampled: SampledToken) -> bool:
        statistics = channel.statistics()
        # Only while this task is parked in receive() with nothing handed to it yet: the token is the next
        # event it would see.
        if (statistics.tasks_waiting_receive != 1 or statistics.current_buffer_used or failed
                or result.output.stopped or not now.ready()):  # type: ignore[union-attr]
            return False
        try:
            delta = result.output.push(sampled)
            if delta and on_delta is not None:  # a streamed choice sends it; a whole one only keeps it
                for chunk in _delta_chunks(completion, index, delta):
                    now.send(chunk)  # type: ignore[union-attr]
        except Exception as exc:  # noqa: BLE001 - re-raised by the loop below, as if it had pushed the token
            failed.append(exc)
        if result.output.stopped or failed:
            job.cancel()  # the scheduler ends the turn and still sends its usage
        return True

    try:
        async with channel:
            if now is not None:
                job.on_token = take
                job.on_flush = now.flush
            async for event in _events(completion, index):
                if failed:
                    raise failed[0]
                if isinstance(event, TokenEvent):
                    if result.output.stopped:
                        continue  # tokens decoded after the stop string, before the scheduler saw the cancel
                    delta = result.output.push(event.sampled)
                    if delta and on_delta is not None:
                        await on_delta(delta)
                    if result.output.stopped:
                        job.cancel()  # the scheduler ends the turn and still sends its usage
                elif isinstance(event, FinishEvent) and result.output.stopped:
                    result.usage = event.usage  # finish_reason stays "stop": a stop string ended it
                elif isinstance(event, FinishEvent):
                    result.finish_reason = event.reason
                    result.usage = event.usage
                    if event.end_token:
                        result.output.end_token()
                elif isinstance(event, ErrorEvent):
                    # A failure after generation began closes the choice normally (spec: finish "stop").
                    result.finish_reason = "stop"
                    result.usage = event.usage
                    result.error = event.error
                    if not result.output.completion_tokens and index == 0 and on_delta is None:
                        raise _context_error(event.error, completion.request)
                    if result.never_ran:  # fewer choices came back than were asked for: say why
                        completion.n_status = ("partial_slot_unavailable" if event.error.error_type == "server_busy"
                                               else "partial_generation_failed")
            if failed:
                raise failed[0]
    finally:
        job.on_token = None
        job.on_flush = None
        job.cancel()
    delta = result.output.finish()
    if delta and on_delta is not None:
        await on_delta(delta)
    return result


def _usage_body(completion: Completion, results: list[ChoiceResult]) -> dict[str, Any]:
    first = results[0].usage if results else None
    prompt_tokens = len(completion.prompt.tokens)
    completion_tokens = sum(r.output.completion_tokens for r in results)
    body: dict[str, Any] = {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "prompt_tokens_details": {"cached_tokens": first.cached_tokens if first else 0},
        "kv_used": first.kv_used if first else prompt_tokens,
        "kv_cap": completion.instance.scheduler.kv_cap,
    }
    if first is not None and first.session_conflict:
        body["session_conflict"] = True
    return body


async def complete(completion: Completion) -> dict[str, Any]:
    results: list[ChoiceResult | None] = [None] * len(completion.jobs)

    async def run(i: int) -> None:
        results[i] = await _run_choice(completion, i, now=_KEEP_AT_ONCE)

    async with trio.open_nursery() as nursery:
        for i in range(len(completion.jobs)):
            nursery.start_soon(run, i)
    # A later choice that never ran (its queue wait timed out) is left out, as one that could not be queued is;
    # n_status says so. (A stream has already opened it: there it closes empty, with the same n_status.)
    done = [r for r in results if r is not None and not r.never_ran]
    choices = []
    for r in done:
        calls = r.output.tool_calls
        content = r.output.content
        message: dict[str, Any] = {"role": "assistant", "content": None if calls and not content.strip() else content}
        if r.output.reasoning:
            message["reasoning_content"] = r.output.reasoning
        if calls:
            message["tool_calls"] = calls
        choice: dict[str, Any] = {"index": r.index, "message": message, "finish_reason": r.final_reason}
        choice.update(_choice_extras(r))
        if completion.request.logprobs:
            choice["logprobs"] = {"content": r.output.logprobs}
        choices.append(choice)
    body: dict[str, Any] = {
        "id": completion.id,
        "object": "chat.completion",
        "created": completion.created,
        "model": completion.model_name,
        "choices": choices,
        "usage": _usage_body(completion, done),
    }
    if completion.n_status:
        body["n_status"] = completion.n_status
    status = _response_format_status(completion, done)
    if status is not None:
        body["response_format_status"] = status
    return body


def _chunk(completion: Completion, choices: list[dict[str, Any]], **top: Any) -> dict[str, Any]:
    chunk = {"id": completion.id, "object": "chat.completion.chunk", "created": completion.created,
             "model": completion.model_name, "choices": choices}
    chunk.update(top)
    return chunk


def _delta_chunks(completion: Completion, index: int, delta: Delta) -> list[dict[str, Any]]:
    chunks = []
    if delta.reasoning:
        chunks.append({"index": index, "delta": {"reasoning_content": delta.reasoning}, "finish_reason": None})
    if delta.content or (delta.logprobs and not delta.reasoning and not delta.tool_calls):
        chunks.append({"index": index, "delta": {"content": delta.content}, "finish_reason": None})
    for piece in delta.tool_calls:
        if "id" in piece:
            call = {"index": piece["index"], "id": piece["id"], "type": "function",
                    "function": {"name": piece["name"], "arguments": ""}}
        else:
            call = {"index": piece["index"], "function": {"arguments": piece["arguments"]}}
        chunks.append({"index": index, "delta": {"tool_calls": [call]}, "finish_reason": None})
    if delta.logprobs and completion.request.logprobs and chunks:
        chunks[-1]["logprobs"] = {"content": delta.logprobs}
    return [_chunk(completion, [c]) for c in chunks]


Emit = Callable[[dict[str, Any]], Awaitable[None]]


@dataclass(frozen=True)
class NowSink:
    """A sink that can also send without waiting: `send(chunk)` is allowed when `ready()` says so, and after
    it within the same callback. What it sends is held until `flush()` (the scheduler calls it once a wake-up's
    tokens are all handed over: one write for them), or until the next awaited emit, which sends it first;
    whatever the socket cannot take at once goes out before that emit too."""

    ready: Callable[[], bool]
    send: Callable[[dict[str, Any]], None]
    flush: Callable[[], None]


def _always_ready(send: Callable[[dict[str, Any]], None]) -> NowSink:
    """A sink that takes every token at once and hands its chunks to `send` (which never waits)."""
    return NowSink(ready=lambda: True, send=send, flush=lambda: None)


# A whole (non-streamed) choice takes its tokens at once too (`_run_choice`), with nothing to send: a stop string
# then cancels its job in the wake-up that brought the token that completes it, as a streamed choice's does.
# Through the events channel the scheduler ran 1-5 more steps before this task saw the stop (2-core VM): their
# tokens were fed to the slot and stayed in its KV, uncounted, and kv_used varied from run to run.
_KEEP_AT_ONCE = _always_ready(lambda chunk: None)


async def stream(completion: Completion, emit: Emit, now: NowSink | None = None) -> None:
    """Hands the SSE chunk bodies to `emit` in the spec's order. One choice (the usual case) streams straight
    from its job's events, in this task: a token costs no task switch between the scheduler's channel and
    the socket, and with `now` mostly not even the channel (`_run_choice`). With n > 1 the choices run
    concurrently in the scheduler but stream one after another by index: later choices' chunks wait in their
    own buffers."""
    n = len(completion.jobs)
    results: list[ChoiceResult | None] = [None] * n

    async def run(i: int, sink: Emit, now: NowSink | None = None) -> None:
        await sink(_chunk(completion, [{"index": i, "delta": {"role": "assistant"}, "finish_reason": None}]))

        async def on_delta(delta: Delta) -> None:
            for c in _delta_chunks(completion, i, delta):
                await sink(c)

        result = await _run_choice(completion, i, on_delta, now)
        results[i] = result
        top: dict[str, Any] = {}
        if completion.n_status:
            top["n_status"] = completion.n_status
        status = _response_format_status(completion, [result])
        if status is not None:
            top["response_format_status"] = status
        closing = {"index": i, "delta": {}, "finish_reason": result.final_reason, **_choice_extras(result)}
        await sink(_chunk(completion, [closing], **top))

    if n == 1:
        await run(0, emit, now)
    else:
        buffers = [trio.open_memory_channel[dict[str, Any]](math.inf) for _ in range(n)]

        async def buffered(i: int) -> None:
            send = buffers[i][0]

            async def sink(chunk: dict[str, Any]) -> None:
                send.send_nowait(chunk)

            async with send:  # its chunks wait in the buffer: taken at once too, a stop ends the turn there
                await run(i, sink, _always_ready(send.send_nowait))

        async with trio.open_nursery() as nursery:
            for i in range(n):
                nursery.start_soon(buffered, i)
            for i in range(n):
                async with buffers[i][1] as receive:
                    async for chunk in receive:
                        await emit(chunk)
    if completion.request.include_usage:
        done = [r for r in results if r is not None]
        await emit(_chunk(completion, [], usage=_usage_body(completion, done)))
