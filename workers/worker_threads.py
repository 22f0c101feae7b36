"""A worker's own threads, each run guarded: the inbound thread (the op socket), the step thread (the
engine), and what happens when one dies.

Inbound thread: verifies and decodes each frame on the PULL socket (cluster/wire.py) and posts the op to
the step thread; a bad frame is counted and dropped there, so nothing a peer sends can kill this thread.
Step thread: one loop turn drains the commands (blocking, bounded, only while the engine is idle), polls
the role, steps the engine once (its output to the detokenizer stage, a held request's first token to
the role), fails the requests whose grammar failed to compile, watches the detokenizer thread, frees the
requests of routers whose lease ran out, publishes the stats and beats, and sends what the KV tiers
stored and removed (``KvEvents``, after the first beat: a router admits a worker by its heartbeat).
Guard: if a guarded thread dies (or exits while the worker is not stopping), or the detokenizer thread
fails or hangs, or a transfer thread is found dead, the worker says so once (log, stats unhealthy,
``WorkerFailed`` flushed to every router) and calls ``on_fatal``: by default the process exits, so Ray
restarts it.
"""

from __future__ import annotations

import logging
import os
import queue
import threading
import time
from collections.abc import Callable
from typing import Any

import zmq

from cluster.wire import Op, WireDecoder, WorkerFailed
from workers.detokenizer import DetokenizerStage
from workers.engine import Engine
from workers.request import RequestStatus
from workers.role import Role
from workers.stats_log import StatsLine
from workers.step_output import StepOutput
from workers.worker_ops import OpHandler
from workers.worker_outbox import Outbox
from workers.worker_vitals import Vitals

logger = logging.getLogger(__name__)

EXIT_CODE_FATAL = 70
_IDLE_WAIT_S = 0.05  # bound on one idle wait for work; wakes at once when a message arrives
_POLL_MS = 100
_LAST_WORDS_S = 2.0  # bound on flushing WorkerFailed before the process exits


def exit_process(reason: str) -> None:
    """Default ``on_fatal``: leave now (a thread is dead, the process cannot serve); Ray restarts it."""
    logging.shutdown()
    os._exit(EXIT_CODE_FATAL)


class Guard:
    """Runs the worker's threads guarded and reports the worker's failure, once. ``on_failure`` runs
    first (the stats say unhealthy), then ``WorkerFailed`` goes out as the last words, then ``on_fatal``.
    ``more_threads``: the other threads the worker's health needs alive (transfer, detokenizer)."""

    def __init__(
        self,
        worker_id: str,
        stop: threading.Event,
        outbox: Outbox,
        on_fatal: Callable[[str], None],
        on_failure: Callable[[], None],
        more_threads: Callable[[], list[threading.Thread]],
    ) -> None:
        self.worker_id = worker_id
        self._stop = stop
        self._outbox = outbox
        self._on_fatal = on_fatal
        self._on_failure = on_failure
        self._more_threads = more_threads
        self.threads: list[threading.Thread] = []
        self.failed: str | None = None
        self._lock = threading.Lock()

    def start(self, name: str, target: Callable[[], None]) -> None:
        t = threading.Thread(
            target=self._guarded, args=(name, target), name=f"{self.worker_id}-{name}", daemon=True
        )
        t.start()
        self.threads.append(t)

    def join(self, timeout_s: float) -> None:
        for t in self.threads:
            t.join(timeout=timeout_s)

    def is_healthy(self) -> bool:
        return self.failed is None and all(t.is_alive() for t in self.threads + self._more_threads())

    def _guarded(self, name: str, target: Callable[[], None]) -> None:
        try:
            target()
        except BaseException as e:
            if self._stop.is_set():
                # NOTE: the worker is being shut down: a thread still running when its sockets close
                # (shutdown's join is bounded) raises for that; the process is not failing, only ending
                logger.warning("%s: %s thread raised while shutting down: %r", self.worker_id, name, e)
                return
            logger.exception("%s: %s thread died", self.worker_id, name)
            self.fatal(f"{name} thread died: {type(e).__name__}: {e}")
            return
        if not self._stop.is_set():
            self.fatal(f"{name} thread exited")

    def fatal(self, reason: str) -> None:
        """Say so once (log + WorkerFailed to the router), then ``on_fatal``."""
        with self._lock:
            if self.failed is not None:
                return
            self.failed = reason
        logger.error("%s: worker failed: %s", self.worker_id, reason)
        self._on_failure()
        try:
            # NOTE: flushed before on_fatal, which usually exits the process (a queued frame would die)
            self._outbox.send(WorkerFailed(self.worker_id, reason), last_words_s=_LAST_WORDS_S)
        except Exception:
            logger.exception("%s: could not send WorkerFailed", self.worker_id)
        self._on_fatal(reason)


