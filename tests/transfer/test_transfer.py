"""KV transfer over gloo between real processes: byte identity, skips, ordering, and every failure.

The test process drives a prefill process (process 0, KVSenders) and a decode process (process 1,
KVReceivers) like a router would: it asks process 0 to offer a request,
hands the KVHandoff to process 1, and checks the KV bytes process 1 ends up with against the same seeded
tensors rebuilt here. Each side is its own peer (worker id = the side's name), so each sender/receiver
couple builds its own pair (a two-rank gloo group, its rendezvous over their handshake link) on its first
transfer.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import queue
import threading
import time
import traceback
from collections.abc import Iterator
from typing import Any

import msgpack
import pytest
import torch
import zmq

from cluster.frames import FrameSigner, new_secret
from tests.support.cluster_utils import wait_for
from transfer.channel import TORCH_DTYPES, Channel, CudaIpcChannel, OpLane, PendingOp
from transfer.digest import DEVICE_CHECKSUM_SCHEME
from transfer.handshake import HandshakeFrames, MessageKind
from transfer.peers import PairKey, PeerId
from transfer.protocol import (
    KVHandoff,
    KVLayout,
    TransferError,
    TransferRequest,
    TransferTimeoutError,
    handoff_from_dict,
    to_dict,
)
from transfer.rendezvous import RendezvousLink
from transfer.side import DEFAULT_CHUNK_BYTES, NUM_SLOTS
from transfer.staging import TRAILER_BYTES

NUM_LAYERS, NUM_BLOCKS, BLOCK_SIZE, NUM_HEADS, HEAD_DIM = 2, 32, 4, 2, 8
SRC_SEED, DST_SEED = 1, 2
REPLY_TIMEOUT_S = 30.0
STARTUP_TIMEOUT_S = 180.0  # NOTE: far more than on a quiet box (~5 s); the CI box may be loaded
ROW_BYTES_F32 = 2 * BLOCK_SIZE * NUM_HEADS * HEAD_DIM * 4


def make_kv(seed: int, dtype: str, head_dim: int = HEAD_DIM) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    shape = (NUM_LAYERS, NUM_BLOCKS, 2, BLOCK_SIZE, NUM_HEADS, head_dim)
    return torch.randn(shape, generator=g).to(TORCH_DTYPES[dtype])


def as_bytes(kv: torch.Tensor) -> torch.Tensor:
    """[L, num_blocks, -1] uint8 view: block-wise byte comparison for any dtype."""
    return kv.reshape(kv.shape[0], kv.shape[1], -1).view(torch.uint8)


class Faults:
    """One process's fault plan, shared by its channels: an armed fault applies to one send, the
    `after`-th from now (0: the next). "stall" never sends the bytes; "blackhole" never sends and never
    completes (a peer that stopped draining); "corrupt" flips one byte after the chunk was sealed; "swap"
    exchanges two byte ranges of the payload (args: offset a, offset b, length); "record" keeps a copy of
    the bytes it sends; "replay" sends the recorded bytes instead. `fired` is set when a fault was
    applied; `note` says what it did ("swap": whether the ranges differed, "replay": whether the recorded
    payload equals the replaced one)."""

    def __init__(self) -> None:
        self.armed: tuple[str, int, tuple[Any, ...]] | None = None
        self.fired = threading.Event()
        self.recorded: torch.Tensor | None = None
        self.note: Any = None
        self.ops: list[PendingOp] = []  # every op posted on a real channel
        self.lock = threading.Lock()

    def arm(self, fault: str, after: int, *args: Any) -> None:
        with self.lock:
            self.armed = (fault, after, args)
            self.fired.clear()

    def take(self) -> tuple[str, tuple[Any, ...]] | None:
        with self.lock:
            if self.armed is None:
                return None
            fault, after, args = self.armed
            self.armed = (fault, after - 1, args) if after else None
            return None if after else (fault, args)

    def posted(self, op: PendingOp) -> PendingOp:
        with self.lock:
            self.ops.append(op)
        return op

    def num_unfinished(self, since: int) -> int:
        with self.lock:
            return sum(not op.is_done() for op in self.ops[since:])


class FaultyChannel(Channel):
    """Wraps a real channel and applies the process's `Faults` to its sends."""

    def __init__(self, inner: Channel, faults: Faults) -> None:
        self.inner = inner
        self.faults = faults
        self.backend = inner.backend

    def staging_device(self, kv_device: torch.device) -> torch.device:
        return self.inner.staging_device(kv_device)

    def generation(self, prefill: PeerId, decode: PeerId) -> int:
        return self.inner.generation(prefill, decode)

    def connect(self, key: PairKey, rank: int) -> PendingOp:
        return self.inner.connect(key, rank)

    def abandon(self, key: PairKey, ops: list[PendingOp]) -> None:
        self.inner.abandon(key, ops)

    def drop(self, peer: PeerId) -> None:
        self.inner.drop(peer)

    def broken_pairs(self) -> list[PairKey]:
        return self.inner.broken_pairs()

    def use_link(self, link: RendezvousLink) -> None:
        self.inner.use_link(link)

    def isend(self, buf: torch.Tensor, key: PairKey, tag: int, lane: OpLane | None = None) -> PendingOp:
        faults = self.faults
        taken = faults.take()
        if taken is None:
            return faults.posted(self.inner.isend(buf, key, tag, lane))
        fault, args = taken
        if fault == "stall":
            faults.fired.set()
            return _NoOp()
        if fault == "blackhole":
            faults.fired.set()
            return _NeverOp()
        flat = buf.view(-1).view(torch.uint8)
        if fault == "corrupt":
            flat = flat.clone()
            flat[flat.numel() // 2] ^= 0x5A
        elif fault == "swap":
            a, b, length = args
            flat = flat.clone()
            first, second = flat[a : a + length].clone(), flat[b : b + length].clone()
            flat[a : a + length], flat[b : b + length] = second, first
            faults.note = not torch.equal(first, second)
        elif fault == "record":
            faults.recorded = flat.clone()
        elif fault == "replay":
            recorded = faults.recorded
            assert recorded is not None and recorded.numel() == flat.numel()
            faults.note = torch.equal(recorded[:-TRAILER_BYTES], flat[:-TRAILER_BYTES])
            flat = recorded
        faults.fired.set()
        return faults.posted(self.inner.isend(flat, key, tag, lane))

    def irecv(self, buf: torch.Tensor, key: PairKey, tag: int, lane: OpLane | None = None) -> PendingOp:
        return self.faults.posted(self.inner.irecv(buf, key, tag, lane))


class _NoOp(PendingOp):
    def wait(self, timeout_s: float) -> None:
        return None


class _NeverOp(PendingOp):
    def wait(self, timeout_s: float) -> None:
        threading.Event().wait(timeout_s)
        raise TransferTimeoutError(f"never completes (waited {timeout_s:.3f}s)")


def _worker(index: int, secret: bytes, commands: Any, replies: Any) -> None:
    """Hosts the KVSenders / KVReceivers it is told to (each its own peer: its name, incarnation
    ``p<index>``); each command is answered with ("ok"|"err", value)."""
    torch.set_num_threads(1)
    from transfer.connector import KVReceiver, KVSender
    from transfer.pairs import PairChannel

    faults = Faults()

    def channel(group_timeout_s: float) -> FaultyChannel:
        return FaultyChannel(PairChannel("127.0.0.1", group_timeout_s=group_timeout_s), faults)

    # NOTE: far beyond the tests: abandoned ops must not expire (and break the pair) unless a test says
    shared = channel(600.0)
    replies.put(("ok", "ready"))
    kvs: dict[str, torch.Tensor] = {}
    sides: dict[str, Any] = {}
    sent: dict[str, bool] = {}
    sent_cond = threading.Condition()
    submitted: dict[str, tuple[Any, float]] = {}

    def outcome(future: Any, t0: float) -> dict[str, Any]:
        try:
            out: dict[str, Any] = {"ok": True, "nbytes": future.result(timeout=60).nbytes}
        except TransferError as e:
            out = {"ok": False, "error_type": type(e).__name__, "error": str(e)}
        out["elapsed"] = time.monotonic() - t0
        return out

    def on_sent(request_id: str, ok: bool) -> None:
        with sent_cond:
            sent[request_id] = ok
            sent_cond.notify_all()

    def handle(cmd: str, *args: Any) -> Any:
        if cmd == "sender":
            name, dtype, *rest = args  # then chunk_bytes, timeout_s, num_slots, group_timeout_s, checksum
            defaults = (DEFAULT_CHUNK_BYTES, 10.0, NUM_SLOTS, None, None)
            chunk_bytes, timeout_s, num_slots, group_timeout_s, checksum = (*rest, *defaults[len(rest) :])
            kvs[name] = make_kv(SRC_SEED, dtype)
            sides[name] = KVSender(
                kvs[name],
                me=PeerId(name, f"p{index}"),
                channel=shared if group_timeout_s is None else channel(group_timeout_s),
                secret=secret,
                on_sent=on_sent,
                timeout_s=timeout_s,
                chunk_bytes=chunk_bytes,
                num_slots=num_slots,
                checksum=checksum,
            )
            sides[name].start()
            return sides[name].endpoint
        if cmd == "receiver":
            name, dtype, head_dim, timeout_s, *rest = args  # then num_slots, group_timeout_s, checksum
            num_slots, group_timeout_s, checksum = (*rest, *(NUM_SLOTS, None, None)[len(rest) :])
            kvs[name] = make_kv(DST_SEED, dtype, head_dim)
            sides[name] = KVReceiver(
                kvs[name],
                me=PeerId(name, f"p{index}"),
                channel=shared if group_timeout_s is None else channel(group_timeout_s),
                secret=secret,
                timeout_s=timeout_s,
                num_slots=num_slots,
                checksum=checksum,
            )
            sides[name].start()
            return None
        if cmd == "offer":  # the caller's list changes after the offer: the sender must not see it
            name, request_id, block_ids, lease_s = args
            handoff = sides[name].offer(request_id, block_ids, len(block_ids) * BLOCK_SIZE, ["ab"], lease_s)
            block_ids[:] = [NUM_BLOCKS - 1] * len(block_ids)
            return to_dict(handoff)
        if cmd == "offer_error":  # -> the exception type name offer raised, or None
            name, request_id, block_ids = args
            try:
                sides[name].offer(request_id, block_ids, 1)
            except Exception as e:  # noqa: BLE001 (reported to the test)
                return type(e).__name__
            return None
        if cmd == "abort":
            return sides[args[0]].abort(args[1])
        if cmd == "fault":  # (name, after=0, *args): see Faults
            faults.arm(args[0], *(args[1:] or (0,)))
            return None
        if cmd == "fault_note":
            return faults.note
        if cmd == "num_ops":  # channel ops posted so far
            return len(faults.ops)
        if cmd == "unfinished_ops":  # of the channel ops posted since the `num_ops` given
            return faults.num_unfinished(args[0])
        if cmd == "wait_fault":  # -> whether the fault was applied within the bound
            return faults.fired.wait(args[0])
        if cmd == "drop_peer":  # (side, worker id, incarnation or None) -> the peer names dropped
            return sorted(p.name for p in sides[args[0]].drop_peer(*args[1:]))
        if cmd == "broken":  # -> the side's broken peers
            return sides[args[0]].broken_peers()
        if cmd == "rejected":  # -> the side's rejected handshake frames, by reason
            return sides[args[0]].rejected_frames()
        if cmd == "submit":  # returns at once; "collect" waits for the outcome
            name, key, handoff, ids = args
            submitted[key] = (sides[name].submit(handoff_from_dict(handoff), ids), time.monotonic())
            return None
        if cmd == "post":  # a fetch sent before the offer, waiting up to wait_s for it (early admission)
            name, key, handoff, ids, wait_s = args
            deadline = time.time() + wait_s
            future = sides[name].submit(
                handoff_from_dict(handoff), ids, deadline=deadline, wait_for_offer=True
            )
            submitted[key] = (future, time.monotonic())
            return None
        if cmd == "is_done":  # -> whether a submitted fetch has its outcome yet
            return submitted[args[0]][0].done()
        if cmd == "cancel":
            return sides[args[0]].cancel(args[1])
        if cmd == "parked":
            return sides[args[0]].num_parked()
        if cmd == "collect":
            return outcome(*submitted.pop(args[0]))
        if cmd == "wait_sent":  # -> on_sent's ok, or None if it did not come within the bound
            request_id, timeout_s = args
            with sent_cond:
                sent_cond.wait_for(lambda: request_id in sent, timeout_s)
                return sent.get(request_id)
        if cmd == "results":
            return [to_dict(r) for r in sides[args[0]].results()]
        if cmd == "held":
            return sides[args[0]].num_held()
        if cmd == "receive":  # jobs: [(handoff, dst_ids, skip)], all submitted before any is awaited
            name, jobs = args
            t0 = time.monotonic()
            futures = [sides[name].submit(handoff_from_dict(h), ids, skip) for h, ids, skip in jobs]
            return [outcome(f, t0) for f in futures]
        if cmd == "kv":
            return as_bytes(kvs[args[0]]).numpy().tobytes()
        raise ValueError(f"unknown command {cmd}")

    while True:
        msg = commands.get(timeout=120)
        if msg[0] == "exit":
            for side in sides.values():
                side.close()
            os._exit(0)  # NOTE: skip gloo teardown, which would wait for the peer
        try:
            replies.put(("ok", handle(*msg)))
        except Exception:  # noqa: BLE001 (the traceback goes to the test process)
            replies.put(("err", traceback.format_exc()))


class Pair:
    """`num_procs` worker processes (2 unless told), driven by commands."""

    def __init__(self, num_procs: int = 2) -> None:
        ctx = mp.get_context("spawn")
        self.secret = new_secret()
        self.endpoints: dict[str, str] = {}  # handshake sockets of the senders the tests kept
        self._queues = [(ctx.Queue(), ctx.Queue()) for _ in range(num_procs)]
        self.procs = [
            ctx.Process(target=_worker, args=(i, self.secret, *self._queues[i]), daemon=True)
            for i in range(num_procs)
        ]
        for p in self.procs:
            p.start()
        for i, (_, replies) in enumerate(self._queues):  # NOTE: spawn + import torch
            try:
                assert replies.get(timeout=STARTUP_TIMEOUT_S) == ("ok", "ready")
            except queue.Empty:
                self.close()
                raise AssertionError(f"process {i} did not start in {STARTUP_TIMEOUT_S}s") from None

    def call(self, index: int, *cmd: Any) -> Any:
        commands, replies = self._queues[index]
        commands.put(cmd)
        try:
            status, value = replies.get(timeout=REPLY_TIMEOUT_S)
        except queue.Empty:
            raise AssertionError(
                f"process {index} gave no answer to {cmd[0]} in {REPLY_TIMEOUT_S}s"
            ) from None
        if status == "err":
            raise AssertionError(f"process {index} failed {cmd[0]}:\n{value}")
        return value

    def kill(self, index: int) -> None:
        self.procs[index].kill()
        self.procs[index].join(10)

    def close(self) -> None:
        for commands, p in zip((q for q, _ in self._queues), self.procs, strict=True):
            if p.is_alive():
                commands.put(("exit",))
        for p in self.procs:
            p.join(10)
        for p in self.procs:
            if p.is_alive():
                p.terminate()
                p.join(5)


@pytest.fixture(scope="module")
def pair() -> Iterator[Pair]:
    os.environ["OMP_NUM_THREADS"] = "1"
    p = Pair()
    try:
        for dtype in ("float32", "bfloat16"):
            p.endpoints[f"S-{dtype}"] = p.call(0, "sender", f"S-{dtype}", dtype)
        p.call(1, "receiver", "R-bfloat16", "bfloat16", HEAD_DIM, 10.0)
        # NOTE: 4 slots (a credit every 2 chunks) against S-chunked's 3: the sides' rings differ
        p.call(1, "receiver", "R-float32", "float32", HEAD_DIM, 10.0, 4)
        # NOTE: 3 rows per chunk: a 4-block transfer of 2 layers is 3 chunks, one across the layer edge
        p.call(0, "sender", "S-chunked", "float32", 3 * ROW_BYTES_F32, 10.0, 3)
        yield p
    finally:
        p.close()


_ids = iter(range(1_000_000))


def new_id(prefix: str) -> str:
    return f"{prefix}-{next(_ids)}"


def read_kv(pair: Pair, index: int, name: str, like: torch.Tensor) -> torch.Tensor:
    raw = pair.call(index, "kv", name)
    return torch.frombuffer(bytearray(raw), dtype=torch.uint8).view(as_bytes(like).shape)


def check_blocks(before: torch.Tensor, after: torch.Tensor, dtype: str, moved: dict[int, int]) -> None:
    """`moved` maps dst block id -> src block id; every other dst block must be unchanged."""
    src = as_bytes(make_kv(SRC_SEED, dtype))
    for dst_id, src_id in moved.items():
        assert torch.equal(after[:, dst_id], src[:, src_id]), f"dst block {dst_id} != src block {src_id}"
    untouched = [b for b in range(NUM_BLOCKS) if b not in moved]
    assert torch.equal(after[:, untouched], before[:, untouched])


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_noncontiguous_blocks_arrive_byte_identical(pair: Pair, dtype: str) -> None:
    like = make_kv(DST_SEED, dtype)
    before = read_kv(pair, 1, f"R-{dtype}", like)
    rid = new_id("req")
    src_ids, dst_ids = [3, 17, 5, 30], [8, 2, 25, 11]
    handoff = pair.call(0, "offer", f"S-{dtype}", rid, src_ids, None)
    assert handoff["num_blocks"] == 4 and handoff["layout"]["dtype"] == dtype
    assert (handoff["src_worker_id"], handoff["src_incarnation"]) == (f"S-{dtype}", "p0")
    [out] = pair.call(1, "receive", f"R-{dtype}", [(handoff, dst_ids, 0)])
    block_bytes = KVLayout(NUM_LAYERS, BLOCK_SIZE, NUM_HEADS, HEAD_DIM, dtype).bytes_per_block
    assert out["ok"] and out["nbytes"] == 4 * block_bytes
    assert pair.call(0, "wait_sent", rid, 10.0) is True
    check_blocks(
        before, read_kv(pair, 1, f"R-{dtype}", like), dtype, dict(zip(dst_ids, src_ids, strict=True))
    )
    [sender_side] = [r for r in pair.call(0, "results", f"S-{dtype}") if r["request_id"] == rid]
    assert sender_side["ok"] and sender_side["nbytes"] == 4 * block_bytes and sender_side["num_blocks"] == 4
    assert pair.call(0, "held", f"S-{dtype}") == 0


def test_skip_first_n_blocks_moves_only_the_tail(pair: Pair) -> None:
    like = make_kv(DST_SEED, "float32")
    before = read_kv(pair, 1, "R-float32", like)
    rid, full_hit = new_id("skip"), new_id("skip")
    src_ids = [4, 9, 6, 12, 20]
    handoff = pair.call(0, "offer", "S-float32", rid, src_ids, None)
    hit_handoff = pair.call(0, "offer", "S-float32", full_hit, [21, 22], None)
    outs = pair.call(1, "receive", "R-float32", [(handoff, [7, 1, 9], 2), (hit_handoff, [], 2)])
    block_bytes = KVLayout(NUM_LAYERS, BLOCK_SIZE, NUM_HEADS, HEAD_DIM, "float32").bytes_per_block
    assert [(o["ok"], o["nbytes"]) for o in outs] == [(True, 3 * block_bytes), (True, 0)]
    check_blocks(before, read_kv(pair, 1, "R-float32", like), "float32", {7: 6, 1: 12, 9: 20})
    assert pair.call(0, "wait_sent", rid, 10.0) is True
    assert pair.call(0, "wait_sent", full_hit, 10.0) is True


def test_transfers_in_a_row_and_interleaved_keep_order(pair: Pair) -> None:
    like = make_kv(DST_SEED, "bfloat16")
    before = read_kv(pair, 1, "R-bfloat16", like)
    rids = [new_id("row") for _ in range(4)]
    src = {rids[0]: [1, 2], rids[1]: [10, 3, 31], rids[2]: [7], rids[3]: [15, 16, 14, 13]}
    dst = {rids[0]: [30, 29], rids[1]: [3, 4, 5], rids[2]: [12], rids[3]: [20, 22, 21, 19]}
    handoffs = {r: pair.call(0, "offer", "S-bfloat16", r, src[r], None) for r in rids}
    # offered 0,1,2,3; fetched 2,0 in one batch of concurrent submits, then 3, then 1
    first = pair.call(1, "receive", "R-bfloat16", [(handoffs[r], dst[r], 0) for r in (rids[2], rids[0])])
    second = pair.call(1, "receive", "R-bfloat16", [(handoffs[rids[3]], dst[rids[3]], 0)])
    third = pair.call(1, "receive", "R-bfloat16", [(handoffs[rids[1]], dst[rids[1]], 0)])
    assert all(o["ok"] for o in first + second + third), first + second + third
    moved = {d: s for r in rids for d, s in zip(dst[r], src[r], strict=True)}
    check_blocks(before, read_kv(pair, 1, "R-bfloat16", like), "bfloat16", moved)
    assert all(
        pair.call(0, "wait_sent", r, 10.0) is True for r in rids
    )  # NOTE: the sender records after DONE
    order = [r["request_id"] for r in pair.call(0, "results", "S-bfloat16") if r["request_id"] in rids]
    assert order == [rids[2], rids[0], rids[3], rids[1]]


def test_header_mismatch_fails_both_sides_and_the_pair_still_works(pair: Pair) -> None:
    pair.call(1, "receiver", "R-narrow", "float32", HEAD_DIM // 2, 10.0)  # same dtype, other head_dim
    rid = new_id("mismatch")
    handoff = pair.call(0, "offer", "S-float32", rid, [2, 3], None)
    [out] = pair.call(1, "receive", "R-narrow", [(handoff, [5, 6], 0)])
    assert not out["ok"] and out["error_type"] == "TransferMismatchError" and "layout" in out["error"]
    assert pair.call(0, "wait_sent", rid, 10.0) is False
    [sender_side] = [r for r in pair.call(0, "results", "S-float32") if r["request_id"] == rid]
    assert sender_side["error_type"] == "TransferMismatchError"

    # block-count mismatch: 3 destination blocks for a 2-block request
    rid2 = new_id("mismatch")
    handoff2 = pair.call(0, "offer", "S-float32", rid2, [2, 3], None)
    [out2] = pair.call(1, "receive", "R-float32", [(handoff2, [5, 6, 7], 0)])
    assert not out2["ok"] and out2["error_type"] == "TransferMismatchError" and "num_blocks" in out2["error"]
    assert pair.call(0, "wait_sent", rid2, 10.0) is False

    like = make_kv(DST_SEED, "float32")
    before = read_kv(pair, 1, "R-float32", like)
    rid3 = new_id("after-mismatch")
    handoff3 = pair.call(0, "offer", "S-float32", rid3, [2, 3], None)
    [out3] = pair.call(1, "receive", "R-float32", [(handoff3, [5, 6], 0)])
    assert out3["ok"]
    check_blocks(before, read_kv(pair, 1, "R-float32", like), "float32", {5: 2, 6: 3})


def test_stalled_sender_times_out_within_bound(pair: Pair) -> None:
    timeout_s = 1.5
    pair.call(1, "receiver", "R-impatient", "float32", HEAD_DIM, timeout_s)
    like = make_kv(DST_SEED, "float32")
    before = read_kv(pair, 1, "R-impatient", like)
    rid = new_id("stall")
    handoff = pair.call(0, "offer", "S-float32", rid, [4, 5, 6], None)
    pair.call(0, "fault", "stall")
    [out] = pair.call(1, "receive", "R-impatient", [(handoff, [9, 10, 11], 0)])
    assert not out["ok"] and out["error_type"] == "TransferTimeoutError"
    assert out["elapsed"] < timeout_s + 5.0
    assert torch.equal(read_kv(pair, 1, "R-impatient", like), before)
    assert pair.call(0, "wait_sent", rid, 10.0) is False
    [sender_side] = [r for r in pair.call(0, "results", "S-float32") if r["request_id"] == rid]
    assert sender_side["error_type"] == "TransferTimeoutError"

    rid2 = new_id("after-stall")
    handoff2 = pair.call(0, "offer", "S-float32", rid2, [4, 5, 6], None)
    [out2] = pair.call(1, "receive", "R-impatient", [(handoff2, [9, 10, 11], 0)])
    assert out2["ok"]
    check_blocks(before, read_kv(pair, 1, "R-impatient", like), "float32", {9: 4, 10: 5, 11: 6})


def test_corrupted_bytes_fail_the_checksum_and_are_not_scattered(pair: Pair) -> None:
    like = make_kv(DST_SEED, "bfloat16")
    before = read_kv(pair, 1, "R-bfloat16", like)
    rid = new_id("corrupt")
    handoff = pair.call(0, "offer", "S-bfloat16", rid, [8, 9], None)
    pair.call(0, "fault", "corrupt")
    [out] = pair.call(1, "receive", "R-bfloat16", [(handoff, [23, 24], 0)])
    assert not out["ok"] and out["error_type"] == "TransferChecksumError"
    assert torch.equal(read_kv(pair, 1, "R-bfloat16", like), before)
    assert pair.call(0, "wait_sent", rid, 10.0) is False


def test_the_device_digest_seals_a_gloo_transfer_on_cpu_and_both_ends_must_agree_on_it(pair: Pair) -> None:
    """The digest the nccl / CUDA IPC path computes on the GPU, chosen here for a gloo pair on CPU: a
    chunked transfer arrives byte identical, a corrupted chunk is caught before its scatter, and a sender
    sealing with XXH3 is refused by the header check."""
    pair.call(1, "receiver", "R-device", "float32", HEAD_DIM, 10.0, 4, None, DEVICE_CHECKSUM_SCHEME)
    pair.call(0, "sender", "S-device", "float32", 3 * ROW_BYTES_F32, 10.0, 3, None, DEVICE_CHECKSUM_SCHEME)
    like = make_kv(DST_SEED, "float32")
    before = read_kv(pair, 1, "R-device", like)
    rid = new_id("device-digest")
    src_ids, dst_ids = [11, 2, 27, 6, 30], [14, 26, 3, 31, 9]  # 10 rows: 4 chunks
    handoff = pair.call(0, "offer", "S-device", rid, src_ids, None)
    [out] = pair.call(1, "receive", "R-device", [(handoff, dst_ids, 0)])
    assert out["ok"] and out["nbytes"] == 5 * NUM_LAYERS * ROW_BYTES_F32
    assert pair.call(0, "wait_sent", rid, 10.0) is True
    after = read_kv(pair, 1, "R-device", like)
    check_blocks(before, after, "float32", dict(zip(dst_ids, src_ids, strict=True)))

    rid2 = new_id("device-digest-corrupt")
    handoff2 = pair.call(0, "offer", "S-device", rid2, [1, 2, 3, 4], None)
    pair.call(0, "fault", "corrupt", 1)  # chunk 1 of 3
    [out2] = pair.call(1, "receive", "R-device", [(handoff2, [5, 6, 7, 8], 0)])
    assert not out2["ok"] and out2["error_type"] == "TransferChecksumError" and "chunk 1/3" in out2["error"]
    assert pair.call(0, "wait_sent", rid2, 10.0) is False
    got, src = read_kv(pair, 1, "R-device", like), as_bytes(make_kv(SRC_SEED, "float32"))
    assert torch.equal(got[0, [5, 6, 7]], src[0, [1, 2, 3]])  # chunk 0: verified, then scattered
    assert torch.equal(got[0, 8], after[0, 8]) and torch.equal(got[1], after[1])  # chunks 1 and 2: not
    assert torch.equal(got[:, :5], after[:, :5]) and torch.equal(got[:, 9:], after[:, 9:])

    rid3 = new_id("device-digest-mismatch")
    handoff3 = pair.call(0, "offer", "S-float32", rid3, [1, 2], None)  # seals with XXH3
    [out3] = pair.call(1, "receive", "R-device", [(handoff3, [20, 21], 0)])
    assert not out3["ok"] and out3["error_type"] == "TransferMismatchError"
    assert f"checksum is 'xxh3_64-nonce-v2', expected '{DEVICE_CHECKSUM_SCHEME}'" in out3["error"]
    assert pair.call(0, "wait_sent", rid3, 10.0) is False


def test_unknown_aborted_and_expired_requests_are_rejected(pair: Pair) -> None:
    aborted, expired = new_id("aborted"), new_id("expired")
    handoff = pair.call(0, "offer", "S-float32", aborted, [1, 2], None)
    assert pair.call(0, "abort", "S-float32", aborted) is True
    short = pair.call(0, "offer", "S-float32", expired, [3], 0.2)
    assert pair.call(0, "wait_sent", expired, 10.0) is False  # lease expiry releases the blocks
    outs = pair.call(1, "receive", "R-float32", [(handoff, [1, 2], 0), (short, [3], 0)])
    assert [o["error_type"] for o in outs] == ["TransferRejectedError", "TransferRejectedError"]
    assert pair.call(0, "wait_sent", aborted, 0.0) is None  # abort() means no callback
    assert pair.call(0, "held", "S-float32") == 0


def _ipc_worker(rank: int, endpoints: dict[str, str], replies: Any) -> None:
    """Rank 0 sends two halves of one buffer (tags 5, 6); rank 1 receives both, then times out on tag 7."""
    try:
        key = PairKey(PeerId("P", "0"), PeerId("D", "1"), 0)
        channel = CudaIpcChannel(key.ends[rank], endpoints)
        expected = torch.arange(4096, dtype=torch.int32, device="cuda") * 7
        if rank == 0:
            staging = expected.clone()
            channel.send(staging[:2048], key, tag=5, timeout_s=30.0)
            channel.send(staging[2048:], key, tag=6, timeout_s=30.0)
            replies.put(("ok", len(channel._exports)))
        else:
            buf = torch.zeros_like(expected)
            channel.recv(buf[:2048], key, tag=5, timeout_s=30.0)
            channel.recv(buf[2048:], key, tag=6, timeout_s=30.0)
            start = time.monotonic()
            try:
                channel.recv(torch.zeros_like(expected), key, tag=7, timeout_s=0.5)
                replies.put(("err", "recv without a sender returned"))
            except TimeoutError:
                elapsed = time.monotonic() - start
                replies.put(("ok", (torch.equal(buf, expected), len(channel._imports), elapsed)))
        channel.close()
    except Exception:  # noqa: BLE001 (the traceback goes to the test process)
        replies.put(("err", traceback.format_exc()))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_ipc_channel_moves_a_buffer_between_processes_on_one_gpu(tmp_path: Any) -> None:
    ctx = mp.get_context("spawn")
    endpoints = {name: f"ipc://{tmp_path}/ipc-{r}" for r, name in enumerate(("P/0", "D/1"))}
    replies = [ctx.Queue(), ctx.Queue()]
    procs = [ctx.Process(target=_ipc_worker, args=(r, endpoints, replies[r]), daemon=True) for r in range(2)]
    try:
        for p in procs:
            p.start()
        results = [q.get(timeout=60) for q in replies]
        assert results[0] == ("ok", 1), results[0]  # one buffer, exported once for both sends
        status, (equal, num_imports, elapsed) = results[1]
        assert status == "ok" and equal and num_imports == 1 and elapsed < 5.5
    finally:
        for p in procs:
            p.join(10)
            if p.is_alive():
                p.terminate()


def test_a_transfer_in_several_chunks_arrives_byte_identical(pair: Pair) -> None:
    like = make_kv(DST_SEED, "float32")
    before = read_kv(pair, 1, "R-float32", like)
    rid = new_id("chunked")
    src_ids, dst_ids = [11, 2, 27, 6], [14, 26, 3, 31]
    handoff = pair.call(0, "offer", "S-chunked", rid, src_ids, None)
    [out] = pair.call(1, "receive", "R-float32", [(handoff, dst_ids, 0)])
    assert out["ok"] and out["nbytes"] == 4 * NUM_LAYERS * ROW_BYTES_F32
    assert pair.call(0, "wait_sent", rid, 10.0) is True
    check_blocks(
        before, read_kv(pair, 1, "R-float32", like), "float32", dict(zip(dst_ids, src_ids, strict=True))
    )
    [sent] = [r for r in pair.call(0, "results", "S-chunked") if r["request_id"] == rid]
    assert sent["ok"] and sent["num_blocks"] == 4

    # chunk 0 of 6 corrupted: nothing is scattered, and the later chunks (sent, or fed as junk once the
    # sender saw the abort, into recvs the receiver had posted) must not disturb the next transfer
    rid2, rid3 = new_id("chunked-corrupt"), new_id("chunked-after")
    before2 = read_kv(pair, 1, "R-float32", like)
    handoff2 = pair.call(0, "offer", "S-chunked", rid2, [1, 2, 3, 4, 9, 10, 12, 13], None)
    pair.call(0, "fault", "corrupt")
    [out2] = pair.call(1, "receive", "R-float32", [(handoff2, [5, 6, 7, 8, 9, 10, 11, 12], 0)])
    assert not out2["ok"] and out2["error_type"] == "TransferChecksumError" and "chunk 0/6" in out2["error"]
    assert pair.call(0, "wait_sent", rid2, 10.0) is False
    assert torch.equal(read_kv(pair, 1, "R-float32", like), before2)
    handoff3 = pair.call(0, "offer", "S-chunked", rid3, [1, 2, 3, 4], None)
    [out3] = pair.call(1, "receive", "R-float32", [(handoff3, [5, 6, 7, 8], 0)])
    assert out3["ok"]
    check_blocks(before2, read_kv(pair, 1, "R-float32", like), "float32", {5: 1, 6: 2, 7: 3, 8: 4})


def test_chunks_wrap_around_the_rings_and_a_bad_chunk_stops_the_scatter_there(pair: Pair) -> None:
    """16 rows in chunks of 3 (6 chunks) through a 3-slot sender ring and a 4-slot receiver ring that
    credits every 2 chunks. Chunk 1 corrupted: chunk 0 (verified) is scattered, nothing after it; the
    sender feeds junk to the recvs it had not sent, so no op is left pending and the next transfer on the
    pair works."""
    like = make_kv(DST_SEED, "float32")
    src_ids, dst_ids = [1, 2, 3, 4, 9, 10, 12, 13], [5, 6, 7, 8, 18, 19, 20, 21]
    before = read_kv(pair, 1, "R-float32", like)
    rid = new_id("wrap")
    handoff = pair.call(0, "offer", "S-chunked", rid, src_ids, None)
    [out] = pair.call(1, "receive", "R-float32", [(handoff, dst_ids, 0)])
    assert out["ok"] and out["nbytes"] == 8 * NUM_LAYERS * ROW_BYTES_F32
    assert pair.call(0, "wait_sent", rid, 10.0) is True
    moved = dict(zip(dst_ids, src_ids, strict=True))
    check_blocks(before, read_kv(pair, 1, "R-float32", like), "float32", moved)
    # 7 blocks: 14 rows, 5 chunks; the one credit the sender needs (chunk 0's slot) is off the every-2 beat
    rid_odd, dst_odd = new_id("wrap-odd"), [10, 11, 12, 13, 14, 15, 16]
    before_odd = read_kv(pair, 1, "R-float32", like)
    handoff = pair.call(0, "offer", "S-chunked", rid_odd, src_ids[:7], None)
    [out] = pair.call(1, "receive", "R-float32", [(handoff, dst_odd, 0)])
    assert out["ok"] and out["nbytes"] == 7 * NUM_LAYERS * ROW_BYTES_F32
    moved = dict(zip(dst_odd, src_ids[:7], strict=True))
    check_blocks(before_odd, read_kv(pair, 1, "R-float32", like), "float32", moved)

    rid2, dst2 = new_id("wrap-corrupt"), [22, 23, 24, 25, 26, 27, 28, 29]
    before2 = read_kv(pair, 1, "R-float32", like)
    ops0, ops1 = pair.call(0, "num_ops"), pair.call(1, "num_ops")
    handoff2 = pair.call(0, "offer", "S-chunked", rid2, src_ids, None)
    pair.call(0, "fault", "corrupt", 1)
    [out2] = pair.call(1, "receive", "R-float32", [(handoff2, dst2, 0)])
    assert (out2["ok"], out2["error_type"]) == (False, "TransferChecksumError")
    assert "chunk 1/6" in out2["error"]
    assert pair.call(0, "wait_sent", rid2, 10.0) is False
    after2 = read_kv(pair, 1, "R-float32", like)
    src = as_bytes(make_kv(SRC_SEED, "float32"))
    assert torch.equal(after2[0, dst2[:3]], src[0, src_ids[:3]])  # chunk 0: rows 0-2 = layer 0, blocks 0-2
    assert torch.equal(after2[0, dst2[3:]], before2[0, dst2[3:]])
    assert torch.equal(after2[1], before2[1])
    untouched = [b for b in range(NUM_BLOCKS) if b not in dst2]
    assert torch.equal(after2[:, untouched], before2[:, untouched])

    # NOTE: every op of that transfer met its match (the sender fed junk to the recvs it had not sent)
    wait_for(
        lambda: pair.call(0, "unfinished_ops", ops0) == pair.call(1, "unfinished_ops", ops1) == 0,
        10.0,
        "ops done",
    )

    rid3 = new_id("wrap-after")
    handoff3 = pair.call(0, "offer", "S-chunked", rid3, src_ids, None)
    [out3] = pair.call(1, "receive", "R-float32", [(handoff3, dst2, 0)])
    assert out3["ok"]
    moved3 = dict(zip(dst2, src_ids, strict=True))
    check_blocks(before2, read_kv(pair, 1, "R-float32", like), "float32", moved3)


def test_a_transfer_far_longer_than_the_rings_is_credited_in_time(pair: Pair) -> None:
    """16 blocks in chunks of 3 rows: 11 chunks through the sender's 3 slots, into a 4-slot receiver (a
    credit every 2 chunks) and a 1-slot one (a credit every chunk). The sender needs credits long before
    the receiver's last needed one (chunk 4 waits for chunk 0's slot): credits sent too seldom would
    stall the transfer until it times out."""
    pair.call(1, "receiver", "R-one-slot", "float32", HEAD_DIM, 10.0, 1)
    src_ids, dst_ids = list(range(1, 17)), list(range(31, 15, -1))
    like = make_kv(DST_SEED, "float32")
    for name in ("R-float32", "R-one-slot"):
        before = read_kv(pair, 1, name, like)
        rid = new_id("long")
        handoff = pair.call(0, "offer", "S-chunked", rid, src_ids, None)
        [out] = pair.call(1, "receive", name, [(handoff, dst_ids, 0)])
        assert out["ok"] and out["nbytes"] == 16 * NUM_LAYERS * ROW_BYTES_F32, out
        assert pair.call(0, "wait_sent", rid, 10.0) is True
        moved = dict(zip(dst_ids, src_ids, strict=True))
        check_blocks(before, read_kv(pair, 1, name, like), "float32", moved)


@pytest.mark.parametrize("swapped", ["k_and_v", "two_tokens"])
def test_swapped_k_and_v_or_tokens_inside_a_block_fail_the_digest(pair: Pair, swapped: str) -> None:
    like = make_kv(DST_SEED, "float32")
    before = read_kv(pair, 1, "R-float32", like)
    rid = new_id(swapped)
    handoff = pair.call(0, "offer", "S-float32", rid, [8, 9], None)
    half, token = ROW_BYTES_F32 // 2, NUM_HEADS * HEAD_DIM * 4  # row 0 = block 8 of layer 0: K then V
    ranges = (0, half, half) if swapped == "k_and_v" else (token, 3 * token, token)
    pair.call(0, "fault", "swap", 0, *ranges)
    [out] = pair.call(1, "receive", "R-float32", [(handoff, [23, 24], 0)])
    assert pair.call(0, "fault_note") is True  # the swapped bytes differed
    assert (out["ok"], out["error_type"]) == (False, "TransferChecksumError") and "chunk 0/1" in out["error"]
    assert torch.equal(read_kv(pair, 1, "R-float32", like), before)
    assert pair.call(0, "wait_sent", rid, 10.0) is False
    [sender_side] = [r for r in pair.call(0, "results", "S-float32") if r["request_id"] == rid]
    assert sender_side["error_type"] == "TransferChecksumError"  # the receiver's abort names it


def test_a_chunk_replayed_from_another_transfer_fails_the_digest(pair: Pair) -> None:
    """Transfer 1's sealed chunk is sent again for transfer 2 of the very same blocks: the payload bytes
    are equal, only the nonce the digest is keyed with differs."""
    like = make_kv(DST_SEED, "float32")
    first, replayed = new_id("record"), new_id("replay")
    pair.call(0, "fault", "record")
    handoff1 = pair.call(0, "offer", "S-float32", first, [10, 11], None)
    [out1] = pair.call(1, "receive", "R-float32", [(handoff1, [12, 13], 0)])
    assert out1["ok"]
    before = read_kv(pair, 1, "R-float32", like)
    handoff = pair.call(0, "offer", "S-float32", replayed, [10, 11], None)
    pair.call(0, "fault", "replay")
    [out2] = pair.call(1, "receive", "R-float32", [(handoff, [14, 15], 0)])
    assert pair.call(0, "fault_note") is True  # same payload bytes as the chunk it replaced
    assert (out2["ok"], out2["error_type"]) == (False, "TransferChecksumError")
    assert torch.equal(read_kv(pair, 1, "R-float32", like), before)
    assert pair.call(0, "wait_sent", replayed, 10.0) is False


def test_offer_freezes_the_block_ids_and_checks_them(pair: Pair) -> None:
    # NOTE: the "offer" command overwrites the caller's list right after offering; every transfer test
    # still moves the offered blocks, so the sender works from its own frozen copy.
    assert pair.call(0, "offer_error", "S-float32", new_id("range"), [1, NUM_BLOCKS]) == "ValueError"
    assert pair.call(0, "offer_error", "S-float32", new_id("range"), [-1]) == "ValueError"
    rid = new_id("twice")
    pair.call(0, "offer", "S-float32", rid, [3], None)
    assert pair.call(0, "offer_error", "S-float32", rid, [3]) == "TransferRejectedError"
    assert pair.call(0, "abort", "S-float32", rid) is True
    assert pair.call(0, "held", "S-float32") == 0


def test_drop_peer_fails_its_transfer_at_once_and_others_go_on() -> None:
    """Processes: 0 sender S0; 1 receiver R1 + sender S1 (the peer that dies); 2 receiver R2.
    1) R2 fetching from a stalled S1 with a fetch from S0 queued behind: R2.drop_peer("S1") (every
       incarnation it saw); a new incarnation of S1 (in process 0) is another peer and serves R2.
    2) S0 stuck sending to R1 (which is then killed) with R2's fetch queued behind:
       S0.drop_peer("R1", "p1"). Without drop_peer the queued fetch would wait out the 15 s timeouts."""
    os.environ["OMP_NUM_THREADS"] = "1"
    timeout_s = 15.0
    trio = Pair(num_procs=3)
    try:
        trio.call(0, "sender", "S0", "float32", DEFAULT_CHUNK_BYTES, timeout_s)
        trio.call(1, "sender", "S1", "float32", DEFAULT_CHUNK_BYTES, timeout_s)
        trio.call(1, "receiver", "R1", "float32", HEAD_DIM, timeout_s)
        trio.call(2, "receiver", "R2", "float32", HEAD_DIM, timeout_s)
        like = make_kv(DST_SEED, "float32")
        before = read_kv(trio, 2, "R2", like)

        # 1) the receiver drops a dead sender
        stalled = trio.call(1, "offer", "S1", "from-1", [1, 2], None)
        healthy = trio.call(0, "offer", "S0", "from-0", [3, 4, 5], None)
        trio.call(1, "fault", "stall")
        trio.call(2, "submit", "R2", "c", stalled, [10, 11])
        assert trio.call(1, "wait_fault", 10.0) is True  # S1 posted its (stalled) send: R2 waits on it
        trio.call(2, "submit", "R2", "d", healthy, [12, 13, 14])
        assert trio.call(2, "drop_peer", "R2", "S1", None) == ["S1/p1"]
        lost, ok = trio.call(2, "collect", "c"), trio.call(2, "collect", "d")
        assert (lost["ok"], lost["error_type"]) == (False, "TransferPeerLostError")
        assert "S1/p1" in lost["error"]
        assert ok["ok"] and ok["elapsed"] < timeout_s / 3
        later = trio.call(1, "offer", "S1", "from-1-later", [6], None)
        trio.call(2, "submit", "R2", "e", later, [15])
        rejected = trio.call(2, "collect", "e")
        assert rejected["error_type"] == "TransferPeerLostError" and rejected["elapsed"] < 1.0
        check_blocks(before, read_kv(trio, 2, "R2", like), "float32", {12: 3, 13: 4, 14: 5})
        trio.call(0, "sender", "S1", "float32", DEFAULT_CHUNK_BYTES, timeout_s)  # S1 "restarted"
        reborn = trio.call(0, "offer", "S1", "from-1-reborn", [16, 17], None)
        assert reborn["src_incarnation"] == "p0"
        [out] = trio.call(2, "receive", "R2", [(reborn, [16, 17], 0)])
        assert out["ok"]
        check_blocks(before, read_kv(trio, 2, "R2", like), "float32", {12: 3, 13: 4, 14: 5, 16: 16, 17: 17})

        # 2) the sender drops a dead receiver it is sending to
        to_dead = trio.call(0, "offer", "S0", "to-1", [7, 8], None)
        to_live = trio.call(0, "offer", "S0", "to-2", [9, 10, 11], None)
        trio.call(0, "fault", "blackhole")
        trio.call(1, "submit", "R1", "a", to_dead, [20, 21])
        assert trio.call(0, "wait_fault", 10.0) is True  # S0 is in its channel send to R1
        trio.call(2, "submit", "R2", "b", to_live, [20, 21, 22])
        trio.kill(1)
        assert trio.call(0, "drop_peer", "S0", "R1", "p1") == ["R1/p1"]
        out = trio.call(2, "collect", "b")
        assert out["ok"] and out["elapsed"] < timeout_s / 3
        assert trio.call(0, "wait_sent", "to-1", 5.0) is False
        assert trio.call(0, "wait_sent", "to-2", 5.0) is True
        [failed] = [r for r in trio.call(0, "results", "S0") if r["request_id"] == "to-1"]
        assert failed["error_type"] == "TransferPeerLostError" and "R1/p1" in failed["error"]
        moved = {12: 3, 13: 4, 14: 5, 16: 16, 17: 17, 20: 9, 21: 10, 22: 11}
        check_blocks(before, read_kv(trio, 2, "R2", like), "float32", moved)
    finally:
        trio.close()


def test_a_broken_pair_is_rebuilt_at_the_next_generation_and_carries_the_next_transfer(pair: Pair) -> None:
    """A recv that never gets its send outlives the group's 4 s timeout: gloo fails it and closes the
    pair, which the receiver then reports broken. The next transfer asks for generation 1: both ends
    build it (the sender had not noticed the break) and the bytes arrive exactly."""
    pair.call(0, "sender", "S-brittle", "float32", DEFAULT_CHUNK_BYTES, 10.0, NUM_SLOTS, 4.0)
    pair.call(1, "receiver", "R-brittle", "float32", HEAD_DIM, 3.0, NUM_SLOTS, 4.0)
    like = make_kv(DST_SEED, "float32")
    before = read_kv(pair, 1, "R-brittle", like)
    first = new_id("brittle")
    [out] = pair.call(
        1, "receive", "R-brittle", [(pair.call(0, "offer", "S-brittle", first, [1, 2], None), [3, 4], 0)]
    )
    assert out["ok"]
    stalled = new_id("brittle-stall")
    handoff = pair.call(0, "offer", "S-brittle", stalled, [5, 6], None)
    pair.call(0, "fault", "stall")
    [out] = pair.call(1, "receive", "R-brittle", [(handoff, [7, 8], 0)])
    assert (out["ok"], out["error_type"]) == (False, "TransferTimeoutError")
    wait_for(lambda: pair.call(1, "broken", "R-brittle") == ["S-brittle/p0"], 30, "the pair reported broken")
    assert pair.call(0, "broken", "S-brittle") == []  # the sender has no op on it: it has not seen it yet

    after = new_id("brittle-after")
    handoff = pair.call(0, "offer", "S-brittle", after, [9, 10], None)
    [out] = pair.call(1, "receive", "R-brittle", [(handoff, [11, 12], 0)])
    assert out["ok"]
    check_blocks(before, read_kv(pair, 1, "R-brittle", like), "float32", {3: 1, 4: 2, 11: 9, 12: 10})
    assert pair.call(0, "wait_sent", after, 10.0) is True
    generations = {
        side: {r["request_id"]: r["generation"] for r in pair.call(i, "results", side)}
        for i, side in ((0, "S-brittle"), (1, "R-brittle"))
    }
    assert generations["R-brittle"] == {first: 0, stalled: 0, after: 1}
    assert generations["S-brittle"] == {first: 0, stalled: 0, after: 1}
    assert pair.call(1, "broken", "R-brittle") == pair.call(0, "broken", "S-brittle") == []


def test_every_handshake_frame_is_authenticated_and_a_bad_one_is_counted_and_dropped(pair: Pair) -> None:
    """Frames to a sender's handshake socket that fail a check are counted by reason and dropped; the
    sender serves the next transfer as if nothing happened."""
    me = "S-float32/p0"
    signer, stranger = FrameSigner(pair.secret), FrameSigner(new_secret())
    frames: list[list[bytes]] = [
        [b"\x00" * 40],  # not a frame
        [msgpack.packb({"kind": "request", "nonce": 1})],  # the old, unsigned form
        [stranger.sign(me, "request", {"nonce": 1, "request": {}})],  # another key
        [signer.sign(me, "request", {"nonce": 1, "request": {"request_id": 5}})],  # bad field
        [signer.sign(me, "gimme", {"nonce": 1})],  # unknown tag
        [signer.sign("S-float32/p9", "abort", {"nonce": 1, "error_type": "", "message": ""})],  # misaddressed
        [b"two", b"parts"],  # a message of the wrong shape
    ]
    # NOTE: signed last: a session's counter only grows, so an earlier counter would read as a replay
    harmless = signer.sign(me, "abort", {"nonce": 7, "error_type": "", "message": ""})  # of no transfer
    frames += [[harmless], [harmless]]  # accepted once, then replayed
    expected = {
        "malformed": 3,
        "bad_mac": 1,
        "bad_field": 1,
        "unknown_tag": 1,
        "misaddressed": 1,
        "replayed": 1,
    }
    before = pair.call(0, "rejected", "S-float32")
    ctx: zmq.Context[Any] = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 1000)
    try:
        sock.connect(pair.endpoints["S-float32"])
        for parts in frames:
            sock.send_multipart(parts)

        def counted() -> dict[str, int]:
            now = pair.call(0, "rejected", "S-float32")
            return {k: now.get(k, 0) - before.get(k, 0) for k in set(now) | set(expected)}

        wait_for(lambda: counted() == expected, 20, "every bad frame counted")
    finally:
        sock.close()
        ctx.term()
    like = make_kv(DST_SEED, "float32")
    before_kv = read_kv(pair, 1, "R-float32", like)
    rid = new_id("after-forgeries")
    [out] = pair.call(
        1, "receive", "R-float32", [(pair.call(0, "offer", "S-float32", rid, [6, 7], None), [8, 9], 0)]
    )
    assert out["ok"]
    check_blocks(before_kv, read_kv(pair, 1, "R-float32", like), "float32", {8: 6, 9: 7})
    assert pair.call(1, "rejected", "R-float32") == {}


def expected_handoff(pair: Pair, sender: str, request_id: str, num_blocks: int) -> dict[str, Any]:
    """The handoff a decode worker builds before the prefill side offers anything (early admission)."""
    layout = KVLayout(NUM_LAYERS, BLOCK_SIZE, NUM_HEADS, HEAD_DIM, "float32")
    endpoint = pair.endpoints[sender]
    handoff = KVHandoff(request_id, sender, "p0", endpoint, layout, num_blocks * BLOCK_SIZE, num_blocks, 0.0)
    return to_dict(handoff)


def test_fetches_posted_before_the_offer_are_served_when_it_comes_and_block_nothing(pair: Pair) -> None:
    """Early admission: two fetches wait at the sender for their offers; an offered request fetched the
    usual way passes them, the second offer is served at once while the first still waits, then the
    first is withdrawn on the prefill side and fails there and then."""
    like = make_kv(DST_SEED, "float32")
    before = read_kv(pair, 1, "R-float32", like)
    first, second, usual = new_id("early"), new_id("early"), new_id("usual")
    pair.call(1, "post", "R-float32", first, expected_handoff(pair, "S-float32", first, 2), [4, 5], 60.0)
    pair.call(1, "post", "R-float32", second, expected_handoff(pair, "S-float32", second, 3), [6, 7, 9], 60.0)
    wait_for(lambda: pair.call(0, "parked", "S-float32") == 2, 10, "both fetches parked")
    offered = pair.call(0, "offer", "S-float32", usual, [12], None)
    [out] = pair.call(1, "receive", "R-float32", [(offered, [13], 0)])
    assert out["ok"] and pair.call(0, "wait_sent", usual, 10.0) is True
    pair.call(0, "offer", "S-float32", second, [20, 21, 22], None)
    assert pair.call(1, "collect", second)["ok"]
    assert pair.call(0, "wait_sent", second, 10.0) is True
    check_blocks(before, read_kv(pair, 1, "R-float32", like), "float32", {13: 12, 6: 20, 7: 21, 9: 22})
    assert pair.call(1, "is_done", first) is False and pair.call(0, "parked", "S-float32") == 1
    assert pair.call(0, "abort", "S-float32", first) is False  # nothing offered, so no lease withdrawn
    refused = pair.call(1, "collect", first)
    assert (refused["ok"], refused["error_type"]) == (False, "TransferRejectedError")
    assert "withdrew" in refused["error"]
    assert pair.call(0, "parked", "S-float32") == 0 and pair.call(0, "held", "S-float32") == 0
    check_blocks(before, read_kv(pair, 1, "R-float32", like), "float32", {13: 12, 6: 20, 7: 21, 9: 22})


def test_a_posted_fetch_cancelled_or_past_its_bound_leaves_nothing_parked(pair: Pair) -> None:
    cancelled, late = new_id("cancelled"), new_id("late")
    pair.call(1, "post", "R-float32", cancelled, expected_handoff(pair, "S-float32", cancelled, 1), [3], 60.0)
    wait_for(lambda: pair.call(0, "parked", "S-float32") == 1, 10, "fetch parked")
    pair.call(1, "cancel", "R-float32", cancelled)
    out = pair.call(1, "collect", cancelled)
    assert (out["ok"], out["error_type"]) == (False, "TransferError") and "cancelled" in out["error"]
    wait_for(lambda: pair.call(0, "parked", "S-float32") == 0, 10, "the sender forgot the fetch")
    # its offer comes after all: nothing asks for it any more, the lease is the prefill side's to end
    pair.call(0, "offer", "S-float32", cancelled, [3], None)
    assert pair.call(0, "abort", "S-float32", cancelled) is True
    pair.call(1, "post", "R-float32", late, expected_handoff(pair, "S-float32", late, 1), [3], 0.3)
    out = pair.call(1, "collect", late)
    assert (out["ok"], out["error_type"]) == (False, "TransferTimeoutError")
    wait_for(lambda: pair.call(0, "parked", "S-float32") == 0, 10, "the late fetch forgotten")
    assert pair.call(0, "held", "S-float32") == 0


def test_a_parked_request_is_answered_ready_so_a_stopped_receiver_blocks_no_transfer(pair: Pair) -> None:
    """A receiver that parked a request and then stopped answering (SIGSTOP, a stuck process): the offer
    gets it a READY, never a header whose ack the sender would wait out its transfer timeout for; the
    next transfer goes through at once and the offer stays held for its owner to end."""
    stalled, usual = new_id("stalled"), new_id("usual")
    frames = HandshakeFrames(pair.secret, "ghost/p9")
    ctx: zmq.Context[Any] = zmq.Context()
    ghost = ctx.socket(zmq.DEALER)
    ghost.setsockopt(zmq.LINGER, 0)
    try:
        ghost.connect(pair.endpoints["S-float32"])
        request = TransferRequest(stalled, 77, "ghost", "p9", 0, 0, 1, time.time() + 60.0)
        ghost.send(frames.encode("S-float32/p0", MessageKind.REQUEST, 77, request=request))
        wait_for(lambda: pair.call(0, "parked", "S-float32") == 1, 10, "the ghost's request parked")
        pair.call(0, "offer", "S-float32", stalled, [5], None)
        assert ghost.poll(10_000)
        assert frames.decode(ghost.recv()) == (MessageKind.READY, 77, {})
        handoff = pair.call(0, "offer", "S-float32", usual, [6], None)
        [out] = pair.call(1, "receive", "R-float32", [(handoff, [9], 0)])
        assert out["ok"] and pair.call(0, "wait_sent", usual, 10.0) is True
        assert pair.call(0, "held", "S-float32") == 1 and pair.call(0, "parked", "S-float32") == 0
        assert pair.call(0, "abort", "S-float32", stalled) is True
    finally:
        ghost.close()
        ctx.term()
