"""Every pdserve metric, defined once, in one dedicated prometheus-client registry.

Two sources feed it:

* the HTTP server calls the small observation API below (``observe_first_token``, ``observe_token_gap``,
  ``observe_finished``, ``observe_error``) as it sees token deltas;
* a custom collector turns ``router.worker_stats()`` (a cached snapshot, cheap) into per-worker gauges
  and counters at scrape time, so nothing polls the workers on the metrics path (the host KV tier's
  among them: hits by tier, occupancy, blocks and bytes offloaded and loaded); another turns the
  router's routing decisions (``router.route_decisions()``) and the latest live advice into
  ``pdserve_route_decisions_total{mode,reason}`` and the ``pdserve_advice_*`` gauges.

Names carry the ``pdserve_`` prefix and every series a ``model_name`` label (the served name), as
vLLM's do. Counters are declared without ``_total``; the exposition adds it. Counters whose children a
dashboard sums (errors by status and code, requests by finish reason) are created at zero up front, so
a healthy cluster's error panels read 0, not "No data". ``compat="vllm"`` also exports the ``vllm:*``
names whose meaning pdserve shares (``cluster/http/metrics_vllm.py``).
The registry is never the global one, so two apps in one process (tests) never collide.
This module imports no torch and nothing of the project beyond ``cluster.protocol``.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from cluster.http.loop_histogram import LoopHistogram
from cluster.http.metrics_vllm import VllmMetrics, vllm_worker_metrics
from cluster.protocol import ErrorCode, FinishReason, RequestTimings, WorkerStats

logger = logging.getLogger(__name__)

# NOTE: one bucket set spans GPU decode steps (sub-ms) and CPU prefill of long prompts (tens of s):
# roughly 1-2.5-5 per decade from 0.5 ms to 120 s, 22 buckets.
LATENCY_BUCKETS: tuple[float, ...] = (
    0.0005,
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.075,
    0.1,
    0.15,
    0.25,
    0.5,
    0.75,
    1.0,
    1.5,
    2.5,
    5.0,
    10.0,
    20.0,
    40.0,
    80.0,
    120.0,
)

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
COMPAT_MODES = ("none", "vllm")
# (HTTP status, code) pairs the edge answers with; created at 0 so error panels never read "No data".
KNOWN_ERRORS: tuple[tuple[int, str], ...] = (
    (400, "invalid_request"),
    (400, "context_length_exceeded"),
    (400, ErrorCode.STRUCTURED_OUTPUT_TOO_COMPLEX.value),
    (401, "invalid_api_key"),
    (404, "model_not_found"),
    (413, "request_too_large"),
    (429, ErrorCode.QUEUE_FULL.value),
    (429, ErrorCode.SLO_UNATTAINABLE.value),
    (429, "key_requests_limit"),
    (429, "key_tokens_limit"),
    (499, ErrorCode.ABORTED.value),
    (499, "client_disconnected"),
    (499, "stream_stalled"),
    (500, ErrorCode.INTERNAL.value),
    (500, ErrorCode.WORKER_FAILED.value),
    (500, ErrorCode.KV_TRANSFER_FAILED.value),
    (503, ErrorCode.UNAVAILABLE.value),
    (504, ErrorCode.DEADLINE_EXCEEDED.value),
)

StatsSource = Callable[[], Sequence[WorkerStats]]
RejectedSource = Callable[[], dict[str, int]]
RouteSource = Callable[[], Mapping[tuple[str, str], int]]
AdviceSource = Callable[[], Mapping[str, Any] | None]
ADVICE_POOLS = ("prefill", "decode", "colocated")


class RouterCollector(Collector):
    """Scrape-time view of the router's decisions: routing decisions by (mode, reason) as a counter, and
    the latest live advice (deploy/planner/advice.py) as gauges: the predicted SLO attainment of the
    recommended and of the running configuration, and the recommended workers per pool."""

    def __init__(self, routes: RouteSource | None, advice: AdviceSource | None, model_name: str) -> None:
        self.routes, self.advice, self.model_name = routes, advice, model_name

    def collect(self) -> Iterator[Metric]:
        if self.routes is not None:
            counter = CounterMetricFamily(
                "pdserve_route_decisions",
                "Routing decisions by mode (colocated | disaggregated | conditional) and reason",
                labels=["model_name", "mode", "reason"],
            )
            for (mode, reason), count in sorted(self.routes().items()):
                counter.add_metric([self.model_name, mode, reason], float(count))
            yield counter
        if self.advice is None:
            return
        advice = self.advice()
        attainment = GaugeMetricFamily(
            "pdserve_advice_slo_attainment",
            "Live advice: the planner's predicted SLO attainment over the recent traffic (role: recommended"
            " or current configuration)",
            labels=["model_name", "role", "configuration"],
        )
        workers = GaugeMetricFamily(
            "pdserve_advice_recommended_workers",
            "Live advice: workers per pool in the configuration the planner recommends",
            labels=["model_name", "pool"],
        )
        if advice is not None:
            for role in ("recommended", "current"):
                label, value = advice.get(role), advice.get(f"{role}_slo_attainment")
                if isinstance(label, str) and isinstance(value, (int, float)):
                    attainment.add_metric([self.model_name, role, label], float(value))
            for pool in ADVICE_POOLS:
                num = advice.get(f"recommended_{pool}")
                if isinstance(num, int):
                    workers.add_metric([self.model_name, pool], float(num))
        yield attainment
        yield workers


class WorkerStatsCollector(Collector):
    """Scrape-time view of ``WorkerStats`` snapshots: gauges and counters labelled worker + pool.

    A failing stats source yields no worker metrics for that scrape instead of failing the scrape.
    """

    GAUGES: tuple[tuple[str, str, Callable[[WorkerStats], float]], ...] = (
        (
            "pdserve_worker_healthy",
            "1 if the worker's heartbeat is fresh and all its threads live, else 0",
            lambda s: float(s.healthy),
        ),
        (
            "pdserve_num_requests_running",
            "Requests in the worker's running batch",
            lambda s: s.engine.num_running,
        ),
        ("pdserve_num_requests_waiting", "Requests queued in the worker", lambda s: s.engine.num_waiting),
        (
            "pdserve_num_requests_waiting_for_kv",
            "Decode-side requests waiting for their KV transfer",
            lambda s: s.num_waiting_for_kv,
        ),
        ("pdserve_kv_cache_usage_ratio", "Fraction of usable KV blocks in use", lambda s: s.engine.kv_usage),
        ("pdserve_kv_cache_free_blocks", "Free KV blocks", lambda s: s.engine.num_free_blocks),
        ("pdserve_kv_cache_total_blocks", "Usable KV blocks", lambda s: s.engine.num_total_blocks),
        (
            "pdserve_kv_host_cache_total_blocks",
            "Blocks of the worker's host-memory KV tier (0: no tier)",
            lambda s: s.engine.num_host_blocks,
        ),
        (
            "pdserve_kv_host_cache_used_blocks",
            "Host-tier blocks holding a cached block",
            lambda s: s.engine.num_host_blocks_used,
        ),
        (
            "pdserve_kv_host_cache_usage_ratio",
            "Fraction of the host tier's blocks holding a cached block (0 without a tier)",
            lambda s: s.engine.num_host_blocks_used / max(1, s.engine.num_host_blocks),
        ),
        (
            "pdserve_kv_host_load_cost_ratio",
            "A host-tier block's copy time over its tokens' prefill time, as the worker measured them "
            "(>= 1: recomputed, not loaded; -1: not measured or no tier); the router weighs host hits by it",
            lambda s: s.engine.host_load_cost,
        ),
    )
    COUNTERS: tuple[tuple[str, str, Callable[[WorkerStats], float]], ...] = (
        ("pdserve_preemptions", "Requests preempted (recompute)", lambda s: s.engine.num_preemptions),
        (
            "pdserve_prefix_cache_queries",
            "Prompt tokens looked up in the prefix cache",
            lambda s: s.engine.prefix_cache_queries,
        ),
        (
            "pdserve_prefix_cache_hits",
            "Prompt tokens found in the prefix cache (either tier)",
            lambda s: s.engine.prefix_cache_hits,
        ),
        (
            "pdserve_prefix_cache_host_hits",
            "Prompt tokens found in the host tier (loaded back; included in pdserve_prefix_cache_hits)",
            lambda s: s.engine.prefix_cache_host_hits,
        ),
        (
            "pdserve_kv_offloaded_blocks",
            "KV blocks copied device -> host tier",
            lambda s: s.engine.kv_offloaded_blocks,
        ),
        (
            "pdserve_kv_loaded_blocks",
            "KV blocks copied host tier -> device",
            lambda s: s.engine.kv_loaded_blocks,
        ),
        (
            "pdserve_kv_offloaded_bytes",
            "KV bytes copied device -> host tier (summed over ranks)",
            lambda s: s.engine.kv_offloaded_bytes,
        ),
        (
            "pdserve_kv_loaded_bytes",
            "KV bytes copied host tier -> device (summed over ranks)",
            lambda s: s.engine.kv_loaded_bytes,
        ),
        (
            "pdserve_kv_pulled_blocks",
            "Prefix KV blocks pulled from another worker's cache instead of recomputed",
            lambda s: s.num_pulled_blocks,
        ),
        (
            "pdserve_kv_pulled_bytes",
            "Prefix KV bytes pulled from other workers",
            lambda s: s.num_pulled_bytes,
        ),
        (
            "pdserve_kv_pull_failures",
            "Prefix pulls that failed or found nothing to take (the prompt computed as usual)",
            lambda s: s.num_pull_failures,
        ),
        ("pdserve_kv_transfer_bytes", "KV bytes moved by this worker", lambda s: s.transfer.bytes_total),
        ("pdserve_kv_transfer_seconds", "Seconds spent moving KV", lambda s: s.transfer.seconds_total),
        ("pdserve_kv_transfers", "KV handoffs completed", lambda s: s.transfer.num_ok),
    )

    def __init__(
        self,
        source: StatsSource,
        router_rejected: RejectedSource | None = None,
        model_name: str = "",
        compat: str = "none",
    ) -> None:
        self.source = source
        self.router_rejected = router_rejected
        self.model_name = model_name
        self.compat = compat

    def collect(self) -> Iterator[Metric]:
        try:
            stats = list(self.source())
        except Exception:  # NOTE: a broken stats source must not take the whole scrape down.
            logger.exception("worker_stats() failed during a /metrics scrape")
            return
        labels = ["model_name", "worker", "pool"]
        for name, doc, get in self.GAUGES:
            gauge = GaugeMetricFamily(name, doc, labels=labels)
            for s in stats:
                gauge.add_metric([self.model_name, s.worker_id, s.pool], float(get(s)))
            yield gauge
        for name, doc, get in self.COUNTERS:
            counter = CounterMetricFamily(name, doc, labels=labels)
            for s in stats:
                counter.add_metric([self.model_name, s.worker_id, s.pool], float(get(s)))
            yield counter
        yield self._rejected(stats)
        if self.compat == "vllm":
            yield from vllm_worker_metrics(stats, self.model_name)

    def _rejected(self, stats: list[WorkerStats]) -> Metric:
        counter = CounterMetricFamily(
            "pdserve_control_messages_rejected",
            "Control frames dropped (bad MAC, malformed, replayed, unknown tag, ...) by receiver and reason",
            labels=["model_name", "worker", "reason"],
        )
        sources = [(s.worker_id, s.rejected_frames) for s in stats]
        if self.router_rejected is not None:
            sources.append(("router", self.router_rejected()))
        for worker, rejected in sources:
            for reason, count in sorted(rejected.items()):
                counter.add_metric([self.model_name, worker, reason], float(count))
        return counter


class Metrics:
    """The server-side metrics of one cluster; ``render()`` is the /metrics body.

    ``mode`` labels the latency histograms ("disaggregated" | "colocated" | "conditional") so one
    dashboard compares runs of different modes; ``model_name`` labels every series. ``mode`` given
    here pre-creates the per-mode request counters at 0.
    """

    def __init__(
        self,
        stats_source: StatsSource | None = None,
        router_rejected: RejectedSource | None = None,
        *,
        model_name: str = "",
        mode: str | None = None,
        compat: str = "none",
        route_decisions: RouteSource | None = None,
        advice: AdviceSource | None = None,
    ) -> None:
        if compat not in COMPAT_MODES:
            raise ValueError(f"metrics compat must be one of {COMPAT_MODES}, got {compat!r}")
        self.registry = CollectorRegistry(auto_describe=True)
        self.model_name = model_name
        self.vllm = VllmMetrics(self.registry, model_name) if compat == "vllm" else None

        def histogram(name: str, doc: str) -> Histogram:
            return Histogram(
                name, doc, ["model_name", "mode"], buckets=LATENCY_BUCKETS, registry=self.registry
            )

        self.ttft = histogram("pdserve_time_to_first_token_seconds", "Server arrival -> first token delta")
        # NOTE: observed per token per stream, from the event loop only: a lock-free histogram
        self.tbt = LoopHistogram(
            "pdserve_time_between_tokens_seconds",
            "Gap between token deltas of one request",
            ["model_name", "mode"],
            LATENCY_BUCKETS,
            self.registry,
        )
        self.e2e = histogram("pdserve_e2e_request_latency_seconds", "Server arrival -> last token delta")
        self.queue = histogram("pdserve_queue_time_seconds", "Router arrival -> a worker computes it")
        self.prefill = histogram("pdserve_prefill_time_seconds", "Prefill compute until the first token")
        self.transfer = histogram("pdserve_kv_transfer_time_seconds", "KV handoff of one request")
        self.decode = histogram("pdserve_decode_time_seconds", "First token -> finish")
        self.prompt_tokens = Counter(
            "pdserve_prompt_tokens",
            "Prompt tokens of finished requests",
            ["model_name", "mode"],
            registry=self.registry,
        )
        self.generation_tokens = Counter(
            "pdserve_generation_tokens",
            "Generated tokens streamed to clients",
            ["model_name", "mode"],
            registry=self.registry,
        )
        self.cached_tokens = Counter(
            "pdserve_cached_prompt_tokens",
            "Prompt tokens served from a prefix cache",
            ["model_name", "mode"],
            registry=self.registry,
        )
        self.requests = Counter(
            "pdserve_requests",
            "Finished requests by finish reason",
            ["model_name", "finish_reason", "mode"],
            registry=self.registry,
        )
        self.errors = Counter(
            "pdserve_request_errors",
            "Requests answered with an error, by HTTP status",
            ["model_name", "status", "code"],
            registry=self.registry,
        )
        for status, code in KNOWN_ERRORS:
            self.errors.labels(model_name, str(status), code)
        if mode is not None:
            for reason in FinishReason:
                self.requests.labels(model_name, reason.value, mode)
            for counter in (self.prompt_tokens, self.generation_tokens, self.cached_tokens):
                counter.labels(model_name, mode)
        if stats_source is not None:
            self.registry.register(WorkerStatsCollector(stats_source, router_rejected, model_name, compat))
        if route_decisions is not None or advice is not None:
            self.registry.register(RouterCollector(route_decisions, advice, model_name))

    def observe_first_token(self, ttft_s: float, mode: str) -> None:
        self.ttft.labels(self.model_name, mode).observe(ttft_s)
        if self.vllm is not None:
            self.vllm.ttft.labels(self.model_name).observe(ttft_s)

    def observe_token_gap(self, gap_s: float, mode: str) -> None:
        self.token_gap_observer(mode)(gap_s)

    def token_gap_observer(self, mode: str) -> Callable[[float], None]:
        """``observe_token_gap`` for one ``mode``, its series looked up once (a stream observes a gap per
        token: the label lookups cost more than the observations). Call it on the event loop only
        (``LoopHistogram``)."""
        tbt = self.tbt.labels(self.model_name, mode)
        if self.vllm is None:
            return tbt.observe
        tpot, itl = self.vllm.tpot.labels(self.model_name), self.vllm.itl.labels(self.model_name)
        observe_tbt, observe_vllm = tbt.observe, tpot.observe_both

        def observe(gap_s: float) -> None:
            observe_tbt(gap_s)
            observe_vllm(itl, gap_s)

        return observe

    def observe_finished(
        self,
        timings: RequestTimings | None,
        finish_reason: str,
        mode: str,
        *,
        e2e_s: float,
        num_prompt_tokens: int,
        num_generation_tokens: int,
        num_cached_tokens: int = 0,
    ) -> None:
        """Record one finished router request: e2e as the server saw it, the router's phase split."""
        name = self.model_name
        self.e2e.labels(name, mode).observe(e2e_s)
        if timings is not None:
            self.queue.labels(name, mode).observe(timings.queue_s)
            self.prefill.labels(name, mode).observe(timings.prefill_s)
            self.decode.labels(name, mode).observe(timings.decode_s)
            # NOTE: colocated requests (and conditional-mode requests that skipped the handoff) move
            # no KV; recording their zeros would drag the transfer quantiles to 0.
            if timings.transfer_s > 0.0:
                self.transfer.labels(name, mode).observe(timings.transfer_s)
        self.prompt_tokens.labels(name, mode).inc(num_prompt_tokens)
        self.generation_tokens.labels(name, mode).inc(num_generation_tokens)
        self.cached_tokens.labels(name, mode).inc(num_cached_tokens)
        self.requests.labels(name, finish_reason, mode).inc()
        if self.vllm is not None:
            self.vllm.observe_finished(
                timings, finish_reason, e2e_s, num_prompt_tokens, num_generation_tokens
            )

    def observe_group(self, generation_tokens: list[int]) -> None:
        """One client request (n choices x prompts) finished every choice."""
        if self.vllm is not None and generation_tokens:
            self.vllm.max_generation_tokens.labels(self.model_name).observe(max(generation_tokens))

    def observe_abort(self, mode: str) -> None:
        """A request abandoned before it finished (client gone, a sibling choice failed)."""
        self.requests.labels(self.model_name, FinishReason.ABORT.value, mode).inc()
        if self.vllm is not None:
            self.vllm.success.labels(self.model_name, FinishReason.ABORT.value).inc()

    def observe_error(self, status: int, code: str) -> None:
        self.errors.labels(self.model_name, str(status), code).inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)
