"""Run-time predictions from a cost profile: the TTFT a new request would see on a worker, the cost of
each route, whether to admit it under its SLO. Pure functions over what the router already knows of a
worker (outstanding prompt tokens, its last stats); the planner's simulation uses the same profile.

For the router (items "SLO-aware admission", "routing that explains itself", "live advice"):

    queue = WorkerQueue.of(worker_ref)                        # or built by hand in tests
    ttft = predict_ttft_s(profile, budget, queue, len(prompt), cached_tokens=hit)
    predictor = Predictor(profile, budget)                    # the same, over the router's WorkerRefs
    verdict = admit(ttft, slo_ttft_s)                         # 429 + Retry-After when not verdict.ok
    route = choose_route(profile, budget, len(prompt), prefill_queue, decode_queue,
                         prefill_hit_tokens=..., decode_hit_tokens=..., tbt_slo_s=...)
    route.mode, route.reason, route.ttft_s                    # metrics label, timings field
    traffic.record(arrival_s, len(prompt), num_output_tokens) # each finished request (TrafficLog)

Imports only cluster/ leaves (the cost model, the stats type): no torch, no workers.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass
from typing import Protocol

from cluster.cost_model import CostProfile, StepShape
from cluster.protocol import WorkerStats


class _Load(Protocol):
    @property
    def block_size(self) -> int: ...
    @property
    def num_prompt_tokens(self) -> int: ...
    @property
    def stats(self) -> WorkerStats | None: ...


@dataclass(frozen=True)
class WorkerQueue:
    """What stands between a new request and its first token on one worker.

    ``num_queued_prompt_tokens`` / ``num_queued_prompts``: prompt work routed there and not prefilled
    yet (all of it is computed before the new prompt: admission is FIFO); ``num_running`` /
    ``num_context_tokens``: the decode batch that rides along in every step (colocated and decode
    workers), from the worker's last stats."""

    num_queued_prompt_tokens: int = 0
    num_queued_prompts: int = 0
    num_running: int = 0
    num_context_tokens: int = 0

    @classmethod
    def of(cls, worker: _Load, num_queued_prompts: int | None = None) -> WorkerQueue:
        """From the router's view of a worker (a WorkerRef, or the simulator's SimWorker): its outstanding
        prompt tokens, and from its last stats the running batch, whose context is estimated as the KV
        blocks in use (an upper bound: cached and held blocks count too). ``num_queued_prompts``: how many
        prompts those tokens belong to, when the caller counts them (default: one per full budget)."""
        engine = worker.stats.engine if worker.stats is not None else None
        running = engine.num_running if engine is not None else 0
        used = engine.num_total_blocks - engine.num_free_blocks if engine is not None else 0
        queued = worker.num_prompt_tokens
        return cls(
            num_queued_prompt_tokens=queued,
            num_queued_prompts=num_queued_prompts if num_queued_prompts is not None else int(queued > 0),
            num_running=running,
            num_context_tokens=used * worker.block_size if running else 0,
        )


def prefill_time_s(
    profile: CostProfile, budget: int, queue: WorkerQueue, prompt_tokens: int, cached_tokens: int = 0
) -> float:
    """Seconds from the worker reading the request to its first token: every queued prompt token, then
    its own (at least one is computed), in chunks of ``budget`` minus the running decodes (decodes go
    first, one token each), each step costed by the profile.

    Attention pairs are estimated as each prompt token attending to half of a mean-length prompt."""
    own = max(1, prompt_tokens - min(cached_tokens, prompt_tokens - 1))
    todo = queue.num_queued_prompt_tokens + own
    num_prompts = queue.num_queued_prompts + 1
    mean_len = (queue.num_queued_prompt_tokens + prompt_tokens) / num_prompts
    per_step = max(1, budget - queue.num_running)
    total = 0.0
    context = queue.num_context_tokens
    done = 0
    while done < todo:
        chunk = min(per_step, todo - done)
        seqs = max(1, min(num_prompts, math.ceil(chunk / max(1.0, mean_len))))
        shape = StepShape(
            num_prefill_tokens=chunk,
            num_prefill_seqs=seqs,
            num_decode_seqs=queue.num_running,
            num_context_tokens=context,
            num_attention_pairs=int(chunk * (mean_len + 1) / 2),
            num_padded_context_tokens=context,  # NOTE: contexts taken as equal (only their sum is known)
        )
        total += profile.step_s(shape)
        context += queue.num_running
        done += chunk
    return total


def predict_ttft_s(
    profile: CostProfile, budget: int, queue: WorkerQueue, prompt_tokens: int, cached_tokens: int = 0
) -> float:
    """Client-side TTFT: HTTP in, one hop to the worker, its prefill queue, one hop back, HTTP out."""
    network = 2 * (profile.http_s + profile.hop_s)
    return network + prefill_time_s(profile, budget, queue, prompt_tokens, cached_tokens)


