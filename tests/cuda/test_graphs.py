"""CUDA-graph residency bookkeeping through a fake capture layer: warm-up, capture, replay, failure with bounded
retry and backoff, give-up, ineligible slots, and the spec's `graphs` counters."""

from __future__ import annotations

import contextlib

import pytest

from pantheon.kernels.cuda.graphs import (
    CaptureUnsupported,
    GraphResidency,
    RetryPolicy,
    UnsupportedCapture,
)


class FakeCapture:
    """Records what the bookkeeping asks of the driver; `fail_next` makes the next captures fail at `fail_at`."""

    def __init__(self) -> None:
        self.log: list[str] = []
        self.capturing = False
        self.fail_next = 0
        self.fail_at = "end"
        self.fail_launch = False
        self.graphs = 0
        self.deferred = 0

    def _maybe_fail(self, stage: str) -> None:
        if self.fail_next and self.fail_at == stage:
            self.fail_next -= 1
            raise RuntimeError(f"CUDA_ERROR_STREAM_CAPTURE_INVALIDATED at {stage}")

    def begin(self, stream, body):
        self.log.append("begin")
        self._maybe_fail("begin")
        self.capturing = True

    def end(self, stream):
        self.log.append("end")
        self.capturing = False
        self._maybe_fail("end")
        self.graphs += 1
        return f"graph{self.graphs}"

    def instantiate(self, graph, stream):
        self.log.append("instantiate")
        self._maybe_fail("instantiate")
        return f"exec-{graph}"

    def launch(self, executable, stream):
        self.log.append(f"launch {executable}")
        if self.fail_launch:
            raise RuntimeError("launch failed")

    def destroy(self, graph, executable):
        self.log.append(f"destroy {graph} {executable}")

    def deferred_cleanup(self):
        self.deferred += 1
        return contextlib.nullcontext()


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


class Body:
    """The direct kernel launches of a slot: counts real runs and runs under capture."""

    def __init__(self, capture: FakeCapture) -> None:
        self.capture = capture
        self.direct = 0
        self.captured = 0

    def __call__(self) -> None:
        if self.capture.capturing:
            self.captured += 1
        else:
            self.direct += 1


def make(policy: RetryPolicy | None = None):
    capture, clock = FakeCapture(), Clock()
    residency = GraphResidency(capture, policy or RetryPolicy(warmup_runs=1, max_attempts=3, backoff_s=1.0), clock)
    return residency, capture, clock, Body(capture)


def test_nothing_reported_before_a_slot_runs():
    residency, *_ = make()
    residency.slot(("attn", 0), "batched_attn")
    assert residency.summary() is None and residency.counters() is None


def test_warm_up_then_capture_then_replay():
    residency, capture, _, body = make()
    assert residency.run(0, "batched_attn", body, "s") is False  # warm-up: direct
    assert residency.summary() == {"live": 0, "total": 1, "failed": 0, "ineligible": 0, "pending": 1}
    assert residency.run(0, "batched_attn", body, "s") is True  # captured, then launched
    assert capture.log == ["begin", "end", "instantiate", "launch exec-graph1"]
    assert capture.deferred == 1
    assert residency.run(0, "batched_attn", body, "s") is True  # replay: the body is not called
    assert (body.direct, body.captured) == (1, 1)
    assert residency.counters() == {"live": 1, "total": 1, "failed": 0, "ineligible": 0, "pending": 0, "gave_up": 0,
                                    "captures": 1, "capture_failures": 0,
                                    "batched_attn": {"live": 1, "total": 1, "failed": 0, "ineligible": 0,
                                                     "pending": 0}}


