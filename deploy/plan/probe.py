"""``pdserve plan calibrate``: fit this machine's cost profile.

The engine sweep (deploy/planner/calibrate.py) fits the step model. With ``--probe`` the sweep runs in a
Ray worker process (scheduled by the OS like the cluster's own workers, which on a shared host is not
like the driver) and the cluster of ``--config`` is started to measure what surrounds a step there:

* one control hop: the router's queue time of a request sent to an idle cluster;
* the HTTP edge: client TTFT minus the router's TTFT, halved (in and out);
* the KV handoff: latency + bytes / bandwidth, fitted to the decode side's transfer times;
* the step scales: the engines' own step time (from their stats) in steady decode batches over what the
  sweep predicts for the same shapes scales the fitted model's decode terms and its base, and at the end
  the twin replays those batches and the light one below with everything else measured and corrects
  the base and the decode terms apart by their measured over simulated decode seconds
  (``twin_decode_terms``: the batches' own prefills and handoffs run beside their decodes, which the
  twin models on its own; a batch of 2 weighs the base, one of 32 the per-sequence terms); the prefill
  workers' own time in idle
  prefills (four prompt lengths, each prompt alone), in the bursts below (many short prompts in one
  step) and in bursts of prompts like batch_pressure's and stress's (steps full of prompts) fits, by
  least squares of relative errors, scales of its prompt terms and of their attention, what a prefill
  step and each prompt chunk in it cost in place beyond the model, and what a handoff sent beside a
  prefill step costs it (in place, a worker shares the host with the router, HTTP edge and the other
  workers, which the sweep alone does not; a prefill worker's transfer thread sends each prompt's KV
  while the next prompts compute, and the receiving side works meanwhile): each phase's chunks and
  sends are the twin's schedule of its prompts (``fit_prefill_sends``);
* the front end's CPU per streamed token (router, HTTP edge and client all run in this process): the
  simulation serves tokens through it one at a time and counts it in the host's CPU demand;
* the front end's work per new request (HTTP, validation, the route decision), from the edge times
  (client TTFT minus the router's) of bursts of 8 and 32 short requests sent at once: the simulation
  shares the front end between the requests it holds, so a burst is routed about together, and counts
  it as a busy core meanwhile (``fit_frontend_per_request``); the HTTP edge is what an idle request's
  edge time leaves after it;
* the host's effective CPUs: the same decode batch again (in waves) while the prefill worker computes
  prompts two at a time; how much slower its steps get says how many workers really run at once (a
  2-vCPU VM may give less than 2: shared physical cores, memory bandwidth, other tenants);
* the prefill weight: in that same phase, the prefill worker's time over the twin's for the same
  prompts on an idle host: how much the rest of the host's demand counts against a prefill step
  (CostProfile.prefill_weight);
* what a KV handoff costs the steps beside it: the workers split their own steps by whether a transfer
  finished during them (``cluster.protocol.StepSplit``); over the light batch of 2 streams, as many
  short streams (a handoff every few steps) and the contended phase above, each phase on its own, the
  decode workers' steps beside a received transfer over the others, less what their shapes alone
  differ by, per transfer (``fit_handoff_step``; CostProfile.handoff_receive_step_s);
* the delivery jitter by batch: for each decode batch (the two above and a light one of 2 streams),
  the mean of an exponential delay per streamed token with which the simulation of that batch (the
  profile measured so far, the same seeded requests) gives its measured spread of gaps (90th
  percentile over median); the simulation interpolates between the batches;
* the jitter beside another worker: two streams at a time whose successors' long prompts prefill
  beside their decodes; the delay added to the tokens of a step that ends while another worker is in a
  step, with which the simulation gives that phase's measured spread of gaps.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import json
import math
import statistics
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, fields, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from bench.serve import Record, Scenario
from bench.serve import run as run_scenario
from cluster.config import ClusterConfig, EngineConfig
from cluster.cost_model import CostProfile, LinearStepCost, StepShape, TransferCost, shape_of
from cluster.protocol import StepSplit, WorkerStats
from deploy.plan.common import (
    DEFAULT_CONFIG,
    cpu_kv_blocks,
    default_profile_path,
    load_cluster_config,
    workload_of,
)
from deploy.planner.calibrate import Sample
from deploy.planner.sim import Simulation
from deploy.planner.twin import SimConfig
from deploy.planner.workload import Workload

if TYPE_CHECKING:
    from deploy.launch import ClusterHandle


_DECODE_PROMPT = 256  # the decode probe's prompts: contexts like the benchmark scenarios


def client_args(seed: int) -> argparse.Namespace:
    """What ``bench.serve.run`` reads of its command line."""
    return argparse.Namespace(
        api_key=None, timeout=600.0, model=None, temperature=0.0, ignore_eos=True, quiet=True, seed=seed
    )


@contextlib.contextmanager
def running_cluster(cfg: ClusterConfig) -> Iterator[tuple[str, ClusterHandle]]:
    """The cluster of ``cfg`` served over HTTP on a free loopback port; yields its URL and handle. This
    process then hosts the router and the HTTP edge as a serving process does, and freezes its start-up
    heap as one does (``deploy.http_host.serve_on_loop``): a benchmark process and nothing else."""
    from cluster.heap import freeze_startup_heap
    from deploy.http_host import start_http
    from deploy.launch import start_cluster

    handle = start_cluster(cfg)
    try:
        with start_http(handle) as http:
            freeze_startup_heap()
            yield http.url, handle
    finally:
        handle.shutdown()


def pool_stats(handle: ClusterHandle, pool: str) -> list[WorkerStats]:
    """Fresh stats of every worker of ``pool`` (asked of the actors, not the last heartbeat)."""
    import ray

    ids = [w.worker_id for w in handle.router.workers if w.pool == pool]
    return list(ray.get([handle.actors[i].stats.remote() for i in ids], timeout=60))


@dataclass(frozen=True)
class EngineTotals:
    """A pool's engine counters, summed: subtract two to see what ran in between."""

    num_steps: int
    seconds: float  # schedule + prepare + forward + detokenize
    num_generated: int

    @classmethod
    def of(cls, handle: ClusterHandle, pool: str) -> EngineTotals:
        """Fresh totals of every worker of ``pool`` (``pool_stats``)."""
        engines = [st.engine for st in pool_stats(handle, pool)]
        seconds = sum(
            e.schedule_time_s + e.prepare_time_s + e.forward_time_s + e.detokenize_time_s for e in engines
        )
        return cls(sum(e.num_steps for e in engines), seconds, sum(e.num_generation_tokens for e in engines))

    def __sub__(self, other: EngineTotals) -> EngineTotals:
        return EngineTotals(
            self.num_steps - other.num_steps,
            self.seconds - other.seconds,
            self.num_generated - other.num_generated,
        )


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
    if in_ray:
        import ray

        task = ray.remote(num_cpus=max(pool.num_cpus, 0.001))(_calibration_task)
        ref = task.remote(cfg.engine_config(), reps, seed, pool.torch_threads)
        data, samples = ray.get(ref, timeout=3600)
    else:
        data, samples = _calibration_task(cfg.engine_config(), reps, seed, pool.torch_threads)
    profile = CostProfile.from_dict(data)
    if verbose:
        print(fit_table(profile, samples), flush=True)
    return profile


