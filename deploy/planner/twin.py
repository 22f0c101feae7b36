"""The engine's twin: one worker's real Scheduler (its KVCacheManager and prefix cache included), stepped
under a cost model instead of a forward pass.

Only the Scheduler's public methods are used (add_request, schedule, update_from_output,
reserve_prefilled, commit_prefilled, release), so the simulation runs whatever policy the engine runs.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field, replace

from cluster.config import ClusterConfig, EngineConfig, RouterConfig
from cluster.cost_model import StepShape
from cluster.protocol import EngineStats, SamplingParams, WorkerStats
from workers.request import Request
from workers.scheduler import SampledTokens, Scheduler, SchedulerOutput

MODES = ("colocated", "disaggregated", "conditional")


@dataclass(frozen=True)
class SimConfig:
    """One deployment to simulate: the router mode, pool sizes and every worker's engine settings."""

    mode: str
    num_prefill: int = 0
    num_decode: int = 0
    num_colocated: int = 0
    engine: EngineConfig = field(default_factory=EngineConfig)  # colocated workers', and the default
    prefill_engine: EngineConfig | None = None  # the prefill pool's own settings (None: ``engine``)
    decode_engine: EngineConfig | None = None  # the decode pool's own settings (None: ``engine``)
    num_kv_blocks: int = 2048  # per worker, block 0 included (as EngineConfig.num_kv_blocks)
    # a prefill / decode pool's own KV blocks a worker (None: ``num_kv_blocks``): pools of different
    # tensor-parallel sizes hold different amounts of KV
    prefill_kv_blocks: int | None = None
    decode_kv_blocks: int | None = None
    max_model_len: int = 2048
    router: RouterConfig = field(default_factory=RouterConfig)
    heartbeat_interval_s: float = 0.5  # how stale the router's view of free blocks is
    # conditional mode by predicted cost, as a router with a cost profile routes (False: by prompt length,
    # as one without a profile does)
    cost_routing: bool = True

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {self.mode!r}")
        if self.mode == "colocated" and self.num_colocated < 1:
            raise ValueError("colocated mode needs num_colocated >= 1")
        if self.mode != "colocated" and (self.num_prefill < 1 or self.num_decode < 1):
            raise ValueError(f"{self.mode} mode needs num_prefill >= 1 and num_decode >= 1")

    @classmethod
    def from_cluster(cls, cfg: ClusterConfig, *, num_kv_blocks: int, max_model_len: int) -> SimConfig:
        """The deployment a cluster config describes (pools, router, engine settings)."""
        return cls(
            mode=cfg.router.mode,
            num_prefill=cfg.prefill.num_workers if cfg.router.mode != "colocated" else 0,
            num_decode=cfg.decode.num_workers if cfg.router.mode != "colocated" else 0,
            num_colocated=cfg.colocated.num_workers if cfg.router.mode == "colocated" else 0,
            engine=cfg.engine_config("colocated"),
            prefill_engine=cfg.engine_config("prefill"),
            decode_engine=cfg.engine_config("decode"),
            num_kv_blocks=num_kv_blocks,
            # NOTE: block_size is one for every pool (cluster/config.py)
            max_model_len=min(max_model_len, (num_kv_blocks - 1) * cfg.engine_config("decode").block_size),
            router=cfg.router,
            heartbeat_interval_s=cfg.router.health_interval_s,
        )

    def engine_of(self, pool: str) -> EngineConfig:
        """The engine settings of ``pool``'s workers: a prefill and a decode pool may differ."""
        own = {"prefill": self.prefill_engine, "decode": self.decode_engine}.get(pool)
        return own if own is not None else self.engine

    def kv_blocks_of(self, pool: str) -> int:
        """KV blocks of each of ``pool``'s workers, block 0 included."""
        own = {"prefill": self.prefill_kv_blocks, "decode": self.decode_kv_blocks}.get(pool)
        return own if own is not None else self.num_kv_blocks

    def tp_of(self, pool: str) -> int:
        """GPUs (tensor-parallel ranks) of each of ``pool``'s workers."""
        return self.engine_of(pool).tensor_parallel_size

    @property
    def pools(self) -> tuple[str, ...]:
        return ("colocated",) if self.mode == "colocated" else ("prefill", "decode")

    @property
    def num_workers(self) -> int:
        return self.num_colocated if self.mode == "colocated" else self.num_prefill + self.num_decode

    @property
    def num_gpus(self) -> int:
        """Workers times their ranks, over the pools the mode runs (``num_workers`` at TP 1)."""
        if self.mode == "colocated":
            return self.num_colocated * self.tp_of("colocated")
        return self.num_prefill * self.tp_of("prefill") + self.num_decode * self.tp_of("decode")

    @property
    def is_tensor_parallel(self) -> bool:
        return any(self.tp_of(pool) > 1 for pool in self.pools)

    @property
    def label(self) -> str:
        """``colocated x4`` / ``2P:2D``; with a pool at TP > 1, every pool's size: ``colocated x2 TP4``,
        ``1P(TP4):2D(TP2)``."""
        if self.mode == "colocated":
            tp = f" TP{self.tp_of('colocated')}" if self.is_tensor_parallel else ""
            return f"colocated x{self.num_colocated}{tp}"
        cond = " cond" if self.mode == "conditional" else ""
        if not self.is_tensor_parallel:
            return f"{self.num_prefill}P:{self.num_decode}D{cond}"
        return f"{self.num_prefill}P(TP{self.tp_of('prefill')}):{self.num_decode}D(TP{self.tp_of('decode')}){cond}"

    def colocated(self, num_workers: int) -> SimConfig:
        return replace(self, mode="colocated", num_colocated=num_workers, num_prefill=0, num_decode=0)

    def split(self, num_prefill: int, num_decode: int, mode: str = "disaggregated") -> SimConfig:
        return replace(self, mode=mode, num_prefill=num_prefill, num_decode=num_decode, num_colocated=0)


