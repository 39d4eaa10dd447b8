"""Attention residency: which full-attention layers run on the die and which fell back to host softmax.

A layer runs on the die when its KV ring (the layer's K and V pools for every slot) lives in device memory.
When a ring cannot be allocated there (device out of memory, or the die's budget spent), or the die's attention
kernels do not take the layer's head dim (`impossible`, never retried), the backend keeps it in host memory instead and that layer's attention runs on the host, with the same arithmetic in float32, so
the tokens are the same and only speed is lost. The spec's `attention` object is the one place that says so.

A host ring is retried on a bounded backoff (at the start of a forward pass, `CudaBackend.heal_rings`): when
the device allocation succeeds the ring's contents move up and the layer is back on the die; after
`max_attempts` failed retries the layer gives up (`gave_up`) and stays on the host.

Layers are named by their K pool (the model's own array): a layer counts in `total` once the forward has reached
it. Pure Python (no numba), so the bookkeeping is testable anywhere.
"""

from __future__ import annotations

import time
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

# The spec's reason names for a layer that is off the die (these two can happen on this backend).
RING_ALLOC_FAILED = "ring_alloc_failed"
NO_FLASH_KERNELS = "no_flash_kernels"  # the die's attention kernels do not take the layer's head dim


@dataclass
class RingRetry:
    max_attempts: int = 4  # failed device allocations of a host ring before the layer gives up
    backoff_s: float = 1.0  # wait after the first failure; doubles per further failure
    backoff_max_s: float = 60.0


@dataclass
class _Layer:
    pool: weakref.ref  # the layer's K pool, to forget layers whose state was released
    on_host: bool
    reason: str = ""
    attempts: int = 0
    retry_at: float = 0.0
    gave_up: bool = False


@dataclass
class AttentionResidency:
    retry: RingRetry = field(default_factory=RingRetry)
    clock: Callable[[], float] = time.monotonic
    ring_alloc_failures: int = 0  # lifetime: device allocations of a ring that failed (first tries and retries)
    host_engagements: int = 0  # lifetime: times a layer started running its attention on the host
    _layers: dict[int, _Layer] = field(default_factory=dict)
    _host_rings: dict[int, float] = field(default_factory=dict)  # id(host pool) -> first retry time
    _impossible: set[int] = field(default_factory=set)  # id(host pool) of rings no retry can move

    # -- events from the backend ---------------------------------------------------------------------------
    def ring_failed(self, host_pool: Any) -> None:
        """A ring was placed in host memory because the device allocation failed."""
        self.ring_alloc_failures += 1
        self.host_ring(host_pool)

    def host_ring(self, host_pool: Any) -> None:
        """A ring in host memory (failed, or moved there to join its layer's other ring): retried after the
        backoff."""
        self._host_rings[id(host_pool)] = self.clock() + self.retry.backoff_s

    def impossible_ring(self, host_pool: Any) -> None:
        """A ring kept in host memory because the die's kernels cannot run its layer: never retried."""
        self._impossible.add(id(host_pool))

    def forget_host_ring(self, host_pool: Any) -> None:
        self._host_rings.pop(id(host_pool), None)

    def reached(self, k_pool: Any, on_host: bool) -> None:
        """The forward ran a layer's attention (every call; cheap)."""
        key = id(k_pool)
        layer = self._layers.get(key)
        if layer is not None and layer.pool() is k_pool:
            if on_host and not layer.on_host:
                self.host_engagements += 1
            layer.on_host = on_host
            return
        impossible = key in self._impossible
        self._layers[key] = _Layer(weakref.ref(k_pool), on_host, NO_FLASH_KERNELS if impossible else
                                   RING_ALLOC_FAILED if on_host else "", gave_up=impossible)
        if on_host:
            self.host_engagements += 1

    def due_for_retry(self, host_pool: Any) -> bool:
        key = id(host_pool)
        layer = self._layers.get(key)
        if key in self._impossible or (layer is not None and layer.gave_up):
            return False
        return self.clock() >= self._host_rings.get(key, 0.0)

    def retry_failed(self, host_pool: Any) -> None:
        key = id(host_pool)
        self.ring_alloc_failures += 1
        layer = self._layers.get(key)
        attempts = (layer.attempts if layer is not None else 0) + 1
        if layer is not None:
            layer.attempts = attempts
            layer.gave_up = attempts >= self.retry.max_attempts
        delay = min(self.retry.backoff_max_s, self.retry.backoff_s * 2 ** attempts)
        self._host_rings[key] = self.clock() + delay

    def moved_to_die(self, host_pool: Any, device_pool: Any) -> None:
        """A host ring's retry succeeded: the layer is now named by its device pool and runs on the die."""
        self._host_rings.pop(id(host_pool), None)
        layer = self._layers.pop(id(host_pool), None)
        if layer is not None:
            self._layers[id(device_pool)] = _Layer(weakref.ref(device_pool), False)

    # -- the spec's object ---------------------------------------------------------------------------------
    def counters(self, operator: bool = False) -> dict[str, Any] | None:
        """`attention` for /v1/models (operator=False) or /admin/models; None before any layer was reached."""
        live = {k: layer for k, layer in self._layers.items() if layer.pool() is not None}
        self._layers = live
        if not live:
            return None
        host = [layer for layer in live.values() if layer.on_host]
        out: dict[str, Any] = {"ondie": len(live) - len(host), "host": len(host), "total": len(live)}
        if operator:
            impossible = sum(1 for layer in host if layer.reason == NO_FLASH_KERNELS)
            out.update(gave_up=sum(1 for layer in host if layer.gave_up) - impossible, impossible=impossible,
                       host_engagements=self.host_engagements, ring_alloc_failures=self.ring_alloc_failures)
            if host:
                reasons: dict[str, int] = {}
                for layer in host:
                    reasons[layer.reason] = reasons.get(layer.reason, 0) + 1
                out["reasons"] = reasons
        return out


__all__ = ["NO_FLASH_KERNELS", "RING_ALLOC_FAILED", "AttentionResidency", "RingRetry"]
