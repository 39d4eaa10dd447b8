"""Sessions that survive a restart (`--session-dir DIR`).

A draining server writes each live session of each model as `DIR/<model>/<id>.pnsess` (the session blob
of engine/snapshot.py; the file name is the id in base64url), atomically: temp file, fsync, rename, then the
directory is fsynced. A model loaded at start or through POST /admin/models/load loads every file of its
folder back; a file that is corrupt (or whose name is no session id) is logged and renamed to `*.rejected`;
one it cannot take now (other weights, no free session slot, a window too small for it, an unreadable or
special file) is logged and kept for a later start. None of this is fatal. A save removes only the files this
process restored whose session is gone (released, reaped): another server's files in a shared folder, and
the ones it could not take, stay. An unload saves the model's sessions as a shutdown does.

Guarantee: a clean shutdown (SIGTERM / Ctrl-C) keeps every session's most recent conversation as of the
end of the drain (an id holding two conversations keeps the one used last; a second signal exits at once,
saving nothing). A killed server (SIGKILL, power loss) restarts from the files of the previous clean
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
    for stale in instance.session_files - written:  # restored here, and the session is gone since
        (directory / stale).unlink(missing_ok=True)
    instance.session_files = written
    await trio.to_thread.run_sync(_fsync_dir, directory)
    return len(written)


def check_session_dir(root: Path) -> None:
    """Raise OSError unless `root` is (or can be made) a folder this process can write: checked at start, so
    that a folder no save could write is the operator's error then, not sessions lost at the next shutdown."""
    root.mkdir(parents=True, exist_ok=True)
    probe = root / f".probe{os.getpid()}"
    probe.write_bytes(b"")
    probe.unlink()


async def load_sessions(instance: ModelInstance, root: Path) -> int:
    directory = _model_dir(root, instance)
    if not directory.is_dir():
        return 0
    for path in sorted(directory.glob("*" + SUFFIX)):
        try:
            reject = await _load_file(instance, path)
        except OSError as exc:  # unreadable: kept for a later start
            log.warning("%s: skipping session file %s: %s", instance.name, path.name, exc)
            continue
        if reject is not None:
            log.warning("%s: rejecting session file %s: %s", instance.name, path.name, reject)
            try:
                path.rename(path.with_name(path.name + ".rejected"))
            except OSError as exc:  # a read-only folder: the file stays, skipped again next time
                log.warning("%s: could not rename %s: %s", instance.name, path.name, exc)
    if instance.session_files:
        log.info("%s: restored %d session(s) from %s", instance.name, len(instance.session_files), directory)
    return len(instance.session_files)


async def _load_file(instance: ModelInstance, path: Path) -> str | None:
    """Restore one file's session; the reason to reject the file for good (corrupt, no session id), or None
    (restored, or skipped with a warning for a reason that may pass: a special file, other weights, no room)."""
    session_id = _session_id(path)
    if session_id is None:
        return "file name is not a session id"
    if not path.is_file():  # a folder, a dangling link, a FIFO (whose read would wait for a writer)
        log.warning("%s: skipping %s: not a regular file", instance.name, path.name)
        return None
    served = instance.served
    blob = await trio.to_thread.run_sync(path.read_bytes)
    try:
        snap = await trio.to_thread.run_sync(lambda: snapshot.decode(
            blob, architecture=served.architecture, dims=served.model.state_dims(),
            weights_version=served.weights_version))
        await session_ops.restore_session(instance.scheduler, session_id, blob, snap.tokens)
    except snapshot.BadBlob as exc:
        return str(exc)
    except (snapshot.WeightsMismatch, ApiError) as exc:
        why = exc.message if isinstance(exc, ApiError) else str(exc)
        log.warning("%s: skipping session file %s for now: %s", instance.name, path.name, why)
        return None
    instance.session_files.add(path.name)
    return None
