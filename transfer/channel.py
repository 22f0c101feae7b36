"""Channels: move ONE contiguous staging tensor to or from the other end of a pair, every wait bounded.

`PairChannel` (transfer/pairs.py) gives each prefill/decode pair its own two-rank torch.distributed
group (gloo on CPU, nccl between GPUs). `CudaIpcChannel` is for a prefill and a decode process that share
one GPU (two NCCL ranks cannot): the sender exports its staging buffer as a CUDA IPC handle, sent as
msgpack bytes over ZMQ, and the receiver copies out of it. The connector orders transfers by its
handshake, so a channel only has to move bytes; each transfer carries its own tag.

A channel is used by one transfer thread (it is not thread-safe). The chunked staging (gather,
checksum, scatter) lives in transfer/staging.py.
"""

from __future__ import annotations

import threading
import time
from abc import ABC, abstractmethod
from collections import deque
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

import msgpack
import torch
import zmq

if TYPE_CHECKING:
    from transfer.kv_source import KvSource

from transfer.peers import PairKey, PeerId
from transfer.protocol import KVLayout, TransferError, TransferTimeoutError
from transfer.rendezvous import RendezvousLink

# NOTE: a CudaIpcChannel message names a buffer (~300 B of msgpack); its socket drops anything larger unread
MAX_IPC_MESSAGE_BYTES = 64 << 10
TORCH_DTYPES = {
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "float8_e4m3fn": torch.float8_e4m3fn,
    "float8_e5m2": torch.float8_e5m2,
    "uint8": torch.uint8,
}


def layout_of(kv: torch.Tensor | KvSource) -> KVLayout:
    """The layout of a ``[num_layers, num_blocks, 2, block_size, num_kv_heads, head_dim]`` KV cache (a
    tensor, or a `KvSource`: a tensor-parallel worker's, every head)."""
    if len(kv.shape) != 6 or kv.shape[2] != 2:
        raise TransferError(
            f"KV cache must be [L, num_blocks, 2, block_size, heads, dim], got {list(kv.shape)}"
        )
    if isinstance(kv, torch.Tensor) and not kv.is_contiguous():
        raise TransferError("KV cache must be contiguous")
    dtype = str(kv.dtype).removeprefix("torch.")
    return KVLayout(int(kv.shape[0]), int(kv.shape[3]), int(kv.shape[4]), int(kv.shape[5]), dtype)


class PendingOp(ABC):
    """A posted send or recv; `wait` returns when it completed or raises TransferTimeoutError.

    After a TransferTimeoutError the op is still pending and `wait` may be called again (the connector
    waits in short slices so it can notice a dropped peer in between).
    """

    @abstractmethod
    def wait(self, timeout_s: float) -> None: ...

    def is_done(self) -> bool:
        """Whether the op completed (or failed), without waiting; channels that cannot tell say False."""
        return False


class OpLane:
    """The ops of one transfer: a channel that needs a helper thread to wait (gloo) waits them in posting
    order on ONE thread, started when an op is added and ended once none was left for `linger_s`.

    NOTE: a chunked transfer posts dozens of ops; one thread each would be as many threads per transfer,
    and, for an op towards a dead peer that never completes, as many left behind. Per lane at most one
    thread ever waits, so an abandoned transfer leaves at most one thread, which ends when gloo fails the
    op (the peer's socket closed, or the process-group timeout). The thread lingers `linger_s` between ops
    because a transfer's ring often waits for one op before it adds the next (starting a thread per op was
    ~8% of the sender thread's py-spy samples), but not much longer: every transfer has its own lanes.
    """

    def __init__(self, name: str, linger_s: float = 0.05) -> None:
        self.name = name
        self.linger_s = linger_s
        self._cond = threading.Condition(threading.Lock())
        self._queue: deque[_GlooOp] = deque()
        self._is_running = False

    def add(self, op: _GlooOp) -> None:
        with self._cond:
            self._queue.append(op)
            if self._is_running:
                self._cond.notify()
                return
            self._is_running = True
        threading.Thread(target=self._run, name=f"lane-{self.name}", daemon=True).start()

    def _run(self) -> None:
        while True:
            with self._cond:
                if not self._queue:
                    self._cond.wait(self.linger_s)
                if not self._queue:
                    self._is_running = False
                    return
                op = self._queue.popleft()
            op.run()


