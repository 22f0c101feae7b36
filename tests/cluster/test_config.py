"""The config's checking (cluster/config/checking.py, by msgspec): a mapping becomes a frozen config or a
ValueError whose message names the key's full path, the type it must have and the value given. The
messages the CLI prints for a YAML file: tests/deploy/test_cli.py; per-pool engines:
tests/deploy/test_pool_engines.py."""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import pytest

from cluster.config import ClusterConfig, EngineConfig, PoolConfig, RouterConfig, ServerConfig, from_dict

# NOTE: tensor_parallel_size is a pool's own key (pools.<pool>.tensor_parallel_size), not an engine option
ENGINE_KEYS = sorted(
    f.name for f in dataclasses.fields(EngineConfig) if f.name not in ("model", "tensor_parallel_size")
)
TOP_KEYS = [
    "engine",
    "log",
    "model",
    "network",
    "pin_cpu_cores",
    "placement_strategy",
    "pools",
    "ray_address",
    "router",
    "server",
    "transfer",
]

BAD_CONFIGS = [
    # an unknown key, however deep, names its mapping's full path and every unknown key in it
    (
        {"pools": {"decode": {"engine": {"max_num_seqs": 8, "swap": 1, "bogus": 2}}}},
        f"unknown pools.decode.engine option(s) ['bogus', 'swap']; known: {ENGINE_KEYS}",
    ),
    ({"foo": 1}, f"unknown ClusterConfig option(s) ['foo']; known: {TOP_KEYS}"),
    (
        {"model": {"pth": "x"}},
        "unknown model option(s) ['pth']; known: ['dtype', 'max_model_len', 'path', 'revision']",
    ),
    # bool is not an int, nor a float
    ({"engine": {"max_num_seqs": True}}, "engine.max_num_seqs must be int, got True (bool)"),
    (
        {"pools": {"decode": {"engine": {"max_num_seqs": False}}}},
        "pools.decode.engine.max_num_seqs must be int, got False (bool)",
    ),
    ({"router": {"request_timeout_s": True}}, "router.request_timeout_s must be float, got True (bool)"),
    # a string is not a number
    (
        {"engine": {"gpu_memory_utilization": "0.5"}},
        "engine.gpu_memory_utilization must be float, got '0.5' (str)",
    ),
    (
        {"pools": {"prefill": {"num_cpus": "2"}}},
        "pools.prefill.num_cpus must be float, got '2' (str)",
    ),
    # a float must be finite
    ({"transfer": {"timeout_s": math.inf}}, "transfer.timeout_s must be float, got inf (float)"),
    ({"router": {"ttft_slo_ms": math.nan}}, "router.ttft_slo_ms must be float or null, got nan (float)"),
    (
        {"pools": {"colocated": {"engine": {"gpu_memory_utilization": -math.inf}}}},
        "pools.colocated.engine.gpu_memory_utilization must be float, got -inf (float)",
    ),
    # a list where a mapping belongs
    ({"pools": {"decode": {"engine": [1, 2]}}}, "pools.decode.engine must be dict, got [1, 2] (list)"),
    ({"pools": ["decode"]}, "pools must be dict, got ['decode'] (list)"),
    ({"model": ["x"]}, "model must be a mapping, got list"),
    ({"pools": {"decode": []}}, "pools.decode must be a mapping, got list"),
    (
        {"pools": {"decode": {"resources": ["gpu"]}}},
        "pools.decode.resources must be dict, got ['gpu'] (list)",
    ),
    # None only where the type says so
    ({"engine": {"max_num_seqs": None}}, "engine.max_num_seqs must be int, got None (NoneType)"),
    ({"server": {"host": None}}, "server.host must be str, got None (NoneType)"),
    ({"engine": None}, "engine must be dict, got None (NoneType)"),
    # a mapping's values are typed too
    (
        {"pools": {"decode": {"resources": {"host_b": "yes"}}}},
        "pools.decode.resources.host_b must be float, got 'yes' (str)",
    ),
    # a constructor's own check names the key's path when it names its field first
    ({"model": {"max_model_len": 0}}, "model.max_model_len must be >= 1, got 0"),
    (
        {"router": {"router_lease_s": 1}},
        "router.router_lease_s must be >= 4 x health_interval_s (2), got 1.0",
    ),
    ({"transfer": {"backend": "ucx"}}, "transfer backend must be one of ('auto', 'gloo', 'nccl')"),
    ({"router": {"mode": "colocated"}}, "router mode colocated needs pools.colocated.num_workers >= 1"),
]


