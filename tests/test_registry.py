"""pantheon.sched.registry: which instance a request's `model` value routes to."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from pantheon.errors import ApiError
from pantheon.sched.registry import ModelInstance, Registry


def instance(name: str) -> ModelInstance:
    scheduler = SimpleNamespace(max_concurrent=4, n_active=0, n_waiting=0)
    return ModelInstance(served=SimpleNamespace(name=name), scheduler=scheduler)  # type: ignore[arg-type]


def test_one_served_model_takes_any_name_but_not_one_being_unloaded() -> None:
    registry = Registry()
    kept, going = instance("kept"), instance("going")
    registry.add(kept)
    registry.add(going)
    assert registry.route("going") is going
    with pytest.raises(ApiError) as two:
        registry.route("other")
    assert (two.value.status, two.value.error_type) == (404, "model_not_found")
    going.unloading = True  # draining: "kept" is now the only served model
    assert registry.route(None) is kept and registry.route("anything") is kept
    with pytest.raises(ApiError) as caught:
        registry.route("going")
    assert (caught.value.status, caught.value.error_type) == (404, "model_not_found")
    assert "being unloaded" in caught.value.message


async def test_an_unload_waits_for_requests_routed_before_it(tmp_path) -> None:
    """A request routed to an instance may still be rendering its prompt (a worker thread), not yet a job the
    scheduler knows of: the unload waits for it (`ModelInstance.handling`) instead of stopping the scheduler
    under it, which left the request waiting for ever."""
    import trio

    from pantheon.config import ModelOptions, read_env
    from pantheon.kernels.cpu.backend import CpuBackend
    from pantheon.sched.manager import ModelManager
    from tests.tiny_models import write_tiny_llama

    path = write_tiny_llama(tmp_path / "tiny.gguf", seed=1)
    manager = ModelManager(Registry(), read_env(), CpuBackend(int8=False))
    async with trio.open_nursery() as nursery:
        await nursery.start(manager.run)
        inst = await manager.load(ModelOptions(path=path, name="t"))
        unloaded = trio.Event()

        async def unload() -> None:
            await manager.unload("t")
            unloaded.set()

        with inst.handling():
            assert inst.busy and inst.scheduler.idle
            nursery.start_soon(unload)
            await trio.sleep(0.3)
            assert not unloaded.is_set() and inst.unloading  # new requests no longer route here
            assert not inst.scheduler.closed.is_set()
        with trio.fail_after(5):
            await unloaded.wait()
        assert inst.scheduler.closed.is_set() and not manager.registry.instances
        nursery.cancel_scope.cancel()


def test_the_shutdown_drain_waits_for_requests_still_preparing() -> None:
    """A request routed before SIGTERM may still be rendering its prompt (no job yet): the drain is not idle
    until it is done, or the server would stop under it (a bare 500 to the client)."""
    from pantheon.http.server import _idle

    registry = Registry()
    inst = instance("m")
    inst.scheduler.idle = True  # type: ignore[attr-defined]
    registry.add(inst)
    assert _idle(registry)
    with inst.handling():
        assert not _idle(registry)
    assert _idle(registry)


async def test_an_unloaded_model_is_freed_at_once(tmp_path) -> None:
    """An instance's objects hold reference cycles, which only the cyclic collector frees, and in a server it may
    not run for a long while: 30 load / chat / unload rounds of a tiny model held every copy (+50 MB a round).
    The unload collects them itself."""
    import gc
    import weakref

    import trio

    from pantheon.config import ModelOptions, read_env
    from pantheon.kernels.cpu.backend import CpuBackend
    from pantheon.sched.manager import ModelManager
    from tests.tiny_models import write_tiny_llama

    path = write_tiny_llama(tmp_path / "tiny.gguf", seed=1)
    manager = ModelManager(Registry(), read_env(), CpuBackend(int8=False))
    async with trio.open_nursery() as nursery:
        await nursery.start(manager.run)
        inst = await manager.load(ModelOptions(path=path, name="t"))
        gone = weakref.ref(inst.served.model)
        inst.scheduler.cycle = inst.scheduler  # type: ignore[attr-defined]  # as its bound methods, jobs... make
        del inst
        gc.disable()
        try:
            await manager.unload("t")
            assert gone() is None
        finally:
            gc.enable()
        nursery.cancel_scope.cancel()
