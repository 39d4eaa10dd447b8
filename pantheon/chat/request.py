"""Parse and validate a /v1/chat/completions body into a typed ChatRequest (defaults, aliases, clamps)."""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import orjson

from pantheon.errors import invalid_request

MAX_TOKENS_CLAMP = 1_048_576
DEFAULT_MAX_TOKENS = 1024
N_CAP = 8


@dataclass
class Message:
    role: str
    content: str
    reasoning_content: str | None = None
    tool_calls: list[dict[str, Any]] | None = None
    tool_call_id: str | None = None
    name: str | None = None
    # An array content's text parts joined with nothing: what llama-server appends when it continues a
    # trailing assistant message (`content` joins them by newlines, as its templates get them). None for string
    # content.
    unjoined_text: str | None = None


@dataclass
class ChatRequest:
    messages: list[Message]
    model: str | None = None
    temperature: float = 0.7
    top_p: float = 0.95
    top_k: int = 40
    min_p: float = 0.0
    max_tokens: int = DEFAULT_MAX_TOKENS
    stop: list[str] = field(default_factory=list)
    stream: bool = False
    include_usage: bool = False
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repeat_penalty: float = 1.0  # llama.cpp's repeat_penalty, vLLM's repetition_penalty
    repeat_last_n: int = 64
    # llama.cpp's and vLLM's ignore_eos: the end-of-generation tokens are never drawn (unconstrained turns).
    ignore_eos: bool = False
    logit_bias: dict[int, float] = field(default_factory=dict)
    logprobs: bool = False
    top_logprobs: int = 0
    n: int = 1
    n_capped: bool = False
    response_format: dict[str, Any] | None = None
    enable_thinking: bool | None = None
    # llama-server's and vLLM's `chat_template_kwargs`: more variables for the chat template (its
    # `enable_thinking` is taken as the top-level field's fallback, not passed through).
    template_kwargs: dict[str, Any] = field(default_factory=dict)
    reasoning_budget: int | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: Any = "auto"
    parallel_tool_calls: bool = True  # False: one call at most (later ones are dropped)
    session_id: str | None = None
    # llama.cpp's field: False starts the turn cold unless it continues its own session's conversation, instead
    # of from an anonymous cache or a prefix copied from another slot (`SessionTable`); the tokens are the same
    # either way.
    cache_prompt: bool = True


def _number(body: Mapping[str, Any], key: str, default: float) -> float:
    value = body.get(key)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise invalid_request(f"'{key}' must be a finite number")
    return float(value)


def _optional_number(body: Mapping[str, Any], key: str) -> float | None:
    return None if body.get(key) is None else _number(body, key, 0.0)


def _integer(body: Mapping[str, Any], key: str, default: int | None) -> int | None:
    value = body.get(key)
    if value is None:
        return default
    if (isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value)
            or value != int(value)):
        raise invalid_request(f"'{key}' must be an integer")
    return int(value)


def _seed(body: Mapping[str, Any]) -> int | None:
    """`seed` is a number: a fractional one seeds as its integer part (as llama-server reads it)."""
    value = body.get("seed")
    if value is None:
        return None
    _number(body, "seed", 0.0)  # refuses what is not a finite number; an integer seed stays exact
    return int(value)


def _boolean(body: Mapping[str, Any], key: str, default: bool | None) -> bool | None:
    value = body.get(key)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise invalid_request(f"'{key}' must be a boolean")
    return value


# Template variables the server sets itself: a request's chat_template_kwargs cannot replace them.
_RESERVED_TEMPLATE_VARIABLES = frozenset({"messages", "tools", "add_generation_prompt", "bos_token", "eos_token"})


def _template_kwargs(raw: Any) -> dict[str, Any]:
    """`chat_template_kwargs` (llama-server, vLLM): an object of template variables; the ones the server sets
    itself are dropped."""
    if raw is None:
        return {}
    if not isinstance(raw, dict):
        raise invalid_request("'chat_template_kwargs' must be an object")
    return {k: v for k, v in raw.items() if k not in _RESERVED_TEMPLATE_VARIABLES}


def _text_parts(content: Any) -> list[str] | None:
    """The texts of an array of {"type": "text"} parts (other parts are skipped); None for any other content."""
    if not isinstance(content, list):
        return None
    return [part["text"] for part in content
            if isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str)]


def _joined_by_lines(parts: list[str]) -> str:
    """Text parts joined as llama-server joins them for a template that takes string content: a newline
    before each part but the first non-empty one."""
    text = ""
    for part in parts:
        text = f"{text}\n{part}" if text else part
    return text


