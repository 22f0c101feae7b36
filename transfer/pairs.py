"""PairChannel: every prefill/decode pair gets its own two-rank torch.distributed group, on first use.

A pair's group is a standalone ``ProcessGroupGloo`` (or ``ProcessGroupNCCL``) over a `LinkStore` of its
own (transfer/rendezvous.py): what the group sets while it is built (gloo's addresses, NCCL's unique id)
travels to the pair's other end as a signed handshake frame on the link the two ends already talk over
(the decode side's DEALER, the prefill side's ROUTER), and what it gets comes only from there. There is
no shared store (the cluster hosts none), and nothing a process without the cluster secret writes
anywhere is read. There is no global torch.distributed world either, so a worker that Ray restarts, or
one added later (a new incarnation, hence a new peer), moves KV as soon as the router admits it. Both
ends call `connect` with the key they agreed on in the handshake (transfer/protocol.py); the side that
owns the link attached it first (`use_link`: KVSender and KVReceiver do so). The group is built
on a helper thread (its rendezvous waits for the other end's values) and warmed up with one small
send/recv before `connect`'s op completes.

NOTE: the warm-up matters for NCCL, which creates a pair's communicator lazily on its first op and needs
both ranks inside it: without it the first real transfer's receive would wait for a sender that waits
for the receiver's ack. With gloo it proves the connection before any KV byte is at stake. Once the build
ended its store is sealed: the pair's ops never need another value (a pair only sends and receives
between its two ranks, over the communicator the warm-up made).

gloo's device is created with this worker's own address (``bind_host``): its sockets listen there, never
on every interface. The gloo/NCCL connections are not authenticated: the KV bytes they carry are checked
with a MAC keyed from the cluster secret (integrity `mac`, transfer/staging.py).

Broken pairs: a failed op (a gloo op that outlives the group's timeout closes the pair, a dead peer
closes it, and a closed pair fails every later op at once) or a failed build (the other end's values did
not come within the group's timeout, or its side dropped the peer) marks the pair broken. A broken pair
is never used again: `generation` answers the next generation, which the next transfer between the two
builds. An old group stays referenced by its unfinished ops until they end.
"""

from __future__ import annotations

import datetime
import logging
import os
import threading
from typing import Any

import torch

from transfer.channel import Channel, OpLane, PendingOp, _as_bytes, _GlooOp, _PolledOp
from transfer.peers import DECODE_RANK, PREFILL_RANK, PairKey, PeerId
from transfer.protocol import TransferError, TransferPairError, TransferTimeoutError
from transfer.rendezvous import LinkStore, RendezvousLink
from transfer.ring import on_stream

logger = logging.getLogger(__name__)

BACKENDS = ("gloo", "nccl")
# NOTE: ProcessGroupNCCL's watchdog defaults to tearing the process down when an op fails or times out
# (TORCH_NCCL_ASYNC_ERROR_HANDLING=3, SkipCleanUp), and its heartbeat monitor may abort it too. A stuck
# pair op must only break that pair (PairChannel.abandon): 2 (CleanUpOnly) aborts the pair's communicator,
# which ends its stuck kernels and fails its ops, and keeps the process; the monitor is switched off. Each
# is set only where the user set neither of its names (ProcessGroupNCCL.hpp lists the legacy alias).
NCCL_ENV_DEFAULTS = {
    ("TORCH_NCCL_ASYNC_ERROR_HANDLING", "NCCL_ASYNC_ERROR_HANDLING"): "2",
    ("TORCH_NCCL_ENABLE_MONITORING",): "0",
}


def indexed_device(device: torch.device) -> torch.device:
    """`device` with its index: a bare ``cuda`` is the calling thread's current device (set_device and
    ProcessGroupNCCL refuse one without an index; the current device is per thread, so resolve it on the
    thread that owns the device, not on a helper)."""
    if device.type == "cuda" and device.index is None:
        return torch.device("cuda", torch.cuda.current_device())
    return device


def set_nccl_env_defaults() -> None:
    """Set `NCCL_ENV_DEFAULTS` unless the user chose them; call before the first ProcessGroupNCCL is made
    (it reads them when it is constructed)."""
    for names, value in NCCL_ENV_DEFAULTS.items():
        if not any(name in os.environ for name in names):
            os.environ[names[0]] = value


