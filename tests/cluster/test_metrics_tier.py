"""The host KV tier's metrics (issue 44): hits by tier, occupancy, blocks and bytes offloaded and loaded,
exported per worker from the WorkerStats the router holds, as pdserve_* series and under vLLM's names
where vLLM has them; and the dashboard's tier panels."""

from __future__ import annotations

import json

from prometheus_client.parser import text_string_to_metric_families

from cluster.http.metrics import Metrics
from cluster.protocol import EngineStats, WorkerStats
from tests.cluster.test_metrics import DASHBOARD, dashboard_exprs, samples

BLOCK_BYTES = 32768  # the bundled model's KV block: 4 layers x K,V x 16 slots x 2 heads x 32 x 4 B

TIERED = WorkerStats(
    "prefill-0",
    "prefill",
    engine=EngineStats(
        prefix_cache_queries=1000,
        prefix_cache_hits=600,
        prefix_cache_host_hits=250,
        num_host_blocks=512,
        num_host_blocks_used=128,
        host_load_cost=0.125,
        kv_offloaded_blocks=40,
        kv_loaded_blocks=10,
        kv_offloaded_bytes=40 * BLOCK_BYTES,
        kv_loaded_bytes=10 * BLOCK_BYTES,
        num_free_blocks=16,
        num_total_blocks=64,
    ),
    num_pulled_blocks=6,
    num_pulled_bytes=6 * BLOCK_BYTES,
    num_pull_failures=1,
)
PLAIN = WorkerStats(
    "decode-0",
    "decode",
    engine=EngineStats(
        prefix_cache_queries=100, prefix_cache_hits=30, num_free_blocks=60, num_total_blocks=64
    ),
)
PREFILL = (("pool", "prefill"), ("worker", "prefill-0"))
DECODE = (("pool", "decode"), ("worker", "decode-0"))


def render(compat: str = "none") -> str:
    return Metrics(lambda: [TIERED, PLAIN], model_name="m", compat=compat).render().decode()


def test_tier_series_per_worker_are_exact() -> None:
    got = samples(render(), model="m")
    assert got[("pdserve_prefix_cache_queries_total", PREFILL)] == 1000.0
    assert got[("pdserve_prefix_cache_hits_total", PREFILL)] == 600.0
    assert got[("pdserve_prefix_cache_host_hits_total", PREFILL)] == 250.0
    assert got[("pdserve_prefix_cache_host_hits_total", DECODE)] == 0.0
    assert got[("pdserve_kv_host_cache_total_blocks", PREFILL)] == 512.0
    assert got[("pdserve_kv_host_cache_used_blocks", PREFILL)] == 128.0
    assert got[("pdserve_kv_host_cache_usage_ratio", PREFILL)] == 0.25
    # a worker without a tier reads 0 blocks and 0 occupancy, never a division by zero
    assert got[("pdserve_kv_host_cache_total_blocks", DECODE)] == 0.0
    assert got[("pdserve_kv_host_cache_usage_ratio", DECODE)] == 0.0
    assert got[("pdserve_kv_host_load_cost_ratio", PREFILL)] == 0.125
    assert got[("pdserve_kv_host_load_cost_ratio", DECODE)] == -1.0  # no tier: nothing measured
    assert got[("pdserve_kv_offloaded_blocks_total", PREFILL)] == 40.0
    assert got[("pdserve_kv_loaded_blocks_total", PREFILL)] == 10.0
    assert got[("pdserve_kv_offloaded_bytes_total", PREFILL)] == 1310720.0
    assert got[("pdserve_kv_loaded_bytes_total", PREFILL)] == 327680.0
    assert got[("pdserve_kv_offloaded_bytes_total", DECODE)] == 0.0
    # prefix pulls from other workers (cluster/router/pulls.py)
    assert got[("pdserve_kv_pulled_blocks_total", PREFILL)] == 6.0
    assert got[("pdserve_kv_pulled_bytes_total", PREFILL)] == 196608.0
    assert got[("pdserve_kv_pull_failures_total", PREFILL)] == 1.0
    assert got[("pdserve_kv_pulled_blocks_total", DECODE)] == 0.0