@dataclass
class Flight:
    """One request inside the simulated cluster (the router's flight plus the client's record)."""

    index: int
    request_id: str
    prompt: list[int]
    params: SamplingParams
    prefill: SimWorker | None = None
    decode: SimWorker | None = None
    transfer_s: float = 0.0
    queued_on: SimWorker | None = None  # whose prefill queue (the router's count) holds it
    predicted_ttft_s: float | None = None
    predicted_tbt_s: float | None = None
    # early decode admission: its decode worker was told at dispatch (is_early), reserved its blocks and
    # posted the fetch (is_reserved: the transfer starts when the prefill offers the KV), the prefill
    # offered the KV (is_offered), the KV landed (is_kv_here), the first token came (is_first_here)
    is_early: bool = False
    is_reserved: bool = False
    is_offered: bool = False
    is_kv_here: bool = False
    is_first_here: bool = False
    num_kv_tokens: int = 0  # KV positions its handoff moves


class SimWorker:
    """One worker: its Scheduler, the commands it has not read yet, the decode role's waiting handoffs,
    and the router's bookkeeping about it (what cluster/router/placement.py reads: the WorkerLoad protocol)."""

    def __init__(self, worker_id: str, pool: str, config: SimConfig) -> None:
        self.worker_id = worker_id
        self.pool = pool
        engine = config.engine_of(pool)
        self.block_size = engine.block_size
        self.num_kv_blocks = config.kv_blocks_of(pool)
        self.scheduler = Scheduler(engine, self.num_kv_blocks, config.max_model_len)
        self.inbox: deque[tuple[int, Flight]] = deque()
        self.pending: deque[Flight] = deque()  # decode side: handoffs waiting for blocks or a seat
        self.early: dict[str, Flight] = {}  # decode side: early admissions not reserved yet, in order
        self.step_out: SchedulerOutput | None = None
        self.spinning = False  # has work it cannot schedule now: the real step loop polls (burns a core)
        self.link_free_s = 0.0  # its transfer thread is busy until then
        # handoffs that finished (received, sent) during its current step: they cost its next one
        self.received_beside = 0
        self.received_tokens_beside = 0  # their KV positions
        self.sent_beside = 0
        self.num_charged_handoffs = 0  # (received, sent) handoffs charged to its steps so far
        # the router's view (WorkerLoad)
        self.num_assigned = 0
        self.num_prompt_tokens = 0
        self.num_queued_prompts = 0
        self.stats: WorkerStats | None = None
        self._last_beat = -math.inf
        self.num_steps = 0
        self.num_tokens = 0
        self.busy_s = 0.0

    @property
    def in_step(self) -> bool:
        return self.step_out is not None

    @property
    def is_blocked(self) -> bool:
        """Its next waiting request's tokens need more blocks than are free: once its running work is
        done, its step loop spins (prefix hits aside)."""
        waiting = self.scheduler.waiting
        if not waiting:
            return False
        need = -(-waiting[0].num_tokens // self.block_size)
        return need > self.scheduler.kv.pool.num_free

    @property
    def has_work(self) -> bool:
        s = self.scheduler
        return bool(s.waiting or s.running or self.pending)

    def queue(self, flight: Flight) -> None:
        """The router counts the flight's prompt in this worker's prefill queue (until its first token)."""
        flight.queued_on = self
        self.num_prompt_tokens += len(flight.prompt)
        self.num_queued_prompts += 1

    def unqueue(self, flight: Flight) -> None:
        if flight.queued_on is self:
            flight.queued_on = None
            self.num_prompt_tokens -= len(flight.prompt)
            self.num_queued_prompts -= 1

    def add(self, flight: Flight, hold: bool) -> None:
        """A Generate op: the whole request here, or (hold) its prefill only."""
        request = Request(flight.request_id, flight.prompt, flight.params, (), hold, 0.0)
        self.scheduler.add_request(request)

    def reserve(self, flight: Flight, first_token_id: int | None) -> int | None:
        """A DecodeHandoff (or, ``first_token_id`` None, an early admission before the first token):
        reserve blocks for the prompt's KV; the number of KV positions that must move (whole blocks the
        local prefix cache does not hold), or None when blocks or seats are short."""
        request = Request(flight.request_id, flight.prompt, flight.params, (), False, 0.0)
        if first_token_id is not None:
            request.output_token_ids.append(first_token_id)
        reserved = self.scheduler.reserve_prefilled(request)
        if reserved is None:
            return None
        block_ids, num_hit = reserved
        return (len(block_ids) - num_hit) * self.block_size

    def commit(self, flight: Flight) -> None:
        """The KV landed (and, reserved early, its first token came): the request decodes on."""
        if flight.is_early:
            self.scheduler.requests[flight.request_id].output_token_ids.append(0)
        self.scheduler.commit_prefilled(flight.request_id)

    def begin_step(self) -> StepShape | None:
        out = self.scheduler.schedule()
        if out.is_empty:
            return None
        self.step_out = out
        # NOTE: shape_of without the tuples: this runs once per simulated step
        prefill_tokens = prefill_seqs = decode_seqs = context = pairs = longest = 0
        for s in out.scheduled:
            start = s.start_position
            if s.is_decode:
                decode_seqs += 1
                context += start
                if start > longest:
                    longest = start
            else:
                n = len(s.token_ids)
                prefill_seqs += 1
                prefill_tokens += n
                pairs += n * start + n * (n + 1) // 2
        return StepShape(prefill_tokens, prefill_seqs, decode_seqs, context, pairs, decode_seqs * longest)

    def end_step(self) -> list[Request]:
        """The step's "forward" is over: every sequence that reached its last known token samples."""
        out = self.step_out
        if out is None:
            raise RuntimeError(f"{self.worker_id}: end_step without a step")
        self.step_out = None
        self.num_steps += 1
        # NOTE: every simulated step "samples" token 0; no EOS is configured, so only max_tokens ends a request.
        sampled = SampledTokens({s.request_id: 0 for s in out.scheduled if s.needs_sample})
        updated = self.scheduler.update_from_output(out, sampled)
        self.num_tokens += len(updated)
        return updated

    def beat(self, now: float, interval_s: float) -> bool:
        """Publish the stats snapshot the router sees, at most every heartbeat interval (True: it did)."""
        if now - self._last_beat < interval_s:
            return False
        self._last_beat = now
        kv = self.scheduler.kv
        engine = EngineStats(
            num_free_blocks=kv.pool.num_free,
            num_total_blocks=kv.pool.num_usable,
            num_running=len(self.scheduler.running),
            num_waiting=len(self.scheduler.waiting),
            num_steps=self.num_steps,
        )
        self.stats = WorkerStats(
            self.worker_id, self.pool, engine=engine, num_waiting_for_kv=len(self.pending)
        )
        return True
