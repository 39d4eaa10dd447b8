"""PANTHEON_TOOL_GRAMMAR=1 and tool_choice "auto": the grammar is lazy (spec: "`"auto"` masks once a call opener
appears"). Until the answer writes a call opener the turn decodes as it would unconstrained (no mask, the end
token anywhere, the think block free); from the opener on the call is held to its grammar; once the call has
closed the text is free again, as llama.cpp's lazy grammars with trigger patterns work.

The controller is driven token by token over the Qwen3.5 fixture's vocabulary (fast), then two servers on the
fixture, one with the grammar on and one without, must decode an auto turn alike (slow).
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import httpx
import pytest

from pantheon.chat import structure
from pantheon.chat.request import parse_chat_request
from pantheon.chat.tools import DIALECTS, parse_tools
from pantheon.config import read_env
from pantheon.engine.constraints import GrammarController, grammar_tokenizer
from pantheon.io.gguf_file import open_gguf
from pantheon.io.tokenizer import Tokenizer
from tests.server_process import ServerProcess

FIXTURE = Path(__file__).parent / "fixtures" / "qwen35" / "qwen35moe.gguf"
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
    "required": ["city"]}}}]
# The fixture tokenizer's "<tool_call>" (a user-defined token, as in Qwen's GGUFs) and its end of turn.
TOOL_CALL, IM_END = "281", "278"


@pytest.fixture(scope="module")
def served() -> SimpleNamespace:
    """What `structure.plan` and `structure.grammar_controller` read of a loaded model."""
    tokenizer = Tokenizer.from_gguf_metadata(open_gguf(FIXTURE, read_env().cache_dir).metadata)
    return SimpleNamespace(tokenizer=tokenizer, lltokenizer=grammar_tokenizer(tokenizer),
                           model=SimpleNamespace(vocab_size=tokenizer.vocab_size))


def controller(served: SimpleNamespace, dialect: str = "qwen_xml", *, think: bool = False,
               opens_think: bool = False, tool_choice: Any = "auto") -> Any:
    """One choice's grammar controller, as a request with TOOLS gets it under PANTHEON_TOOL_GRAMMAR=1."""
    request = parse_chat_request({"messages": [{"role": "user", "content": "weather?"}], "tools": TOOLS,
                                  "tool_choice": tool_choice})
    env = dataclasses.replace(read_env(), tool_grammar=True)
    think_mode = "open" if opens_think else "optional" if think else "none"
    plan = structure.plan(served, request, env, DIALECTS[dialect], parse_tools(TOOLS), think_mode)
    return structure.grammar_controller(served, plan, think=think, opens_think=opens_think)


def feed(served: SimpleNamespace, c: Any, text: str) -> list[Any]:
    """Generate `text` token by token through `c`; the mask before each token (each token must be allowed)."""
    masks = []
    for t in served.tokenizer.encode(text, parse_special=False):
        mask = c.mask()
        assert mask is None or mask[t], (text, served.tokenizer.token_bytes(t))
        masks.append(mask)
        c.advance(t)
    return masks


def allowed(served: SimpleNamespace, c: Any, text: str) -> bool:
    """Whether the next token may start `text` (its first token)."""
    mask = c.mask()
    return mask is None or bool(mask[served.tokenizer.encode(text, parse_special=False)[0]])


CALL = "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n</function>\n</tool_call>"


def test_text_before_an_opener_is_not_masked(served: SimpleNamespace) -> None:
    c = controller(served)
    assert c.mask() is None
    # Prose with markup, a lone "<", and characters written a byte at a time: nothing is masked, and the turn
    # may end anywhere (the whole-turn grammar masked lone UTF-8 continuation bytes and shifted every logprob).
    assert feed(served, c, "Sure: a < b, <b>bold</b>, <function 中文 ```python\n") == [None] * len(
        served.tokenizer.encode("Sure: a < b, <b>bold</b>, <function 中文 ```python\n", parse_special=False))
    assert c.mask() is None and c.forced() is None
    assert c.stop_requested(served.tokenizer.eos_id) is True


