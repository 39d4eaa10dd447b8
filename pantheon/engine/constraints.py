"""Token controllers: what steers one sequence's decode beyond sampling.

- `GrammarController`: an llguidance matcher gives the allowed tokens at every step (tool calls, JSON).
  When the model ends its turn inside a constrained call at a point where the call can still be closed,
  the controller appends the closing text (forced tokens) instead of leaving the call broken.
- `LazyGrammarController`: no mask until a call opener appears in the answer (outside the think block); then a
  `GrammarController` holds the call, from the opener's text on, until the call closes.
- `ReasoningBudget`: after N tokens inside a <think> block, forces the tokens of "</think>".
- `Controllers`: several of them on one sequence (forced tokens first, masks intersected).

The scheduler drives them through the TokenController protocol (pantheon/sched/jobs.py) from its worker
thread; masks are boolean arrays over the model's vocabulary.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np


class _GrammarVocabulary:
    """The vocabulary as llguidance's `TokenizerWrapper` reads it: every token's bytes, control tokens (the
    ones decode hides) marked special with llguidance's 0xFF prefix, and a tokenize function.

    Built from the GGUF's own token types rather than from the `tokenizers` JSON export: llguidance treats
    every added token that looks like "<...>" as special even when the export marks it `special: false`, so
    Qwen's user-defined "<tool_call>" and "</think>" tokens could never match the markers the grammars write as
    text (a "required" call ended with no call, and a think block could not close)."""

    def __init__(self, tokenizer: Any) -> None:
        self.eos_token_id = tokenizer.eos_id
        self.bos_token_id = tokenizer.bos_id
        n = tokenizer.vocab_size
        self.special_token_ids = [i for i in range(n) if tokenizer.is_hidden(i)]
        hidden = set(self.special_token_ids)
        self.tokens = [b"\xff" + tokenizer.token_bytes(i) if i in hidden else tokenizer.token_bytes(i)
                       for i in range(n)]
        self._tokenizer = tokenizer

    def __call__(self, text: str | bytes) -> list[int]:
        if isinstance(text, bytes):
            text = text.decode("utf-8", errors="replace")
        return self._tokenizer.encode(text, parse_special=False)


def grammar_tokenizer(tokenizer: Any) -> Any:
    """llguidance's `LLTokenizer` for a `pantheon.io.tokenizer.Tokenizer` (raises ImportError without
    llguidance)."""
    import llguidance

    return llguidance.LLTokenizer(llguidance.TokenizerWrapper(_GrammarVocabulary(tokenizer)),
                                  eos_token=tokenizer.eos_id)


def unpack_bitmask(bitmask: bytes, vocab_size: int) -> np.ndarray:
    return np.unpackbits(np.frombuffer(bitmask, dtype=np.uint8), bitorder="little")[:vocab_size].astype(bool)


class GrammarController:
    def __init__(self, matcher: Any, *, vocab_size: int, eos_id: int, closers: Sequence[list[int]] = (),
                 last_resort_closers: Sequence[list[int]] = ()) -> None:
        self.matcher = matcher
        self.vocab_size = vocab_size
        self.eos_id = eos_id
        # Checked at every step (may the model end here?): the dialect's own closing texts.
        self.closers = [list(c) for c in closers if c]
        # Also tried when the model ends its turn: closers that first finish an open JSON string/array/object
        # value.
        self.last_resort_closers = [list(c) for c in last_resort_closers if c]
        self._forcing: list[int] = []
        self._done = False
        self.appended_closer = False

    def _closer_here(self, *, last_resort: bool = False) -> list[int] | None:
        """A closing text that would complete the grammar from here, if any."""
        for closer in self.closers + (self.last_resort_closers if last_resort else []):
            if self.matcher.validate_tokens(closer) == len(closer):
                trial = self.matcher.deep_copy()
                if trial.consume_tokens(closer) and trial.is_accepting():
                    return closer
        return None

    def forced(self) -> int | None:
        return self._forcing[0] if self._forcing else None

    def mask(self) -> np.ndarray | None:
        if self.matcher.is_stopped() or self.matcher.is_error():
            return None
        allowed = unpack_bitmask(self.matcher.compute_bitmask(), self.vocab_size)
        if not allowed[self.eos_id] and self._closer_here() is not None:
            allowed[self.eos_id] = True  # ending here is fine: the serve appends the closing text
        return allowed

    def advance(self, token: int) -> None:
        if self._forcing and token == self._forcing[0]:
            self._forcing.pop(0)
            if not self._forcing:
                self._done = True  # the closing text after an end token: the turn is over
        if not self.matcher.is_stopped():
            self.matcher.consume_token(token)

    def stop_requested(self, token: int) -> bool:
        """The model sampled an end token: True to end now; False when closing text is appended first."""
        if self._forcing:
            return False
        if self.matcher.is_accepting() or self.matcher.is_error():
            self._done = True
            return True
        closer = self._closer_here(last_resort=True)
        if closer is None:
            self._done = True
            return True
        self._forcing = list(closer)
        self.appended_closer = True
        return False

    def is_finished(self) -> bool:
        return self._done or self.matcher.is_stopped()

    @property
    def completed(self) -> bool:
        """The output satisfies the grammar (for response_format_status). A matcher stopped by an error (a token
        the grammar refused, e.g. one forced by a reasoning budget) did not."""
        return not self.matcher.is_error() and (self.matcher.is_accepting() or self.matcher.is_stopped())


class LazyGrammarController:
    """A grammar armed by a trigger, as llama.cpp's lazy grammars with trigger patterns: the turn decodes as it
    would unconstrained (no mask, the end token anywhere) until one of `openers` appears in the answer's text;
    `arm()` then gives a fresh `GrammarController` (a matcher of a grammar whose free text may open calls), which
    is fed the text from the opener on and holds the call; once its matcher accepts (the call closed) it is
    dropped, and the text after the call's last `call_ends` marker is watched again.

    The think block is never constrained: with `think`, the output's block (already open with `opens_think`,
    else opened by a "<think>" at its start, after whitespace, as the answer's splitter reads it) is skipped up
    to "</think>". An opener followed, in the token that completes it, by text the grammar refuses is left as
    text: masks only apply to tokens after it."""

    _THINK_OPEN, _THINK_CLOSE = b"<think>", b"</think>"

    def __init__(self, arm: Callable[[], GrammarController], tokenize: Callable[[bytes], list[int]],
                 token_bytes: Callable[[int], bytes], *, openers: Sequence[str], call_ends: Sequence[str],
                 think: bool, opens_think: bool) -> None:
        self._arm = arm
        self._tokenize = tokenize  # bytes -> token ids (any split: the matcher reads bytes)
        self._token_bytes = token_bytes
        self._openers = [o.encode() for o in openers]
        self._ends = [e.encode() for e in call_ends]
        self._phase = ("inside" if opens_think else "start") if think else "answer"
        self._text = b""  # answer text not searched through yet (a partial opener or think tag waits here)
        self.call: GrammarController | None = None  # the armed grammar, while a call is open
        self._call_text = b""  # the text fed to `call`, from its opener on

    def forced(self) -> int | None:
        return self.call.forced() if self.call is not None else None

    def mask(self) -> np.ndarray | None:
        return self.call.mask() if self.call is not None else None

    def advance(self, token: int) -> None:
        data = self._token_bytes(token)
        if self.call is None:
            self._watch(data)
            return
        self.call.advance(token)
        self._call_text += data
        if self.call.is_finished() or self.call.forced() is not None:
            # Its closing text is (being) appended after an end token: the turn ends once it is, even where the
            # grammar accepts partway through it (a bare `<function=` call, after `</function>`).
            return
        if self.call.matcher.is_error():
            # A token it refused (forced past the mask): the call is the parser's to judge, the text free again.
            self.call, self._call_text = None, b""
        elif self.call.matcher.is_accepting():
            self._close_call()

    def stop_requested(self, token: int) -> bool:
        return self.call.stop_requested(token) if self.call is not None else True

    def is_finished(self) -> bool:
        return self.call is not None and self.call.is_finished()

    def _close_call(self) -> None:
        """The call closed: free text again, from the end of its last closing marker (the token that closed it
        may carry text after it, an opener even)."""
        text = self._call_text
        after = max((text.rfind(end) + len(end) for end in self._ends if end in text), default=len(text))
        self.call, self._call_text = None, b""
        self._watch(text[after:])

    def _watch(self, data: bytes) -> None:
        self._text += data
        while self._text:
            if self._phase == "start":
                stripped = self._text.lstrip()
                if stripped.startswith(self._THINK_OPEN):
                    self._phase, self._text = "inside", stripped[len(self._THINK_OPEN):]
                    continue
                if self._THINK_OPEN.startswith(stripped):
                    return  # may still become "<think>"
                self._phase = "answer"
            if self._phase == "inside":
                i = self._text.find(self._THINK_CLOSE)
                if i < 0:
                    self._text = self._text[-(len(self._THINK_CLOSE) - 1):]  # may be the start of "</think>"
                    return
                self._phase, self._text = "answer", self._text[i + len(self._THINK_CLOSE):]
                continue
            hits = [(i, o) for o in self._openers if (i := self._text.find(o)) >= 0]
            if not hits:
                keep = max(len(o) for o in self._openers) - 1  # the start of an opener the next token may finish
                self._text = self._text[-keep:] if keep else b""
                return
            rest, self._text = self._text[min(hits)[0]:], b""
            if self._start_call(rest):
                return
            self._text = rest[1:]  # not a call the grammar takes: text, and the search goes on

    def _start_call(self, text: bytes) -> bool:
        """Arm the grammar with `text` (an opener and what followed it); False when the grammar refuses it."""
        call = self._arm()
        ids = self._tokenize(text)
        if call.matcher.validate_tokens(ids) < len(ids) or not call.matcher.consume_tokens(ids):
            return False
        self.call, self._call_text = call, text
        if call.matcher.is_accepting():
            self._close_call()  # the whole call came in this token
        return True


def ends_inside_a_character(data: bytes) -> bool:
    """Whether `data` ends partway through a UTF-8 character: its last lead byte announces more continuation
    bytes than follow it."""
    for back in range(1, min(4, len(data)) + 1):
        byte = data[-back]
        if byte & 0xC0 != 0x80:  # not a continuation byte: the last character's first one
            length = 4 if byte >= 0xF0 else 3 if byte >= 0xE0 else 2 if byte >= 0xC0 else 1
            return back < length
    return False


class ReasoningBudget:
    """Counts generated tokens inside a <think> block and forces `close_tokens` once `budget` is spent: at the
    next character boundary, so that a multi-byte character whose first bytes the last token wrote is
    completed first (a closing text after its lead byte is no UTF-8: the grammars refuse it, and the turn ended
    with neither the block closed nor the call its grammar compels), yet never more than
    `MAX_CHARACTER_TOKENS` tokens late."""

    MAX_CHARACTER_TOKENS = 3  # a UTF-8 character has at most 3 bytes after its first

    def __init__(self, budget: int, close_tokens: list[int], token_bytes: Any, *, starts_inside: bool) -> None:
        self.budget = budget
        self.close_tokens = close_tokens
        self.token_bytes = token_bytes  # token id -> bytes
        self.inside = starts_inside
        self.may_open = not starts_inside
        self.spent = 0
        self._text = ""  # recent generated text, to spot the tags across token boundaries
        self._tail = b""  # the last bytes generated, to tell whether they end inside a character
        self._forcing: list[int] = []

    def forced(self) -> int | None:
        return self._forcing[0] if self._forcing else None

    def mask(self) -> np.ndarray | None:
        return None

    def advance(self, token: int) -> None:
        if self._forcing and token == self._forcing[0]:
            self._forcing.pop(0)
            if not self._forcing:
                self.inside = False
            return
        piece = self.token_bytes(token)
        self._tail = (self._tail + piece)[-4:]
        self._text = (self._text + piece.decode("utf-8", errors="replace"))[-32:]
        if self.may_open:
            if "<think>" in self._text:
                self.inside, self.may_open = True, False
                self._text = self._text.split("<think>", 1)[1]
            elif self._text.strip() and not "<think>".startswith(self._text.strip()[:7]):
                self.may_open = False  # the answer started without a think block
            return
        if not self.inside:
            return
        if "</think>" in self._text:
            self.inside = False
            return
        self.spent += 1
        if self.spent >= self.budget and (not ends_inside_a_character(self._tail)
                                          or self.spent >= self.budget + self.MAX_CHARACTER_TOKENS):
            self._forcing = list(self.close_tokens)

    def stop_requested(self, token: int) -> bool:
        return True

    def is_finished(self) -> bool:
        return False


class Controllers:
    def __init__(self, parts: Sequence[Any]) -> None:
        self.parts = list(parts)

    def forced(self) -> int | None:
        for part in self.parts:
            token = part.forced()
            if token is not None:
                return token
        return None

    def mask(self) -> np.ndarray | None:
        combined = None
        for part in self.parts:
            m = part.mask()
            if m is not None:
                combined = m if combined is None else combined & m
        return combined

    def advance(self, token: int) -> None:
        for part in self.parts:
            part.advance(token)

    def stop_requested(self, token: int) -> bool:
        return all([part.stop_requested(token) for part in self.parts])

    def is_finished(self) -> bool:
        return any(part.is_finished() for part in self.parts)
