"""The lock-free per-token histogram exposes exactly what prometheus-client's Histogram does."""

from __future__ import annotations

import re

import pytest
from prometheus_client import CollectorRegistry, Histogram, generate_latest

from cluster.http.loop_histogram import LoopHistogram

BUCKETS = (0.001, 0.005, 0.01, 0.1, 1.0)
VALUES = [0.0, 0.0005, 0.001, 0.0010001, 0.004, 0.005, 0.05, 0.1, 0.99, 1.0, 1.5, 1e9]


def _exposition(registry: CollectorRegistry) -> list[str]:
    """The text exposition less the creation timestamps' values."""
    text = generate_latest(registry).decode()
    return [re.sub(r"(_created\{[^}]*\}) \S+", r"\1 T", line) for line in text.splitlines()]


def test_same_exposition_as_prometheus_client() -> None:
    ours, theirs = CollectorRegistry(), CollectorRegistry()
    loop = LoopHistogram("gap_seconds", "A gap", ["model_name", "mode"], BUCKETS, ours)
    reference = Histogram("gap_seconds", "A gap", ["model_name", "mode"], buckets=BUCKETS, registry=theirs)
    for i, v in enumerate(VALUES):
        mode = "a" if i % 3 else "b"
        loop.labels("m", mode).observe(v)
        reference.labels("m", mode).observe(v)
    assert _exposition(ours) == _exposition(theirs)
    assert 'gap_seconds_bucket{le="0.005",mode="a",model_name="m"} 4.0' in _exposition(ours)  # cumulative


def test_observe_both_counts_in_both_series() -> None:
    registry = CollectorRegistry()
    a = LoopHistogram("a_seconds", "a", ["model_name"], BUCKETS, registry).labels("m")
    b = LoopHistogram("b_seconds", "b", ["model_name"], BUCKETS, registry).labels("m")
    for v in VALUES:
        a.observe_both(b, v)
    assert a.counts == b.counts == [3, 3, 0, 2, 2, 2]  # (<= 0.001], (.., 0.005], ..., +Inf
    assert a.sum == b.sum == pytest.approx(sum(VALUES))


def test_bad_buckets_and_labels_are_refused() -> None:
    with pytest.raises(ValueError, match="increasing"):
        LoopHistogram("x_seconds", "x", [], (1.0, 0.5), CollectorRegistry())
    h = LoopHistogram("y_seconds", "y", ["model_name"], BUCKETS, CollectorRegistry())
    with pytest.raises(ValueError, match="expected labels"):
        h.labels("m", "extra")
