"""Chat templates: what the renderer gives the templates that llama-server's renderer gives them (probed
capabilities, the variables they read), and how a prompt ends around a think block. Small templates written here
stand for the real families (noted beside each)."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest

from pantheon.chat.prompt import build_prompt
from pantheon.chat.request import parse_chat_request
from pantheon.chat.tools import DIALECTS
from pantheon.config import read_env
from pantheon.errors import ApiError
from pantheon.io.chat_template import ChatTemplate
from pantheon.io.gguf_file import open_gguf
from pantheon.io.tokenizer import Tokenizer

TURNS = "{% for m in messages %}<|{{ m.role }}|>{{ m.content }}\n{% endfor %}"
# Gemma-2-like: no system role at all.
NO_SYSTEM = ("{% for m in messages %}{% if m.role == 'system' %}{{ raise_exception('System role not supported') }}"
             "{% endif %}<|{{ m.role }}|>{{ m.content }}\n{% endfor %}")
# SmolVLM / Idefics3-like: content read as a list of typed parts only (a string's characters render nothing).
TYPED_ONLY = ("{% for m in messages %}<|{{ m.role }}|>{% for part in m.content %}{% if part.type == 'text' %}"
              "{{ part.text }}{% endif %}{% endfor %}\n{% endfor %}")
# QwQ / DeepSeek-R1-distill-like: the generation prompt opens <think> whatever enable_thinking says.
OPENS_THINK = TURNS + "{% if add_generation_prompt %}<|assistant|><think>\n{% endif %}"
# DeepSeek-V3.1-like: reads `thinking`, not `enable_thinking`.
READS_THINKING = (TURNS + "{% if add_generation_prompt %}<|assistant|>"
                  "{% if thinking %}<think>{% else %}</think>{% endif %}{% endif %}")


def test_a_template_without_a_system_role_gets_the_system_text_in_the_next_user_message() -> None:
    t = ChatTemplate(NO_SYSTEM)
    assert not t.supports_system_role and ChatTemplate(TURNS).supports_system_role
    messages = [{"role": "system", "content": "Be terse."}, {"role": "user", "content": "Hi"},
                {"role": "assistant", "content": "Hello"}, {"role": "system", "content": "Now French."},
                {"role": "user", "content": "Bye"}]
    assert t.render(messages, add_generation_prompt=False) == (
        "<|user|>Be terse.\nHi\n<|assistant|>Hello\n<|user|>Now French.\nBye\n")
    # Before another role, or at the end, the system text is a user message of its own.
    assert t.render([{"role": "system", "content": "S"}, {"role": "assistant", "content": "A"}],
                    add_generation_prompt=False) == "<|user|>S\n<|assistant|>A\n"


def test_a_template_that_renders_only_typed_parts_gets_them() -> None:
    t = ChatTemplate(TYPED_ONLY)
    assert t.requires_typed_content and not ChatTemplate(TURNS).requires_typed_content
    assert t.supports_system_role  # probed with typed parts too
    # (trim_blocks takes the line break after the inner endfor, as in HF's environment)
    assert t.render([{"role": "user", "content": "Hello there"}], add_generation_prompt=False) == "<|user|>Hello there"


def test_variables_llama_server_supplies() -> None:
    """HF's {% generation %} tag renders its body; date_string (Llama 3.x), datetime and functions (FireFunction)
    are defined; `thinking` follows enable_thinking."""
    t = ChatTemplate("{% generation %}[{{ functions }}]{% endgeneration %}{{ date_string }}|{{ datetime }}")
    out = t.render([], add_generation_prompt=False)
    assert out.startswith("[]") and len(out.split("|")) == 2 and all(out.split("|"))
    with pytest.raises(ApiError):
        ChatTemplate(NO_SYSTEM)._render([{"role": "system", "content": "x"}], add_generation_prompt=False)
    reads = ChatTemplate(READS_THINKING)
    assert reads.render([{"role": "user", "content": "a"}], extra={"enable_thinking": True}).endswith("<think>")
    assert reads.render([{"role": "user", "content": "a"}], extra={"enable_thinking": False}).endswith("</think>")


@pytest.fixture(scope="module")
def tokenizer(default_model_path: Path) -> Tokenizer:
    return Tokenizer.from_gguf_metadata(open_gguf(default_model_path, read_env().cache_dir).metadata)


def prompt_text(tokenizer: Tokenizer, source: str, body: dict) -> str:
    served = SimpleNamespace(template=ChatTemplate(source), tokenizer=tokenizer)
    request = parse_chat_request({"messages": [{"role": "user", "content": "Hi"}], **body})
    return build_prompt(served, request, no_think_default=False, dialect=DIALECTS["qwen_xml"], tools=[]).text


def test_a_block_the_generation_prompt_opens_is_closed_where_it_stands(tokenizer: Tokenizer) -> None:
    """enable_thinking false on a template that always opens <think>: the open block is closed, as
    llama-server closes it ("<think>\\n</think>"), not followed by a second, closed one."""
    assert prompt_text(tokenizer, OPENS_THINK, {"enable_thinking": False}).endswith("<|assistant|><think>\n</think>")
    assert prompt_text(tokenizer, OPENS_THINK, {"enable_thinking": True}).endswith("<|assistant|><think>\n")
    # A template that neither opens nor closes one gets a closed block prefilled (the spec's enable_thinking).
    plain_think = TURNS + "{% if add_generation_prompt %}<|assistant|>{% endif %}{# <think> #}"
    assert prompt_text(tokenizer, plain_think, {"enable_thinking": False}).endswith(
        "<|assistant|><think>\n\n</think>\n\n")


def test_whatever_a_template_raises_is_the_requests_400() -> None:
    """A template's own runtime error (here a division by zero) is a 400 naming it, never a 500; at load the
    probes take it as "not supported"."""
    t = ChatTemplate("{% for m in messages %}{{ m.content }}{{ 1 // (m.role != 'user') }}{% endfor %}")
    with pytest.raises(ApiError) as info:
        t.render([{"role": "user", "content": "x"}])
    assert info.value.status == 400 and "ZeroDivisionError" in info.value.message
    assert not t.supports_system_role


def test_chat_template_kwargs_reach_the_template(tokenizer: Tokenizer) -> None:
    """`chat_template_kwargs` as llama-server and vLLM take it: its variables reach the template (not the ones the
    server sets itself), and its enable_thinking turns thinking off or on where the top-level field is absent."""
    reads_variable = TURNS + "{% if add_generation_prompt %}<|assistant|>{{ persona | default('none') }}{% endif %}"
    assert prompt_text(tokenizer, reads_variable, {"chat_template_kwargs": {"persona": "pirate"}}).endswith(
        "<|assistant|>pirate")
    kept = prompt_text(tokenizer, reads_variable, {"chat_template_kwargs": {"messages": [], "bos_token": "X"}})
    assert kept.startswith("<|user|>Hi\n") and kept.endswith("<|assistant|>none")
    off = {"chat_template_kwargs": {"enable_thinking": False}}
    assert prompt_text(tokenizer, OPENS_THINK, off).endswith("<|assistant|><think>\n</think>")
    assert prompt_text(tokenizer, READS_THINKING, off).endswith("<|assistant|></think>")
    # The top-level field wins.
    assert prompt_text(tokenizer, OPENS_THINK, {**off, "enable_thinking": True}).endswith("<|assistant|><think>\n")
    for bad in ({"chat_template_kwargs": []}, {"chat_template_kwargs": "x"},
                {"chat_template_kwargs": {"enable_thinking": "false"}},
                {"enable_thinking": True, "chat_template_kwargs": {"enable_thinking": 0}}):
        with pytest.raises(ApiError) as info:
            parse_chat_request({"messages": [{"role": "user", "content": "Hi"}], **bad})
        assert info.value.status == 400, bad


def test_two_assistant_messages_at_the_end_are_refused(tokenizer: Tokenizer) -> None:
    """The trailing one would be continued, after an assistant turn closed before it: llama-server answers 400,
    and so does this server, rather than continue text written after the model's own end of turn. One trailing
    assistant message, or one after a call's result, is continued."""
    hi, said = {"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello."}
    template = TURNS + "{% if add_generation_prompt %}<|assistant|>{% endif %}"
    with pytest.raises(ApiError) as info:
        prompt_text(tokenizer, template, {"messages": [hi, said, {"role": "assistant", "content": "Also"}]})
    assert info.value.status == 400 and "2 or more assistant messages" in info.value.message
    call = {"role": "assistant", "content": None,
            "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}]}
    with pytest.raises(ApiError) as info:  # the last one a call's (not continued, but still after a closed turn)
        prompt_text(tokenizer, template, {"messages": [hi, said, call]})
    assert info.value.status == 400 and "2 or more assistant messages" in info.value.message
    assert prompt_text(tokenizer, template, {"messages": [hi, said]}).endswith("<|user|>Hi\n<|assistant|>Hello.")
    result = {"role": "tool", "tool_call_id": "c1", "content": "42"}
    assert prompt_text(tokenizer, template, {"messages": [hi, call, result, said]}).endswith(
        "</tool_response>\n<|assistant|>Hello.")
