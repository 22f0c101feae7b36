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

from cluster.metrics import Metrics
from cluster.protocol import QueueFullError, RequestTimings, WorkerStats
from cluster.server import create_app
from tests.stub_router import ServerThread, StubRouter, make_tokenizer

DASHBOARD = Path(__file__).resolve().parents[1] / "deploy" / "grafana" / "pdserve.json"
# Which series suffixes a query may name, per exposition type (prometheus text format rules).
SUFFIXES = {"counter": ("_total",), "histogram": ("_bucket", "_sum", "_count"), "gauge": ("",)}


def dashboard_metric_names(dashboard: dict[str, Any]) -> set[str]:
    """Every ``pdserve_*`` series named in any panel query (rows and nested panels included)."""
    names: set[str] = set()

    def walk(node: Any) -> None:
        if isinstance(node, dict):
            if isinstance(node.get("expr"), str):
                names.update(re.findall(r"\bpdserve_[A-Za-z0-9_]+", node["expr"]))
            for value in node.values():
                walk(value)
        elif isinstance(node, list):
            for value in node:
                walk(value)

    walk(dashboard)
    return names


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
