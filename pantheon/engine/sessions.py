"""Which slot a turn runs in: the prefix cache's bookkeeping, with no tensors in it.

A slot is one sequence's state in the model's state pool. A session id owns up to
`conversations_per_session` slots (one per conversation: opencode sends its title request and its real
turns under one id); a turn resumes from the owned slot whose tokens its prompt continues, and computes only
the rest. Stateless turns (no id) use slots no session owns; the pool is sized so they always find one. On
a rewindable model such a slot keeps its tokens after the turn, as an anonymous prefix cache: a later
stateless turn that shares at least SHARED_REUSE_FRACTION of its prompt with one (a client resending
the whole conversation each turn, or the same long system prompt) resumes from it, as llama.cpp's server
does with its slots. A prompt that starts a new conversation (a new id's first turn; a stateless turn no
anonymous slot serves) may instead start from a copy of that much of any idle slot's tokens, another
session's included, where the model can copy a slot's prefix (llama models): opencode's sessions all open
with the same ~7.5k tokens of system prompt and tools. A request's `cache_prompt: false` turns both off
(a session still resumes its own conversations). A resumed or copied prefix gives the bits of a cold
prefill (attention reads a cached position as it would have computed it), so only the time changes.

`max_sessions` counts ids. A new id when that many ids are live is refused with
429 `model_at_session_capacity`; ids idle past the TTL are reaped first, unless a watch holds them.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from pantheon.errors import ApiError

# A prompt continues a conversation when it repeats the conversation's history up to where its last turn's
# generation prompt began (the slot's anchor); the reply after it may re-render differently. Restored slots
# have no known anchor: half of their tokens stands in for it.
CONTINUATION_FRACTION = 0.5
# A stateless turn resumes from a free unowned slot's tokens in place when they cover at least this fraction of
# its prompt and it keeps at least this fraction of them (a short question sharing only the template's system
# header must not cut a long conversation's cache down to it); else it takes an empty (else the least recently
# used) slot, leaving the other caches whole. A new conversation copies another slot's prefix only from the
# same fraction of its prompt on.
SHARED_REUSE_FRACTION = 0.5


@dataclass
class SlotInfo:
    index: int
    tokens: list[int] = field(default_factory=list)  # tokens whose state the slot holds, in order
    session: str | None = None
    busy: bool = False
    # Busy only because an export is reading the slot (no turn is running in it): a turn that continues this
    # conversation waits for the read rather than starting cold beside it.
    exporting: bool = False
    last_used: float = 0.0
    # Recurrent models only: snapshots of the slot's state at earlier positions (objects with .n_tokens),
    # since their state cannot be rewound to a shorter prefix.
    checkpoints: list[Any] = field(default_factory=list)
    # How much of the slot a prompt must repeat to continue its conversation: where the last turn's history
    # ended (its prompt before the generation prompt).
    anchor: int = 0
    # Admitted turns that have yet to copy this slot's prefix (`Assignment.copy_from`): until they have, nothing
    # may write into it (a restore, a turn rewinding it, a new owner), so it counts as busy for everything that
    # would. The scheduler unpins it once the copy is done (`SessionTable.unpin`).
    pins: int = 0

    @property
    def taken(self) -> bool:
        """Busy, or pinned as a copy source: not to be written, evicted or handed out."""
        return self.busy or self.pins > 0

    def clear(self) -> None:
        self.tokens.clear()
        self.checkpoints.clear()

    def truncate(self, n: int) -> None:
        del self.tokens[n:]
        self.checkpoints = [c for c in self.checkpoints if c.n_tokens <= n]


@dataclass
class Session:
    id: str
    slots: list[SlotInfo] = field(default_factory=list)
    last_used: float = 0.0

    @property
    def busy(self) -> bool:
        return any(s.busy for s in self.slots)

    def most_recent(self) -> SlotInfo | None:
        return max(self.slots, key=lambda s: s.last_used, default=None)


@dataclass(frozen=True)
class Assignment:
    slot: SlotInfo
    cached_tokens: int
    conflict: bool = False
    restore: Any = None  # a checkpoint to reinstall before prefilling (recurrent models)
    copy_from: tuple[int, int] | None = None  # (slot index, n): copy that slot's first n positions first


def common_prefix(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    i = 0
    # Compare in strides first: prompts share thousands of tokens with their conversation.
    while i + 64 <= n and a[i : i + 64] == b[i : i + 64]:
        i += 64
    while i < n and a[i] == b[i]:
        i += 1
    return i


def _longest_prefix(prompt: list[int], slots: Iterable[SlotInfo], keep_fraction: float = 0.0
                    ) -> tuple[int, SlotInfo | None]:
    """(usable, slot): of `slots`, the one a turn with this prompt can resume the most of, and how much (one
    prompt token always left to compute: its logits give the first new token); only slots that keep at least
    keep_fraction of their tokens count. (0, None) when none shares SHARED_REUSE_FRACTION of the prompt."""
    best, best_usable = None, 0
    for slot in slots:
        usable = min(common_prefix(slot.tokens, prompt), len(prompt) - 1)
        if usable > best_usable and usable >= keep_fraction * len(slot.tokens):
            best, best_usable = slot, usable
    if best is None or best_usable < SHARED_REUSE_FRACTION * len(prompt):
        return 0, None
    return best_usable, best


def _start_from(slot: SlotInfo, source: SlotInfo, prompt: list[int], usable: int) -> tuple[int, int] | None:
    """`slot` starts a turn from the first `usable` tokens of `prompt`, which `source` holds: kept in place when
    it is the slot itself, else the copy_from of an `Assignment`, `source` pinned until the scheduler has copied
    them (`SessionTable.unpin`)."""
    slot.tokens[:] = prompt[:usable]
    if source is slot:
        return None
    source.pins += 1
    return source.index, usable


def _seconds(value: float) -> str:
    """A time estimate for a message: whole seconds from 10 s up, two significant digits below (a short prompt's
    re-prefill read "about 0 s")."""
    return f"{value:.0f}" if value >= 10 else f"{value:.2g}"


class SessionTable:
    def __init__(self, *, n_slots: int, max_sessions: int, conversations_per_session: int = 2,
                 idle_ttl_s: float = 12 * 3600.0, clock: Callable[[], float] = time.monotonic,
                 rewindable: bool = True, copy_prefixes: bool = False) -> None:
        self.slots = [SlotInfo(i) for i in range(n_slots)]
        # A rewindable state (attention KV) resumes from any prefix; a recurrent one only from the slot's
        # current end or from a checkpoint.
        self.rewindable = rewindable
        # A new conversation under an id may start from a copy of the prefix it shares with a sibling (the model
        # can copy a slot's first positions into another).
        self.copy_prefixes = copy_prefixes
        self.max_sessions = max_sessions
        self.conversations_per_session = conversations_per_session
        self.idle_ttl_s = idle_ttl_s
        self.clock = clock
        self.sessions: dict[str, Session] = {}
        # Open /session/watch connections per id (the id need not have a session yet): held ids are
        # never reaped.
        self.watches: dict[str, int] = {}

    # -- queries -------------------------------------------------------------------------------------------
    def live_sessions(self) -> list[str]:
        return list(self.sessions)

    def get(self, session_id: str) -> Session | None:
        return self.sessions.get(session_id)

    def _free_unowned_slot(self) -> SlotInfo | None:
        """An idle slot no session owns: an empty one first, else the least recently used (its cache goes)."""
        free = [s for s in self.slots if not s.taken and s.session is None]
        return min(free, key=lambda s: (len(s.tokens) > 0, s.last_used)) if free else None

    def _stateless_slot(self, prompt: list[int], reuse: bool) -> tuple[SlotInfo, int] | None:
        """The slot of a turn without a session id and how many of its prompt's tokens it holds already: the
        free unowned slot sharing the longest prefix with the prompt (at least SHARED_REUSE_FRACTION of the
        prompt and of the slot's tokens, one token always left to compute), else an emptied one. None when no
        unowned slot is free."""
        if reuse and self.rewindable:
            anonymous = (s for s in self.slots if not s.taken and s.session is None and s.tokens)
            usable, best = _longest_prefix(prompt, anonymous, keep_fraction=SHARED_REUSE_FRACTION)
            if best is not None:
                best.truncate(usable)
                return best, usable
        slot = self._free_unowned_slot()
        if slot is None:
            return None
        slot.clear()
        return slot, 0

    def _shared_start(self, slot: SlotInfo, prompt: list[int], reuse: bool) -> tuple[int, tuple[int, int] | None]:
        """For a new conversation in the emptied `slot`: (cached tokens, copy_from) when some other idle slot
        holds at least SHARED_REUSE_FRACTION of the prompt (one token always left to compute) and the model can
        copy prefixes; that slot is pinned until the copy is done. Else (0, None)."""
        if not (reuse and self.copy_prefixes):
            return 0, None
        # A busy slot's tokens may run ahead of its state: never a source.
        usable, source = _longest_prefix(prompt, (s for s in self.slots if s is not slot and not s.busy))
        if source is None:
            return 0, None
        return usable, _start_from(slot, source, prompt, usable)

    # -- admission -----------------------------------------------------------------------------------------
    def check_capacity(self, session_id: str | None, reprefill_estimate_s: float | None = None) -> None:
        """Raise 429 model_at_session_capacity when a new id cannot get a session now."""
        if session_id is None or session_id in self.sessions:
            return
        self.reap()
        if len(self.sessions) >= self.max_sessions:
            estimate = f"; re-prefilling a dropped session costs about {_seconds(reprefill_estimate_s)} s" \
                if reprefill_estimate_s is not None else ""
            raise ApiError(429, "model_at_session_capacity",
                           f"all {self.max_sessions} session slots hold live sessions; retry later or release "
                           f"one with POST /session/release{estimate}", headers={"Retry-After": "30"})

    def assign(self, session_id: str | None, prompt: list[int], anchor: int | None = None, reuse: bool = True
               ) -> Assignment | None:
        """Pick the slot a turn runs in, or None when every usable slot is busy (the job keeps waiting).

        `anchor`: where this prompt's history ends; it becomes the slot's anchor for the next turn. `reuse`
        False (the request's `cache_prompt`): no anonymous cache and no copied prefix, so a turn that does not
        continue its own session's conversation starts cold."""
        assignment = self._assign(session_id, prompt, reuse)
        if assignment is not None:
            assignment.slot.anchor = anchor if anchor is not None else len(prompt)
        return assignment

    def _assign(self, session_id: str | None, prompt: list[int], reuse: bool = True) -> Assignment | None:
        now = self.clock()
        session = self.sessions.get(session_id) if session_id is not None else None
        if session is None:
            # A stateless turn, or a new id's first: an anonymous cache it continues, else a copy of what another
            # slot shares with it, else cold.
            if session_id is not None:
                self.check_capacity(session_id)
            got = self._stateless_slot(prompt, reuse)
            if got is None:
                return None
            slot, cached = got
            if session_id is not None:
                self._open_session(session_id, slot, now, keep=True)
            copy_from = None
            if not cached:
                cached, copy_from = self._shared_start(slot, prompt, reuse)
            return self._take(slot, cached, now, copy_from=copy_from)
        # The owned conversation this prompt continues, if any: of those whose history up to the anchor it
        # repeats, the one it shares the most with (a tie: the most recent), so that re-sending a prompt resumes
        # the conversation it started rather than whichever slot comes first.
        best, best_len = None, 0
        for slot in sorted(session.slots, key=lambda s: -s.last_used):
            n = common_prefix(slot.tokens, prompt)
            if n > best_len and n >= max(1, min(slot.anchor, len(slot.tokens))):
                best, best_len = slot, n
        if best is not None:
            if best.busy and best.exporting or not best.busy and best.pins:
                return None  # the export (the copy) is done in a moment; the scheduler is poked then
            if not best.busy:
                # Keep at least one prompt token to compute: its logits give the first new token.
                usable = min(best_len, len(prompt) - 1)
                session.last_used = now
                if self.rewindable or usable == len(best.tokens):
                    best.truncate(usable)
                    return self._take(best, usable, now)
                checkpoint = max((c for c in best.checkpoints if c.n_tokens <= usable),
                                 key=lambda c: c.n_tokens, default=None)
                if checkpoint is None:
                    best.clear()
                    return self._take(best, 0, now)
                best.truncate(checkpoint.n_tokens)
                return self._take(best, checkpoint.n_tokens, now, restore=checkpoint)
            conflict = True  # the same conversation is mid-turn: this one runs cold beside it
        else:
            conflict = False
        # A new conversation under this id (or a cold copy of a busy one). What it shares with the conversations
        # there now, measured before one of them may be evicted for it.
        shared = [(common_prefix(s.tokens, prompt), s) for s in session.slots]
        got = self._conversation_slot(session)
        if got is None:
            return None
        slot, evicted = got
        session.last_used = now
        if conflict or not self.copy_prefixes or not reuse:  # reuse: the request's cache_prompt
            return self._take(slot, 0, now, conflict or evicted)
        # It starts from the longest prefix it shares with one of them (re-sending turn 1 after turn 2, an edited
        # earlier message, a compaction request replaying the conversation): copied from that slot, or, when that
        # is the slot just evicted for it, kept in place. The other conversation stays whole. Only a new
        # conversation that could reuse nothing and evicted another is flagged as a conflict.
        n, source = max(shared, key=lambda pair: pair[0], default=(0, None))
        usable = min(n, len(prompt) - 1)
        if source is None or usable <= 0:
            cached, copy_from = self._shared_start(slot, prompt, reuse)
            return self._take(slot, cached, now, evicted and not cached, copy_from=copy_from)
        return self._take(slot, usable, now, copy_from=_start_from(slot, source, prompt, usable))

    def _conversation_slot(self, session: Session) -> tuple[SlotInfo, bool] | None:
        """An emptied slot for a new conversation of `session`: a free one while it has fewer than
        conversations_per_session, else its least recently used idle conversation (evicted: True)."""
        if len(session.slots) < self.conversations_per_session:
            slot = self._free_unowned_slot()
            if slot is None:
                return None
            slot.session = session.id
            session.slots.append(slot)
            evicted = False
        else:
            idle = [s for s in session.slots if not s.taken]
            if not idle:
                return None
            slot = min(idle, key=lambda s: s.last_used)
            evicted = True  # that conversation can no longer resume
        slot.clear()
        return slot, evicted

    def _open_session(self, session_id: str, slot: SlotInfo, now: float, keep: bool = False) -> Session:
        """A new session owning `slot`; keep: the slot's tokens stay (an anonymous cache its first turn
        continues)."""
        session = self.sessions[session_id] = Session(session_id, last_used=now)
        slot.session = session_id
        if not keep:
            slot.clear()
        session.slots.append(slot)
        return session

    def _take(self, slot: SlotInfo, cached: int, now: float, conflict: bool = False,
              restore: Any = None, copy_from: tuple[int, int] | None = None) -> Assignment:
        slot.busy = True
        slot.last_used = now
        return Assignment(slot, cached, conflict, restore, copy_from)

    def finish(self, slot: SlotInfo, *, keep: bool = True) -> None:
        """The turn on `slot` ended. Its tokens stay (the cache: a session's, or on a rewindable model an
        anonymous one for later stateless turns); `keep=False` (a failed turn, half-written state) empties the
        slot, as does a stateless turn on a recurrent model (its state resumes only from its end)."""
        slot.busy = False
        slot.last_used = self.clock()
        if not keep or slot.session is None and not self.rewindable:
            slot.clear()
        if slot.session is not None:
            session = self.sessions.get(slot.session)
            if session is not None:
                session.last_used = slot.last_used

    def unpin(self, slot_index: int) -> None:
        """A turn has copied slot `slot_index`'s prefix (or ended before it could): one pin fewer."""
        slot = self.slots[slot_index]
        slot.pins = max(0, slot.pins - 1)

    # -- lifetime ------------------------------------------------------------------------------------------
    def release(self, session_id: str) -> bool:
        """Free every slot of a session now. Busy slots are detached: their turn finishes statelessly."""
        session = self.sessions.pop(session_id, None)
        if session is None:
            return False
        for slot in session.slots:
            slot.session = None
            if not slot.busy:
                slot.clear()  # its bookkeeping only: a pinned slot's state stays as it is until the copy
        return True

    def reap(self) -> list[str]:
        """Release sessions idle longer than the TTL (never a busy or watched one)."""
        now = self.clock()
        expired = [s.id for s in self.sessions.values()
                   if not s.busy and not self.watches.get(s.id) and now - s.last_used > self.idle_ttl_s]
        for session_id in expired:
            self.release(session_id)
        return expired

    def hold(self, session_id: str) -> None:
        self.watches[session_id] = self.watches.get(session_id, 0) + 1

    def unhold(self, session_id: str) -> int:
        """Drop one watch; returns how many remain."""
        left = self.watches.get(session_id, 0) - 1
        if left > 0:
            self.watches[session_id] = left
        else:
            self.watches.pop(session_id, None)
            left = 0
        return left

    def touch(self, session_id: str) -> None:
        session = self.sessions.get(session_id)
        if session is not None:
            session.last_used = self.clock()

    def install(self, session_id: str, tokens: list[int]) -> SlotInfo | None:
        """Reserve a slot for restored state: the conversation these tokens continue (replaced), else a new
        one. Returns the slot marked busy (the caller writes the state, then calls finish), or None when the
        id is at capacity or no slot is free. Raises ApiError for a new id over max_sessions."""
        now = self.clock()
        session = self.sessions.get(session_id)
        if session is None:
            self.check_capacity(session_id)
            slot = self._free_unowned_slot()
            if slot is None:
                return None
            self._open_session(session_id, slot, now)
            self._take(slot, 0, now)
            slot.anchor = int(CONTINUATION_FRACTION * len(tokens))
            return slot
        target = next((slot for slot in session.slots if slot.tokens and not slot.taken
                       and common_prefix(slot.tokens, tokens) >= max(1, min(slot.anchor, len(slot.tokens)))), None)
        if target is None:
            got = self._conversation_slot(session)
            if got is None:
                return None
            target = got[0]
        target.clear()
        session.last_used = now
        self._take(target, 0, now)
        # The structure of restored tokens is unknown: a prompt continues them when it repeats half of them.
        target.anchor = int(CONTINUATION_FRACTION * len(tokens))
        return target