class Channel(ABC):
    """Moves a contiguous tensor to or from the other end of a pair (`PairKey`): the side that connected
    the pair as `rank` talks to rank ``1 - rank``. Buffers must stay alive until `wait` returned.

    `connect` must be called by both ends of a pair (at the generation they agreed on) before its first
    op; `generation` says which one to ask for. `lane` groups the ops of one transfer (see OpLane);
    channels that wait without threads ignore it. Channels without pairs keep the defaults.
    """

    backend: str = ""

    @abstractmethod
    def staging_device(self, kv_device: torch.device) -> torch.device:
        """Where the staging buffer for a KV cache on `kv_device` must live for this channel."""

    def generation(self, prefill: PeerId, decode: PeerId) -> int:
        """The least generation a new transfer between the two may use (the current pair's, or the next
        one if that pair is broken)."""
        return 0

    def connect(self, key: PairKey, rank: int) -> PendingOp:
        """Join the pair `key` as `rank` (a no-op if it is the current one); the op completes when the
        pair can carry ops, or raises TransferPairError."""
        return _DoneOp()

    @abstractmethod
    def isend(self, buf: torch.Tensor, key: PairKey, tag: int, lane: OpLane | None = None) -> PendingOp: ...

    @abstractmethod
    def irecv(self, buf: torch.Tensor, key: PairKey, tag: int, lane: OpLane | None = None) -> PendingOp: ...

    def send(self, buf: torch.Tensor, key: PairKey, tag: int, timeout_s: float) -> None:
        self.isend(buf, key, tag).wait(timeout_s)

    def recv(self, buf: torch.Tensor, key: PairKey, tag: int, timeout_s: float) -> None:
        self.irecv(buf, key, tag).wait(timeout_s)

    def abandon(self, key: PairKey, ops: list[PendingOp]) -> None:  # noqa: B027 (optional hook)
        """A transfer on `key` gave up; some of its `ops` may never complete."""

    def drop(self, peer: PeerId) -> None:  # noqa: B027 (optional hook)
        """`peer` is dead: forget every pair with it."""

    def broken_pairs(self) -> list[PairKey]:
        """Current pairs that must be rebuilt before their next use."""
        return []

    def close(self) -> None:  # noqa: B027 (optional hook)
        """Release sockets and process groups."""

    def use_link(self, link: RendezvousLink) -> None:  # noqa: B027 (optional hook)
        """The rendezvous link of a side that moves KV over this channel (``link.me``): PairChannel builds
        that side's pairs over it (transfer/rendezvous.py)."""


def _as_bytes(buf: torch.Tensor) -> torch.Tensor:
    if not buf.is_contiguous():
        raise TransferError("channel buffers must be contiguous")
    return buf.view(-1).view(torch.uint8)


class _DoneOp(PendingOp):
    def is_done(self) -> bool:
        return True

    def wait(self, timeout_s: float) -> None:
        return None


class _GlooOp(PendingOp):
    """Waits on a gloo Work from a helper thread; a failed op calls `on_error` (the pair is broken).

    NOTE: `Work.wait(timeout)` on gloo closes the whole TCP pair when it times out ("Application timeout
    caused pair closure"), which would kill every later transfer between the two ranks. So the blocking
    wait runs in a daemon thread and the caller waits on an Event instead. On timeout the op is abandoned:
    the thread (and through it the buffer) stays alive until the peer's matching op arrives, and the
    unique per-transfer tag keeps that late op from matching anything else. Only an op whose peer never
    comes (a dead process) stays pending, and gloo closes the pair at the process-group timeout.
    `keep` is held until the op ends (the pair's group: gloo's buffers point into it).
    """

    def __init__(
        self,
        work: Any,
        what: str,
        lane: OpLane | None,
        post: Callable[[], Any] | None = None,
        on_error: Callable[[str], None] | None = None,
        keep: Any = None,
    ) -> None:
        self._work = work
        self._post = post  # NOTE: if set, the waiting thread posts the op first (see PairChannel.isend)
        self._on_error = on_error
        self._keep = keep
        self._what = what
        self._done = threading.Event()
        self._error: Exception | None = None
        if lane is None:
            threading.Thread(target=self.run, name=f"gloo-{what}", daemon=True).start()
        else:
            lane.add(self)

    def run(self) -> None:
        try:
            if self._post is not None:
                self._work = self._post()
                if self._work is None:
                    raise TransferError("this rank is not in the channel's process group")
            self._work.wait()
        except Exception as e:  # noqa: BLE001 (re-raised as TransferError by wait())
            self._error = e
            if self._on_error is not None:
                self._on_error(f"{self._what} failed: {e}")
        finally:
            self._work = self._keep = None
            self._done.set()

    def is_done(self) -> bool:
        return self._done.is_set()

    def wait(self, timeout_s: float) -> None:
        if not self._done.wait(max(timeout_s, 0.0)):
            raise TransferTimeoutError(f"{self._what} did not complete within {timeout_s:.3f}s")
        if self._error is not None:
            raise TransferError(f"{self._what} failed: {self._error}") from self._error