def _decode_scenario(batch: int, waves: int = 1) -> Scenario:
    return Scenario(batch * waves, (_DECODE_PROMPT, _DECODE_PROMPT), (96, 96), max_concurrency=batch)


def _handoff_scenario(batch: int) -> Scenario:
    return Scenario(16 * batch, (_DECODE_PROMPT, _DECODE_PROMPT), (16, 16), max_concurrency=batch)


def _step_ratio(profile: CostProfile, ran: EngineTotals) -> float:
    """Measured seconds per decode step over the model's, at the mean batch that ran (nearly every step
    decodes the whole batch, at about prompt + 48 tokens of context)."""
    batch = max(1, round(ran.num_generated / max(1, ran.num_steps)))
    shape = shape_of([(_DECODE_PROMPT + 48, 1, True)] * batch)
    return ran.seconds / max(1, ran.num_steps) / profile.step.step_s(shape)


def _prefill_chunks(n: int, budget: int) -> list[StepShape]:
    return [shape_of([(s, min(budget, n - s), False)]) for s in range(0, n, budget)]


_MIN_EXTRA_S = 1e-6  # a fitted extra below this is noise


def twin_config(cfg: ClusterConfig, profile: CostProfile, max_model_len: int) -> SimConfig:
    """The twin of ``cfg``'s cluster, with the KV blocks a CPU worker of ``profile`` gets."""
    return SimConfig.from_cluster(cfg, num_kv_blocks=cpu_kv_blocks(cfg, profile), max_model_len=max_model_len)


@dataclass(frozen=True)
class PrefillRun:
    """What a prefill pool ran in one probe phase: its engines' seconds, the model's seconds of the
    prompts' own terms (a step's base excluded) apart from their attention (``attention_s``, the
    attention pairs' term), its steps, the prompt chunks they computed, and how many handoffs it sent
    beside its steps (0 until the twin counts them: ``fit_prefill_sends``)."""

    seconds: float
    prompt_s: float
    steps: int
    chunks: int
    sent: float = 0.0
    attention_s: float = 0.0

    @classmethod
    def of(cls, ran: EngineTotals, step: Any, records: Sequence[Record], budget: int) -> PrefillRun:
        chunks = [c for r in records for c in _prefill_chunks(r.prompt_len, budget)]
        prompt_s, attention_s = prompt_terms(step, chunks)
        return cls(ran.seconds, prompt_s, ran.num_steps, len(chunks), attention_s=attention_s)


def prompt_terms(step: Any, shapes: Sequence[StepShape]) -> tuple[float, float]:
    """The seconds ``step`` gives the prompts of ``shapes`` (a step's base excluded): (all but their
    attention, their attention pairs' term; a roofline model's all in the first)."""
    if not isinstance(step, LinearStepCost):
        return sum(step.step_s(s) for s in shapes), 0.0
    attention = sum(step.attention_pair_s * s.num_attention_pairs for s in shapes)
    return sum(step.step_s(s) - step.base_s for s in shapes) - attention, attention


_EXTRAS = ("step", "chunk", "sent")


def fit_prefill_terms(runs: Sequence[PrefillRun], base_s: float) -> dict[str, float]:
    """The terms of seconds - base_s x steps = scale x prompt_s + attention scale x attention_s + per
    step x steps + per chunk x chunks + per send x sent, fitted by least squares of relative errors (each
    run weighs 1 / its seconds): ``scale``, ``attention_scale`` (the scale itself where no run has
    attention seconds), ``per_step``, ``per_chunk``, ``per_sent`` (seconds). Of the fits with positive
    scales and extras of a microsecond or more (any subset of the three extras), the one with the least
    error; the ratio of the sums for both scales when none is.

    NOTE: idle prompts alone have one chunk a step and send their handoffs between steps, so they tell
    none of the extras apart; bursts (many prompts in a step, each one's handoff leaving beside the
    next step) can. Prompts of several lengths tell the attention (quadratic in a prompt's length) from
    the rest: in place it scales apart from the sweep's."""
    y = np.array([r.seconds - base_s * r.steps for r in runs], dtype=np.float64)
    columns = {
        "scale": [r.prompt_s for r in runs],
        "attention_scale": [r.attention_s for r in runs],
        "step": [float(r.steps) for r in runs],
        "chunk": [float(r.chunks) for r in runs],
        "sent": [r.sent for r in runs],
    }
    scales = ("scale", "attention_scale") if any(r.attention_s > 0.0 for r in runs) else ("scale",)
    weights = np.array([1.0 / max(r.seconds, 1e-6) for r in runs], dtype=np.float64)
    best: tuple[float, dict[str, float]] | None = None
    for k in range(len(_EXTRAS), -1, -1):
        for extras in itertools.combinations(_EXTRAS, k):
            names = scales + extras
            if len(runs) < len(names):
                continue
            design = np.array([columns[n] for n in names], dtype=np.float64).T
            coef, *_ = np.linalg.lstsq(design * weights[:, None], y * weights, rcond=None)
            if not (
                all(c > 0.0 for c in coef[: len(scales)])
                and all(c >= _MIN_EXTRA_S for c in coef[len(scales) :])
            ):
                continue
            error = float((((design @ coef - y) * weights) ** 2).sum())
            if best is None or error < best[0]:
                best = (error, dict(zip(names, (float(c) for c in coef), strict=True)))
    if best is not None:
        fit = best[1]
    else:
        fit = {"scale": float(y.sum() / sum(r.prompt_s + r.attention_s for r in runs))}
    return {
        "scale": fit["scale"],
        "attention_scale": fit.get("attention_scale", fit["scale"]),
        **{f"per_{e}": fit.get(e, 0.0) for e in _EXTRAS},
    }


