"""The mock probe's fits (deploy/plan/mock_probe.py runs its phases): what a mock cluster's steps and
handoffs cost on this host beside the cost profile its workers wait.

A mock worker's step waits the profile's time for its shape, and its own host work comes on top
(``CostProfile.host_step_s``, ``host_decode_s``, ``host_chunk_s``, ``host_token_s``):

* the front end's work per new request, taken one at a time (``fit_frontend_in_order``: a burst's
  requests reach the router that far apart);
* per step, per decode sequence and while the worker's transfer thread moves KV (``fit_decode_host``,
  ``host_transfer_s``): the decode workers' steps beside which no transfer finished (their step
  split), mean step less the profile's for the twin's steps of the same phase, against their mean batch
  and the share of the twin's steps that began beside a transfer, over the decode phases;
* per prompt chunk and per prompt token (``fit_prompt_host``): the prefill workers' seconds over prompts
  sent one at a time, less the profile's and the per-step term, against their chunks and tokens;
* what a received handoff adds to the step beside which it finished, per KV position it moved
  (``fit_receive_per_token``: the steps beside a finished transfer against the others, as
  ``fit_handoff_step`` reads them, over the positions those transfers moved; ``handoff_receive_token_s``);
* the handoff's bandwidth in place (``fit_loaded_transfer``: the decode phases' received bytes over
  their seconds, the idle handoffs' latency apart);
* how much slower a handoff runs while its sender spins (``fit_spinning_scale``: a burst of long prompts
  that holds more KV than the prefill worker has, through the twin; ``spinning_transfer_scale``).
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

import numpy as np

from cluster.config import ClusterConfig
from cluster.cost_model import CostProfile, StepShape, TransferCost, shape_of
from cluster.protocol import StepSplit, TransferStats
from deploy.loadgen import Record, Scenario
from deploy.plan.harness import EngineTotals
from deploy.plan.inputs import twin_config, workload_of
from deploy.planner.sim import Simulation
from deploy.planner.twin import SimWorker
from deploy.planner.workload import Workload

_MIN_PLAIN_STEPS = 50  # decode phases with fewer steps beside no transfer are pooled into one row
_MAX_SPINNING_SCALE = 8.0
_MAX_PER_REQUEST_S = 0.02


@dataclass(frozen=True)
class PhaseRun:
    """One phase of the mock probe: its load (``scenario`` sent with ``seed``), the clients' records,
    each pool's engine totals over it, the decode pool's step split and its KV receivers' totals."""

    name: str
    scenario: Scenario
    seed: int
    records: list[Record]
    totals: dict[str, EngineTotals]
    split: StepSplit
    received: TransferStats

    def workload(self, vocab_size: int, max_model_len: int) -> Workload:
        return workload_of(self.name, self.scenario, vocab_size, max_model_len, self.seed)


@dataclass
class PoolCounts:
    """What a pool's twin workers ran in one phase: the profile's own seconds for its steps (no host
    terms, no handoff charges), its steps and how many of them began beside a transfer."""

    profile_s: float = 0.0
    steps: int = 0
    overlapped: int = 0  # steps that began while the worker's transfer thread moved KV


def bare(profile: CostProfile) -> CostProfile:
    """``profile`` without the host terms."""
    return replace(
        profile, host_step_s=0.0, host_decode_s=0.0, host_chunk_s=0.0, host_token_s=0.0, host_transfer_s=0.0
    )


def twin_counts(
    cfg: ClusterConfig, profile: CostProfile, workload: Workload, max_model_len: int
) -> dict[str, PoolCounts]:
    """Each pool's ``PoolCounts`` when the twin of ``cfg`` runs ``workload`` under ``profile``."""
    counts: dict[str, PoolCounts] = {}
    own = bare(profile)

    def on_step(w: SimWorker, t: float, shape: StepShape, step_s: float) -> None:
        c = counts.setdefault(w.pool, PoolCounts())
        c.profile_s += own.step_s(shape)
        c.steps += 1
        c.overlapped += w.link_free_s > t

    Simulation(twin_config(cfg, profile, max_model_len), profile, workload, on_step=on_step).run()
    return counts


def nonnegative_lstsq(design: np.ndarray, y: np.ndarray) -> np.ndarray:
    """``x >= 0`` minimizing ``|design x - y|``: of the least-squares fits on every subset of the columns
    whose coefficients all come out non-negative, the one with the least error (the others 0)."""
    n = design.shape[1]
    best: tuple[float, np.ndarray] = (float((y**2).sum()), np.zeros(n))
    for k in range(1, n + 1):
        for cols in itertools.combinations(range(n), k):
            coef, *_ = np.linalg.lstsq(design[:, cols], y, rcond=None)
            if any(c < 0.0 for c in coef):
                continue
            x = np.zeros(n)
            x[list(cols)] = coef
            error = float(((design @ x - y) ** 2).sum())
            if error < best[0]:
                best = (error, x)
    return best[1]