class _PolledOp(PendingOp):
    """Waits on a Work by polling `is_completed()` (nccl: queries the CUDA event, never blocks)."""

    def __init__(
        self, work: Any, buf: torch.Tensor, what: str, on_error: Callable[[str], None], keep: Any
    ) -> None:
        self._work = work
        self._buf = buf  # NOTE: keeps the buffer alive while the collective may still write it
        self._keep = keep  # and the pair's group
        self._on_error = on_error
        self._what = what

    def is_done(self) -> bool:
        return bool(self._work.is_completed())

    def wait(self, timeout_s: float) -> None:
        deadline = time.monotonic() + max(timeout_s, 0.0)
        pause = 20e-6
        while not self._work.is_completed():
            if time.monotonic() >= deadline:
                # NOTE: an nccl op cannot be cancelled; the communicator is unusable after this.
                raise TransferTimeoutError(f"{self._what} did not complete within {timeout_s:.3f}s")
            time.sleep(pause)
            pause = min(pause * 2, 2e-3)
        try:
            self._work.wait()
        except Exception as e:
            self._on_error(f"{self._what} failed: {e}")
            raise TransferError(f"{self._what} failed: {e}") from e


class CudaIpcChannel(Channel):
    """Same-GPU channel: the staging buffer travels as a CUDA IPC handle over ZMQ (PUSH/PULL, msgpack).

    Each peer binds a PULL socket at `endpoints[its name]` and pushes to the other end's. `send` names the
    bytes (an exported buffer, an offset, a length) and returns once the receiver said it has copied them
    out (so the caller may reuse or free them); `recv` waits for that, copies into `buf` on the caller's
    current stream, synchronizes that stream, and answers.

    NOTE: a buffer is exported once (`reduce_tensor` makes a shared-memory record per call, freed only
    with the buffer) and opened once by the peer (opening an IPC handle costs milliseconds); both sides
    keep the last `_MAX_EXPORTS` buffers per peer, which keeps each alive until it falls out.
    """

    _MAX_STASH = 64
    _MAX_EXPORTS = 4

    def __init__(
        self, me: PeerId, endpoints: Mapping[str, str], zmq_context: zmq.Context[Any] | None = None
    ) -> None:
        self.me = me
        self.backend = "cuda_ipc"
        self._endpoints = dict(endpoints)
        self._ctx = zmq_context or zmq.Context.instance()
        self._pull = self._ctx.socket(zmq.PULL)
        self._pull.setsockopt(zmq.LINGER, 0)
        self._pull.setsockopt(zmq.MAXMSGSIZE, MAX_IPC_MESSAGE_BYTES)
        self._pull.bind(self._endpoints[me.name])
        self._push: dict[str, zmq.Socket[Any]] = {}
        self._stash: dict[tuple[str, str, int], dict[str, Any]] = {}
        self._exports: dict[int, tuple[torch.UntypedStorage, dict[str, Any]]] = {}  # by storage address
        self._imports: dict[tuple[str, bytes, int], torch.Tensor] = {}  # by (src, handle, offset)

    def staging_device(self, kv_device: torch.device) -> torch.device:
        if kv_device.type != "cuda":
            raise TransferError("CudaIpcChannel needs the KV cache on a CUDA device")
        return kv_device

    def _export(self, flat: torch.Tensor) -> dict[str, Any]:
        """The IPC handle of the whole storage under `flat`, made on its first send only."""
        storage = flat.untyped_storage()
        cached = self._exports.get(storage.data_ptr())
        if cached is not None and cached[0].nbytes() == storage.nbytes():
            return cached[1]
        from torch.multiprocessing.reductions import reduce_tensor

        whole = torch.empty(0, dtype=torch.uint8, device=flat.device).set_(storage)
        _, args = reduce_tensor(whole)
        # NOTE: only plain fields go on the wire; the classes and dtype are fixed (uint8 UntypedStorage).
        handle = {
            "numel": int(args[1][0]),
            "device": int(args[6]),
            "handle": bytes(args[7]),
            "storage_size": int(args[8]),
            "storage_offset": int(args[9]),
            "ref_counter_handle": bytes(args[11]),
            "ref_counter_offset": int(args[12]),
            "event_handle": bytes(args[13]) if args[13] is not None else None,
            "event_sync_required": bool(args[14]),
        }
        if len(self._exports) >= self._MAX_EXPORTS:
            self._exports.pop(next(iter(self._exports)))
        self._exports[storage.data_ptr()] = (storage, handle)
        return handle

    def _import(self, src: str, h: dict[str, Any]) -> torch.Tensor:
        """The peer's exported storage as a uint8 tensor, opened on first use."""
        key = (src, bytes(h["handle"]), int(h["storage_offset"]))
        shared = self._imports.get(key)
        if shared is None:
            from torch.multiprocessing.reductions import rebuild_cuda_tensor

            shared = rebuild_cuda_tensor(
                torch.Tensor, (h["numel"],), (1,), 0, torch.UntypedStorage, torch.uint8,
                h["device"], h["handle"], h["storage_size"], h["storage_offset"], False,
                h["ref_counter_handle"], h["ref_counter_offset"], h["event_handle"], h["event_sync_required"],
            )  # fmt: skip
            if len(self._imports) >= self._MAX_EXPORTS:
                self._imports.pop(next(iter(self._imports)))
            self._imports[key] = shared
        return shared

    def isend(self, buf: torch.Tensor, key: PairKey, tag: int, lane: OpLane | None = None) -> PendingOp:
        flat = _as_bytes(buf)
        if flat.numel() == 0:
            return _CallbackOp(lambda timeout_s: None)
        dst = key.other(self.me).name
        # NOTE: the caller's current stream (the side's own) holds the writes of these bytes
        torch.cuda.current_stream(flat.device).synchronize()
        msg = {"kind": "handle", "src": self.me.name, "tag": tag, "ipc": self._export(flat)}
        self._push_to(dst, {**msg, "offset": flat.storage_offset(), "nbytes": flat.numel()})
        what = f"ipc send {flat.numel()} B to {dst}"
        return _CallbackOp(lambda timeout_s: self._await(("copied", dst, tag), timeout_s, what, flat))

    def irecv(self, buf: torch.Tensor, key: PairKey, tag: int, lane: OpLane | None = None) -> PendingOp:
        flat = _as_bytes(buf)
        if flat.numel() == 0:
            return _CallbackOp(lambda timeout_s: None)
        src = key.other(self.me).name
        what = f"ipc recv {flat.numel()} B from {src}"

        def finish(timeout_s: float) -> None:
            msg = self._await(("handle", src, tag), timeout_s, what, flat)
            offset, nbytes = int(msg["offset"]), int(msg["nbytes"])
            shared = self._import(src, msg["ipc"])
            if nbytes != flat.numel() or not 0 <= offset <= shared.numel() - nbytes:
                raise TransferError(f"{what}: peer sent {nbytes} B at offset {offset} of {shared.numel()}")
            flat.copy_(shared[offset : offset + nbytes])
            torch.cuda.current_stream(flat.device).synchronize()
            self._push_to(src, {"kind": "copied", "src": self.me.name, "tag": tag})

        return _CallbackOp(finish)

    def _push_to(self, peer: str, msg: dict[str, Any]) -> None:
        sock = self._push.get(peer)
        if sock is None:
            sock = self._ctx.socket(zmq.PUSH)
            sock.setsockopt(zmq.LINGER, 0)
            sock.connect(self._endpoints[peer])
            self._push[peer] = sock
        sock.send(msgpack.packb(msg, use_bin_type=True))

    def _await(
        self, key: tuple[str, str, int], timeout_s: float, what: str, keep_alive: torch.Tensor
    ) -> dict[str, Any]:
        deadline = time.monotonic() + max(timeout_s, 0.0)
        while key not in self._stash:
            left_ms = int((deadline - time.monotonic()) * 1000)
            if left_ms <= 0:
                raise TransferTimeoutError(f"{what} did not complete within {timeout_s:.3f}s")
            if self._pull.poll(min(left_ms, 100)):
                msg = msgpack.unpackb(self._pull.recv(), raw=False)
                if len(self._stash) >= self._MAX_STASH:  # stale frames of abandoned transfers
                    self._stash.pop(next(iter(self._stash)))
                self._stash[(msg["kind"], msg["src"], msg["tag"])] = msg
        del keep_alive
        return self._stash.pop(key)

    def close(self) -> None:
        for sock in (*self._push.values(), self._pull):
            sock.close(linger=0)
        self._push.clear()
        self._exports.clear()
        self._imports.clear()


class _CallbackOp(PendingOp):
    def __init__(self, fn: Callable[[float], Any]) -> None:
        self._fn = fn

    def wait(self, timeout_s: float) -> None:
        self._fn(timeout_s)
