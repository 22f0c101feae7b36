"""From what the probe's phases measured (``ProbeMeasurements``; deploy/plan/probe.py runs them) to the
cost profile in place and the figures the probe prints (``fit_probe``): the host's effective CPUs and
the decode scale, the control hop, the HTTP edge and the KV handoff, then the fits of the fit_*
modules in turn, each over the profile the ones before it left."""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass, replace
from typing import Any, NamedTuple

import numpy as np

from cluster.config import ClusterConfig, EngineConfig
from cluster.cost_model import CostProfile, TransferCost
from cluster.protocol import ModelInfo, StepSplit
from deploy.loadgen import Record, Scenario
from deploy.plan.fit_decode import twin_decode_seconds, twin_decode_terms
from deploy.plan.fit_host import (
    fit_frontend_per_request,
    fit_handoff_step,
    fit_prefill_weight,
    overlapped_slowdown,
    probe_step_model,
)
from deploy.plan.fit_jitter import fit_delivery_jitter, fit_delivery_jitter_by_batch
from deploy.plan.fit_prefill import PrefillRun, fit_prefill_sends, in_place_step, twin_prefill_s
from deploy.plan.harness import EngineTotals
from deploy.plan.inputs import workload_of
from deploy.plan.probe_loads import BESIDE_PREFILLS, DECODE_PROMPT, step_ratio
from deploy.planner.workload import Workload


class DecodePhase(NamedTuple):
    """One decode batch the probe ran: its batch, load, seed and the clients' records."""

    batch: int
    scenario: Scenario
    seed: int
    records: list[Record]


@dataclass
class DecodeBatches:
    """The decode phases (``phases``, the light batch's last when it ran apart), the decode workers'
    engine seconds in each (``seconds``), the measured over modelled step of the first ones
    (``per_step``), the front end's CPU seconds per streamed token over them (``frontend``) and the host's
    demand meanwhile in busy workers (``demand``: the decode worker and the front end's share)."""

    phases: list[DecodePhase]
    seconds: list[float]
    per_step: list[float]
    frontend: float
    demand: float


@dataclass(frozen=True)
class ContendedRun:
    """The contended phase: a decode batch while the prefill worker computes prompts. The pools' engine
    totals over it, the tokens streamed per second, each load's wall seconds, and the loads (scenario,
    seed: the decode batch's first)."""

    decoded: EngineTotals
    prefilled: EngineTotals
    rate: float
    decode_s: float
    prefill_s: float
    loads: list[tuple[Scenario, int]]


@dataclass
class ProbeMeasurements:
    """Everything the probe's phases measured on the running cluster, for ``fit_probe``."""

    colocated: bool
    idle: list[Record]  # the idle prefills' answered requests
    prefill_runs: list[PrefillRun]  # the prefill pool's idle prefills and bursts
    prefill_loads: list[tuple[Scenario, int]]  # what each of them ran (scenario, seed)
    decode: DecodeBatches
    bursts: list[list[Record]]  # the bursts of short requests (the front end's work per request)
    handoff_splits: list[StepSplit]  # the decode pool's step splits, a window per phase
    beside: tuple[int, list[Record]]  # the streams beside long prefills: (seed, records)
    contended: ContendedRun | None  # None: colocated, or no host CPU count to fit


@dataclass(frozen=True)
class HostFit:
    """The decode scale (the measured decode steps over the sweep's), the host's effective CPUs, its
    slowdown in the contended phase, that phase's prefill seconds, demand and loads (for the prefill
    weight; None without it), and the share of each worker's loads the other was busy beside."""

    decode_scale: float
    host_cpus: float | None
    host_slowdown: float
    contended: tuple[float, float, list[tuple[Scenario, int]]] | None
    overlap: tuple[float, float]