@pytest.mark.parametrize(("data", "message"), BAD_CONFIGS, ids=[m[:50] for _, m in BAD_CONFIGS])
def test_a_bad_value_is_an_error_naming_its_path_type_and_value(data: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError) as info:
        ClusterConfig.from_dict(data)
    assert str(info.value) == message


def test_values_take_their_declared_types() -> None:
    cfg = ClusterConfig.from_dict(
        {
            "model": None,  # an empty section: its defaults
            "router": {"request_timeout_s": 10, "ttft_slo_ms": None},
            "pools": {"prefill": None, "decode": {"num_cpus": 2, "resources": {"host_b": 1}}},
        }
    )
    # an int where a float is expected is taken, as a float
    assert cfg.router == RouterConfig(request_timeout_s=10.0)
    assert type(cfg.router.request_timeout_s) is float and type(cfg.decode.num_cpus) is float
    assert cfg.decode == PoolConfig(num_cpus=2.0, resources={"host_b": 1.0})
    assert type(cfg.decode.resources["host_b"]) is float
    assert (cfg.model, cfg.prefill) == (ClusterConfig().model, PoolConfig())


def test_to_dict_round_trips() -> None:
    cfg = ClusterConfig.from_dict(
        {
            "model": {"path": "org/name", "revision": "main", "max_model_len": 512},
            "engine": {"max_num_seqs": 8, "gpu_memory_utilization": 0.5},
            "pools": {
                "decode": {"num_workers": 2, "resources": {"host_b": 1}, "engine": {"max_num_seqs": 32}}
            },
            "server": {"api_key": "k", "port": 9000},
            "router": {"mode": "conditional", "ttft_slo_ms": 250},
        }
    )
    assert ClusterConfig.from_dict(cfg.to_dict()) == cfg
    assert cfg.engine_config("decode").max_num_seqs == 32 and cfg.engine_config("prefill").max_num_seqs == 8


def test_a_config_built_in_code_has_its_engine_sections_checked_the_same_way() -> None:
    with pytest.raises(ValueError) as shared:
        ClusterConfig(engine={"max_num_seqs": "64"})
    assert str(shared.value) == "engine.max_num_seqs must be int, got '64' (str)"
    with pytest.raises(ValueError) as own:
        ClusterConfig(decode=PoolConfig(engine={"enforce_eager": 1}))
    assert str(own.value) == "pools.decode.engine.enforce_eager must be bool, got 1 (int)"
    assert ServerConfig("0.0.0.0", 9000).port == 9000  # direct construction stays plain dataclass


def test_the_offline_options_are_checked_with_their_paths() -> None:
    assert EngineConfig.from_options("m", max_model_len=64, max_num_seqs=4) == from_dict(
        EngineConfig, {"model": {"path": "m", "max_model_len": 64}, "max_num_seqs": 4}
    )
    with pytest.raises(ValueError) as typed:
        EngineConfig.from_options("m", max_model_len="5")
    assert str(typed.value) == "model.max_model_len must be int or null, got '5' (str)"
    with pytest.raises(ValueError) as ranged:
        EngineConfig.from_options("m", max_model_len=0)
    assert str(ranged.value) == "model.max_model_len must be >= 1, got 0"
    with pytest.raises(ValueError) as unknown:
        EngineConfig.from_options("m", max_num_seq=4)
    assert str(unknown.value).startswith("unknown EngineConfig option(s) ['max_num_seq']; known: [")


def test_from_dict_takes_a_dataclass_only() -> None:
    with pytest.raises(TypeError, match="is not a dataclass"):
        from_dict(dict, {})


def test_tensor_parallel_size_is_a_pools_and_the_flags_set_it() -> None:
    from deploy.cli import build_parser
    from deploy.cli_args import build_config

    cfg = ClusterConfig.from_dict(
        {
            "pools": {"colocated": {"num_workers": 1, "tensor_parallel_size": 4}},
            "router": {"mode": "colocated"},
        }
    )
    assert cfg.engine_config("colocated").tensor_parallel_size == 4
    with pytest.raises(
        ValueError, match=r"tensor_parallel_size is a pool's: set pools.<pool>.tensor_parallel_size"
    ):
        ClusterConfig.from_dict({"engine": {"tensor_parallel_size": 2}})
    with pytest.raises(ValueError, match=r"pools.prefill.tensor_parallel_size must be in \[1, 64\], got 0"):
        ClusterConfig.from_dict({"pools": {"prefill": {"tensor_parallel_size": 0}}})
    args = ["serve", "--config", "deploy/cpu-colocated.yaml", "--tensor-parallel-size", "2"]
    assert build_config(build_parser().parse_args(args)).colocated.tensor_parallel_size == 2
