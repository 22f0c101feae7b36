"""Tensor parallelism in the planner: the cost model's arithmetic per TP size (checked against a hand
computation), the KV a worker of N GPUs holds, the (workers, TP) search under a GPU budget and its
refusals, and the config the plan writes."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import yaml

from cluster.config import ClusterConfig, EngineConfig
from cluster.cost_model import (
    CostProfile,
    LinearStepCost,
    RooflineStepCost,
    StepShape,
    TransferCost,
    shape_of,
)
from deploy.cli import main as cli_main
from deploy.planner.parallel import (
    Parallelism,
    gpu_parallelism,
    layout_config,
    split_candidates,
    split_layout,
)
from deploy.planner.profiles import HARDWARE, ModelShape, gpu_kv_blocks, roofline_profile
from deploy.planner.report import Slo
from deploy.planner.search import recommend, search
from deploy.planner.sim import Simulation
from deploy.planner.twin import SimConfig, SimWorker
from deploy.planner.workload import poisson

H100 = HARDWARE["h100"]
LLAMA_70B = "bench/configs/llama-3-70b"
GPU_CONFIG = "deploy/gpu-disagg.yaml"


def llama_70b() -> ModelShape:
    return ModelShape.from_config(LLAMA_70B)


def test_llama_3_70b_shape_by_hand() -> None:
    m = llama_70b()
    assert (m.num_layers, m.hidden_size, m.num_heads, m.num_kv_heads, m.head_dim) == (80, 8192, 64, 8, 128)
    # a layer: q 8192x8192, k and v 8192x1024 each, o 8192x8192, gate/up/down 3 x 8192x28672
    assert m.layer_params == 80 * 855_638_016 == 68_451_041_280
    assert m.weight_bytes == 2 * (68_451_041_280 + 8192 * 128256) == 139_003_428_864
    assert m.resident_weight_bytes == 139_003_428_864 + 2 * 8192 * 128256
    assert m.kv_bytes_per_token == 2 * 80 * 8 * 128 * 2 == 327_680
    assert [m.kv_heads_per_rank(tp) for tp in (1, 2, 4, 8, 16)] == [8, 4, 2, 1, 1]
    with pytest.raises(ValueError, match="tensor_parallel_size 3 must divide its 64 query heads"):
        m.kv_heads_per_rank(3)


def test_tp_step_time_equals_the_hand_computation() -> None:
    step = roofline_profile(H100, llama_70b()).with_tensor_parallel(4).step
    assert isinstance(step, RooflineStepCost)
    assert step.tensor_parallel_size == 4 and step.kv_share == 2 / 8
    # a decode step: 64 sequences at 1,000 positions of context each
    decode = StepShape(num_decode_seqs=64, num_context_tokens=64_000)
    flops = (2 * 69_501_714_432 * 64 + 4 * 80 * 64 * 128 * 64_064) / 4
    nbytes = 139_003_428_864 / 4 + 327_680 * 2 / 8 * 64_064
    # two all-reduces a layer, 64 tokens x 8192 x 2 bytes each; a ring moves 2 x 3/4 of it per GPU
    allreduce = 160 * (10e-6 + 2 * 3 / 4 * (64 * 8192 * 2) / 450e9)
    assert step.allreduce_s(64) == pytest.approx(allreduce, rel=1e-12)
    roof = max(flops / (989e12 * 0.6), nbytes / (3350e9 * 0.8))
    assert nbytes / (3350e9 * 0.8) > flops / (989e12 * 0.6)  # memory bound
    assert step.step_s(decode) == pytest.approx(2e-3 + roof + allreduce, rel=1e-12)
    # a 4,096-token prompt: compute bound, and its all-reduces carry 4,096 tokens each
    prefill = shape_of([(0, 4096, False)])
    flops = (2 * 69_501_714_432 * 4096 + 4 * 80 * 64 * 128 * (4096 * 4097 // 2)) / 4
    allreduce = 160 * (10e-6 + 2 * 3 / 4 * (4096 * 8192 * 2) / 450e9)
    assert step.step_s(prefill) == pytest.approx(2e-3 + flops / (989e12 * 0.6) + allreduce, rel=1e-12)


def test_tp_one_has_no_all_reduce_and_replicates_kv_heads_past_their_number() -> None:
    profile = roofline_profile(H100, llama_70b())
    one = profile.step
    assert isinstance(one, RooflineStepCost)
    assert one.allreduce_s(4096) == 0.0 and one.kv_share == 1.0
    decode = StepShape(num_decode_seqs=1, num_context_tokens=100)
    assert one.step_s(decode) == pytest.approx(2e-3 + (139_003_428_864 + 327_680 * 101) / (3350e9 * 0.8))
    sixteen = profile.with_tensor_parallel(16).step
    assert isinstance(sixteen, RooflineStepCost)
    assert sixteen.kv_share == 1 / 8  # 8 KV heads over 16 ranks: one each, replicated
    with pytest.raises(ValueError, match="must divide the 8 KV heads or be a multiple of them"):
        profile.with_tensor_parallel(12)


def test_a_worker_of_n_gpus_holds_its_share_of_weights_and_kv() -> None:
    m = llama_70b()
    per_rank = 80e9 * 0.9 - m.resident_weight_bytes / 4 - 2**30
    assert gpu_kv_blocks(H100, m, 16, 0.9, tp=4) == int(per_rank // (16 * 327_680 * 2 / 8))
    per_rank = 80e9 * 0.9 - m.resident_weight_bytes / 8 - 2**30
    assert gpu_kv_blocks(H100, m, 16, 0.9, tp=8) == int(per_rank // (16 * 327_680 / 8))
    with pytest.raises(ValueError, match=r"does not fit on one H100 SXM: 141\.1 GB of weights a GPU"):
        gpu_kv_blocks(H100, m, 16)
    with pytest.raises(ValueError, match=r"does not fit on 2 x H100 SXM \(TP2\): 70\.6 GB"):
        gpu_kv_blocks(H100, m, 16, 0.85, tp=2)


def test_a_profile_times_only_the_sizes_it_knows(tmp_path: Path) -> None:
    linear = CostProfile(
        "cpu", "measured", LinearStepCost(0.002, 1e-4, 0, 2e-4, 0, 0), TransferCost(0, 1e9), 64
    )
    assert linear.with_tensor_parallel(1) is linear
    with pytest.raises(
        ValueError, match="'cpu' was measured at tensor_parallel_size 1; it cannot time a worker of 2"
    ):
        linear.with_tensor_parallel(2)
    # a roofline saved before the link figures loads, and stays at one GPU
    roof = roofline_profile(H100, llama_70b())
    data = roof.to_dict()
    for key in (
        "allreduces_per_step",
        "allreduce_bytes_per_token",
        "link_bytes_per_s",
        "allreduce_latency_s",
    ):
        del data["step"][key]
    old = CostProfile.from_dict(json.loads(json.dumps(data)))
    with pytest.raises(ValueError, match="has no link figures"):
        old.with_tensor_parallel(2)
    # the TP fields survive the JSON
    path = tmp_path / "p.json"
    roof.with_tensor_parallel(8).save(path)
    assert CostProfile.load(path) == roof.with_tensor_parallel(8)
    assert CostProfile.load(path).tensor_parallel_size == 8


def test_split_candidates_use_the_budget_exactly() -> None:
    assert split_candidates(8, 1, 1) == [(1, 7), (2, 6), (3, 5), (4, 4), (5, 3), (6, 2), (7, 1)]
    assert split_candidates(8, 1, 2) == [(2, 3), (4, 2), (6, 1)]
    assert split_candidates(8, 4, 4) == [(1, 1)]
    assert split_candidates(8, 4, 8) == []


def gpu_base(cfg: ClusterConfig, tp_sizes: tuple[int, ...]) -> tuple[SimConfig, Parallelism, CostProfile]:
    m = llama_70b()
    profile = roofline_profile(H100, m)
    engines = {pool: cfg.engine_config(pool) for pool in ("colocated", "prefill", "decode")}
    par = gpu_parallelism(H100, m, engines, profile, tp_sizes, 16384)
    base = SimConfig.from_cluster(cfg, num_kv_blocks=2, max_model_len=16384)
    return base, par, profile


def test_the_search_splits_a_model_too_big_for_one_gpu() -> None:
    cfg = ClusterConfig.from_yaml(GPU_CONFIG)  # gpu_memory_utilization 0.85
    base, par, profile = gpu_base(cfg, (1, 2, 4, 8))
    assert [tp for tp, _ in par.refused] == [1, 2]
    assert par.sizes("prefill") == par.sizes("decode") == par.sizes("colocated") == [4, 8]
    wl = poisson(2.0, 12, (512, 2048), (16, 64), seed=0, vocab_size=128256)
    rows = search(base, [8], profile, wl, Slo(2000.0, 100.0), split_mode="disaggregated", parallelism=par)
    assert [r.config.label for r in rows] == ["colocated x2 TP4", "colocated x1 TP8", "1P(TP4):1D(TP4)"]
    assert all(r.config.num_gpus == 8 for r in rows)
    best = recommend(rows)
    assert best.summary.meets_slo
    assert min(best.config.tp_of(pool) for pool in best.config.pools) >= 4


def test_the_search_keeps_one_gpu_a_worker_when_tp_only_adds_all_reduce_time() -> None:
    # a model whose steps are host overhead alone: splitting it saves nothing, each all-reduce costs
    step = RooflineStepCost(
        overhead_s=2e-3,
        flops_per_s=1e15,
        bytes_per_s=1e15,
        flops_per_token=1e3,
        attention_flops_per_pair=1.0,
        weight_bytes=1e6,
        kv_bytes_per_token=1e3,
        allreduces_per_step=64,
        allreduce_bytes_per_token=4096.0,
        link_bytes_per_s=450e9,
        allreduce_latency_s=10e-6,
    )
    profile = CostProfile("small", "hand", step, TransferCost(1e-3, 450e9), 1000)
    two = profile.with_tensor_parallel(2).step
    shape = StepShape(num_decode_seqs=8, num_context_tokens=800)
    assert two.step_s(shape) == pytest.approx(step.step_s(shape) + 64 * (10e-6 + 8 * 4096 / 450e9))
    base = SimConfig("disaggregated", num_prefill=1, num_decode=1, num_kv_blocks=512, max_model_len=2048)
    blocks = {1: 512, 2: 1024}
    par = Parallelism({"colocated": blocks, "prefill": blocks, "decode": blocks}, (), 2048)
    wl = poisson(400.0, 300, (64, 256), (16, 64), seed=0, vocab_size=1000)
    rows = search(base, [2, 4], profile, wl, Slo(200.0, 50.0), parallelism=par)
    labels = [r.config.label for r in rows]
    assert labels == [
        "colocated x2",
        "colocated x1 TP2",
        "1P:1D",
        "colocated x4",
        "colocated x2 TP2",
        "1P:3D",
        "2P:2D",
        "3P:1D",
        "2P(TP1):1D(TP2)",
        "1P(TP2):2D(TP1)",
        "1P(TP2):1D(TP2)",
    ]
    best = recommend(rows)
    assert not best.config.is_tensor_parallel
    # at every budget the best layout is one GPU a worker
    for n in (2, 4):
        at_n = [r for r in rows if r.config.num_gpus == n]
        top = max(
            at_n, key=lambda r: (r.summary.goodput_rps, r.summary.slo_attainment, -r.summary.ttft_ms.p90)
        )
        assert not top.config.is_tensor_parallel, top.config.label


def test_a_budget_no_layout_fits_is_refused_with_the_reasons() -> None:
    cfg = ClusterConfig.from_yaml(GPU_CONFIG)
    base, par, profile = gpu_base(cfg, (1, 2))
    wl = poisson(2.0, 4, (64, 128), (8, 16), seed=0, vocab_size=128256)
    with pytest.raises(ValueError) as e:
        search(base, [2], profile, wl, Slo(), parallelism=par)
    message = str(e.value)
    assert message.startswith("no layout of 2 GPUs fits: sizes that fit: colocated TP none, prefill TP none")
    assert "TP1: llama-3-70b does not fit on one H100 SXM" in message
    assert "TP2: llama-3-70b does not fit on 2 x H100 SXM (TP2)" in message


def test_pdserve_plan_refuses_a_budget_too_small(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["plan", "--gpu", "h100", "--model", LLAMA_70B, "--config", GPU_CONFIG, "--gpus", "2"]
    with pytest.raises(SystemExit) as e:
        cli_main([*argv, "--workload", "poisson:1", "--num-requests", "4"])
    assert str(e.value).startswith("pdserve plan: no layout of 2 GPUs fits")


def test_each_pool_steps_at_its_own_size() -> None:
    cfg = ClusterConfig.from_yaml(GPU_CONFIG)
    base, par, profile = gpu_base(cfg, (4, 8))
    layout = split_layout(base, par, (1, 4), (1, 8), "disaggregated")
    assert (layout.tp_of("prefill"), layout.tp_of("decode"), layout.num_gpus) == (4, 8, 12)
    assert layout.kv_blocks_of("prefill") == par.kv_blocks["prefill"][4] < layout.kv_blocks_of("decode")
    seen: list[tuple[str, Any, float]] = []

    def on_step(w: SimWorker, t: float, shape: Any, step_s: float) -> None:
        seen.append((w.pool, shape, step_s))

    wl = poisson(2.0, 6, (256, 1024), (4, 8), seed=0, vocab_size=128256)
    Simulation(layout, profile, wl, on_step=on_step).run()
    assert {pool for pool, _, _ in seen} == {"prefill", "decode"}
    for pool, shape, step_s in seen:
        tp = 4 if pool == "prefill" else 8
        assert step_s == profile.with_tensor_parallel(tp).step_s(shape)


def test_pdserve_plan_names_each_pools_size_and_writes_it(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "plan"
    argv = ["plan", "--gpu", "h100", "--model", LLAMA_70B, "--config", GPU_CONFIG, "--gpus", "8"]
    argv += ["--split-mode", "disaggregated", "--workload", "poisson:2", "--num-requests", "12"]
    argv += [
        "--prompt-len",
        "512",
        "2048",
        "--output-len",
        "16",
        "64",
        "--slo-ttft-ms",
        "2000",
        "--out",
        str(out),
    ]
    assert cli_main(argv) == 0
    printed = capsys.readouterr().out
    result = json.loads((out / "plan.json").read_text())
    labels = [row["label"] for row in result["rows"]]
    assert labels == ["colocated x2 TP4", "colocated x1 TP8", "1P(TP4):1D(TP4)"]
    assert [row["num_gpus"] for row in result["rows"]] == [8, 8, 8]
    assert "  1  refused: llama-3-70b does not fit on one H100 SXM" in printed
    assert f"recommended: {result['recommended']} -- " in printed
    assert "  why: rule: the fewest GPUs that meet the SLO (8)" in printed
    written = yaml.safe_load((out / "plan.yaml").read_text())
    cfg = ClusterConfig.from_dict(written)
    tp = result["recommended_tensor_parallel_size"]
    assert {pool: cfg.pool(pool).tensor_parallel_size for pool in cfg.pool_names} == tp
    assert {pool: cfg.engine_config(pool).tensor_parallel_size for pool in cfg.pool_names} == tp


def test_layout_config_sets_mode_workers_and_sizes() -> None:
    cfg = ClusterConfig.from_yaml(GPU_CONFIG)
    base, par, _ = gpu_base(cfg, (4, 8))
    data = layout_config(cfg, split_layout(base, par, (1, 4), (1, 8), "disaggregated"))
    again = ClusterConfig.from_dict(data)
    assert again.router.mode == "disaggregated"
    assert (again.prefill.num_workers, again.prefill.tensor_parallel_size) == (1, 4)
    assert (again.decode.num_workers, again.decode.tensor_parallel_size) == (1, 8)
    colocated = ClusterConfig.from_dict(
        layout_config(cfg, replace(base.colocated(2), engine=replace(base.engine, tensor_parallel_size=4)))
    )
    assert colocated.router.mode == "colocated"
    assert (colocated.colocated.num_workers, colocated.engine_config("colocated").tensor_parallel_size) == (
        2,
        4,
    )
    assert EngineConfig().tensor_parallel_size == 1
