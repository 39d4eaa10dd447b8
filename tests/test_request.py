"""Request parsing: defaults, aliases, clamps, precedence and validation errors."""

from __future__ import annotations

import pytest

from pantheon.chat.request import parse_chat_request
from pantheon.errors import ApiError

MSG = [{"role": "user", "content": "hi"}]


def parse(**body: object):
    return parse_chat_request({"messages": MSG, **body})


def test_defaults_match_the_spec() -> None:
    r = parse()
    assert (r.temperature, r.top_p, r.top_k, r.max_tokens, r.n, r.stream) == (0.7, 0.95, 40, 1024, 1, False)
    assert r.stop == [] and r.logit_bias == {} and r.session_id is None and r.tool_choice == "auto"


@pytest.mark.parametrize("value,expected", [(0, 512), (-5, 512), (10, 10), (10**9, 1048576)])
def test_max_tokens_defaults_and_clamp(value: int, expected: int) -> None:
    assert parse(max_tokens=value).max_tokens == expected


def test_max_tokens_wins_over_max_completion_tokens() -> None:
    assert parse(max_tokens=5, max_completion_tokens=9).max_tokens == 5
    assert parse(max_completion_tokens=9).max_tokens == 9


def test_llama_server_and_vllm_names() -> None:
    """n_predict (llama-server) stands for max_tokens after max_completion_tokens; repeat_penalty (llama.cpp)
    wins over repetition_penalty (vLLM); ignore_eos is read."""
    assert parse(n_predict=7).max_tokens == 7
    assert parse(max_completion_tokens=9, n_predict=7).max_tokens == 9
    assert parse(n_predict=-1).max_tokens == 512  # as max_tokens reads a negative count
    assert parse(repetition_penalty=1.3).repeat_penalty == 1.3
    assert parse(repeat_penalty=1.1, repetition_penalty=1.3).repeat_penalty == 1.1
    assert (parse().repeat_penalty, parse().repeat_last_n, parse().ignore_eos) == (1.0, 64, False)
    assert parse(repeat_last_n=-1, ignore_eos=True).repeat_last_n == -1 and parse(ignore_eos=True).ignore_eos
    # A window longer than any reply is the whole reply (a 2**63 one ended the server: no deque holds it).
    assert parse(repeat_last_n=2**63).repeat_last_n == parse(repeat_last_n=1e20).repeat_last_n == -1
    assert parse(repeat_last_n=1_048_576).repeat_last_n == 1_048_576


def test_penalties_and_logprobs_are_clamped() -> None:
    r = parse(presence_penalty=5, frequency_penalty=-7, top_logprobs=99, logprobs=True)
    assert (r.presence_penalty, r.frequency_penalty, r.top_logprobs) == (2.0, -2.0, 20)


def test_logit_bias_clamps_and_skips_non_numeric() -> None:
    r = parse(logit_bias={"5": 500, "x": 1, "7": "a", "9": -3.5})
    assert r.logit_bias == {5: 100.0, 9: -3.5}
    # Keys Python's int() would read but that are not plain token ids: skipped as well.
    r = parse(logit_bias={"1_0": 100, " 12 ": 100, "\uff11\uff12": 100, "+7": 100, "-1": 100, "3": 1})
    assert r.logit_bias == {3: 1.0}
    # Past int()'s 4300-digit limit (a ValueError, once a 500) and any id a vocabulary has: skipped too.
    r = parse(logit_bias={"9" * 5000: 1, "1" * 19: 1, "4": 2})
    assert r.logit_bias == {4: 2.0}


def test_n_is_capped_to_8() -> None:
    r = parse(n=20)
    assert r.n == 8 and r.n_capped


def test_stop_accepts_string_or_array() -> None:
    assert parse(stop="END").stop == ["END"]
    assert parse(stop=["a", "b"]).stop == ["a", "b"]


def test_session_key_precedence() -> None:
    body = {"messages": MSG, "prompt_cache_key": "p", "promptCacheKey": "c"}
    assert parse_chat_request(body, header_session="h").session_id == "p"
    assert parse_chat_request({"messages": MSG, "promptCacheKey": "c"}, header_session="h").session_id == "c"
    assert parse_chat_request({"messages": MSG}, header_session="h").session_id == "h"
    assert parse_chat_request({**body, "session_id": "s"}).session_id == "s"


def test_message_content_forms() -> None:
    r = parse_chat_request({"messages": [
        {"content": "no role"},
        {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "image_url", "image_url": {}},
                                     {"type": "text", "text": "b"}]},
        {"role": "assistant", "content": 42, "reasoning": "thought"},
    ]})
    assert [(m.role, m.content) for m in r.messages] == [("user", "no role"), ("user", "a\nb"), ("assistant", "")]
    assert [m.unjoined_text for m in r.messages] == [None, "ab", None]
    assert r.messages[2].reasoning_content == "thought"
    # llama-server's join: a newline before each part once there is text, so empty parts count after the first.
    empty_parts = [{"type": "text", "text": t} for t in ("", "a", "", "b")]
    assert parse_chat_request({"messages": [{"role": "user", "content": empty_parts}]}).messages[0].content == "a\n\nb"


def test_stream_options_include_usage() -> None:
    assert parse(stream=True, stream_options={"include_usage": True}).include_usage
    assert not parse(stream=True, stream_options={}).include_usage
    assert not parse(stream=True, stream_options=None).include_usage


