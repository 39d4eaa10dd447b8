"""The session table: prefix reuse, several conversations per id, capacity, TTL, release, install."""

from __future__ import annotations

import pytest

from pantheon.engine.sessions import Assignment, SessionTable
from pantheon.errors import ApiError


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def table(**kw: object) -> tuple[SessionTable, Clock]:
    clock = Clock()
    args = {"n_slots": 6, "max_sessions": 2, "idle_ttl_s": 100.0, "clock": clock}
    args.update(kw)
    return SessionTable(**args), clock  # type: ignore[arg-type]


def finished_turn(t: SessionTable, session: str | None, prompt: list[int], generated: list[int],
                  reuse: bool = True) -> Assignment:
    a = t.assign(session, prompt, reuse=reuse)
    assert a is not None
    a.slot.tokens[:] = prompt + generated  # what the scheduler commits
    t.finish(a.slot)
    return a


def run_turn(t: SessionTable, session: str | None, prompt: list[int], generated: list[int]) -> int:
    return finished_turn(t, session, prompt, generated).cached_tokens


def test_second_turn_reuses_the_conversation() -> None:
    t, _ = table()
    turn1 = list(range(100))
    assert run_turn(t, "s", turn1, [500, 501, 502]) == 0
    turn2 = turn1 + [500, 501, 777, 778]  # the reply re-tokenized a little differently, then a new message
    assert run_turn(t, "s", turn2, [9]) == 102


def test_cache_always_leaves_a_token_to_compute() -> None:
    t, _ = table()
    prompt = list(range(50))
    run_turn(t, "s", prompt, [])
    assert run_turn(t, "s", prompt, []) == 49


def run_stateless(t: SessionTable, prompt: list[int], generated: list[int], reuse: bool = True
                  ) -> tuple[int, int]:
    """(slot index, cached tokens) of a stateless turn."""
    a = finished_turn(t, None, prompt, generated, reuse)
    return a.slot.index, a.cached_tokens


def test_stateless_turns_resume_from_what_an_earlier_one_left() -> None:
    t, _ = table()
    system = list(range(100))
    first, cached = run_stateless(t, system + [500, 501], [7, 8])
    assert cached == 0
    # The whole conversation resent with the reply and a new message: resumes in the same slot.
    slot, cached = run_stateless(t, system + [500, 501, 7, 8, 600], [9])
    assert (slot, cached) == (first, 104)
    # The same prompt again: all but one token.
    slot, cached = run_stateless(t, system + [500, 501, 7, 8, 600], [9])
    assert (slot, cached) == (first, 104)
    assert t.live_sessions() == []


def test_a_stateless_turn_sharing_too_little_leaves_the_caches_alone() -> None:
    t, _ = table()
    kept, _ = run_stateless(t, list(range(100)), [1])
    # Shares 10 of 40 tokens (< STATELESS_REUSE_FRACTION): an empty slot, cold; the first cache stays whole.
    other, cached = run_stateless(t, list(range(10)) + list(range(1000, 1030)), [2])
    assert other != kept and cached == 0
    assert run_stateless(t, list(range(100)) + [5], [])[1] == 100


def test_a_short_prompt_does_not_cut_a_long_anonymous_cache() -> None:
    """A short question sharing only the template's header with a long conversation's cache takes another
    slot (copying the header where the model can copy prefixes); the long cache stays whole and resumes."""
    for copies in (False, True):
        t, _ = table(copy_prefixes=copies)
        header = list(range(30))
        long_slot, _ = run_stateless(t, header + list(range(100, 1100)), [1])
        a = t.assign(None, header + [5, 6, 7])
        assert a is not None and a.slot.index != long_slot
        assert (a.cached_tokens, a.copy_from) == ((30, (long_slot, 30)) if copies else (0, None))
        if a.copy_from:
            t.unpin(a.copy_from[0])
        a.slot.tokens[:] = header + [5, 6, 7, 8]
        t.finish(a.slot)
        assert run_stateless(t, header + list(range(100, 1100)) + [1, 2], []) == (long_slot, 1031)


def test_cache_prompt_false_starts_a_stateless_turn_cold() -> None:
    t, _ = table()
    run_stateless(t, list(range(50)), [1])
    assert run_stateless(t, list(range(50)), [1], reuse=False)[1] == 0

    # A new id's first turn takes over the anonymous cache it continues, which then is the session's.
    t2, _ = table(n_slots=3)
    anonymous, _ = run_stateless(t2, list(range(50)), [1])
    a = t2.assign("s", list(range(50)) + [1, 2])
    assert a is not None and (a.slot.index, a.cached_tokens) == (anonymous, 51) and a.slot.session == "s"
    t2.finish(a.slot)
    # With cache_prompt false it starts cold in an empty slot, and the anonymous caches stay whole.
    other, _ = run_stateless(t2, list(range(100, 150)), [1])
    b = t2.assign("u", list(range(100, 150)), reuse=False)
    assert b is not None and b.slot.index not in (anonymous, other) and b.cached_tokens == 0
    b.slot.tokens[:] = list(range(100, 150))
    t2.finish(b.slot)
    # ... and its own later turns still resume.
    assert t2.assign("u", list(range(100, 150)) + [7], reuse=False).cached_tokens == 50  # type: ignore[union-attr]


