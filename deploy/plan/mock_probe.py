"""The probe of a mock cluster (``load_format: mock``; ``pdserve plan validate`` of one): its workers'
steps wait a known cost profile (a GPU's roofline estimate), so the step model is not fitted; what the
probe measures is what surrounds those steps on this host, over the profile as it is:

* one control hop, the HTTP edge and the KV handoff (latency + bytes / bandwidth: the mock moves the
  model's real KV bytes over this host's transfer backend), from prompts of five lengths each alone;
* the front end's CPU per streamed token (router, HTTP edge and client in this process) over decode
  batches of 8 and 32 streams, and its work per new request, taken one at a time, from bursts of short
  requests;
* the mock's own host time per step, per decode sequence, per prompt chunk and per prompt token, what a
  received handoff adds to the step it finishes beside (per KV position), and how much slower a handoff
  runs beside a spinning worker (a burst of long prompts that outgrows the prefill worker's KV): the
  fits of deploy/plan/fit_mock.py;
* the delivery jitter by decode batch (2 streams after 256-token prompts; 8 and 32 after 16-token ones,
  whose handoffs move little), as the CPU probe fits it (deploy/plan/fit_jitter.py).

The phases' loads are the CPU probe's (deploy/plan/probe_loads.py) but for the prompt lengths, which go
up to the mock's context, and the spinning burst.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

from cluster.config import ClusterConfig
from cluster.cost_model import CostProfile
from deploy.loadgen import ClientSettings, Scenario, run_scenario
from deploy.plan.fit_jitter import fit_delivery_jitter_by_batch
from deploy.plan.fit_mock import (
    PhaseRun,
    decode_step_model,
    fit_decode_host,
    fit_frontend_in_order,
    fit_loaded_transfer,
    fit_prompt_host,
    fit_receive_per_token,
    fit_spinning_scale,
    host_residuals,
)
from deploy.plan.harness import EngineTotals, received_of, split_delta, step_split_of, transfer_delta
from deploy.plan.probe_fit import fit_edge
from deploy.plan.probe_loads import (
    BESIDE_PREFILLS,
    BURSTS,
    DECODE_PROMPT,
    LIGHT_BATCH,
    LIGHT_WAVES,
    PREFILL_BURSTS,
    decode_scenario,
    handoff_scenario,
    idle_scenario,
)

if TYPE_CHECKING:
    from deploy.launch import Cluster

IDLE_PROMPT_LENS = (16, 256, 1024, 2048, 3072)  # each alone (up to the context less the 2 tokens out)
FRONTEND_BATCHES = (8, 32)  # the decode batches the front end's CPU per token is measured over
SPIN_OVERFILL = 2.5  # the spinning burst's prompts hold this many times the prefill worker's KV blocks
MAX_SPIN_PROMPTS = 24


@dataclass
class MockMeasurements:
    """What the mock probe's phases measured (``PhaseRun`` each): the idle prompts, the decode batches
    the delivery jitter is fitted on (batch -> phase), the bursts of short requests, the phases whose decode steps the host terms are
    fitted on, the spinning burst, every phase, and the front end's CPU seconds per streamed token over
    the decode batches."""

    idle: list[PhaseRun]
    decode: dict[int, PhaseRun]
    bursts: list[PhaseRun]
    decoding: list[PhaseRun]
    spin: PhaseRun | None
    phases: list[PhaseRun]
    frontend: float


class MockPhases:
    """Runs the mock probe's loads against ``url`` (serving ``handle``): around each, the pools' engine
    totals, the decode pool's step split and its receivers' transfer totals."""

    def __init__(self, url: str, handle: Cluster, seed: int) -> None:
        self.url = url
        self.handle = handle
        cfg = handle.config
        self.pools = tuple(dict.fromkeys((cfg.prefill_pool, cfg.decode_pool)))
        self.decode_pool = cfg.decode_pool
        # NOTE: a seed per phase: the same seed would give each phase's first prompt the previous one's
        # tokens as a prefix, and prefix-cache hits would make prefills look cheaper than they are
        self.seeds = iter(range(seed * 1000 + 1, seed * 1000 + 1000))

    async def run(self, name: str, scenario: Scenario) -> PhaseRun:
        seed, handle = next(self.seeds), self.handle
        before = {pool: EngineTotals.of(handle, pool) for pool in self.pools}
        split, received = step_split_of(handle, self.decode_pool), received_of(handle, self.decode_pool)
        records, _ = await run_scenario(self.url, name, ClientSettings(seed), scenario)
        totals = {pool: EngineTotals.of(handle, pool) - before[pool] for pool in self.pools}
        split = split_delta(step_split_of(handle, self.decode_pool), split)
        received = transfer_delta(received_of(handle, self.decode_pool), received)
        return PhaseRun(name, scenario, seed, records, totals, split, received)


def steady_scenario(batch: int) -> Scenario:
    """``batch`` streams of 192 tokens at once after 16-token prompts."""
    return Scenario(batch, (16, 16), (192, 192), max_concurrency=batch)


def spin_scenario(handle: Cluster, prompt_len: int) -> Scenario | None:
    """Prompts of ``prompt_len`` sent at once, holding ``SPIN_OVERFILL`` times the prefill worker's KV
    blocks: it spins while the first ones' KV leaves. None colocated or with a KV cache sized at run
    time (no block count in the config)."""
    cfg = handle.config
    engine = cfg.engine_config(cfg.prefill_pool)
    if cfg.router.mode == "colocated" or not engine.num_kv_blocks:
        return None
    blocks = -(-prompt_len // engine.block_size)
    n = min(MAX_SPIN_PROMPTS, max(2, round(SPIN_OVERFILL * engine.num_kv_blocks / blocks)))
    return Scenario(n, (prompt_len, prompt_len), (2, 2))


async def run_mock_phases(url: str, handle: Cluster, seed: int) -> MockMeasurements:
    """Every phase of the module docstring, in turn, on the running mock cluster."""
    p = MockPhases(url, handle, seed)
    lens = [n for n in IDLE_PROMPT_LENS if n <= handle.model_info.max_model_len - 2]
    idle = [await p.run(f"probe-{n}", idle_scenario(n)) for n in lens]
    max_seqs = handle.config.engine_config(handle.config.decode_pool).max_num_seqs
    decode: dict[int, PhaseRun] = {}
    cpu, num_tokens = 0.0, 0
    frontend_batches = {min(b, max_seqs) for b in FRONTEND_BATCHES}
    for batch in sorted({min(LIGHT_BATCH, max_seqs)} | frontend_batches):
        waves = LIGHT_WAVES if batch == LIGHT_BATCH else max(1, 32 // batch)
        cpu0 = time.process_time()
        decode[batch] = run = await p.run(f"probe-decode-{batch}", decode_scenario(batch, waves))
        if batch in frontend_batches:
            cpu += time.process_time() - cpu0
            num_tokens += sum(r.output_tokens for r in run.records)
    # decode batches whose prompts are short (their handoffs move little): the steps' host terms apart
    # from the transfers', and the delivery jitter
    steady = {b: await p.run(f"probe-steady-{b}", steady_scenario(b)) for b in sorted(frontend_batches)}
    bursts = [await p.run("probe-burst", s) for s in BURSTS]
    prefill_bursts = [await p.run("probe-prefill-burst", s) for s in PREFILL_BURSTS]
    handoffs = await p.run("probe-handoffs", handoff_scenario(min(LIGHT_BATCH, max_seqs)))
    beside = await p.run("probe-beside-prefills", BESIDE_PREFILLS)
    spin_load = spin_scenario(handle, lens[-1])
    spin = await p.run("probe-spin", spin_load) if spin_load is not None else None
    decoding = [*decode.values(), *steady.values(), handoffs, beside]
    jitter = {min(LIGHT_BATCH, max_seqs): decode[min(LIGHT_BATCH, max_seqs)], **steady}
    phases = [*idle, *decoding, *bursts, *prefill_bursts] + ([spin] if spin is not None else [])
    return MockMeasurements(idle, jitter, bursts, decoding, spin, phases, cpu / max(1, num_tokens))


def fit_mock_probe(
    cfg: ClusterConfig, profile: CostProfile, vocab_size: int, max_model_len: int, m: MockMeasurements
) -> tuple[CostProfile, dict[str, Any]]:
    """``profile`` (the one the mock workers wait) with every term of the module docstring fitted on
    ``m``, and the figures to print."""
    colocated = cfg.router.mode == "colocated"
    idle = [r for phase in m.idle for r in phase.records if r.error is None and r.server and r.ttft_s]
    if not idle:
        raise RuntimeError("mock probe: every idle prompt failed")
    decode_engine = cfg.engine_config(cfg.decode_pool)
    hop, edge, idle_transfer = fit_edge(profile, decode_engine, idle, colocated)
    transfer = idle_transfer if colocated else fit_loaded_transfer(idle_transfer, m.decoding)
    # NOTE: a burst's requests reach the router one by one, per request apart (the edge times of a burst
    # of 32 rose about linearly, 30 -> 178 ms): the front end takes them in order
    per_request = fit_frontend_in_order([b.records for b in m.bursts])
    measured = replace(
        profile,
        source=f"{profile.source}; in place on a mock cluster (pdserve plan validate's mock probe)",
        host_cpus=None,
        hop_s=hop,
        http_s=max(0.0, (edge - per_request - m.frontend) / 2),  # an idle request's edge time
        transfer=transfer,
        frontend_cpu_per_token_s=m.frontend,
        frontend_s_per_request=per_request,
        frontend_fifo=True,
        # NOTE: a mock worker sleeps through its steps: no jitter beside another worker's step (on the
        # CPU cluster, a stream's threads waiting for a core beside another worker's compute), and a
        # handoff sent beside a prefill step costs it nothing the probe could tell from its host terms
        delivery_jitter_contended_s=0.0,
        handoff_send_step_s=0.0,
        handoff_receive_step_s=0.0,
    )
    step_s, decode_s, transfer_s = fit_decode_host(
        cfg, measured, m.decoding + m.idle, vocab_size, max_model_len
    )
    measured = replace(measured, host_step_s=step_s, host_decode_s=decode_s, host_transfer_s=transfer_s)
    budget = cfg.engine_config(cfg.prefill_pool).max_num_batched_tokens
    chunk_s, token_s = fit_prompt_host(measured, m.idle, cfg.prefill_pool, budget)
    measured = replace(measured, host_chunk_s=chunk_s, host_token_s=token_s)
    model_s = decode_step_model(measured, DECODE_PROMPT + 48)
    receive = fit_receive_per_token(m.decoding, model_s, decode_engine.block_size)
    measured = replace(measured, handoff_receive_token_s=receive)
    if m.spin is not None:
        scale = fit_spinning_scale(cfg, measured, m.spin, vocab_size, max_model_len)
        measured = replace(measured, spinning_transfer_scale=scale)
    runs = [(b, run.workload(vocab_size, max_model_len), run.records) for b, run in m.decode.items()]
    jitter = fit_delivery_jitter_by_batch(cfg, measured, runs, max_model_len)
    measured = replace(measured, delivery_jitter_s=0.0, delivery_jitter_by_batch=jitter)
    report: dict[str, Any] = {
        "hop_ms": hop * 1e3,
        "http_ms": measured.http_s * 1e3,
        "transfer_latency_ms": transfer.latency_s * 1e3,
        "transfer_gb_per_s": transfer.bytes_per_s / 1e9,
        "idle_transfer_gb_per_s": idle_transfer.bytes_per_s / 1e9,
        "frontend_cpu_per_token_us": m.frontend * 1e6,
        "frontend_per_request_ms": per_request * 1e3,
        "host_step_ms": measured.host_step_s * 1e3,
        "host_decode_us": measured.host_decode_s * 1e6,
        "host_chunk_ms": measured.host_chunk_s * 1e3,
        "host_token_us": measured.host_token_s * 1e6,
        "host_transfer_ms": measured.host_transfer_s * 1e3,
        "handoff_receive_token_us": measured.handoff_receive_token_s * 1e6,
        "spinning_transfer_scale": measured.spinning_transfer_scale,
        "delivery_jitter_ms_by_batch": {str(b): j * 1e3 for b, j in jitter},
        # each phase's pools: measured engine seconds and the twin's busy seconds after the fit
        "phases": [
            [name, pool, real, twin]
            for name, pool, real, twin in host_residuals(cfg, measured, m.phases, vocab_size, max_model_len)
        ],
    }
    return measured, report


def probe_mock(
    url: str, handle: Cluster, profile: CostProfile, seed: int
) -> tuple[CostProfile, dict[str, Any]]:
    """The mock probe on a running mock cluster (``url`` serves ``handle``) whose workers wait ``profile``."""
    m = asyncio.run(run_mock_phases(url, handle, seed))
    info = handle.model_info
    return fit_mock_probe(handle.config, profile, info.vocab_size, info.max_model_len, m)