def in_place_step(
    step: Any, runs: Sequence[PrefillRun], decode_scale: float
) -> tuple[Any, float, dict[str, float]]:
    """(step model, step scale, fitted terms) in place. A fitted linear model: its decode terms and its
    base scale by ``decode_scale`` (most steps decode), its prompt terms by the scales
    ``fit_prefill_terms`` finds in ``runs`` (the attention pairs' term by its own), and a prefill step
    and each prompt chunk cost its extras (``prefill_step_s``, added to ``prefill_seq_s``); step scale
    1.0; the fitted terms include the cost of a handoff sent beside a step (``per_sent``,
    ``CostProfile.handoff_send_step_s``). A roofline is kept as it is, with one factor for every step:
    the geometric mean of the prefill runs' ratio and the decode scale."""
    if isinstance(step, LinearStepCost):
        fitted = fit_prefill_terms(runs, step.base_s * decode_scale)
        scaled = step.scaled(fitted["scale"], decode_scale, base=decode_scale)
        in_place = replace(
            scaled,
            attention_pair_s=step.attention_pair_s * fitted["attention_scale"],
            prefill_step_s=fitted["per_step"],
            prefill_seq_s=scaled.prefill_seq_s + fitted["per_chunk"],
        )
        return in_place, 1.0, fitted
    ratio = sum(r.seconds for r in runs) / sum(r.prompt_s + r.attention_s for r in runs)
    fitted = {"scale": ratio, "attention_scale": ratio, "per_step": 0.0, "per_chunk": 0.0, "per_sent": 0.0}
    return step, math.sqrt(ratio * decode_scale), fitted


def twin_prefill_phase(
    cfg: ClusterConfig, profile: CostProfile, sweep_step: Any, workload: Workload, max_model_len: int
) -> tuple[float, float, int, int]:
    """How the twin's prefill workers run ``workload`` under ``profile``: (the seconds of the prompt
    terms of ``sweep_step`` over their steps, and of their attention apart (``prompt_terms``); the
    prompt chunks they compute; the handoffs they send beside a step, each charged to the step after
    it). The twin runs the real Scheduler, so its chunks are the ones a real burst is cut into (a prompt
    may span two steps)."""
    base = twin_config(cfg, profile, max_model_len)
    shapes: list[StepShape] = []

    def on_step(w: Any, t: float, shape: StepShape, step_s: float) -> None:
        if w.pool == "prefill" and shape.num_prefill_seqs:
            shapes.append(shape)

    charged = Simulation(base, profile, workload, on_step=on_step).run().worker_charged_handoffs
    prompt_s, attention_s = prompt_terms(sweep_step, shapes)
    chunks = sum(s.num_prefill_seqs for s in shapes)
    return prompt_s, attention_s, chunks, sum(n for w, n in charged.items() if w.startswith("prefill"))


def fit_prefill_sends(
    cfg: ClusterConfig,
    profile: CostProfile,
    sweep_step: Any,
    runs: Sequence[PrefillRun],
    workloads: Sequence[Workload],
    decode_scale: float,
    max_model_len: int,
    rounds: int = 2,
) -> tuple[CostProfile, dict[str, float]]:
    """``profile`` with the in-place step (``in_place_step`` of ``sweep_step``) and the send cost
    (``handoff_send_step_s``) fitted on the prefill ``runs``: each run's prompt seconds, chunks and
    handoffs sent beside a step are the twin's for its ``workloads`` entry under the profile so far
    (``twin_prefill_phase``; the measured seconds and steps stay); ``rounds`` times, since the schedule
    moves with the fitted terms. Returns the fitted terms too."""
    fitted: dict[str, float] = {}
    for _ in range(rounds):
        phases = [twin_prefill_phase(cfg, profile, sweep_step, w, max_model_len) for w in workloads]
        runs = [
            replace(r, prompt_s=prompt_s, attention_s=attention_s, chunks=chunks, sent=float(sent))
            for r, (prompt_s, attention_s, chunks, sent) in zip(runs, phases, strict=True)
        ]
        step, scale, fitted = in_place_step(sweep_step, runs, decode_scale)
        profile = replace(profile, step=step, step_scale=scale, handoff_send_step_s=fitted["per_sent"])
    return profile, fitted


def twin_prefill_s(cfg: ClusterConfig, profile: CostProfile, workload: Workload, max_model_len: int) -> float:
    """The twin's prefill workers' busy seconds in ``workload`` (``profile``)."""
    base = twin_config(cfg, profile, max_model_len)
    busy = Simulation(base, profile, workload).run().worker_busy_s
    return sum(v for w, v in busy.items() if w.startswith("prefill"))


_MIN_PREFILL_WEIGHT, _MAX_PREFILL_WEIGHT = 0.25, 4.0
_MIN_OVERLAP = 0.25


def fit_prefill_weight(prefill_slowdown: float, demand: float, host_cpus: float) -> float:
    """``CostProfile.prefill_weight`` W with (1 + W (demand - 1)) / host_cpus == prefill_slowdown, within
    [0.25, 4] (below 1: a prefill step suffers less from the rest of the host than a decode step does);
    1.0 where the rest of the demand was too small to fit it on."""
    if demand < 1.05:
        return 1.0
    weight = (prefill_slowdown * host_cpus - 1.0) / (demand - 1.0)
    return min(_MAX_PREFILL_WEIGHT, max(_MIN_PREFILL_WEIGHT, weight))


