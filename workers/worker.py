"""EngineWorker: one Engine stepped by its own thread, fed and drained over authenticated ZMQ frames.

Threads and what they own:
  - step thread: the Engine (single-threaded by contract), the role's handoff state, the heartbeat;
  - inbound thread: the PULL socket; it verifies and decodes frames (cluster/wire.py) and queues ops;
  - detokenizer thread (a ``DetokenizerStage``): the text of each step's deltas, then the ``Deltas``
    frames to the router, in step order (the step thread never decodes text but for the requests whose
    text decides their end: stop strings, a held prefill's first token);
  - transfer thread(s) (inside the role's KVSender / KVReceiver): KV bytes; callbacks only queue commands.
    Each prefill/decode pair moves its KV over its own group, built on first use over the pair's own
    signed handshake link (transfer/rendezvous.py; a worker moves KV if ``WorkerControl.moves_kv``): no
    launch-time step and no shared store, so a restarted or added worker moves KV as soon as it is
    admitted.
Every thread runs guarded: if one dies (or a transfer thread is found dead), the worker sends
``WorkerFailed`` to the router at once and exits the process (``on_fatal``), so Ray can restart it.
A bad frame is counted and dropped by the inbound thread; nothing a peer sends can kill a thread.

Roles: a prefill worker composes a :class:`PrefillRole` (hold after the first token, offer the KV), a
decode worker a :class:`DecodeRole` (reserve, receive, commit); a colocated worker has none. Any worker
runs whole requests (``Generate`` with hold False).

Garbage collection: a worker launched as its own process (``freeze_heap``) freezes the objects alive at
the end of start-up (``freeze_startup_heap``): a full collection then scans only what serving made.

Health: the step thread sends a ``Heartbeat`` (with the stats snapshot) every ``heartbeat_interval_s``,
busy or idle; the router treats a worker whose beat is stale as unhealthy (SIGSTOP, a stuck step).
Actor methods (stats, ping, check_leaks) never wait behind a forward.

The worker's jobs, a file each: this one is the actor's face (it builds and wires the parts, and
answers Ray); workers/worker_threads.py runs the inbound and step threads, guarded (a dead one's
``WorkerFailed``, ``on_fatal``); workers/worker_ops.py handles the step thread's commands (the ops, the
routers' leases); workers/worker_outbox.py sends the events; workers/worker_vitals.py publishes the
stats, beats, and reports leaks.
"""

from __future__ import annotations

import logging
import os
import queue
import secrets
import threading
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

import torch
import zmq

from cluster.config import EngineConfig, TransferConfig
from cluster.heap import freeze_startup_heap
from cluster.hub import model_fingerprint
from cluster.protocol import WorkerStats, peer_name
from cluster.wire import OPS, WireDecoder, WorkerControl, WorkerInfo
from workers.decode_role import DecodeRole
from workers.detokenizer import DetokenizerStage
from workers.engine import Engine
from workers.parallel_kv import cached_kv
from workers.prefill_role import PrefillRole
from workers.prefix_pulls import PrefixPulls
from workers.rank_process import on_rank_death
from workers.role import Role, WorkerContext
from workers.stats_log import StatsLine
from workers.worker_ops import InjectedFault, LeakCheck, OpHandler
from workers.worker_outbox import Outbox
from workers.worker_threads import EXIT_CODE_FATAL, Guard, InboundLoop, StepLoop, exit_process
from workers.worker_vitals import STAGE_DRAIN_S, Vitals

__all__ = ["EXIT_CODE_FATAL", "FAULT_KINDS", "EngineWorker", "exit_process", "resolve_node_ip"]

logger = logging.getLogger(__name__)

# NOTE: one step's text takes about a millisecond; a minute on one is a hang, even on a loaded box
_STAGE_STUCK_S = 60.0
_FAULT_HANG_S = 600.0  # bound on an injected hang (shutdown ends it first)
FAULT_KINDS = ("step", "inbound", "detokenizer", "detokenizer_stuck")


def _raise_injected_detokenizer_fault() -> None:
    raise RuntimeError("injected fault in the detokenizer thread")


def _make_role(pool: str, context: WorkerContext) -> Role | None:
    if pool == "prefill":
        return PrefillRole(context)
    if pool == "decode":
        return DecodeRole(context)
    return None


def resolve_node_ip() -> str:
    """This node's address as Ray knows it (the one other hosts reach it on)."""
    import ray

    return str(ray.util.get_node_ip_address())


