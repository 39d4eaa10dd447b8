"""Messages -> prompt text (the model's chat template) -> token ids."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from pantheon.chat.request import ChatRequest, Message
from pantheon.engine.loader import LoadedModel

CLOSED_THINK = "<think>\n\n</think>\n\n"


@dataclass(frozen=True)
class Prompt:
    text: str
    tokens: list[int]
    think: bool  # output may carry a <think> block to split into reasoning_content
    opens_think: bool  # the prompt itself ends inside an open <think> block
    thinking: bool = False  # thinking is on for this request (think-style template, not prefilled closed)


def _template_message(message: Message) -> dict[str, Any]:
    out: dict[str, Any] = {"role": message.role, "content": message.content}
    if message.role == "assistant":
        if message.reasoning_content:
            out["reasoning_content"] = message.reasoning_content
        if message.tool_calls:
            out["tool_calls"] = message.tool_calls
    if message.tool_call_id:
        out["tool_call_id"] = message.tool_call_id
    if message.name:
        out["name"] = message.name
    return out


def _ends_in_open_think(text: str) -> bool:
    return text.rfind("<think>") > text.rfind("</think>")


def build_prompt(served: LoadedModel, request: ChatRequest, *, no_think_default: bool) -> Prompt:
    template = served.template
    messages = [_template_message(m) for m in request.messages]
    extra: dict[str, Any] = {}
    thinking = False
    if template.is_think_style:
        thinking = request.enable_thinking if request.enable_thinking is not None else not no_think_default
        extra["enable_thinking"] = thinking
    text = template.render(messages, add_generation_prompt=True, extra=extra)
    if template.is_think_style and not thinking and not text.rstrip().endswith("</think>"):
        text += CLOSED_THINK  # templates that ignore enable_thinking still get a closed block
    tokenizer = served.tokenizer
    tokens = tokenizer.encode(text, parse_special=True)
    if tokenizer.add_bos and tokenizer.bos_id is not None and (not tokens or tokens[0] != tokenizer.bos_id):
        tokens.insert(0, tokenizer.bos_id)
    return Prompt(text=text, tokens=tokens, think=template.is_think_style,
                  opens_think=template.is_think_style and _ends_in_open_think(text), thinking=thinking)