def fit_decode_host(
    cfg: ClusterConfig,
    profile: CostProfile,
    phases: Sequence[PhaseRun],
    vocab_size: int,
    max_model_len: int,
    rounds: int = 3,
) -> tuple[float, float, float]:
    """(``host_step_s``, ``host_decode_s``, ``host_transfer_s``): see the module docstring (phases of
    fewer than ``_MIN_PLAIN_STEPS`` such steps pooled into one row); ``rounds`` times, the twin's steps
    under the terms so far (which of them begin beside a transfer moves with the terms); zeros without a
    row."""
    terms = (0.0, 0.0, 0.0)
    for _ in range(rounds):
        now = replace(profile, host_step_s=terms[0], host_decode_s=terms[1], host_transfer_s=terms[2])
        rows, targets = _decode_rows(cfg, now, phases, vocab_size, max_model_len)
        if not rows:
            return terms
        step_s, decode_s, transfer_s = nonnegative_lstsq(np.array(rows), np.array(targets))
        terms = (float(step_s), float(decode_s), float(transfer_s))
    return terms


def _decode_rows(
    cfg: ClusterConfig, profile: CostProfile, phases: Sequence[PhaseRun], vocab_size: int, max_model_len: int
) -> tuple[list[list[float]], list[float]]:
    rows, targets = [], []
    pool = cfg.decode_pool
    small = [0.0, 0, 0, 0.0, 0, 0]  # phases of fewer steps, pooled: seconds, steps, tokens; the twin's
    for phase in phases:
        s = phase.split
        plain = s.num_steps - s.beside_steps
        twin = twin_counts(cfg, profile, phase.workload(vocab_size, max_model_len), max_model_len).get(pool)
        if plain < 1 or twin is None or twin.steps == 0:
            continue
        seconds, tokens = s.seconds - s.beside_seconds, s.num_tokens - s.beside_tokens
        if plain < _MIN_PLAIN_STEPS:
            for i, v in enumerate((seconds, plain, tokens, twin.profile_s, twin.steps, twin.overlapped)):
                small[i] += v
            continue
        rows.append([1.0, tokens / plain, twin.overlapped / twin.steps])
        targets.append(seconds / plain - twin.profile_s / twin.steps)
    seconds, plain, tokens, profile_s, twin_steps, overlapped = small
    if plain >= _MIN_PLAIN_STEPS / 4:
        rows.append([1.0, tokens / plain, overlapped / twin_steps])
        targets.append(seconds / plain - profile_s / twin_steps)
    return rows, targets


def fit_prompt_host(
    profile: CostProfile, idle: Sequence[PhaseRun], pool: str, budget: int
) -> tuple[float, float]:
    """(``host_chunk_s``, ``host_token_s``) from prompts sent one at a time (each phase one length, every
    prompt alone in its steps, cut into chunks of ``budget`` tokens): ``pool``'s engine seconds less the
    profile's seconds for those chunks and ``host_step_s`` for each step; (0, 0) without such a phase."""
    rows, targets = [], []
    for phase in idle:
        totals = phase.totals.get(pool)
        done = [r for r in phase.records if r.error is None]
        if totals is None or not done or totals.num_steps == 0:
            continue
        chunks = [
            shape_of([(start, min(budget, r.prompt_len - start), False)])
            for r in done
            for start in range(0, r.prompt_len, budget)
        ]
        own = sum(profile.step.step_s(c) * profile.step_scale for c in chunks)
        rows.append([float(len(chunks)), float(sum(r.prompt_len for r in done))])
        targets.append(totals.seconds - own - profile.host_step_s * totals.num_steps)
    if not rows:
        return 0.0, 0.0
    chunk_s, token_s = nonnegative_lstsq(np.array(rows), np.array(targets))
    return float(chunk_s), float(token_s)


