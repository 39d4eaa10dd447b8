"""A hybrid (Gated DeltaNet + attention + MoE) model served end to end: think-style template, reasoning
budget, and sessions that resume from state checkpoints (tests/fixtures/qwen35, random weights)."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest

from tests.server_process import ServerProcess

pytestmark = pytest.mark.slow

FIXTURE = Path(__file__).parent / "fixtures" / "qwen35" / "qwen35moe.gguf"


@pytest.fixture(scope="module")
def hybrid(tmp_path_factory: pytest.TempPathFactory):
    log = tmp_path_factory.mktemp("hybrid") / "serve.log"
    server = ServerProcess(["--model", f"{FIXTURE}:hybrid", "--max-sessions", "2"], log_path=log).start()
    yield server
    server.stop()


def chat(server: ServerProcess, messages: list[dict], **body: object) -> dict:
    r = httpx.post(server.base_url + "/v1/chat/completions", timeout=300,
                   json={"messages": messages, "temperature": 0, "max_tokens": 12, **body})
    assert r.status_code == 200, r.text
    return r.json()


def reply_turn(body: dict) -> dict:
    message = body["choices"][0]["message"]
    turn = {"role": "assistant", "content": message.get("content") or ""}
    if message.get("reasoning_content"):
        turn["reasoning_content"] = message["reasoning_content"]
    return turn


def test_think_template_splits_reasoning(hybrid: ServerProcess) -> None:
    body = chat(hybrid, [{"role": "user", "content": "hello"}], max_tokens=8)
    message = body["choices"][0]["message"]
    # The template opens <think>: until the model closes it, what it writes is reasoning.
    assert message.get("reasoning_content")
    closed = chat(hybrid, [{"role": "user", "content": "hello"}], max_tokens=8, enable_thinking=False)
    assert not closed["choices"][0]["message"].get("reasoning_content")
    assert closed["choices"][0]["message"]["content"]


# The fixture tokenizer's end-of-turn tokens, forbidden where a test needs the answer to go on past a forced
# </think> (what random weights write next is arbitrary: after the close, greedily, sometimes the end).
NO_END = {"276": -100, "278": -100}


def test_reasoning_budget_forces_the_block_closed(hybrid: ServerProcess) -> None:
    free = chat(hybrid, [{"role": "user", "content": "think"}], max_tokens=30)["choices"][0]["message"]
    budgeted = chat(hybrid, [{"role": "user", "content": "think"}], max_tokens=30, reasoning_budget=4,
                    logit_bias=NO_END)["choices"][0]["message"]
    assert len(budgeted.get("reasoning_content", "")) < len(free.get("reasoning_content", ""))
    assert budgeted["content"]  # the answer starts once </think> was forced


WEATHER = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]
FIRST_BYTE_OF_A_CHARACTER = "228"  # the fixture tokenizer's byte token 0xE4, which starts a 3-byte character


@pytest.mark.parametrize("structure", [{"tools": WEATHER, "tool_choice": "required"},
                                       {"response_format": {"type": "json_object"}}])
def test_a_budget_spent_inside_a_character_still_closes_the_block(hybrid: ServerProcess, structure: dict) -> None:
    """The budget runs out right after a character's first byte (the bias makes that the first reasoning
    token): the character is completed, then </think> forced, and the turn goes on to what its grammar compels
    (the closing text after a lone lead byte is no UTF-8: the grammar refused it, and the turn ended "stop"
    with no call, no JSON and no error)."""
    body = chat(hybrid, [{"role": "user", "content": "weather in Paris?"}], max_tokens=48, reasoning_budget=1,
                logit_bias={FIRST_BYTE_OF_A_CHARACTER: 100}, **structure)
    choice = body["choices"][0]
    assert "\ufffd" not in choice["message"].get("reasoning_content", ""), choice
    if "tools" in structure:
        assert choice["finish_reason"] == "tool_calls" or "tool_call_error" in choice, choice
    else:
        assert choice["message"]["content"].lstrip().startswith("{"), choice


def test_a_continued_assistant_message_continues_its_answer(hybrid: ServerProcess) -> None:
    """A trailing assistant message with answer text is continued as answer (content), after its reasoning in
    a closed block; one with reasoning and no answer yet is continued as reasoning."""
    ask = {"role": "user", "content": "continue me"}
    answer = chat(hybrid, [ask, {"role": "assistant", "content": "Answer:", "reasoning_content": "I thought."}],
                  max_tokens=6)["choices"][0]["message"]
    assert answer["content"] and not answer.get("reasoning_content"), answer
    thought = chat(hybrid, [ask, {"role": "assistant", "content": "", "reasoning_content": "I thought"}],
                   max_tokens=6, logit_bias={"280": -100})["choices"][0]["message"]  # 280: </think>
    assert thought.get("reasoning_content") and not thought.get("content"), thought


def test_second_turn_resumes_from_a_checkpoint_and_equals_cold(hybrid: ServerProcess) -> None:
    first_msgs = [{"role": "user", "content": "tell me something"}]
    first = chat(hybrid, first_msgs, session_id="conv")
    assert first["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    second_msgs = first_msgs + [reply_turn(first), {"role": "user", "content": "and more"}]
    warm = chat(hybrid, second_msgs, session_id="conv")
    cold = chat(hybrid, second_msgs)
    cached = warm["usage"]["prompt_tokens_details"]["cached_tokens"]
    # Resumed from the checkpoint where the first turn's history ended (before its generation prompt: the
    # template re-renders the reply without its reasoning, so the prompts diverge right after that point).
    assert first["usage"]["prompt_tokens"] // 2 <= cached < first["usage"]["prompt_tokens"]
    assert cold["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    assert warm["choices"][0]["message"] == cold["choices"][0]["message"]


def test_export_restore_continue_equals_uninterrupted(hybrid: ServerProcess) -> None:
    msgs = [{"role": "user", "content": "a story please"}]
    first = chat(hybrid, msgs, session_id="blob")
    exported = httpx.post(hybrid.base_url + "/admin/session/export", json={"session_id": "blob"}).json()
    assert exported["n_tok"] > 0
    next_msgs = msgs + [reply_turn(first), {"role": "user", "content": "continue"}]
    uninterrupted = chat(hybrid, next_msgs, session_id="blob")
    httpx.post(hybrid.base_url + "/session/release", json={"session_id": "blob"})
    r = httpx.post(hybrid.base_url + "/session/restore", json={"session_id": "blob", "blob": exported["blob_b64"],
                                                               "tokens": exported["tokens"]})
    assert r.status_code == 200, r.text
    restored = chat(hybrid, next_msgs, session_id="blob")
    assert restored["choices"][0]["message"] == uninterrupted["choices"][0]["message"]
    # The blob carries the recurrent state's checkpoints too: the restored session resumes from the same one the
    # live session did (the state at the blob's end is past where the re-rendered prompt diverges).
    cached = restored["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert cached == uninterrupted["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
