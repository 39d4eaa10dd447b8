"""bench/interference.py's burner: it takes about the share of a core it is asked for, and is gone when switched off;
the loss is read per round against that share."""

from __future__ import annotations

import math
import time

import pytest

from bench.interference import BUSY, QUIET, Burner, loss_over_share


def test_the_burner_takes_its_share_of_a_core_and_stops() -> None:
    burner = Burner(burst_us=6000, period_ms=20)  # 30% of a core
    burner.switch(BUSY)
    proc = burner.proc
    assert proc is not None
    time.sleep(1.5)
    burner.switch(QUIET)
    assert burner.proc is None and proc.poll() is not None
    assert 1.4 <= burner.wall_s <= 3.0
    assert 0.15 <= burner.share <= 0.45
    burner.switch(QUIET)  # switching off twice is harmless
    assert burner.wall_s <= 3.0


def test_loss_is_the_median_of_the_rounds_over_the_share() -> None:
    quiet = [100.0, 200.0, 100.0]
    busy = [90.0, 190.0, 80.0]  # losses 10%, 5%, 20%
    loss, ratio = loss_over_share(quiet, busy, share=0.05)
    assert loss == pytest.approx(0.10)
    assert ratio == pytest.approx(2.0)
    assert math.isnan(loss_over_share(quiet, busy, share=0.0)[1])  # no share measured: no ratio
