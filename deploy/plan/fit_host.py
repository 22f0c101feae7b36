"""The probe's fits of what surrounds a step on the host: how much a busy host slows a prefill step
(``fit_prefill_weight``, from a slowdown measured over a partly overlapped phase: ``overlapped_slowdown``),
the front end's work per new request (``fit_frontend_per_request``), and what a KV handoff received
beside a decode step adds to it (``fit_handoff_step``, with ``probe_step_model`` for the shapes)."""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable, Sequence
from typing import Any

from cluster.cost_model import shape_of
from cluster.protocol import StepSplit
from deploy.loadgen import Record

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


_MAX_PER_REQUEST_S = 0.02


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


def probe_step_model(step: Any, prompt_len: int, context: int) -> Callable[[float, float], float]:
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
