"""EngineWorker: one Engine stepped by its own thread, fed and drained over ZMQ with msgpack.

Threads and what they own:
  - step thread: the Engine (single-threaded by contract) and the outbound PUSH socket to the router;
  - inbound thread: the PULL socket; it only decodes messages and queues them for the step thread;
  - transfer thread (inside KVSender / KVReceiver): the KV bytes; its callbacks only queue commands.
Actor methods (stats, health, check_leaks) never wait behind a forward: stats are a snapshot the step
thread publishes, everything else goes through the command queue with a bounded wait.

Messages in (router -> worker), each a msgpack map with "op":
  generate {rid, prompt, params, hold, deadline}: run a request here (hold: prefill of a handoff)
  decode   {rid, prompt, first_token, params, handoff, deadline}: receive a prefilled request's KV
  abort    {rid}
Messages out (worker -> router), each with "kind" and "worker":
  delta {delta}: tokens of a request; prefilled {delta, handoff}: first token + where its KV waits;
  transferred {rid, seconds, nbytes}; error {rid, status, message}
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

import zmq

from cluster.config import EngineConfig, TransferConfig
from cluster.protocol import (
    SamplingParams,
    TokenDelta,
    WorkerStats,
    pack,
    to_dict,
    unpack,
)
from workers.engine import Engine
from workers.request import RequestStatus

logger = logging.getLogger(__name__)

_IDLE_WAIT_S = 0.05  # bound on one idle wait for work; wakes at once when a message arrives

Command = tuple[str, Any]


class EngineWorker:
    """Base of PrefillWorker and DecodeWorker (and the colocated worker). Plain class: Ray wraps it at
    launch (deploy/launch.py), tests may drive it directly. ``engine_factory`` is injectable."""

    pool = "colocated"

    def __init__(
        self,
        worker_id: str,
        engine_config: EngineConfig,
        transfer_config: TransferConfig | None = None,
        *,
        torch_threads: int | None = None,
        bind_host: str = "127.0.0.1",
        engine_factory: Callable[[EngineConfig], Engine] = Engine,
    ) -> None:
        if torch_threads is not None:
            import torch

            torch.set_num_threads(torch_threads)
        self.worker_id = worker_id
        self.transfer_config = transfer_config or TransferConfig()
        self.engine = engine_factory(engine_config)
        self._ctx: zmq.Context[Any] = zmq.Context()
        self._pull = self._ctx.socket(zmq.PULL)
        self._pull.setsockopt(zmq.LINGER, 0)
        self._pull.bind(f"tcp://{bind_host}:*")
        self.request_endpoint: str = self._pull.getsockopt_string(zmq.LAST_ENDPOINT)
        self._push: zmq.Socket[Any] | None = None
        self._commands: queue.Queue[Command] = queue.Queue()
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []
        self._stats = WorkerStats(worker_id, self.pool)
        self._transfer_bytes = 0
        self._transfer_seconds = 0.0
        self._num_transfers = 0
        self._num_failed_transfers = 0
        self._num_waiting_for_kv = 0
        self.failed: str | None = None

    # ---- actor API ------------------------------------------------------------------------------------
    def info(self) -> dict[str, Any]:
        e = self.engine
        return {
            "worker_id": self.worker_id,
            "pool": self.pool,
            "request_endpoint": self.request_endpoint,
            "max_model_len": e.max_model_len,
            "vocab_size": e.vocab_size,
            "model_dir": e.model_dir,
            "block_size": e.config.block_size,
            "num_blocks": e.runner.num_blocks,
            "device": str(e.runner.device),
        }

    def start(self, router_endpoint: str) -> None:
        """Connect to the router's PULL socket and start the step and inbound threads."""
        self._push = self._ctx.socket(zmq.PUSH)
        self._push.setsockopt(zmq.LINGER, 0)
        self._push.connect(router_endpoint)
        self._publish_stats()
        for target, name in ((self._inbound_loop, "inbound"), (self._step_loop, "step")):
            t = threading.Thread(target=target, name=f"{self.worker_id}-{name}", daemon=True)
            t.start()
            self._threads.append(t)

    def stats(self) -> dict[str, Any]:
        return to_dict(self._stats)

    def health(self) -> bool:
        return self.failed is None and all(t.is_alive() for t in self._threads)

    def check_leaks(self, timeout_s: float = 10.0) -> str | None:
        """Leak invariant, checked on the step thread: None if clean, else what leaked."""
        fut: Future[str | None] = Future()
        self._commands.put(("check_leaks", fut))
        return fut.result(timeout=timeout_s)

    def rendezvous_address(self) -> tuple[str, int]:
        """Rank 0 publishes where the torch.distributed TCPStore will listen (a free port here)."""
        import socket

        host = self._pull.getsockopt_string(zmq.LAST_ENDPOINT).rsplit(":", 1)[0].removeprefix("tcp://")
        with socket.socket() as s:
            s.bind((host, 0))
            return host, int(s.getsockname()[1])

    def init_process_group(self, rank: int, world_size: int, master: tuple[str, int], backend: str) -> None:
        """Join the cluster's one torch.distributed world (every worker calls this at launch, together)."""
        import datetime

        import torch.distributed as dist

        dist.init_process_group(
            backend,
            init_method=f"tcp://{master[0]}:{master[1]}",
            rank=rank,
            world_size=world_size,
            timeout=datetime.timedelta(seconds=max(60.0, 4 * self.transfer_config.timeout_s)),
        )
        self.rank = rank
        self._start_transfer(rank)

    def _start_transfer(self, rank: int) -> None:
        """PrefillWorker / DecodeWorker start their KV sender / receiver here."""
        return None

    def shutdown(self) -> None:
        self._stop.set()
        for t in self._threads:
            t.join(timeout=5.0)
        self._close_transfer()
        self._pull.close(linger=0)
        if self._push is not None:
            self._push.close(linger=0)
        self._ctx.term()

    # ---- threads --------------------------------------------------------------------------------------
    def _inbound_loop(self) -> None:
        poller = zmq.Poller()
        poller.register(self._pull, zmq.POLLIN)
        while not self._stop.is_set():
            if poller.poll(100):
                try:
                    self._commands.put(("msg", unpack(self._pull.recv())))
                except ValueError:
                    logger.exception("%s: dropped a malformed message", self.worker_id)

    def _step_loop(self) -> None:
        try:
            while not self._stop.is_set():
                busy = self.engine.has_unfinished()
                self._drain_commands(block=not busy and not self._has_pending_work())
                self._poll_pending_work()
                if self.engine.has_unfinished():
                    self._on_deltas(self.engine.step())
                self._publish_stats()
        except Exception as e:
            logger.exception("%s: step loop died", self.worker_id)
            self.failed = f"{type(e).__name__}: {e}"

    def _drain_commands(self, block: bool) -> None:
        try:
            cmd = self._commands.get(timeout=_IDLE_WAIT_S) if block else self._commands.get_nowait()
        except queue.Empty:
            return
        while True:
            self._handle_command(*cmd)
            try:
                cmd = self._commands.get_nowait()
            except queue.Empty:
                return

    def _handle_command(self, kind: str, payload: Any) -> None:
        if kind == "msg":
            op = payload.get("op")
            if op == "generate":
                self._on_generate(payload)
            elif op == "decode":
                self._on_decode(payload)
            elif op == "abort":
                self._on_abort(payload["rid"])
            elif op == "peer_dead":
                self._on_peer_dead(int(payload["rank"]))
            else:
                logger.warning("%s: unknown op %r", self.worker_id, op)
        elif kind == "check_leaks":
            payload.set_result(self._leak_report())
        else:
            self._handle_transfer_command(kind, payload)

    # ---- requests -------------------------------------------------------------------------------------
    def _on_generate(self, msg: dict[str, Any]) -> None:
        rid = msg["rid"]
        try:
            self.engine.add_request(
                rid, msg["prompt"], SamplingParams(**msg["params"]), hold_after_prefill=bool(msg.get("hold"))
            )
        except ValueError as e:
            self._send_error(rid, 400, str(e))

    def _on_abort(self, rid: str) -> None:
        self.engine.abort(rid)

    def _on_deltas(self, deltas: list[TokenDelta]) -> None:
        for delta in deltas:
            if self.engine.request_status(delta.request_id) == RequestStatus.SENDING_KV:
                self._on_prefilled(delta)
            else:
                self._send({"kind": "delta", "delta": to_dict(delta)})

    def _send(self, message: dict[str, Any]) -> None:
        assert self._push is not None, "start() first"
        message["worker"] = self.worker_id
        self._push.send(pack(message))

    def _send_error(self, rid: str, status: int, message: str) -> None:
        self._send({"kind": "error", "rid": rid, "status": status, "message": message})

    def _publish_stats(self) -> None:
        st = self.engine.stats()
        self._stats = WorkerStats(
            worker_id=self.worker_id,
            pool=self.pool,
            healthy=self.failed is None,
            num_running=st.num_running,
            num_waiting=st.num_waiting,
            num_waiting_for_kv=self._num_waiting_for_kv,
            kv_usage=1.0 - st.num_free_blocks / max(1, st.num_total_blocks),
            num_free_blocks=st.num_free_blocks,
            num_total_blocks=st.num_total_blocks,
            num_preemptions=st.num_preemptions,
            prefix_cache_queries=st.prefix_cache_queries,
            prefix_cache_hits=st.prefix_cache_hits,
            num_prompt_tokens=st.num_prompt_tokens,
            num_generation_tokens=st.num_generation_tokens,
            transfer_bytes=self._transfer_bytes,
            transfer_seconds=self._transfer_seconds,
            num_transfers=self._num_transfers,
            num_failed_transfers=self._num_failed_transfers,
        )

    def _leak_report(self) -> str | None:
        try:
            self.engine.check_no_leaks()
            self._check_transfer_leaks()
        except AssertionError as e:
            return str(e)
        return None

    # ---- hooks for the transfer side (PrefillWorker / DecodeWorker) -----------------------------------
    def _on_prefilled(self, delta: TokenDelta) -> None:
        raise RuntimeError(f"{self.pool} worker cannot hold a request for a handoff")

    def _on_decode(self, msg: dict[str, Any]) -> None:
        self._send_error(msg["rid"], 400, f"{self.pool} worker cannot receive KV")

    def _handle_transfer_command(self, kind: str, payload: Any) -> None:
        raise RuntimeError(f"unknown command {kind!r}")

    def _on_peer_dead(self, rank: int) -> None:
        return None

    def _has_pending_work(self) -> bool:
        return False

    def _poll_pending_work(self) -> None:
        return None

    def _check_transfer_leaks(self) -> None:
        return None

    def _close_transfer(self) -> None:
        return None
