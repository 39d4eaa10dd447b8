"""A streamed choice with a `NowSink` (pantheon.chat.completion): a token the scheduler hands to `job.on_token`
while the consumer waits on an empty channel is pushed and sent right there; every other token takes the
channel. Either way the chunks come out once each, in token order, and a stop string still ends the turn."""

from __future__ import annotations

import math
from types import SimpleNamespace
from typing import Any

import pytest
import trio
import trio.testing

from pantheon.chat import completion as chat_completion
from pantheon.chat.structure import Structure
from pantheon.chat.tools import DIALECTS, parse_tools
from pantheon.config import read_env
from pantheon.engine.sampling import SampledToken, SamplingParams
from pantheon.io.tokenizer import Tokenizer
from pantheon.sched.jobs import FinishEvent, GenerationJob, TokenEvent, Usage
from tests.test_tokenizer import read_metadata

TEXT = "Hello there, how are you today? I am fine, thank you."


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    path = read_env().default_model_path
    if not path.exists():
        pytest.fail(f"default model missing at {path}: run `make test` first")
    return Tokenizer.from_gguf_metadata(read_metadata(path))


def _completion(tokenizer: Tokenizer, stops: list[str]) -> tuple[chat_completion.Completion, Any]:
    request = SimpleNamespace(stop=stops, logprobs=False, include_usage=False, parallel_tool_calls=True)
    instance = SimpleNamespace(name="m", served=SimpleNamespace(tokenizer=tokenizer))
    prompt = SimpleNamespace(think=False, opens_think=False)
    completion = chat_completion.Completion(instance=instance, request=request, prompt=prompt)  # type: ignore[arg-type]
    send, receive = trio.open_memory_channel[Any](math.inf)
    completion.jobs.append(GenerationJob(prompt=[1], sampling=SamplingParams(), max_tokens=100,
                                         stop_ids=frozenset()))
    completion.channels.append(receive)
    completion.grammars.append(None)
    return completion, send


def _content(chunks: list[tuple[str, dict[str, Any]]]) -> str:
    return "".join(c["choices"][0]["delta"].get("content") or "" for _, c in chunks if c["choices"])


async def _relay(tokenizer: Tokenizer, stops: list[str], ready_for: Any, back_to_back: set[int] = frozenset()
                 ) -> tuple[list[tuple[str, dict[str, Any]]], list[str], GenerationJob]:
    """Stream TEXT's tokens as the scheduler would (on_token first, else the channel), the sink ready for token
    i when ready_for(i). Tokens in back_to_back follow the one before without letting the consumer run.
    Returns the chunks in sending order with the road each took, the roads of the tokens, and the job."""
    completion, send = _completion(tokenizer, stops)
    job = completion.jobs[0]
    chunks: list[tuple[str, dict[str, Any]]] = []
    roads: list[str] = []
    ready = [True]

    async def emit(chunk: dict[str, Any]) -> None:
        await trio.sleep(0)  # a real send may wait
        chunks.append(("awaited", chunk))

    now = chat_completion.NowSink(lambda: ready[0], lambda chunk: chunks.append(("now", chunk)), lambda: None)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(chat_completion.stream, completion, emit, now)
        await trio.testing.wait_all_tasks_blocked()
        for i, token in enumerate(tokenizer.encode(TEXT)):
            if i not in back_to_back:
                await trio.testing.wait_all_tasks_blocked()
            if job.cancelled:
                break
            ready[0] = ready_for(i)
            sampled = SampledToken(token)
            if job.on_token is not None and job.on_token(sampled):
                roads.append("now")
            else:
                roads.append("channel")
                send.send_nowait(TokenEvent(sampled))
        await trio.testing.wait_all_tasks_blocked()
        send.send_nowait(FinishEvent("stop", Usage(1, 0, len(roads), 1 + len(roads), 100)))
        await send.aclose()
    return chunks, roads, job


