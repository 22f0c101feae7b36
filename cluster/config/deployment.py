"""A whole deployment: ``PoolConfig`` (one pool of identical workers) and ``ClusterConfig`` (the model,
the shared ``engine:`` section, the pools, transfer, router, server and logs), read from the YAML's
mapping (``ClusterConfig.from_dict`` / ``from_yaml``) with every error naming its key's full path."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from cluster.config.checking import check_keys, convert, from_dict, require
from cluster.config.engine import EngineConfig, ModelConfig
from cluster.config.services import LogConfig, RouterConfig, ServerConfig, TransferConfig

PLACEMENT_STRATEGIES = ("PACK", "SPREAD")
NETWORKS = ("auto", "loopback", "node")
POOLS = ("prefill", "decode", "colocated")
DEFAULT_MAX_RESTARTS = 3  # restarts of one worker over its life (Ray's max_restarts): PoolConfig
# KV blocks move between pools, and the router hashes prompts in blocks: one block size for every pool
CLUSTER_WIDE_ENGINE_KEYS = ("block_size",)


@dataclass(frozen=True)
class PoolConfig:
    """One pool of identical workers. num_gpus 0 runs on CPU; 1 pins each worker to its own GPU.
    engine: this pool's engine settings over the cluster's shared ``engine:`` section (EngineConfig
    fields except model and block_size), e.g. a decode pool's ``max_num_seqs``; checked by ClusterConfig,
    which knows the shared section (``ClusterConfig.engine_config(pool)`` gives the merged EngineConfig)."""

    num_workers: int = 1
    num_gpus: float = 0.0
    num_cpus: float = 1.0
    torch_threads: int = 1  # CPU workers: threads per worker (2 workers on 2 cores: 1 each)
    # NOTE: a dead worker is replaced by default (a deployment must not stay half-dead after its first
    # crash), but not forever: Ray's per-actor count over the worker's life, so one that keeps crashing
    # stays dead after its last restart (its requests migrate; `scale` adds a fresh one). 0: never
    # restarted; -1: always.
    max_restarts: int = DEFAULT_MAX_RESTARTS
    # custom Ray resources each worker needs, e.g. {"host_b": 1} pins the pool to nodes that offer it
    resources: dict[str, float] = field(default_factory=dict)
    engine: dict[str, Any] = field(default_factory=dict)
    # ranks per worker (tensor parallelism): each rank is a process with num_gpus / num_cpus of its own,
    # all ranks of a worker on one node (a Ray placement group, STRICT_PACK)
    tensor_parallel_size: int = 1

    def __post_init__(self) -> None:
        require(
            1 <= self.tensor_parallel_size <= 64,
            f"tensor_parallel_size must be in [1, 64], got {self.tensor_parallel_size}",
        )
        require(self.num_workers >= 0, f"num_workers must be >= 0, got {self.num_workers}")
        require(self.num_gpus in (0, 0.0, 1, 1.0), f"num_gpus must be 0 or 1 per worker, got {self.num_gpus}")
        require(self.num_cpus >= 0, f"num_cpus must be >= 0, got {self.num_cpus}")
        require(self.torch_threads >= 1, f"torch_threads must be >= 1, got {self.torch_threads}")
        require(self.max_restarts >= -1, f"max_restarts must be >= -1 (-1: always), got {self.max_restarts}")


# model: its own section; tensor_parallel_size: the pool's own key (pools.<pool>.tensor_parallel_size)
_ENGINE_KEYS = {f.name for f in dataclasses.fields(EngineConfig)} - {"model", "tensor_parallel_size"}


@dataclass(frozen=True)
class ClusterConfig:
    """A whole deployment: the model, engine options shared by every worker, the pools, transfer,
    router and HTTP server. Pools: ``prefill`` + ``decode`` (disaggregated / conditional) or
    ``colocated``; each pool's own ``engine:`` keys override the shared ones (``engine_config(pool)``)."""

    model: ModelConfig = field(default_factory=ModelConfig)
    engine: dict[str, Any] = field(default_factory=dict)  # EngineConfig fields except model: every pool's
    prefill: PoolConfig = field(default_factory=PoolConfig)
    decode: PoolConfig = field(default_factory=PoolConfig)
    colocated: PoolConfig = field(default_factory=lambda: PoolConfig(num_workers=0))
    transfer: TransferConfig = field(default_factory=TransferConfig)
    router: RouterConfig = field(default_factory=RouterConfig)
    server: ServerConfig = field(default_factory=ServerConfig)
    log: LogConfig = field(default_factory=LogConfig)
    # PACK: Ray's default placement (fills a node first); SPREAD: spread workers over nodes
    placement_strategy: str = "PACK"
    ray_address: str | None = None  # None: join RAY_ADDRESS if set, else start a local cluster
    # which address every socket binds and advertises: loopback (one host), the node's own address
    # (several hosts), or auto (loopback when the Ray cluster has one node)
    network: str = "auto"
    # CPU workers on one host: pin worker k to CPU core k (round-robin over the driver's cores), so two
    # workers on two cores stand for two devices (benchmarks comparing modes on equal hardware)
    pin_cpu_cores: bool = False

    def __post_init__(self) -> None:
        require(
            "tensor_parallel_size" not in self.engine,
            "tensor_parallel_size is a pool's: set pools.<pool>.tensor_parallel_size",
        )
        # NOTE: the shared section alone first, so an error names the section its key is in
        check_keys(self.engine, "engine", _ENGINE_KEYS)
        from_dict(EngineConfig, {**self.engine, "model": self.model}, "engine")
        for pool in POOLS:
            own = self.pool(pool).engine
            for key in CLUSTER_WIDE_ENGINE_KEYS:
                require(
                    key not in own,
                    f"pools.{pool}.engine.{key} is one for every pool: set engine.{key} instead",
                )
            check_keys(own, f"pools.{pool}.engine", _ENGINE_KEYS)
            self.engine_config(pool)
        require(
            self.placement_strategy in PLACEMENT_STRATEGIES,
            f"placement_strategy must be one of {PLACEMENT_STRATEGIES}, got {self.placement_strategy!r}",
        )
        require(self.network in NETWORKS, f"network must be one of {NETWORKS}, got {self.network!r}")
        if self.router.mode == "colocated":
            require(
                self.colocated.num_workers >= 1,
                "router mode colocated needs pools.colocated.num_workers >= 1",
            )
        else:
            require(
                self.prefill.num_workers >= 1,
                f"router mode {self.router.mode} needs pools.prefill.num_workers >= 1",
            )
            require(
                self.decode.num_workers >= 1,
                f"router mode {self.router.mode} needs pools.decode.num_workers >= 1",
            )

    @property
    def pool_names(self) -> tuple[str, ...]:
        """The pools the router mode runs: ``("colocated",)`` or ``("prefill", "decode")``."""
        return ("colocated",) if self.router.mode == "colocated" else ("prefill", "decode")

    @property
    def prefill_pool(self) -> str:
        """The pool that prefills prompts (the router predicts TTFT with its token budget)."""
        return self.pool_names[0]

    @property
    def decode_pool(self) -> str:
        """The pool that decodes, holding each request's KV to its end."""
        return self.pool_names[-1]

    def pool(self, name: str) -> PoolConfig:
        require(name in POOLS, f"pool must be one of {POOLS}, got {name!r}")
        return {"prefill": self.prefill, "decode": self.decode, "colocated": self.colocated}[name]

    def engine_config(self, pool: str) -> EngineConfig:
        """``pool``'s workers' engine: the shared ``engine:`` section, the pool's own ``engine:`` over it."""
        own = self.pool(pool)
        merged = {**self.engine, **own.engine, "model": self.model}
        merged["tensor_parallel_size"] = own.tensor_parallel_size
        return from_dict(EngineConfig, merged, f"pools.{pool}.engine")

    def engine_configs(self) -> dict[str, EngineConfig]:
        """The engine of every pool the router mode runs, by pool."""
        return {pool: self.engine_config(pool) for pool in self.pool_names}

    def to_dict(self) -> dict[str, Any]:
        """The YAML's mapping of this config (``from_dict(to_dict())`` equals it; plain JSON types)."""
        data = dataclasses.asdict(self)
        data["pools"] = {name: data.pop(name) for name in POOLS}
        return data

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> ClusterConfig:
        """From the YAML's mapping: the pools under ``pools:`` (``pools.decode.engine.max_num_seqs``), every
        other section at the top; each value is checked and an error names its key's full path. A section
        left empty (``model:``, ``pools.decode:``) takes its defaults."""
        require(isinstance(data, dict), f"a cluster config must be a mapping, got {type(data).__name__}")
        misplaced = sorted(set(data) & set(POOLS))
        require(
            not misplaced, f"{misplaced} must be under pools: (e.g. pools.{(misplaced or ['decode'])[0]})"
        )
        check_keys(data, cls.__name__, _YAML_KEYS)
        pools = convert({} if data.get("pools") is None else data["pools"], dict[str, Any], "pools")
        check_keys(pools, "pools", set(POOLS))
        values = {
            k: from_dict(_SECTIONS[k], {} if v is None else v, k) if k in _SECTIONS else v
            for k, v in data.items()
            if k != "pools"
        }
        for name, pool in pools.items():
            values[name] = from_dict(PoolConfig, {} if pool is None else pool, f"pools.{name}")
        return from_dict(cls, values)

    @classmethod
    def from_yaml(cls, path: str) -> ClusterConfig:
        import yaml

        with open(path) as f:
            data = yaml.safe_load(f) or {}
        if not isinstance(data, dict):
            raise ValueError(f"{path}: top level must be a mapping")
        return cls.from_dict(data)


# the YAML's sections that are config dataclasses of their own, and every key its top level may hold
_SECTIONS: dict[str, type] = {
    "model": ModelConfig,
    "transfer": TransferConfig,
    "router": RouterConfig,
    "server": ServerConfig,
    "log": LogConfig,
}
_YAML_KEYS = {f.name for f in dataclasses.fields(ClusterConfig)} - set(POOLS) | {"pools"}
