"""bench/offline.py (issue 42 item 3): ``--variant`` values reach the config with the types a YAML file
would give them, and the host-overhead measurement runs with the null forward under both schedulers
(NullModel has every method the runner calls on a model: the argmax-only path and the logits path)."""

from __future__ import annotations

import pytest
import torch

from bench.offline import NullModel, host_overhead, parse_value, parse_variant
from cluster.config import EngineConfig
from workers.engine import BUNDLED_MODEL


@pytest.mark.parametrize(
    ("raw", "expected"),
    [
        ("true", True),
        ("false", False),
        ("True", True),
        ("null", None),
        ("~", None),
        ("None", None),
        ("64", 64),
        (" 1.5 ", 1.5),
        ("1e-3", 0.001),
        ("dummy", "dummy"),
        ("'true'", "true"),
    ],
)
def test_variant_values_are_read_as_yaml_reads_them(raw: str, expected: object) -> None:
    value = parse_value(raw)
    assert value == expected and type(value) is type(expected)


def test_a_variant_with_yaml_booleans_builds_its_engine_config() -> None:
    v = parse_variant("async:async_scheduling=true,max_num_seqs=8,repetition_penalty=1.1,load_format=dummy")
    assert (v.name, v.options, v.sampling) == (
        "async",
        {"async_scheduling": True, "max_num_seqs": 8, "load_format": "dummy"},
        {"repetition_penalty": 1.1},
    )
    config = EngineConfig.from_options(BUNDLED_MODEL, **v.options)
    assert (config.async_scheduling, config.max_num_seqs) == (True, 8)
    off = parse_variant("sync:async_scheduling=false,num_kv_blocks=null")
    config = EngineConfig.from_options(BUNDLED_MODEL, **off.options)
    assert (config.async_scheduling, config.num_kv_blocks) == (False, None)


def test_null_model_argmax_is_its_logits_argmax() -> None:
    model = NullModel(hidden_size=8, vocab_size=32, max_rows=16)
    hidden = model(torch.zeros(5, dtype=torch.long), torch.arange(5))
    tokens = model.argmax_tokens(hidden)
    assert tokens.dtype == torch.long
    assert tokens.tolist() == model.compute_logits(hidden, raw=True).argmax(dim=-1).tolist() == [0] * 5


@pytest.mark.parametrize("async_scheduling", [False, True])
@pytest.mark.parametrize("sampling", [None, {"repetition_penalty": 1.1}])
def test_host_overhead_runs_with_the_null_forward(
    async_scheduling: bool, sampling: dict[str, float] | None
) -> None:
    result = host_overhead(
        BUNDLED_MODEL,
        {"async_scheduling": async_scheduling},
        num_running=4,
        num_steps=3,
        seed=0,
        null_forward=True,
        sampling=sampling,
    )
    # NOTE: the offline LLM detokenizes on its stage thread: the step's split and the stage's figure
    assert set(result) == {
        "host", "host_cpu", "host_cpu_min", "forward", "schedule+update", "prepare", "detokenize", "stage"
    }  # fmt: skip
