"""Sessions that survive a restart (`--session-dir DIR`).

A draining server writes each live session of each model as `DIR/<model>/<id>.pnsess` (the session blob
of engine/snapshot.py; the file name is the id in base64url), atomically: temp file, fsync, rename, then the
directory is fsynced. Files of sessions that are no longer live are removed. A starting server loads every
file back after its models are loaded; a file that is corrupt or from other weights is logged and renamed
to `*.rejected`, never fatal.

Guarantee: a clean shutdown (SIGTERM / Ctrl-C) keeps every session's most recent conversation as of the
end of the drain. A killed server (SIGKILL, power loss) restarts from the files of the previous clean
shutdown: writing on every turn would cost ~46 KiB per token of context per turn on the default model (a
4k-token conversation is ~190 MB rewritten after each reply), so it is not done.
"""

from __future__ import annotations

import base64
import logging
import os
from pathlib import Path

import trio

from pantheon.engine import snapshot
from pantheon.errors import ApiError
from pantheon.sched import session_ops
from pantheon.sched.registry import ModelInstance

log = logging.getLogger("pantheon.sessions")
SUFFIX = ".pnsess"


def _file_name(session_id: str) -> str:
    return base64.urlsafe_b64encode(session_id.encode()).decode("ascii") + SUFFIX


def _session_id(path: Path) -> str | None:
    """The id a file name encodes; None unless it is exactly what _file_name would write for a non-empty id."""
    stem = path.name[: -len(SUFFIX)]
    try:
        session_id = base64.urlsafe_b64decode(stem.encode("ascii")).decode()
    except (ValueError, UnicodeDecodeError):
        return None
    if not session_id or _file_name(session_id) != path.name:
        return None
    return session_id


def _model_dir(root: Path, instance: ModelInstance) -> Path:
    return root / base64.urlsafe_b64encode(instance.name.encode()).decode("ascii")


def _write_atomic(path: Path, data: bytes) -> None:
    tmp = path.with_name(path.name + f".tmp{os.getpid()}")
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


async def save_sessions(instance: ModelInstance, root: Path) -> int:
    directory = _model_dir(root, instance)
    await trio.to_thread.run_sync(lambda: directory.mkdir(parents=True, exist_ok=True))
    written: set[str] = set()
    for session_id in instance.scheduler.sessions.live_sessions():
        try:
            exported = await session_ops.export_session(instance.scheduler, session_id)
        except ApiError as exc:
            log.warning("%s: session %s not saved: %s", instance.name, session_id, exc.message)
            continue
        name = _file_name(session_id)
        await trio.to_thread.run_sync(_write_atomic, directory / name, exported.blob)
        written.add(name)
    for stale in directory.glob("*" + SUFFIX):
        if stale.name not in written:
            stale.unlink(missing_ok=True)
    await trio.to_thread.run_sync(_fsync_dir, directory)
    return len(written)


async def load_sessions(instance: ModelInstance, root: Path) -> int:
    directory = _model_dir(root, instance)
    if not directory.is_dir():
        return 0
    loaded = 0
    served = instance.served
    for path in sorted(directory.glob("*" + SUFFIX)):
        session_id = _session_id(path)
        reason = None
        if session_id is None:
            reason = "file name is not a session id"
        else:
            blob = await trio.to_thread.run_sync(path.read_bytes)
            try:
                snap = await trio.to_thread.run_sync(lambda: snapshot.decode(
                    blob, architecture=served.architecture, dims=served.model.state_dims(),
                    weights_version=served.weights_version))
                await session_ops.restore_session(instance.scheduler, session_id, blob, snap.tokens)
                loaded += 1
            except (snapshot.BadBlob, snapshot.WeightsMismatch) as exc:
                reason = str(exc)
            except ApiError as exc:
                reason = exc.message
        if reason is not None:
            log.warning("%s: skipping session file %s: %s", instance.name, path.name, reason)
            path.rename(path.with_name(path.name + ".rejected"))
    if loaded:
        log.info("%s: restored %d session(s) from %s", instance.name, loaded, directory)
    return loaded
