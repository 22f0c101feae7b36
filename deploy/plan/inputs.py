"""What every ``pdserve plan`` subcommand starts from: the cluster config, the model directory, the KV
blocks of a CPU worker and the twin of a cluster, the default cost profile, and the seeded workloads in
the twin's terms (the load generator's scenarios: the very same prompts and send times)."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

from cluster import cost_model
from cluster.config import ClusterConfig
from cluster.cost_model import CostProfile
from deploy.loadgen import SCENARIOS, Scenario, arrival_offsets, build_dataset
from deploy.planner.twin import SimConfig
from deploy.planner.workload import Workload, from_prompts

REPO = Path(__file__).resolve().parents[2]
BUNDLED_MODEL = REPO / "workers" / "assets" / "pdserve-tiny"
DEFAULT_CONFIG = "deploy/cpu-disagg.yaml"


def default_profile_path() -> Path:
    return cost_model.default_profile_path()


def load_cluster_config(path: str) -> ClusterConfig:
    p = Path(path)
    return ClusterConfig.from_yaml(str(p if p.exists() or p.is_absolute() else REPO / p))


def model_dir(cfg: ClusterConfig, override: str | None) -> Path:
    return Path(override or cfg.model.path or BUNDLED_MODEL)


def mock_step_profile(cfg: ClusterConfig) -> CostProfile | None:
    """The cost profile a mock cluster's workers wait (``engine.mock_cost_profile``: a path, or "default"
    for ``pdserve plan calibrate``'s); None for any other cluster, or a mock one without a profile."""
    engine = cfg.engine_config(cfg.decode_pool)
    if engine.load_format != "mock" or not engine.mock_cost_profile:
        return None
    name = engine.mock_cost_profile
    return CostProfile.load(default_profile_path() if name == "default" else Path(name).expanduser())


def cpu_kv_blocks(cfg: ClusterConfig, profile: CostProfile) -> int:
    """KV blocks of one CPU worker of the decode pool (the pool that holds each request's KV to its end):
    the config's, else sized from cpu_kv_cache_bytes as the runner does."""
    engine = cfg.engine_config(cfg.decode_pool)
    per_block = engine.block_size * profile.kv_bytes_per_token
    return engine.num_kv_blocks or max(2, engine.cpu_kv_cache_bytes // per_block + 1)


def twin_config(cfg: ClusterConfig, profile: CostProfile, max_model_len: int) -> SimConfig:
    """The twin of ``cfg``'s cluster, with the KV blocks a CPU worker of ``profile`` gets."""
    return SimConfig.from_cluster(cfg, num_kv_blocks=cpu_kv_blocks(cfg, profile), max_model_len=max_model_len)


def scenario_workload(
    name: str, vocab_size: int, max_model_len: int, seed: int, scale: float = 1.0
) -> Workload:
    """One of ``pdserve bench serve``'s scenarios: the same seeded prompts and send times."""
    s = SCENARIOS[name]
    n = max(1, round(s.num_requests * scale))
    s = replace(
        s, num_requests=n, max_concurrency=None if s.max_concurrency is None else min(s.max_concurrency, n)
    )
    return workload_of(name, s, vocab_size, max_model_len, seed)


def workload_of(name: str, s: Scenario, vocab_size: int, max_model_len: int, seed: int) -> Workload:
    """The simulator's copy of a ``pdserve bench serve`` run of ``s``: the same seeded prompts, send
    times and concurrency."""
    dataset = build_dataset(s, vocab_size, max_model_len, seed)
    return from_prompts(
        name, dataset, arrival_offsets(s, seed), vocab_size=vocab_size, max_concurrency=s.max_concurrency
    )