def fit_host(sweep: CostProfile, decode: DecodeBatches, contended: ContendedRun | None) -> HostFit:
    """The decode scale, and how many workers this host really runs at once: how much slower the decode
    steps got beside a busy prefill worker (a 2-vCPU VM may give less than 2: shared physical cores,
    memory bandwidth, other tenants)."""
    decode_scale = math.exp(statistics.fmean(math.log(r) for r in decode.per_step))
    host_cpus = sweep.host_cpus
    if contended is None or not host_cpus:
        return HostFit(decode_scale, host_cpus, 1.0, None, (1.0, 1.0))
    c = contended
    # NOTE: the two loads overlap for the shorter one's duration, each worker busy only part of it:
    # the slowdowns measured over all their steps are diluted by the steps beside an idle worker
    both = max(1e-9, min(c.decode_s, c.prefill_s))
    overlap = (c.prefilled.seconds * both / max(1e-9, c.prefill_s) / max(1e-9, c.decode_s),
               c.decoded.seconds * both / max(1e-9, c.decode_s) / max(1e-9, c.prefill_s))  # fmt: skip
    slowdown = overlapped_slowdown(step_ratio(sweep, c.decoded) / decode.per_step[0], overlap[0])
    if slowdown > 1.0:
        host_cpus = min(host_cpus, (2.0 + min(1.0, c.rate * decode.frontend)) / slowdown)
        # NOTE: the simulation stretches steps by demand / host_cpus itself; the decode scale was
        # measured beside the busy front end, so it must not count that share twice
        decode_scale /= max(1.0, decode.demand / host_cpus)
    demand = 2.0 + min(1.0, c.rate * decode.frontend)
    host_slowdown = max(1.0, demand / host_cpus)
    return HostFit(decode_scale, host_cpus, host_slowdown, (c.prefilled.seconds, demand, c.loads), overlap)


