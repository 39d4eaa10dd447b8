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
from pantheon.config import ServeOptions
from pantheon.engine.loader import load_served_model
from pantheon.http.app import App, ServerState
from pantheon.sched.registry import ModelInstance, Registry
from pantheon.sched.scheduler import Scheduler

log = logging.getLogger("pantheon")


def make_backend(options: ServeOptions) -> Any:
    from pantheon.kernels.cpu.backend import CpuBackend

    return CpuBackend(threads=options.resolved_threads)


def make_instance(loaded: Any, env: Any) -> ModelInstance:
    opts = loaded.options
    max_concurrent = opts.resolved_max_concurrent if env.batch_slots else 1
    n_slots = max(opts.resolved_max_sessions, max_concurrent)
    scheduler = Scheduler(loaded, n_slots=n_slots, max_concurrent=max_concurrent,
                          queue_depth=env.queue_depth if env.batch_slots else 0)
    return ModelInstance(loaded, scheduler)


def _hypercorn_config(options: ServeOptions) -> HypercornConfig:
    config = HypercornConfig()
    config.bind = [f"{options.host}:{options.port}"]
    config.accesslog = None
    config.errorlog = logging.getLogger("hypercorn.error")
    config.graceful_timeout = 1.0  # our own drain has already waited for in-flight turns
    config.keep_alive_timeout = 5.0
    return config


def _idle(registry: Registry) -> bool:
    return all(i.scheduler.n_active == 0 and i.scheduler.n_waiting == 0 for i in registry.instances)


async def _watch_signals(state: ServerState, shutdown: trio.Event, drain_timeout_s: float) -> None:
    with trio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
        async for signum in signals:
            if state.draining:
                log.warning("second signal: exiting now")
                sys.stderr.flush()
                os._exit(1)
            state.draining = True
            log.warning("%s: draining (deadline %.0f s)", signal.Signals(signum).name, drain_timeout_s)
            with trio.move_on_after(drain_timeout_s):
                while not _idle(state.registry):
                    await trio.sleep(0.05)
            shutdown.set()


async def serve(options: ServeOptions, *, task_status: trio.TaskStatus[list[str]] = trio.TASK_STATUS_IGNORED) -> None:
    env = options.env
    backend = make_backend(options)
    registry = Registry()
    for model_options in options.models:
        log.info("loading %s from %s", model_options.name, model_options.path)
        loaded = await trio.to_thread.run_sync(load_served_model, model_options, env, backend)
        registry.add(make_instance(loaded, env))
    state = ServerState(registry=registry, env=env, backend=compiled_backend(), accelerator=backend.accelerator)
    app = App(state)
    shutdown = trio.Event()
    async with trio.open_nursery() as root:
        for instance in registry.instances:
            await root.start(instance.scheduler.run)
        root.start_soon(_watch_signals, state, shutdown, options.drain_timeout_s)
        async with trio.open_nursery() as http:
            binds = await http.start(partial(hypercorn_serve, app, _hypercorn_config(options),
                                             shutdown_trigger=shutdown.wait))
            for instance in registry.instances:
                log.info("serving %s (ctx %d) on %s", instance.name, instance.scheduler.kv_cap, ", ".join(binds))
            task_status.started(binds)
        # hypercorn returned: it stopped accepting and its graceful window is over. End everything else.
        root.cancel_scope.cancel()
