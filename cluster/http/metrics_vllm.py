"""``--metrics-compat vllm``: the ``vllm:*`` metric names whose meaning pdserve shares, beside its own.

With these, vLLM's published Grafana dashboard (which selects ``model_name`` from
``label_values({__name__=~"vllm:.*"}, model_name)``) works on a pdserve cluster unchanged. Each maps
to what pdserve measures:

- request-level (HTTP edge, labelled ``model_name``): ``vllm:time_to_first_token_seconds``,
  ``vllm:time_per_output_token_seconds`` and ``vllm:inter_token_latency_seconds`` (the gap between
  token deltas), ``vllm:e2e_request_latency_seconds``, ``vllm:request_queue_time_seconds``,
  ``vllm:request_prefill_time_seconds``, ``vllm:request_decode_time_seconds``,
  ``vllm:request_inference_time_seconds`` (prefill + transfer + decode),
  ``vllm:request_prompt_tokens`` / ``vllm:request_generation_tokens`` (per request),
  ``vllm:request_max_num_generation_tokens`` (the longest choice of a client request),
  ``vllm:prompt_tokens_total``, ``vllm:generation_tokens_total``,
  ``vllm:request_success_total{finished_reason}``;
- per worker (``model_name`` + ``engine`` = worker id): ``vllm:num_requests_running``,
  ``vllm:num_requests_waiting``, ``vllm:kv_cache_usage_perc`` and its older name
  ``vllm:gpu_cache_usage_perc`` (a fraction, as vLLM's), ``vllm:num_preemptions_total``,
  ``vllm:prefix_cache_queries_total``, ``vllm:prefix_cache_hits_total`` (the device tier's hits: vLLM
  counts its GPU cache there and a KV connector's hits apart);
- per worker with a host KV tier (vLLM's names for its offloading connector, whose CPU tier is
  pdserve's host tier): ``vllm:external_prefix_cache_queries_total`` / ``vllm:external_prefix_cache_hits_total``
  (tokens looked up; tokens found in the host tier), ``vllm:kv_offload_store_bytes_total`` (device ->
  host) and ``vllm:kv_offload_load_bytes_total`` (host -> device).

Not exported (no pdserve meaning): speculative decoding, LoRA, spec-decode and multi-modal cache series;
``vllm:kv_offload_cpu_cache_usage_perc`` (vLLM's counts the CPU blocks pinned by transfers in flight,
not the blocks held: pdserve's host-tier occupancy is ``pdserve_kv_host_cache_usage_ratio``); the
deprecated ``vllm:kv_offload_total_bytes{transfer_type}`` (the store / load pair above replaced it).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from cluster.http.loop_histogram import LoopHistogram
from cluster.protocol import RequestTimings, WorkerStats

# NOTE: bucket edges over the ranges vLLM's histograms cover (ms to minutes; 1 to 1e6 tokens).
TTFT_BUCKETS = (
    0.001,
    0.005,
    0.01,
    0.02,
    0.04,
    0.06,
    0.08,
    0.1,
    0.25,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
    160.0,
    640.0,
    2560.0,
)
TPOT_BUCKETS = (
    0.01,
    0.025,
    0.05,
    0.075,
    0.1,
    0.15,
    0.2,
    0.3,
    0.4,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
)
REQUEST_BUCKETS = (
    0.3,
    0.5,
    0.8,
    1.0,
    1.5,
    2.0,
    2.5,
    5.0,
    10.0,
    15.0,
    20.0,
    30.0,
    40.0,
    50.0,
    60.0,
    120.0,
    240.0,
    480.0,
    960.0,
    1920.0,
    7680.0,
)
TOKEN_BUCKETS = tuple(float(m * 10**e) for e in range(7) for m in (1, 2, 5))


class VllmMetrics:
    """The request-level ``vllm:*`` series, in the same registry as pdserve's own."""

    def __init__(self, registry: CollectorRegistry, model_name: str) -> None:
        self.model_name = model_name
        labels = ["model_name"]

        def histogram(name: str, doc: str, buckets: Sequence[float]) -> Histogram:
            return Histogram(name, doc, labels, buckets=buckets, registry=registry)

        self.ttft = histogram("vllm:time_to_first_token_seconds", "Time to first token", TTFT_BUCKETS)
        # NOTE: observed per token per stream, from the event loop only: lock-free histograms sharing
        # their buckets, so one bisect observes both (``Metrics.token_gap_observer``)
        self.tpot = LoopHistogram(
            "vllm:time_per_output_token_seconds", "Gap between tokens", labels, TPOT_BUCKETS, registry
        )
        self.itl = LoopHistogram(
            "vllm:inter_token_latency_seconds", "Gap between tokens", labels, TPOT_BUCKETS, registry
        )
        self.e2e = histogram("vllm:e2e_request_latency_seconds", "End-to-end latency", REQUEST_BUCKETS)
        self.queue = histogram("vllm:request_queue_time_seconds", "Queue time", REQUEST_BUCKETS)
        self.prefill = histogram("vllm:request_prefill_time_seconds", "Prefill time", REQUEST_BUCKETS)
        self.decode = histogram("vllm:request_decode_time_seconds", "Decode time", REQUEST_BUCKETS)
        self.inference = histogram("vllm:request_inference_time_seconds", "Prefill + decode", REQUEST_BUCKETS)
        self.prompt_len = histogram("vllm:request_prompt_tokens", "Prompt tokens per request", TOKEN_BUCKETS)
        self.gen_len = histogram(
            "vllm:request_generation_tokens", "Generated tokens per request", TOKEN_BUCKETS
        )
        self.max_generation_tokens = histogram(
            "vllm:request_max_num_generation_tokens", "Longest choice of a client request", TOKEN_BUCKETS
        )
        self.prompt_tokens = Counter("vllm:prompt_tokens", "Prompt tokens", labels, registry=registry)
        self.generation_tokens = Counter(
            "vllm:generation_tokens", "Generated tokens", labels, registry=registry
        )
        self.success = Counter(
            "vllm:request_success", "Finished requests", ["model_name", "finished_reason"], registry=registry
        )
        for reason in ("stop", "length", "abort"):
            self.success.labels(model_name, reason)
        self.prompt_tokens.labels(model_name)
        self.generation_tokens.labels(model_name)

    def observe_token_gap(self, gap_s: float) -> None:
        self.tpot.labels(self.model_name).observe_both(self.itl.labels(self.model_name), gap_s)

    def observe_finished(
        self,
        timings: RequestTimings | None,
        finish_reason: str,
        e2e_s: float,
        num_prompt_tokens: int,
        num_generation_tokens: int,
    ) -> None:
        name = self.model_name
        self.e2e.labels(name).observe(e2e_s)
        if timings is not None:
            self.queue.labels(name).observe(timings.queue_s)
            self.prefill.labels(name).observe(timings.prefill_s)
            self.decode.labels(name).observe(timings.decode_s)
            self.inference.labels(name).observe(timings.prefill_s + timings.transfer_s + timings.decode_s)
        self.prompt_len.labels(name).observe(num_prompt_tokens)
        self.gen_len.labels(name).observe(num_generation_tokens)
        self.prompt_tokens.labels(name).inc(num_prompt_tokens)
        self.generation_tokens.labels(name).inc(num_generation_tokens)
        self.success.labels(name, finish_reason).inc()