def overlapped_slowdown(slowdown: float, overlap: float) -> float:
    """The slowdown of a step while the other worker is busy, from `slowdown` measured over every step of
    a phase in which the other worker was busy a fraction `overlap` of the time (the steps beside an
    idle one run at 1x): 1 + (slowdown - 1) / overlap, the overlap taken as at least 0.25."""
    return 1.0 + (slowdown - 1.0) / min(1.0, max(_MIN_OVERLAP, overlap))


_MIN_JITTER_S, _MAX_JITTER_S = 0.00025, 0.032
_LIGHT_BATCH, _LIGHT_WAVES = 2, 8  # the probe's light decode batch: 16 requests, 2 at a time
# the probe's bursts: short requests sent at once, a few and many (smoke and long_decode send 4 and 8 at
# once, batch_pressure 64)
_BURSTS = (Scenario(8, (16, 16), (2, 2)), Scenario(32, (16, 16), (2, 2)))
# bursts of prompts like batch_pressure's (64-256 tokens, 64 at once) and stress's (64-512, all at once)
# for the prefill fit: steps full of prompts, each prompt's handoff leaving beside the next ones' step
_PREFILL_BURSTS = (
    Scenario(24, (128, 192), (2, 2)),
    Scenario(48, (64, 256), (2, 2)),
    Scenario(32, (64, 512), (2, 2)),
)
_MAX_PER_REQUEST_S = 0.02
# two streams at a time whose successors' long prompts prefill beside them: the delivery jitter of a
# step that runs while another worker computes (CostProfile.delivery_jitter_contended_s)
_BESIDE_PREFILLS = Scenario(16, (1024, 1024), (48, 48), max_concurrency=2)


def _spread(gaps: Sequence[float]) -> float:
    p50, p90 = np.percentile(np.asarray(gaps, dtype=np.float64), [50, 90])
    return float(p90 - p50)


def phase_spread(gaps_by_request: Sequence[Sequence[float]], wave: int) -> float:
    """The spread of a phase's gaps (their 90th percentile over their median; `gaps_by_request` in send
    order): with three waves of `wave` requests or more, the median of each wave's own spread, else the
    spread of all of them (0.0 without gaps).

    NOTE: one probe's decode phase of 8 streams now and then measured twice the usual spread (the jitter
    it fitted for a batch of 8 ran 0-2.7 ms over the 21 probes of stops 24-26, while long_decode's real TBT
    p90 stayed within 6.2-7.4 ms): a pause of the host in one wave lifts the pooled percentile, and one
    wave of four cannot move the median of the waves."""
    waves = [
        [g for gaps in gaps_by_request[i : i + wave] for g in gaps]
        for i in range(0, len(gaps_by_request), max(1, wave))
    ]
    waves = [w for w in waves if w]
    if len(waves) >= 3:
        return float(statistics.median(_spread(w) for w in waves))
    pooled = [g for w in waves for g in w]
    return _spread(pooled) if pooled else 0.0


def fit_delivery_jitter(
    cfg: ClusterConfig,
    profile: CostProfile,
    runs: Sequence[tuple[Workload, Sequence[Record]]],
    max_model_len: int,
    contended: bool = False,
) -> float:
    """``CostProfile.delivery_jitter_s`` (``contended``: ``delivery_jitter_contended_s``): the jitter
    with which the simulation of each run (``profile`` otherwise as is, seed 0; for the plain jitter,
    without its points by batch) gives, averaged over the runs, the measured spread of the gaps
    between a stream's tokens: their 90th percentile over their median (the spread, not the level: a
    step model a little off moves both percentiles alike), the median of its waves' (`phase_spread`,
    on both sides). The smallest such jitter, up to 32 ms (that
    if none reaches it); 0.0 when the simulation without it already reaches the measured spread."""
    base = twin_config(cfg, profile, max_model_len)
    pairs = []
    for workload, records in runs:
        served = [r.tbt_s for r in records if r.error is None]
        if any(served):
            pairs.append((workload, phase_spread(served, _wave(workload))))
    if not pairs:
        return 0.0
    if not contended:
        profile = replace(profile, delivery_jitter_by_batch=())

    def excess(jitter: float) -> float:
        if contended:
            p = replace(profile, delivery_jitter_contended_s=jitter)
        else:
            p = replace(profile, delivery_jitter_s=jitter)
        simulated = []
        for workload, real in pairs:
            gaps = [list(r.gaps_s) for r in Simulation(base, p, workload).run().records]
            simulated.append(phase_spread(gaps, _wave(workload)) - real)
        return statistics.fmean(simulated)

    if excess(0.0) >= 0.0:
        return 0.0
    # NOTE: the simulated spread grows with the jitter only up to a point: past it a stream's tokens
    # bunch up (each kept behind the one before) and the spread falls again. So the bracket is found
    # from below, doubling, and the bisection runs inside it: the smallest jitter that fits.
    lo, hi = 0.0, _MIN_JITTER_S
    while excess(hi) < 0.0:
        if hi >= _MAX_JITTER_S:
            return hi
        lo, hi = hi, min(2 * hi, _MAX_JITTER_S)
    while hi - lo > 1e-5:
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if excess(mid) < 0.0 else (lo, mid)
    return (lo + hi) / 2


def _wave(workload: Workload) -> int:
    return workload.max_concurrency or len(workload)


def fit_delivery_jitter_by_batch(
    cfg: ClusterConfig,
    profile: CostProfile,
    runs: Sequence[tuple[int, Workload, Sequence[Record]]],
    max_model_len: int,
) -> tuple[tuple[int, float], ...]:
    """``CostProfile.delivery_jitter_by_batch``: (batch, ``fit_delivery_jitter`` of that batch's run
    alone) for each decode batch the probe ran, by batch."""
    return tuple(
        (batch, fit_delivery_jitter(cfg, profile, [(workload, records)], max_model_len))
        for batch, workload, records in sorted(runs, key=lambda run: run[0])
    )