def test_a_call_is_constrained_from_its_opener_and_free_after_it(served: SimpleNamespace) -> None:
    c = controller(served)
    assert feed(served, c, "Let me check.\n<tool_call>")[-1] is None  # the opener itself is drawn freely
    assert c.mask() is not None and not c.mask()[served.tokenizer.eos_id]
    assert not allowed(served, c, "x")
    feed(served, c, "\n<function=")
    assert allowed(served, c, "g") and not allowed(served, c, "x")  # an offered function only
    feed(served, c, "get_weather>\n<parameter=city>\nParis\n</parameter>\n<parameter=days>\n")
    assert allowed(served, c, "3") and not allowed(served, c, "x")  # typed: an integer
    feed(served, c, "3\n</parameter>\n</function>\n</tool_call>")
    # The call closed: free text again, the end token allowed and ending the turn.
    assert c.mask() is None
    assert feed(served, c, "\nDone, <b>x</b>.") == [None] * len(served.tokenizer.encode("\nDone, <b>x</b>."))
    assert c.stop_requested(served.tokenizer.eos_id) is True
    # The next opener (here the bare form) arms the grammar again.
    feed(served, c, "\n<function=")
    assert c.mask() is not None and not allowed(served, c, "x")


@pytest.mark.parametrize("opening", [CALL, CALL[len("<tool_call>\n"):]], ids=["tool_call", "bare_function"])
def test_an_end_token_inside_a_call_appends_its_closing_text(served: SimpleNamespace, opening: str) -> None:
    """The closing text is appended whole and the turn ends, also for a bare `<function=` call, whose grammar
    accepts partway through the closer (after `</function>`): the call was dropped there, with the rest of the
    closer, and the turn went on after the end token the model had drawn."""
    c = controller(served)
    feed(served, c, "Checking.\n" + opening[:opening.index("Paris") + 3])
    assert c.mask()[served.tokenizer.eos_id]  # a closing text completes the call from here
    assert c.stop_requested(served.tokenizer.eos_id) is False
    appended = []
    while (token := c.forced()) is not None:
        c.advance(token)
        appended.append(token)
    assert served.tokenizer.decode(appended) == "\n</parameter>\n</function>\n</tool_call>"
    assert c.is_finished()


@pytest.mark.parametrize(("think", "opens_think", "prefix"), [(True, True, ""), (True, False, "\n<think>")])
def test_the_think_block_is_never_constrained(served: SimpleNamespace, think: bool, opens_think: bool,
                                              prefix: str) -> None:
    """An opener inside the think block is reasoning, not a call (the parser reads calls in the answer only), and
    the turn may end there; after </think> an opener arms the grammar."""
    c = controller(served, think=think, opens_think=opens_think)
    text = prefix + "maybe <tool_call>\n<function=nope> garbage"
    assert feed(served, c, text) == [None] * len(served.tokenizer.encode(text, parse_special=False))
    assert c.stop_requested(served.tokenizer.eos_id) is True
    feed(served, c, "</think>\n\n<tool_call>")
    assert c.mask() is not None and not allowed(served, c, "x")


def test_a_think_tag_later_in_the_answer_is_text(served: SimpleNamespace) -> None:
    """Only the start of the output may open the think block (as the answer's splitter reads it): a <think> in the
    answer does not hide the call after it."""
    c = controller(served, think=True)
    feed(served, c, "Answer <think> <tool_call>")
    assert c.mask() is not None


def test_json_dialect_arms_at_its_fence(served: SimpleNamespace) -> None:
    c = controller(served, "json")
    assert feed(served, c, 'No call: {"name": "x"} {braces}\n') == [None] * len(
        served.tokenizer.encode('No call: {"name": "x"} {braces}\n', parse_special=False))
    feed(served, c, "```json\n")
    assert c.mask() is not None and not allowed(served, c, "x")
    feed(served, c, '{"name": "get_weather", "arguments": {"city": "Oslo"}}\n```')
    assert c.mask() is None


@pytest.mark.parametrize("tool_choice", ["required", {"type": "function", "function": {"name": "get_weather"}}])
def test_a_turn_that_must_call_is_constrained_from_its_first_token(served: SimpleNamespace, tool_choice: Any) -> None:
    c = controller(served, tool_choice=tool_choice)
    assert isinstance(c, GrammarController)
    assert c.mask() is not None and not c.mask()[served.tokenizer.eos_id] and not allowed(served, c, "x")


