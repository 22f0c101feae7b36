"""Which worker gets a request: plain functions over the router's view of its workers (no sockets, no
Ray), so tests and a simulation drive the same policy the router runs.

* prefill: prefix affinity on the prompt's first block (rendezvous hashing over the healthy prefill
  workers), unless the preferred worker has ``affinity_slack_tokens`` more outstanding prompt tokens
  than the least loaded one;
* decode: the fewest requests (``busy``), then the most free KV blocks in its last stats;
* colocated: the fewest requests (``busy``).

With ``prefix_routing: index`` (the default) the prefill and colocated picks go by the router's exact
index of the workers' KV tiers instead (cluster/router/kv_index.py; ``explain_by_index``): each worker's
cost is the prompt tokens it would still compute, plus ``host_hit_cost`` for each token it would copy
back from its host tier (what its own load rule measured a copy to cost against a recompute; 0.25 until
it did), plus its queue (the same work of every prompt routed there whose first token has not come
back: a queued prompt's hit is not work, so a worker that holds the conversations it is sent does not
look busier than it is) and, for a colocated worker, ``REQUEST_COST_TOKENS`` for each request it runs
(they share every step with the new prompt); the cheapest wins, ties to the fewer requests, then the
worker id. A cached prefix thus draws a request to a busier worker as long as the tokens saved outweigh
the extra queue.

A worker's requests (``busy``) are the more of those this router routed there and those the worker
last reported (running, waiting, waiting for KV): the report counts other routers' requests (front-end
replicas balance by it without talking to each other), this router's count the ones routed since the
report.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Callable, Sequence
from typing import Protocol, TypeVar

from cluster.block_hash import ROOT_HASH, hash_block
from cluster.protocol import ClusterUnavailableError, WorkerStats
from cluster.router.kv_index import KvHit

# NOTE: a token the host tier holds costs a quarter of computing it until its worker measured the ratio
# (``EngineStats.host_load_cost``): it is copied back to the device (PCIe, ~25 GB/s against a prefill's
# compute on the same bytes) before the step that uses it
HOST_HIT_COST = 0.25
DEVICE_HIT_COST = 0.0  # NOTE: a device hit is free: its blocks are shared as they are
# NOTE: a request in a colocated worker's batch weighs like this many prompt tokens: it shares each step
REQUEST_COST_TOKENS = 32


class WorkerLoad(Protocol):
    """What placement reads of a worker."""

    @property
    def worker_id(self) -> str: ...
    @property
    def block_size(self) -> int: ...
    @property
    def num_assigned(self) -> int: ...  # requests routed here that are not over
    @property
    def num_prompt_tokens(self) -> int: ...  # outstanding prompt tokens routed here (prefill load)
    @property
    def stats(self) -> WorkerStats | None: ...


W = TypeVar("W", bound=WorkerLoad)


def require(workers: Sequence[W], pool: str) -> Sequence[W]:
    if not workers:
        raise ClusterUnavailableError(f"no healthy {pool} worker")
    return workers


def busy(w: WorkerLoad) -> int:
    """The worker's requests as this router knows them (see the module docstring)."""
    s = w.stats
    if s is None:
        return w.num_assigned
    return max(w.num_assigned, s.engine.num_running + s.engine.num_waiting + s.num_waiting_for_kv)


def pick_least_loaded(workers: Sequence[W], pool: str) -> W:
    return min(require(workers, pool), key=lambda w: (busy(w), w.worker_id))


def pick_prefill(workers: Sequence[W], prompt: Sequence[int], affinity_slack_tokens: int) -> W:
    return explain_prefill(workers, prompt, affinity_slack_tokens)[0]