def fit_frontend_per_request(
    bursts: Sequence[Sequence[Record]], idle_edge_s: float, frontend_cpu_per_token_s: float
) -> float:
    """``CostProfile.frontend_s_per_request`` from bursts of requests sent at once, by their edge time
    (client TTFT minus the router's TTFT). The front end shares itself between the n new requests of a
    burst, so they are routed about together, (n - 1) x per request later than a lone one; and the
    first tokens of the step that prefilled them leave it one at a time, (n / 2 - 1) x its time per
    token later on average. So a burst's mean edge time over an idle request's (``idle_edge_s``) is
    (n - 1) x per request + (n / 2 - 1) x per token: least squares over the bursts, within [0, 20 ms]
    (0.0 without a burst of two or more answered requests)."""
    xs, ys = [], []
    for records in bursts:
        edges = [
            r.ttft_s - r.server["ttft_s"]
            for r in records
            if r.error is None and r.ttft_s is not None and r.server and "ttft_s" in r.server
        ]
        n = len(records)
        if n < 2 or not edges:
            continue
        xs.append(n - 1.0)
        ys.append(statistics.fmean(edges) - idle_edge_s - max(0.0, n / 2 - 1) * frontend_cpu_per_token_s)
    if not xs:
        return 0.0
    per_request = sum(x * y for x, y in zip(xs, ys, strict=True)) / sum(x * x for x in xs)
    return min(_MAX_PER_REQUEST_S, max(0.0, per_request))


_MAX_HANDOFF_STEP_S = 0.02


def step_split_of(handle: ClusterHandle, pool: str) -> StepSplit:
    """The step split of every worker of ``pool``, summed (fresh: ``pool_stats``)."""
    total = StepSplit()
    for st in pool_stats(handle, pool):
        for f in fields(StepSplit):
            setattr(total, f.name, getattr(total, f.name) + getattr(st.steps, f.name))
    return total


def split_delta(after: StepSplit, before: StepSplit) -> StepSplit:
    return StepSplit(**{f.name: getattr(after, f.name) - getattr(before, f.name) for f in fields(StepSplit)})


def fit_handoff_step(splits: Sequence[StepSplit], model_s: Callable[[float, float], float]) -> float:
    """What a finished transfer adds to a step beside it (``CostProfile.handoff_receive_step_s``, from a
    decode pool's splits), from one split per phase: in each, the steps beside which a transfer finished
    over the others, less what their shapes alone make them differ by (``model_s(tokens a step streams,
    prompt tokens it computes)``, of each share's mean step); summed over the phases, per transfer,
    within [0, 20 ms]. A phase where no transfer finished beside a step or no step ran without one adds
    nothing; 0.0 when none does.

    NOTE: a phase is compared within itself: the phases load the host differently, so the steps of one
    are no baseline for the steps beside a transfer in another."""
    extra, transfers = 0.0, 0
    for split in splits:
        plain_steps = split.num_steps - split.beside_steps
        if split.beside_transfers < 1 or plain_steps < 1:
            continue
        plain = (split.seconds - split.beside_seconds) / plain_steps
        beside = split.beside_steps
        shape_gap = model_s(split.beside_tokens / beside, split.beside_prompt_tokens / beside) - model_s(
            (split.num_tokens - split.beside_tokens) / plain_steps,
            (split.prompt_tokens - split.beside_prompt_tokens) / plain_steps,
        )
        extra += split.beside_seconds - beside * (plain + shape_gap)
        transfers += split.beside_transfers
    if transfers < 1:
        return 0.0
    return min(_MAX_HANDOFF_STEP_S, max(0.0, extra / transfers))


def _twin_decode_seconds(
    cfg: ClusterConfig, profile: CostProfile, runs: Sequence[tuple[Workload, float]], max_model_len: int
) -> list[float]:
    """The twin's decode workers' busy seconds (every pool but prefill) in each run's workload."""
    base = twin_config(cfg, profile, max_model_len)
    seconds = []
    for workload, _ in runs:
        busy = Simulation(base, profile, workload).run().worker_busy_s
        seconds.append(sum(v for w, v in busy.items() if not w.startswith("prefill")))
    return seconds


def twin_decode_ratio(
    cfg: ClusterConfig, profile: CostProfile, runs: Sequence[tuple[Workload, float]], max_model_len: int
) -> float:
    """The decode workers' measured seconds over the twin's (``profile``, the same seeded requests) in
    each run, geometric mean; 1.0 without a run the twin gives time to."""
    simulated = _twin_decode_seconds(cfg, profile, runs, max_model_len)
    logs = [math.log(m / s) for (_, m), s in zip(runs, simulated, strict=True) if s > 0.0 and m > 0.0]
    return math.exp(statistics.fmean(logs)) if logs else 1.0


def twin_decode_scale(
    cfg: ClusterConfig,
    profile: CostProfile,
    runs: Sequence[tuple[Workload, float]],
    max_model_len: int,
    rounds: int = 2,
) -> tuple[CostProfile, float]:
    """``profile`` with its linear step's decode terms and base times the factor that makes the twin's
    decode seconds of ``runs`` their measured ones (``twin_decode_ratio``, applied ``rounds`` times: the
    schedule, and so the ratio, moves with the scale), and that factor; a roofline profile as it is."""
    scale, step = 1.0, profile.step
    if not isinstance(step, LinearStepCost):
        return profile, 1.0
    for _ in range(rounds):
        ratio = twin_decode_ratio(cfg, profile, runs, max_model_len)
        step = step.scaled(1.0, ratio, base=ratio)
        profile = replace(profile, step=step)
        scale *= ratio
    return profile, scale


_TERMS_STEP = math.log(1.1)  # the twin's finite difference in each scale (log)
_MAX_TERMS_MOVE = math.log(4.0)  # how far the two-term fit may move either scale (log)


