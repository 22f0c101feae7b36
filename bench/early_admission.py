"""Early decode admission, A/B in one cluster: the gap between a request's first and second token.

    python -m bench.early_admission --config deploy/cpu-disagg.yaml --pin-cpu-cores --rounds 4

Sends ``pdserve bench serve``'s ``long_prompts`` requests (same seeded prompts, lengths and Poisson
arrivals; rounds 2k and 2k + 1 share seed k) through the cluster's router and, request by request,
switches the router's ``early_decode_admission`` on or off (alternating; the second round of a pair flips
the pattern, so every prompt runs both ways at the same place in the arrivals). The box's noise (other jobs on a shared machine) thus hits both arms alike, which
separate runs of ``bench serve`` cannot promise. Measured where the router's stream is consumed (no HTTP):
the first-to-second-token gap, TTFT, the other token gaps, and the router's transfer seconds; and the
per-prompt paired difference of the gap (on minus off).
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import time
from collections.abc import Sequence

import numpy as np

from cluster.config import ClusterConfig
from cluster.protocol import SamplingParams
from deploy.launch import Cluster, build_cluster
from deploy.loadgen import SCENARIOS, arrival_offsets, build_dataset


@dataclasses.dataclass
class Sample:
    is_early: bool
    prompt_len: int
    key: tuple[int, int]  # (seed, index): the same prompt in the other arm has the same key
    ttft_s: float = 0.0
    gap_s: float = 0.0  # first to second token
    later_gaps_s: list[float] = dataclasses.field(default_factory=list)
    transfer_s: float = 0.0


async def one(handle: Cluster, rid: str, prompt: list[int], max_tokens: int, sample: Sample) -> None:
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    start = time.perf_counter()
    times: list[float] = []
    async for delta in handle.agenerate(prompt, params, request_id=rid):
        times += [time.perf_counter()] * len(delta.token_ids)
        if delta.timings is not None:
            sample.transfer_s = delta.timings.transfer_s
    sample.ttft_s, sample.gap_s = times[0] - start, times[1] - times[0]
    sample.later_gaps_s = list(np.diff(times[1:]))


async def run_round(
    handle: Cluster, round_index: int, num_requests: int | None, is_sequential: bool
) -> list[Sample]:
    scenario = SCENARIOS["long_prompts"]
    if num_requests is not None:
        scenario = dataclasses.replace(scenario, num_requests=num_requests)
    info = handle.model_info
    seed = round_index // 2
    dataset = build_dataset(scenario, info.vocab_size, info.max_model_len, seed=seed)
    offsets = arrival_offsets(scenario, seed=seed)
    router = handle.router
    samples, tasks = [], []
    start = time.perf_counter()
    for i, ((prompt, max_tokens), offset) in enumerate(zip(dataset, offsets, strict=True)):
        if is_sequential and tasks:
            await tasks[-1]
        else:
            await asyncio.sleep(max(0.0, start + offset - time.perf_counter()))
        sample = Sample(is_early=(i + round_index) % 2 == 0, prompt_len=len(prompt), key=(seed, i))
        rid = f"r{round_index}-{i}"
        # NOTE: a first token of its own per round: no prefix-cache hit from the other arm's run
        prompt = [10 + round_index, *prompt[1:]]
        # NOTE: the router reads the flag when it dispatches; the next flip waits for that (bounded)
        router.config = dataclasses.replace(router.config, early_decode_admission=sample.is_early)
        tasks.append(asyncio.ensure_future(one(handle, rid, prompt, max(2, max_tokens), sample)))
        for _ in range(2000):
            if router.placement(rid)[0] is not None or tasks[-1].done():
                break
            await asyncio.sleep(0.001)
        samples.append(sample)
    await asyncio.gather(*tasks)
    return samples


def report(samples: Sequence[Sample]) -> None:
    def ms(values: Sequence[float]) -> str:
        a = np.asarray(values) * 1000.0
        return f"p50 {np.percentile(a, 50):7.1f}  p90 {np.percentile(a, 90):7.1f}  mean {a.mean():7.1f}"

    for is_early in (False, True):
        arm = [s for s in samples if s.is_early == is_early]
        print(f"early_decode_admission={str(is_early).lower():5}  n={len(arm)}")
        print(f"  first->second token gap ms  {ms([s.gap_s for s in arm])}")
        print(f"  TTFT ms                     {ms([s.ttft_s for s in arm])}")
        print(f"  later token gaps ms         {ms([g for s in arm for g in s.later_gaps_s])}")
        print(f"  router transfer_s ms        {ms([s.transfer_s for s in arm])}")
    gaps: dict[tuple[int, int], dict[bool, float]] = {}
    for s in samples:
        gaps.setdefault(s.key, {})[s.is_early] = s.gap_s
    diffs = [g[True] - g[False] for g in gaps.values() if len(g) == 2]
    if diffs:
        print(f"paired gap difference (on - off), {len(diffs)} prompts: {ms(diffs)}")


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", default="deploy/cpu-disagg.yaml")
    p.add_argument("--pin-cpu-cores", action="store_true", help="one core per worker (bench serve's flag)")
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--num-requests", type=int, default=None, help="per round (default: the scenario's 16)")
    p.add_argument("--sequential", action="store_true", help="one request at a time, not the arrivals")
    args = p.parse_args(argv)
    cfg = ClusterConfig.from_yaml(args.config)
    handle = build_cluster(dataclasses.replace(cfg, pin_cpu_cores=True) if args.pin_cpu_cores else cfg)
    samples: list[Sample] = []
    try:
        for is_early in (False, True):  # warm-up, both ways: the KV pair, the kernels' shapes
            handle.router.config = dataclasses.replace(handle.router.config, early_decode_admission=is_early)
            handle.generate(list(range(10, 300)), SamplingParams(max_tokens=4))
        for r in range(args.rounds):
            samples += asyncio.run(run_round(handle, r, args.num_requests, args.sequential))
            print(f"round {r + 1}/{args.rounds} done", flush=True)
    finally:
        handle.shutdown()
    report(samples)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
