"""What a worker's handoff role sees of its worker, and what the worker asks of its role.

A prefill worker composes a PrefillRole, a decode worker a DecodeRole (workers/prefill_role.py,
workers/decode_role.py); a colocated worker has none. Every role method runs on the worker's step
thread, except the callbacks a role hands to its own transfer thread, which only ``post`` commands.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

from cluster.config import TransferConfig
from cluster.protocol import TokenDelta, TransferStats
from cluster.wire import DecodeHandoff, PeerDead
from workers.engine import Engine


@dataclass(frozen=True)
class WorkerContext:
    """The worker's parts a role uses: its engine (step thread only), ``send`` (an event to the
    router), ``post`` (a command to the step thread, callable from any thread)."""

    worker_id: str
    bind_host: str  # the address this worker's sockets bind (the node's own; loopback on one host)
    engine: Engine
    transfer_config: TransferConfig
    send: Callable[[Any], None]
    post: Callable[[object], None]


class Role(Protocol):
    holds_prefills: bool  # Generate(hold=True) is allowed here
    accepts_handoffs: bool  # DecodeHandoff is allowed here

    def start(self, rank: int) -> None:
        """The transfer world is up (this worker is ``rank``): start the KV sender / receiver."""

    def on_first_token(self, delta: TokenDelta) -> None:
        """A held request produced its first token (SENDING_KV): offer its KV, tell the router."""

    def on_decode(self, op: DecodeHandoff) -> None: ...

    def on_abort(self, request_id: str) -> bool:
        """True if the role took the abort over (e.g. deferred while a transfer is in flight)."""

    def on_peer_dead(self, op: PeerDead) -> None: ...

    def on_extend_lease(self, request_id: str) -> None:
        """The decode side still wants this held request: keep its KV past the lease."""

    def handle(self, cmd: object) -> None:
        """A command the role posted from its transfer thread."""

    def poll(self) -> None:
        """Once per step-loop turn: retry waiting handoffs, expire them."""

    def num_waiting_for_kv(self) -> int: ...

    def transfer_stats(self) -> TransferStats: ...

    def threads(self) -> list[threading.Thread]: ...

    def check_leaks(self) -> None:
        """Raise AssertionError naming what the role still holds."""

    def close(self) -> None: ...