def twin_decode_terms(
    cfg: ClusterConfig,
    profile: CostProfile,
    runs: Sequence[tuple[Workload, float]],
    max_model_len: int,
    rounds: int = 3,
) -> tuple[CostProfile, float, float]:
    """``profile`` with its linear step's base and decode terms scaled apart, so that the twin's decode
    seconds of ``runs`` (a workload and its measured decode seconds; batches of different sizes: a light
    one weighs the base, a heavy one the per-sequence terms) come closest to the measured ones (least
    squares of the log ratios). Each round linearizes through the twin: every run at the current scales
    and with each scale 10% up (the schedule moves with the scales). The base's change is moved into
    ``prefill_step_s`` (not below 0), so a step that computes prompt tokens costs what the prefill fit
    made it. Returns (profile, base factor, decode factor). With fewer than two runs the twin gives time
    to, or two that cannot tell the scales apart, one factor for both (``twin_decode_scale``); a roofline
    profile as it is."""
    step = profile.step
    if not isinstance(step, LinearStepCost):
        return profile, 1.0, 1.0

    def scaled(log_base: float, log_decode: float) -> CostProfile:
        new = step.scaled(1.0, math.exp(log_decode), base=math.exp(log_base))
        moved = step.base_s - new.base_s
        return replace(profile, step=replace(new, prefill_step_s=max(0.0, step.prefill_step_s + moved)))

    def at(log_base: float, log_decode: float) -> list[float]:
        return _twin_decode_seconds(cfg, scaled(log_base, log_decode), runs, max_model_len)

    measured = [s for _, s in runs]
    x = y = 0.0
    for _ in range(rounds):
        now, up_base, up_decode = at(x, y), at(x + _TERMS_STEP, y), at(x, y + _TERMS_STEP)
        rows, targets = [], []
        for m, s, sb, sd in zip(measured, now, up_base, up_decode, strict=True):
            if m > 0.0 and s > 0.0 and sb > 0.0 and sd > 0.0:
                rows.append((math.log(sb / s) / _TERMS_STEP, math.log(sd / s) / _TERMS_STEP))
                targets.append(math.log(m / s))
        a = np.array(rows, dtype=np.float64).reshape(-1, 2)
        if len(rows) < 2 or np.linalg.cond(a) > 1e3:
            scaled_profile, scale = twin_decode_scale(cfg, profile, runs, max_model_len)
            return scaled_profile, scale, scale
        dx, dy = np.linalg.lstsq(a, np.array(targets), rcond=None)[0]
        x = min(_MAX_TERMS_MOVE, max(-_MAX_TERMS_MOVE, x + float(dx)))
        y = min(_MAX_TERMS_MOVE, max(-_MAX_TERMS_MOVE, y + float(dy)))
    return scaled(x, y), math.exp(x), math.exp(y)


class _SplitWindows:
    """Pools' step splits over chosen phases of the probe, one window per phase."""

    def __init__(self, handle: ClusterHandle, pools: Sequence[str]) -> None:
        self.handle = handle
        self.windows: dict[str, list[StepSplit]] = {pool: [] for pool in pools}
        self._at: dict[str, StepSplit] = {}

    def open(self) -> None:
        self._at = {pool: step_split_of(self.handle, pool) for pool in self.windows}

    def close(self) -> None:
        for pool, before in self._at.items():
            self.windows[pool].append(split_delta(step_split_of(self.handle, pool), before))


def _probe_step_model(step: Any, prompt_len: int, context: int) -> Callable[[float, float], float]:
    """``fit_handoff_step``'s model of a mean step of the probe's phases: a decode batch of the tokens it
    streams (rounded) at ``context`` tokens, and its prompt tokens (a recompute's) as prompts of
    ``prompt_len`` (linear between whole numbers of them)."""

    def model_s(tokens: float, prompt_tokens: float) -> float:
        decodes = [(context, 1, True)] * round(tokens)
        k = prompt_tokens / prompt_len
        lo = math.floor(k)

        def at(n: int) -> float:
            return float(step.step_s(shape_of(decodes + [(0, prompt_len, False)] * n)))

        return at(lo) + (k - lo) * (at(lo + 1) - at(lo))

    return model_s


