"""The cluster probe of ``pdserve plan calibrate --probe``: on the running cluster, measure what surrounds
a step there, beside the engine sweep's step model (deploy/plan/calibrate.py). The phases run in turn
(``ProbePhases``, their loads in probe_loads.py); probe_fit.py turns what they measured into the
profile (the fits themselves: fit_prefill.py, fit_decode.py, fit_jitter.py, fit_host.py):

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

import asyncio
import time
from typing import TYPE_CHECKING, Any

from cluster.cost_model import CostProfile
from deploy.loadgen import ClientSettings, Record, Scenario, run_scenario
from deploy.plan.fit_prefill import PrefillRun
from deploy.plan.harness import EngineTotals, SplitWindows
from deploy.plan.probe_fit import ContendedRun, DecodeBatches, DecodePhase, ProbeMeasurements, fit_probe
from deploy.plan.probe_loads import (
    BESIDE_PREFILLS,
    BURSTS,
    DECODE_BATCHES,
    IDLE_PROMPT_LENS,
    LIGHT_BATCH,
    LIGHT_WAVES,
    PREFILL_BURSTS,
    decode_scenario,
    handoff_scenario,
    idle_scenario,
    prefill_load_scenario,
    step_ratio,
)

if TYPE_CHECKING:
    from deploy.launch import Cluster


class ProbePhases:
    """The probe's phases on a running cluster (``url`` serves ``handle``), measured against the sweep's
    profile ``sweep``; ``probe`` runs them in their order. Each sends its loads through the load
    generator and reads the pools' engine counters (and the decode pool's step splits) around them; the
    prefill pool's runs gather in ``prefill_runs`` and ``prefill_loads``."""

    def __init__(self, url: str, handle: Cluster, sweep: CostProfile, seed: int) -> None:
        self.url = url
        self.handle = handle
        self.sweep = sweep
        cfg = handle.config
        # NOTE: the prefill pool's token budget cuts the prompts into chunks; the decode pool's seats bound
        # the decode batches
        self.prefill_engine = cfg.engine_config(cfg.prefill_pool)
        self.decode_engine = cfg.engine_config(cfg.decode_pool)
        self.colocated = cfg.router.mode == "colocated"
        self.prefill_pool, self.decode_pool = cfg.prefill_pool, cfg.decode_pool  # colocated: one pool
        # NOTE: a seed per probe run: the same seed would give each run's first prompt the previous one's
        # tokens as a prefix, and prefix-cache hits would make prefills look cheaper than they are
        self.seeds = iter(range(seed * 1000 + 1, seed * 1000 + 1000))
        self.prefill_runs: list[PrefillRun] = []  # the prefill pool's idle prefills (and bursts)
        self.prefill_loads: list[tuple[Scenario, int]] = []  # what each of them ran (scenario, seed)
        # what a handoff costs the steps beside it, from the workers' step splits over the light batch,
        # as many short streams (a handoff every few steps) and the contended phase
        self.splits = SplitWindows(handle, (self.decode_pool,))

    async def _send(self, name: str, scenario: Scenario, seed: int) -> tuple[list[Record], float]:
        return await run_scenario(self.url, name, ClientSettings(seed), scenario)

    def _totals(self, pool: str) -> EngineTotals:
        return EngineTotals.of(self.handle, pool)

    def _add_prefill_run(
        self, before: EngineTotals, done: list[Record], scenario: Scenario, seed: int
    ) -> None:
        ran = self._totals(self.prefill_pool) - before
        budget = self.prefill_engine.max_num_batched_tokens
        self.prefill_runs.append(PrefillRun.of(ran, self.sweep.step, done, budget))
        self.prefill_loads.append((scenario, seed))

    async def idle_prefills(self) -> list[Record]:
        """Prompts of four lengths, each alone: the control hop, the HTTP edge, the KV handoff and the
        prefill fit's idle runs. Returns the answered requests."""
        idle: list[Record] = []
        for n in IDLE_PROMPT_LENS:
            before = self._totals(self.prefill_pool)
            scenario, phase_seed = idle_scenario(n), next(self.seeds)
            recs, _ = await self._send(f"probe-{n}", scenario, phase_seed)
            done = [r for r in recs if r.error is None and r.server and r.ttft_s is not None]
            if done:
                self._add_prefill_run(before, done, scenario, phase_seed)
            idle += done
        if not idle:
            raise RuntimeError("cluster probe: every probe request failed")
        return idle

    async def decode_batches(self) -> DecodeBatches:
        """Steady decode batches: their steps against the sweep's, and the front end's CPU per token."""
        cpu0, wall0 = time.process_time(), time.perf_counter()
        num_tokens, per_step = 0, []
        decode_seconds: list[float] = []  # the decode workers' engine seconds in each phase
        phases: list[DecodePhase] = []  # the decode batches, to fit the jitter on
        for batch in sorted({min(b, self.decode_engine.max_num_seqs) for b in DECODE_BATCHES}):
            before = self._totals(self.decode_pool)
            # NOTE: at least 32 requests (in waves): a single wave of 8 streams gave a spread of gaps (the
            # jitter fit) twice the usual now and then
            scenario, phase_seed = decode_scenario(batch, max(1, 32 // batch)), next(self.seeds)
            recs, _ = await self._send(f"probe-decode-{batch}", scenario, phase_seed)
            num_tokens += sum(r.output_tokens for r in recs)
            ran = self._totals(self.decode_pool) - before
            per_step.append(step_ratio(self.sweep, ran))
            decode_seconds.append(ran.seconds)
            phases.append(DecodePhase(batch, scenario, phase_seed, recs))
        frontend = (time.process_time() - cpu0) / max(1, num_tokens)
        demand = 1.0 + min(1.0, num_tokens / (time.perf_counter() - wall0) * frontend)
        return DecodeBatches(phases, decode_seconds, per_step, frontend, demand)

    async def bursts(self) -> list[list[Record]]:
        """Bursts of short requests sent at once, for the front end's work per request (in a
        disaggregated cluster, the prefill worker's time in them and in the bursts of prompts joins the
        prefill fit: many prompts in one step; colocated, the burst's decodes share those steps).
        Returns the short bursts' records."""
        bursts: list[list[Record]] = []
        for scenario in BURSTS + (() if self.colocated else PREFILL_BURSTS):
            before, phase_seed = self._totals(self.prefill_pool), next(self.seeds)
            recs, _ = await self._send("probe-burst", scenario, phase_seed)
            done = [r for r in recs if r.error is None]
            if done and not self.colocated:
                self._add_prefill_run(before, done, scenario, phase_seed)
            if scenario in BURSTS:
                bursts.append(recs)
        return bursts

    async def light_batch(self, decode: DecodeBatches) -> None:
        """A light batch too, unless ``decode`` ran it (appended to it): for the jitter (its tokens reach
        the clients steadier than a batch of 8's) and the handoff cost; the steps and the front end are
        measured on the batches before it."""
        light = min(LIGHT_BATCH, self.decode_engine.max_num_seqs)
        if light in (p.batch for p in decode.phases):
            return
        scenario, phase_seed = decode_scenario(light, LIGHT_WAVES), next(self.seeds)
        before = self._totals(self.decode_pool)
        self.splits.open()
        recs, _ = await self._send(f"probe-decode-{light}", scenario, phase_seed)
        self.splits.close()
        decode.seconds.append((self._totals(self.decode_pool) - before).seconds)
        decode.phases.append(DecodePhase(light, scenario, phase_seed, recs))

    async def handoffs(self) -> None:
        """As many short streams as the light batch at a time (a handoff every few steps), for the step
        splits; nothing colocated."""
        if self.colocated:
            return
        light = min(LIGHT_BATCH, self.decode_engine.max_num_seqs)
        self.splits.open()
        await self._send("probe-handoffs", handoff_scenario(light), next(self.seeds))
        self.splits.close()

    async def beside_prefills(self) -> tuple[int, list[Record]]:
        """Two streams at a time beside their successors' long prompts: (seed, records)."""
        beside_seed = next(self.seeds)
        beside, _ = await self._send("probe-beside-prefills", BESIDE_PREFILLS, beside_seed)
        return beside_seed, beside

    async def contended(self, decode: DecodeBatches) -> ContendedRun | None:
        """The first decode batch again (in waves, to last as long as the prefills), while the prefill
        worker computes prompts like the scenarios' (256 tokens, two at a time): how much two busy
        workers (and the front end) slow each other down on this host. None colocated, or without the
        sweep's host CPU count."""
        if self.colocated or not self.sweep.host_cpus:
            return None
        before, t0 = self._totals(self.decode_pool), time.perf_counter()
        before_prefill = self._totals(self.prefill_pool)
        batch = min(8, self.decode_engine.max_num_seqs)
        loads = [(decode_scenario(batch, 6), next(self.seeds)), (prefill_load_scenario(), next(self.seeds))]
        self.splits.open()
        runs = await asyncio.gather(
            self._send("probe-contended", loads[0][0], loads[0][1]),
            self._send("probe-prefill-load", loads[1][0], loads[1][1]),
        )
        self.splits.close()
        decoded = self._totals(self.decode_pool) - before
        prefilled = self._totals(self.prefill_pool) - before_prefill
        rate = sum(r.output_tokens for recs, _ in runs for r in recs) / (time.perf_counter() - t0)
        (_, decode_s), (_, prefill_s) = runs
        return ContendedRun(decoded, prefilled, rate, decode_s, prefill_s, loads)


async def probe(
    url: str, handle: Cluster, profile: CostProfile, seed: int
) -> tuple[CostProfile, dict[str, Any]]:
    """Measure the terms of the module docstring on the running cluster (``url`` serves ``handle``)."""
    phases = ProbePhases(url, handle, profile, seed)
    idle = await phases.idle_prefills()
    decode = await phases.decode_batches()
    bursts = await phases.bursts()
    await phases.light_batch(decode)
    await phases.handoffs()
    beside = await phases.beside_prefills()
    contended = await phases.contended(decode)
    measured = ProbeMeasurements(
        colocated=phases.colocated,
        idle=idle,
        prefill_runs=phases.prefill_runs,
        prefill_loads=phases.prefill_loads,
        decode=decode,
        bursts=bursts,
        handoff_splits=phases.splits.windows[phases.decode_pool],
        beside=beside,
        contended=contended,
    )
    return fit_probe(handle.config, profile, handle.model_info, measured)
