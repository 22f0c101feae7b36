"""A Prometheus histogram for the edge's per-token observations (the gap between two tokens of a stream).

prometheus-client's ``Histogram.observe`` takes a lock twice and scans its buckets in Python: ~1.5 us, and
the edge observes up to three series per token per stream (pdserve's TBT and vLLM's TPOT and ITL). Here a
series is a list of bucket counts and a sum, observed with one ``bisect`` and no lock, by the one thread
that observes it (the event loop), and a series that shares another's buckets shares its bucket index
(``observe_both``). Scrapes may run on another thread: they read plain ints and a float (an observation
may land between reading the sum and the buckets, as with prometheus-client's own histograms). The
exposition is prometheus-client's: ``_bucket`` (cumulative, ``le`` last), ``_count``, ``_sum`` and
``_created``.
"""

from __future__ import annotations

import time
from bisect import bisect_left
from collections.abc import Iterator, Sequence

from prometheus_client import CollectorRegistry
from prometheus_client.core import HistogramMetricFamily, Metric
from prometheus_client.registry import Collector
from prometheus_client.samples import Sample
from prometheus_client.utils import floatToGoString


class LoopSeries:
    """One labelled series: observed from one thread only."""

    __slots__ = ("bounds", "counts", "created", "sum")

    def __init__(self, bounds: list[float]) -> None:
        self.bounds = bounds
        self.counts = [0] * (len(bounds) + 1)  # NOTE: the last one is +Inf's own
        self.sum = 0.0
        self.created = time.time()

    def observe(self, value: float) -> None:
        self.counts[bisect_left(self.bounds, value)] += 1
        self.sum += value

    def observe_both(self, other: LoopSeries, value: float) -> None:
        """``observe(value)`` here and on ``other``, a series with the same buckets."""
        i = bisect_left(self.bounds, value)
        self.counts[i] += 1
        self.sum += value
        other.counts[i] += 1
        other.sum += value


class LoopHistogram(Collector):
    """A histogram family of :class:`LoopSeries`, registered in ``registry`` like prometheus-client's."""

    def __init__(
        self,
        name: str,
        documentation: str,
        labelnames: Sequence[str],
        buckets: Sequence[float],
        registry: CollectorRegistry,
    ) -> None:
        bounds = [float(b) for b in buckets]
        if bounds != sorted(bounds) or len(set(bounds)) != len(bounds) or not bounds:
            raise ValueError(f"{name}: buckets must be increasing, got {buckets!r}")
        if bounds[-1] == float("inf"):
            bounds.pop()
        self.name, self.documentation = name, documentation
        self.labelnames = tuple(labelnames)
        self.bounds = bounds
        self._series: dict[tuple[str, ...], LoopSeries] = {}
        registry.register(self)

    def labels(self, *values: str) -> LoopSeries:
        if len(values) != len(self.labelnames):
            raise ValueError(f"{self.name}: expected labels {self.labelnames}, got {values!r}")
        series = self._series.get(values)
        if series is None:
            series = self._series[values] = LoopSeries(self.bounds)
        return series

    def collect(self) -> Iterator[Metric]:
        family = HistogramMetricFamily(self.name, self.documentation, labels=self.labelnames)
        les = [floatToGoString(b) for b in self.bounds] + ["+Inf"]
        for values, series in list(self._series.items()):
            counts, total = list(series.counts), series.sum
            cumulative, acc = [], 0.0
            for le, n in zip(les, counts, strict=True):
                acc += n
                cumulative.append((le, acc))
            family.add_metric(list(values), cumulative, total)
            labels = dict(zip(self.labelnames, values, strict=True))
            family.samples.append(Sample(self.name + "_created", labels, series.created))
        yield family