def test_a_new_conversation_starts_from_a_copy_of_another_sessions_prefix() -> None:
    """opencode's sessions all open with the same long system prompt and tools: a new id's first turn copies
    that prefix from an idle slot of another session (models that copy prefixes), which stays pinned, and
    keeps its own conversation, until the copy is done."""
    t, _ = table(copy_prefixes=True, max_sessions=4)
    system = list(range(1000))
    run_turn(t, "a", system + [1, 2, 3], [4, 5])
    source = t.get("a").slots[0]  # type: ignore[union-attr]
    b = t.assign("b", system + [7, 8, 9])
    assert b is not None and b.slot is not source
    assert (b.cached_tokens, b.copy_from) == (1000, (source.index, 1000)) and b.slot.tokens == system
    assert source.pins == 1 and source.tokens == system + [1, 2, 3, 4, 5]
    assert t.assign("a", system + [1, 2, 3, 4, 5, 6]) is None  # a's own turn waits for the copy
    t.unpin(source.index)
    assert t.assign("a", system + [1, 2, 3, 4, 5, 6]).cached_tokens == 1005  # type: ignore[union-attr]
    b.slot.tokens[:] = system + [7, 8, 9, 10]
    t.finish(b.slot)
    # A stateless turn copies it too (no anonymous slot holds it); a busy slot (a's, mid-turn) is never a source.
    c = t.assign(None, system + [42])
    assert c is not None and c.copy_from is not None and c.copy_from[0] == b.slot.index and c.cached_tokens == 1000
    t.unpin(c.copy_from[0])
    # Sharing less than half the prompt, or cache_prompt false: cold.
    assert t.assign("d", system[:10] + list(range(5000, 5100))).cached_tokens == 0  # type: ignore[union-attr]
    e = t.assign("e", system + [3], reuse=False)
    assert e is not None and (e.cached_tokens, e.copy_from) == (0, None)


def test_busy_and_failed_stateless_slots_are_not_reused() -> None:
    t, _ = table(n_slots=2)
    prompt = list(range(40))
    busy = t.assign(None, prompt)
    assert busy is not None
    busy.slot.tokens[:] = prompt
    other = t.assign(None, prompt)  # the slot holding the prefix is mid-turn
    assert other is not None and other.slot is not busy.slot and other.cached_tokens == 0
    t.finish(busy.slot, keep=False)  # a failed turn: its state may be half-written
    assert not busy.slot.tokens
    t.finish(other.slot)


def test_recurrent_models_keep_no_stateless_cache() -> None:
    t, _ = table(rewindable=False)
    run_stateless(t, list(range(30)), [1])
    assert run_stateless(t, list(range(30)) + [1, 2], [1])[1] == 0


def test_two_conversations_under_one_id_each_resume() -> None:
    t, _ = table()
    title = [1, 2, 3] + list(range(1000, 1040))
    main = [1, 2, 3] + list(range(2000, 2100))
    run_turn(t, "s", title, [7])
    run_turn(t, "s", main, [8])
    assert run_turn(t, "s", main + [8, 50], [9]) == 104
    assert run_turn(t, "s", title + [7, 60], [9]) == 44
    a = t.assign("s", main + [8, 50, 9, 70])
    assert a is not None and not a.conflict


def test_third_conversation_evicts_and_reports_conflict() -> None:
    t, clock = table()
    for base in (1000, 2000):
        clock.now += 1
        run_turn(t, "s", list(range(base, base + 50)), [])
    clock.now += 1
    a = t.assign("s", list(range(3000, 3050)))
    assert a is not None and a.conflict and a.cached_tokens == 0


def test_busy_conversation_runs_cold_beside_it() -> None:
    t, _ = table()
    prompt = list(range(60))
    run_turn(t, "s", prompt, [])
    first = t.assign("s", prompt + [1])
    second = t.assign("s", prompt + [2])
    assert first is not None and second is not None
    assert first.cached_tokens == 60 and second.cached_tokens == 0 and second.conflict
    assert first.slot is not second.slot


