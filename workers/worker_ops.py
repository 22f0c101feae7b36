"""The step thread's commands: the ops the inbound thread decoded (a ``match`` on the ``Op`` union), the
commands the worker's own threads post (a leak check, an injected fault, the role's transfer callbacks),
and the routers' leases.

Ops: ``Generate`` adds a request to the engine (``hold``: a prefill worker keeps its KV for a handoff);
``PrepareDecode`` / ``DecodeHandoff`` go to a decode worker's role (elsewhere the first is a hint to
ignore, the second fails the request); ``Abort`` frees a request wherever it is (the role first: it may
have to wait for a transfer in flight; a prefix pull's id goes to ``PrefixPulls``); ``PeerDead`` and
``ExtendLease`` go to the role; ``OfferPrefix`` / ``FetchPrefix`` (and their transfers' callbacks) to
``PrefixPulls`` (workers/prefix_pulls.py); ``KvResync`` asks the next KV events for a snapshot
(workers/worker_vitals.py); ``RouterLease``
renews a router's lease (and frees the requests of the incarnation it replaces in its slot). An op that
brings a request from a router holding no lease here (a replaced replica's op that came late) is refused
and counted ``stale_owner``: nobody would hear its events.
Leases: every loop turn, the requests of a router whose lease ran out are freed (and it is told, should
it be only slow). Everything here runs on the step thread.
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass

from cluster.protocol import ErrorCode
from cluster.wire import (
    Abort,
    DecodeHandoff,
    Event,
    ExtendLease,
    FetchPrefix,
    Generate,
    KvResync,
    OfferPrefix,
    PeerDead,
    PrefixFetched,
    PrefixOffered,
    PrepareDecode,
    RequestFailed,
    RouterLease,
)
from workers.engine import Engine
from workers.prefix_pulls import PrefixPulls
from workers.role import Role
from workers.structured_compile import CompileFailed
from workers.worker_outbox import Outbox
from workers.worker_vitals import Vitals


@dataclass(frozen=True)
class LeakCheck:
    """Check the leak invariant on the step thread; the report (None: clean) fills ``result``."""

    result: Future[str | None]


@dataclass(frozen=True)
class InjectedFault:
    """Make the step thread die (a test hook: ``EngineWorker.inject_fault``)."""

    kind: str


class OpHandler:
    """See the module docstring. ``reject`` counts a refused op by reason (with the frames the inbound
    thread refused)."""

    def __init__(
        self,
        pool: str,
        engine: Engine,
        role: Role | None,
        outbox: Outbox,
        vitals: Vitals,
        reject: Callable[[str], None],
        pulls: PrefixPulls | None = None,
    ) -> None:
        self.pool = pool
        self._pulls = pulls
        self._engine = engine
        self._role = role
        self._outbox = outbox
        self._links = outbox.links
        self._vitals = vitals
        self._reject = reject

    def handle(self, cmd: object) -> None:
        if isinstance(cmd, (Generate, PrepareDecode, DecodeHandoff)) and not self._links.admit(
            cmd.request_id, cmd.owner
        ):
            # NOTE: its router holds no lease here (a replaced replica's op that came late): nobody
            # would hear its events
            self._reject("stale_owner")
            return
        role = self._role
        if self._pulls is not None and self._pulls.handle(cmd):
            return
        match cmd:
            case Generate():
                self._on_generate(cmd)
            case Abort(request_id=request_id):
                self.abort(request_id)
            case RouterLease():
                freed = self._links.on_lease(cmd)
                if freed is None:
                    self._reject("bad_field")
                else:
                    for rid in freed:
                        self._free_for_router(rid)
            case DecodeHandoff():
                if role is None or not role.accepts_handoffs:
                    self._outbox.fail_request(
                        cmd.request_id, ErrorCode.INVALID_REQUEST, f"{self.pool} worker cannot receive KV"
                    )
                else:
                    role.on_decode(cmd)
            case PrepareDecode():
                # NOTE: elsewhere it is a hint to ignore; the DecodeHandoff that follows fails the request
                if role is not None and role.accepts_handoffs:
                    role.on_prepare(cmd)
            case PeerDead():
                if role is not None:
                    role.on_peer_dead(cmd)
                if self._pulls is not None:
                    self._pulls.on_peer_dead(cmd)
            case ExtendLease(request_id=request_id):
                if role is not None:
                    role.on_extend_lease(request_id)
            case KvResync():
                self._vitals.request_kv_snapshot()
            case OfferPrefix():  # NOTE: a worker that moves no KV (PrefixPulls takes them elsewhere)
                self._outbox.send(
                    PrefixOffered(self._outbox.worker_id, cmd.pull_id, 0, error="no pulls here")
                )
            case FetchPrefix():
                self._outbox.send(
                    PrefixFetched(self._outbox.worker_id, cmd.pull_id, 0, error="no pulls here")
                )
            case LeakCheck(result=result):
                result.set_result(self._vitals.leak_report())
            case InjectedFault(kind=kind):
                raise RuntimeError(f"injected fault in the {kind} thread")
            case _ if role is not None:
                role.handle(cmd)
            case _:
                raise RuntimeError(f"{self._outbox.worker_id}: unexpected command {type(cmd).__name__}")

    def abort(self, request_id: str) -> None:
        if self._pulls is not None and self._pulls.on_abort(request_id):
            return
        if self._role is None or not self._role.on_abort(request_id):
            self._engine.abort(request_id)

    def _on_generate(self, op: Generate) -> None:
        if op.hold and (self._role is None or not self._role.holds_prefills):
            self._outbox.fail_request(
                op.request_id, ErrorCode.INVALID_REQUEST, f"{self.pool} worker cannot hold KV"
            )
            return
        try:
            self._engine.add_request(
                op.request_id,
                op.prompt_token_ids,
                op.params,
                hold_after_prefill=op.hold,
                output_token_ids=op.output_token_ids,
            )
        except ValueError as e:
            code = e.code if isinstance(e, CompileFailed) else ErrorCode.INVALID_REQUEST
            self._outbox.fail_request(op.request_id, code, str(e))

    # ---- the routers' leases ---------------------------------------------------------------------------
    def check_leases(self) -> None:
        """Free the requests of every router whose lease ran out (and tell it, should it be only slow);
        forget the requests that left."""
        worker_id = self._outbox.worker_id
        for owner, request_ids in self._links.expired():
            for rid in request_ids:
                self._free_for_router(rid)
            why = (
                f"this worker heard nothing from its router for its {owner.lease_s:g} s lease: request freed"
            )
            failed: list[Event] = [
                RequestFailed(worker_id, rid, ErrorCode.UNAVAILABLE, why) for rid in request_ids
            ]
            self._outbox.send_to(owner.replica, failed)
        self._links.sweep(self.is_live)

    def _free_for_router(self, request_id: str) -> None:
        """Free a request whose router is gone (its lease ran out, or a restarted one took its slot)."""
        if self.is_live(request_id):
            self._vitals.num_freed_for_router += 1
        self.abort(request_id)

    def is_live(self, request_id: str) -> bool:
        return self._engine.request_status(request_id) is not None or (
            self._role is not None and self._role.holds(request_id)
        )
