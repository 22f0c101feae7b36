"""KV transfer over gloo between two real processes: byte identity, skips, ordering, and every failure.

The test process drives a prefill process (rank 0, KVSender) and a decode process (rank 1, KVReceiver)
like a router would: it asks rank 0 to offer a request, hands the KVHandoff to rank 1, and checks the
KV bytes rank 1 ends up with against the same seeded tensors rebuilt here.
"""

from __future__ import annotations

import datetime
import multiprocessing as mp
import os
import queue
import threading
import time
import traceback
from collections.abc import Iterator
from typing import Any

import pytest
import torch

from transfer.channel import TORCH_DTYPES, Channel, CudaIpcChannel, OpLane, PendingOp
from transfer.protocol import (
    CHECKSUM_SCHEME,
    KVHandoff,
    KVLayout,
    MessageKind,
    TransferError,
    TransferHeader,
    TransferMismatchError,
    TransferTimeoutError,
    decode_message,
    encode_message,
    handoff_from_dict,
    tag_for_nonce,
    to_dict,
    validate_header,
)
from transfer.side import DEFAULT_CHUNK_BYTES
from transfer.staging import (
    ChunkPlan,
    block_index,
    chunk_checksum,
    chunk_view,
    gather_blocks,
    gather_chunk,
    kv_rows,
    read_trailer,
    scatter_chunk,
)

NUM_LAYERS, NUM_BLOCKS, BLOCK_SIZE, NUM_HEADS, HEAD_DIM = 2, 32, 4, 2, 8
SRC_SEED, DST_SEED = 1, 2
REPLY_TIMEOUT_S = 30.0
ROW_BYTES_F32 = 2 * BLOCK_SIZE * NUM_HEADS * HEAD_DIM * 4


def make_kv(seed: int, dtype: str, head_dim: int = HEAD_DIM) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    shape = (NUM_LAYERS, NUM_BLOCKS, 2, BLOCK_SIZE, NUM_HEADS, head_dim)
    return torch.randn(shape, generator=g).to(TORCH_DTYPES[dtype])


def as_bytes(kv: torch.Tensor) -> torch.Tensor:
    """[L, num_blocks, -1] uint8 view: block-wise byte comparison for any dtype."""
    return kv.reshape(kv.shape[0], kv.shape[1], -1).view(torch.uint8)