def fit_edge(
    sweep: CostProfile, engine: EngineConfig, idle: list[Record], colocated: bool
) -> tuple[float, float, TransferCost]:
    """From the idle prefills: the control hop (the router's queue time), the edge (client TTFT minus the
    router's) and the KV handoff (latency + bytes / bandwidth, fitted to the decode side's transfer
    times; the sweep's where nothing is handed off)."""
    server = [r.server or {} for r in idle]
    hop = statistics.median(t["queue_s"] for t in server)
    edge = statistics.median((r.ttft_s or 0.0) - t["ttft_s"] for r, t in zip(idle, server, strict=True))
    moved = [
        -(-r.prompt_len // engine.block_size) * engine.block_size * sweep.kv_bytes_per_token for r in idle
    ]
    seconds = np.array([t["transfer_s"] for t in server])
    if colocated:
        transfer = sweep.transfer
    elif len(set(moved)) > 1:
        slope, latency = (float(v) for v in np.polyfit(np.array(moved, dtype=np.float64), seconds, 1))
        transfer = TransferCost(max(0.0, latency), 1.0 / slope if slope > 0 else sweep.transfer.bytes_per_s)
    else:
        transfer = TransferCost(float(seconds.mean()), sweep.transfer.bytes_per_s)
    return hop, edge, transfer


def fit_probe(
    cfg: ClusterConfig, sweep: CostProfile, info: ModelInfo, m: ProbeMeasurements
) -> tuple[CostProfile, dict[str, Any]]:
    """The profile in place: the sweep's ``sweep`` with every term of probe.py's docstring fitted on
    ``m`` (the cluster of ``cfg`` serving the model of ``info``), and the figures to print."""
    host = fit_host(sweep, m.decode, m.contended)
    hop, edge, transfer = fit_edge(sweep, cfg.engine_config(cfg.decode_pool), m.idle, m.colocated)
    frontend = m.decode.frontend
    # NOTE: with the decode scale as the contended phase left it
    step, scale, fitted = in_place_step(sweep.step, m.prefill_runs, host.decode_scale)
    per_request = fit_frontend_per_request(m.bursts, edge, frontend)
    measured = replace(
        sweep,
        step=step,
        host_cpus=host.host_cpus,
        hop_s=hop,
        http_s=max(0.0, (edge - frontend - per_request) / 2),
        transfer=transfer,
        step_scale=scale,
        frontend_cpu_per_token_s=frontend,
        frontend_s_per_request=per_request,
    )
    max_len = info.max_model_len

    def load(scenario: Scenario, load_seed: int) -> Workload:
        return workload_of("probe", scenario, info.vocab_size, max_len, load_seed)

    prefill_workloads: list[Workload] = []
    if not m.colocated:
        prefill_workloads = [load(sc, sd) for sc, sd in m.prefill_loads]
        measured, fitted = fit_prefill_sends(
            cfg, measured, sweep.step, m.prefill_runs, prefill_workloads, host.decode_scale, max_len
        )
        step = measured.step
    prefill_slowdown, prefill_weight = 1.0, 1.0
    if host.contended is not None and host.host_cpus:
        # the prefill worker's time in the contended phase over the twin's for its prompts on an idle
        # host (each client's requests alone): how much the rest of the host's demand counts against a
        # prefill step
        prefill_s, demand, clients = host.contended
        alone = replace(measured, host_cpus=None)
        expected = sum(twin_prefill_s(cfg, alone, load(sc, sd), max_len) for sc, sd in clients)
        prefill_slowdown = overlapped_slowdown(prefill_s / expected, host.overlap[1])
        prefill_weight = fit_prefill_weight(prefill_slowdown, demand, host.host_cpus)
        measured = replace(measured, prefill_weight=prefill_weight)
    if not m.colocated:
        probe_step = probe_step_model(step, DECODE_PROMPT, DECODE_PROMPT + 32)
        measured = replace(measured, handoff_receive_step_s=fit_handoff_step(m.handoff_splits, probe_step))
    workloads = [
        (b, workload_of(f"probe-decode-{b}", sc, info.vocab_size, max_len, sd), recs)
        for b, sc, sd, recs in m.decode.phases
    ]
    # NOTE: the decode scale took up, besides the steps' own in-place cost, what the twin models on its
    # own in those phases (their prompts' prefill steps beside the decodes, the handoffs received beside
    # them): corrected by their measured over simulated decode seconds, the base apart from the decode
    # terms (one scale for both made the twin's steps at a batch of 1-2 up to 40% slower than real)
    runs_s = [
        (w, s) for (_, w, _), s in zip(workloads[: len(m.decode.seconds)], m.decode.seconds, strict=True)
    ]
    measured, base_scale, twin_scale = twin_decode_terms(cfg, measured, runs_s, max_len)
    # the jitter by batch, then that of a step beside another worker's on top of it, then the jitter by
    # batch again with it (the decode phases' own prefills run beside their first decodes)
    jitter = fit_delivery_jitter_by_batch(cfg, measured, workloads, max_len)
    measured = replace(measured, delivery_jitter_s=0.0, delivery_jitter_by_batch=jitter)
    beside_seed, beside = m.beside
    beside_run = [(load(BESIDE_PREFILLS, beside_seed), beside)]
    beside_jitter = fit_delivery_jitter(cfg, measured, beside_run, max_len, contended=True)
    if beside_jitter:
        measured = replace(measured, delivery_jitter_contended_s=beside_jitter)
        jitter = fit_delivery_jitter_by_batch(cfg, measured, workloads, max_len)
        measured = replace(measured, delivery_jitter_by_batch=jitter)
    report: dict[str, Any] = {
        "hop_ms": hop * 1e3,
        "http_ms": measured.http_s * 1e3,
        "transfer_latency_ms": transfer.latency_s * 1e3,
        "transfer_gb_per_s": transfer.bytes_per_s / 1e9,
        "prefill_scale": fitted["scale"],
        "prefill_attention_scale": fitted["attention_scale"],
        "prefill_extra_per_step_ms": fitted["per_step"] * 1e3,
        "prefill_extra_per_chunk_ms": fitted["per_chunk"] * 1e3,
        "handoff_send_step_ms": measured.handoff_send_step_s * 1e3,
        "decode_scale": host.decode_scale * twin_scale,
        "decode_base_scale": host.decode_scale * base_scale,
        "frontend_cpu_per_token_us": frontend * 1e6,
        "frontend_per_request_ms": per_request * 1e3,
        "host_cpus": host.host_cpus,
        "host_slowdown": host.host_slowdown,
        "prefill_slowdown": prefill_slowdown,
        "prefill_weight": prefill_weight,
        "contended_overlap": list(host.overlap),
        "delivery_jitter_ms_by_batch": {str(b): j * 1e3 for b, j in jitter},
        "delivery_jitter_contended_ms": measured.delivery_jitter_contended_s * 1e3,
        "handoff_receive_step_ms": measured.handoff_receive_step_s * 1e3,
    }
    # each decode phase (batch, measured decode seconds) and the twin's after the fit
    twin_s = twin_decode_seconds(cfg, measured, runs_s, max_len)
    report["decode_phases"] = [
        [b, s, t] for (b, *_), (_, s), t in zip(m.decode.phases, runs_s, twin_s, strict=False)
    ]
    if not m.colocated:  # each prefill phase (seconds, steps) and how close the twin's prefill worker comes
        report["prefill_phases"] = [[r.seconds, r.steps] for r in m.prefill_runs]
        report["prefill_twin_over_real"] = [
            twin_prefill_s(cfg, measured, w, max_len) / r.seconds
            for r, w in zip(m.prefill_runs, prefill_workloads, strict=True)
        ]
    return measured, report
