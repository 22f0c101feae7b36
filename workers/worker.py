"""EngineWorker: one Engine stepped by its own thread, fed and drained over authenticated ZMQ frames.

Threads and what they own:
  - step thread: the Engine (single-threaded by contract), the role's handoff state, the heartbeat;
  - inbound thread: the PULL socket; it verifies and decodes frames (cluster/wire.py) and queues ops;
  - detokenizer thread (a ``DetokenizerStage``): the text of each step's deltas, then the ``Deltas``
    frames to the router, in step order (the step thread never decodes text but for the requests whose
    text decides their end: stop strings, a held prefill's first token);
  - transfer thread(s) (inside the role's KVSender / KVReceiver): KV bytes; callbacks only queue commands.
    Each prefill/decode pair moves its KV over its own group, built on first use on the store the
    router hosts (``WorkerControl.store``): no launch-time step, so a restarted or added worker moves KV
    as soon as it is admitted.
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
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import os
import queue
import secrets
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

import zmq

from cluster.config import EngineConfig, TransferConfig
from cluster.heap import freeze_startup_heap
from cluster.hub import model_fingerprint
from cluster.protocol import ErrorCode, StepSplit, TokenDelta, TransferStats, WorkerStats, peer_name
from cluster.wire import (
    OPS,
    Abort,
    DecodeHandoff,
    Deltas,
    Event,
    ExtendLease,
    Generate,
    Heartbeat,
    PeerDead,
    PrepareDecode,
    RequestFailed,
    RouterLease,
    WireDecoder,
    WireEncoder,
    WorkerControl,
    WorkerFailed,
    WorkerInfo,
)
from workers.decode_role import DecodeRole
from workers.detokenizer import DetokenizerStage
from workers.engine import Engine
from workers.prefill_role import PrefillRole
from workers.request import RequestStatus
from workers.role import Role, WorkerContext
from workers.router_links import RouterLinks
from workers.stats_log import StatsLine
from workers.step_output import StepOutput
from workers.structured_compile import CompileFailed

logger = logging.getLogger(__name__)

_IDLE_WAIT_S = 0.05  # bound on one idle wait for work; wakes at once when a message arrives
_POLL_MS = 100
_LAST_WORDS_S = 2.0  # bound on flushing WorkerFailed before the process exits
_STAGE_DRAIN_S = 10.0  # bound on the detokenizer stage's catching up (leak check, shutdown)
# NOTE: one step's text takes about a millisecond; a minute on one is a hang, even on a loaded box
_STAGE_STUCK_S = 60.0
_FAULT_HANG_S = 600.0  # bound on an injected hang (shutdown ends it first)
# NOTE: bounds a Deltas frame (a one-token delta with 20 logprobs is ~0.5 KB) far below max_frame_bytes
_DELTAS_PER_FRAME = 512
FAULT_KINDS = ("step", "inbound", "detokenizer", "detokenizer_stuck")
EXIT_CODE_FATAL = 70


def _raise_injected_detokenizer_fault() -> None:
    raise RuntimeError("injected fault in the detokenizer thread")


@dataclass(frozen=True)
class _LeakCheck:
    result: Future[str | None]


@dataclass(frozen=True)
class _Fault:
    kind: str


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


def exit_process(reason: str) -> None:
    """Default ``on_fatal``: leave now (a thread is dead, the process cannot serve); Ray restarts it."""
    logging.shutdown()
    os._exit(EXIT_CODE_FATAL)


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
        self._stage: DetokenizerStage | None = None
        if self.engine.tokenizer is not None:
            self._stage = DetokenizerStage(
                self.engine.tokenizer, self._send_deltas, f"{worker_id}-detokenizer"
            )
            self.engine.use_stage(self._stage)
        self._allow_faults = allow_fault_injection
        self._stage_stuck_s = stage_stuck_s
        self._on_fatal = on_fatal
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
        self._encoder = WireEncoder(secret)
        # NOTE: a context of its own, so the last words can be flushed by terminating it (see _send)
        self._push_ctx: zmq.Context[Any] = zmq.Context()
        self._links = RouterLinks(control.router_endpoints, self._encoder, self._push_ctx)
        self._push_lock = threading.Lock()  # NOTE: the step thread sends; a dying thread sends once too
        self._silent = False  # the last words were said: nothing more goes out
        self._commands: queue.Queue[object] = queue.Queue()
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []
        self._inbound_fault = threading.Event()
        self._last_beat = 0.0
        self._num_freed_for_router = 0
        self.failed: str | None = None
        self._fatal_lock = threading.Lock()
        context = WorkerContext(
            worker_id,
            incarnation,
            self.node_ip,
            self.engine,
            transfer_config,
            secret,
            control.store,
            self._send,
            self._commands.put,
        )
        self.role: Role | None = _make_role(pool, context)
        if self.role is not None:
            self.role.start()
        e = self.engine
        # NOTE: with the engine, role and sockets built, before the inbound and step threads start
        frozen = freeze_startup_heap() if freeze_heap else 0
        self.info = WorkerInfo(
            worker_id=worker_id,
            pool=pool,
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
            model_fingerprint=model_fingerprint(e.model_dir),
            gc_frozen_objects=frozen,
        )
        self._stats = WorkerStats(worker_id, pool)
        self._steps = StepSplit()  # the step thread's own; published as a copy
        self._stats_line = StatsLine(stats_interval_s)  # the periodic INFO line (0: off)
        self._publish_stats()
        for target, name in ((self._inbound_loop, "inbound"), (self._step_loop, "step")):
            t = threading.Thread(
                target=self._guarded, args=(name, target), name=f"{worker_id}-{name}", daemon=True
            )
            t.start()
            self._threads.append(t)
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

    # ---- actor API ------------------------------------------------------------------------------------
    def get_info(self) -> WorkerInfo:
        return self.info

    def stats(self) -> WorkerStats:
        return self._stats

    def ping(self) -> int:
        """Liveness for the router's lifecycle watch (answers even while the step thread is busy)."""
        return os.getpid()

    def health(self) -> bool:
        return self._is_healthy()

    def check_leaks(self, timeout_s: float = 10.0) -> str | None:
        """Leak invariant, checked on the step thread: None if clean, else what leaked."""
        check = _LeakCheck(Future())
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
            self._commands.put(_Fault(kind))

    def shutdown(self) -> None:
        self._stop.set()
        for t in self._threads:
            t.join(timeout=5.0)
        if self._stage is not None:
            self._stage.close(_STAGE_DRAIN_S)
        if self.role is not None:
            self.role.close()
        self._pull.close(linger=0)
        with self._push_lock:
            self._silent = True
            self._links.close()
            self._push_ctx.term()
        self._ctx.term()

    # ---- threads --------------------------------------------------------------------------------------
    def _guarded(self, name: str, target: Callable[[], None]) -> None:
        try:
            target()
        except BaseException as e:
            logger.exception("%s: %s thread died", self.worker_id, name)
            self._fatal(f"{name} thread died: {type(e).__name__}: {e}")
            return
        if not self._stop.is_set():
            self._fatal(f"{name} thread exited")

    def _fatal(self, reason: str) -> None:
        """Say so once (log + WorkerFailed to the router), then ``on_fatal``."""
        with self._fatal_lock:
            if self.failed is not None:
                return
            self.failed = reason
        logger.error("%s: worker failed: %s", self.worker_id, reason)
        self._stats = dataclasses.replace(self._stats, healthy=False)
        try:
            # NOTE: flushed before on_fatal, which usually exits the process (a queued frame would die)
            self._send(WorkerFailed(self.worker_id, reason), last_words_s=_LAST_WORDS_S)
        except Exception:
            logger.exception("%s: could not send WorkerFailed", self.worker_id)
        self._on_fatal(reason)

    def _inbound_loop(self) -> None:
        poller = zmq.Poller()
        poller.register(self._pull, zmq.POLLIN)
        while not self._stop.is_set():
            if self._inbound_fault.is_set():
                raise RuntimeError("injected fault in the inbound thread")
            if poller.poll(_POLL_MS):
                op = self._decoder.decode(self._pull.recv(copy=True))
                if op is not None:
                    self._commands.put(op)

    def _step_loop(self) -> None:
        while not self._stop.is_set():
            # NOTE: an idle engine waits for a command (bounded): handoffs waiting for blocks can only
            # start after a command (an abort, a finished transfer) frees some, so nothing spins.
            self._drain_commands(block=not self.engine.has_unfinished())
            if self.role is not None:
                self.role.poll()
            if self.engine.has_unfinished():
                finished, prompt = self._finished_transfers(), self.engine.num_prompt_tokens
                t0 = time.perf_counter()
                output = self.engine.step_output()
                self._steps.count(
                    time.perf_counter() - t0,
                    len(output),
                    self.engine.num_prompt_tokens - prompt,
                    self._finished_transfers() - finished,
                )
                self._on_output(output)
            for failure in self.engine.take_failed():  # NOTE: requests whose grammar failed to compile
                self._fail_request(failure.request_id, failure.code, failure.message)
            problem = self._stage_problem()
            if problem is not None:
                self._fatal(problem)  # NOTE: its tokens would never leave; the worker says so, then stops
                return
            self._check_leases()
            self._publish_stats()
            self._beat()
            self._stats_line.maybe_log(self._stats)

    def _finished_transfers(self) -> int:
        if self.role is None:
            return 0
        t = self.role.transfer_stats()
        return t.num_ok + t.num_failed

    def _hang_until_shutdown(self) -> None:
        self._stop.wait(_FAULT_HANG_S)

    def _stage_problem(self) -> str | None:
        """Why the detokenizer thread can no longer send this worker's tokens, if it cannot: it failed
        (it keeps its error), or one item has held it past ``stage_stuck_s`` (the step thread would go
        on beating while every stream hangs)."""
        stage = self._stage
        if stage is None:
            return None
        if stage.error is not None:
            e = stage.error
            logger.error("%s: detokenizer thread died", self.worker_id, exc_info=e)
            return f"detokenizer thread died: {type(e).__name__}: {e}"
        since = stage.busy_since
        if since is not None and time.monotonic() - since > self._stage_stuck_s:
            return f"detokenizer thread stuck: one step's deltas for over {self._stage_stuck_s:g} s"
        return None

    def _beat(self) -> None:
        now = time.monotonic()
        if now - self._last_beat < self.control.heartbeat_interval_s:
            return
        self._last_beat = now
        dead = [t.name for t in self._role_threads() if not t.is_alive()]
        if dead:
            raise RuntimeError(f"transfer thread(s) {dead} died")
        self._send(Heartbeat(self.info, self._stats))

    def _role_threads(self) -> list[threading.Thread]:
        return self.role.threads() if self.role is not None else []

    def _drain_commands(self, block: bool) -> None:
        try:
            cmd = self._commands.get(timeout=_IDLE_WAIT_S) if block else self._commands.get_nowait()
        except queue.Empty:
            return
        while True:
            self._handle(cmd)
            try:
                cmd = self._commands.get_nowait()
            except queue.Empty:
                return

    def _handle(self, cmd: object) -> None:
        if isinstance(cmd, (Generate, PrepareDecode, DecodeHandoff)) and not self._links.admit(
            cmd.request_id, cmd.owner
        ):
            # NOTE: its router holds no lease here (a replaced replica's op that came late): nobody
            # would hear its events
            self._decoder.verifier.reject("stale_owner")
            return
        if isinstance(cmd, Generate):
            self._on_generate(cmd)
        elif isinstance(cmd, Abort):
            self._abort(cmd.request_id)
        elif isinstance(cmd, RouterLease):
            freed = self._links.on_lease(cmd)
            if freed is None:
                self._decoder.verifier.reject("bad_field")
            else:
                for rid in freed:
                    self._free_for_router(rid)
        elif isinstance(cmd, DecodeHandoff):
            if self.role is None or not self.role.accepts_handoffs:
                self._fail_request(
                    cmd.request_id, ErrorCode.INVALID_REQUEST, f"{self.pool} worker cannot receive KV"
                )
            else:
                self.role.on_decode(cmd)
        elif isinstance(cmd, PrepareDecode):
            # NOTE: elsewhere it is a hint to ignore; the DecodeHandoff that follows fails the request
            if self.role is not None and self.role.accepts_handoffs:
                self.role.on_prepare(cmd)
        elif isinstance(cmd, PeerDead):
            if self.role is not None:
                self.role.on_peer_dead(cmd)
        elif isinstance(cmd, ExtendLease):
            if self.role is not None:
                self.role.on_extend_lease(cmd.request_id)
        elif isinstance(cmd, _LeakCheck):
            cmd.result.set_result(self._leak_report())
        elif isinstance(cmd, _Fault):
            raise RuntimeError(f"injected fault in the {cmd.kind} thread")
        elif self.role is not None:
            self.role.handle(cmd)
        else:
            raise RuntimeError(f"{self.worker_id}: unexpected command {type(cmd).__name__}")

    def _check_leases(self) -> None:
        """Free the requests of every router whose lease ran out (and tell it, should it be only slow);
        forget the requests that left."""
        for owner, request_ids in self._links.expired():
            for rid in request_ids:
                self._free_for_router(rid)
            why = (
                f"this worker heard nothing from its router for its {owner.lease_s:g} s lease: request freed"
            )
            with self._push_lock:
                for rid in request_ids:
                    if not self._silent:
                        self._links.send_to(
                            owner.replica, RequestFailed(self.worker_id, rid, ErrorCode.UNAVAILABLE, why)
                        )
        self._links.sweep(self._is_live)

    def _free_for_router(self, request_id: str) -> None:
        """Free a request whose router is gone (its lease ran out, or a restarted one took its slot)."""
        if self._is_live(request_id):
            self._num_freed_for_router += 1
        self._abort(request_id)

    def _is_live(self, request_id: str) -> bool:
        return self.engine.request_status(request_id) is not None or (
            self.role is not None and self.role.holds(request_id)
        )

    # ---- requests -------------------------------------------------------------------------------------
    def _abort(self, request_id: str) -> None:
        if self.role is None or not self.role.on_abort(request_id):
            self.engine.abort(request_id)

    def _on_generate(self, op: Generate) -> None:
        if op.hold and (self.role is None or not self.role.holds_prefills):
            self._fail_request(op.request_id, ErrorCode.INVALID_REQUEST, f"{self.pool} worker cannot hold KV")
            return
        try:
            self.engine.add_request(
                op.request_id,
                op.prompt_token_ids,
                op.params,
                hold_after_prefill=op.hold,
                output_token_ids=op.output_token_ids,
            )
        except ValueError as e:
            code = e.code if isinstance(e, CompileFailed) else ErrorCode.INVALID_REQUEST
            self._fail_request(op.request_id, code, str(e))

    def _on_output(self, output: StepOutput) -> None:
        """A step's output to the router through the detokenizer stage, which builds its deltas and sends
        them once their text is in (a held request's first token goes with its handoff instead)."""
        if self.role is not None:
            sending = RequestStatus.SENDING_KV
            held = [item[0].status is sending for item in output.items]
            if any(held):
                first_tokens, output = output.split(held)
                for delta in first_tokens.deltas():
                    self.role.on_first_token(delta)
        if self._stage is not None:
            self._stage.submit(output)
        else:
            self._send_deltas(output.deltas())

    def _send_deltas(self, deltas: list[TokenDelta]) -> None:
        """Deltas to the router in ``Deltas`` frames of at most _DELTAS_PER_FRAME (the stage's thread)."""
        for start in range(0, len(deltas), _DELTAS_PER_FRAME):
            self._send(Deltas(self.worker_id, deltas[start : start + _DELTAS_PER_FRAME]))

    def _send(self, message: Event, last_words_s: float | None = None) -> None:
        """Send one frame to the router. ``last_words_s``: it is the last one; wait (bounded) till it
        left the process, for the process may exit next (a frame still queued in ZMQ would die)."""
        with self._push_lock:
            if self._silent:
                return
            # NOTE: signed under the lock: the frame counter must reach the router in order (it rejects
            # a counter at or below the last as a replay), and the step thread, the detokenizer thread
            # and a dying thread all send.
            dropped = self._links.send(message)
            if last_words_s is None:
                for rid in dropped:  # NOTE: their router cannot hear them: free them (on the step thread)
                    self._commands.put(Abort(rid))
                return
            # NOTE: a socket closed with a linger keeps sending its queue until the linger ends, and
            # terminating its context waits for that (a message tracker would not: ZMQ copies small
            # frames and reports them done at once).
            self._silent = True
            self._links.close(linger_ms=int(last_words_s * 1000))
            self._push_ctx.term()

    def _fail_request(self, request_id: str, code: ErrorCode, message: str) -> None:
        self._send(RequestFailed(self.worker_id, request_id, code, message))

    def _is_healthy(self) -> bool:
        threads = self._threads + self._role_threads()
        if self._stage is not None:
            threads.append(self._stage.thread)
        return self.failed is None and all(t.is_alive() for t in threads)

    def _publish_stats(self) -> None:
        role = self.role
        self._stats = WorkerStats(
            worker_id=self.worker_id,
            pool=self.pool,
            healthy=self._is_healthy(),
            num_waiting_for_kv=role.num_waiting_for_kv() if role is not None else 0,
            engine=self.engine.stats(),
            transfer=role.transfer_stats() if role is not None else TransferStats(),
            rejected_frames=self._rejected_frames(),
            broken_peers=role.broken_peers() if role is not None else [],
            steps=dataclasses.replace(self._steps),
            num_freed_for_router=self._num_freed_for_router,
        )

    def _rejected_frames(self) -> dict[str, int]:
        """Control frames and KV handshake frames this worker dropped, by reason."""
        counts = collections.Counter(self._decoder.rejected())
        if self.role is not None:
            counts.update(self.role.rejected_frames())
        return dict(counts)

    def _leak_report(self) -> str | None:
        try:
            self.engine.check_no_leaks()
            if self.role is not None:
                self.role.check_leaks()
            if self._stage is not None:
                try:  # NOTE: the final deltas it still holds free their state
                    self._stage.flush(_STAGE_DRAIN_S)
                except (RuntimeError, TimeoutError) as e:  # failed or stuck: the step loop says so next
                    return f"the detokenizer stage did not drain: {e}"
                if self._stage.num_requests:
                    raise AssertionError(f"the detokenizer stage holds {self._stage.num_requests} requests")
        except AssertionError as e:
            return str(e)
        return None