def _parse_tool_calls(index: int, raw: Any) -> list[dict] | None:
    """An assistant message's replayed calls, checked as OpenAI shapes them: each an object whose `function`
    has a name and arguments given as JSON text (an object is taken too, as llama.cpp does)."""
    if raw is None:
        return None
    if not isinstance(raw, list):
        raise invalid_request(f"messages[{index}].tool_calls must be an array")
    for j, call in enumerate(raw):
        where = f"messages[{index}].tool_calls[{j}]"
        if not isinstance(call, dict):
            raise invalid_request(f"{where} must be an object")
        function = call.get("function")
        if not isinstance(function, dict):
            raise invalid_request(f"{where}.function must be an object")
        name = function.get("name")
        if not isinstance(name, str) or not name:
            raise invalid_request(f"{where}.function.name must be a non-empty string")
        arguments = function.get("arguments")
        if arguments is not None and not isinstance(arguments, (str, dict)):
            raise invalid_request(f"{where}.function.arguments must be a string of JSON text or an object")
    return raw


def _parse_message(index: int, raw: Any) -> Message:
    if not isinstance(raw, dict):
        raise invalid_request(f"messages[{index}] must be an object")
    role = raw.get("role")
    if role is None or role == "":
        role = "user"  # a missing role is the user's, as the spec says
    elif not isinstance(role, str):
        raise invalid_request(f"messages[{index}].role must be a string")
    elif role == "developer":
        # OpenAI's newer name for the system role (its SDKs send it for reasoning models); chat templates
        # know only "system", and would render it as a turn of its own beside their default system prompt.
        role = "system"
    for key in ("reasoning_content", "tool_call_id", "name"):  # strings where given (null reads as absent)
        if raw.get(key) is not None and not isinstance(raw[key], str):
            raise invalid_request(f"messages[{index}].{key} must be a string")
    reasoning = raw.get("reasoning_content")
    if reasoning is None:
        reasoning = raw.get("reasoning")  # other servers' spelling of the same field (taken when a string)
    tool_calls = _parse_tool_calls(index, raw.get("tool_calls"))
    content = raw.get("content")
    parts = _text_parts(content)  # string content as is; anything else that is no parts array reads as empty
    return Message(
        role=role,
        content=content if isinstance(content, str) else _joined_by_lines(parts or []),
        reasoning_content=reasoning if isinstance(reasoning, str) and reasoning else None,
        tool_calls=tool_calls or None,
        tool_call_id=raw.get("tool_call_id"),
        name=raw.get("name"),
        unjoined_text="".join(parts) if parts is not None else None,
    )


def _parse_stop(value: Any) -> list[str]:
    if value is None:
        return []
    if isinstance(value, str):
        return [value] if value else []
    if isinstance(value, list) and all(isinstance(s, str) for s in value):
        return [s for s in value if s]
    raise invalid_request("'stop' must be a string or an array of strings")


# logit_bias keys longer than this are no token id of any vocabulary (ids out of the model's range are skipped
# where the bias is applied).
_MAX_ID_DIGITS = 18


def _parse_logit_bias(value: Any) -> dict[int, float]:
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise invalid_request("'logit_bias' must be an object mapping token ids to numbers")
    bias: dict[int, float] = {}
    for key, raw in value.items():
        # Plain ASCII digits only: Python's int() would also read "1_0", " 12 " and full-width digits as ids.
        if not (isinstance(key, str) and key.isascii() and key.isdigit()):
            continue  # non-numeric keys are skipped, as the spec says
        if len(key) > _MAX_ID_DIGITS:
            continue  # no vocabulary's id (int() refuses past 4300 digits, a ValueError the route would 500 on)
        token = int(key)
        if isinstance(raw, bool) or not isinstance(raw, (int, float)) or not math.isfinite(raw):
            continue
        bias[token] = min(100.0, max(-100.0, float(raw)))
    return bias


def _session_key(body: Mapping[str, Any], header_session: str | None) -> str | None:
    keys = ("session_id", "prompt_cache_key", "promptCacheKey")
    for key in keys:  # every alias present is checked, the ones the first shadows too
        value = body.get(key)
        if value is not None and not isinstance(value, str):
            raise invalid_request(f"'{key}' must be a string")
    return next((body[key] for key in keys if body.get(key)), None) or header_session or None