def fit_receive_per_token(
    phases: Sequence[PhaseRun], model_s: Callable[[float, float], float], block_size: int
) -> float:
    """``handoff_receive_token_s``: over the decode phases' splits, what the steps beside which a
    transfer finished took beyond the others (less what their shapes alone make them differ by:
    ``model_s(tokens a step streams, prompt tokens it computes)``), per KV position those transfers moved
    (each phase's prompts are of one length, whole blocks moving); 0.0 when none finished beside a
    step."""
    extra, positions = 0.0, 0
    for phase in phases:
        s = phase.split
        plain = s.num_steps - s.beside_steps
        if s.beside_transfers < 1 or plain < 1:
            continue
        beside = s.beside_steps
        shape_gap = model_s(s.beside_tokens / beside, s.beside_prompt_tokens / beside) - model_s(
            (s.num_tokens - s.beside_tokens) / plain, (s.prompt_tokens - s.beside_prompt_tokens) / plain
        )
        extra += s.beside_seconds - beside * ((s.seconds - s.beside_seconds) / plain + shape_gap)
        moved = -(-phase.scenario.prompt_len[1] // block_size) * block_size
        positions += s.beside_transfers * moved
    return max(0.0, extra / positions) if positions else 0.0


def decode_step_model(profile: CostProfile, context: int) -> Callable[[float, float], float]:
    """A decode pool's mean step under ``profile``: a batch of the tokens it streams (linear between
    whole batches) at ``context`` tokens, and its prompt tokens as one chunk."""

    def at(batch: int, prompt_tokens: float) -> float:
        chunk = [(0, round(prompt_tokens), False)] if prompt_tokens >= 1 else []
        return profile.step_s(shape_of([(context, 1, True)] * batch + chunk))

    def model_s(tokens: float, prompt_tokens: float) -> float:
        lo = int(tokens)
        return at(lo, prompt_tokens) + (tokens - lo) * (at(lo + 1, prompt_tokens) - at(lo, prompt_tokens))

    return model_s


def twin_transfer_s(
    cfg: ClusterConfig, profile: CostProfile, workload: Workload, max_model_len: int
) -> tuple[float, float]:
    """The twin's handoffs in ``workload``: (their seconds, the share of them that ran while a side
    spun, at scale 1)."""
    sim = Simulation(twin_config(cfg, profile, max_model_len), profile, workload)
    sim.run()
    scale = profile.spinning_transfer_scale
    return sim.transfer_busy_s, sim.spinning_transfer_s / scale if scale > 0 else 0.0


def fit_spinning_scale(
    cfg: ClusterConfig,
    profile: CostProfile,
    spin: PhaseRun,
    vocab_size: int,
    max_model_len: int,
    rounds: int = 3,
) -> float:
    """``spinning_transfer_scale``: the scale with which the twin's handoffs in ``spin`` (a burst that
    outgrows the prefill worker's KV) take the seconds the decode pool's receivers measured, ``rounds``
    times (which handoffs run beside a spinning worker moves with it); within [1, 8], 1.0 when no handoff
    of the twin's ran beside one."""
    measured = spin.received.seconds_total
    workload = spin.workload(vocab_size, max_model_len)
    scale = 1.0
    for _ in range(rounds):
        total, spinning = twin_transfer_s(
            cfg, replace(profile, spinning_transfer_scale=scale), workload, max_model_len
        )
        if spinning <= 0.0:
            return 1.0
        plain = total - scale * spinning
        scale = min(_MAX_SPINNING_SCALE, max(1.0, (measured - plain) / spinning))
    return scale


def fit_frontend_in_order(bursts: Sequence[Sequence[Record]]) -> float:
    """``CostProfile.frontend_s_per_request`` of a front end that takes new requests one at a time
    (``frontend_fifo``): the least-squares slope of a burst's edge times (client TTFT minus the
    router's) in the order they come; of several bursts, the least, within [0, 20 ms]; 0.0 without a
    burst of two or more answered requests.

    NOTE: the least: a larger burst's slope takes in its first tokens, streamed through the same event
    loop meanwhile, which the twin's front end serves apart (on the 2-core box a burst of 32 gave 1.7-11.5
    ms from one probe to the next, one of 8 1.1-4.6 ms)."""
    slopes = []
    for records in bursts:
        edges = sorted(
            r.ttft_s - r.server["ttft_s"]
            for r in records
            if r.error is None and r.ttft_s is not None and r.server and "ttft_s" in r.server
        )
        if len(edges) < 2:
            continue
        mid, mean = (len(edges) - 1) / 2, sum(edges) / len(edges)
        xs = [i - mid for i in range(len(edges))]
        slopes.append(sum(x * (e - mean) for x, e in zip(xs, edges, strict=True)) / sum(x * x for x in xs))
    return min(_MAX_PER_REQUEST_S, max(0.0, min(slopes))) if slopes else 0.0


def fit_loaded_transfer(idle: TransferCost, phases: Sequence[PhaseRun]) -> TransferCost:
    """The KV handoff in place: ``idle``'s latency (from prompts each alone), and the bandwidth the decode
    pool's receivers measured over ``phases`` (decode batches: the handoffs share the host with the
    steps, the front end and each other; on the 2-core box they ran at a third to a half of an idle
    handoff's bandwidth); ``idle`` where they moved nothing."""
    num = sum(p.received.num_ok for p in phases)
    nbytes = sum(p.received.bytes_total for p in phases)
    seconds = sum(p.received.seconds_total for p in phases) - num * idle.latency_s
    if num < 1 or nbytes <= 0 or seconds <= 0.0:
        return idle
    return TransferCost(idle.latency_s, nbytes / seconds)


def host_residuals(
    cfg: ClusterConfig, profile: CostProfile, phases: Sequence[PhaseRun], vocab_size: int, max_model_len: int
) -> list[tuple[str, str, float, float]]:
    """Each phase's pools: (phase, pool, measured seconds, the twin's busy seconds under ``profile``)."""
    out = []
    for phase in phases:
        workload = phase.workload(vocab_size, max_model_len)
        busy = Simulation(twin_config(cfg, profile, max_model_len), profile, workload).run().worker_busy_s
        for pool, totals in phase.totals.items():
            twin = sum(v for w, v in busy.items() if w.rsplit("-", 1)[0] == pool)
            out.append((phase.name, pool, totals.seconds, twin))
    return out