async def test_tokens_go_straight_to_a_ready_sink_and_through_the_channel_otherwise(tokenizer: Tokenizer) -> None:
    chunks, roads, job = await _relay(tokenizer, [], lambda i: i % 3 != 1)
    assert _content(chunks) == TEXT
    assert roads.count("now") >= 2 * len(roads) // 3 - 1 and "channel" in roads
    # The chunks sent at once are content chunks of tokens taken at once; the role and finish chunks are awaited.
    sent_now = [c for road, c in chunks if road == "now"]
    assert sent_now and all(c["choices"][0]["delta"].get("content") for c in sent_now)
    assert chunks[0][1]["choices"][0]["delta"] == {"role": "assistant"}
    assert chunks[-1][1]["choices"][0]["finish_reason"] == "stop"
    assert job.on_token is None  # the consumer is gone: no more hand-offs


async def test_a_token_behind_a_queued_one_takes_the_channel_too(tokenizer: Tokenizer) -> None:
    """Token 1 finds the sink not ready and is queued; token 2 comes before the consumer has run and finds the
    sink ready: it must still queue behind token 1, or the text would come out of order."""
    chunks, roads, _ = await _relay(tokenizer, [], lambda i: i != 1, back_to_back={2})
    assert roads[1:3] == ["channel", "channel"]
    assert roads[3] == "now"
    assert _content(chunks) == TEXT


async def test_a_stop_string_seen_on_the_short_road_ends_the_turn_there(tokenizer: Tokenizer) -> None:
    chunks, roads, job = await _relay(tokenizer, ["how are"], lambda i: True)
    assert _content(chunks) == "Hello there, "
    assert job.cancelled  # set while the token was taken, so the scheduler drops the job at once
    assert set(roads) == {"now"}
    assert chunks[-1][1]["choices"][0]["finish_reason"] == "stop"


CALL_THEN_TEXT = ("<tool_call>\n<function=get_time>\n<parameter=zone>\nCET\n</parameter>\n</function>\n</tool_call>\n"
                  "And then I will")


def _tool_completion(tokenizer: Tokenizer) -> tuple[chat_completion.Completion, Any]:
    """A completion of one choice whose tools are parsed in the default (Qwen XML) dialect."""
    completion, send = _completion(tokenizer, [])
    completion.request.logprobs = False
    completion.prompt = SimpleNamespace(think=False, opens_think=False, tokens=[1, 2, 3])
    completion.instance.scheduler = SimpleNamespace(kv_cap=100)
    tools = parse_tools([{"type": "function", "function": {
        "name": "get_time", "parameters": {"type": "object", "properties": {"zone": {"type": "string"}}}}}])
    completion.structure = Structure(dialect=DIALECTS["qwen_xml"], tools=tools)
    return completion, send


@pytest.mark.parametrize("reason, final", [("length", "tool_calls"), ("stop", "tool_calls"),
                                           ("repetition_loop", "repetition_loop")])
async def test_a_turn_with_a_parsed_call_ends_with_tool_calls(tokenizer: Tokenizer, reason: str, final: str) -> None:
    """The spec: "tool_calls present when a call was parsed; finish_reason is then tool_calls", a turn max_tokens
    cut after a finished call included (llama-server says "length" there); only repetition_loop outranks it."""
    tokens = tokenizer.encode(CALL_THEN_TEXT)

    async def run(streamed: bool) -> tuple[str, list[dict[str, Any]]]:
        completion, send = _tool_completion(tokenizer)
        for token in tokens:
            send.send_nowait(TokenEvent(SampledToken(token)))
        send.send_nowait(FinishEvent(reason, Usage(3, 0, len(tokens), 3 + len(tokens), 100)))
        send.close()
        if not streamed:
            choice = (await chat_completion.complete(completion))["choices"][0]
            return choice["finish_reason"], choice["message"]["tool_calls"]
        chunks: list[dict[str, Any]] = []

        async def emit(chunk: dict[str, Any]) -> None:
            chunks.append(chunk)

        await chat_completion.stream(completion, emit)
        deltas = [call for c in chunks if c["choices"] for call in c["choices"][0]["delta"].get("tool_calls", [])]
        return chunks[-1]["choices"][0]["finish_reason"], deltas

    for streamed in (False, True):
        finish, calls = await run(streamed)
        assert finish == final, streamed
        assert [call["function"]["name"] for call in calls if "name" in call["function"]] == ["get_time"], calls
