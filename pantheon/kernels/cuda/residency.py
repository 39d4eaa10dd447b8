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
class _HostRing:
    retry_at: float  # clock time of the next device allocation to try
    attempts: int = 0  # failed retries
    impossible: bool = False  # the die's kernels cannot run its layer: never retried


@dataclass
class AttentionResidency:
    retry: RingRetry = field(default_factory=RingRetry)
    clock: Callable[[], float] = time.monotonic
    ring_alloc_failures: int = 0  # lifetime: device allocations of a ring that failed (first tries and retries)
    host_engagements: int = 0  # lifetime: times a layer started running its attention on the host
    # id(K pool) -> (the pool, to forget layers whose state was released; whether it attends on the host)
    _layers: dict[int, tuple[weakref.ref, bool]] = field(default_factory=dict)
    _host_rings: dict[int, _HostRing] = field(default_factory=dict)  # id(host pool) -> its retry state

    # -- events from the backend ---------------------------------------------------------------------------
    def ring_failed(self, host_pool: Any) -> None:
        """A ring was placed in host memory because the device allocation failed."""
        self.ring_alloc_failures += 1
        self.host_ring(host_pool)

    def host_ring(self, host_pool: Any) -> None:
        """A ring in host memory (failed, or moved there to join its layer's other ring): retried after the
        backoff."""
        self._host_rings[id(host_pool)] = _HostRing(self.clock() + self.retry.backoff_s)

    def impossible_ring(self, host_pool: Any) -> None:
        """A ring kept in host memory because the die's kernels cannot run its layer: never retried."""
        self._host_rings[id(host_pool)] = _HostRing(float("inf"), impossible=True)

    def forget_host_ring(self, host_pool: Any) -> None:
        self._host_rings.pop(id(host_pool), None)

    @property
    def any_host_rings(self) -> bool:
        return bool(self._host_rings)

    def reached(self, k_pool: Any, on_host: bool) -> None:
        """The forward ran a layer's attention (every call; cheap)."""
        key = id(k_pool)
        known = self._layers.get(key)
        if known is None or known[0]() is not k_pool:
            known = None
        if on_host and (known is None or not known[1]):
            self.host_engagements += 1
        if known is None or known[1] != on_host:
            self._layers[key] = (weakref.ref(k_pool), on_host)

    def due_for_retry(self, host_pool: Any) -> bool:
        ring = self._host_rings.get(id(host_pool))
        return ring is None or (not self._gave_up(ring) and self.clock() >= ring.retry_at)

    def retry_failed(self, host_pool: Any) -> None:
        self.ring_alloc_failures += 1
        ring = self._host_rings.setdefault(id(host_pool), _HostRing(0.0))
        ring.attempts += 1
        ring.retry_at = self.clock() + min(self.retry.backoff_max_s, self.retry.backoff_s * 2 ** ring.attempts)

    def moved_to_die(self, host_pool: Any, device_pool: Any) -> None:
        """A host ring's retry succeeded: the layer is now named by its device pool and runs on the die."""
        self._host_rings.pop(id(host_pool), None)
        if self._layers.pop(id(host_pool), None) is not None:
            self._layers[id(device_pool)] = (weakref.ref(device_pool), False)

    def _gave_up(self, ring: _HostRing) -> bool:
        return ring.impossible or ring.attempts >= self.retry.max_attempts

    # -- the spec's object ---------------------------------------------------------------------------------
    def counters(self, operator: bool = False) -> dict[str, Any] | None:
        """`attention` for /v1/models (operator=False) or /admin/models; None before any layer was reached."""
        self._layers = {k: v for k, v in self._layers.items() if v[0]() is not None}
        if not self._layers:
            return None
        host = [self._host_rings.get(key, _HostRing(0.0)) for key, (_, on_host) in self._layers.items() if on_host]
        out: dict[str, Any] = {"ondie": len(self._layers) - len(host), "host": len(host), "total": len(self._layers)}
        if operator:
            impossible = sum(1 for ring in host if ring.impossible)
            out.update(gave_up=sum(1 for ring in host if self._gave_up(ring)) - impossible, impossible=impossible,
                       host_engagements=self.host_engagements, ring_alloc_failures=self.ring_alloc_failures)
            if host:
                reasons: dict[str, int] = {}
                for ring in host:
                    reason = NO_FLASH_KERNELS if ring.impossible else RING_ALLOC_FAILED
                    reasons[reason] = reasons.get(reason, 0) + 1
                out["reasons"] = reasons
        return out


__all__ = ["NO_FLASH_KERNELS", "RING_ALLOC_FAILED", "AttentionResidency", "RingRetry"]
