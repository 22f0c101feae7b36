"""``pdserve plan``: how many prefill and decode workers a workload needs for its TTFT / TBT SLO, and
whether to disaggregate at all, answered by simulating the cluster's own scheduler and placement
policy under a step-cost profile (deploy/planner/).

    pdserve plan --workload scenario:stress --workers 2 4            # this machine's calibrated profile
    pdserve plan --workload poisson:20 --prompt-len 512 2048 --output-len 64 256 \\
        --gpu h100 --model bench/configs/llama-3-8b --workers 8      # a roofline estimate for H100s
    pdserve plan --workload trace:requests.jsonl --profile my-profile.json --workers 16
    pdserve plan --workload scenario:long_prompts --gpu h100 --model bench/configs/llama-3-70b \
        --config deploy/gpu-disagg.yaml --gpus 8      # (workers, TP) per pool on 8 GPUs
    pdserve plan calibrate [--config deploy/cpu-disagg.yaml] [--probe]
    pdserve plan validate --config deploy/cpu-disagg.yaml            # simulation vs the real cluster
    pdserve plan validate bench/configs/llama-3-8b --config deploy/mock-cluster.yaml --gpu h100 \
        --num-prefill-workers 1 --num-decode-workers 1 --num-kv-blocks 1024  # ... a mock one, GPU rates
    pdserve plan spread A/validate.json B/validate.json              # the real cluster vs itself

Workloads: ``scenario:NAME`` (``pdserve bench serve``'s seeded scenarios, the very same prompts),
``poisson:RATE`` (``--num-requests``, uniform ``--prompt-len`` / ``--output-len``, optional prefix
groups), ``trace:PATH`` (JSON lines or CSV: arrival_s, prompt_len, output_len[, prefix_group,
prefix_len]). With ``--gpu`` each budget (``--gpus``, or ``--workers``) is a number of GPUs and every
pool's workers may take any tensor-parallel size of ``--tensor-parallel-sizes`` that fits (default: 1 2 4
8, one node); the report names each pool's size and why. Writes ``<out>/plan.json``, ``<out>/plan.png``
and ``<out>/plan.yaml`` (the config, running the recommended layout).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict
from pathlib import Path

import yaml

from cluster.config import ClusterConfig, EngineConfig
from cluster.cost_model import CostProfile
from deploy.loadgen import SCENARIOS
from deploy.plan.inputs import (
    DEFAULT_CONFIG,
    cpu_kv_blocks,
    default_profile_path,
    load_cluster_config,
    model_dir,
    scenario_workload,
)
from deploy.planner.parallel import (
    NODE_SIZES,
    POOLS,
    Parallelism,
    gpu_parallelism,
    layout_config,
    step_table,
)
from deploy.planner.profiles import HARDWARE, ModelShape, roofline_profile
from deploy.planner.report import Slo, plot, table
from deploy.planner.search import recommend, search, why
from deploy.planner.twin import SimConfig
from deploy.planner.workload import Workload, load_trace, poisson


def make_workload(args: argparse.Namespace, vocab_size: int, max_model_len: int) -> Workload:
    kind, _, value = args.workload.partition(":")
    if kind == "scenario":
        if value not in SCENARIOS:
            raise SystemExit(f"unknown scenario {value!r}; known: {sorted(SCENARIOS)}")
        return scenario_workload(value, vocab_size, max_model_len, args.seed)
    if kind == "poisson":
        return poisson(
            float(value),
            args.num_requests,
            tuple(args.prompt_len),
            tuple(args.output_len),
            seed=args.seed,
            burstiness=args.burstiness,
            vocab_size=vocab_size,
            max_model_len=max_model_len,
            num_prefix_groups=args.prefix_groups,
            prefix_len=args.prefix_len,
        )
    if kind == "trace":
        return load_trace(value, vocab_size=vocab_size, seed=args.seed)
    raise SystemExit(f"--workload must be scenario:NAME, poisson:RATE or trace:PATH, got {args.workload!r}")


def resolve_profile(
    args: argparse.Namespace, cfg: ClusterConfig
) -> tuple[CostProfile, SimConfig, int, Parallelism | None]:
    """The cost profile, the base deployment to vary, the model's vocabulary size, and the
    tensor-parallel sizes each pool may take (None: the config's own, budgets count workers)."""
    mdir = model_dir(cfg, args.model)
    shape = ModelShape.from_config(mdir)
    engine = cfg.engine_config(cfg.decode_pool)
    limit = engine.max_model_len(
        int(json.loads((mdir / "config.json").read_text())["max_position_embeddings"])
    )
    engines = {pool: cfg.engine_config(pool) for pool in POOLS}
    sizes = args.tensor_parallel_sizes
    par: Parallelism | None = None
    if args.gpu:
        hw = HARDWARE[args.gpu]
        profile = roofline_profile(hw, shape)
        par = gpu_parallelism(hw, shape, engines, profile, sizes or NODE_SIZES, limit)
        tp = cfg.pool(cfg.decode_pool).tensor_parallel_size
        # NOTE: the base's own blocks matter only to a plan without a size search (never: --gpu searches)
        num_blocks = par.kv_blocks[cfg.decode_pool].get(tp) or max(
            par.kv_blocks[cfg.decode_pool].values(), default=2
        )
    else:
        path = Path(args.profile) if args.profile else default_profile_path()
        if not path.exists():
            if args.profile:
                raise SystemExit(f"no cost profile at {path}")
            print(f"no calibrated profile at {path}: calibrating this machine first", flush=True)
            calibrate_main(["--config", args.config, "--out", str(path)])
        profile = CostProfile.load(path)
        num_blocks = cpu_kv_blocks(cfg, profile)
        if sizes:
            par = cpu_parallelism(profile, engines, sizes, num_blocks, limit)
    base = SimConfig.from_cluster(cfg, num_kv_blocks=num_blocks, max_model_len=limit)
    return profile, base, shape.vocab_size, par


def cpu_parallelism(
    profile: CostProfile, engines: dict[str, EngineConfig], sizes: Sequence[int], num_blocks: int, limit: int
) -> Parallelism:
    """A measured profile's sizes: only the one it was measured at times a step (the others refused)."""
    kv_blocks: dict[str, dict[int, int]] = {pool: {} for pool in engines}
    refused: dict[int, str] = {}
    for tp in sorted(set(sizes)):
        try:
            profile.with_tensor_parallel(tp)
        except ValueError as e:
            refused[tp] = str(e)
            continue
        for pool, engine in engines.items():
            kv_blocks[pool][tp] = engine.num_kv_blocks or num_blocks
    return Parallelism(kv_blocks, tuple(sorted(refused.items())), limit)


def plan_main(argv: Sequence[str] | None) -> int:
    p = argparse.ArgumentParser(prog="pdserve plan", description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--config", default=DEFAULT_CONFIG, help="cluster config whose engine/router settings to plan with"
    )
    p.add_argument(
        "--model", default=None, help="checkpoint directory (config.json is enough); default: the config's"
    )
    src = p.add_mutually_exclusive_group()
    src.add_argument("--profile", default=None, help=f"cost profile JSON (default: {default_profile_path()})")
    src.add_argument("--gpu", choices=sorted(HARDWARE), help="roofline estimate for this accelerator")
    p.add_argument(
        "--workload", default="scenario:staggered", help="scenario:NAME | poisson:RATE | trace:PATH"
    )
    p.add_argument("--num-requests", type=int, default=1000)
    p.add_argument("--prompt-len", type=int, nargs=2, default=(64, 512), metavar=("MIN", "MAX"))
    p.add_argument("--output-len", type=int, nargs=2, default=(32, 256), metavar=("MIN", "MAX"))
    p.add_argument("--burstiness", type=float, default=1.0)
    p.add_argument("--prefix-groups", type=int, default=0, help="poisson: requests share one of N prefixes")
    p.add_argument("--prefix-len", type=int, default=0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--workers",
        "--gpus",
        dest="workers",
        type=int,
        nargs="+",
        default=None,
        help="worker counts; with --gpu (or --tensor-parallel-sizes) GPU budgets; default: the config's",
    )
    p.add_argument(
        "--tensor-parallel-sizes",
        "--tp",
        dest="tensor_parallel_sizes",
        type=int,
        nargs="+",
        default=None,
        help=f"sizes a pool's workers may take (default with --gpu: {' '.join(map(str, NODE_SIZES))})",
    )
    p.add_argument("--split-mode", choices=["disaggregated", "conditional"], default=None)
    p.add_argument("--slo-ttft-ms", type=float, default=1000.0)
    p.add_argument("--slo-tbt-ms", type=float, default=100.0)
    p.add_argument("--slo-percentile", type=float, choices=[50.0, 90.0, 99.0], default=90.0)
    p.add_argument("--out", type=Path, default=Path("plan_results"))
    args = p.parse_args(argv)

    cfg = load_cluster_config(args.config)
    profile, base, vocab, par = resolve_profile(args, cfg)
    workload = make_workload(args, vocab, base.max_model_len if par is None else par.max_model_len)
    slo = Slo(args.slo_ttft_ms, args.slo_tbt_ms, args.slo_percentile)
    counts = args.workers or [base.num_workers if par is None else base.num_gpus]
    split_mode = args.split_mode or ("conditional" if base.mode == "conditional" else "disaggregated")
    print(f"profile: {profile.name} ({profile.source})")
    print(
        f"workload: {workload.name}, {len(workload)} requests; SLO: TTFT <= {slo.ttft_ms:g} ms, "
        f"TBT <= {slo.tbt_ms:g} ms at p{slo.percentile:g}; workers: {counts}",
        flush=True,
    )
    if par is not None:
        requests = workload.requests
        context = round(sum(r.prompt_len + r.output_len / 2 for r in requests) / max(1, len(requests)))
        print(step_table(profile, par, base.engine_of(cfg.decode_pool), context), flush=True)
    t0 = time.perf_counter()
    try:
        rows = search(base, counts, profile, workload, slo, split_mode=split_mode, parallelism=par)
    except ValueError as e:
        raise SystemExit(f"pdserve plan: {e}") from None
    best = recommend(rows)
    elapsed = time.perf_counter() - t0
    print(table([r.summary for r in rows], slo, best.config.label, per_gpu=par is not None))
    verdict = "meets" if best.summary.meets_slo else "misses (best effort)"
    print(
        f"recommended: {best.config.label} -- {verdict} the SLO: TTFT p{slo.percentile:g} "
        f"{best.summary.ttft_ms.at(slo.percentile):.0f} ms, TBT p{slo.percentile:g} "
        f"{best.summary.tbt_ms.at(slo.percentile):.1f} ms, {best.summary.slo_attainment:.1%} of requests "
        f"within SLO, goodput {best.summary.goodput_rps:.2f} req/s ({len(rows)} configurations simulated in "
        f"{elapsed:.1f} s)"
    )
    reasons = why(best, rows) if par is not None else []
    for line in reasons:
        print(f"  why: {line}")
    args.out.mkdir(parents=True, exist_ok=True)
    plan_yaml = args.out / "plan.yaml"
    plan_yaml.write_text(yaml.safe_dump(layout_config(cfg, best.config), sort_keys=False))
    print(f"config: {plan_yaml}")
    png = args.out / "plan.png"
    title = f"pdserve plan: {workload.name} on {profile.name}"
    if plot([r.summary for r in rows], slo, png, title, best.config.label):
        print(f"plot: {png}")
    (args.out / "plan.json").write_text(
        json.dumps(
            {
                "profile": profile.to_dict(),
                "workload": workload.name,
                "slo": asdict(slo),
                "recommended": best.config.label,
                "recommended_tensor_parallel_size": {
                    pool: best.config.tp_of(pool) for pool in best.config.pools
                },
                "why": reasons,
                "refused_tensor_parallel_sizes": dict(par.refused) if par is not None else {},
                "rows": [asdict(r.summary) for r in rows],
            },
            indent=1,
        )
    )
    return 0


def calibrate_main(argv: Sequence[str] | None) -> int:
    from deploy.plan.calibrate import calibrate_command

    return calibrate_command(argv)


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] == "calibrate":
        return calibrate_main(argv[1:])
    if argv and argv[0] == "validate":
        from deploy.plan.validate import validate_command

        return validate_command(argv[1:])
    if argv and argv[0] == "spread":
        from deploy.plan.spread import spread_command

        return spread_command(argv[1:])
    return plan_main(argv)
