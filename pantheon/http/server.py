"""The serving process: one trio run, one root nursery holding hypercorn, the schedulers and the signal
watch. SIGINT/SIGTERM start a drain (new completions get 503, running ones finish within the deadline),
then the root scope is cancelled; a second signal exits at once."""

from __future__ import annotations

import logging
import os
import signal
import sys
from functools import partial
from typing import Any

import trio
from hypercorn.config import Config as HypercornConfig
from hypercorn.trio import serve as hypercorn_serve

from pantheon.buildinfo import compiled_backend
from pantheon.config import EnvKnobs, ServeOptions
from pantheon.errors import ApiError, ModelLoadError
from pantheon.http import fastsend, http11, protocol_errors
from pantheon.http.app import App, ServerState
from pantheon.metrics import standard_metrics
from pantheon.sched.manager import ModelManager
from pantheon.sched.registry import Registry
from pantheon.sched.memory import MemoryReading, MemoryWatch, read_meminfo

log = logging.getLogger("pantheon")

DEADLINE_FLUSH_S = 5.0  # after the drain deadline: how long ended turns get to send their last chunks


def make_backend(options: ServeOptions) -> Any:
    from pantheon.kernels.cpu.backend import CpuBackend

    return CpuBackend(threads=options.resolved_threads, int8=options.env.cpu_int8)


async def _watch_memory(state: ServerState, env: EnvKnobs) -> None:
    """The memory-pressure ladders: poll host memory (and each die's, on the cuda backend), clamp every
    scheduler's slots and window by the ladder of the memory its state lives in."""
    watch = MemoryWatch(env.mem_elevated_pct, env.mem_high_pct, env.mem_critical_pct)
    die_manager = state.manager.die_manager if state.manager is not None else None
    while True:
        try:
            reading = read_meminfo(env.meminfo_path)
        except (OSError, ValueError):
            reading = None  # unreadable: keep the last level
        if reading is not None:
            before = watch.host.level
            level = state.memory_level = watch.host.update(reading)
            if level != before:
                log.warning("memory pressure level %d -> %d (%.1f%% available)", before, level,
                            reading.available_pct)
        if die_manager is not None:
            for die in sorted({d for i in state.registry.instances if i.on_accelerator for d in i.dies}):
                before = watch.dies[die].level if die in watch.dies else 0
                die_reading = MemoryReading(*die_manager.memory(die))
                if watch.update_die(die, die_reading) != before:
                    log.warning("die %d memory pressure level %d -> %d (%.1f%% available)", die, before,
                                watch.dies[die].level, die_reading.available_pct)
        apply_memory_limits(state.registry.instances, watch)
        await trio.sleep(env.mem_poll_ms / 1000.0)


def apply_memory_limits(instances: list[Any], watch: MemoryWatch) -> None:
    for instance in instances:
        ladder = watch.ladder_for(instance.dies, instance.on_accelerator)
        s = instance.scheduler
        s.apply_limits(ladder.concurrency(s.concurrency_cap), ladder.window(s.ctx_window_configured),
                       ladder.critical)


async def _reap_sessions(registry: Registry, env: EnvKnobs) -> None:
    # Often enough that a session outlives its TTL by at most a quarter of it (capped at 30 s).
    interval = min(30.0, max(0.05, env.session_idle_ttl_ms / 4000.0))
    while True:
        await trio.sleep(interval)
        for instance in registry.instances:
            for session_id in instance.scheduler.sessions.reap():
                log.info("%s: session %s reaped after idling past its TTL", instance.name, session_id)


def _hypercorn_config(options: ServeOptions) -> HypercornConfig:
    config = HypercornConfig()
    config.bind = [f"{options.host}:{options.port}"]
    config.accesslog = None
    config.errorlog = logging.getLogger("hypercorn.error")
    config.graceful_timeout = 1.0  # our own drain has already waited for in-flight turns
    config.keep_alive_timeout = 5.0
    return config


def _idle(registry: Registry) -> bool:
    """No turn running or queued, and no request routed to a model still preparing one (`handling`)."""
    return not any(i.busy for i in registry.instances)


async def _drain(state: ServerState, options: ServeOptions, shutdown: trio.Event) -> None:
    """Refuse new completions, let in-flight and queued turns finish within the deadline, save sessions."""
    state.draining = True
    with trio.move_on_after(options.drain_timeout_s):
        while not _idle(state.registry):
            await trio.sleep(0.05)
    if not _idle(state.registry):
        # The deadline: end what still runs as a stop would, and give the streams a moment to send their
        # closing chunks before the HTTP server stops.
        log.warning("drain deadline: ending the turns still running")
        for instance in state.registry.instances:
            instance.scheduler.end_turns_now()
        with trio.move_on_after(DEADLINE_FLUSH_S):
            while not _idle(state.registry):
                await trio.sleep(0.05)
    await state.manager.save_all_sessions()
    for instance in state.registry.instances:
        instance.scheduler.stopping.set()  # open watches end with a last comment, not a cut connection
    shutdown.set()


async def _watch_signals(state: ServerState, options: ServeOptions, shutdown: trio.Event) -> None:
    with trio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
        async with trio.open_nursery() as nursery:
            async for signum in signals:
                if state.draining:
                    log.warning("second signal: exiting now")
                    sys.stderr.flush()
                    os._exit(1)
                log.warning("%s: draining (deadline %.0f s)", signal.Signals(signum).name, options.drain_timeout_s)
                nursery.start_soon(_drain, state, options, shutdown)


async def serve(options: ServeOptions, *, task_status: trio.TaskStatus[list[str]] = trio.TASK_STATUS_IGNORED) -> None:
    env = options.env
    backend = make_backend(options)
    registry = Registry()
    metrics = standard_metrics()
    die_manager = None
    if compiled_backend() == "cuda":
        from pantheon.kernels.cuda.dies import DieManager

        die_manager = DieManager.probe(env.die_reserve_bytes)  # 0 dies without a driver: serve on the host
    manager = ModelManager(registry, env, backend, die_manager=die_manager, metrics=metrics,
                           session_dir=options.session_dir)
    state = ServerState(registry=registry, env=env, backend=compiled_backend(), manager=manager, metrics=metrics,
                        dies_visible=manager.dies_visible)
    app = App(state)
    shutdown = trio.Event()
    async with trio.open_nursery() as root:
        await root.start(manager.run)
        for model_options in options.models:
            log.info("loading %s from %s", model_options.name, model_options.path)
            try:
                await manager.load(model_options)  # its sessions restored from --session-dir
            except ApiError as exc:
                raise ModelLoadError(exc.message) from None
        root.start_soon(_watch_signals, state, options, shutdown)
        root.start_soon(_watch_memory, state, env)
        root.start_soon(_reap_sessions, registry, env)
        if not fastsend.install():
            log.info("hypercorn's TCPServer.protocol_send not found: socket writes take hypercorn's own road")
        if not protocol_errors.install():
            log.info("hypercorn's H11Protocol._send_error_response not found: its own error answers stay bare")
        if not http11.install():
            log.info("hypercorn's H11Protocol steps not found: it may upgrade to HTTP/2 or websockets")
        async with trio.open_nursery() as http:
            binds = await http.start(partial(hypercorn_serve, app, _hypercorn_config(options),
                                             shutdown_trigger=shutdown.wait))
            for instance in registry.instances:
                log.info("serving %s (ctx %d) on %s", instance.name, instance.scheduler.kv_cap, ", ".join(binds))
            task_status.started(binds)
        # hypercorn returned: it stopped accepting and its graceful window is over. End everything else.
        root.cancel_scope.cancel()