def decode_step_s(profile: CostProfile, num_running: int, num_context_tokens: int) -> float:
    """One decode-only step of ``num_running`` sequences (the TBT they see while nothing else runs)."""
    shape = StepShape(
        num_decode_seqs=num_running,
        num_context_tokens=num_context_tokens,
        num_padded_context_tokens=num_context_tokens,
    )
    return profile.step_s(shape)


def predict_tbt_s(
    profile: CostProfile, decode: WorkerQueue, prompt_tokens: int, num_joining: int = 0
) -> float:
    """The decode step a new request would see on a worker running ``decode``'s batch, with
    ``num_joining`` more requests about to join it: every sequence at the batch's mean context (the new
    one at its prompt). Steps that also carry prompt chunks (colocated) take longer than this."""
    batch = decode.num_running + num_joining + 1
    per_seq = decode.num_context_tokens / decode.num_running if decode.num_running else float(prompt_tokens)
    return decode_step_s(profile, batch, int(per_seq * (batch - 1)) + prompt_tokens)


@dataclass(frozen=True)
class Admission:
    ok: bool
    predicted_ttft_s: float
    retry_after_s: int  # whole seconds for a Retry-After header (0 when admitted)
    predicted_tbt_s: float | None = None
    missed: str = ""  # "ttft" | "tbt": which prediction missed its SLO ("" when admitted)


def admit(predicted_ttft_s: float, slo_ttft_s: float) -> Admission:
    """Admit when the prediction meets the SLO; else tell the client when the excess has drained."""
    if predicted_ttft_s <= slo_ttft_s:
        return Admission(True, predicted_ttft_s, 0)
    return Admission(False, predicted_ttft_s, max(1, math.ceil(predicted_ttft_s - slo_ttft_s)))


@dataclass(frozen=True)
class RouteEstimate:
    """One way to serve a request and what it is predicted to cost."""

    mode: str  # "disaggregated" | "local" (prefilled on the decode / colocated worker)
    ttft_s: float
    first_gap_s: float  # first -> second token: the handoff plus a decode step, or a decode step
    stall_s: float  # the longest step the running decodes of the decode worker sit through for it
    reason: str


def estimate_routes(
    profile: CostProfile,
    budget: int,
    prompt_tokens: int,
    prefill: WorkerQueue,
    decode: WorkerQueue,
    *,
    prefill_hit_tokens: int = 0,
    decode_hit_tokens: int = 0,
) -> tuple[RouteEstimate, RouteEstimate]:
    """(disaggregated, local) estimates for one request: prefill worker + KV handoff of what the decode
    worker's own prefix cache lacks, versus prefilling on the decode worker next to its batch."""
    decode_step = decode_step_s(profile, decode.num_running + 1, decode.num_context_tokens + prompt_tokens)
    moved = max(0, prompt_tokens - decode_hit_tokens)
    remote = RouteEstimate(
        "disaggregated",
        predict_ttft_s(profile, budget, prefill, prompt_tokens, prefill_hit_tokens),
        2 * profile.hop_s + profile.handoff_s(moved) + decode_step,
        decode_step_s(profile, decode.num_running, decode.num_context_tokens),
        "",
    )
    own = max(1, prompt_tokens - min(decode_hit_tokens, prompt_tokens - 1))
    chunk = min(own, max(1, budget - decode.num_running))
    stall = profile.step_s(
        StepShape(
            num_prefill_tokens=chunk,
            num_prefill_seqs=1,
            num_decode_seqs=decode.num_running,
            num_context_tokens=decode.num_context_tokens,
            num_attention_pairs=chunk * (prompt_tokens - own) + chunk * (chunk + 1) // 2,
            num_padded_context_tokens=decode.num_context_tokens,
        )
    )
    local = RouteEstimate(
        "local",
        predict_ttft_s(profile, budget, decode, prompt_tokens, decode_hit_tokens),
        decode_step,
        stall,
        "",
    )
    return remote, local


def choose_route(
    profile: CostProfile,
    budget: int,
    prompt_tokens: int,
    prefill: WorkerQueue,
    decode: WorkerQueue,
    *,
    prefill_hit_tokens: int = 0,
    decode_hit_tokens: int = 0,
    tbt_slo_s: float | None = None,
) -> RouteEstimate:
    """Conditional mode by predicted cost: prefill on the decode worker when that reaches the second
    token no later than the disaggregated path and (with a TBT SLO) does not stall its running decodes
    past it; otherwise disaggregate. The estimate carries the reason (a metrics label)."""
    remote, local = estimate_routes(
        profile,
        budget,
        prompt_tokens,
        prefill,
        decode,
        prefill_hit_tokens=prefill_hit_tokens,
        decode_hit_tokens=decode_hit_tokens,
    )
    if tbt_slo_s is not None and decode.num_running and local.stall_s > tbt_slo_s:
        return _why(remote, "local_prefill_would_stall_decodes")
    if local.ttft_s + local.first_gap_s <= remote.ttft_s + remote.first_gap_s:
        why = "decode_prefix_hit" if decode_hit_tokens > prefill_hit_tokens else "local_prefill_cheaper"
        return _why(local, why)
    return _why(remote, "handoff_cheaper")


