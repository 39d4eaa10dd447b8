"""The memory-pressure ladder: read host memory, step serving capacity down under pressure and back up.

Levels (available memory as a share of the total, thresholds from config):
  0 normal    everything as configured
  1 elevated  below mem_elevated_pct: decode slots halved
  2 high      below mem_high_pct: one decode slot, the context window halved
  3 critical  below mem_critical_pct: as 2, and a request that finds the queue full, or opens a new
              session, is refused with 503 server_memory_constrained (instead of 429)
A level is left only when available memory is back above its threshold plus a 2-point margin, so a reading
that hovers at a threshold does not flap.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

RECOVERY_MARGIN_PCT = 2.0
MIN_WINDOW = 256


@dataclass(frozen=True)
class MemoryReading:
    available_bytes: int
    total_bytes: int

    @property
    def available_pct(self) -> float:
        return 100.0 * self.available_bytes / self.total_bytes if self.total_bytes else 100.0


def read_meminfo(path: Path) -> MemoryReading:
    values: dict[str, int] = {}
    for line in path.read_text().splitlines():
        key, _, rest = line.partition(":")
        parts = rest.split()
        if parts:
            values[key.strip()] = int(parts[0]) * (1024 if len(parts) > 1 and parts[1] == "kB" else 1)
    total = values.get("MemTotal", 0)
    available = values.get("MemAvailable", values.get("MemFree", total))
    return MemoryReading(available, total)


class MemoryLadder:
    def __init__(self, elevated_pct: float, high_pct: float, critical_pct: float) -> None:
        self.thresholds = (elevated_pct, high_pct, critical_pct)
        self.level = 0

    def update(self, reading: MemoryReading) -> int:
        pct = reading.available_pct
        target = sum(1 for t in self.thresholds if pct < t)
        if target > self.level:
            self.level = target
        else:
            # Step up only past the margin: the level we are in must clear its threshold + margin.
            while self.level > target and pct >= self.thresholds[self.level - 1] + RECOVERY_MARGIN_PCT:
                self.level -= 1
        return self.level

    def concurrency(self, configured: int) -> int:
        if self.level == 0:
            return configured
        if self.level == 1:
            return max(1, configured // 2)
        return 1

    def window(self, configured: int) -> int:
        if self.level < 2:
            return configured
        return max(min(MIN_WINDOW, configured), configured // 2)

    @property
    def critical(self) -> bool:
        return self.level >= 3


class MemoryWatch:
    """The host's ladder and one ladder per die. A model whose forward passes run on dies (its KV rings and
    state live there) follows the worst of its dies' ladders; a model on the host follows the host's."""

    def __init__(self, elevated_pct: float, high_pct: float, critical_pct: float) -> None:
        self._thresholds = (elevated_pct, high_pct, critical_pct)
        self.host = MemoryLadder(*self._thresholds)
        self.dies: dict[int, MemoryLadder] = {}

    def update_die(self, die: int, reading: MemoryReading) -> int:
        return self.dies.setdefault(die, MemoryLadder(*self._thresholds)).update(reading)

    def ladder_for(self, dies: tuple[int, ...], on_accelerator: bool) -> MemoryLadder:
        ladders = [self.dies[d] for d in dies if d in self.dies] if on_accelerator else []
        return max(ladders, key=lambda ladder: ladder.level) if ladders else self.host
