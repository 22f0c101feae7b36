"""The driver side of the two-host tests, run as a subprocess (not a test module):

    RAY_AUTH_MODE=token python -m tests.support.two_host_driver ADDRESS IP_A SCENARIO ARGS_JSON

Ray reads RAY_AUTH_MODE once, at import, and the lab's Ray cluster runs token auth, so the driver is its
own process. It starts a cluster on the lab (prefill pool on host A, decode pool on host B), runs the
scenario and prints one JSON line, ``RESULT {...}``, last.

Scenarios:
  disagg     ARGS {"prompts": [[...]], "max_tokens": [...]}: all at once; outputs, transfer bytes, where
             each worker runs
  link_flap  ARGS {"prompts", "max_tokens", "veth": name, "down_s": 3}: the link goes down once transfers
             are under way and comes back; outputs (or errors) per request, then a second wave's outputs
  replicas   ARGS {"profile": path}: mock workers (prefill on A, decode on B) behind 2 front-end replicas
             on host A; 32 streams, replica 1 killed (kill -9) mid-stream; the streams, the leak reports
             once its lease ran out, then which replicas serve after its restart
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import time
from typing import Any

import ray

from cluster.protocol import RouterError, SamplingParams
from deploy.launch import Cluster, build_cluster
from tests.support.cluster_utils import cluster_config, collect, wait_for


def lab_config(overrides: dict[str, Any]) -> dict[str, Any]:
    return cluster_config(
        "",
        prefill={"num_workers": 1, "resources": {"host_a": 1}},
        decode={"num_workers": 1, "resources": {"host_b": 1}},
        router={"health_interval_s": 0.2, "health_timeout_s": 2.0, "request_timeout_s": 120.0},
        **overrides,
    )


def greedy(n: int) -> SamplingParams:
    return SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)


async def run_all(handle: Cluster, prompts: list[list[int]], max_tokens: list[int]) -> list[Any]:
    async def one(i: int) -> Any:
        try:
            return await collect(handle, prompts[i], greedy(max_tokens[i]), f"r{i}-{time.monotonic_ns()}")
        except RouterError as e:
            return {"error": type(e).__name__, "message": str(e)}

    return list(await asyncio.gather(*(one(i) for i in range(len(prompts)))))


def fresh_stats(handle: Cluster) -> None:
    """Until every worker has sent a heartbeat (its stats) after this call."""
    since = time.monotonic()
    wait_for(lambda: all(w.last_beat > since for w in handle.router.workers), 10, "fresh heartbeats")


def placement(handle: Cluster) -> dict[str, str]:
    return {w.worker_id: w.info.node_ip for w in handle.router.workers}


def transfers(handle: Cluster) -> dict[str, Any]:
    return {
        s.worker_id: {"ok": s.transfer.num_ok, "bytes": s.transfer.bytes_total} for s in handle.worker_stats()
    }


def scenario_disagg(handle: Cluster, args: dict[str, Any]) -> dict[str, Any]:
    outputs = asyncio.run(run_all(handle, args["prompts"], args["max_tokens"]))
    fresh_stats(handle)
    return {"outputs": outputs, "placement": placement(handle), "transfers": transfers(handle)}


def scenario_link_flap(handle: Cluster, args: dict[str, Any]) -> dict[str, Any]:
    async def main() -> list[Any]:
        task = asyncio.ensure_future(run_all(handle, args["prompts"], args["max_tokens"]))
        # NOTE: take the link down once the decode side is waiting for KV (a transfer under way)
        for _ in range(2000):
            stats = handle.worker_stats()
            if any(s.num_waiting_for_kv for s in stats) or task.done():
                break
            await asyncio.sleep(0.005)
        subprocess.run(["ip", "link", "set", args["veth"], "down"], check=True, timeout=30)
        await asyncio.sleep(args.get("down_s", 3.0))
        subprocess.run(["ip", "link", "set", args["veth"], "up"], check=True, timeout=30)
        return await task

    first = asyncio.run(main())
    second = asyncio.run(run_all(handle, args["prompts"], args["max_tokens"]))
    fresh_stats(handle)
    return {"first": first, "second": second, "transfers": transfers(handle), "placement": placement(handle)}


SCENARIOS = {"disagg": scenario_disagg, "link_flap": scenario_link_flap}


def scenario_replicas(args: dict[str, Any]) -> dict[str, Any]:
    from cluster.config import ClusterConfig
    from deploy.replica_set import ReplicatedFrontEnd
    from tests.support.replica_streams import rule_outputs, serve_on_every_replica, streams_with_a_kill

    overrides = {
        "engine": {
            "load_format": "mock",
            "mock_cost_profile": args["profile"],
            "block_size": 16,
            "num_kv_blocks": 1024,
        },
        "server": {"replicas": 2, "port": 0},
    }
    cfg = lab_config(overrides)
    cfg["router"]["router_lease_s"] = 2.0
    cluster = build_cluster(ClusterConfig.from_dict(cfg))
    try:
        front = cluster.front_end
        assert isinstance(front, ReplicatedFrontEnd)
        victim = front.replicas.slots[1]
        victim_pid = victim.pid
        assert victim_pid is not None
        streams = streams_with_a_kill(front.url, victim_pid)

        def clean() -> bool:
            return all(r is None for r in cluster.check_leaks(10).values())

        wait_for(clean, 30, "no KV held for the dead replica's requests")
        leaks = cluster.check_leaks(10)
        freed = {
            w: ray.get(a.stats.remote(), timeout=30).num_freed_for_router for w, a in cluster.actors.items()
        }
        wait_for(lambda: victim.num_restarts == 1 and victim.serving.is_set(), 120, "replica 1 restarted")
        served = serve_on_every_replica(front.url, rule_outputs(), {0, 1})
        workers = {w: ray.get(a.get_info.remote(), timeout=30).node_ip for w, a in cluster.actors.items()}
        return {
            "streams": [s.as_dict() for s in streams],
            "leaks": leaks,
            "freed": freed,
            "served": sorted(served),
            "restarted": victim.pid != victim_pid,
            "placement": workers,
            "endpoints": [slot.endpoint for slot in front.replicas.slots],
        }
    finally:
        cluster.shutdown()


def main(argv: list[str]) -> int:
    address, ip_a, scenario, raw = argv
    args = json.loads(raw)
    ray.init(address=address, _node_ip_address=ip_a, log_to_driver=False)
    try:
        if scenario == "replicas":
            print("RESULT " + json.dumps(scenario_replicas(args)), flush=True)
            return 0
        handle = build_cluster(lab_config(args.get("config", {})))
        try:
            result = SCENARIOS[scenario](handle, args)
            result["leaks"] = _leaks(handle)
        finally:
            handle.shutdown()
    finally:
        ray.shutdown()
    print("RESULT " + json.dumps(result), flush=True)
    return 0


def _leaks(handle: Cluster) -> dict[str, str | None]:
    handle.wait_until_quiet(timeout_s=60)
    return handle.check_leaks()


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
