"""What a worker's handoff role sees of its worker, and what the worker asks of its role.

A prefill worker composes a PrefillRole, a decode worker a DecodeRole (workers/prefill_role.py,
workers/decode_role.py); a colocated worker has none. Every role method runs on the worker's step
thread, except the callbacks a role hands to its own transfer thread, which only ``post`` commands.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

from cluster.config import TransferConfig
from cluster.protocol import TokenDelta, TransferStats
from cluster.wire import DecodeHandoff, Event, PeerDead, PrepareDecode
from transfer.pairs import PairChannel
from transfer.peers import PeerId
from workers.engine import Engine


@dataclass(frozen=True)
class WorkerContext:
    """The worker's parts a role uses: its engine (step thread only), ``send`` (an event to the
    router), ``post`` (a command to the step thread, callable from any thread). ``moves_kv``: this worker
    hands KV over (``WorkerControl.moves_kv``; False: it cannot move KV)."""

    worker_id: str
    incarnation: str
    bind_host: str  # the address this worker's sockets bind (the node's own; loopback on one host)
    engine: Engine
    transfer_config: TransferConfig
    secret: bytes  # the cluster's: signs and checks the KV handshake's frames
    moves_kv: bool
    send: Callable[[Event], None]
    post: Callable[[object], None]

    @property
    def me(self) -> PeerId:
        return PeerId(self.worker_id, self.incarnation)

    def channel(self) -> PairChannel | None:
        """A channel for this worker's KV-transfer pairs (each built on first use, rendezvousing over its
        own signed link), or None if this worker moves no KV."""
        if not self.moves_kv:
            return None
        cfg, runner = self.transfer_config, self.engine.runner
        backend = cfg.backend
        if backend == "auto":  # NOTE: launch resolves it for the whole cluster; a lone worker guesses
            backend = "nccl" if runner.device.type == "cuda" else "gloo"
        # NOTE: an abandoned op whose match never comes (a dead peer) ends at the group's timeout, which
        # then breaks the pair; far longer than a transfer, so a slow peer's late ops still land.
        return PairChannel(
            self.bind_host,
            backend,
            group_timeout_s=max(60.0, 4 * cfg.timeout_s),
            device=runner.device if backend == "nccl" else None,
        )


class Role(Protocol):
    holds_prefills: bool  # Generate(hold=True) is allowed here
    accepts_handoffs: bool  # PrepareDecode and DecodeHandoff are allowed here

    def start(self) -> None:
        """Start the KV sender / receiver (its pairs are built on first use)."""

    def kv_endpoint(self) -> str:
        """The KV sender's handshake socket ("" if this role has none)."""

    def broken_peers(self) -> list[str]:
        """KV-transfer peers whose pair with this worker is broken."""

    def rejected_frames(self) -> dict[str, int]:
        """KV handshake frames dropped, by reason."""

    def on_first_token(self, delta: TokenDelta) -> None:
        """A held request produced its first token (SENDING_KV): offer its KV, tell the router."""

    def on_prepare(self, op: PrepareDecode) -> None:
        """Early decode admission: reserve blocks and post the fetch while the prefill runs."""

    def on_decode(self, op: DecodeHandoff) -> None: ...

    def on_abort(self, request_id: str) -> bool:
        """True if the role took the abort over (e.g. deferred while a transfer is in flight)."""

    def holds(self, request_id: str) -> bool:
        """The role holds state of the request outside the engine (a handoff waiting, a fetch)."""

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