def explain_prefill(workers: Sequence[W], prompt: Sequence[int], affinity_slack_tokens: int) -> tuple[W, str]:
    """pick_prefill's choice and why: "prefix_affinity" (the prompt's first block's worker),
    "affinity_target_busy" (that worker is past the slack: the least loaded one) or
    "prompt_shorter_than_a_block" (no block to be affine to: the least loaded one)."""
    ws = require(workers, "prefill")
    least = min(ws, key=lambda w: (w.num_prompt_tokens, w.num_assigned, w.worker_id))
    block_size = ws[0].block_size
    if len(prompt) < block_size:
        return least, "prompt_shorter_than_a_block"
    key = hash_block(ROOT_HASH, prompt[:block_size])
    preferred = max(ws, key=lambda w: hashlib.blake2b(key + w.worker_id.encode(), digest_size=8).digest())
    if preferred.num_prompt_tokens - least.num_prompt_tokens > affinity_slack_tokens:
        return least, "affinity_target_busy"
    return preferred, "prefix_affinity"


def host_hit_cost(w: WorkerLoad) -> float:
    """What a token of ``w``'s host tier costs against computing it: the ratio its load rule measured
    (capped at 1: past it the engine recomputes the block), else ``HOST_HIT_COST``."""
    measured = w.stats.engine.host_load_cost if w.stats is not None else -1.0
    return HOST_HIT_COST if measured < 0 else min(1.0, measured)


def prompt_work(w: WorkerLoad, hit: KvHit, num_tokens: int) -> float:
    """The prefill work of a ``num_tokens`` prompt on ``w`` holding ``hit`` of it, in prompt tokens: those
    it computes, plus the copies back of its host-tier hit (``host_hit_cost`` each)."""
    device, host = hit.device_blocks * w.block_size, hit.host_blocks * w.block_size
    return num_tokens - device - host + DEVICE_HIT_COST * device + host_hit_cost(w) * host


def queued_work(w: WorkerLoad, hit: KvHit, num_tokens: int) -> int:
    """``prompt_work`` as the worker's queue counts it (``num_prompt_tokens``): whole tokens, at least one
    (the engine always computes a prompt's last token)."""
    return max(1, math.ceil(prompt_work(w, hit, num_tokens)))


def index_cost(w: WorkerLoad, hit: KvHit, num_tokens: int, request_cost_tokens: int) -> float:
    """What placing a ``num_tokens`` prompt on ``w`` costs, in prompt tokens (module docstring)."""
    return prompt_work(w, hit, num_tokens) + w.num_prompt_tokens + request_cost_tokens * busy(w)


def hit_reason(hit: KvHit) -> str:
    """The route reason that names a hit: any of it on the host tier, all of it on the device, none."""
    if hit.host_blocks:
        return "kv_index_host_hit"
    return "kv_index_device_hit" if hit.device_blocks else "kv_index_miss"


def explain_by_index(
    workers: Sequence[W],
    hit_of: Callable[[W], KvHit],
    num_tokens: int,
    pool: str,
    request_cost_tokens: int = 0,
) -> tuple[W, str, KvHit]:
    """The cheapest worker by ``index_cost`` (``hit_of``: what the index says it holds of the prompt),
    the reason naming its hit (``hit_reason``) and the hit."""
    ws = require(workers, pool)
    best: tuple[float, int, str] | None = None
    choice: tuple[W, KvHit] | None = None
    for w in ws:
        hit = hit_of(w)
        key = (index_cost(w, hit, num_tokens, request_cost_tokens), busy(w), w.worker_id)
        if best is None or key < best:
            best, choice = key, (w, hit)
    if choice is None:  # NOTE: unreachable: require() refused an empty pool
        raise ClusterUnavailableError(f"no healthy {pool} worker")
    w, hit = choice
    return w, hit_reason(hit), hit


def pick_decode(workers: Sequence[W]) -> W:
    def score(w: W) -> tuple[int, int, str]:
        free = w.stats.engine.num_free_blocks if w.stats is not None else 0
        return (busy(w), -free, w.worker_id)

    return min(require(workers, "decode"), key=score)