def _why(estimate: RouteEstimate, reason: str) -> RouteEstimate:
    return RouteEstimate(estimate.mode, estimate.ttft_s, estimate.first_gap_s, estimate.stall_s, reason)


class _Queued(_Load, Protocol):
    @property
    def num_queued_prompts(self) -> int: ...
    @property
    def num_assigned(self) -> int: ...


@dataclass(frozen=True)
class Predictor:
    """What the router predicts with: a cost profile, the workers' token budget per step
    (``max_num_batched_tokens``) and the TBT bound a local prefill must not stall decodes past."""

    profile: CostProfile
    budget: int
    tbt_slo_s: float | None = None

    def queue(self, worker: _Queued) -> WorkerQueue:
        return WorkerQueue.of(worker, worker.num_queued_prompts)

    def ttft_s(self, worker: _Queued, prompt_tokens: int, cached_tokens: int = 0) -> float:
        """Client-side TTFT of a new request sent to ``worker`` now."""
        return predict_ttft_s(self.profile, self.budget, self.queue(worker), prompt_tokens, cached_tokens)

    def step_now_s(self, worker: _Load) -> float | None:
        """The profile's decode step for the batch ``worker`` last reported (None while it runs none)."""
        q = WorkerQueue.of(worker)
        return decode_step_s(self.profile, q.num_running, q.num_context_tokens) if q.num_running else None

    def tbt_s(self, worker: _Queued, prompt_tokens: int, num_joining: int = 0) -> float:
        """The decode step a new request would see on ``worker``: its running batch (the larger of its
        last stats and the requests the router has there that are past their prefill), the prompts
        queued there and ``num_joining`` more (e.g. prefills on their way to it), and the new one."""
        q = self.queue(worker)
        running = max(q.num_running, worker.num_assigned - worker.num_queued_prompts)
        if running != q.num_running:
            per_seq = q.num_context_tokens / q.num_running if q.num_running else prompt_tokens
            q = WorkerQueue(q.num_queued_prompt_tokens, q.num_queued_prompts, running, int(per_seq * running))
        return predict_tbt_s(self.profile, q, prompt_tokens, worker.num_queued_prompts + num_joining)

    def route(
        self,
        prompt_tokens: int,
        prefill: _Queued,
        decode: _Queued,
        *,
        prefill_hit_tokens: int = 0,
        decode_hit_tokens: int = 0,
    ) -> RouteEstimate:
        """choose_route between ``prefill`` (+ a handoff to ``decode``) and a local prefill on ``decode``."""
        return choose_route(
            self.profile,
            self.budget,
            prompt_tokens,
            self.queue(prefill),
            self.queue(decode),
            prefill_hit_tokens=prefill_hit_tokens,
            decode_hit_tokens=decode_hit_tokens,
            tbt_slo_s=self.tbt_slo_s,
        )


# ---- live advice: what the router remembers of recent traffic --------------------------------------
@dataclass(frozen=True, slots=True)
class TrafficEntry:
    arrival_s: float  # time.time() when the router accepted it
    prompt_tokens: int
    output_tokens: int


class TrafficLog:
    """A sliding window of finished requests. Not thread-safe: the router's loop owns it."""

    def __init__(self, window_s: float = 600.0, max_entries: int = 20_000) -> None:
        if window_s <= 0 or max_entries < 1:
            raise ValueError(f"window_s must be > 0 and max_entries >= 1, got {window_s}, {max_entries}")
        self.window_s = window_s
        self._entries: deque[TrafficEntry] = deque(maxlen=max_entries)

    def record(self, arrival_s: float, prompt_tokens: int, output_tokens: int) -> None:
        self._entries.append(TrafficEntry(arrival_s, prompt_tokens, output_tokens))

    def snapshot(self, now: float) -> list[TrafficEntry]:
        """Entries that arrived within the window before ``now``, oldest first (older ones are dropped)."""
        horizon = now - self.window_s
        while self._entries and self._entries[0].arrival_s < horizon:
            self._entries.popleft()
        return sorted(self._entries, key=lambda e: e.arrival_s)

    def __len__(self) -> int:
        return len(self._entries)
