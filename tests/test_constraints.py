"""Token controllers: the reasoning budget, and grammar masks with closing text appended at an end token."""

from __future__ import annotations

from pathlib import Path

import llguidance
import numpy as np
import pytest

from pantheon.config import read_env
from pantheon.engine.constraints import (Controllers, GrammarController, LazyGrammarController, ReasoningBudget,
                                         ends_inside_a_character, grammar_tokenizer)
from pantheon.io.gguf_file import open_gguf
from pantheon.io.tokenizer import Tokenizer

CLOSE = [900, 901]
TEXT = {1: "<think>", 2: "</think>", 3: "word ", 4: "<th", 5: "ink>", 6: "Hello", 900: "\n</", 901: "think>\n"}
# Byte tokens: "中" is E4 B8 AD in UTF-8, here one byte a token (as byte-fallback vocabularies write it).
BYTES = {7: b"\xe4", 8: b"\xb8", 9: b"\xad"}


def run(budget: ReasoningBudget, tokens: list[int]) -> list[int]:
    out = []
    for t in tokens:
        forced = budget.forced()
        t = forced if forced is not None else t
        budget.advance(t)
        out.append(t)
    while (forced := budget.forced()) is not None:
        budget.advance(forced)
        out.append(forced)
    return out


def make(budget: int, *, inside: bool) -> ReasoningBudget:
    return ReasoningBudget(budget, CLOSE, lambda t: BYTES.get(t) or TEXT[t].encode(), starts_inside=inside)


def test_budget_forces_close_after_n_reasoning_tokens() -> None:
    assert run(make(3, inside=True), [3, 3, 3, 3, 3]) == [3, 3, 3, 900, 901]


def test_budget_counts_only_after_the_block_opens() -> None:
    out = run(make(2, inside=False), [4, 5, 3, 3, 3, 3])  # "<th" "ink>" split across tokens
    assert out == [4, 5, 3, 3, 900, 901]


def test_a_closed_block_is_not_forced() -> None:
    assert run(make(5, inside=True), [3, 2, 3, 3, 3, 3, 3, 3]) == [3, 2, 3, 3, 3, 3, 3, 3]


def test_an_answer_without_think_is_never_forced() -> None:
    assert run(make(1, inside=False), [6, 3, 3, 3]) == [6, 3, 3, 3]


def test_the_close_waits_for_a_character_the_budget_cut_in_two() -> None:
    """The closing text right after a character's first byte would be no UTF-8 (a grammar refuses it): the
    character's other bytes come first, then the close."""
    assert run(make(1, inside=True), [7, 8, 9, 3, 3]) == [7, 8, 9, 900, 901]
    assert run(make(2, inside=True), [3, 7, 8, 9, 3]) == [3, 7, 8, 9, 900, 901]
    # Bytes that never make a character: the close comes at most three tokens late.
    assert run(make(1, inside=True), [7, 7, 7, 7, 7, 7]) == [7, 7, 7, 7, 900, 901]


@pytest.mark.parametrize(("data", "inside"), [(b"", False), (b"a", False), (b"\xe4", True), (b"\xe4\xb8", True),
                                              (b"\xe4\xb8\xad", False), (b"a\xc3", True), (b"\xc3\xa9", False),
                                              (b"\xf0\x9f\x98", True), (b"\xf0\x9f\x98\x80", False),
                                              (b"\xb8\xad", False)])
def test_ends_inside_a_character(data: bytes, inside: bool) -> None:
    assert ends_inside_a_character(data) is inside


@pytest.fixture(scope="module")
def tokenizer(default_model_path: Path) -> Tokenizer:
    env = read_env()
    return Tokenizer.from_gguf_metadata(open_gguf(default_model_path, env.cache_dir).metadata)


@pytest.fixture(scope="module")
def lltok(tokenizer: Tokenizer) -> llguidance.LLTokenizer:
    return grammar_tokenizer(tokenizer)


GRAMMAR = 'start: "<call>" /[a-z]+/ "</call>"'


def controller(lltok, tokenizer, closers=()) -> GrammarController:
    matcher = llguidance.LLMatcher(lltok, llguidance.LLMatcher.grammar_from_lark(GRAMMAR))
    return GrammarController(matcher, vocab_size=tokenizer.vocab_size, eos_id=tokenizer.eos_id,
                             closers=[tokenizer.encode(c) for c in closers])


def test_mask_follows_the_grammar_and_refuses_eos_before_the_end(lltok, tokenizer) -> None:
    c = controller(lltok, tokenizer)
    for t in tokenizer.encode("<call>abc"):
        m = c.mask()
        assert m[t] and not m[tokenizer.eos_id]
        c.advance(t)
    assert not c.mask()[tokenizer.encode("1")[0]]
    for t in tokenizer.encode("</call>"):
        c.advance(t)
    assert c.completed and c.is_finished()


