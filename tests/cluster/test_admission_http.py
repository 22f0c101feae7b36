"""SLO-aware admission and live advice over HTTP: the real Router and app with a fake worker on the control
plane. A request whose predicted TTFT misses its SLO is a 429 with Retry-After and nothing is queued or
sent; an admitted one carries its route; the advice route and gauges answer from the router's recent
traffic; the Advisor over a stub router keeps to its window, cap and cache."""

from __future__ import annotations

import asyncio
import math
import os
import time
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

import httpx
import pytest
import zmq
import zmq.asyncio

from cluster.config import ClusterConfig, PoolConfig, RouterConfig, ServerConfig
from cluster.cost_model import CostProfile, LinearStepCost, TransferCost
from cluster.frames import new_secret
from cluster.http.app import create_app
from cluster.protocol import EngineStats, FinishReason, TokenDelta, WorkerStats, peer_name
from cluster.router.predict import Predictor, TrafficLog
from cluster.router.router import Router
from cluster.wire import (
    OPS,
    ROUTER_ID,
    Deltas,
    Generate,
    Heartbeat,
    RouterLease,
    WireDecoder,
    WireEncoder,
    WorkerInfo,
)
from deploy.planner.advice import Advisor

# every step 2.5 s whatever it computes; a control hop 62.5 ms each way: a new request's predicted TTFT on
# an idle worker is 2 x 62.5 ms + 2.5 s = 2.625 s (binary-exact)
CONSTANT = CostProfile(
    "constant",
    "hand",
    LinearStepCost(2.5, 0.0, 0.0, 0.0, 0.0, 0.0),
    TransferCost(0.0, 1e9),
    1000,
    hop_s=0.0625,
)
KEY = "sk-admission"
WORKER = "colocated-0"


class FakeWorker:
    """A worker as the router sees it: heartbeats in, ops out, over the real signed frames."""

    def __init__(self, ctx: zmq.asyncio.Context, secret: bytes, router_endpoint: str) -> None:
        self.pull = ctx.socket(zmq.PULL)
        self.pull.setsockopt(zmq.LINGER, 0)
        self.pull.bind("tcp://127.0.0.1:*")
        self.push = ctx.socket(zmq.PUSH)
        self.push.setsockopt(zmq.LINGER, 0)
        self.push.connect(router_endpoint)
        endpoint = self.pull.getsockopt_string(zmq.LAST_ENDPOINT)
        self.info = WorkerInfo(
            WORKER,
            "colocated",
            "inc-1",
            endpoint,
            "127.0.0.1",
            16,
            64,
            128,
            512,
            "/models/fake",
            "cpu",
            os.getpid(),
        )
        self.encoder = WireEncoder(secret)
        self.decoder = WireDecoder(secret, peer_name(WORKER, self.info.incarnation), OPS)

    async def beat(self) -> None:
        stats = WorkerStats(WORKER, "colocated", engine=EngineStats(num_free_blocks=63, num_total_blocks=63))
        await self.push.send(self.encoder.encode(ROUTER_ID, Heartbeat(self.info, stats)))

    async def serve_one(self) -> Generate:
        """The next op (bounded wait) but leases, which must be a Generate; answers it with one final
        token."""
        op = self.decoder.decode(await asyncio.wait_for(self.pull.recv(), 10))
        while isinstance(op, RouterLease):
            op = self.decoder.decode(await asyncio.wait_for(self.pull.recv(), 10))
        assert isinstance(op, Generate)
        delta = TokenDelta(op.request_id, [7], finish_reason=FinishReason.LENGTH)
        await self.push.send(self.encoder.encode(ROUTER_ID, Deltas(WORKER, [delta])))
        return op

    def close(self) -> None:
        self.pull.close(linger=0)
        self.push.close(linger=0)


def metric_line(text: str, prefix: str) -> str:
    lines = [line for line in text.splitlines() if line.startswith(prefix)]
    assert len(lines) == 1, (prefix, lines)
    return lines[0]


