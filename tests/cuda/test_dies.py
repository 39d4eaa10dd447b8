"""The die manager on described dies (a fake probe) and on this machine's real driver probe (none here)."""

from __future__ import annotations

import pytest

from pantheon.kernels.cuda.dies import DieBudgetExceeded, DieInfo, DieManager, driver_probe

GiB = 1 << 30


def k80_and_one() -> list[DieInfo]:
    """Two dies on one board (shared board group) and a single-die card."""
    return [DieInfo(0, "Tesla K80", 12 * GiB, 7, "0000:05:00.0"), DieInfo(1, "Tesla K80", 12 * GiB, 7, "0000:06:00.0"),
            DieInfo(2, "H200", 140 * GiB, 9, "0000:41:00.0")]


def test_no_driver_means_zero_dies_without_raising():
    # This machine has cuda-bindings but no NVIDIA driver: the probe must come back empty, not raise.
    assert isinstance(driver_probe(), list)
    manager = DieManager.probe(reserve_bytes=GiB, environ={})
    assert manager.count() == len(driver_probe())


def test_empty_cuda_visible_devices_skips_the_driver():
    def probe():
        raise AssertionError("the driver must not be asked")

    for value in ("", "-1", " "):
        assert DieManager.probe(environ={"CUDA_VISIBLE_DEVICES": value}, probe=probe).count() == 0


def test_a_failing_probe_gives_zero_dies():
    def probe():
        raise RuntimeError("driver exploded")

    assert DieManager.probe(environ={}, probe=probe).count() == 0


def test_cards_budgets_and_status():
    manager = DieManager.probe(reserve_bytes=GiB, environ={"CUDA_VISIBLE_DEVICES": "3,4,5"}, probe=k80_and_one)
    assert manager.count() == 3
    assert [manager.card_of(d) for d in range(3)] == [0, 0, 1]
    assert manager.budget(0) == 11 * GiB and manager.budget(2) == 139 * GiB
    assert manager.status() == [
        {"die": 0, "card": 0, "vram_budget": 11 * GiB, "vram_used": 0},
        {"die": 1, "card": 0, "vram_budget": 11 * GiB, "vram_used": 0},
        {"die": 2, "card": 1, "vram_budget": 139 * GiB, "vram_used": 0},
    ]
    with pytest.raises(IndexError):
        manager.budget(3)


def test_charges_are_per_owner_and_bounded_by_the_budget():
    manager = DieManager(k80_and_one(), reserve_bytes=GiB)
    manager.charge(0, "a", 4 * GiB)
    manager.charge(0, "b", 6 * GiB)
    assert manager.used(0) == 10 * GiB and manager.owners(0) == {"a": 4 * GiB, "b": 6 * GiB}
    with pytest.raises(DieBudgetExceeded) as info:
        manager.charge(0, "a", 2 * GiB)
    assert isinstance(info.value, MemoryError)  # the model manager maps MemoryError to 507
    assert manager.used(0) == 10 * GiB  # a refused charge leaves nothing behind
    manager.release(0, "a", GiB)
    assert manager.owners(0)["a"] == 3 * GiB
    manager.release(0, "b")
    assert manager.used(0) == 3 * GiB and manager.used(1) == 0
    manager.release(0, "a", 5 * GiB)  # releasing more than charged clears the owner
    assert manager.owners(0) == {}


def test_a_dies_memory_reading_for_the_ladder():
    """The driver's free memory beyond the reserve; where the driver cannot be read (or raises), the budget
    less what models were charged."""
    answers = {0: (30 * GiB, 140 * GiB), 1: None}

    def memory(ordinal):
        if ordinal == 2:
            raise RuntimeError("driver error")
        return answers[ordinal]

    dies = [DieInfo(i, "H200", 140 * GiB, i, "") for i in range(3)]
    manager = DieManager(dies, reserve_bytes=2 * GiB, memory_probe=memory)
    assert manager.memory(0) == (28 * GiB, 138 * GiB)
    manager.charge(1, "m", 100 * GiB)
    assert manager.memory(1) == (38 * GiB, 138 * GiB)
    assert manager.memory(2) == (138 * GiB, 138 * GiB)
    with pytest.raises(IndexError):
        manager.memory(3)