def test_counters_are_counters_and_gauges_gauges() -> None:
    types = {f.name: f.type for f in text_string_to_metric_families(render())}
    for name in (
        "pdserve_prefix_cache_host_hits",
        "pdserve_kv_offloaded_blocks",
        "pdserve_kv_loaded_blocks",
        "pdserve_kv_offloaded_bytes",
        "pdserve_kv_loaded_bytes",
        "pdserve_kv_pulled_blocks",
        "pdserve_kv_pulled_bytes",
        "pdserve_kv_pull_failures",
    ):
        assert types[name] == "counter", name
    for name in (
        "pdserve_kv_host_cache_total_blocks",
        "pdserve_kv_host_cache_used_blocks",
        "pdserve_kv_host_cache_usage_ratio",
        "pdserve_kv_host_load_cost_ratio",
    ):
        assert types[name] == "gauge", name


def test_vllm_names_split_device_hits_from_the_host_tiers() -> None:
    got = samples(render("vllm"), model="m")
    prefill, decode = (("engine", "prefill-0"),), (("engine", "decode-0"),)
    # vLLM counts its GPU cache's hits in prefix_cache_hits and a connector's (its CPU tier) apart
    assert got[("vllm:prefix_cache_queries_total", prefill)] == 1000.0
    assert got[("vllm:prefix_cache_hits_total", prefill)] == 350.0
    assert got[("vllm:prefix_cache_hits_total", decode)] == 30.0
    assert got[("vllm:external_prefix_cache_queries_total", prefill)] == 1000.0
    assert got[("vllm:external_prefix_cache_hits_total", prefill)] == 250.0
    assert got[("vllm:kv_offload_store_bytes_total", prefill)] == 1310720.0
    assert got[("vllm:kv_offload_load_bytes_total", prefill)] == 327680.0
    # a worker without a tier has no connector series, as a vLLM engine without a KV connector
    tier_names = {
        "vllm:external_prefix_cache_queries_total",
        "vllm:external_prefix_cache_hits_total",
        "vllm:kv_offload_store_bytes_total",
        "vllm:kv_offload_load_bytes_total",
    }
    assert {name for name, labels in got if labels == decode} & tier_names == set()
    # names with another meaning in vLLM (CPU blocks pinned by transfers) or deprecated there
    assert not any(name.startswith(("vllm:kv_offload_cpu", "vllm:kv_offload_total")) for name, _ in got)


def test_the_dashboard_has_the_tier_panels() -> None:
    dashboard = json.loads(DASHBOARD.read_text())
    row = [p for p in dashboard["panels"] if p.get("title") == "KV host tier"]
    assert len(row) == 1 and row[0]["type"] == "row"
    start = dashboard["panels"].index(row[0])
    titles = [p["title"] for p in dashboard["panels"][start + 1 :]]
    assert titles == [
        "Prefix-cache hit rate by tier (tokens)",
        "Host tier occupancy per worker",
        "Host tier traffic (bytes/s)",
        "Host tier traffic (blocks/s)",
    ]
    exprs = " ".join(dashboard_exprs({"panels": dashboard["panels"][start:]}))
    for name in (
        "pdserve_prefix_cache_hits_total",
        "pdserve_prefix_cache_host_hits_total",
        "pdserve_prefix_cache_queries_total",
        "pdserve_kv_host_cache_usage_ratio",
        "pdserve_kv_offloaded_bytes_total",
        "pdserve_kv_loaded_bytes_total",
        "pdserve_kv_offloaded_blocks_total",
        "pdserve_kv_loaded_blocks_total",
    ):
        assert name in exprs, name
    ids = [p["id"] for p in dashboard["panels"]]
    assert len(ids) == len(set(ids))