class EngineWorker:
    """One worker of any pool. Plain class: Ray wraps it at launch (deploy/launch.py), tests may drive it
    directly. ``engine_factory`` is injectable; ``on_fatal`` runs (once) when a thread dies.
    ``freeze_heap``: ``freeze_startup_heap`` once everything is built (the launcher's actors, each a
    process of its own; never in a process that hosts anything else)."""

    def __init__(
        self,
        worker_id: str,
        pool: str,
        engine_config: EngineConfig,
        transfer_config: TransferConfig,
        secret: bytes,
        control: WorkerControl,
        *,
        torch_threads: int | None = None,
        cpu_core: int | None = None,
        engine_factory: Callable[[EngineConfig], Engine] = Engine,
        allow_fault_injection: bool = False,
        on_fatal: Callable[[str], None] = exit_process,
        stats_interval_s: float = 0.0,
        stage_stuck_s: float = _STAGE_STUCK_S,
        freeze_heap: bool = False,
    ) -> None:
        if cpu_core is not None:
            os.sched_setaffinity(0, {cpu_core})  # NOTE: before torch starts its thread pool
        if torch_threads is not None:
            import torch

            torch.set_num_threads(torch_threads)
        self.worker_id = worker_id
        self.pool = pool
        self.transfer_config = transfer_config
        self.control = control
        self.engine = engine_factory(engine_config)
        self._commands: queue.Queue[object] = queue.Queue()
        self._outbox = Outbox(worker_id, control.router_endpoints, secret, self._commands.put)
        self._stage: DetokenizerStage | None = None
        if self.engine.tokenizer is not None:
            self._stage = DetokenizerStage(
                self.engine.tokenizer, self._outbox.send_deltas, f"{worker_id}-detokenizer"
            )
            self.engine.use_stage(self._stage)
        self._allow_faults = allow_fault_injection
        self.node_ip = resolve_node_ip() if control.bind == "node" else "127.0.0.1"
        self._ctx: zmq.Context[Any] = zmq.Context()
        self._pull = self._ctx.socket(zmq.PULL)
        self._pull.setsockopt(zmq.LINGER, 0)
        incarnation = secrets.token_hex(8)
        # NOTE: ops are addressed to this process (worker id and incarnation), so none meant for a
        # predecessor (Ray restarted this worker) or a successor is ever acted on here: it is misaddressed.
        self._decoder = WireDecoder(secret, peer_name(worker_id, incarnation), OPS)
        # NOTE: libzmq drops a larger frame while reading its length instead of buffering it whole for the
        # verifier to refuse (the sender's connection is closed; the router's PUSH reconnects by itself)
        self._pull.setsockopt(zmq.MAXMSGSIZE, self._decoder.verifier.max_frame_bytes)
        self._pull.bind(f"tcp://{self.node_ip}:*")
        self.request_endpoint: str = self._pull.getsockopt_string(zmq.LAST_ENDPOINT)
        self._stop = threading.Event()
        self._inbound_fault = threading.Event()
        context = WorkerContext(
            worker_id,
            incarnation,
            self.node_ip,
            self.engine,
            transfer_config,
            secret,
            control.moves_kv,
            self._outbox.send,
            self._commands.put,
        )
        self.role: Role | None = _make_role(pool, context)
        if self.role is not None:
            self.role.start()
        # NOTE: prefix pulls (workers/prefix_pulls.py): any worker that moves KV holds; a prefill one pulls
        self.pulls: PrefixPulls | None = None
        if self.role is not None and control.moves_kv:
            self.pulls = PrefixPulls(context, can_pull=pool == "prefill")
            self.pulls.start()
        # NOTE: with the engine, role and sockets built, before the inbound and step threads start
        frozen = freeze_startup_heap() if freeze_heap else 0
        self.info = self._make_info(incarnation, frozen)
        self._guard = Guard(
            worker_id,
            self._stop,
            self._outbox,
            on_fatal,
            on_failure=lambda: self._vitals.mark_unhealthy(),
            more_threads=self._more_threads,
        )
        # NOTE: a tensor-parallel worker's ranks are one unit: one that exits fails this worker at once
        on_rank_death(self._guard.fatal)
        self._vitals = Vitals(
            self.info,
            self.engine,
            self.role,
            self._stage,
            self._outbox,
            control.heartbeat_interval_s,
            self._guard.is_healthy,
            self._decoder.rejected,
            self.pulls,
        )
        self._vitals.publish()
        ops = OpHandler(
            pool,
            self.engine,
            self.role,
            self._outbox,
            self._vitals,
            self._decoder.verifier.reject,
            self.pulls,
        )
        inbound = InboundLoop(self._pull, self._decoder, self._commands.put, self._stop, self._inbound_fault)
        step = StepLoop(
            self.engine,
            self.role,
            self._stage,
            self._commands,
            ops,
            self._vitals,
            self._guard,
            self._outbox,
            self._stop,
            stage_stuck_s,
            StatsLine(stats_interval_s),  # the periodic INFO line (0: off)
        )
        self._guard.start("inbound", inbound.run)
        self._guard.start("step", step.run)
        logger.info(
            "%s: %s worker up on %s (%s, %d KV blocks of %d tokens, max_model_len %d)",
            worker_id,
            pool,
            self.request_endpoint,
            self.info.device,
            self.info.num_blocks,
            self.info.block_size,
            self.info.max_model_len,
        )

    def _make_info(self, incarnation: str, gc_frozen_objects: int) -> WorkerInfo:
        e = self.engine
        return WorkerInfo(
            worker_id=self.worker_id,
            pool=self.pool,
            incarnation=incarnation,
            request_endpoint=self.request_endpoint,
            node_ip=self.node_ip,
            block_size=e.config.block_size,
            num_blocks=e.runner.num_blocks,
            max_model_len=e.max_model_len,
            vocab_size=e.vocab_size,
            model_dir=e.model_dir,
            device=str(e.runner.device),
            pid=os.getpid(),
            cpu_cores=sorted(os.sched_getaffinity(0)),
            kv_endpoint=self.role.kv_endpoint() if self.role is not None else "",
            pull_endpoint=self.pulls.endpoint if self.pulls is not None else "",
            model_fingerprint=model_fingerprint(e.model_dir),
            gc_frozen_objects=gc_frozen_objects,
            kv_events=e.config.enable_prefix_caching,
        )

    def _more_threads(self) -> list[threading.Thread]:
        """The threads beside the guarded ones that the worker's health needs alive."""
        threads = self.role.threads() if self.role is not None else []
        threads += self.pulls.threads() if self.pulls is not None else []
        if self._stage is not None:
            threads.append(self._stage.thread)
        return threads

    @property
    def failed(self) -> str | None:
        """Why the worker failed (a thread died), or None."""
        return self._guard.failed

    # ---- actor API ------------------------------------------------------------------------------------
    def get_info(self) -> WorkerInfo:
        return self.info

    def stats(self) -> WorkerStats:
        return self._vitals.stats

    def rank_pids(self) -> list[int]:
        """The process ids of this worker's tensor-parallel ranks 1..N-1 (none at one rank)."""
        ranks = self.engine.runner.ranks
        return [] if ranks is None else ranks.pids

    def cached_kv(self, token_ids: list[int]) -> bytes:
        """The KV this worker's prefix cache holds for ``token_ids``' full blocks, every head, as the raw
        bytes of ``[L, n, 2, block_size, num_kv_heads, head_dim]`` (tests: what a handoff delivered)."""
        kv = cached_kv(self.engine.runner, self.engine.scheduler.kv, token_ids)
        return bytes(kv.contiguous().view(torch.uint8).numpy())

    def ping(self) -> int:
        """Liveness for the router's lifecycle watch (answers even while the step thread is busy)."""
        return os.getpid()

    def health(self) -> bool:
        return self._guard.is_healthy()

    def check_leaks(self, timeout_s: float = 10.0) -> str | None:
        """Leak invariant, checked on the step thread: None if clean, else what leaked."""
        check = LeakCheck(Future())
        self._commands.put(check)
        return check.result.result(timeout=timeout_s)

    def inject_fault(self, kind: str) -> None:
        """Test hook (only with ``allow_fault_injection``): make the ``step``, ``inbound`` or ``detokenizer``
        thread die, or the detokenizer thread hang until shutdown (``detokenizer_stuck``)."""
        if not self._allow_faults:
            raise PermissionError("fault injection is off for this worker")
        if kind not in FAULT_KINDS:
            raise ValueError(f"fault kind must be one of {FAULT_KINDS}, got {kind!r}")
        if kind == "inbound":
            self._inbound_fault.set()
        elif kind in ("detokenizer", "detokenizer_stuck"):
            if self._stage is None:
                raise ValueError("this worker has no detokenizer thread (no tokenizer)")
            self._stage.call(
                _raise_injected_detokenizer_fault if kind == "detokenizer" else self._hang_until_shutdown
            )
        else:
            self._commands.put(InjectedFault(kind))

    def shutdown(self) -> None:
        self._stop.set()
        self._guard.join(timeout_s=5.0)
        if self._stage is not None:
            self._stage.close(STAGE_DRAIN_S)
        if self.role is not None:
            self.role.close()
        if self.pulls is not None:
            self.pulls.close()
        self._pull.close(linger=0)
        self._outbox.close()
        self._ctx.term()
        self.engine.close()  # NOTE: a tensor-parallel worker's other ranks (bounded)

    def _hang_until_shutdown(self) -> None:
        self._stop.wait(_FAULT_HANG_S)
