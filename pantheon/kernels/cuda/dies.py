"""The die manager: which accelerator dies this process sees, their VRAM budget and what has been charged to them.

A die is one CUDA device as the driver enumerates it, so ordinals are relative to CUDA_VISIBLE_DEVICES (the
driver applies it; an empty value means no dies, and is honoured without touching the driver). A die's budget is
its total memory minus PN_DIE_RESERVE_BYTES. `card` groups dies that sit on one board (multi-GPU boards such as
the K80 report a shared board group id); on single-die cards it is the die's own index among cards.

Probing never raises: no cuda-bindings, no driver, no device or a driver error all give 0 dies. The probe is a
parameter so tests (and the simulator) can describe whatever dies they like.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class DieInfo:
    ordinal: int  # CUDA_VISIBLE_DEVICES-relative device ordinal
    name: str
    total_bytes: int
    board_group: int  # dies with the same value share a physical card
    pci_bus_id: str = ""


class DieBudgetExceeded(MemoryError):
    """A charge would take a die past its budget."""


Probe = Callable[[], Sequence[DieInfo]]
MemoryProbe = Callable[[int], "tuple[int, int] | None"]  # ordinal -> (free, total) bytes, None if unreadable


def _visible_devices_empty(environ: Mapping[str, str]) -> bool:
    raw = environ.get("CUDA_VISIBLE_DEVICES")
    return raw is not None and raw.strip() in {"", "-1", "NoDevFiles"}


def driver_probe() -> list[DieInfo]:
    """Dies as the CUDA driver reports them; [] when cuda-bindings, the driver or a device is missing."""
    try:
        from cuda.bindings import driver as cu
    except Exception:  # cuda-bindings absent or broken: a cpu install
        return []

    def check(result: tuple[Any, ...]) -> Any:
        err, *values = result
        if err != cu.CUresult.CUDA_SUCCESS:
            raise RuntimeError(f"CUDA driver error {err}")
        return values[0] if len(values) == 1 else values

    try:
        check(cu.cuInit(0))
        dies = []
        for ordinal in range(int(check(cu.cuDeviceGetCount()))):
            dev = check(cu.cuDeviceGet(ordinal))
            name = check(cu.cuDeviceGetName(128, dev))
            total = int(check(cu.cuDeviceTotalMem(dev)))
            group = int(check(cu.cuDeviceGetAttribute(
                cu.CUdevice_attribute.CU_DEVICE_ATTRIBUTE_MULTI_GPU_BOARD_GROUP_ID, dev)))
            bus = check(cu.cuDeviceGetPCIBusId(32, dev))
            dies.append(DieInfo(ordinal, _text(name), total, group, _text(bus)))
        return dies
    except Exception:  # no driver library (DynamicLibNotFoundError), no device, or any driver failure
        return []


def driver_memory_probe(ordinal: int) -> tuple[int, int] | None:
    """(free, total) bytes of a die as the driver reports them (cuMemGetInfo in its primary context, which a
    model on that die has already made); None on any failure. Not exercised without a GPU."""
    try:
        from cuda.bindings import driver as cu

        ok = cu.CUresult.CUDA_SUCCESS
        err, dev = cu.cuDeviceGet(ordinal)
        if err != ok:
            return None
        err, ctx = cu.cuDevicePrimaryCtxRetain(dev)
        if err != ok:
            return None
        try:
            if cu.cuCtxPushCurrent(ctx)[0] != ok:
                return None
            try:
                err, free, total = cu.cuMemGetInfo()
            finally:
                cu.cuCtxPopCurrent()
            return (int(free), int(total)) if err == ok else None
        finally:
            cu.cuDevicePrimaryCtxRelease(dev)
    except Exception:
        return None


def _text(raw: Any) -> str:
    if isinstance(raw, (bytes, bytearray)):
        return raw.split(b"\0", 1)[0].decode(errors="replace")
    return str(raw)


class DieManager:
    """Dies, their budgets and per-owner charges. Thread-safe: loads run in worker threads."""

    def __init__(self, dies: Sequence[DieInfo], reserve_bytes: int = 0,
                 memory_probe: MemoryProbe = driver_memory_probe) -> None:
        self._dies = sorted(dies, key=lambda d: d.ordinal)
        self.reserve_bytes = max(0, int(reserve_bytes))
        self._memory_probe = memory_probe
        cards: dict[int, int] = {}
        self._card = [cards.setdefault(d.board_group, len(cards)) for d in self._dies]
        self._charges: list[dict[str, int]] = [{} for _ in self._dies]
        self._lock = threading.Lock()

    @classmethod
    def probe(cls, reserve_bytes: int = 0, environ: Mapping[str, str] | None = None,
              probe: Probe | None = None, memory_probe: MemoryProbe = driver_memory_probe) -> "DieManager":
        """The dies this process can use. Never raises; 0 dies when there is no driver or device."""
        environ = os.environ if environ is None else environ
        if _visible_devices_empty(environ):
            return cls([], reserve_bytes, memory_probe)
        try:
            dies = list((probe or driver_probe)())
        except Exception:
            dies = []
        return cls(dies, reserve_bytes, memory_probe)

    # -- queries -------------------------------------------------------------------------------------------
    def count(self) -> int:
        """`dies_visible`."""
        return len(self._dies)

    def info(self, die: int) -> DieInfo:
        return self._dies[self._index(die)]

    def card_of(self, die: int) -> int:
        return self._card[self._index(die)]

    def budget(self, die: int) -> int:
        return max(0, self.info(die).total_bytes - self.reserve_bytes)

    def used(self, die: int) -> int:
        with self._lock:
            return sum(self._charges[self._index(die)].values())

    def owners(self, die: int) -> dict[str, int]:
        with self._lock:
            return dict(self._charges[self._index(die)])

    def memory(self, die: int) -> tuple[int, int]:
        """(available, total) bytes of a die for the memory ladder: the driver's free memory beyond the reserve,
        of the die's total less the reserve; where the driver cannot be read, the budget less what models
        were charged. Never raises for a visible die."""
        info = self.info(die)
        reading = None
        try:
            reading = self._memory_probe(info.ordinal)
        except Exception:
            reading = None
        budget = self.budget(die)
        if reading is None:
            return max(0, budget - self.used(die)), budget
        free, total = reading
        return max(0, int(free) - self.reserve_bytes), max(0, int(total) - self.reserve_bytes)

    def status(self) -> list[dict[str, Any]]:
        """One row per die: die, card, vram_budget, vram_used (the model columns are the model manager's)."""
        return [{"die": i, "card": self._card[i], "vram_budget": self.budget(i), "vram_used": self.used(i)}
                for i in range(len(self._dies))]

    # -- accounting ----------------------------------------------------------------------------------------
    def charge(self, die: int, owner: str, nbytes: int) -> None:
        """Charge nbytes to owner on die; raises DieBudgetExceeded (a MemoryError) past the budget."""
        index = self._index(die)
        budget = self.budget(die)
        with self._lock:
            charges = self._charges[index]
            used = sum(charges.values())
            if used + nbytes > budget:
                raise DieBudgetExceeded(
                    f"die {die} has {budget - used} of {budget} bytes left, {nbytes} more were asked for")
            charges[owner] = charges.get(owner, 0) + int(nbytes)

    def release(self, die: int, owner: str, nbytes: int | None = None) -> None:
        """Give back nbytes of owner's charge on die (all of it when nbytes is None)."""
        index = self._index(die)
        with self._lock:
            charges = self._charges[index]
            left = 0 if nbytes is None else charges.get(owner, 0) - int(nbytes)
            if left > 0:
                charges[owner] = left
            else:
                charges.pop(owner, None)

    def _index(self, die: int) -> int:
        if not 0 <= die < len(self._dies):
            raise IndexError(f"die {die} is not visible (this process sees {len(self._dies)})")
        return die


__all__ = ["DieBudgetExceeded", "DieInfo", "DieManager", "driver_memory_probe", "driver_probe"]
