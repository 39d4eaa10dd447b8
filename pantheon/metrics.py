"""Prometheus metrics (text exposition format 0.0.4), written by hand: a few counters, gauges read at scrape
time, and histograms. One `Metrics` object per process, passed to whoever records (no module globals)."""

from __future__ import annotations

import bisect
import itertools
import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)

Labels = tuple[tuple[str, str], ...]


def _labels(labels: Labels) -> str:
    if not labels:
        return ""
    inner = ",".join(f'{k}="{_escape(v)}"' for k, v in labels)
    return "{" + inner + "}"


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def _number(value: float) -> str:
    if math.isinf(value):
        return "+Inf" if value > 0 else "-Inf"
    return repr(float(value)) if not float(value).is_integer() else str(int(value))


@dataclass
class Histogram:
    buckets: tuple[float, ...] = LATENCY_BUCKETS
    # Observations per bucket, not cumulative: one increment per observation (the inter-token latency is
    # observed for every token); `cumulative` gives Prometheus's counts at scrape time.
    counts: list[int] = field(default_factory=list)
    total: float = 0.0
    n: int = 0

    def observe(self, value: float) -> None:
        if not self.counts:
            self.counts = [0] * len(self.buckets)
        i = bisect.bisect_left(self.buckets, value)  # the first bound >= value
        if i < len(self.buckets):
            self.counts[i] += 1
        self.total += value
        self.n += 1

    def cumulative(self) -> list[int]:
        """Observations <= each bound, in bound order."""
        return list(itertools.accumulate(self.counts or [0] * len(self.buckets)))


class Metrics:
    def __init__(self) -> None:
        self._counters: dict[str, dict[Labels, float]] = {}
        self._histograms: dict[str, dict[Labels, Histogram]] = {}
        self._help: dict[str, tuple[str, str]] = {}
        self._gauges: list[Callable[[], Iterable[tuple[str, Labels, float]]]] = []

    def describe(self, name: str, kind: str, text: str) -> None:
        self._help[name] = (kind, text)

    def inc(self, name: str, amount: float = 1.0, **labels: str) -> None:
        series = self._counters.setdefault(name, {})
        key = tuple(sorted(labels.items()))
        series[key] = series.get(key, 0.0) + amount

    def observe(self, name: str, value: float, **labels: str) -> None:
        series = self._histograms.setdefault(name, {})
        series.setdefault(tuple(sorted(labels.items())), Histogram()).observe(value)

    def add_gauges(self, read: Callable[[], Iterable[tuple[str, Labels, float]]]) -> None:
        """`read()` yields (name, labels, value) at every scrape."""
        self._gauges.append(read)

    def render(self) -> str:
        lines: list[str] = []
        gauges: dict[str, list[tuple[Labels, float]]] = {}
        for read in self._gauges:
            for name, labels, value in read():
                gauges.setdefault(name, []).append((labels, value))

        def header(name: str, default_kind: str) -> None:
            kind, text = self._help.get(name, (default_kind, name))
            lines.append(f"# HELP {name} {text}")
            lines.append(f"# TYPE {name} {kind}")

        for name, series in sorted(self._counters.items()):
            header(name, "counter")
            for labels, value in sorted(series.items()):
                lines.append(f"{name}{_labels(labels)} {_number(value)}")
        for name, points in sorted(gauges.items()):
            header(name, "gauge")
            for labels, value in points:
                lines.append(f"{name}{_labels(labels)} {_number(value)}")
        for name, hseries in sorted(self._histograms.items()):
            header(name, "histogram")
            for labels, h in sorted(hseries.items()):
                for bound, count in zip(h.buckets, h.cumulative()):
                    lines.append(f"{name}_bucket{_labels(labels + (('le', _number(bound)),))} {count}")
                lines.append(f"{name}_bucket{_labels(labels + (('le', '+Inf'),))} {h.n}")
                lines.append(f"{name}_sum{_labels(labels)} {_number(h.total)}")
                lines.append(f"{name}_count{_labels(labels)} {h.n}")
        return "\n".join(lines) + "\n"


def standard_metrics() -> Metrics:
    m = Metrics()
    m.describe("pantheon_requests_total", "counter", "HTTP requests by route and status")
    m.describe("pantheon_tokens_prefilled_total", "counter", "prompt tokens computed (not taken from a cache)")
    m.describe("pantheon_tokens_cached_total", "counter", "prompt tokens reused from the prefix cache")
    m.describe("pantheon_tokens_decoded_total", "counter", "tokens generated")
    m.describe("pantheon_time_to_first_token_seconds", "histogram", "from admission request to the first token")
    m.describe("pantheon_inter_token_latency_seconds", "histogram", "between consecutive tokens of a stream")
    m.describe("pantheon_queue_depth", "gauge", "jobs waiting for a decode slot")
    m.describe("pantheon_active_slots", "gauge", "sequences decoding or prefilling now")
    m.describe("pantheon_sessions", "gauge", "live sessions")
    m.describe("pantheon_memory_ladder_level", "gauge", "memory-pressure ladder level (0 normal .. 3 critical)")
    m.describe("pantheon_context_window", "gauge", "effective per-session context window")
    return m
