from __future__ import annotations

from pathlib import Path

from pantheon.sched.memory import MemoryLadder, MemoryReading, read_meminfo

GIB = 1 << 30


def reading(pct: float) -> MemoryReading:
    return MemoryReading(int(pct / 100 * 100 * GIB), 100 * GIB)


def test_levels_step_down_and_back_up_with_hysteresis() -> None:
    ladder = MemoryLadder(15, 8, 4)
    assert ladder.update(reading(50)) == 0
    assert ladder.update(reading(10)) == 1
    assert ladder.update(reading(3)) == 3
    assert ladder.update(reading(4.5)) == 3  # inside the margin: stays critical
    assert ladder.update(reading(6.5)) == 2
    assert ladder.update(reading(12)) == 1
    assert ladder.update(reading(16)) == 1  # 15 + 2 not yet cleared
    assert ladder.update(reading(17.5)) == 0


def test_clamps_per_level() -> None:
    ladder = MemoryLadder(15, 8, 4)
    assert (ladder.concurrency(8), ladder.window(8192), ladder.critical) == (8, 8192, False)
    ladder.update(reading(10))
    assert (ladder.concurrency(8), ladder.window(8192)) == (4, 8192)
    ladder.update(reading(5))
    assert (ladder.concurrency(8), ladder.window(8192)) == (1, 4096)
    ladder.update(reading(1))
    assert ladder.critical


def test_read_meminfo(tmp_path: Path) -> None:
    f = tmp_path / "meminfo"
    f.write_text("MemTotal:       1000 kB\nMemFree:         100 kB\nMemAvailable:    250 kB\n")
    r = read_meminfo(f)
    assert (r.total_bytes, r.available_bytes, r.available_pct) == (1024000, 256000, 25.0)
