"""Frozen configuration dataclasses.

Every value a user sets lives here; values discovered at run time (resolved dtype, device, number of KV
blocks sized from memory) live on the engine, never back on a config. Unknown keys are an error, and so
is a value of the wrong type: ``checking`` turns a mapping into a checked config by msgspec, every error
naming the key's full path (``pools.decode.engine.max_num_seqs must be int, got '64' (str)``).
This package imports nothing of the project.

- ``engine``: ``ModelConfig``, ``EngineConfig``
- ``services``: ``TransferConfig``, ``RouterConfig``, ``ServerConfig``, ``LogConfig``
- ``deployment``: ``PoolConfig``, ``ClusterConfig`` (``from_dict``, ``from_yaml``)
- ``checking``: a mapping -> a checked config dataclass (``from_dict``)
"""

from __future__ import annotations

from cluster.config.checking import from_dict
from cluster.config.deployment import (
    CLUSTER_WIDE_ENGINE_KEYS,
    DEFAULT_MAX_RESTARTS,
    NETWORKS,
    PLACEMENT_STRATEGIES,
    POOLS,
    ClusterConfig,
    PoolConfig,
)
from cluster.config.engine import (
    ATTENTION_BACKENDS,
    DEVICES,
    DTYPES,
    LOAD_FORMATS,
    MAX_GRAMMAR_RULES,
    MAX_STRUCTURED_SPEC_CHARS,
    EngineConfig,
    ModelConfig,
)
from cluster.config.services import (
    ADMISSION_POLICIES,
    FAILURE_POLICIES,
    LOG_FORMATS,
    LOG_LEVELS,
    METRICS_COMPAT,
    PREFIX_ROUTING,
    ROUTER_MODES,
    TOOL_CALL_PARSERS,
    TRANSFER_BACKENDS,
    TRANSFER_INTEGRITY,
    LogConfig,
    RouterConfig,
    ServerConfig,
    TransferConfig,
)

__all__ = [
    "ADMISSION_POLICIES",
    "ATTENTION_BACKENDS",
    "CLUSTER_WIDE_ENGINE_KEYS",
    "DEFAULT_MAX_RESTARTS",
    "DEVICES",
    "DTYPES",
    "FAILURE_POLICIES",
    "LOAD_FORMATS",
    "LOG_FORMATS",
    "LOG_LEVELS",
    "MAX_GRAMMAR_RULES",
    "MAX_STRUCTURED_SPEC_CHARS",
    "METRICS_COMPAT",
    "NETWORKS",
    "PLACEMENT_STRATEGIES",
    "POOLS",
    "PREFIX_ROUTING",
    "ROUTER_MODES",
    "TOOL_CALL_PARSERS",
    "TRANSFER_BACKENDS",
    "TRANSFER_INTEGRITY",
    "ClusterConfig",
    "EngineConfig",
    "LogConfig",
    "ModelConfig",
    "PoolConfig",
    "RouterConfig",
    "ServerConfig",
    "TransferConfig",
    "from_dict",
]
