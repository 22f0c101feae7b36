"""Route decisions that explain themselves: which path a request takes (colocated, disaggregated or
conditional), which worker gets it, the prefix-cache hit expected there, the TTFT the cost model predicts,
and why.

Plain functions over the router's view of its workers, so the router (cluster/router/router.py) and the
planner's simulation (deploy/planner/sim.py) decide the same way. Worker picks stay
cluster/router/placement.py's; this module adds the choice of path and the reason, which labels
``pdserve_route_decisions_total{mode,reason}`` and travels in ``RequestTimings.route``.

Modes and reasons (a fixed set, so the metric's cardinality is bounded):

* with ``prefix_routing: index`` (a ``KvIndex`` given), the prefill worker (disaggregated mode) and the
  colocated worker are picked by the index against load (cluster/router/placement.py
  ``explain_by_index``) and the reason names the hit there: ``kv_index_device_hit``,
  ``kv_index_host_hit`` (some of it on the host tier) or ``kv_index_miss``; the hit's tokens are the
  route's ``prefill_hit_tokens``. Without an index (``affinity``, the planner's twin) as below;
* ``colocated``: one worker runs the request whole. ``least_loaded`` (colocated mode),
  ``resume_mid_stream`` (a migrated request that already streamed tokens), ``no_healthy_prefill_worker``
  / ``no_healthy_decode_worker`` (one pool is empty: the other runs it whole);
* ``disaggregated``: a prefill worker, then a KV handoff. Disaggregated mode says which prefill worker
  and why (``prefix_affinity``, ``affinity_target_busy``, ``prompt_shorter_than_a_block``); conditional
  mode says why not locally (``handoff_cheaper``, ``local_prefill_would_stall_decodes``, or
  ``long_prompt`` without a cost profile);
* ``conditional``: conditional mode prefills on the decode worker: ``local_prefill_cheaper``,
  ``decode_prefix_hit`` (cheaper because that worker already holds the prefix), or ``short_prompt``
  without a cost profile.

Conditional mode with a cost profile compares, for each decode worker (at most
``MAX_DECODE_CANDIDATES``), the predicted time to the second token of a local prefill (its own queue and
running batch, its expected prefix hit) against the prefill worker's queue plus the handoff of what that
decode worker lacks (cluster/router/predict.py ``choose_route``), and takes the cheapest. Without a profile it
keeps the prompt-length rule (``conditional_max_prompt_tokens``).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Generic, Protocol, TypeVar

from cluster.block_hash import BlockHash, hash_full_blocks
from cluster.config import RouterConfig
from cluster.protocol import ClusterUnavailableError, RouteInfo
from cluster.router.kv_index import KvHit, KvIndex
from cluster.router.placement import (
    REQUEST_COST_TOKENS,
    WorkerLoad,
    busy,
    explain_by_index,
    explain_prefill,
    pick_decode,
    pick_least_loaded,
    queued_work,
)
from cluster.router.predict import Predictor, RouteEstimate

MAX_DECODE_CANDIDATES = 8


class RoutableWorker(WorkerLoad, Protocol):
    """What a route decision reads of a worker (the router's WorkerRef, the simulator's SimWorker)."""

    @property
    def num_queued_prompts(self) -> int: ...  # prompts routed here whose first token has not come back


W = TypeVar("W", bound=RoutableWorker)


class PrefixView:
    """The router's estimate of every worker's prefix cache: the chained hashes of the full blocks it
    routed there, at most ``capacity`` per worker, evicted least recently routed first (a prompt's tail
    before its head, as the engine frees them). An estimate: the worker may have evicted sooner (other
    blocks in use) or hold more (a restart forgets, see ``forget``). Not thread-safe: one loop owns it."""

    def __init__(self) -> None:
        self._blocks: dict[str, OrderedDict[BlockHash, None]] = {}

    def hit_tokens(
        self, worker_id: str, hashes: Sequence[BlockHash], num_tokens: int, block_size: int
    ) -> int:
        """Tokens of a ``num_tokens`` prompt (block hashes ``hashes``) expected cached on the worker; like
        the engine, never the whole prompt (its last token is always computed)."""
        blocks = self._blocks.get(worker_id)
        if not blocks or num_tokens < 1:
            return 0
        n = 0
        for h in hashes[: (num_tokens - 1) // block_size]:
            if h not in blocks:
                break
            n += 1
        return n * block_size

    def record(self, worker_id: str, hashes: Sequence[BlockHash], capacity: int) -> None:
        blocks = self._blocks.setdefault(worker_id, OrderedDict())
        for h in reversed(hashes):  # NOTE: the head ends most recent: evicted last
            blocks[h] = None
            blocks.move_to_end(h)
        while len(blocks) > max(0, capacity):
            blocks.popitem(last=False)

    def forget(self, worker_id: str) -> None:
        self._blocks.pop(worker_id, None)

    def num_blocks(self, worker_id: str) -> int:
        return len(self._blocks.get(worker_id, ()))


@dataclass(frozen=True)
class Route(Generic[W]):
    """One routing decision. ``worker`` gets the request first: its prefill worker when ``hold`` (a
    decode worker is picked at the handoff), else the worker that runs it whole."""

    mode: str
    reason: str
    worker: W
    hold: bool
    prefill_hit_tokens: int = 0
    decode_hit_tokens: int = 0
    predicted_ttft_s: float | None = None
    predicted_tbt_s: float | None = None
    block_hashes: list[BlockHash] = field(default_factory=list, repr=False, compare=False)
    tbt_worker_id: str | None = None  # whose decode step predicted_tbt_s is (the handoff's likely target)
    # the prefill work it queues on ``worker`` (placement.py queued_work: the tokens it computes there
    # and its host-tier copies) when the index saw that worker's hit; None: the whole prompt
    queued_tokens: int | None = None

    def info(self) -> RouteInfo:
        wid = self.worker.worker_id
        return RouteInfo(
            mode=self.mode,
            reason=self.reason,
            prefill_worker=wid,
            decode_worker=None if self.hold else wid,
            prefill_hit_tokens=self.prefill_hit_tokens,
            decode_hit_tokens=0 if self.hold else self.decode_hit_tokens,
            predicted_ttft_s=self.predicted_ttft_s,
            predicted_tbt_s=self.predicted_tbt_s,
        )


@dataclass(frozen=True)
class Pools(Generic[W]):
    """The healthy workers of each pool."""

    prefill: Sequence[W] = ()
    decode: Sequence[W] = ()
    colocated: Sequence[W] = ()


def decide(
    mode: str,
    token_ids: Sequence[int],
    pools: Pools[W],
    config: RouterConfig,
    *,
    predictor: Predictor | None = None,
    view: PrefixView | None = None,
    index: KvIndex | None = None,
    resume: bool = False,
) -> Route[W]:
    """Where ``token_ids`` (the prompt; for a migrated request, prompt + tokens so far) go, and why.
    ``resume``: the request already streamed tokens (it is finished whole on one worker). ``index``:
    place by the workers' reported KV blocks (the module docstring); its hits replace the view's
    estimates. Raises ClusterUnavailableError when no healthy worker can take it. Pure: counts and
    records nothing."""
    n = len(token_ids)
    every = [*pools.prefill, *pools.decode, *pools.colocated]
    block_size = every[0].block_size if every else 1
    has_view = view is not None or index is not None
    hashes = hash_full_blocks(token_ids, block_size) if has_view and n >= block_size else []

    hits: dict[str, KvHit] = {}  # NOTE: each worker's walk of the prompt's hashes, once per decision

    def kv_hit(w: W) -> KvHit:
        if index is None:
            return KvHit()
        h = hits.get(w.worker_id)
        if h is None:
            h = hits[w.worker_id] = index.hit(w.worker_id, hashes, n, w.block_size)
        return h

    def hit(w: W) -> int:
        if index is not None:
            return kv_hit(w).num_blocks * w.block_size
        return view.hit_tokens(w.worker_id, hashes, n, w.block_size) if view is not None else 0

    def ttft(w: W, cached: int) -> float | None:
        return predictor.ttft_s(w, n, cached) if predictor is not None else None

    def tbt(d: W, num_joining: int = 0) -> float | None:
        return predictor.tbt_s(d, n, num_joining) if predictor is not None else None

    def work_of(w: W) -> int | None:
        return queued_work(w, kv_hit(w), n) if index is not None else None

    def whole(route_mode: str, reason: str, w: W) -> Route[W]:
        h = hit(w)
        return Route(route_mode, reason, w, False, h, h, ttft(w, h), tbt(w), hashes, w.worker_id, work_of(w))

    def held(reason: str, w: W, ttft_s: float | None = None) -> Route[W]:
        h = hit(w)
        if predictor is None:
            return Route("disaggregated", reason, w, True, h, 0, None, None, hashes, None, work_of(w))
        # NOTE: the decode side is picked at the handoff; pick_decode's choice now stands in for it, with
        # the prompts queued on the prefill pool shared out over the decode pool joining it first
        queued = sum(p.num_queued_prompts for p in pools.prefill)
        joining = -(-queued // len(pools.decode))
        predicted = ttft(w, h) if ttft_s is None else ttft_s
        d = pick_decode(pools.decode)
        return Route(
            "disaggregated",
            reason,
            w,
            True,
            h,
            0,
            predicted,
            tbt(d, joining),
            hashes,
            d.worker_id,
            work_of(w),
        )

    if mode == "colocated":
        if index is not None:
            w, why, _ = explain_by_index(pools.colocated, kv_hit, n, "colocated", REQUEST_COST_TOKENS)
            return whole("colocated", "resume_mid_stream" if resume else why, w)
        reason = "resume_mid_stream" if resume else "least_loaded"
        return whole("colocated", reason, _whole_worker(mode, pools, config))
    if resume or not pools.prefill or not pools.decode:
        if resume:
            reason = "resume_mid_stream"
        else:
            reason = "no_healthy_prefill_worker" if not pools.prefill else "no_healthy_decode_worker"
        return whole("colocated", reason, _whole_worker(mode, pools, config))
    if index is not None:
        prefill, why, _ = explain_by_index(pools.prefill, kv_hit, n, "prefill")
    else:
        prefill, why = explain_prefill(pools.prefill, token_ids, config.affinity_slack_tokens)
    if mode == "disaggregated":
        return held(why, prefill)
    if predictor is None:
        if n <= config.conditional_max_prompt_tokens:
            return whole("conditional", "short_prompt", pick_decode(pools.decode))
        return held("long_prompt", prefill)
    prefill_hit = hit(prefill)
    remote: RouteEstimate | None = None
    best: tuple[float, W, int, RouteEstimate] | None = None
    for d in decode_candidates(pools.decode):
        decode_hit = hit(d)
        est = predictor.route(n, prefill, d, prefill_hit_tokens=prefill_hit, decode_hit_tokens=decode_hit)
        if est.mode == "local":
            cost = est.ttft_s + est.first_gap_s
            if best is None or cost < best[0]:
                best = (cost, d, decode_hit, est)
        elif remote is None:
            remote = est
    if best is not None:
        _, d, decode_hit, est = best
        return Route(
            "conditional",
            est.reason,
            d,
            False,
            decode_hit,
            decode_hit,
            est.ttft_s,
            tbt(d),
            hashes,
            d.worker_id,
            work_of(d),
        )
    if remote is None:  # NOTE: unreachable: every candidate is either local or remote
        raise RuntimeError("conditional routing found no route")
    return held(remote.reason, prefill, remote.ttft_s)


def decode_candidates(decodes: Sequence[W]) -> list[W]:
    """pick_decode's choice first, then the others by load, at most MAX_DECODE_CANDIDATES."""
    first = pick_decode(decodes)
    rest = sorted((d for d in decodes if d is not first), key=lambda d: (busy(d), d.worker_id))
    return [first, *rest][:MAX_DECODE_CANDIDATES]


def _whole_worker(mode: str, pools: Pools[W], config: RouterConfig) -> W:
    """A worker to run a whole request: colocated, else a decode worker, else (fallback) a prefill one."""
    if mode == "colocated":
        return pick_least_loaded(pools.colocated, "colocated")
    if pools.decode:
        return pick_decode(pools.decode)
    if config.colocated_fallback and pools.prefill:
        return pick_least_loaded(pools.prefill, "prefill")
    raise ClusterUnavailableError("no healthy worker can run the request")
