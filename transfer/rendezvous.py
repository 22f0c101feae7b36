"""The pair rendezvous over the handshake link: the values a pair's group sets and gets while it is built
travel as signed handshake frames between the pair's two ends; no shared store is read.

A pair's two-rank group (transfer/pairs.py) rendezvouses through a `LinkStore` of its own at each end: a
``dist.Store`` held in this process whose ``set`` keeps the value and ships ``(key, value)`` to the other
end, and whose ``get`` / ``wait`` block (bounded by the group's timeout) until the other end's value came.
A value ships as a ``rendezvous`` handshake frame (transfer/handshake.py) on the link the two ends already
talk over: the decode side's DEALER and the prefill side's ROUTER. The frame is signed with the cluster
secret and bound to its recipient, with a replay guard (cluster/frames.py); its body names the pair (both
ends: worker id and incarnation) and its generation, so a value never reaches another pair, another
process of the same worker, or another generation of the same pair.

Each side (KVSender / KVReceiver) owns one `RendezvousLink`: the stores of the pairs it is building, the
values that came before their pair's store existed (a sender's value may overtake the receiver's join:
buffered, bounded in count and bytes), and the values waiting to be sent. Sockets are not thread-safe, so
only the side's transfer thread touches them: a store's ``set`` (on the pair's build thread, or NCCL's)
queues its value and wakes the transfer thread (``wake``), which sends it (`take_outbox`) and hands each
value it reads to `deliver`. The prefill side (ROUTER) sends to the connection the decode peer's last
verified transfer request came on; a value is accepted only from the connection of the peer it names
(the side checks that and counts a mismatch as ``misbound``).

What the stranger (no cluster secret) can do now: nothing it sends becomes a rendezvous value. A frame
whose MAC does not verify and that claims to carry a rendezvous value is counted ``rendezvous_bad_tag``
(transfer/handshake.py; any other such frame ``bad_mac``), replays and frames meant for another process
under the frame verifier's reasons. Values from a process that holds the secret but name a pair this end
is not in, or come over another peer's connection, are counted ``rendezvous_misbound``; for a generation
already built or given up ``rendezvous_stale``; over `MAX_VALUE_BYTES` ``rendezvous_too_large``; buffered
and evicted by newer ones ``rendezvous_overflow``. A peer that dies mid-rendezvous: its pair's waits fail
at once when the side drops it (`drop`), else at the group's timeout; the pair is then broken and rebuilt
at the next generation (transfer/pairs.py). What stays exposed: a stranger that reaches the prefill
side's handshake socket makes it check a MAC per frame it sends (frames capped at 64 KiB) and fills its
refusal counters; the gloo/NCCL connections the group opens are not authenticated, so the KV bytes they
carry are checked with a MAC (transfer/staging.py).
"""

from __future__ import annotations

import datetime
import logging
import threading
import time
from collections import Counter, OrderedDict, deque
from collections.abc import Callable
from typing import Any

import torch.distributed as dist

from transfer.peers import PairKey, PeerId

logger = logging.getLogger(__name__)

# NOTE: gloo sets ~170 B per rank (its address), NCCL a 128 B unique id; under the handshake frame cap
MAX_VALUE_BYTES = 16 << 10
MAX_PENDING_VALUES = 64  # values buffered for pairs this end has not opened yet
MAX_PENDING_BYTES = 256 << 10
MAX_OUTBOX = 256
MAX_PAIRS_REMEMBERED = 4096  # pairs whose latest generation is remembered (stale values are told apart)

REASON_BAD_TAG = "rendezvous_bad_tag"
REASON_TOO_LARGE = "rendezvous_too_large"
REASON_MISBOUND = "rendezvous_misbound"
REASON_STALE = "rendezvous_stale"
REASON_OVERFLOW = "rendezvous_overflow"

Ends = tuple[str, str]  # (prefill peer name, decode peer name)