async def _http_scenario() -> dict[str, Any]:
    config = RouterConfig(mode="colocated", admission="slo", ttft_slo_ms=2000.0, health_timeout_s=60.0)
    secret = new_secret()
    router = Router(config, secret, predictor=Predictor(CONSTANT, budget=64))
    await router.start()
    ctx = zmq.asyncio.Context()
    worker = FakeWorker(ctx, secret, router.endpoint)
    out: dict[str, Any] = {}
    try:
        await worker.beat()
        await router.wait_admitted([WORKER], 10)
        cluster = ClusterConfig(
            engine={"max_num_batched_tokens": 64, "num_kv_blocks": 64},
            colocated=PoolConfig(num_workers=1),
            router=config,
        )
        advisor = Advisor(router, cluster, CONSTANT, vocab_size=512, max_model_len=128)
        # NOTE: live advice is an admin route (issue 31 row 10): it takes the admin key only
        app = create_app(router, None, ServerConfig(api_key=KEY, admin_key=f"{KEY}-admin"), advisor=advisor)
        auth = {"Authorization": f"Bearer {KEY}"}
        admin = {"Authorization": f"Bearer {KEY}-admin"}
        body = {"model": "fake", "prompt": list(range(10, 18)), "max_tokens": 1}
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://pdserve", timeout=30) as http:
            # predicted TTFT: 2 x 62.5 ms of hops + one 2.5 s step = 2.625 s
            slo_header = {**auth, "x-pdserve-ttft-slo-ms": "100"}
            out["refused"] = await http.post("/v1/completions", json=body, headers=slo_header)
            out["refused_stream"] = await http.post(
                "/v1/completions", json={**body, "stream": True}, headers=slo_header
            )
            out["refused_by_config"] = await http.post("/v1/completions", json=body, headers=auth)
            out["bad_header"] = await http.post(
                "/v1/completions", json=body, headers={**auth, "x-pdserve-ttft-slo-ms": "-3"}
            )
            w = router.workers[0]
            out["after_refusals"] = (
                router.route_decisions(),
                w.num_assigned,
                w.num_prompt_tokens,
                len(router.traffic),
            )
            admitted = asyncio.ensure_future(
                http.post("/v1/completions", json=body, headers={**auth, "x-pdserve-ttft-slo-ms": "3000"})
            )
            out["first_op"] = await worker.serve_one()
            out["admitted"] = await admitted
            out["advice_no_key"] = await http.get("/v1/pdserve/advice")
            out["advice_bad_window"] = await http.get("/v1/pdserve/advice?window_s=0", headers=admin)
            out["advice"] = await http.get("/v1/pdserve/advice", headers=admin)
            out["metrics"] = (await http.get("/metrics", headers=auth)).text
        advisor.close()
    finally:
        worker.close()
        ctx.term()
        await router.close()
    return out


@pytest.fixture(scope="module")
def out() -> dict[str, Any]:
    return asyncio.run(_http_scenario())


def test_an_unattainable_slo_is_a_429_with_retry_after_and_nothing_is_queued(out: dict[str, Any]) -> None:
    refused = out["refused"]
    assert refused.status_code == 429
    assert refused.headers["retry-after"] == "3"  # ceil(2.625 - 0.1)
    error = refused.json()["error"]
    assert error["code"] == "slo_unattainable"
    assert error["message"] == (
        "predicted time to first token 2625 ms exceeds the TTFT SLO 100 ms (on colocated-0); retry after 3 s"
    )
    assert (out["refused_stream"].status_code, out["refused_stream"].headers["retry-after"]) == (429, "3")
    by_config = out["refused_by_config"]  # no header: the router's 2000 ms
    assert (by_config.status_code, by_config.headers["retry-after"]) == (429, "1")
    bad = out["bad_header"].json()["error"]
    assert out["bad_header"].status_code == 400 and bad["param"] == "x-pdserve-ttft-slo-ms"
    assert "(0, 3600000]" in bad["message"]
    # nothing routed, counted or queued for the refused requests (the three are in the traffic log)
    assert out["after_refusals"] == ({}, 0, 0, 3)
    # the first op the worker ever received is the admitted request's
    op = out["first_op"]
    assert op.prompt_token_ids == list(range(10, 18)) and op.hold is False
    admitted = out["admitted"]
    assert admitted.status_code == 200
    choice = admitted.json()["choices"][0]
    assert choice["token_ids"] == [7]
    assert choice["pdserve_timings"]["route"] == {
        "mode": "colocated",
        "reason": "kv_index_miss",  # NOTE: placed by the KV index (the default), which holds nothing
        "prefill_worker": WORKER,
        "decode_worker": WORKER,
        "prefill_hit_tokens": 0,
        "decode_hit_tokens": 0,
        "predicted_ttft_s": 2.625,
        "predicted_tbt_s": 2.5,
    }
    metrics = out["metrics"]
    assert metric_line(metrics, "pdserve_route_decisions_total{") == (
        'pdserve_route_decisions_total{mode="colocated",model_name="fake",reason="kv_index_miss"} 1.0'
    )
    assert metric_line(
        metrics, 'pdserve_request_errors_total{code="slo_unattainable",model_name="fake",status="429"}'
    ).endswith(" 3.0")


