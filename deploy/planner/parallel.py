"""Tensor parallelism in the plan: which sizes a pool's workers may take (the model's weights and room
for KV on every rank of one node), the layouts of a GPU budget (workers and TP per pool, as DistServe
searches them), and the words for why the planner picked one.

A size is refused, with the figures, when the heads cannot be split over it, when the profile cannot
time it (a measured profile knows only the size it was measured at) or when the weights leave no room
for KV. What a size costs is the profile's alone (``CostProfile.with_tensor_parallel``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

from cluster.config import ClusterConfig, EngineConfig
from cluster.cost_model import CostProfile, RooflineStepCost, StepShape, shape_of
from deploy.planner.profiles import Hardware, ModelShape, gpu_kv_blocks
from deploy.planner.twin import SimConfig

NODE_SIZES = (1, 2, 4, 8)  # a worker's ranks live on one node (NVLink): the sizes tried by default
POOLS = ("colocated", "prefill", "decode")


@dataclass(frozen=True)
class Parallelism:
    """The sizes the search may give each pool: ``kv_blocks[pool][tp]`` is the KV blocks a worker of that
    pool holds at ``tp`` GPUs (only sizes that fit); ``refused``: (size, why) for those that do not;
    ``max_model_len``: the model's and engine's limit before any pool's KV caps it."""

    kv_blocks: dict[str, dict[int, int]]
    refused: tuple[tuple[int, str], ...]
    max_model_len: int

    def sizes(self, pool: str) -> list[int]:
        return sorted(self.kv_blocks.get(pool, {}))


def gpu_parallelism(
    hw: Hardware,
    model: ModelShape,
    engines: dict[str, EngineConfig],
    profile: CostProfile,
    sizes: Sequence[int],
    max_model_len: int,
) -> Parallelism:
    """Each pool's sizes among ``sizes`` that fit ``hw`` (``engines``: each pool's engine, whose
    ``num_kv_blocks`` when set is taken as is, and whose ``gpu_memory_utilization`` sizes the rest)."""
    kv_blocks: dict[str, dict[int, int]] = {}
    refused: dict[int, str] = {}
    for pool, engine in engines.items():
        fits = kv_blocks.setdefault(pool, {})
        for tp in sorted(set(sizes)):
            try:
                profile.with_tensor_parallel(tp)
                blocks = gpu_kv_blocks(hw, model, engine.block_size, engine.gpu_memory_utilization, tp)
            except ValueError as e:
                refused.setdefault(tp, str(e))
                continue
            fits[tp] = engine.num_kv_blocks or blocks
    return Parallelism(kv_blocks, tuple(sorted(refused.items())), max_model_len)


def fixed_parallelism(base: SimConfig, max_model_len: int) -> Parallelism:
    """The config's own size per pool and nothing else (a measured profile's plan)."""
    kv_blocks = {pool: {base.tp_of(pool): base.kv_blocks_of(pool)} for pool in POOLS}
    return Parallelism(kv_blocks, (), max_model_len)


def colocated_layout(base: SimConfig, par: Parallelism, num_workers: int, tp: int) -> SimConfig:
    blocks = par.kv_blocks["colocated"][tp]
    engine = replace(base.engine_of("colocated"), tensor_parallel_size=tp)
    return replace(
        base.colocated(num_workers),
        engine=engine,
        num_kv_blocks=blocks,
        max_model_len=min(par.max_model_len, (blocks - 1) * engine.block_size),
    )


def split_layout(
    base: SimConfig, par: Parallelism, prefill: tuple[int, int], decode: tuple[int, int], mode: str
) -> SimConfig:
    """``prefill`` / ``decode``: (workers, TP) of each pool. A request must fit both pools' KV."""
    (p, tp_p), (d, tp_d) = prefill, decode
    blocks_p, blocks_d = par.kv_blocks["prefill"][tp_p], par.kv_blocks["decode"][tp_d]
    block_size = base.engine_of("decode").block_size
    return replace(
        base.split(p, d, mode),
        prefill_engine=replace(base.engine_of("prefill"), tensor_parallel_size=tp_p),
        decode_engine=replace(base.engine_of("decode"), tensor_parallel_size=tp_d),
        prefill_kv_blocks=blocks_p,
        decode_kv_blocks=blocks_d,
        max_model_len=min(par.max_model_len, (min(blocks_p, blocks_d) - 1) * block_size),
    )