class RejectCounter:
    """Rendezvous values refused, by reason; thread-safe."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._counts: Counter[str] = Counter()

    def add(self, reason: str, name: str) -> None:
        with self._lock:
            self._counts[reason] += 1
            total = sum(self._counts.values())
        if total <= 10 or total % 1000 == 0:  # NOTE: a flood of refusals must not flood the log
            logger.warning("ignored rendezvous value #%d for %r: %s", total, name, reason)

    def snapshot(self) -> dict[str, int]:
        with self._lock:
            return dict(self._counts)


class LinkStore(dist.Store):
    """One end's store for one pair's group rendezvous (see the module docstring). Thread-safe.

    ``set`` keeps the value and, until the build ended (`seal`), hands it to ``ship``; ``get`` / ``wait``
    return once every key is here (set here or `deliver`ed from the other end), raise TimeoutError past
    their bound (the store's ``timeout_s``, or the ``wait``'s own if shorter) and RuntimeError at once
    after `fail`. ``add`` and ``compare_set`` (a counter or a race shared by both ends) cannot be kept
    consistent by two ends that only exchange values, and neither gloo's nor NCCL's pair rendezvous uses
    them: they raise.

    NOTE: torch calls it from C++ through a trampoline that looks the Python object up on every call: the
    pair keeps a reference for as long as its group lives (transfer/pairs.py).
    """

    def __init__(self, key: PairKey, rank: int, timeout_s: float, ship: Callable[[str, bytes], None]) -> None:
        super().__init__()
        self.key = key
        self.rank = rank
        self._timeout_s = timeout_s
        self._ship = ship
        self._cond = threading.Condition()
        self._values: dict[str, bytes] = {}
        self._error: str | None = None
        self._is_sealed = False

    # ---- the other end's values (the side's transfer thread) -----------------------------------------
    def deliver(self, name: str, value: bytes) -> None:
        with self._cond:
            self._values[name] = value
            self._cond.notify_all()

    def fail(self, why: str) -> None:
        """Give up: every wait, now or later, raises at once."""
        with self._cond:
            self._error = self._error or why
            self._cond.notify_all()

    def seal(self) -> None:
        """The build ended: later sets (NCCL's watchdog signals) stay here."""
        with self._cond:
            self._is_sealed = True

    # ---- dist.Store ----------------------------------------------------------------------------------
    def set(self, key: str, value: bytes | str) -> None:
        raw = value.encode() if isinstance(value, str) else bytes(value)
        if len(raw) > MAX_VALUE_BYTES:
            raise ValueError(f"rendezvous value for {key!r} is {len(raw)} B (max {MAX_VALUE_BYTES})")
        with self._cond:
            self._values[key] = raw
            self._cond.notify_all()
            is_sealed = self._is_sealed
        if not is_sealed:
            self._ship(key, raw)

    def get(self, key: str) -> bytes:
        return self._wait([key], self._timeout_s)[0]

    def wait(self, keys: list[str], timeout: datetime.timedelta | None = None) -> None:
        bound = self._timeout_s if timeout is None else min(self._timeout_s, timeout.total_seconds())
        self._wait(keys, bound)

    def check(self, keys: list[str]) -> bool:
        with self._cond:
            return all(k in self._values for k in keys)

    def multi_get(self, keys: list[str]) -> list[bytes]:
        return self._wait(keys, self._timeout_s)

    def multi_set(self, keys: list[str], values: list[bytes | str]) -> None:
        for key, value in zip(keys, values, strict=True):
            self.set(key, value)

    def add(self, key: str, amount: int) -> int:
        raise NotImplementedError(f"a pair's link store has no shared counters (add {key!r})")

    def compare_set(self, key: str, expected: bytes | str, desired: bytes | str) -> bytes:
        raise NotImplementedError(f"a pair's link store has no shared compare-and-set ({key!r})")

    def delete_key(self, key: str) -> bool:
        with self._cond:
            return self._values.pop(key, None) is not None

    def num_keys(self) -> int:
        with self._cond:
            return len(self._values)

    def set_timeout(self, timeout: datetime.timedelta) -> None:
        self._timeout_s = timeout.total_seconds()

    def clone(self) -> LinkStore:
        return self  # NOTE: one replica per pair end; every method is thread-safe

    def _wait(self, keys: list[str], timeout_s: float) -> list[bytes]:
        deadline = time.monotonic() + timeout_s
        with self._cond:
            while True:
                if self._error is not None:
                    raise RuntimeError(f"rendezvous of pair {self.key} abandoned: {self._error}")
                missing = [k for k in keys if k not in self._values]
                if not missing:
                    return [self._values[k] for k in keys]
                left = deadline - time.monotonic()
                if left <= 0:
                    peer = self.key.ends[1 - self.rank].name
                    raise TimeoutError(
                        f"no rendezvous value for {missing} from {peer} within {timeout_s:.1f}s"
                    )
                self._cond.wait(left)


class RendezvousLink:
    """One side's end of its pairs' rendezvous: the `LinkStore`s of the pairs it builds, values buffered
    for pairs not opened yet, values waiting to be sent (see the module docstring).

    ``me`` is the side's process, ``rank`` its rank in every pair (prefill 0, decode 1); ``wake`` wakes the
    side's transfer thread (a value to send, a build ended). `open` / `close` come from the channel,
    `deliver` / `take_outbox` / `reject` from the transfer thread, `drop` / `close_all` / `rejected` from
    any thread.
    """

    def __init__(self, me: PeerId, rank: int, wake: Callable[[], None]) -> None:
        self.me = me
        self.rank = rank
        self._wake = wake
        self._lock = threading.Lock()
        self._open: dict[Ends, LinkStore] = {}
        self._last: dict[Ends, int] = {}  # the latest generation opened, per pair
        self._pending: OrderedDict[tuple[str, str, int, str], bytes] = OrderedDict()
        self._pending_bytes = 0
        self._outbox: deque[tuple[PeerId, dict[str, Any]]] = deque()
        self._rejected = RejectCounter()

    def open(self, key: PairKey, timeout_s: float) -> LinkStore:
        """The store of pair `key` at this end, holding what already came for it; an older generation's
        store of the same two peers fails (its build ends)."""
        ends = _ends(key)
        store = LinkStore(key, self.rank, timeout_s, lambda name, value: self._ship(key, name, value))
        with self._lock:
            old = self._open.pop(ends, None)
            self._open[ends] = store
            self._last[ends] = max(self._last.pop(ends, -1), key.generation)  # NOTE: now the newest entry
            while len(self._last) > MAX_PAIRS_REMEMBERED:
                del self._last[next(iter(self._last))]
            for item in [p for p in self._pending if p[:2] == ends and p[2] <= key.generation]:
                value = self._pending.pop(item)
                self._pending_bytes -= len(value)
                if item[2] == key.generation:
                    store.deliver(item[3], value)
        if old is not None:
            old.fail(f"superseded by generation {key.generation}")
        return store

    def close(self, store: LinkStore) -> None:
        """The build that used `store` ended (built or broken): nothing more is delivered to it."""
        store.seal()
        with self._lock:
            if self._open.get(_ends(store.key)) is store:
                del self._open[_ends(store.key)]
        self._wake()

    def deliver(self, fields: dict[str, Any]) -> None:
        """A rendezvous message the side verified and read from the connection of the peer it names
        (``prefill``, ``decode``, ``generation``, ``key``, ``value``)."""
        ends: Ends = (fields["prefill"], fields["decode"])
        generation, name, value = fields["generation"], fields["key"], fields["value"]
        what = f"{ends[0]}|{ends[1]}|{generation}|{name}"
        if ends[self.rank] != self.me.name or ends[1 - self.rank] == self.me.name:
            self.reject(REASON_MISBOUND, what)
            return
        if len(value) > MAX_VALUE_BYTES:
            self.reject(REASON_TOO_LARGE, what)
            return
        evicted: list[tuple[str, str, int, str]] = []
        with self._lock:
            store = self._open.get(ends)
            if store is not None and store.key.generation == generation:
                store.deliver(name, value)
                return
            is_stale = generation <= self._last.get(ends, -1)
            if not is_stale:
                item = (*ends, generation, name)
                self._pending_bytes += len(value) - len(self._pending.pop(item, b""))
                self._pending[item] = value
                while len(self._pending) > MAX_PENDING_VALUES or self._pending_bytes > MAX_PENDING_BYTES:
                    oldest, dropped = self._pending.popitem(last=False)
                    self._pending_bytes -= len(dropped)
                    evicted.append(oldest)
        if is_stale:
            self.reject(REASON_STALE, what)
        for item in evicted:
            self.reject(REASON_OVERFLOW, "|".join(map(str, item)))

    def take_outbox(self) -> list[tuple[PeerId, dict[str, Any]]]:
        """The values to send, oldest first: (to whom, the message's fields)."""
        with self._lock:
            out, self._outbox = list(self._outbox), deque()
        return out

    def reject(self, reason: str, name: str) -> None:
        self._rejected.add(reason, name)

    def rejected(self) -> dict[str, int]:
        return self._rejected.snapshot()

    def drop(self, peer: PeerId) -> None:
        """`peer` is dead: its pairs' rendezvous fail at once; what came from it or waits for it goes."""
        with self._lock:
            stores = [s for ends, s in self._open.items() if peer.name in ends]
            for ends in [e for e in self._open if peer.name in e]:
                del self._open[ends]
            for ends in [e for e in self._last if peer.name in e]:
                del self._last[ends]
            for item in [p for p in self._pending if peer.name in p[:2]]:
                self._pending_bytes -= len(self._pending.pop(item))
            self._outbox = deque(m for m in self._outbox if m[0] != peer)
        for store in stores:
            store.fail(f"peer {peer.name} was dropped")

    def close_all(self, why: str) -> None:
        with self._lock:
            stores, self._open = list(self._open.values()), {}
        for store in stores:
            store.fail(why)

    def _ship(self, key: PairKey, name: str, value: bytes) -> None:
        fields = {
            "prefill": key.prefill.name,
            "decode": key.decode.name,
            "generation": key.generation,
            "key": name,
            "value": value,
        }
        with self._lock:
            if len(self._outbox) >= MAX_OUTBOX:  # NOTE: a transfer thread that stopped reading its queue
                logger.warning("%s: rendezvous outbox full, dropping its oldest value", self.me.name)
                self._outbox.popleft()
            self._outbox.append((key.other(self.me), fields))
        self._wake()


def _ends(key: PairKey) -> Ends:
    return key.prefill.name, key.decode.name
