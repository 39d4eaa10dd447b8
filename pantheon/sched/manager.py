"""Loading and unloading model instances at runtime (and at start-up, through the same path).

Loads are serialized (one at a time) and run in a worker thread, so serving the other models never stalls.
Each instance's scheduler runs in its own cancel scope inside the root nursery; unloading marks the instance
(new requests no longer route to it), lets its in-flight and queued turns finish, then cancels that scope.

Admission: before an instance is added, its memory need (the weights' bytes plus the sequence state of
every slot at the full context window) is checked against the host budget: MemAvailable minus what the
other instances already claimed, or PN_HOST_BUDGET_BYTES when set.
"""

from __future__ import annotations

import functools
import gc
import logging
import stat
from pathlib import Path
from typing import Any

import trio

from pantheon.config import MAX_MODEL_DIES, EnvKnobs, ModelOptions
from pantheon.engine.loader import LoadedModel, load_served_model, read_model_file
from pantheon.errors import ApiError, ModelLoadError
from pantheon.metrics import Metrics
from pantheon.models.registry import SEGMENTED_ARCHITECTURES
from pantheon.sched.forward_thread import ForwardThread
from pantheon.sched.memory import read_meminfo
from pantheon.sched.persistence import load_sessions, save_sessions
from pantheon.sched.registry import ModelInstance, Registry
from pantheon.sched.scheduler import Scheduler

log = logging.getLogger("pantheon.models")

MAX_INSTANCES = 16


def _refuse_unloadable(path: Path) -> None:
    """404 for a name that is no file (missing, a directory, a name the system refuses as too long); 500 for one
    that exists but is not a regular file (a device, a FIFO, a socket): it is there, but no model can be read
    from it, and opening a FIFO would wait for a writer."""
    try:
        mode = path.stat().st_mode
    except OSError:
        mode = None
    if mode is None or stat.S_ISDIR(mode):
        raise load_failed(404, f"model file not found: {path}")
    if not stat.S_ISREG(mode):
        raise load_failed(500, f"cannot load {path}: not a regular file (a device, FIFO or socket)")


def load_failed(status: int, message: str) -> ApiError:
    return ApiError(status, "load_failed", message)


def slot_count(options: ModelOptions) -> int:
    """Sessions own up to two slots each; stateless turns always find one of max_concurrent more."""
    return 2 * options.resolved_max_sessions + options.resolved_max_concurrent


# How long an unload waits for a cancelled scheduler task to return before it frees what it can.
UNLOAD_TASK_WAIT_S = 5.0


