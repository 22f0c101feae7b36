"""Who moves KV with whom: a peer is one process of a worker (worker id + incarnation; a worker Ray
restarted is a new peer), and a pair is one prefill peer and one decode peer at a generation."""

from __future__ import annotations

from dataclasses import dataclass

from cluster.protocol import peer_name

PREFILL_RANK, DECODE_RANK = 0, 1  # each pair's group has two ranks: the prefill side is 0


@dataclass(frozen=True)
class PeerId:
    """One process of a worker."""

    worker_id: str
    incarnation: str

    @property
    def name(self) -> str:
        """``worker_id/incarnation``: what handshake frames are addressed to and stats report."""
        return peer_name(self.worker_id, self.incarnation)


@dataclass(frozen=True)
class PairKey:
    """A prefill peer and a decode peer, and the generation of their group (a broken group is rebuilt
    at the next generation; both ends agree on it in the handshake, see transfer/protocol.py)."""

    prefill: PeerId
    decode: PeerId
    generation: int

    @property
    def ends(self) -> tuple[PeerId, PeerId]:
        return self.prefill, self.decode

    def other(self, me: PeerId) -> PeerId:
        return self.decode if me == self.prefill else self.prefill