def vllm_worker_metrics(stats: Sequence[WorkerStats], model_name: str) -> Iterator[Metric]:
    """The per-worker ``vllm:*`` gauges and counters from the workers' latest snapshots."""
    labels = ["model_name", "engine"]
    gauges = (
        ("vllm:num_requests_running", "Requests in the batch", lambda s: s.engine.num_running),
        ("vllm:num_requests_waiting", "Requests waiting", lambda s: s.engine.num_waiting),
        ("vllm:kv_cache_usage_perc", "KV cache usage (fraction)", lambda s: s.engine.kv_usage),
        ("vllm:gpu_cache_usage_perc", "KV cache usage (fraction)", lambda s: s.engine.kv_usage),
    )
    for name, doc, get in gauges:
        gauge = GaugeMetricFamily(name, doc, labels=labels)
        for s in stats:
            gauge.add_metric([model_name, s.worker_id], float(get(s)))
        yield gauge
    counters = (
        ("vllm:num_preemptions", "Preemptions", lambda s: s.engine.num_preemptions),
        (
            "vllm:prefix_cache_queries",
            "Prefix cache queries (tokens)",
            lambda s: s.engine.prefix_cache_queries,
        ),
        (
            "vllm:prefix_cache_hits",
            "Prefix cache hits (tokens)",
            lambda s: s.engine.prefix_cache_hits - s.engine.prefix_cache_host_hits,
        ),
    )
    for name, doc, get in counters:
        counter = CounterMetricFamily(name, doc, labels=labels)
        for s in stats:
            counter.add_metric([model_name, s.worker_id], float(get(s)))
        yield counter
    tiered = [s for s in stats if s.engine.num_host_blocks > 0]
    tier_counters = (
        (
            "vllm:external_prefix_cache_queries",
            "External prefix cache queries (tokens)",
            lambda s: s.engine.prefix_cache_queries,
        ),
        (
            "vllm:external_prefix_cache_hits",
            "External prefix cache hits (tokens)",
            lambda s: s.engine.prefix_cache_host_hits,
        ),
        ("vllm:kv_offload_store_bytes", "Bytes stored to offload", lambda s: s.engine.kv_offloaded_bytes),
        ("vllm:kv_offload_load_bytes", "Bytes loaded from offload", lambda s: s.engine.kv_loaded_bytes),
    )
    for name, doc, get in tier_counters:
        counter = CounterMetricFamily(name, doc, labels=labels)
        for s in tiered:
            counter.add_metric([model_name, s.worker_id], float(get(s)))
        yield counter
