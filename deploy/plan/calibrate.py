"""``pdserve plan calibrate``: fit this machine's cost profile.

The engine sweep (deploy/planner/calibrate.py) fits the step model. With ``--probe`` the sweep runs in a
Ray worker process (scheduled by the OS like the cluster's own workers, which on a shared host is not
like the driver) and the cluster of ``--config`` is started to measure what surrounds a step there (the
cluster probe: deploy/plan/probe.py, whose docstring lists every term it fits).
"""

from __future__ import annotations

import argparse
import asyncio
import json
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from cluster.config import ClusterConfig, EngineConfig
from cluster.cost_model import CostProfile
from deploy.plan.harness import running_cluster
from deploy.plan.inputs import DEFAULT_CONFIG, default_profile_path, load_cluster_config
from deploy.plan.probe import probe
from deploy.planner.calibrate import Sample

if TYPE_CHECKING:
    from deploy.launch import Cluster


def _calibration_task(
    engine_config: EngineConfig, reps: int, seed: int, threads: int
) -> tuple[dict[str, Any], list[Sample]]:
    import torch

    from deploy.planner.calibrate import calibrate

    torch.set_num_threads(threads)
    profile, samples = calibrate(engine_config, reps=reps, seed=seed)
    return profile.to_dict(), samples


def calibrate_profile(
    cfg: ClusterConfig, *, reps: int, seed: int, in_ray: bool, verbose: bool = True
) -> CostProfile:
    """The engine sweep with one worker's thread count: here, or (``in_ray``) in a Ray worker process;
    Ray must be up for that (a running cluster)."""
    from deploy.planner.calibrate import fit_table

    pool = cfg.colocated if cfg.router.mode == "colocated" else cfg.decode
    engine = cfg.engine_config(cfg.decode_pool)
    if in_ray:
        import ray

        task = ray.remote(num_cpus=max(pool.num_cpus, 0.001))(_calibration_task)
        ref = task.remote(engine, reps, seed, pool.torch_threads)
        data, samples = ray.get(ref, timeout=3600)
    else:
        data, samples = _calibration_task(engine, reps, seed, pool.torch_threads)
    profile = CostProfile.from_dict(data)
    if verbose:
        print(fit_table(profile, samples), flush=True)
    return profile


def calibrate_and_probe(url: str, handle: Cluster, *, reps: int, seed: int) -> CostProfile:
    """On a running cluster: the sweep in a Ray worker, then the probe."""
    sweep = calibrate_profile(handle.config, reps=reps, seed=seed, in_ray=True)
    return probe_and_report(url, handle, sweep, seed)


def probe_and_report(
    url: str, handle: Cluster, sweep: CostProfile, seed: int, label: str = ""
) -> CostProfile:
    """The probe over the sweep's profile `sweep`; prints its figures (``cluster probe<label>: {...}``)."""
    profile, report = asyncio.run(probe(url, handle, sweep, seed))
    print(f"cluster probe{label}: " + json.dumps({k: _round(v) for k, v in report.items()}), flush=True)
    return profile


def mock_probe_and_report(
    url: str, handle: Cluster, profile: CostProfile, seed: int, label: str = ""
) -> CostProfile:
    """The mock probe (deploy/plan/mock_probe.py) over ``profile``, the one the mock workers wait; prints
    its figures (``mock cluster probe<label>: {...}``)."""
    from deploy.plan.mock_probe import probe_mock

    measured, report = probe_mock(url, handle, profile, seed)
    print(f"mock cluster probe{label}: " + json.dumps(_round(report)), flush=True)
    return measured


def _round(v: Any) -> Any:
    if isinstance(v, dict):
        return {k: _round(x) for k, x in v.items()}
    if isinstance(v, list):
        return [_round(x) for x in v]
    return round(v, 3) if isinstance(v, float) else v


def calibrate_command(argv: Sequence[str] | None) -> int:
    p = argparse.ArgumentParser(prog="pdserve plan calibrate", description="fit this machine's cost profile")
    p.add_argument(
        "--config", default=DEFAULT_CONFIG, help="the engine settings (and, with --probe, cluster)"
    )
    p.add_argument("--out", type=Path, default=default_profile_path())
    p.add_argument("--reps", type=int, default=5, help="repetitions of each step shape")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--probe", action="store_true", help="start the cluster: sweep in Ray, measure around it")
    args = p.parse_args(argv)
    cfg = load_cluster_config(args.config)
    if args.probe:
        with running_cluster(cfg) as (url, handle):
            profile = calibrate_and_probe(url, handle, reps=args.reps, seed=args.seed)
    else:
        profile = calibrate_profile(cfg, reps=args.reps, seed=args.seed, in_ray=False)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    profile.save(args.out)
    print(f"profile written to {args.out}: {profile.source}")
    return 0
