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