async def probe(
    url: str, handle: ClusterHandle, profile: CostProfile, seed: int
) -> tuple[CostProfile, dict[str, Any]]:
    """Measure the terms of the module docstring on the running cluster (``url`` serves ``handle``)."""
    cfg = handle.config
    engine = cfg.engine_config()
    colocated = cfg.router.mode == "colocated"
    prefill_pool, decode_pool = ("colocated", "colocated") if colocated else ("prefill", "decode")
    # NOTE: a seed per probe run: the same seed would give each run's first prompt the previous one's
    # tokens as a prefix, and prefix-cache hits would make prefills look cheaper than they are
    seeds = iter(range(seed * 1000 + 1, seed * 1000 + 1000))
    budget = engine.max_num_batched_tokens
    idle: list[Record] = []
    prefill_runs: list[PrefillRun] = []  # the prefill pool's idle prefills (and bursts, below)
    prefill_loads: list[tuple[Scenario, int]] = []  # what each of them ran (scenario, seed)
    for n in (16, 256, 1024, 1792):
        before = EngineTotals.of(handle, prefill_pool)
        scenario, phase_seed = Scenario(4, (n, n), (2, 2), max_concurrency=1), next(seeds)
        recs, _ = await run_scenario(url, f"probe-{n}", client_args(phase_seed), scenario)
        done = [r for r in recs if r.error is None and r.server and r.ttft_s is not None]
        if done:
            prefill_runs.append(
                PrefillRun.of(EngineTotals.of(handle, prefill_pool) - before, profile.step, done, budget)
            )
            prefill_loads.append((scenario, phase_seed))
        idle += done
    if not idle:
        raise RuntimeError("cluster probe: every probe request failed")

    cpu0, wall0 = time.process_time(), time.perf_counter()
    num_tokens, per_step = 0, []
    decode_seconds: list[float] = []  # the decode workers' engine seconds in each phase
    phases: list[tuple[int, Scenario, int, list[Record]]] = []  # the decode batches, to fit the jitter on
    for batch in sorted({min(b, engine.max_num_seqs) for b in (8, 32)}):
        before = EngineTotals.of(handle, decode_pool)
        # NOTE: at least 32 requests (in waves): a single wave of 8 streams gave a spread of gaps (the
        # jitter fit below) twice the usual now and then
        scenario, phase_seed = _decode_scenario(batch, max(1, 32 // batch)), next(seeds)
        recs, _ = await run_scenario(url, f"probe-decode-{batch}", client_args(phase_seed), scenario)
        num_tokens += sum(r.output_tokens for r in recs)
        ran = EngineTotals.of(handle, decode_pool) - before
        per_step.append(_step_ratio(profile, ran))
        decode_seconds.append(ran.seconds)
        phases.append((batch, scenario, phase_seed, recs))
    frontend = (time.process_time() - cpu0) / max(1, num_tokens)
    decode_demand = 1.0 + min(1.0, num_tokens / (time.perf_counter() - wall0) * frontend)
    # bursts of short requests sent at once, for the front end's work per request (fitted below)
    # (in a disaggregated cluster, the prefill worker's time in them joins the prefill fit: many prompts
    # in one step; colocated, the burst's decodes share those steps)
    bursts: list[list[Record]] = []
    for scenario in _BURSTS + (() if colocated else _PREFILL_BURSTS):
        before, phase_seed = EngineTotals.of(handle, prefill_pool), next(seeds)
        recs, _ = await run_scenario(url, "probe-burst", client_args(phase_seed), scenario)
        done = [r for r in recs if r.error is None]
        if done and not colocated:
            prefill_runs.append(
                PrefillRun.of(EngineTotals.of(handle, prefill_pool) - before, profile.step, done, budget)
            )
            prefill_loads.append((scenario, phase_seed))
        if scenario in _BURSTS:
            bursts.append(recs)
    # NOTE: a light batch too, for the jitter (its tokens reach the clients steadier than a batch of
    # 8's) and the handoff cost (below): the steps and the front end are measured on the two batches above
    light = min(_LIGHT_BATCH, engine.max_num_seqs)
    # what a handoff costs the steps beside it, from the workers' step splits over this light batch,
    # as many short streams (a handoff every few steps) and the contended phase below
    splits = _SplitWindows(handle, (decode_pool,))
    if light not in (b for b, *_ in phases):
        scenario, phase_seed = _decode_scenario(light, _LIGHT_WAVES), next(seeds)
        before = EngineTotals.of(handle, decode_pool)
        splits.open()
        recs, _ = await run_scenario(url, f"probe-decode-{light}", client_args(phase_seed), scenario)
        splits.close()
        decode_seconds.append((EngineTotals.of(handle, decode_pool) - before).seconds)
        phases.append((light, scenario, phase_seed, recs))
    if not colocated:
        splits.open()
        await run_scenario(url, "probe-handoffs", client_args(next(seeds)), _handoff_scenario(light))
        splits.close()
    beside_seed = next(seeds)
    beside, _ = await run_scenario(url, "probe-beside-prefills", client_args(beside_seed), _BESIDE_PREFILLS)
    decode_scale = math.exp(statistics.fmean(math.log(r) for r in per_step))
    host_cpus = profile.host_cpus
    prefill_slowdown, host_slowdown, prefill_weight = 1.0, 1.0, 1.0
    contended: tuple[float, float, list[tuple[Scenario, int]]] | None = None  # prefill s, demand, loads
    report_overlap = (1.0, 1.0)  # the prefill worker's busy share of the contended decodes, and vice versa
    if not colocated and host_cpus:
        # the first decode batch again (in waves, to last as long as the prefills), while the prefill
        # worker computes prompts like the scenarios' (256 tokens, two at a time): how much two busy
        # workers (and the front end) slow each other down on this host
        before, t0 = EngineTotals.of(handle, decode_pool), time.perf_counter()
        before_prefill = EngineTotals.of(handle, prefill_pool)
        batch = min(8, engine.max_num_seqs)
        busy = Scenario(96, (_DECODE_PROMPT, _DECODE_PROMPT), (2, 2), max_concurrency=2)
        loads = [(_decode_scenario(batch, 6), next(seeds)), (busy, next(seeds))]
        splits.open()
        runs = await asyncio.gather(
            run_scenario(url, "probe-contended", client_args(loads[0][1]), loads[0][0]),
            run_scenario(url, "probe-prefill-load", client_args(loads[1][1]), loads[1][0]),
        )
        splits.close()
        decoded = EngineTotals.of(handle, decode_pool) - before
        prefilled = EngineTotals.of(handle, prefill_pool) - before_prefill
        rate = sum(r.output_tokens for recs, _ in runs for r in recs) / (time.perf_counter() - t0)
        # NOTE: the two loads overlap for the shorter one's duration, each worker busy only part of it:
        # the slowdowns measured over all their steps are diluted by the steps beside an idle worker
        (_, decode_d), (_, prefill_d) = runs
        both = max(1e-9, min(decode_d, prefill_d))
        overlap = (prefilled.seconds * both / max(1e-9, prefill_d) / max(1e-9, decode_d),
                   decoded.seconds * both / max(1e-9, decode_d) / max(1e-9, prefill_d))  # fmt: skip
        slowdown = overlapped_slowdown(_step_ratio(profile, decoded) / per_step[0], overlap[0])
        if slowdown > 1.0:
            host_cpus = min(host_cpus, (2.0 + min(1.0, rate * frontend)) / slowdown)
            # NOTE: the simulation stretches steps by demand / host_cpus itself; the decode scale was
            # measured beside the busy front end, so it must not count that share twice
            decode_scale /= max(1.0, decode_demand / host_cpus)
        demand = 2.0 + min(1.0, rate * frontend)
        host_slowdown = max(1.0, demand / host_cpus)
        contended = (prefilled.seconds, demand, loads)  # the prefill weight is fitted on it below
        report_overlap = overlap

    server = [r.server or {} for r in idle]
    hop = statistics.median(t["queue_s"] for t in server)
    edge = statistics.median((r.ttft_s or 0.0) - t["ttft_s"] for r, t in zip(idle, server, strict=True))
    moved = [
        -(-r.prompt_len // engine.block_size) * engine.block_size * profile.kv_bytes_per_token for r in idle
    ]
    seconds = np.array([t["transfer_s"] for t in server])
    if colocated:
        transfer = profile.transfer
    elif len(set(moved)) > 1:
        slope, latency = (float(v) for v in np.polyfit(np.array(moved, dtype=np.float64), seconds, 1))
        transfer = TransferCost(max(0.0, latency), 1.0 / slope if slope > 0 else profile.transfer.bytes_per_s)
    else:
        transfer = TransferCost(float(seconds.mean()), profile.transfer.bytes_per_s)
    # NOTE: with the decode scale as the contended phase left it
    step, scale, fitted = in_place_step(profile.step, prefill_runs, decode_scale)
    per_request = fit_frontend_per_request(bursts, edge, frontend)
    measured = replace(
        profile,
        step=step,
        host_cpus=host_cpus,
        hop_s=hop,
        http_s=max(0.0, (edge - frontend - per_request) / 2),
        transfer=transfer,
        step_scale=scale,
        frontend_cpu_per_token_s=frontend,
        frontend_s_per_request=per_request,
    )
    info = handle.model_info
    max_len = info.max_model_len

    def load(scenario: Scenario, load_seed: int) -> Workload:
        return workload_of("probe", scenario, info.vocab_size, max_len, load_seed)

    if not colocated:
        prefill_workloads = [load(sc, sd) for sc, sd in prefill_loads]
        measured, fitted = fit_prefill_sends(
            cfg, measured, profile.step, prefill_runs, prefill_workloads, decode_scale, max_len
        )
        step = measured.step
    if contended is not None and host_cpus:
        # the prefill worker's time in the contended phase over the twin's for its prompts on an idle
        # host (each client's requests alone): how much the rest of the host's demand counts against a
        # prefill step
        prefill_s, demand, clients = contended
        alone = replace(measured, host_cpus=None)
        expected = sum(twin_prefill_s(cfg, alone, load(sc, sd), max_len) for sc, sd in clients)
        prefill_slowdown = overlapped_slowdown(prefill_s / expected, report_overlap[1])
        prefill_weight = fit_prefill_weight(prefill_slowdown, demand, host_cpus)
        measured = replace(measured, prefill_weight=prefill_weight)
    if not colocated:
        probe_step = _probe_step_model(step, _DECODE_PROMPT, _DECODE_PROMPT + 32)
        measured = replace(
            measured,
            handoff_receive_step_s=fit_handoff_step(splits.windows[decode_pool], probe_step),
        )
    workloads = [
        (b, workload_of(f"probe-decode-{b}", sc, info.vocab_size, max_len, sd), recs)
        for b, sc, sd, recs in phases
    ]
    # NOTE: the decode scale took up, besides the steps' own in-place cost, what the twin models on its
    # own in those phases (their prompts' prefill steps beside the decodes, the handoffs received beside
    # them): corrected by their measured over simulated decode seconds, the base apart from the decode
    # terms (one scale for both made the twin's steps at a batch of 1-2 up to 40% slower than real)
    runs_s = [(w, s) for (_, w, _), s in zip(workloads[: len(decode_seconds)], decode_seconds, strict=True)]
    measured, base_scale, twin_scale = twin_decode_terms(cfg, measured, runs_s, max_len)
    # the jitter by batch, then that of a step beside another worker's on top of it, then the jitter by
    # batch again with it (the decode phases' own prefills run beside their first decodes)
    jitter = fit_delivery_jitter_by_batch(cfg, measured, workloads, max_len)
    measured = replace(measured, delivery_jitter_s=0.0, delivery_jitter_by_batch=jitter)
    beside_run = [(load(_BESIDE_PREFILLS, beside_seed), beside)]
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
        "decode_scale": decode_scale * twin_scale,
        "decode_base_scale": decode_scale * base_scale,
        "frontend_cpu_per_token_us": frontend * 1e6,
        "frontend_per_request_ms": per_request * 1e3,
        "host_cpus": host_cpus,
        "host_slowdown": host_slowdown,
        "prefill_slowdown": prefill_slowdown,
        "prefill_weight": prefill_weight,
        "contended_overlap": list(report_overlap),
        "delivery_jitter_ms_by_batch": {str(b): j * 1e3 for b, j in jitter},
        "delivery_jitter_contended_ms": measured.delivery_jitter_contended_s * 1e3,
        "handoff_receive_step_ms": measured.handoff_receive_step_s * 1e3,
    }
    # each decode phase (batch, measured decode seconds) and the twin's after the fit
    twin_s = _twin_decode_seconds(cfg, measured, runs_s, max_len)
    report["decode_phases"] = [[b, s, t] for (b, *_), (_, s), t in zip(phases, runs_s, twin_s, strict=False)]
    if not colocated:  # each prefill phase (seconds, steps) and how close the twin's prefill worker comes
        report["prefill_phases"] = [[r.seconds, r.steps] for r in prefill_runs]
        report["prefill_twin_over_real"] = [
            twin_prefill_s(cfg, measured, w, max_len) / r.seconds
            for r, w in zip(prefill_runs, prefill_workloads, strict=True)
        ]
    return measured, report


def calibrate_and_probe(url: str, handle: ClusterHandle, *, reps: int, seed: int) -> CostProfile:
    """On a running cluster: the sweep in a Ray worker, then the probe."""
    sweep = calibrate_profile(handle.config, reps=reps, seed=seed, in_ray=True)
    return probe_and_report(url, handle, sweep, seed)


def probe_and_report(
    url: str, handle: ClusterHandle, sweep: CostProfile, seed: int, label: str = ""
) -> CostProfile:
    """The probe over the sweep's profile `sweep`; prints its figures (``cluster probe<label>: {...}``)."""
    profile, report = asyncio.run(probe(url, handle, sweep, seed))
    print(f"cluster probe{label}: " + json.dumps({k: _round(v) for k, v in report.items()}), flush=True)
    return profile


def _round(v: Any) -> Any:
    if isinstance(v, dict):
        return {k: _round(x) for k, x in v.items()}
    return [_round(x) for x in v] if isinstance(v, list) else round(v, 3)


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