def test_minicpm_auto_stays_unconstrained(served: SimpleNamespace) -> None:
    assert controller(served, "minicpm_xml") is None


# --- end to end: the fixture served with and without the grammar ---


def _serve(tmp_path_factory: pytest.TempPathFactory, env: dict[str, str]) -> Iterator[ServerProcess]:
    log = tmp_path_factory.mktemp("lazy") / "serve.log"
    server = ServerProcess(["--model", f"{FIXTURE}:hybrid", "--threads", "1"], env=env, log_path=log).start()
    yield server
    server.stop()


@pytest.fixture(scope="module")
def free_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    yield from _serve(tmp_path_factory, {"PANTHEON_TOOL_GRAMMAR": ""})


@pytest.fixture(scope="module")
def lazy_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    yield from _serve(tmp_path_factory, {"PANTHEON_TOOL_GRAMMAR": "1"})


def chat(server: ServerProcess, tools: list[dict] = TOOLS, **body: Any) -> dict:
    r = httpx.post(server.base_url + "/v1/chat/completions", timeout=300, json={
        "messages": [{"role": "user", "content": "weather in Paris?"}], "tools": tools, "tool_choice": "auto",
        **body})
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]


@pytest.mark.slow
@pytest.mark.parametrize("body", [
    {"temperature": 0, "max_tokens": 8, "logprobs": True, "top_logprobs": 5, "enable_thinking": False},
    {"temperature": 0.8, "seed": 3, "max_tokens": 24, "enable_thinking": False, "logprobs": True},
    {"temperature": 0.8, "seed": 11, "max_tokens": 24, "logprobs": True},
    {"temperature": 0, "max_tokens": 8, "ignore_eos": True, "logit_bias": {IM_END: 20}},  # the end token banned
])
def test_an_auto_turn_decodes_as_without_the_grammar(free_server: ServerProcess, lazy_server: ServerProcess,
                                                     body: dict) -> None:
    """No opener in the answer: the same tokens, the same logprobs (no mask renormalised them), seeded too."""
    free, lazy = chat(free_server, **body), chat(lazy_server, **body)
    assert "<tool_call>" not in (free["message"].get("content") or "")
    assert lazy == free


@pytest.mark.slow
def test_an_end_token_ends_the_turn_inside_the_think_block(free_server: ServerProcess,
                                                           lazy_server: ServerProcess) -> None:
    """Thinking on, the end token favoured: the turn ends inside the open think block, as without the grammar
    (the whole-turn grammar required </think> first and ran the turn on to max_tokens)."""
    body = {"temperature": 0, "max_tokens": 16, "logit_bias": {IM_END: 20}}
    lazy = chat(lazy_server, **body)
    assert lazy["finish_reason"] == "stop", lazy
    assert lazy == chat(free_server, **body)


@pytest.mark.slow
def test_a_call_the_model_opens_is_typed(free_server: ServerProcess, lazy_server: ServerProcess) -> None:
    """The opener is favoured, then (less) the end token. The opener is drawn unconstrained: its logprobs are
    those it has without the grammar (the whole-turn grammar's mask renormalised them). Without the grammar no
    call comes of it; with it the end token is refused until the required argument is written, typed, and the
    serve appends the closing text."""
    tools = [{"type": "function", "function": {"name": "forecast", "parameters": {
        "type": "object", "properties": {"days": {"type": "integer"}}, "required": ["days"]}}}]
    # max_tokens leaves room for the appended closing text: 1 + 35 + a digit + 25 tokens in this vocabulary.
    body = {"temperature": 0, "max_tokens": 100, "enable_thinking": False, "logprobs": True, "top_logprobs": 3,
            "logit_bias": {TOOL_CALL: 6, IM_END: 3}}
    free, lazy = chat(free_server, tools, **body), chat(lazy_server, tools, **body)
    assert free["logprobs"]["content"][0]["token"] == "<tool_call>" and "tool_calls" not in free["message"], free
    assert lazy["logprobs"]["content"][0] == free["logprobs"]["content"][0]
    assert lazy["finish_reason"] == "tool_calls", lazy
    (call,) = lazy["message"]["tool_calls"]
    assert call["function"]["name"] == "forecast"
    assert isinstance(json.loads(call["function"]["arguments"])["days"], int)