def test_integral_numbers_pass_as_integers_and_an_empty_role_is_the_users() -> None:
    assert parse(max_tokens=3.0, n=2.0).max_tokens == 3
    assert parse_chat_request({"messages": [{"role": "", "content": "hi"}]}).messages[0].role == "user"


def test_min_p_is_read_and_clamped() -> None:
    assert parse().min_p == 0.0
    assert parse(min_p=0.05).min_p == 0.05
    assert (parse(min_p=-1).min_p, parse(min_p=7).min_p) == (0.0, 1.0)


def test_reasoning_budget_alias() -> None:
    assert parse(max_reasoning_tokens=7).reasoning_budget == 7
    assert parse(reasoning_budget=3, max_reasoning_tokens=7).reasoning_budget == 3


def test_seed_is_any_number_and_model_any_value() -> None:
    # spec: `seed` is a number (a fraction seeds as its integer part, as llama-server reads it); with one model
    # loaded "any value" of `model` routes to it, so a non-string is taken as its JSON text, not refused.
    assert parse(seed=7.9).seed == 7 and parse(seed=-3).seed == -3 and parse(seed=None).seed is None
    assert parse(model=3).model == "3" and parse(model={"a": 1}).model == '{"a":1}'


def test_replayed_calls_take_json_text_or_an_object_as_arguments() -> None:
    calls = [{"id": "c1", "type": "function", "function": {"name": "f", "arguments": '{"a": 1}'}},
             {"id": "c2", "type": "function", "function": {"name": "g", "arguments": {"b": 2}}},
             {"id": "c3", "type": "function", "function": {"name": "h"}}]
    request = parse_chat_request({"messages": [{"role": "user", "content": "hi"},
                                               {"role": "assistant", "content": None, "tool_calls": calls}]})
    assert request.messages[1].tool_calls == calls


@pytest.mark.parametrize("body", [
    [], "x", {}, {"messages": []}, {"messages": "hi"}, {"messages": [1]},
    {"messages": MSG, "temperature": "hot"}, {"messages": MSG, "max_tokens": "many"},
    {"messages": MSG, "stop": 5}, {"messages": MSG, "stream": "yes"}, {"messages": MSG, "seed": "7"},
    # Wrong types are refused the same way everywhere, not read as something else.
    {"messages": MSG, "tools": [1]}, {"messages": MSG, "tools": ["x"]}, {"messages": MSG, "tools": [None]},
    {"messages": [{"role": 0, "content": "hi"}]}, {"messages": [{"role": False, "content": "hi"}]},
    {"messages": [{"role": [], "content": "hi"}]}, {"messages": [{"role": {}, "content": "hi"}]},
    {"messages": MSG, "stream_options": "x"}, {"messages": MSG, "stream_options": {"include_usage": "yes"}},
    {"messages": MSG, "max_tokens": 2.5}, {"messages": MSG, "n": 1.5}, {"messages": MSG, "top_k": 1.5},
    {"messages": MSG, "seed": True}, {"messages": MSG, "session_id": 5}, {"messages": MSG, "prompt_cache_key": ["a"]},
    {"messages": MSG, "min_p": "x"}, {"messages": MSG, "parallel_tool_calls": "no"},
    {"messages": MSG, "cache_prompt": "false"},
    # An alias of the wrong type is refused even where the field it stands for is given and wins.
    {"messages": MSG, "max_tokens": 2, "max_completion_tokens": "x"},
    {"messages": MSG, "reasoning_budget": 1, "max_reasoning_tokens": "x"},
    {"messages": MSG, "session_id": "s", "prompt_cache_key": 5},
    {"messages": MSG, "session_id": "s", "promptCacheKey": []},
    {"messages": MSG, "max_tokens": 2, "n_predict": 1.5}, {"messages": MSG, "ignore_eos": 1},
    {"messages": MSG, "repeat_penalty": 1.1, "repetition_penalty": "x"}, {"messages": MSG, "repeat_penalty": 0},
    {"messages": MSG, "repetition_penalty": -1.0}, {"messages": MSG, "repeat_last_n": -2},
    {"messages": MSG, "repeat_last_n": 1.5},
    *({"messages": [{"role": "assistant", "content": "a", key: 5}]}
      for key in ("reasoning_content", "tool_call_id", "name")),
    # Replayed calls: OpenAI's shape (an object whose function has a name and JSON-text arguments).
    *({"messages": [{"role": "assistant", "content": None, "tool_calls": calls}]} for calls in (
        "x", [1], [{"id": "c"}], [{"function": "f"}], [{"function": {"arguments": "{}"}}],
        [{"function": {"name": "", "arguments": "{}"}}], [{"function": {"name": "f", "arguments": 5}}],
        [{"function": {"name": "f", "arguments": ["a"]}}])),
])
def test_invalid_bodies_are_400(body: object) -> None:
    with pytest.raises(ApiError) as info:
        parse_chat_request(body)
    assert info.value.status == 400 and info.value.error_type == "invalid_request_error"


def test_cache_prompt_defaults_to_true() -> None:
    assert parse_chat_request({"messages": MSG}).cache_prompt is True
    assert parse_chat_request({"messages": MSG, "cache_prompt": False}).cache_prompt is False


def test_a_developer_message_is_a_system_message() -> None:
    req = parse_chat_request({"messages": [{"role": "developer", "content": "Answer in French."},
                                           {"role": "user", "content": "Hi"}]})
    assert [m.role for m in req.messages] == ["system", "user"]
    assert req.messages[0].content == "Answer in French."