class _Pair:
    """One pair's group (this end of it): built once, broken at most once, never rebuilt in place."""

    def __init__(self, key: PairKey, rank: int) -> None:
        self.key = key
        self.rank = rank
        self.peer_rank = 1 - rank
        self.ready = threading.Event()  # the build ended (ok: `group` is set)
        self.group: Any = None
        self.keep: list[Any] = []  # what the group needs alive (its link store)
        self.error: str | None = None  # why it is broken (the build failed, or an op did)

    @property
    def peer(self) -> PeerId:
        return self.key.ends[self.peer_rank]

    def mark_broken(self, why: str) -> None:
        if self.error is None:
            self.error = why
            logger.warning("KV pair %s (generation %d) broken: %s", self.peer.name, self.key.generation, why)


class _BuildOp(PendingOp):
    """Completes when the pair was built and warmed up; raises TransferPairError if it failed."""

    def __init__(self, pair: _Pair) -> None:
        self._pair = pair

    def is_done(self) -> bool:
        return self._pair.ready.is_set()

    def wait(self, timeout_s: float) -> None:
        pair = self._pair
        if not pair.ready.wait(max(timeout_s, 0.0)):
            raise TransferTimeoutError(f"pair with {pair.peer.name} not built within {timeout_s:.3f}s")
        if pair.error is not None or pair.group is None:
            raise TransferPairError(
                f"pair with {pair.peer.name} (generation {pair.key.generation}): {pair.error}"
            )