class FaultyChannel(Channel):
    """Wraps the real channel; `fault` applies to the next send only: "stall" never sends the bytes,
    "corrupt" flips one byte after the checksum was taken, "blackhole" never sends and never completes
    (a peer that stopped draining). `fired` is set when a fault was applied."""

    def __init__(self, inner: Channel) -> None:
        self.inner = inner
        self.fault: str | None = None
        self.fired = threading.Event()

    def staging_device(self, kv_device: torch.device) -> torch.device:
        return self.inner.staging_device(kv_device)

    def isend(self, buf: torch.Tensor, dst_rank: int, tag: int, lane: OpLane | None = None) -> PendingOp:
        fault, self.fault = self.fault, None
        if fault is not None:
            self.fired.set()
        if fault == "stall":
            return _NoOp()
        if fault == "blackhole":
            return _NeverOp()
        if fault == "corrupt":
            buf = buf.clone()
            flat = buf.view(-1).view(torch.uint8)
            flat[flat.numel() // 2] ^= 0x5A
        return self.inner.isend(buf, dst_rank, tag, lane)

    def irecv(self, buf: torch.Tensor, src_rank: int, tag: int, lane: OpLane | None = None) -> PendingOp:
        return self.inner.irecv(buf, src_rank, tag, lane)


class _NoOp(PendingOp):
    def wait(self, timeout_s: float) -> None:
        return None


class _NeverOp(PendingOp):
    def wait(self, timeout_s: float) -> None:
        threading.Event().wait(timeout_s)
        raise TransferTimeoutError(f"never completes (waited {timeout_s:.3f}s)")


def _worker(rank: int, world_size: int, port: int, commands: Any, replies: Any) -> None:
    """Hosts the KVSenders / KVReceivers it is told to; each command is answered with ("ok"|"err", value)."""
    torch.set_num_threads(1)
    import torch.distributed as dist

    from transfer.channel import TorchDistChannel
    from transfer.connector import KVReceiver, KVSender

    timeout = datetime.timedelta(seconds=600)  # NOTE: far beyond the test; abandoned ops must not expire
    # the rendezvous store is hosted by the test process (port 0, read back: no free-port race)
    store = dist.TCPStore("127.0.0.1", port, world_size, is_master=False, timeout=timeout)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world_size, timeout=timeout)
    channel = FaultyChannel(TorchDistChannel())
    kvs: dict[str, torch.Tensor] = {}
    sides: dict[str, Any] = {}
    tables: dict[str, list[int]] = {}
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
            name, dtype, *rest = args
            chunk_bytes, timeout_s = rest if rest else (DEFAULT_CHUNK_BYTES, 10.0)
            kvs[name] = make_kv(SRC_SEED, dtype)
            sides[name] = KVSender(
                kvs[name],
                rank=rank,
                channel=channel,
                get_block_ids=tables.get,
                on_sent=on_sent,
                timeout_s=timeout_s,
                chunk_bytes=chunk_bytes,
            )
            sides[name].start()
            return sides[name].endpoint
        if cmd == "receiver":
            name, dtype, head_dim, timeout_s = args
            kvs[name] = make_kv(DST_SEED, dtype, head_dim)
            sides[name] = KVReceiver(kvs[name], rank=rank, channel=channel, timeout_s=timeout_s)
            sides[name].start()
            return None
        if cmd == "offer":
            name, request_id, block_ids, lease_s = args
            tables[request_id] = block_ids
            return to_dict(
                sides[name].offer(request_id, len(block_ids) * BLOCK_SIZE, ["ab"], lease_s=lease_s)
            )
        if cmd == "abort":
            return sides[args[0]].abort(args[1])
        if cmd == "fault":
            channel.fault = args[0]
            channel.fired.clear()
            return None
        if cmd == "wait_fault":  # -> whether the fault was applied within the bound
            return channel.fired.wait(args[0])
        if cmd == "drop_peer":
            return sides[args[0]].drop_peer(args[1])
        if cmd == "submit":  # returns at once; "collect" waits for the outcome
            name, key, handoff, ids = args
            submitted[key] = (sides[name].submit(handoff_from_dict(handoff), ids), time.monotonic())
            return None
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
    """`world_size` worker processes (2 unless told) in one gloo world, driven by commands."""

    def __init__(self, world_size: int = 2) -> None:
        import torch.distributed as dist

        ctx = mp.get_context("spawn")
        self._store = dist.TCPStore("127.0.0.1", 0, world_size, is_master=True, wait_for_workers=False)
        port = self._store.port
        self._queues = [(ctx.Queue(), ctx.Queue()) for _ in range(world_size)]
        self.procs = [
            ctx.Process(target=_worker, args=(rank, world_size, port, *self._queues[rank]), daemon=True)
            for rank in range(world_size)
        ]
        for p in self.procs:
            p.start()

    def call(self, rank: int, *cmd: Any) -> Any:
        commands, replies = self._queues[rank]
        commands.put(cmd)
        try:
            status, value = replies.get(timeout=REPLY_TIMEOUT_S)
        except queue.Empty:
            raise AssertionError(f"rank {rank} gave no answer to {cmd[0]} in {REPLY_TIMEOUT_S}s") from None
        if status == "err":
            raise AssertionError(f"rank {rank} failed {cmd[0]}:\n{value}")
        return value

    def kill(self, rank: int) -> None:
        self.procs[rank].kill()
        self.procs[rank].join(10)

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
            p.call(0, "sender", f"S-{dtype}", dtype)
            p.call(1, "receiver", f"R-{dtype}", dtype, HEAD_DIM, 10.0)
        # NOTE: 3 rows per chunk: a 4-block transfer of 2 layers is 3 chunks, one across the layer edge
        p.call(0, "sender", "S-chunked", "float32", 3 * ROW_BYTES_F32, 10.0)
        yield p
    finally:
        p.close()


_ids = iter(range(1_000_000))


