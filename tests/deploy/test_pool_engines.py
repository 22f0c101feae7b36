"""Per-pool engine settings: a pool's own ``engine:`` keys over the cluster's shared ``engine:`` section,
checked like every other key (errors name the key's full path), read by the planner's twin per pool;
and the one derivation of ``max_model_len``. The cluster that runs them: tests/e2e/test_pool_engines.py."""

from __future__ import annotations

from pathlib import Path

import pytest

from cluster.config import ClusterConfig, EngineConfig, ModelConfig, from_dict
from deploy.cli_args import PACKAGE_DIR
from deploy.planner.twin import SimConfig, SimWorker

POOLS_YAML = """
model: {path: "", dtype: float32}
engine: {block_size: 16, num_kv_blocks: 256, max_num_seqs: 8, max_num_batched_tokens: 512}
pools:
  prefill: {num_workers: 1, engine: {max_num_batched_tokens: 4096}}
  decode: {num_workers: 2, engine: {max_num_seqs: 32, num_kv_blocks: 1024}}
"""


def test_a_pools_own_engine_keys_override_the_shared_ones(tmp_path: Path) -> None:
    path = tmp_path / "pools.yaml"
    path.write_text(POOLS_YAML)
    cfg = ClusterConfig.from_yaml(str(path))
    shared = EngineConfig(
        model=ModelConfig(dtype="float32"),
        block_size=16,
        num_kv_blocks=256,
        max_num_seqs=8,
        max_num_batched_tokens=512,
    )
    assert cfg.engine_configs() == {
        "prefill": EngineConfig(**{**vars(shared), "max_num_batched_tokens": 4096}),
        "decode": EngineConfig(**{**vars(shared), "max_num_seqs": 32, "num_kv_blocks": 1024}),
    }
    assert cfg.engine_config("colocated") == shared  # a pool without keys of its own: the shared section
    assert (cfg.prefill_pool, cfg.decode_pool) == ("prefill", "decode")
    colocated = ClusterConfig.from_dict(
        {"router": {"mode": "colocated"}, "pools": {"colocated": {"num_workers": 1}}}
    )
    assert colocated.engine_configs() == {"colocated": EngineConfig()}
    assert (colocated.prefill_pool, colocated.decode_pool) == ("colocated", "colocated")


@pytest.mark.parametrize("name", sorted(p.name for p in PACKAGE_DIR.glob("*.yaml")))
def test_todays_yaml_files_give_every_pool_the_shared_engine(name: str) -> None:
    data = ClusterConfig.from_yaml(str(PACKAGE_DIR / name))
    shared = from_dict(EngineConfig, {**data.engine, "model": data.model}, "engine")
    assert set(data.engine_configs().values()) == {shared}


BAD_POOL_ENGINES = [
    (
        {"pools": {"decode": {"engine": {"max_num_seqs": 0}}}},
        "pools.decode.engine.max_num_seqs must be >= 1, got 0",
    ),
    (
        {"pools": {"decode": {"engine": {"max_num_seqs": "64"}}}},
        "pools.decode.engine.max_num_seqs must be int, got '64' (str)",
    ),
    ({"pools": {"prefill": {"engine": {"device": "tpu"}}}}, "pools.prefill.engine.device must be one of"),
    (
        {"pools": {"colocated": {"engine": {"gpu_memory_utilization": 2.0}}}},
        "pools.colocated.engine.gpu_memory_utilization",
    ),
    (
        {"pools": {"decode": {"engine": {"max_num_seq": 64}}}},
        "unknown pools.decode.engine option(s) ['max_num_seq']",
    ),
    (
        {"pools": {"decode": {"engine": {"block_size": 32}}}},
        "pools.decode.engine.block_size is one for every pool",
    ),
    ({"pools": {"decode": {"engine": 64}}}, "pools.decode.engine must be dict, got 64 (int)"),
    ({"pools": {"decoder": {"num_workers": 1}}}, "unknown pools option(s) ['decoder']"),
    ({"pools": {"decode": {"num_workers": -1}}}, "pools.decode.num_workers must be >= 0, got -1"),
    ({"decode": {"num_workers": 1}}, "['decode'] must be under pools: (e.g. pools.decode)"),
    ({"engine": {"max_num_seqs": 0}}, "engine.max_num_seqs must be >= 1, got 0"),
    ({"engine": {"model": {"path": "x"}}}, "unknown engine option(s) ['model']"),
]


@pytest.mark.parametrize(("data", "message"), BAD_POOL_ENGINES, ids=[m[:40] for _, m in BAD_POOL_ENGINES])
def test_a_bad_pool_engine_key_is_an_error_naming_its_full_path(
    data: dict[str, object], message: str
) -> None:
    with pytest.raises(ValueError) as info:
        ClusterConfig.from_dict(data)
    assert str(info.value).startswith(message), str(info.value)


def test_the_twin_gives_each_pool_its_own_engine(tmp_path: Path) -> None:
    path = tmp_path / "pools.yaml"
    path.write_text(POOLS_YAML)
    cfg = ClusterConfig.from_yaml(str(path))
    sim = SimConfig.from_cluster(cfg, num_kv_blocks=256, max_model_len=8192)
    assert (sim.num_prefill, sim.num_decode, sim.max_model_len) == (1, 2, 255 * 16)
    for pool in ("prefill", "decode"):
        assert sim.engine_of(pool) == cfg.engine_config(pool)
        assert SimWorker(f"{pool}-0", pool, sim).scheduler.config == cfg.engine_config(pool)
    # what-if splits keep the pools' settings; colocated workers run the colocated pool's
    assert sim.split(2, 1).engine_of("decode").max_num_seqs == 32
    assert sim.colocated(2).engine_of("colocated") == cfg.engine_config("colocated")
    plain = SimConfig("disaggregated", num_prefill=1, num_decode=1)
    assert plain.engine_of("prefill") == plain.engine_of("decode") == plain.engine


def test_max_model_len_is_derived_in_one_place() -> None:
    """EngineConfig.max_model_len: the config's limit, else the checkpoint's; the KV pool caps it."""
    engine = EngineConfig(block_size=16)
    assert engine.max_model_len(4096) == 4096
    assert engine.max_model_len(4096, num_kv_blocks=101) == 1600  # block 0 is reserved
    assert engine.max_model_len(4096, num_kv_blocks=1000) == 4096
    capped = EngineConfig(model=ModelConfig(max_model_len=512), block_size=16)
    assert capped.max_model_len(4096) == 512
    assert capped.max_model_len(4096, num_kv_blocks=11) == 160
