"""Session export, restore and release on one model instance: the slot state <-> blob round trip.

Runs on the event loop; the copying and (de)serialization run in a worker thread. A slot being read or
written is marked busy, so the scheduler never admits a turn into it meanwhile (a turn that continues an
exporting conversation waits for the export, which is quick, instead of running cold beside it).
"""

from __future__ import annotations

from dataclasses import dataclass

import trio

from pantheon.engine import snapshot
from pantheon.errors import ApiError
from pantheon.sched.scheduler import Scheduler


@dataclass(frozen=True)
class ExportedSession:
    session_id: str
    weights_version: int
    tokens: list[int]
    blob: bytes


def _bad_blob(message: str) -> ApiError:
    return ApiError(400, "bad_session_blob", message)


async def export_session(scheduler: Scheduler, session_id: str) -> ExportedSession:
    table = scheduler.sessions
    session = table.get(session_id)
    if session is not None and session.busy:  # its first turn too: the session exists once that one is done
        raise ApiError(429, "session_busy", f"a turn is in flight on session {session_id!r}; retry after it completes",
                       headers={"Retry-After": "1"})
    if session is None or not any(s.tokens for s in session.slots):
        raise ApiError(404, "session_not_found", f"no live session {session_id!r}")
    slot = max((s for s in session.slots if s.tokens), key=lambda s: s.last_used)
    tokens = list(slot.tokens)
    anchor = min(slot.anchor, len(tokens))
    # A recurrent model's next turn resumes from its last checkpoint at or before the anchor (where the prompts
    # diverge is at or past it): that one goes in the blob, not every checkpoint the slot keeps (each is the
    # whole recurrent state, ~100 MB for the largest hybrids).
    resume = max((c for c in slot.checkpoints if 0 < c.n_tokens <= anchor), key=lambda c: c.n_tokens, default=None)
    checkpoints = [resume] if resume is not None else []
    served = scheduler.served
    model = served.model
    slot.busy = slot.exporting = True
    try:
        def serialize() -> bytes:
            arrays = model.read_slot(scheduler.state, slot.index, len(tokens))
            for j, checkpoint in enumerate(checkpoints):
                arrays += [(f"checkpoint{j}.{name}", a) for name, a in model.checkpoint_arrays(checkpoint)]
            return snapshot.encode(snapshot.Snapshot(served.architecture, model.state_dims(), served.weights_version,
                                                     tokens, arrays, [c.n_tokens for c in checkpoints], anchor))

        blob = await trio.to_thread.run_sync(serialize)
    except MemoryError:
        raise ApiError(500, "server_error", "out of memory while serializing the session") from None
    finally:
        slot.busy = slot.exporting = False
        scheduler.poke()  # a turn may be waiting for this slot
    return ExportedSession(session_id, served.weights_version, tokens, blob)


async def restore_session(scheduler: Scheduler, session_id: str, blob: bytes, tokens: list[int]) -> int:
    """Validate everything first (a rejected restore changes no live state), then install."""
    served = scheduler.served
    model = served.model

    def parse() -> snapshot.Snapshot:
        snap = snapshot.decode(blob, architecture=served.architecture, dims=model.state_dims(),
                               weights_version=served.weights_version)
        return snapshot.in_precision(snap, model.state_dtype)

    try:
        snap = await trio.to_thread.run_sync(parse)
    except snapshot.WeightsMismatch as exc:
        raise ApiError(409, "weights_version_mismatch", f"{exc}; replay the conversation instead") from None
    except snapshot.BadBlob as exc:
        raise _bad_blob(str(exc)) from None
    if snap.tokens != tokens:
        raise _bad_blob(f"the request's tokens ({len(tokens)}) disagree with the blob's ({len(snap.tokens)})")
    n = len(tokens)
    if n == 0:
        raise _bad_blob("the blob holds no tokens")
    if n >= scheduler.kv_cap:
        raise _bad_blob(f"the blob holds {n} tokens; this model's context window is {scheduler.kv_cap}")
    expected = model.slot_layout(n)
    n_state = len(expected)  # the state arrays come first, then each checkpoint's
    if snap.checkpoints:
        if not hasattr(model, "checkpoint_layout"):
            raise _bad_blob("the blob has recurrent-state checkpoints; this model keeps none")
        for j in range(len(snap.checkpoints)):
            expected += [(f"checkpoint{j}.{name}", shape) for name, shape in model.checkpoint_layout()]
    got = [(name, tuple(a.shape)) for name, a in snap.arrays]
    if got != expected or any(a.dtype.kind != "f" for _, a in snap.arrays):
        raise _bad_blob("the blob's state arrays do not fit this model")
    state_arrays = snap.arrays[:n_state]
    checkpoints = []
    for j, at in enumerate(snap.checkpoints):
        prefix = f"checkpoint{j}."
        part = [(name[len(prefix):], a) for name, a in snap.arrays[n_state:] if name.startswith(prefix)]
        checkpoints.append(model.checkpoint_from_arrays(at, part))

    if any(t < 0 or t >= model.vocab_size for t in tokens):
        raise _bad_blob("the blob's tokens are outside this model's vocabulary")
    slot = scheduler.sessions.install(session_id, tokens)
    if slot is None:
        raise ApiError(429, "model_at_session_capacity", "no free session slot to restore into",
                       headers={"Retry-After": "30"})

    def write() -> None:
        # The arrays are in this model's state precision already (`in_precision`: a blob saved with another,
        # float32 vs float16 by PANTHEON_CPU_INT8 or another backend, was converted in `parse`).
        model.write_slot(scheduler.state, slot.index, state_arrays, n)

    try:
        # On the forward thread, between steps: a decode step already running may still write (and drop) a
        # token for a turn that ended meanwhile, in a slot that `install` may just have picked.
        await scheduler.forward_thread.run(write)
    except BaseException:
        scheduler.sessions.finish(slot, keep=False)
        raise
    slot.tokens[:] = tokens
    # As the exporting slot had them: the next turn of the conversation repeats its history up to the anchor,
    # and a recurrent model resumes from the last checkpoint before the point where the prompts diverge.
    slot.checkpoints = checkpoints
    if snap.anchor is not None:
        slot.anchor = snap.anchor
    scheduler.sessions.finish(slot)
    return n
