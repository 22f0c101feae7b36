"""How fast the planner simulates a big cluster: 64 workers, 10,000 requests (a figure, not a test).

    python -m bench.plan_scale [--workers 64] [--num-requests 10000] [--prefill 16] [--rate 600]

Roofline profile of Llama-3-8B on H100s (bench/configs/llama-3-8b), Poisson arrivals, prompts 128-2048
and outputs 32-512 tokens; prints the wall time of one simulation per configuration (colocated and one
P:D split) and the simulated figures, so a split search's cost can be read off.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Sequence
from pathlib import Path

from cluster.config import EngineConfig, RouterConfig
from deploy.planner.profiles import HARDWARE, ModelShape, gpu_kv_blocks, roofline_profile
from deploy.planner.report import Slo
from deploy.planner.search import simulate
from deploy.planner.twin import SimConfig
from deploy.planner.workload import poisson

MODEL = Path(__file__).resolve().parent / "configs" / "llama-3-8b"


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.plan_scale", description=__doc__.split("\n\n")[0])
    p.add_argument("--workers", type=int, default=64)
    p.add_argument("--prefill", type=int, default=16, help="prefill workers of the split")
    p.add_argument("--num-requests", type=int, default=10_000)
    p.add_argument("--rate", type=float, default=600.0, help="requests/s")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)

    hw, shape = HARDWARE["h100"], ModelShape.from_config(MODEL)
    profile = roofline_profile(hw, shape)
    engine = EngineConfig(block_size=16, max_num_seqs=256, max_num_batched_tokens=8192)
    blocks = gpu_kv_blocks(hw, shape, engine.block_size, engine.gpu_memory_utilization)
    # NOTE: the router's default cap on requests in flight (1024) would turn load away at this scale
    router = RouterConfig(max_pending_requests=1_000_000)
    base = SimConfig(
        "colocated",
        num_colocated=args.workers,
        engine=engine,
        num_kv_blocks=blocks,
        max_model_len=8192,
        router=router,
    )
    workload = poisson(
        args.rate, args.num_requests, (128, 2048), (32, 512), seed=args.seed, vocab_size=shape.vocab_size
    )
    slo = Slo(ttft_ms=500.0, tbt_ms=50.0)
    print(
        f"{profile.name}: {blocks} KV blocks per worker; {workload.name}, {len(workload)} requests, "
        f"{sum(r.prompt_len for r in workload.requests)} prompt + {sum(r.output_len for r in workload.requests)} "
        "output tokens",
        flush=True,
    )
    for config in (base, base.split(args.prefill, args.workers - args.prefill)):
        t0 = time.perf_counter()
        row = simulate(config, profile, workload, slo)
        wall = time.perf_counter() - t0
        s = row.summary
        print(
            f"{config.label:>14}: simulated in {wall:5.1f} s wall ({row.result.num_steps} steps, "
            f"{row.result.duration_s:.0f} s simulated): TTFT p90 {s.ttft_ms.p90:.0f} ms, TBT p90 "
            f"{s.tbt_ms.p90:.1f} ms, {s.slo_attainment:.1%} within SLO, {s.output_tokens_per_s:.0f} tok/s",
            flush=True,
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