def parse_chat_request(body: Any, *, header_session: str | None = None) -> ChatRequest:
    if not isinstance(body, dict):
        raise invalid_request("request body must be a JSON object")
    raw_messages = body.get("messages")
    if raw_messages is None:
        raise invalid_request("'messages' is required")
    if not isinstance(raw_messages, list):
        raise invalid_request("'messages' must be an array")
    if not raw_messages:
        raise invalid_request("'messages' must not be empty")
    messages = [_parse_message(i, m) for i, m in enumerate(raw_messages)]

    model = body.get("model")
    if model is not None and not isinstance(model, str):
        # "With one loaded model, any value routes to it": a number or an object is routed as its JSON text,
        # which names no model when several are loaded (404 model_not_found).
        model = orjson.dumps(model).decode()

    # The alias is checked even where max_tokens wins: a field of the wrong type is a 400 wherever it is.
    max_tokens, alias = _integer(body, "max_tokens", None), _integer(body, "max_completion_tokens", None)
    n_predict = _integer(body, "n_predict", None)  # llama-server's name, after the two OpenAI ones
    if max_tokens is None:
        max_tokens = next((v for v in (alias, n_predict) if v is not None), DEFAULT_MAX_TOKENS)
    if max_tokens <= 0:
        max_tokens = 512
    max_tokens = min(max_tokens, MAX_TOKENS_CLAMP)

    n = _integer(body, "n", 1) or 1
    n = max(1, n)
    n_capped = n > N_CAP
    n = min(n, N_CAP)

    stream_options = body.get("stream_options")
    if stream_options is not None and not isinstance(stream_options, dict):
        raise invalid_request("'stream_options' must be an object")
    include_usage = bool(_boolean(stream_options or {}, "include_usage", False))

    logprobs = bool(_boolean(body, "logprobs", False))
    top_logprobs = _integer(body, "top_logprobs", 0) or 0
    top_logprobs = max(0, min(20, top_logprobs))

    seed = _seed(body)

    reasoning_budget, alias = _integer(body, "reasoning_budget", None), _integer(body, "max_reasoning_tokens", None)
    if reasoning_budget is None:
        reasoning_budget = alias

    response_format = body.get("response_format")
    if response_format is not None and not isinstance(response_format, dict):
        raise invalid_request("'response_format' must be an object")

    tools = body.get("tools")
    if tools is not None and not isinstance(tools, list):
        raise invalid_request("'tools' must be an array")
    for i, tool in enumerate(tools or []):
        if not isinstance(tool, dict):
            raise invalid_request(f"tools[{i}] must be an object")

    tool_choice = body.get("tool_choice", "auto")
    if tool_choice is None:
        tool_choice = "auto"

    repeat_penalty, alias = _optional_number(body, "repeat_penalty"), _optional_number(body, "repetition_penalty")
    repeat_penalty = next((v for v in (repeat_penalty, alias) if v is not None), 1.0)
    if repeat_penalty <= 0:  # it divides scores
        raise invalid_request("'repeat_penalty' must be above 0")
    repeat_last_n = _integer(body, "repeat_last_n", 64)
    if repeat_last_n < -1:
        raise invalid_request("'repeat_last_n' must be -1 (the whole reply), 0 (off) or more")
    if repeat_last_n > MAX_TOKENS_CLAMP:  # longer than any reply: the whole reply
        repeat_last_n = -1

    template_kwargs = _template_kwargs(body.get("chat_template_kwargs"))
    enable_thinking = _boolean(body, "enable_thinking", None)
    kwargs_thinking = template_kwargs.pop("enable_thinking", None)
    if kwargs_thinking is not None and not isinstance(kwargs_thinking, bool):  # a 400 even where the field wins
        raise invalid_request("'chat_template_kwargs.enable_thinking' must be a boolean")

    return ChatRequest(
        messages=messages,
        model=model,
        temperature=_number(body, "temperature", 0.7),
        top_p=_number(body, "top_p", 0.95),
        top_k=_integer(body, "top_k", 40) or 0,
        min_p=min(1.0, max(0.0, _number(body, "min_p", 0.0))),
        max_tokens=max_tokens,
        stop=_parse_stop(body.get("stop")),
        stream=bool(_boolean(body, "stream", False)),
        include_usage=include_usage,
        seed=seed,
        presence_penalty=min(2.0, max(-2.0, _number(body, "presence_penalty", 0.0))),
        frequency_penalty=min(2.0, max(-2.0, _number(body, "frequency_penalty", 0.0))),
        repeat_penalty=repeat_penalty,
        repeat_last_n=repeat_last_n,
        ignore_eos=bool(_boolean(body, "ignore_eos", False)),
        logit_bias=_parse_logit_bias(body.get("logit_bias")),
        logprobs=logprobs,
        top_logprobs=top_logprobs,
        n=n,
        n_capped=n_capped,
        response_format=response_format,
        enable_thinking=enable_thinking if enable_thinking is not None else kwargs_thinking,
        template_kwargs=template_kwargs,
        reasoning_budget=reasoning_budget,
        tools=tools or None,
        tool_choice=tool_choice,
        parallel_tool_calls=bool(_boolean(body, "parallel_tool_calls", True)),
        session_id=_session_key(body, header_session),
        cache_prompt=bool(_boolean(body, "cache_prompt", True)),
    )