def new_id(prefix: str) -> str:
    return f"{prefix}-{next(_ids)}"


def read_kv(pair: Pair, rank: int, name: str, like: torch.Tensor) -> torch.Tensor:
    raw = pair.call(rank, "kv", name)
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
    assert handoff["num_blocks"] == 4 and handoff["src_rank"] == 0 and handoff["layout"]["dtype"] == dtype
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


def _header(layout: KVLayout, num_blocks: int = 3, nonce: int = 12345) -> TransferHeader:
    return TransferHeader(
        request_id="r",
        nonce=nonce,
        src_rank=0,
        dst_rank=1,
        layout=layout,
        dtype=layout.dtype,
        shape=layout.layer_shape(num_blocks),
        num_blocks=num_blocks,
        nbytes=layout.bytes_per_block * num_blocks,
        num_chunks=num_blocks,
        chunk_bytes=layout.bytes_per_block,
        checksum=CHECKSUM_SCHEME,
        tag=tag_for_nonce(nonce),
    )


def test_protocol_round_trips_through_msgpack_and_validates_every_field() -> None:
    layout = KVLayout(NUM_LAYERS, BLOCK_SIZE, NUM_HEADS, HEAD_DIM, "bfloat16")
    header = _header(layout)
    assert TransferHeader.from_bytes(header.to_bytes()) == header
    handoff = KVHandoff("r", 0, "tcp://127.0.0.1:5", layout, 11, 3, 123.5, ["aa", b"\x01"])
    assert KVHandoff.from_bytes(handoff.to_bytes()) == handoff
    kind, nonce, body = decode_message(encode_message(MessageKind.HEADER, 9, header=header))
    assert (kind, nonce, body["header"]["layout"]) == (MessageKind.HEADER, 9, to_dict(layout))

    expect = dict(request_id="r", nonce=12345, src_rank=0, dst_rank=1, layout=layout, num_blocks=3)
    validate_header(header, **expect)  # type: ignore[arg-type]
    wrong: list[tuple[str, Any]] = [
        ("request_id", "q"),
        ("nonce", 1),
        ("src_rank", 2),
        ("dst_rank", 0),
        ("layout", KVLayout(NUM_LAYERS, BLOCK_SIZE, NUM_HEADS, HEAD_DIM, "float16")),
        ("num_blocks", 4),
    ]
    for field_name, value in wrong:
        with pytest.raises(TransferMismatchError, match=field_name):
            validate_header(header, **{**expect, field_name: value})  # type: ignore[arg-type]
    bad_fields: list[tuple[str, Any]] = [
        ("dtype", "float32"),
        ("shape", [3, 2, 4, 2, 4]),
        ("nbytes", 1),
        ("tag", 3),
        ("checksum", "none"),
        ("num_chunks", 2),
        ("chunk_bytes", layout.bytes_per_block + 1),
        ("chunk_bytes", 0),
    ]
    for field_name, value in bad_fields:
        bad = TransferHeader.from_bytes(header.to_bytes())
        setattr(bad, field_name, value)
        with pytest.raises(TransferMismatchError, match=field_name):
            validate_header(bad, **expect)  # type: ignore[arg-type]
    with pytest.raises(TransferError, match="malformed"):
        decode_message(b"\x93\x01\x02\x03")
    with pytest.raises(ValueError, match="dtype"):
        KVLayout(1, 1, 1, 1, "int7")


def _seal(kv: torch.Tensor, block_ids: list[int], chunk_bytes: int) -> tuple[ChunkPlan, torch.Tensor]:
    """All chunks of `kv[:, block_ids]` gathered and sealed into one buffer (chunk c at c * stride)."""
    row_bytes = kv[0, 0].numel() * kv.element_size()
    plan = ChunkPlan.create(kv.shape[0], len(block_ids), row_bytes, chunk_bytes)
    buf = torch.empty(plan.num_chunks * plan.stride, dtype=torch.uint8)
    for c in range(plan.num_chunks):
        gather_chunk(
            kv_rows(kv), block_index(block_ids, kv.device), plan, c, chunk_view(buf, plan, c, c * plan.stride)
        )
    return plan, buf


