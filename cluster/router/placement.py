"""Which worker gets a request: plain functions over the router's view of its workers (no sockets, no
Ray), so tests and a simulation drive the same policy the router runs.

* prefill: prefix affinity on the prompt's first block (rendezvous hashing over the healthy prefill
  workers), unless the preferred worker has ``affinity_slack_tokens`` more outstanding prompt tokens
  than the least loaded one;
* decode: the fewest requests (``busy``), then the most free KV blocks in its last stats;
* colocated: the fewest requests (``busy``).

A worker's requests (``busy``) are the more of those this router routed there and those the worker
last reported (running, waiting, waiting for KV): the report counts other routers' requests (front-end
replicas balance by it without talking to each other), this router's count the ones routed since the
report.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from typing import Protocol, TypeVar

from cluster.block_hash import ROOT_HASH, hash_block
from cluster.protocol import ClusterUnavailableError, WorkerStats


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


def pick_decode(workers: Sequence[W]) -> W:
    def score(w: W) -> tuple[int, int, str]:
        free = w.stats.engine.num_free_blocks if w.stats is not None else 0
        return (busy(w), -free, w.worker_id)

    return min(require(workers, "decode"), key=score)
