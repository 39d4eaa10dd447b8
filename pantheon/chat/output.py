"""Turn one choice's sampled tokens into text deltas: streaming detokenization, stop strings, think split.

Per token: detokenize (never a broken UTF-8 sequence) -> stop-string filter (holds back a tail that could
still become a stop string, so a stop split across tokens is caught and never leaks) -> think splitter
(routes text inside <think>...</think> to reasoning, holding back partial tags). Logprob entries ride the
next delta that carries text.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from typing import Any

from pantheon.chat.tools import CallEnd, CallError, CallStart, TextDelta, ToolCallParser
from pantheon.chat.tools.base import partial_suffix
from pantheon.engine.sampling import SampledToken
from pantheon.io.tokenizer import StreamingDecoder, Tokenizer

THINK_OPEN = "<think>"
THINK_CLOSE = "</think>"


@dataclass
class Delta:
    reasoning: str = ""
    content: str = ""
    logprobs: list[dict[str, Any]] = field(default_factory=list)
    # Streaming tool-call pieces of the calls parsed whole in this delta, in order: {"index", "id", "name"}
    # opens a call, {"index", "arguments"} carries its arguments text.
    tool_calls: list[dict[str, Any]] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.reasoning or self.content or self.logprobs or self.tool_calls)


class StopFilter:
    """Cuts the text at the first stop string, holding back a tail that could still become one. Positions
    count characters of the text pushed in: `consumed` taken, `released` given out, and once stopped `cut_at`,
    where the stop string began."""

    def __init__(self, stops: list[str]) -> None:
        self.stops = stops
        self._pending = ""
        self.stopped = False
        self.consumed = 0
        self.released = 0
        self.cut_at: int | None = None

    def _release(self, out: str) -> str:
        self.released += len(out)
        return out

    def push(self, text: str) -> str:
        if self.stopped:
            return ""
        self.consumed += len(text)
        self._pending += text
        if not self.stops:
            out, self._pending = self._pending, ""
            return self._release(out)
        cut = min((i for i in (self._pending.find(s) for s in self.stops) if i >= 0), default=-1)
        if cut >= 0:
            out = self._pending[:cut]
            self._pending = ""
            self.stopped = True
            self.cut_at = self.released + cut
            return self._release(out)
        hold = partial_suffix(self._pending, self.stops)
        out = self._pending[: len(self._pending) - hold]
        self._pending = self._pending[len(self._pending) - hold :]
        return self._release(out)

    def flush(self) -> str:
        out, self._pending = ("" if self.stopped else self._pending), ""
        return self._release(out)


class ThinkSplitter:
    """Routes text to reasoning or content. `in_think` starts True when the prompt already opened the block;
    otherwise a <think> at the very start of the output (after whitespace) opens it."""

    def __init__(self, enabled: bool, in_think: bool) -> None:
        self.enabled = enabled
        self.in_think = enabled and in_think
        self._at_start = enabled and not in_think
        self._after_close = False  # newlines right after </think> are template glue, not answer text
        self._pending = ""

    def push(self, text: str, delta: Delta) -> None:
        if not self.enabled:
            delta.content += text
            return
        self._pending += text
        while self._pending:
            if self._at_start:
                stripped = self._pending.lstrip()
                if stripped.startswith(THINK_OPEN):
                    self._pending = stripped[len(THINK_OPEN):]
                    self.in_think, self._at_start = True, False
                    continue
                if THINK_OPEN.startswith(stripped):
                    return  # could still become <think>
                self._at_start = False
            if self.in_think:
                i = self._pending.find(THINK_CLOSE)
                if i >= 0:
                    delta.reasoning += self._pending[:i]
                    self._pending = self._pending[i + len(THINK_CLOSE):]
                    self.in_think, self._after_close = False, True
                    continue
                hold = partial_suffix(self._pending, [THINK_CLOSE])
                delta.reasoning += self._pending[: len(self._pending) - hold]
                self._pending = self._pending[len(self._pending) - hold:]
                return
            if self._after_close:
                self._pending = self._pending.lstrip("\n")
                if not self._pending:
                    return
                self._after_close = False
            delta.content += self._pending
            self._pending = ""

    def flush(self, delta: Delta) -> None:
        if self._pending:
            if self.in_think:
                delta.reasoning += self._pending
            else:
                delta.content += self._pending
            self._pending = ""


class ChoiceOutput:
    """One choice's output. With tools offered, the answer text (not the reasoning) goes through the
    dialect's incremental call parser: prose stays content, calls become tool_calls."""

    def __init__(self, tokenizer: Tokenizer, *, stops: list[str], think: bool, prompt_opens_think: bool,
                 want_logprobs: bool, tool_parser: ToolCallParser | None = None, max_calls: int | None = None
                 ) -> None:
        self.tokenizer = tokenizer
        self._decoder = StreamingDecoder(tokenizer, skip_special=True)
        self._stop = StopFilter(stops)
        self._think = ThinkSplitter(think, prompt_opens_think)
        self._tools = tool_parser
        self._max_calls = max_calls  # `parallel_tool_calls: false` -> 1: calls past the first are dropped
        self._want_logprobs = want_logprobs
        # Logprob entries not sent yet, each with where its token's text ends in the stop filter's input: an
        # entry goes out once its whole text has passed the filter, and a token with any character of a matched
        # stop string never goes out, also one where the stop string begins inside it (llama-server trims the
        # stop string's tokens too), so streamed and whole answers carry the same entries.
        self._pending_logprobs: list[tuple[int, dict[str, Any]]] = []
        self.content = ""
        self.reasoning = ""
        self.logprobs: list[dict[str, Any]] = []
        self.completion_tokens = 0
        self.tool_calls: list[dict[str, Any]] = []  # finished calls, OpenAI shape
        self.tool_call_errors: list[dict[str, Any]] = []
        self._call_ids: dict[int, tuple[str, str]] = {}
        # The stream's pieces of finished calls, sent with the choice's last delta: the spec's stream sends a
        # choice's content before its tool calls, and a model may write prose after a call.
        self._held_calls: list[dict[str, Any]] = []

    @property
    def stopped(self) -> bool:
        return self._stop.stopped

    def _entry(self, token_id: int, logprob: float) -> dict[str, Any]:
        # A control token (<|im_start|> drawn through a logit bias) has no text in the content, so none here
        # either, as llama-server spells logprob tokens (special=false): the bytes add up to the content.
        raw = b"" if self.tokenizer.is_hidden(token_id) else self.tokenizer.token_bytes(token_id)
        return {"token": raw.decode("utf-8", errors="replace"), "logprob": logprob, "bytes": list(raw)}

    def _logprob_entry(self, sampled: SampledToken) -> dict[str, Any]:
        entry = self._entry(sampled.token_id, sampled.logprob if sampled.logprob is not None else 0.0)
        entry["top_logprobs"] = [self._entry(t, lp) for t, lp in (sampled.top_logprobs or [])]
        return entry

    def _route_tools(self, delta: Delta, final: bool) -> None:
        """Move delta.content through the call parser. A call goes out (its opening piece, then its arguments)
        with the choice's last delta, after all of its content, as the spec's stream orders them: a call that is
        cut short or rejected is never streamed, so the stream's calls are exactly the non-streamed response's
        `tool_calls`, with the same indexes, and its content the same text (prose after a call included)."""
        if self._tools is None:
            return
        events = self._tools.feed(delta.content) if delta.content else []
        if final:
            events += self._tools.finish()
        delta.content = ""
        for event in events:
            if isinstance(event, TextDelta):
                delta.content += event.text
            elif isinstance(event, CallStart):
                self._call_ids[event.index] = (event.id, event.name)
            elif isinstance(event, CallEnd):
                if self._max_calls is not None and len(self.tool_calls) >= self._max_calls:
                    continue
                call_id, name = self._call_ids[event.index]
                index = len(self.tool_calls)
                self._held_calls.append({"index": index, "id": call_id, "name": name})
                self._held_calls.append({"index": index, "arguments": event.arguments})
                self.tool_calls.append({"id": call_id, "type": "function",
                                        "function": {"name": name, "arguments": event.arguments}})
            elif isinstance(event, CallError):
                error = {"code": event.code, "message": event.message}
                if event.function is not None:
                    error["function"] = event.function
                if event.parameter is not None:
                    error["parameter"] = event.parameter
                self.tool_call_errors.append(error)
        if final:
            delta.tool_calls += self._held_calls
            self._held_calls = []

    def _emit(self, delta: Delta, final: bool = False) -> Delta:
        self.content += delta.content
        self.reasoning += delta.reasoning
        cut_at = self._stop.cut_at
        if cut_at is not None:  # the stop string's tokens: never sent, not in the choice's logprobs
            self._pending_logprobs = [(end, e) for end, e in self._pending_logprobs if end <= cut_at]
        if final or delta.content or delta.reasoning or delta.tool_calls:
            released = self._stop.released
            ready = [e for _, e in itertools.takewhile(lambda p: final or p[0] <= released, self._pending_logprobs)]
            if ready:
                delta.logprobs = ready
                self.logprobs += ready
                self._pending_logprobs = self._pending_logprobs[len(ready):]
        return delta

    def push(self, sampled: SampledToken) -> Delta:
        if self.stopped:
            return Delta()
        self.completion_tokens += 1
        delta = Delta()
        self._think.push(self._stop.push(self._decoder.push(sampled.token_id)), delta)
        if self._want_logprobs:
            self._pending_logprobs.append((self._stop.consumed, self._logprob_entry(sampled)))
        self._route_tools(delta, final=False)
        return self._emit(delta)

    def end_token(self) -> None:
        """The choice ended on an end-of-generation token: a completion token, as llama-server and vLLM count it
        (nothing after a stop string counts). It has no text, so no logprobs entry: the entries' tokens add up
        to the content, and a greedy entry's first alternative is its own token."""
        if not self.stopped:
            self.completion_tokens += 1

    def finish(self) -> Delta:
        delta = Delta()
        if not self.stopped:
            self._think.push(self._stop.push(self._decoder.flush()), delta)
            self._think.push(self._stop.flush(), delta)
        self._think.flush(delta)
        self._route_tools(delta, final=True)
        return self._emit(delta, final=True)