def _chunks_ok(plan: ChunkPlan, buf: torch.Tensor) -> list[bool]:
    views = [chunk_view(buf, plan, c, c * plan.stride) for c in range(plan.num_chunks)]
    return [chunk_checksum(w, plan, c) == read_trailer(w) for c, w in enumerate(views)]


def test_chunks_round_trip_and_checksum_catches_a_flipped_byte_and_swapped_blocks() -> None:
    for dtype in ("float32", "bfloat16"):
        kv = make_kv(SRC_SEED, dtype)
        row_bytes = kv[0, 0].numel() * kv.element_size()
        src_ids, dst_ids = [3, 9, 4, 17, 30], [1, 2, 7, 8, 20]
        plan, buf = _seal(kv, src_ids, 4 * row_bytes)  # 10 rows -> chunks of 4, 4, 2; one spans layers
        assert (plan.num_chunks, [plan.wire_bytes(c) for c in range(3)]) == (
            3,
            [4 * row_bytes + 8] * 2 + [2 * row_bytes + 8],
        )
        assert _chunks_ok(plan, buf) == [True, True, True]
        _, swapped = _seal(kv, [3, 9, 17, 4, 30], 4 * row_bytes)
        assert _chunks_ok(plan, torch.cat([swapped[: plan.stride], buf[plan.stride :]])) == [True, True, True]
        assert not torch.equal(swapped, buf)
        spliced = torch.cat([buf[: plan.stride], swapped[plan.stride :]])
        spliced[plan.stride + plan.wire_bytes(1) - 8 : plan.stride + plan.wire_bytes(1)] = buf[
            plan.stride + plan.wire_bytes(1) - 8 : plan.stride + plan.wire_bytes(1)
        ]  # chunk 1 holds blocks 4 and 17 swapped (layer 0) but the right trailer
        assert _chunks_ok(plan, spliced)[1] is False
        flipped = buf.clone()
        flipped[plan.stride + 5] ^= 1
        assert _chunks_ok(plan, flipped) == [True, False, True]
        target = make_kv(DST_SEED, dtype)
        before = as_bytes(target).clone()
        for c in range(plan.num_chunks):
            scatter_chunk(
                kv_rows(target),
                block_index(dst_ids, target.device),
                plan,
                c,
                chunk_view(buf, plan, c, c * plan.stride),
            )
        assert torch.equal(as_bytes(target)[:, dst_ids], as_bytes(kv)[:, src_ids])
        others = [b for b in range(NUM_BLOCKS) if b not in dst_ids]
        assert torch.equal(as_bytes(target)[:, others], before[:, others])
        assert torch.equal(gather_blocks(kv, src_ids), kv[:, src_ids])


def test_chunks_on_rows_that_are_not_word_multiples() -> None:
    g = torch.Generator().manual_seed(3)
    kv = torch.randint(0, 256, (2, 6, 2, 1, 1, 3), dtype=torch.uint8, generator=g).view(torch.float8_e4m3fn)
    plan, buf = _seal(kv, [5, 2], 6 * 3)  # 6-byte rows, 3 per chunk: 4 rows -> 2 chunks
    assert plan.num_chunks == 2 and _chunks_ok(plan, buf) == [True, True]
    flipped = buf.clone()
    flipped[plan.stride + 2] ^= 4
    assert _chunks_ok(plan, flipped) == [True, False]
    target = torch.zeros_like(kv)
    for c in range(2):
        scatter_chunk(
            kv_rows(target),
            block_index([1, 4], target.device),
            plan,
            c,
            chunk_view(buf, plan, c, c * plan.stride),
        )
    assert torch.equal(target.view(torch.uint8)[:, [1, 4]], kv.view(torch.uint8)[:, [5, 2]])
    assert not target.view(torch.uint8)[:, [0, 2, 3, 5]].any()