def test_a_turn_waits_for_an_export_of_its_conversation() -> None:
    """An export reads the slot (busy, exporting): a turn that continues that conversation is not a second
    conversation running beside it. It waits (None: the job stays queued) and then resumes from the cache."""
    t, _ = table()
    prompt = list(range(60))
    run_turn(t, "s", prompt, [5])
    slot = t.get("s").slots[0]
    slot.busy = slot.exporting = True
    assert t.assign("s", prompt + [5, 6]) is None
    slot.busy = slot.exporting = False
    a = t.assign("s", prompt + [5, 6])
    assert a is not None and a.slot is slot and a.cached_tokens == 61 and not a.conflict


def test_capacity_counts_ids() -> None:
    t, _ = table()
    run_turn(t, "a", [1, 2, 3], [])
    run_turn(t, "b", [1, 2, 3], [])
    with pytest.raises(ApiError) as info:
        t.assign("c", [1, 2, 3])
    assert info.value.status == 429 and info.value.error_type == "model_at_session_capacity"
    assert info.value.headers["Retry-After"] == "30"
    run_turn(t, None, [1, 2, 3], [])  # stateless turns are not sessions
    # The message's re-prefill estimate: short ones in two significant digits, not "about 0 s".
    for estimate, said in ((0.0234, "about 0.023 s"), (3.456, "about 3.5 s"), (240.94, "about 241 s")):
        with pytest.raises(ApiError) as info:
            t.check_capacity("c", estimate)
        assert info.value.message.endswith(said), info.value.message


def test_idle_sessions_are_reaped_after_the_ttl_unless_watched() -> None:
    t, clock = table()
    run_turn(t, "a", [1, 2, 3], [])
    run_turn(t, "b", [1, 2, 3], [])
    t.hold("b")
    clock.now += 101
    assert t.reap() == ["a"]
    assert t.live_sessions() == ["b"]
    assert t.assign("c", [4, 5]) is not None  # the reaped id's room is free


def test_release_is_idempotent_and_frees_slots() -> None:
    t, _ = table()
    run_turn(t, "a", list(range(20)), [])
    assert t.release("a") and not t.release("a")
    assert all(s.session is None and not s.tokens for s in t.slots)


def test_install_replaces_the_conversation_it_continues() -> None:
    t, _ = table()
    run_turn(t, "a", list(range(40)), [])
    slot = t.install("a", list(range(45)))
    assert slot is not None and slot.busy and slot.session == "a"
    assert len(t.get("a").slots) == 1


def test_a_new_session_without_a_free_slot_is_not_left_behind() -> None:
    t, _ = table(n_slots=1, max_sessions=2)
    held = t.assign(None, [1])
    assert held is not None
    assert t.assign("x", [1, 2]) is None
    assert t.live_sessions() == []


def test_resending_an_earlier_prompt_resumes_the_conversation_it_started() -> None:
    """Turn 1, turn 2, then turn 1's prompt again three times: the first re-send is a new conversation (it
    stops short of the first conversation's anchor), and every later re-send resumes that one, with no
    conflict and without evicting the two-turn conversation."""
    t, clock = table()
    turn1 = list(range(35))
    run_turn(t, "s", turn1, [900, 901])
    clock.now += 1
    turn2 = turn1 + [900, 901] + list(range(200, 230))
    a = t.assign("s", turn2, anchor=len(turn2) - 3)
    assert a is not None and a.cached_tokens == 37
    a.slot.tokens[:] = turn2 + [5, 6]
    t.finish(a.slot)
    main = a.slot
    for resend in range(3):
        clock.now += 1
        b = t.assign("s", turn1, anchor=34)
        assert b is not None and b.slot is not main and not b.conflict, resend
        assert b.cached_tokens == (0 if resend == 0 else 34), resend
        b.slot.tokens[:] = turn1 + [950 + resend]
        t.finish(b.slot)
    assert main.tokens == turn2 + [5, 6]  # the two-turn conversation is still there to resume


def test_a_second_conversation_starts_from_a_copy_of_what_it_shares() -> None:
    """With prefix copies (attention models), re-sending turn 1 after turn 2 starts the second conversation from
    a copy of the prefix the first one holds; the first stays whole. A third conversation evicts one (and is
    flagged), so it starts cold."""
    t, clock = table(copy_prefixes=True)
    turn1 = list(range(35))
    run_turn(t, "s", turn1, [900, 901])
    clock.now += 1
    turn2 = turn1 + [900, 901] + list(range(200, 230))
    a = t.assign("s", turn2, anchor=len(turn2) - 3)
    a.slot.tokens[:] = turn2 + [5]
    t.finish(a.slot)
    clock.now += 1
    b = t.assign("s", turn1, anchor=34)
    assert b is not None and b.slot is not a.slot and not b.conflict
    assert b.cached_tokens == 34 and b.copy_from == (a.slot.index, 34) and b.slot.tokens == turn1[:34]
    b.slot.tokens[:] = turn1 + [7]
    t.finish(b.slot)
    assert a.slot.tokens == turn2 + [5]
    clock.now += 1
    c = t.assign("s", list(range(35)) + [1, 2, 3], anchor=30)  # continues b's conversation
    assert c is not None and c.slot is b.slot and c.copy_from is None
    t.finish(c.slot)
    clock.now += 1
    d = t.assign("s", [99] * 10)  # a third conversation: evicts the least recent, cold
    assert d is not None and d.conflict and d.cached_tokens == 0 and d.copy_from is None