class InboundLoop:
    """The inbound thread's body: frames from ``pull``, decoded, posted; ``fault``: a test hook."""

    def __init__(
        self,
        pull: zmq.Socket[Any],
        decoder: WireDecoder[Op],
        post: Callable[[object], None],
        stop: threading.Event,
        fault: threading.Event,
    ) -> None:
        self._pull = pull
        self._decoder = decoder
        self._post = post
        self._stop = stop
        self._fault = fault

    def run(self) -> None:
        poller = zmq.Poller()
        poller.register(self._pull, zmq.POLLIN)
        while not self._stop.is_set():
            if self._fault.is_set():
                raise RuntimeError("injected fault in the inbound thread")
            if poller.poll(_POLL_MS):
                op = self._decoder.decode(self._pull.recv(copy=True))
                if op is not None:
                    self._post(op)


class StepLoop:
    """The step thread's body (see the module docstring); the engine is single-threaded by contract,
    and this thread is its one user."""

    def __init__(
        self,
        engine: Engine,
        role: Role | None,
        stage: DetokenizerStage | None,
        commands: queue.Queue[object],
        ops: OpHandler,
        vitals: Vitals,
        guard: Guard,
        outbox: Outbox,
        stop: threading.Event,
        stage_stuck_s: float,
        stats_line: StatsLine,
    ) -> None:
        self._engine = engine
        self._role = role
        self._stage = stage
        self._commands = commands
        self._ops = ops
        self._vitals = vitals
        self._guard = guard
        self._outbox = outbox
        self._stop = stop
        self._stage_stuck_s = stage_stuck_s
        self._stats_line = stats_line

    def run(self) -> None:
        engine, vitals = self._engine, self._vitals
        while not self._stop.is_set():
            # NOTE: an idle engine waits for a command (bounded): handoffs waiting for blocks can only
            # start after a command (an abort, a finished transfer) frees some, so nothing spins.
            self._drain_commands(block=not engine.has_unfinished())
            if self._role is not None:
                self._role.poll()
            if engine.has_unfinished():
                finished, prompt = self._finished_transfers(), engine.num_prompt_tokens
                t0 = time.perf_counter()
                output = engine.step_output()
                vitals.steps.count(
                    time.perf_counter() - t0,
                    len(output),
                    engine.num_prompt_tokens - prompt,
                    self._finished_transfers() - finished,
                )
                self._on_output(output)
            for failure in engine.take_failed():  # NOTE: requests whose grammar failed to compile
                self._outbox.fail_request(failure.request_id, failure.code, failure.message)
            problem = self._stage_problem()
            if problem is not None:
                self._guard.fatal(
                    problem
                )  # NOTE: its tokens would never leave; the worker says so, then stops
                return
            self._ops.check_leases()
            vitals.publish()
            vitals.beat()
            vitals.send_kv_events()
            self._stats_line.maybe_log(vitals.stats)

    def _drain_commands(self, block: bool) -> None:
        try:
            cmd = self._commands.get(timeout=_IDLE_WAIT_S) if block else self._commands.get_nowait()
        except queue.Empty:
            return
        while True:
            self._ops.handle(cmd)
            try:
                cmd = self._commands.get_nowait()
            except queue.Empty:
                return

    def _finished_transfers(self) -> int:
        if self._role is None:
            return 0
        t = self._role.transfer_stats()
        return t.num_ok + t.num_failed

    def _on_output(self, output: StepOutput) -> None:
        """A step's output to the router through the detokenizer stage, which builds its deltas and sends
        them once their text is in (a held request's first token goes with its handoff instead)."""
        if self._role is not None:
            sending = RequestStatus.SENDING_KV
            held = [item[0].status is sending for item in output.items]
            if any(held):
                first_tokens, output = output.split(held)
                for delta in first_tokens.deltas():
                    self._role.on_first_token(delta)
        if self._stage is not None:
            self._stage.submit(output)
        else:
            self._outbox.send_deltas(output.deltas())

    def _stage_problem(self) -> str | None:
        """Why the detokenizer thread can no longer send this worker's tokens, if it cannot: it failed
        (it keeps its error), or one item has held it past ``stage_stuck_s`` (the step thread would go
        on beating while every stream hangs)."""
        stage = self._stage
        if stage is None:
            return None
        if stage.error is not None:
            e = stage.error
            logger.error("%s: detokenizer thread died", self._guard.worker_id, exc_info=e)
            return f"detokenizer thread died: {type(e).__name__}: {e}"
        since = stage.busy_since
        if since is not None and time.monotonic() - since > self._stage_stuck_s:
            return f"detokenizer thread stuck: one step's deltas for over {self._stage_stuck_s:g} s"
        return None