def test_live_advice_route_and_gauges(out: dict[str, Any]) -> None:
    assert out["advice_no_key"].status_code == 401
    bad = out["advice_bad_window"]
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "window_s"
    assert bad.json()["error"]["message"] == "window_s must be in (0, 300] seconds, got '0'"
    answer = out["advice"].json()
    assert (answer["object"], answer["window_s"], answer["current"]) == (
        "pdserve.advice",
        300.0,
        "colocated x1",
    )
    assert answer["slo"] == {"ttft_ms": 2000.0, "tbt_ms": 100.0, "percentile": 90.0}
    advice = answer["advice"]
    # four requests (three refused, one served) replayed on one worker: the only configuration
    assert (advice["num_requests"], advice["current"], advice["recommended"]) == (
        4,
        "colocated x1",
        "colocated x1",
    )
    assert (advice["recommended_colocated"], advice["recommended_prefill"], advice["recommended_decode"]) == (
        1,
        0,
        0,
    )
    # every simulated step takes 2.5 s: no request can meet a 2 s TTFT
    assert advice["recommended_slo_attainment"] == advice["current_slo_attainment"] == 0.0
    gauge = 'pdserve_advice_slo_attainment{configuration="colocated x1",model_name="fake",role="recommended"}'
    assert metric_line(out["metrics"], gauge) == gauge + " 0.0"
    workers = 'pdserve_advice_recommended_workers{model_name="fake",pool="colocated"}'
    assert metric_line(out["metrics"], workers) == workers + " 1.0"
    assert not math.isnan(answer["planner_s"])


@dataclass
class StubWorker:
    worker_id: str
    pool: str
    info: Any
    state: Any


def test_advisor_windows_cache_and_bounds() -> None:
    now = time.time()
    traffic = TrafficLog(window_s=120.0)
    for age in (100.0, 50.0, 8.0, 4.0, 2.0):  # five requests, three in the last 10 s
        traffic.record(now - age, 64, 8)
    live = SimpleNamespace(value="healthy")
    router = SimpleNamespace(
        traffic=traffic,
        workers=[
            StubWorker("prefill-0", "prefill", SimpleNamespace(num_blocks=64), live),
            StubWorker("decode-0", "decode", SimpleNamespace(num_blocks=48), live),
        ],
    )
    cluster = ClusterConfig(engine={"max_num_batched_tokens": 64, "num_kv_blocks": 64})
    advisor = Advisor(router, cluster, CONSTANT, vocab_size=512, max_model_len=128, max_requests=4)  # type: ignore[arg-type]
    assert advisor.current_config().label == "1P:1D" and advisor.current_config().num_kv_blocks == 48

    async def scenario() -> tuple[dict[str, Any], ...]:
        recent = await advisor.advice(10.0)
        everything = await advisor.advice()
        again = await advisor.advice()
        return recent, everything, again

    try:
        recent, everything, again = asyncio.run(scenario())
    finally:
        advisor.close()
    assert (recent["window_s"], recent["advice"]["num_requests"]) == (10.0, 3)
    # the whole 120 s window holds five, capped to the most recent four
    assert (everything["window_s"], everything["advice"]["num_requests"]) == (120.0, 4)
    assert again is everything  # cached
    assert advisor.latest() == everything["advice"]
    assert {r["recommended"] for r in (recent["advice"], everything["advice"])} <= {"colocated x2", "1P:1D"}