def _ipc_worker(rank: int, endpoints: dict[int, str], replies: Any) -> None:
    try:
        channel = CudaIpcChannel(rank, endpoints)
        expected = torch.arange(4096, dtype=torch.int32, device="cuda") * 7
        if rank == 0:
            channel.send(expected.clone(), 1, tag=5, timeout_s=30.0)
            replies.put(("ok", None))
        else:
            buf = torch.zeros_like(expected)
            channel.recv(buf, 0, tag=5, timeout_s=30.0)
            start = time.monotonic()
            try:
                channel.recv(torch.zeros_like(expected), 0, tag=6, timeout_s=0.5)
                replies.put(("err", "recv without a sender returned"))
            except TimeoutError:
                replies.put(("ok", (torch.equal(buf, expected), time.monotonic() - start)))
        channel.close()
    except Exception:  # noqa: BLE001 (the traceback goes to the test process)
        replies.put(("err", traceback.format_exc()))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_ipc_channel_moves_a_buffer_between_processes_on_one_gpu(tmp_path: Any) -> None:
    ctx = mp.get_context("spawn")
    endpoints = {r: f"ipc://{tmp_path}/ipc-{r}" for r in range(2)}
    replies = [ctx.Queue(), ctx.Queue()]
    procs = [ctx.Process(target=_ipc_worker, args=(r, endpoints, replies[r]), daemon=True) for r in range(2)]
    try:
        for p in procs:
            p.start()
        results = [q.get(timeout=60) for q in replies]
        assert results[0] == ("ok", None), results[0]
        status, (equal, elapsed) = results[1]
        assert status == "ok" and equal and elapsed < 5.5
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


def test_drop_peer_fails_its_transfer_at_once_and_others_go_on() -> None:
    """Ranks: 0 sender S0; 1 receiver R1 + sender S1 (the peer that dies); 2 receiver R2.
    1) R2 fetching from a stalled S1 with a fetch from S0 queued behind: R2.drop_peer(1).
    2) S0 stuck sending to R1 (which is then killed) with R2's fetch queued behind: S0.drop_peer(1).
    Without drop_peer the queued fetch would wait out the 15 s timeouts and fail."""
    os.environ["OMP_NUM_THREADS"] = "1"
    timeout_s = 15.0
    trio = Pair(world_size=3)
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
        trio.call(2, "drop_peer", "R2", 1)
        lost, ok = trio.call(2, "collect", "c"), trio.call(2, "collect", "d")
        assert (lost["ok"], lost["error_type"]) == (False, "TransferPeerLostError") and "rank 1" in lost[
            "error"
        ]
        assert ok["ok"] and ok["elapsed"] < timeout_s / 3
        later = trio.call(1, "offer", "S1", "from-1-later", [6], None)
        trio.call(2, "submit", "R2", "e", later, [15])
        rejected = trio.call(2, "collect", "e")
        assert rejected["error_type"] == "TransferPeerLostError" and rejected["elapsed"] < 1.0
        check_blocks(before, read_kv(trio, 2, "R2", like), "float32", {12: 3, 13: 4, 14: 5})

        # 2) the sender drops a dead receiver it is sending to
        to_dead = trio.call(0, "offer", "S0", "to-1", [7, 8], None)
        to_live = trio.call(0, "offer", "S0", "to-2", [9, 10, 11], None)
        trio.call(0, "fault", "blackhole")
        trio.call(1, "submit", "R1", "a", to_dead, [20, 21])
        assert trio.call(0, "wait_fault", 10.0) is True  # S0 is in its channel send to rank 1
        trio.call(2, "submit", "R2", "b", to_live, [20, 21, 22])
        trio.kill(1)
        trio.call(0, "drop_peer", "S0", 1)
        out = trio.call(2, "collect", "b")
        assert out["ok"] and out["elapsed"] < timeout_s / 3
        assert trio.call(0, "wait_sent", "to-1", 5.0) is False
        assert trio.call(0, "wait_sent", "to-2", 5.0) is True
        [failed] = [r for r in trio.call(0, "results", "S0") if r["request_id"] == "to-1"]
        assert failed["error_type"] == "TransferPeerLostError" and "rank 1" in failed["error"]
        check_blocks(
            before, read_kv(trio, 2, "R2", like), "float32", {12: 3, 13: 4, 14: 5, 20: 9, 21: 10, 22: 11}
        )
    finally:
        trio.close()
