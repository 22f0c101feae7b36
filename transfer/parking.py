"""ParkedRequests: transfer requests that reached a KVSender before the offer they ask for.

Early decode admission: the decode side posts its REQUEST while the prefill is still running, with a
bound (``TransferRequest.offer_wait_until``). The sender parks it; `offered` makes it ready (the transfer
thread tells the receiver, which asks again), a withdrawal (the request was aborted on the prefill side)
or the bound passing refuses it (the thread answers with an abort), and the receiver's own abort or a
dropped peer just forgets it. Nothing parked holds blocks: the lease starts with the offer.
"""

from __future__ import annotations

from transfer.peers import PeerId
from transfer.protocol import TransferError, TransferRequest, TransferTimeoutError

Parked = tuple[bytes, TransferRequest]  # (the receiver's ZMQ identity, its request)


def _dst(req: TransferRequest) -> PeerId:
    return PeerId(req.dst_worker_id, req.dst_incarnation)


class ParkedRequests:
    """Not thread-safe by itself: every method runs under the sender's lock, the one that guards its
    leases, so an offer and a park never miss each other."""

    def __init__(self) -> None:
        self._parked: dict[str, Parked] = {}  # by request id
        self._ready: list[Parked] = []  # offered since they were parked
        self._refused: list[tuple[Parked, TransferError]] = []

    def __len__(self) -> int:
        return len(self._parked) + len(self._ready) + len(self._refused)

    def park(self, ident: bytes, req: TransferRequest) -> bool:
        """False if a request for the same request id is parked already (refuse this one)."""
        if req.request_id in self._parked:
            return False
        self._parked[req.request_id] = (ident, req)
        return True

    def offered(self, request_id: str) -> bool:
        """The request was just offered: its parked transfer request (if any: True) becomes ready."""
        item = self._parked.pop(request_id, None)
        if item is not None:
            self._ready.append(item)
        return item is not None

    def withdraw(self, request_id: str, error: TransferError) -> bool:
        """Refuse the transfer request parked for ``request_id`` (True if there was one)."""
        item = self._parked.pop(request_id, None)
        if item is not None:
            self._refused.append((item, error))
        return item is not None

    def take(self, now: float, me: str) -> tuple[list[Parked], list[tuple[Parked, TransferError]]]:
        """(ready, refused) since the last call; parked requests past their bound (time.time() ``now``)
        are refused too."""
        for rid in [r for r, (_, req) in self._parked.items() if req.offer_wait_until <= now]:
            error = TransferTimeoutError(f"{me} was not offered {rid!r} within the transfer request's bound")
            self._refused.append((self._parked.pop(rid), error))
        ready, self._ready = self._ready, []
        refused, self._refused = self._refused, []
        return ready, refused

    def cancel(self, ident: bytes, nonce: int) -> None:
        """The receiver aborted its request (``ident``, ``nonce``): forget it (an offer made meanwhile
        stays; its owner ends it)."""
        for rid in [r for r, (i, req) in self._parked.items() if (i, req.nonce) == (ident, nonce)]:
            del self._parked[rid]
        self._ready = [p for p in self._ready if (p[0], p[1].nonce) != (ident, nonce)]

    def forget(self, dropped: set[PeerId]) -> None:
        """Forget the requests of dropped (dead) peers; nobody is left to answer."""
        for rid in [r for r, (_, req) in self._parked.items() if _dst(req) in dropped]:
            del self._parked[rid]
        self._ready = [p for p in self._ready if _dst(p[1]) not in dropped]
        self._refused = [p for p in self._refused if _dst(p[0][1]) not in dropped]