@pytest.mark.parametrize("stage", ["begin", "end", "instantiate"])
def test_a_failed_capture_falls_back_and_retries_after_a_backoff(stage):
    residency, capture, clock, body = make()
    residency.run(0, "batched_ssm", body, "s")
    capture.fail_next, capture.fail_at = 1, stage
    assert residency.run(0, "batched_ssm", body, "s") is False
    assert body.direct == 2  # the work still ran, directly
    if stage != "begin":
        assert "end" in capture.log  # a started capture is always ended
    assert residency.summary() == {"live": 0, "total": 1, "failed": 1, "ineligible": 0, "pending": 0}
    assert residency.run(0, "batched_ssm", body, "s") is False  # inside the backoff: no new attempt
    assert capture.log.count("begin") == 1
    clock.now += 1.0
    assert residency.run(0, "batched_ssm", body, "s") is True  # retried and healed
    counters = residency.counters()
    assert counters["live"] == 1 and counters["failed"] == 0
    assert counters["captures"] == 1 and counters["capture_failures"] == 1


def test_the_retry_budget_is_bounded_and_backoff_doubles():
    residency, capture, clock, body = make()
    residency.run(0, "single_ssm", body, "s")
    capture.fail_next, capture.fail_at = 10, "end"
    residency.run(0, "single_ssm", body, "s")  # attempt 1, retry in 1 s
    clock.now += 1.5
    residency.run(0, "single_ssm", body, "s")  # attempt 2, retry in 2 s
    clock.now += 1.5
    residency.run(0, "single_ssm", body, "s")  # too early
    assert capture.log.count("begin") == 2
    clock.now += 1.0
    residency.run(0, "single_ssm", body, "s")  # attempt 3: budget spent
    clock.now += 1000
    residency.run(0, "single_ssm", body, "s")
    assert capture.log.count("begin") == 3
    assert residency.summary() == {"live": 0, "total": 1, "failed": 1, "ineligible": 0, "pending": 0, "gave_up": 1}
    assert residency.counters()["capture_failures"] == 3
    assert body.direct == 6 and body.captured == 3


def test_a_failing_replay_goes_back_to_direct_launches():
    residency, capture, clock, body = make()
    residency.run(0, "segment", body, "s")
    residency.run(0, "segment", body, "s")
    capture.fail_launch = True
    assert residency.run(0, "segment", body, "s") is False
    assert body.direct == 2
    assert "destroy graph1 exec-graph1" in capture.log
    assert residency.summary()["failed"] == 1


def test_ineligible_slots_and_unsupported_capture():
    residency, capture, _, body = make()
    residency.mark_ineligible(1, "batched_ssm", "needs the grouped MoE kernel")
    for _ in range(3):
        residency.run(1, "batched_ssm", body, "s")
    assert capture.log == [] and body.direct == 3
    unsupported = GraphResidency(UnsupportedCapture("simulator"), RetryPolicy(warmup_runs=0))
    assert unsupported.run(0, "batched_attn", body, "s") is False
    assert unsupported.summary() == {"live": 0, "total": 1, "failed": 0, "ineligible": 1, "pending": 0}
    with pytest.raises(CaptureUnsupported):
        UnsupportedCapture("x").begin("s", lambda: None)


def test_total_counts_only_exercised_slots_and_classes():
    residency, _, _, body = make()
    for layer in range(3):
        residency.slot(("attn", layer), "batched_attn")
        residency.slot(("single", layer), "single_ssm")  # declared, never run
    for layer in range(3):
        residency.run(("attn", layer), "batched_attn", body, "s")
        residency.run(("attn", layer), "batched_attn", body, "s")
    counters = residency.counters()
    assert counters["total"] == 3 and counters["live"] == 3
    assert "single_ssm" not in counters and "batched_ssm" not in counters
    residency.invalidate()
    assert residency.summary() == {"live": 0, "total": 3, "failed": 0, "ineligible": 0, "pending": 3}
    with pytest.raises(ValueError):
        residency.slot("x", "no_such_class")


def test_an_error_in_the_body_still_ends_the_capture_and_propagates():
    residency, capture, _, _ = make()

    def broken():
        raise ValueError("bad shapes")

    with pytest.raises(ValueError):
        residency.run(0, "batched_attn", broken, "s")  # warm-up run: direct, raises
    with pytest.raises(ValueError):
        residency.run(0, "batched_attn", broken, "s")  # capture attempt ends the capture, then the direct run raises
    assert capture.log[:2] == ["begin", "end"]
    assert not capture.capturing