def test_a_third_conversation_starts_from_the_prefix_it_shares() -> None:
    """Two conversations live; a third (opencode's compaction request replaying the main one) evicts the least
    recent. It reuses the longest prefix it shares: copied from the conversation that stays, or kept in place
    when it is the evicted one's; only a third conversation that reuses nothing is flagged as a conflict."""
    t, clock = table(copy_prefixes=True)
    main, title = list(range(100)), [1, 2, 3] + list(range(500, 540))
    run_turn(t, "s", main, [7])
    clock.now += 1
    run_turn(t, "s", title, [8])
    session = t.get("s")
    main_slot, title_slot = session.slots
    clock.now += 1
    compaction = main[:80] + [900, 901]  # shares 80 tokens with main, 0 with title (the least recent is main)
    c = t.assign("s", compaction, anchor=81)
    assert c is not None and c.slot is main_slot and not c.conflict
    assert c.cached_tokens == 80 and c.copy_from is None  # the evicted slot already holds them
    c.slot.tokens[:] = compaction + [9]
    t.finish(c.slot)
    clock.now += 1
    again = title[:40] + [950]  # shares 40 with title, whose slot is now the least recent: kept in place
    d = t.assign("s", again, anchor=41)
    assert d is not None and not d.conflict and d.cached_tokens == 40 and d.slot is title_slot
    d.slot.tokens[:] = again
    t.finish(d.slot)
    clock.now += 1
    run_turn(t, "s", compaction + [9, 1, 2], [3])  # the compacted conversation goes on: title's is least recent
    clock.now += 1
    e = t.assign("s", compaction[:60] + [7, 7, 7], anchor=62)  # evicts title's slot, copies from main's
    assert e is not None and not e.conflict and e.slot is title_slot
    assert e.cached_tokens == 60 and e.copy_from == (main_slot.index, 60) and e.slot.tokens == compaction[:60]


def test_a_copy_source_is_not_written_until_the_copy_is_done() -> None:
    """A turn admitted to copy another slot's prefix copies it at its first step, which may come much later
    (behind a long prefill). Until the scheduler unpins the source, nothing may write into it: a restore into
    the session, a new conversation evicting it, a stateless turn after a release, a turn rewinding it."""
    t, clock = table(copy_prefixes=True, n_slots=3)
    turn1 = list(range(35))
    run_turn(t, "s", turn1, [900, 901])
    clock.now += 1
    b = t.assign("s", turn1[:30] + [500, 501], anchor=30)  # a second conversation, from a copy of the first
    assert b is not None and b.copy_from is not None
    source = t.slots[b.copy_from[0]]
    assert source.pins == 1 and source.taken and not source.busy
    # A restore into the session may not replace the source conversation, nor evict it: no slot for it now.
    assert t.install("s", turn1 + [900, 901]) is None
    # Nor may a turn that continues (and so rewinds) the source run in it yet: it waits.
    clock.now += 1
    assert t.assign("s", turn1 + [900, 901, 902]) is None
    # Released, the session's slots free up, but not the pinned one.
    t.release("s")
    others = [t.assign(None, [1, 2, 3]) for _ in range(2)]
    assert all(o is None or o.slot is not source for o in others)
    t.unpin(source.index)
    assert not source.taken
    assert t.assign(None, [4, 5, 6]).slot is source  # type: ignore[union-attr]


def test_cache_prompt_false_copies_nothing_from_the_ids_other_conversation() -> None:
    """The README: `"cache_prompt": false` starts a turn cold unless its id resumes its own conversation. A new
    conversation under an id holding another (a different question after the same system prompt) took a copy
    of their shared prefix anyway; without the flag it still does."""
    system = list(range(40))
    for reuse, cached in ((False, 0), (True, 40)):
        t, clock = table(copy_prefixes=True)
        run_turn(t, "s", system + [1, 2, 3], [900, 901])
        clock.now += 1
        a = t.assign("s", system + [7, 8, 9], reuse=reuse)
        assert a is not None and a.cached_tokens == cached and (a.copy_from is None) == (not reuse)
        assert a.slot.tokens == system[:cached]