class PairChannel(Channel):
    """send/recv over each pair's own group, gloo (staging on CPU) or nccl (staging on the KV's GPU).

    Pairs rendezvous over their sides' links (no shared store). ``bind_host``: this worker's own
    address; ``group_timeout_s``: the groups' timeout (rendezvous, and any op, which gloo then fails and
    closes the pair with). Thread-safe; one channel may serve several sides (each `use_link`s its own).
    Tags are honoured by gloo; nccl ignores them and relies on the connector's strict ordering of each
    pair's transfers.
    """

    def __init__(
        self,
        bind_host: str,
        backend: str = "gloo",
        *,
        group_timeout_s: float = 60.0,
        device: torch.device | None = None,
    ) -> None:
        if backend not in BACKENDS:
            raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
        self.backend = backend
        self._bind_host = bind_host
        self._timeout = datetime.timedelta(seconds=group_timeout_s)
        # NOTE: resolved here, on the owner's thread: a bare "cuda" on the build thread would be its cuda:0
        self._device = indexed_device(device) if device is not None else torch.device("cpu")
        self._lock = threading.Lock()
        self._links: dict[PeerId, RendezvousLink] = {}
        self._pairs: dict[tuple[PeerId, PeerId], _Pair] = {}
        self._floor: dict[tuple[PeerId, PeerId], int] = {}  # least generation after a pair was dropped

    @property
    def is_nccl(self) -> bool:
        return self.backend == "nccl"

    def use_link(self, link: RendezvousLink) -> None:
        with self._lock:
            self._links[link.me] = link

    def staging_device(self, kv_device: torch.device) -> torch.device:
        if self.is_nccl:
            if kv_device.type != "cuda":
                raise TransferError("the nccl backend needs the KV cache on a CUDA device")
            return kv_device
        return torch.device("cpu")

    # ---- pairs ----------------------------------------------------------------------------------------
    def generation(self, prefill: PeerId, decode: PeerId) -> int:
        with self._lock:
            pair = self._pairs.get((prefill, decode))
            floor = self._floor.get((prefill, decode), 0)
        if pair is None:
            return floor
        return max(floor, pair.key.generation + (pair.error is not None))

    def connect(self, key: PairKey, rank: int) -> PendingOp:
        if rank not in (PREFILL_RANK, DECODE_RANK):
            raise ValueError(f"rank must be {PREFILL_RANK} or {DECODE_RANK}, got {rank}")
        with self._lock:
            current = self._pairs.get(key.ends)
            if current is not None and current.key == key and current.rank == rank:
                return _BuildOp(current)
            last = current.key.generation if current is not None else self._floor.get(key.ends, 0) - 1
            if key.generation <= last:
                raise TransferPairError(
                    f"pair with {key.other(key.ends[rank]).name}: generation {key.generation} is used up "
                    f"(current {last})"
                )
            # NOTE: a new incarnation of a worker replaces the old one: pairs with that are gone with it
            for ends in [e for e in self._pairs if _same_workers(e, key.ends)]:
                del self._pairs[ends]
            pair = _Pair(key, rank)
            self._pairs[key.ends] = pair
            link = self._links.get(key.ends[rank])
        if link is None or link.rank != rank:
            pair.mark_broken(f"{key.ends[rank].name} has no rendezvous link as rank {rank} (use_link)")
            pair.ready.set()
            return _BuildOp(pair)
        store = link.open(key, self._timeout.total_seconds())
        pair.keep.append(store)
        name = f"pair-{pair.peer.worker_id}-{key.generation}"
        threading.Thread(target=self._build, args=(pair, link, store), name=name, daemon=True).start()
        return _BuildOp(pair)

    def drop(self, peer: PeerId) -> None:
        with self._lock:
            for ends in [e for e in self._pairs if peer in e]:
                self._floor[ends] = self._pairs.pop(ends).key.generation + 1

    def pairs(self) -> list[PairKey]:
        """Current pairs (built, being built or broken)."""
        with self._lock:
            return [p.key for p in self._pairs.values()]

    def broken_pairs(self) -> list[PairKey]:
        with self._lock:
            return [p.key for p in self._pairs.values() if p.error is not None]

    def abandon(self, key: PairKey, ops: list[PendingOp]) -> None:
        # NOTE: an nccl op cannot be cancelled: a communicator with one stuck is unusable. gloo's abandoned
        # ops are waited on by their lane and end when their match comes or the group times them out.
        if self.is_nccl and any(not op.is_done() for op in ops):
            with self._lock:
                pair = self._pairs.get(key.ends)
            if pair is not None and pair.key == key:
                pair.mark_broken("a transfer gave up with nccl ops in flight")

    def close(self) -> None:
        with self._lock:
            self._pairs.clear()

    def _build(self, pair: _Pair, link: RendezvousLink, store: LinkStore) -> None:
        """Rendezvous over the link, then one warm-up send (prefill) / recv (decode) of the generation.

        NOTE: with nccl the warm-up runs on a stream of its own and is polled until the group's timeout
        (`_PolledOp`): `work.wait()` before completion would make this thread's current stream, the
        default one the engine's forward runs on, wait for the peer, and `torch.cuda.synchronize` would
        wait for the whole device, the engine's forward included. Only the probe's stream is synchronized.
        """
        try:
            timeout_s = self._timeout.total_seconds()
            group = build_group(store, "", pair.rank, self.backend, self._bind_host, timeout_s, self._device)
            stream = torch.cuda.Stream(self._device) if self._device.type == "cuda" else None
            with on_stream(stream):
                probe = torch.full((1,), pair.key.generation, dtype=torch.int64, device=self._device)
                if pair.rank == PREFILL_RANK:
                    work = group.send([probe], pair.peer_rank, 0)
                else:
                    probe.fill_(-1)
                    work = group.recv([probe], pair.peer_rank, 0)
                if self.is_nccl:
                    what = f"warm-up with {pair.peer.name}"
                    _PolledOp(work, probe, what, pair.mark_broken, group).wait(self._timeout.total_seconds())
                else:
                    work.wait()  # NOTE: on this helper thread, bounded by the group's timeout
                carried = int(probe.item())  # NOTE: syncs the probe's stream only
            if carried != pair.key.generation:
                raise TransferPairError(f"warm-up carried {carried}, not {pair.key.generation}")
            pair.group = group
        except Exception as e:  # noqa: BLE001 (the pair is marked broken and the error reported to its users)
            pair.mark_broken(f"building the pair failed: {type(e).__name__}: {e}")
        finally:
            pair.ready.set()
            link.close(store)  # NOTE: after `ready`: it wakes the side's thread, which then sees it

    # ---- ops ------------------------------------------------------------------------------------------
    def _usable(self, key: PairKey) -> _Pair:
        with self._lock:
            pair = self._pairs.get(key.ends)
        if pair is None or pair.key != key:
            raise TransferPairError(f"pair {key} is not current")
        if not pair.ready.is_set() or pair.group is None or pair.error is not None:
            raise TransferPairError(f"pair {key} is not usable: {pair.error or 'not built yet'}")
        return pair

    def isend(self, buf: torch.Tensor, key: PairKey, tag: int, lane: OpLane | None = None) -> PendingOp:
        pair = self._usable(key)
        flat = _as_bytes(buf)
        what = f"send {flat.numel()} B to {pair.peer.name}"
        group, peer_rank = pair.group, pair.peer_rank
        if lane is not None and not self.is_nccl:
            # NOTE: posting a gloo send writes what fits of it into the socket in the posting thread (after
            # waiting for the pair's lock, held while the pair reads). Posted from the lane's thread, it
            # leaves the caller free to prepare the next chunk meanwhile.
            post = lambda: group.send([flat], peer_rank, tag)  # noqa: E731
            return _GlooOp(None, what, lane, post, pair.mark_broken, pair)
        return self._op(pair, lambda: group.send([flat], peer_rank, tag), flat, what, lane)

    def irecv(self, buf: torch.Tensor, key: PairKey, tag: int, lane: OpLane | None = None) -> PendingOp:
        pair = self._usable(key)
        flat = _as_bytes(buf)
        what = f"recv {flat.numel()} B from {pair.peer.name}"
        group, peer_rank = pair.group, pair.peer_rank
        return self._op(pair, lambda: group.recv([flat], peer_rank, tag), flat, what, lane)

    def _op(self, pair: _Pair, post: Any, flat: torch.Tensor, what: str, lane: OpLane | None) -> PendingOp:
        try:
            work = post()
        except Exception as e:
            pair.mark_broken(f"{what}: {e}")
            raise TransferPairError(f"{what}: {e}") from e
        if self.is_nccl:
            return _PolledOp(work, flat, what, pair.mark_broken, pair)
        return _GlooOp(work, what, lane, None, pair.mark_broken, pair)


