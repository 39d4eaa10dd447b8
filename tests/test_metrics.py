"""The hand-written Prometheus exposition: histogram buckets are cumulative, a value on a bound counts in it."""

from pantheon.metrics import Metrics


def test_histogram_buckets_are_cumulative_and_bounds_inclusive() -> None:
    m = Metrics()
    for value in (0.001, 0.005, 0.0051, 0.3, 100.0):
        m.observe("lat", value, model="a")
    lines = dict(line.rsplit(" ", 1) for line in m.render().splitlines() if not line.startswith("#"))
    assert lines['lat_bucket{model="a",le="0.005"}'] == "2"  # 0.005 itself is <= 0.005
    assert lines['lat_bucket{model="a",le="0.01"}'] == "3"
    assert lines['lat_bucket{model="a",le="0.25"}'] == "3"
    assert lines['lat_bucket{model="a",le="0.5"}'] == "4"
    assert lines['lat_bucket{model="a",le="60"}'] == "4"  # 100 s is past every bound
    assert lines['lat_bucket{model="a",le="+Inf"}'] == "5" and lines['lat_count{model="a"}'] == "5"
    assert float(lines['lat_sum{model="a"}']) == 0.001 + 0.005 + 0.0051 + 0.3 + 100.0


def test_counters_by_labels() -> None:
    m = Metrics()
    m.inc("hits", route="/", status="200")
    m.inc("hits", 2, status="200", route="/")  # label order does not matter
    m.inc("hits", route="/x", status="404")
    text = m.render()
    assert 'hits{route="/",status="200"} 3' in text and 'hits{route="/x",status="404"} 1' in text