class ModelManager:
    def __init__(self, registry: Registry, env: EnvKnobs, backend: Any, die_manager: Any = None,
                 metrics: Metrics | None = None, session_dir: Path | None = None) -> None:
        self.registry = registry
        # --session-dir: a model's sessions are restored from it when it loads and saved to it when it unloads
        # (and at shutdown, server.py), so an unload and a later load keep them as a restart does.
        self.session_dir = session_dir
        self.metrics = metrics or Metrics()
        self.env = env
        self.backend = backend  # the host (cpu) backend
        self.die_manager = die_manager  # cuda installs: the dies the driver shows (maybe none)
        self.dies_visible = die_manager.count() if die_manager is not None else 0
        self._load_lock = trio.Lock()
        self._nursery: trio.Nursery | None = None
        # One forward thread per backend (see forward_thread.py): every model on the host backend loads and
        # steps on the same thread, so numba keeps a single OpenMP team.
        self._forward_threads: dict[int, ForwardThread] = {}

    async def _save_sessions(self, instance: ModelInstance) -> None:
        assert self.session_dir is not None
        try:
            n = await save_sessions(instance, self.session_dir)
            log.info("%s: saved %d session(s) to %s", instance.name, n, self.session_dir)
        except OSError as exc:
            log.error("%s: could not save sessions: %s", instance.name, exc)

    async def save_all_sessions(self) -> None:
        """At shutdown: every loaded model's live sessions to --session-dir (when set)."""
        if self.session_dir is not None:
            for instance in self.registry.instances:
                await self._save_sessions(instance)

    def _forward_thread(self, backend: Any) -> ForwardThread:
        key = id(backend)
        if key not in self._forward_threads:
            self._forward_threads[key] = ForwardThread()
        return self._forward_threads[key]

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Hosts the instances' scheduler tasks; lives in the root nursery."""
        async with trio.open_nursery() as nursery:
            self._nursery = nursery
            task_status.started()
            await trio.sleep_forever()

    # -- load ----------------------------------------------------------------------------------------------
    def _validate(self, options: ModelOptions) -> None:
        if len(options.dies) > MAX_MODEL_DIES:
            raise ApiError(400, "invalid_request_error", f"at most {MAX_MODEL_DIES} dies per model")
        if options.dies:
            if self.die_manager is None:
                raise load_failed(400, "'dies' needs an accelerator backend; this serve runs on the cpu backend "
                                  "(check `pantheon --backend`, or omit 'dies')")
            bad = [d for d in options.dies if d < 0 or d >= self.dies_visible]
            if bad:
                raise load_failed(400, f"dies {bad} are not visible (this serve sees {self.dies_visible})")
        for inst in self.registry.find_all(options.name):
            if inst.unloading:
                raise load_failed(409, f"model {options.name!r} is unloading")
            if not options.dies or set(options.dies) & set(inst.dies) or not inst.dies:
                # A replica must sit on other dies; on the cpu backend a name is loaded once.
                raise load_failed(409, f"model {options.name!r} is already loaded")
        if len(self.registry.instances) >= MAX_INSTANCES:
            raise load_failed(507, f"the model registry is full ({MAX_INSTANCES} instances)")
        _refuse_unloadable(Path(options.path))

    def _budget_bytes(self) -> int:
        if self.env.host_budget_bytes > 0:
            claimed = sum(i.weights_bytes + i.state_bytes for i in self.registry.instances)
            return self.env.host_budget_bytes - claimed
        try:
            return read_meminfo(self.env.meminfo_path).available_bytes
        except (OSError, ValueError):
            return 1 << 62

    def _backend_for(self, options: ModelOptions) -> Any:
        """The model's die when it names one, its dies' segments when it names several, else the least-used
        visible die, else the host."""
        if self.dies_visible == 0:
            return self.backend
        from pantheon.kernels.cuda import make_backend

        if len(options.dies) > 1:
            from pantheon.kernels.cuda.segments import DieSegments

            return DieSegments([make_backend(die=d, die_manager=self.die_manager, owner=options.name)
                                for d in options.dies])
        die = options.dies[0] if options.dies else min(range(self.dies_visible), key=self.die_manager.used)
        return make_backend(die=die, die_manager=self.die_manager, owner=options.name)

    async def load(self, options: ModelOptions) -> ModelInstance:
        self._validate(options)
        async with self._load_lock:
            self._validate(options)  # again: the registry may have changed while we waited
            try:
                # Reading the file needs no forward thread (see ModelFile): there every other model's decode
                # steps would wait behind it (3.5 s of metadata parsing for a new tiny model on the 2-core VM).
                file = await trio.to_thread.run_sync(read_model_file, options, self.env)
                if len(options.dies) > 1 and file.gguf.architecture not in SEGMENTED_ARCHITECTURES:
                    file.gguf.close()
                    raise load_failed(400, f"a {file.gguf.architecture} model runs on one die: splitting its "
                                      f"layers over several dies is built for {', '.join(SEGMENTED_ARCHITECTURES)} "
                                      f"models only (name one die in 'dies')")
                backend = self._backend_for(options)
                served: LoadedModel = await self._forward_thread(backend).run(
                    functools.partial(load_served_model, side_compile=True), options, self.env, backend, file)
            except FileNotFoundError as exc:
                raise load_failed(404, str(exc)) from None
            except ModelLoadError as exc:
                raise load_failed(500, str(exc)) from None
            except MemoryError:
                raise load_failed(507, "out of memory while loading the model") from None
            except OSError as exc:  # unreadable: no permission, a device or /proc file that refuses reads
                raise load_failed(500, f"cannot read the model file {options.path}: "
                                  f"{exc.strerror or type(exc).__name__}") from None
            except ApiError:
                raise
            except Exception as exc:  # a file the readers choke on in a way they do not name: still the load's
                log.exception("loading %s from %s failed", options.name, options.path)
                raise load_failed(500, f"the model file {options.path} could not be loaded: "
                                  f"{type(exc).__name__}: {exc}") from None
            weights = sum(t.nbytes for t in served.gguf.tensors.values())
            state = served.model.state_bytes(slot_count(options), served.ctx_cap)
            budget = self._budget_bytes()
            if weights + state > budget:
                served.gguf.close()
                raise load_failed(507, f"admission refused: {options.name!r} needs {weights + state} bytes "
                                  f"(weights {weights} + sequence state {state} for "
                                  f"{slot_count(options)} slots x {served.ctx_cap} tokens); {budget} available")
            instance = self._start(served, weights, state, backend)
        log.info("loaded %s from %s (ctx %d, %d bytes)", served.name, options.path, served.ctx_cap, weights + state)
        if self.session_dir is not None:
            await load_sessions(instance, self.session_dir)
        return instance

    def _start(self, served: LoadedModel, weights: int, state: int, backend: Any) -> ModelInstance:
        opts, env = served.options, self.env
        scheduler = Scheduler(served, max_sessions=opts.resolved_max_sessions,
                              max_concurrent=opts.resolved_max_concurrent, queue_depth=env.queue_depth,
                              batched=env.batch_slots, idle_ttl_s=env.session_idle_ttl_ms / 1000.0,
                              metrics=self.metrics, forward_thread=self._forward_thread(backend),
                              stream_interval_s=env.stream_interval_ms / 1000.0)
        dies = opts.dies or ((backend.die,) if backend.accelerator else ())
        instance = ModelInstance(served, scheduler, dies=dies, weights_bytes=weights, state_bytes=state,
                                 backend=backend)
        assert self._nursery is not None, "ModelManager.run is not running"

        async def run_instance() -> None:
            try:
                with instance.cancel_scope:
                    await scheduler.run()
            finally:
                instance.stopped.set()

        self._nursery.start_soon(run_instance)
        self.registry.add(instance)
        return instance

    def die_rows(self) -> list[dict[str, Any]]:
        """`/admin/dies` rows: one per die the die manager holds (none on the cpu backend)."""
        if self.die_manager is None:
            return []
        rows = []
        for die in self.die_manager.status():
            on_die = [i for i in self.registry.instances if die["die"] in i.dies]
            rows.append({"die": die["die"], "card": die["card"],
                         "model": on_die[0].name if on_die else "", "n_models": len(on_die),
                         "vram_budget": die["vram_budget"], "vram_used": die["vram_used"]})
        return rows

    # -- unload --------------------------------------------------------------------------------------------
    async def unload(self, name: str) -> None:
        stopped = await self._stop_instances(name)
        # The instances' objects hold reference cycles (a scheduler and its bound methods, jobs and their
        # completions), which only the cyclic collector frees, and it may not run for a long while: a server
        # that loaded, served and unloaded a model 30 times held every copy (+50 MB a round for a tiny model).
        # Collected here, once their scheduler tasks (cancelled) have returned and nothing here holds them.
        with trio.move_on_after(UNLOAD_TASK_WAIT_S):
            for event in stopped:
                await event.wait()
        gc.collect()
        log.info("unloaded %s", name)

    async def _stop_instances(self, name: str) -> list[trio.Event]:
        """Drain and stop the instances serving `name`; the events their scheduler tasks set on return."""
        instances = self.registry.find_all(name)
        if not instances:
            raise ApiError(404, "unload_failed", f"model {name!r} is not loaded")
        if any(i.unloading for i in instances):
            raise ApiError(409, "unload_failed", f"model {name!r} is already unloading")
        for inst in instances:
            inst.unloading = True
        try:
            while any(i.busy for i in instances):
                await trio.sleep(0.05)
            if self.session_dir is not None:
                for inst in instances:
                    await self._save_sessions(inst)
        finally:
            for inst in instances:
                inst.cancel_scope.cancel()
                self.registry.remove(inst)
                inst.scheduler.release_state()
                inst.served.gguf.close()
                close = getattr(inst.backend, "close", None)
                if close is not None and inst.backend is not self.backend:
                    close()
                    thread = self._forward_threads.pop(id(inst.backend), None)
                    if thread is not None:
                        thread.close()
        return [inst.stopped for inst in instances]
