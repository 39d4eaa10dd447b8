"""The session routes' model lookup (`session_routes._instance`), without a server."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest

from pantheon.errors import ApiError
from pantheon.http.session_routes import _instance
from pantheon.sched.registry import Registry


def registry_of(*instances: Any) -> Registry:
    registry = Registry()
    for instance in instances:
        registry.add(instance)
    return registry


@pytest.mark.parametrize("name", [None, "", "smol"])
def test_with_nothing_serving_the_error_says_no_model_is_loaded(name: str | None) -> None:
    """Nothing loaded, or the only model unloading: 404 model_not_found saying so (it once read "model None is
    not loaded" while a model unloaded)."""
    for registry in (registry_of(), registry_of(SimpleNamespace(name="smol", unloading=True))):
        with pytest.raises(ApiError) as caught:
            _instance(registry, name)
        assert (caught.value.status, caught.value.error_type) == (404, "model_not_found")
        assert caught.value.message == "no model is loaded"


def test_an_unknown_name_is_named_and_a_known_one_found() -> None:
    smol = SimpleNamespace(name="smol", unloading=False)
    registry = registry_of(smol)
    assert _instance(registry, "smol") is smol and _instance(registry, None) is smol
    with pytest.raises(ApiError) as caught:
        _instance(registry, "other")
    assert caught.value.status == 404 and caught.value.message == "model 'other' is not loaded"
