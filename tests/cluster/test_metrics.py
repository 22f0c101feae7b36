"""/metrics after traffic: exact counter values, worker-stats export, and every dashboard metric exported."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from cluster.config import ServerConfig
from cluster.http.app import create_app
from cluster.http.metrics import Metrics
from cluster.protocol import QueueFullError, RequestTimings, WorkerStats
from tests.support.stub_router import ServerThread, StubRouter, make_tokenizer

DASHBOARD = Path(__file__).resolve().parents[2] / "deploy" / "grafana" / "pdserve.json"
# Which series suffixes a query may name, per exposition type (prometheus text format rules).
SUFFIXES = {"counter": ("_total",), "histogram": ("_bucket", "_sum", "_count"), "gauge": ("",)}


def dashboard_exprs(dashboard: dict[str, Any]) -> list[str]:
    """Every panel query of the dashboard (rows and nested panels included)."""
    exprs: list[str] = []

    def walk(node: Any) -> None:
        if isinstance(node, dict):
            if isinstance(node.get("expr"), str):
                exprs.append(node["expr"])
            for value in node.values():
                walk(value)
        elif isinstance(node, list):
            for value in node:
                walk(value)

    walk(dashboard)
    return exprs


def dashboard_metric_names(dashboard: dict[str, Any]) -> set[str]:
    """Every ``pdserve_*`` series named in any panel query."""
    return {
        name for expr in dashboard_exprs(dashboard) for name in re.findall(r"\bpdserve_[A-Za-z0-9_]+", expr)
    }


def exported_families(text: str) -> dict[str, str]:
    """family name -> type, as parsed from an exposition (counter families lose their _total)."""
    return {f.name: f.type for f in text_string_to_metric_families(text) if f.samples}


def unresolved(names: set[str], families: dict[str, str]) -> list[str]:
    """Query names that are no exported series: unknown family, or a suffix the family type lacks."""
    missing = []
    for name in sorted(names):
        ok = any(
            name.endswith(suffix) and families.get(name[: len(name) - len(suffix)]) == kind
            for kind, suffixes in SUFFIXES.items()
            for suffix in suffixes
        )
        if not ok:
            missing.append(name)
    return missing


def samples(text: str, model: str = "stub-model") -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """(name, labels) -> value; every sample must carry model_name=``model`` (left out of the key)."""
    out = {}
    for f in text_string_to_metric_families(text):
        for s in f.samples:
            labels = dict(s.labels)
            assert labels.pop("model_name") == model, s
            out[(s.name, tuple(sorted(labels.items())))] = s.value
    return out


@pytest.fixture(scope="module")
def scraped() -> Iterator[tuple[str, StubRouter]]:
    router = StubRouter(mode="disaggregated")
    router.num_cached_tokens = 2
    with ServerThread(create_app(router, make_tokenizer())) as s:
        url = f"{s.url}/v1"
        assert (
            httpx.post(f"{url}/completions", json={"prompt": [6, 7, 8], "max_tokens": 4}).status_code == 200
        )
        chat = {"messages": [{"role": "user", "content": "w9"}], "max_tokens": 3, "stream": True}
        assert httpx.post(f"{url}/chat/completions", json=chat).status_code == 200
        assert httpx.post(f"{url}/completions", json={"prompt": [6], "max_tokens": 0}).status_code == 400
        router.behavior = "queue_full"
        assert httpx.post(f"{url}/completions", json={"prompt": [6]}).status_code == 429
        router.behavior = None
        r = httpx.get(f"{s.url}/metrics")
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
        yield r.text, router


def test_every_dashboard_metric_is_exported(scraped: tuple[str, StubRouter]) -> None:
    names = dashboard_metric_names(json.loads(DASHBOARD.read_text()))
    assert len(names) >= 20  # the dashboard's panels were found at all
    assert unresolved(names, exported_families(scraped[0])) == []


def test_the_dashboard_counts_each_worker_once_whatever_the_number_of_replicas(
    scraped: tuple[str, StubRouter],
) -> None:
    """Front-end replicas each export every worker's series (from its heartbeats): a query over such a
    series first takes their ``max by (worker ...)``, so N replicas' copies count once; request series
    (each replica's own requests) are summed."""
    worker_series = {
        s.name for f in text_string_to_metric_families(scraped[0]) for s in f.samples if "worker" in s.labels
    }
    assert "pdserve_kv_cache_usage_ratio" in worker_series and "pdserve_requests_total" not in worker_series
    exprs = dashboard_exprs(json.loads(DASHBOARD.read_text()))
    per_worker = [e for e in exprs if set(re.findall(r"\bpdserve_[A-Za-z0-9_]+", e)) & worker_series]
    assert len(per_worker) >= 8
    for expr in per_worker:
        for name in set(re.findall(r"\bpdserve_[A-Za-z0-9_]+", expr)) & worker_series:
            # NOTE: each use of the series sits inside a max by (worker...) of its own
            uses = expr.count(name)
            assert len(re.findall(r"max by \(worker[^)]*\) \((?:rate|increase)?\(?" + name, expr)) == uses, (
                expr
            )


def test_suffix_rules_catch_a_bad_dashboard(scraped: tuple[str, StubRouter]) -> None:
    families = exported_families(scraped[0])
    bad = {
        "pdserve_time_to_first_token_seconds",
        "pdserve_requests",
        "pdserve_kv_cache_usage_ratio_total",
        "pdserve_not_a_metric_total",
        "pdserve_requests_bucket",
    }
    good = {
        "pdserve_time_to_first_token_seconds_bucket",
        "pdserve_requests_total",
        "pdserve_kv_cache_usage_ratio",
    }
    assert unresolved(bad | good, families) == sorted(bad)
    assert all(n.startswith("pdserve_") for n in families)


def test_request_counters_are_exact(scraped: tuple[str, StubRouter]) -> None:
    got = samples(scraped[0])
    mode = ("mode", "disaggregated")
    assert got[("pdserve_requests_total", (("finish_reason", "length"), mode))] == 2.0
    assert got[("pdserve_generation_tokens_total", (mode,))] == 7.0
    assert got[("pdserve_prompt_tokens_total", (mode,))] == 3.0 + len(
        make_tokenizer().encode_chat([{"role": "user", "content": "w9"}])
    )
    assert got[("pdserve_cached_prompt_tokens_total", (mode,))] == 4.0
    assert got[("pdserve_time_to_first_token_seconds_count", (mode,))] == 2.0
    assert got[("pdserve_time_between_tokens_seconds_count", (mode,))] == 5.0  # (4 - 1) + (3 - 1) gaps
    assert got[("pdserve_kv_transfer_time_seconds_count", (mode,))] == 2.0
    assert got[("pdserve_kv_transfer_time_seconds_sum", (mode,))] == pytest.approx(0.006, abs=1e-12)
    assert got[("pdserve_request_errors_total", (("code", "invalid_request"), ("status", "400")))] == 1.0
    assert got[("pdserve_request_errors_total", (("code", "queue_full"), ("status", "429")))] == 1.0


def test_worker_stats_are_exported_per_worker(scraped: tuple[str, StubRouter]) -> None:
    got = samples(scraped[0])
    prefill = (("pool", "prefill"), ("worker", "prefill-0"))
    decode = (("pool", "decode"), ("worker", "decode-0"))
    assert got[("pdserve_num_requests_waiting", prefill)] == 2.0
    assert got[("pdserve_num_requests_waiting_for_kv", decode)] == 1.0
    assert got[("pdserve_kv_cache_usage_ratio", decode)] == 0.5
    assert got[("pdserve_kv_cache_free_blocks", prefill)] == 30.0
    assert got[("pdserve_preemptions_total", decode)] == 1.0
    assert got[("pdserve_prefix_cache_hits_total", prefill)] == 40.0
    assert got[("pdserve_kv_transfer_bytes_total", decode)] == 4096.0


def test_colocated_skips_transfer_and_broken_stats_do_not_break_the_scrape() -> None:
    def broken() -> list[WorkerStats]:
        raise QueueFullError("stats unavailable")

    metrics = Metrics(broken)
    metrics.observe_finished(
        RequestTimings(0.1, 0.2, 0.0, 0.3),
        "stop",
        "colocated",
        e2e_s=0.6,
        num_prompt_tokens=5,
        num_generation_tokens=3,
    )
    got = samples(metrics.render().decode(), model="")
    assert got[("pdserve_prefill_time_seconds_count", (("mode", "colocated"),))] == 1.0
    assert not any(name.startswith("pdserve_kv_transfer_time") for name, _ in got)
    assert not any(name.startswith("pdserve_num_requests") for name, _ in got)


# The series vLLM's published Grafana dashboard queries (examples/.../prometheus_grafana/grafana.json),
# each filtered by model_name.
VLLM_DASHBOARD_SERIES = (
    "vllm:e2e_request_latency_seconds_bucket",
    "vllm:e2e_request_latency_seconds_sum",
    "vllm:e2e_request_latency_seconds_count",
    "vllm:prompt_tokens_total",
    "vllm:generation_tokens_total",
    "vllm:time_per_output_token_seconds_bucket",
    "vllm:time_per_output_token_seconds_sum",
    "vllm:time_per_output_token_seconds_count",
    "vllm:num_requests_running",
    "vllm:num_requests_waiting",
    "vllm:time_to_first_token_seconds_bucket",
    "vllm:time_to_first_token_seconds_sum",
    "vllm:time_to_first_token_seconds_count",
    "vllm:gpu_cache_usage_perc",
    "vllm:request_prompt_tokens_bucket",
    "vllm:request_generation_tokens_bucket",
    "vllm:request_success_total",
    "vllm:request_queue_time_seconds_sum",
    "vllm:request_prefill_time_seconds_sum",
    "vllm:request_decode_time_seconds_sum",
    "vllm:request_max_num_generation_tokens_sum",
)


def test_vllm_compat_exports_what_vllms_dashboard_queries() -> None:
    router = StubRouter(mode="disaggregated")
    with ServerThread(create_app(router, make_tokenizer(), ServerConfig(metrics_compat="vllm"))) as s:
        body = {"prompt": [6, 7, 8], "max_tokens": 4, "n": 2}
        assert httpx.post(f"{s.url}/v1/completions", json=body).status_code == 200
        text = httpx.get(f"{s.url}/metrics").text
    got = samples(text)  # every series, vllm:* included, carries model_name="stub-model"
    names = {name for name, _ in got}
    assert [n for n in VLLM_DASHBOARD_SERIES if n not in names] == []
    assert got[("vllm:prompt_tokens_total", ())] == 6.0
    assert got[("vllm:generation_tokens_total", ())] == 8.0
    assert got[("vllm:request_success_total", (("finished_reason", "length"),))] == 2.0
    assert got[("vllm:request_success_total", (("finished_reason", "stop"),))] == 0.0
    assert got[("vllm:request_max_num_generation_tokens_count", ())] == 1.0
    assert got[("vllm:request_max_num_generation_tokens_sum", ())] == 4.0
    assert got[("vllm:time_per_output_token_seconds_count", ())] == 6.0
    assert got[("vllm:num_requests_waiting", (("engine", "prefill-0"),))] == 2.0
    assert got[("vllm:gpu_cache_usage_perc", (("engine", "decode-0"),))] == 0.5
    assert got[("vllm:prefix_cache_hits_total", (("engine", "prefill-0"),))] == 40.0


def test_error_and_request_counters_read_zero_before_any_traffic() -> None:
    router = StubRouter(mode="colocated")
    with ServerThread(create_app(router, make_tokenizer(), ServerConfig(served_model_name="m"))) as s:
        text = httpx.get(f"{s.url}/metrics").text
    got = samples(text, model="m")
    errors = {labels: v for (name, labels), v in got.items() if name == "pdserve_request_errors_total"}
    assert errors[(("code", "queue_full"), ("status", "429"))] == 0.0
    assert errors[(("code", "slo_unattainable"), ("status", "429"))] == 0.0
    assert errors[(("code", "internal_error"), ("status", "500"))] == 0.0
    assert len(errors) == 18 and set(errors.values()) == {0.0}
    requests = {labels: v for (name, labels), v in got.items() if name == "pdserve_requests_total"}
    assert requests == {
        (("finish_reason", r), ("mode", "colocated")): 0.0 for r in ("stop", "length", "abort", "error")
    }
    assert not any(name.startswith("vllm:") for name, _ in got)


def test_dashboard_filters_every_query_by_model_name() -> None:
    dashboard = json.loads(DASHBOARD.read_text())
    exprs: list[str] = []

    def walk(node: Any) -> None:
        if isinstance(node, dict):
            if isinstance(node.get("expr"), str):
                exprs.append(node["expr"])
            for value in node.values():
                walk(value)
        elif isinstance(node, list):
            for value in node:
                walk(value)

    walk(dashboard)
    selectors = [m for e in exprs for m in re.findall(r"pdserve_[A-Za-z0-9_]+(\{[^}]*\})?", e)]
    assert len(selectors) >= 20 and all('model_name=~"$model_name"' in s for s in selectors)
    assert "model_name" in [v["name"] for v in dashboard["templating"]["list"]]