def test_a_matcher_broken_by_a_refused_token_is_not_completed(lltok, tokenizer) -> None:
    """A token the grammar refuses (a forced one: masks do not apply to forced tokens) leaves the matcher in
    error, which also stops it: that output did not satisfy the grammar (response_format_status
    "not_enforced", not "applied")."""
    c = controller(lltok, tokenizer)
    c.advance(tokenizer.encode("x")[0])
    assert c.matcher.is_error() and not c.completed


def test_eos_inside_a_closable_call_appends_the_closer(lltok, tokenizer) -> None:
    c = controller(lltok, tokenizer, closers=["</call>"])
    for t in tokenizer.encode("<call>abc"):
        c.advance(t)
    assert c.mask()[tokenizer.eos_id]  # ending here is allowed: the closer completes the grammar
    assert c.stop_requested(tokenizer.eos_id) is False
    appended = []
    while (f := c.forced()) is not None:
        c.advance(f)
        appended.append(f)
    assert tokenizer.decode(appended) == "</call>" and c.completed and c.appended_closer


def test_composite_forces_first_and_intersects_masks(lltok, tokenizer) -> None:
    close = tokenizer.encode("</call>")
    grammar = controller(lltok, tokenizer)
    prefix = tokenizer.encode("<call>ab")
    both = Controllers([ReasoningBudget(len(prefix), close, tokenizer.token_bytes, starts_inside=True), grammar])
    for t in prefix:
        assert both.forced() is None
        assert both.mask()[t]
        both.advance(t)
    # the budget (as many tokens as the prefix) is spent: its closing tokens come before any sampling
    forced = []
    while (f := both.forced()) is not None:
        both.advance(f)
        forced.append(f)
    assert forced == close and grammar.completed
    assert isinstance(both.mask(), np.ndarray) or both.mask() is None


# A call is "(" lowercase letters ")"; the free text after it is any text (as an "auto" grammar's is).
LAZY_GRAMMAR = r'start: "(" /[a-z]+/ ")" /(?s:.*)/'


def lazy(lltok, tokenizer, *, think: bool = False, opens_think: bool = False) -> LazyGrammarController:
    compiled = llguidance.LLMatcher(lltok, llguidance.LLMatcher.grammar_from_lark(LAZY_GRAMMAR))

    def arm() -> GrammarController:
        return GrammarController(compiled.deep_copy(), vocab_size=tokenizer.vocab_size, eos_id=tokenizer.eos_id,
                                 closers=[tokenizer.encode(")")])

    return LazyGrammarController(arm, lltok.tokenize_bytes, tokenizer.token_bytes, openers=["("], call_ends=[")"],
                                 think=think, opens_think=opens_think)


def masks(c: LazyGrammarController, tokenizer, text: str) -> list[bool]:
    """Whether each token of `text` was masked (it must have been allowed)."""
    out = []
    for t in tokenizer.encode(text, parse_special=False):
        m = c.mask()
        assert m is None or m[t], tokenizer.token_bytes(t)
        out.append(m is not None)
        c.advance(t)
    return out


def test_a_lazy_grammar_masks_from_its_opener_to_the_end_of_the_call(lltok, tokenizer) -> None:
    c = lazy(lltok, tokenizer)
    # Tokens: "call" "(" "ab" ")(" "cd" ")" " done": the token that closes the first call opens the next one.
    assert masks(c, tokenizer, "call(ab)(cd) done") == [False, False, True, True, True, True, False]
    assert c.mask() is None and c.stop_requested(tokenizer.eos_id)


def test_a_lazy_grammar_reads_the_text_after_the_opener_in_its_token(lltok, tokenizer) -> None:
    c = lazy(lltok, tokenizer)
    masks(c, tokenizer, "a (")  # " (": text before the opener in its token
    assert c.mask() is not None and not c.mask()[tokenizer.encode("1")[0]] and not c.mask()[tokenizer.eos_id]
    masks(c, tokenizer, "ab")
    assert c.mask()[tokenizer.eos_id] and c.stop_requested(tokenizer.eos_id) is False  # the closer is appended
    assert tokenizer.decode([c.forced()]) == ")"
    # An opener whose token goes on with text the grammar refuses ("();") is text: nothing is masked.
    c = lazy(lltok, tokenizer)
    assert masks(c, tokenizer, "x(); y") == [False, False, False]


def test_a_lazy_grammar_never_arms_in_the_think_block(lltok, tokenizer) -> None:
    c = lazy(lltok, tokenizer, think=True, opens_think=True)
    assert not any(masks(c, tokenizer, "f(ab) (1"))
    assert c.stop_requested(tokenizer.eos_id)
    masks(c, tokenizer, "</think>\n(")
    assert c.mask() is not None
    c = lazy(lltok, tokenizer, think=True)
    assert not any(masks(c, tokenizer, " <think>(1 </think>"))
    masks(c, tokenizer, "(")
    assert c.mask() is not None