def build_group(
    store: Any,
    prefix: str,
    rank: int,
    backend: str,
    bind_host: str,
    timeout_s: float,
    device: torch.device | None = None,
    size: int = 2,
) -> Any:
    """A standalone group of ``size`` ranks (two: a pair's; a tensor-parallel worker's ranks build theirs
    with it too) (``ProcessGroupGloo`` / ``ProcessGroupNCCL``) over ``store`` (a
    ``dist.Store``: a pair's `LinkStore`; or the (host, port) of a TCPStore the bench tools host for the
    raw groups they build, never a cluster's), under ``prefix`` if one is given; returns once both ranks joined (gloo) or at once (nccl:
    lazily, on the first op). gloo's sockets listen on ``bind_host`` only. An nccl group first sets
    `NCCL_ENV_DEFAULTS`; a ``device`` without an index is the calling thread's current device. The caller
    keeps a Python store alive as long as the group (torch calls back into it)."""
    import torch.distributed as dist

    timeout = datetime.timedelta(seconds=timeout_s)
    client: Any = store
    if isinstance(store, tuple):
        client = dist.TCPStore(store[0], store[1], None, False, timeout)
    if prefix:
        client = dist.PrefixStore(prefix, client)
    if backend == "nccl":
        if device is not None:
            torch.cuda.set_device(indexed_device(device))
        set_nccl_env_defaults()
        nccl_options = dist.ProcessGroupNCCL.Options()
        nccl_options._timeout = timeout
        return dist.ProcessGroupNCCL(client, rank, size, nccl_options)
    options = dist.ProcessGroupGloo._Options()  # type: ignore[attr-defined]
    options._timeout = timeout
    options._devices = [dist.ProcessGroupGloo.create_device(hostname=bind_host)]
    options._threads = 1  # NOTE: gloo's threads run concurrent ops; a pair's and a rank's run one by one
    return dist.ProcessGroupGloo(client, rank, size, options)


def _same_workers(a: tuple[PeerId, PeerId], b: tuple[PeerId, PeerId]) -> bool:
    """Two different pairs of the same two workers (one end is another incarnation)."""
    return a != b and all(x.worker_id == y.worker_id for x, y in zip(a, b, strict=True))
