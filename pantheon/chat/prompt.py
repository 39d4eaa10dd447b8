"""Messages -> prompt text (the model's chat template, tools in the model's dialect) -> token ids."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from pantheon.chat.request import ChatRequest, Message
from pantheon.chat.tools import Dialect, ToolSpec
from pantheon.engine.loader import LoadedModel
from pantheon.errors import ApiError, invalid_request

CLOSED_THINK = "<think>\n\n</think>\n\n"


@dataclass(frozen=True)
class Prompt:
    text: str
    tokens: list[int]
    think: bool  # output may carry a <think> block to split into reasoning_content
    opens_think: bool  # the prompt itself ends inside an open <think> block
    thinking: bool = False  # thinking is on for this request (think-style template, not prefilled closed)
    # Where the conversation history ends and this turn's generation prompt begins. The next turn's prompt
    # re-renders this turn's reply (without its reasoning, in think templates), so it repeats the prompt
    # exactly up to here: the session table recognises a continuation by it, and a recurrent model keeps a
    # state checkpoint here.
    history_end: int | None = None

    @property
    def think_mode(self) -> str:
        """How a grammar sees the start of the output: "open", "optional" or "none"."""
        if self.opens_think:
            return "open"
        return "optional" if self.thinking else "none"


def _template_messages(messages: list[Message], dialect: Dialect, tools: list[ToolSpec]) -> list[dict[str, Any]]:
    """Tools into a system turn, earlier calls and tool results into plain text in the dialect, so every
    template renders them the same way (and a replayed turn matches what the model generated)."""
    out: list[dict[str, Any]] = []
    for m in messages:
        if m.role == "assistant":
            entry: dict[str, Any] = {"role": "assistant", "content": m.content}
            if m.tool_calls:
                entry["content"] = dialect.render_assistant(m.content, m.tool_calls)
            if m.reasoning_content:
                entry["reasoning_content"] = m.reasoning_content
            out.append(entry)
        elif m.role == "tool":
            role, content = dialect.render_tool_result(m.content, m.tool_call_id, m.name)
            if out and out[-1].get("_tool_results") and out[-1]["role"] == role:
                out[-1]["content"] += "\n" + content  # consecutive results read as one turn
            else:
                out.append({"role": role, "content": content, "_tool_results": True})
        else:
            out.append({"role": m.role, "content": m.content})
    for entry in out:
        entry.pop("_tool_results", None)
    if tools:
        if out and out[0]["role"] == "system":
            out[0]["content"] = dialect.render_system(tools, out[0]["content"])
        else:
            out.insert(0, {"role": "system", "content": dialect.render_system(tools, None)})
    return out


def _thinking(request: ChatRequest, no_think_default: bool, continued: Message | None, prefill: str) -> bool:
    """Whether a think-style template's prompt leaves the reply room to think: the request's enable_thinking,
    else the serve's default. A continued assistant message decides by itself: with answer text it is continued
    as an answer, after its reasoning's closed block; with reasoning and no answer yet, inside the open block
    (llama-server refuses both with thinking on)."""
    if continued is not None and (prefill or continued.reasoning_content):
        return not prefill
    return request.enable_thinking if request.enable_thinking is not None else not no_think_default


def _think_block(text: str, thinking: bool, reasoning: str | None) -> str:
    """A think-style prompt's end before the answer. With thinking off, a closed block (templates that ignore
    enable_thinking still get one), holding `reasoning` when a continued assistant message carries it; with
    thinking on and `reasoning` (a continued message with no answer yet), the open block with it."""
    if thinking:
        if reasoning:
            text += ("" if _ends_in_open_think(text) else "<think>\n") + reasoning
        return text
    if _ends_in_open_think(text):
        # A generation prompt that opens the block whatever enable_thinking says (QwQ, the R1 distills): closed
        # where it stands, as llama-server closes it.
        return text + (f"{reasoning}\n</think>\n\n" if reasoning else "</think>")
    if reasoning and text.endswith(CLOSED_THINK):
        return text[: -len(CLOSED_THINK)] + f"<think>\n{reasoning}\n</think>\n\n"
    if text.rstrip().endswith("</think>"):
        return text
    return text + (f"<think>\n{reasoning}\n</think>\n\n" if reasoning else CLOSED_THINK)


def _ends_in_open_think(text: str) -> bool:
    return text.rfind("<think>") > text.rfind("</think>")


# A rendered prompt of up to EXACT_COUNT_MIN_CHARS characters, or EXACT_COUNT_CHARS_PER_TOKEN a token of a
# larger window, is encoded even when it cannot fit, so that context_over_budget's kv_used is its exact count
# (what a client trims by); a longer one is refused from its length alone (`PromptOverWindow`, a lower bound, by
# far: its longest token's length): on the 2-core Zen 4 VM (2026-12-07) encoding 256 KiB of text took 140-320
# ms of a core, 64 KiB ~35-80.
EXACT_COUNT_MIN_CHARS = 1 << 16
EXACT_COUNT_CHARS_PER_TOKEN = 8


class PromptOverWindow(Exception):
    """The rendered prompt cannot fit the window: it has at least `n_tokens` tokens (found without encoding it,
    so that a huge request costs no tokenizer time)."""

    def __init__(self, n_tokens: int) -> None:
        super().__init__(n_tokens)
        self.n_tokens = n_tokens


def build_prompt(served: LoadedModel, request: ChatRequest, *, no_think_default: bool, dialect: Dialect,
                 tools: list[ToolSpec], window: int | None = None) -> Prompt:
    """The prompt's text and tokens. With `window`, raises PromptOverWindow before encoding a text past the
    exact-count length (above) whose length alone shows that it has `window` tokens or more."""
    template = served.template
    messages = _template_messages(request.messages, dialect, tools)
    prefill = ""
    last = request.messages[-1]
    continued = last if last.role == "assistant" and not last.tool_calls else None
    if last.role == "assistant" and len(request.messages) > 1 and request.messages[-2].role == "assistant":
        # Which of them would the reply continue (or follow, a call's)? llama-server refuses the same way.
        raise invalid_request("Cannot have 2 or more assistant messages at the end of the list.")
    if continued is not None:
        # A trailing assistant message is the start of the reply, continued (llama-server's default): the
        # conversation before it gets the generation prompt, then its text; the reply returned is what follows.
        prefill = messages.pop()["content"]
        if last.unjoined_text is not None:
            prefill = last.unjoined_text  # its parts as llama-server appends them: with nothing between
    thinking = template.is_think_style and _thinking(request, no_think_default, continued, prefill)
    extra: dict[str, Any] = dict(request.template_kwargs)
    if template.is_think_style:
        extra["enable_thinking"] = thinking
    try:
        text = template.render(messages, add_generation_prompt=True, extra=extra)
    except ApiError:
        if messages or not prefill:
            raise
        # A lone assistant message, and a template that cannot render an empty conversation: it is then an
        # ordinary turn of its own.
        messages.append(_template_messages(request.messages, dialect, tools)[-1])
        prefill, continued = "", None
        if template.is_think_style:  # no longer continued: the request's own setting
            thinking = extra["enable_thinking"] = _thinking(request, no_think_default, None, "")
        text = template.render(messages, add_generation_prompt=True, extra=extra)
    if template.is_think_style:
        text = _think_block(text, thinking, continued.reasoning_content if continued is not None else None)
    text += prefill
    tokenizer = served.tokenizer
    if (window is not None and len(text) > max(EXACT_COUNT_MIN_CHARS, EXACT_COUNT_CHARS_PER_TOKEN * window)
            and (at_least := tokenizer.min_tokens(text)) >= window):
        raise PromptOverWindow(at_least)
    tokens = tokenizer.encode(text, parse_special=True)
    offset = 0
    if tokenizer.add_bos and tokenizer.bos_id is not None and (not tokens or tokens[0] != tokenizer.bos_id):
        tokens.insert(0, tokenizer.bos_id)
        offset = 1
    history_end = None
    if len(messages) > 0:
        history = template.render(messages, add_generation_prompt=False, extra=extra)
        history_tokens = tokenizer.encode(history, parse_special=True)
        n = offset + len(history_tokens)
        if text.startswith(history) and 0 < n < len(tokens) and tokens[offset:n] == history_tokens:
            history_end = n
    return Prompt(text=text, tokens=tokens, think=template.is_think_style,
                  opens_think=template.is_think_style and _ends_in_open_think(text), thinking=thinking,
                  history_end=history_end)