def split_candidates(num_gpus: int, tp_p: int, tp_d: int) -> list[tuple[int, int]]:
    """(prefill workers, decode workers) at these sizes that use exactly ``num_gpus``, one of each at least."""
    out = []
    for p in range(1, num_gpus // tp_p + 1):
        rest = num_gpus - p * tp_p
        if rest >= tp_d and rest % tp_d == 0:
            out.append((p, rest // tp_d))
    return out


def no_layout_message(num_gpus: int, par: Parallelism, include_colocated: bool) -> str:
    """Why a budget has no layout: the sizes that fit and those refused."""
    pools = ("colocated", "prefill", "decode") if include_colocated else ("prefill", "decode")
    fits = ", ".join(f"{pool} TP {par.sizes(pool) or 'none'}" for pool in pools)
    why = "; ".join(f"TP{tp}: {reason}" for tp, reason in par.refused)
    return f"no layout of {num_gpus} GPUs fits: sizes that fit: {fits}" + (f"; refused: {why}" if why else "")


def step_table(profile: CostProfile, par: Parallelism, engine: EngineConfig, context_tokens: int) -> str:
    """What the profile says a worker of each size takes for a prompt chunk of the engine's token budget
    and for a decode step of up to 64 sequences at ``context_tokens`` each (all-reduces apart), and the
    KV it holds: the costs the search weighs, per size."""
    sizes = sorted({tp for pool in par.kv_blocks.values() for tp in pool} | {tp for tp, _ in par.refused})
    chunk = engine.max_num_batched_tokens
    num_seqs = min(64, engine.max_num_seqs)
    prefill = shape_of([(0, chunk, False)])
    decode = StepShape(num_decode_seqs=num_seqs, num_context_tokens=num_seqs * context_tokens)
    head = (
        f"{'TP':>3} {'KV tokens/worker':>17} {f'prefill {chunk} tok':>18} {'all-reduce':>11} "
        f"{f'decode {num_seqs}x{context_tokens}':>17} {'all-reduce':>11}  (ms; the profile's steps)"
    )
    lines = [head]
    refused = dict(par.refused)
    for tp in sizes:
        if tp in refused:
            lines.append(f"{tp:>3}  refused: {refused[tp]}")
            continue
        p = profile.with_tensor_parallel(tp)
        step = p.step
        reduce_p = step.allreduce_s(prefill.num_tokens) if isinstance(step, RooflineStepCost) else 0.0
        reduce_d = step.allreduce_s(decode.num_tokens) if isinstance(step, RooflineStepCost) else 0.0
        blocks = max((pool.get(tp, 0) for pool in par.kv_blocks.values()), default=0)
        kv_tokens = (blocks - 1) * engine.block_size if blocks else 0
        lines.append(
            f"{tp:>3} {kv_tokens:>17,} {p.step_s(prefill) * 1e3:>18.1f} {reduce_p * 1e3:>11.2f} "
            f"{p.step_s(decode) * 1e3:>17.2f} {reduce_d * 1e3:>11.2f}"
        )
    return "\n".join(lines)


def layout_config(cfg: ClusterConfig, layout: SimConfig) -> dict[str, Any]:
    """``cfg`` (as its YAML's mapping) running ``layout``: the router mode, each pool's workers and
    tensor-parallel size; every other setting as ``cfg`` has it. ``ClusterConfig.from_dict`` accepts it."""
    data = cfg.to_dict()
    data["router"]["mode"] = layout.mode
    counts = {"colocated": layout.num_colocated, "prefill": layout.num_prefill, "decode": layout.num_decode}
    for pool in layout.pools:
        data["pools"][pool]["num_workers"] = counts[pool]
        data["pools"][pool]["tensor_parallel_size"] = layout.tp_of(pool)
    ClusterConfig.from_dict(data)  # NOTE: what the planner writes must load
    return data
