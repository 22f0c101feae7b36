"""The front end's CPU per streamed token: router, HTTP edge and client, all in this process.

Starts the cluster of ``--config`` (the bundled tiny model by default), streams ``--runs`` rounds of
``--batch`` concurrent greedy requests (``--prompt`` tokens in, ``--output`` out) and prints this
process's CPU seconds per output token for each round, then the median of all rounds but the first
(a warm-up). It is the term ``pdserve plan calibrate --probe`` fits as ``frontend_cpu_per_token_s``, on
its own: quick to compare two commits.

    python -m bench.frontend_cpu                 # deploy/cpu-disagg.yaml, 4 rounds of 32 streams
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time

from deploy.loadgen import ClientSettings, Scenario, run_scenario
from deploy.plan.harness import running_cluster
from deploy.plan.inputs import DEFAULT_CONFIG, load_cluster_config


async def _rounds(url: str, args: argparse.Namespace) -> list[float]:
    scenario = Scenario(
        args.batch, (args.prompt, args.prompt), (args.output, args.output), max_concurrency=args.batch
    )
    per_token = []
    for k in range(args.runs):
        cpu0 = time.process_time()
        records, _ = await run_scenario(url, f"frontend-{k}", ClientSettings(args.seed + k), scenario)
        num_tokens = sum(r.output_tokens for r in records)
        if num_tokens == 0:
            raise RuntimeError(f"round {k}: no token came back ({[r.error for r in records][:3]})")
        per_token.append((time.process_time() - cpu0) / num_tokens)
    return per_token


def main() -> None:
    ap = argparse.ArgumentParser(prog="python -m bench.frontend_cpu", description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", default=str(DEFAULT_CONFIG))
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--prompt", type=int, default=256)
    ap.add_argument("--output", type=int, default=96)
    ap.add_argument("--runs", type=int, default=4)
    ap.add_argument("--seed", type=int, default=100)
    args = ap.parse_args()
    if args.runs < 2:
        ap.error("--runs must be at least 2 (the first is a warm-up)")
    with running_cluster(load_cluster_config(args.config)) as (url, _):
        per_token = asyncio.run(_rounds(url, args))
    rounds = " ".join(f"{t * 1e6:.0f}" for t in per_token)
    print(
        f"front end CPU per streamed token ({args.batch} streams x {args.output} tokens): rounds {rounds} us"
    )
    print(f"median after the warm-up round: {statistics.median(per_token[1:]) * 1e6:.0f} us/token")


if __name__ == "__main__":
    main()
