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


class _Scheduler:
    concurrency_cap = 8
    ctx_window_configured = 4096

    def apply_limits(self, concurrency: int, window: int, critical: bool) -> None:
        self.limits = (concurrency, window, critical)


class _Instance:
    def __init__(self, dies: tuple[int, ...], on_accelerator: bool) -> None:
        self.dies, self.on_accelerator, self.scheduler = dies, on_accelerator, _Scheduler()


def test_a_model_on_dies_follows_its_dies_ladders_and_a_host_model_the_hosts() -> None:
    from pantheon.http.server import apply_memory_limits
    from pantheon.sched.memory import MemoryWatch

    watch = MemoryWatch(15, 8, 4)
    watch.host.update(reading(50))
    watch.update_die(0, reading(10))  # elevated
    watch.update_die(1, reading(3))  # critical
    host, on_0, on_0_1, not_probed = (_Instance((), False), _Instance((0,), True), _Instance((0, 1), True),
                                      _Instance((2,), True))
    apply_memory_limits([host, on_0, on_0_1, not_probed], watch)
    assert host.scheduler.limits == (8, 4096, False)
    assert on_0.scheduler.limits == (4, 4096, False)
    assert on_0_1.scheduler.limits == (1, 2048, True)  # the worse of its two dies
    assert not_probed.scheduler.limits == (8, 4096, False)  # no reading for die 2 yet: the host's ladder
    watch.host.update(reading(3))
    apply_memory_limits([host, on_0], watch)
    assert host.scheduler.limits == (1, 2048, True) and on_0.scheduler.limits == (4, 4096, False)
