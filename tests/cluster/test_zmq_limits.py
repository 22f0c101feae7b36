"""issue 31 row 4: every receiving ZMQ socket pdserve creates has ZMQ_MAXMSGSIZE, so libzmq drops an
oversized frame as it reads its length (closing that connection) instead of buffering it whole for the
frame verifier to refuse; the socket keeps serving the other connections."""

from __future__ import annotations

import asyncio
import os
import sys
import textwrap
from typing import Any

import torch
import zmq

from cluster.config import EngineConfig, TransferConfig
from cluster.frames import DEFAULT_MAX_FRAME_BYTES, new_secret
from cluster.router.router import Router
from cluster.wire import WorkerControl
from tests.support.fake_workers import FakeWorkers, run, until
from transfer.channel import MAX_IPC_MESSAGE_BYTES
from transfer.handshake import MAX_HANDSHAKE_FRAME_BYTES
from transfer.pairs import PairChannel
from transfer.peers import PeerId
from transfer.receiver import KVReceiver
from transfer.sender import KVSender
from workers.worker import EngineWorker

BIG_FRAME_BYTES = 400 << 20
STRANGER_TIMEOUT_S = 30.0

# NOTE: a process without the secret: pushes one 400 MiB frame, then says whether the receiver closed the
# connection (libzmq does so when a frame is over its MAXMSGSIZE) before the bound.
STRANGER = textwrap.dedent(
    """
    import sys, time, zmq
    from zmq.utils.monitor import recv_monitor_message
    endpoint, nbytes, timeout_s = sys.argv[1], int(sys.argv[2]), float(sys.argv[3])
    ctx = zmq.Context()
    sock = ctx.socket(zmq.PUSH)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.RECONNECT_IVL, -1)  # NOTE: one connection: its drop is the answer
    monitor = sock.get_monitor_socket(zmq.EVENT_DISCONNECTED)
    sock.connect(endpoint)
    sock.send(b"x" * nbytes)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if monitor.poll(100) and recv_monitor_message(monitor)["event"] == zmq.EVENT_DISCONNECTED:
            print("dropped", flush=True)
            break
    else:
        print("kept", flush=True)
    """
)


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


async def stranger_push(endpoint: str, nbytes: int) -> str:
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-c", STRANGER, endpoint, str(nbytes), str(STRANGER_TIMEOUT_S),
        stdout=asyncio.subprocess.PIPE,
    )  # fmt: skip
    out, _ = await asyncio.wait_for(proc.communicate(), STRANGER_TIMEOUT_S + 30)
    return out.decode().strip()


def test_issue31_row4_router_pull_drops_a_400_mib_frame_unbuffered_and_keeps_serving() -> None:
    async def scenario(router: Router, fakes: FakeWorkers) -> None:
        await fakes.add("prefill-0", "prefill")
        before = rss_bytes()
        assert await stranger_push(router.endpoint, BIG_FRAME_BYTES) == "dropped"
        grown = rss_bytes() - before
        # NOTE: on a PULL without the cap the whole frame is read into memory (RSS +400 MiB), then refused
        assert grown < 64 << 20, f"router process grew {grown >> 20} MiB on a dropped frame"
        await fakes.push.send(b"PDC1" + b"\0" * 64)  # a bad-MAC frame on a sound connection: still read
        await until(lambda: router.rejected_frames().get("bad_mac") == 1, "the next frame counted")
        await fakes.add("decode-0", "decode")  # the router still admits workers

    run(scenario, rejected={"bad_mac": 1})


def test_issue31_row4_every_receiving_socket_has_its_cap() -> None:
    assert DEFAULT_MAX_FRAME_BYTES == 32 << 20 and MAX_HANDSHAKE_FRAME_BYTES == 64 << 10
    ctx: zmq.Context[Any] = zmq.Context()
    kv = torch.zeros(2, 8, 2, 4, 2, 8)
    channel = PairChannel("127.0.0.1")
    sender = KVSender(kv, me=PeerId("p", "0"), channel=channel, secret=new_secret(),
                      on_sent=lambda rid, ok: None, zmq_context=ctx)  # fmt: skip
    receiver = KVReceiver(kv, me=PeerId("d", "0"), channel=channel, secret=new_secret(), zmq_context=ctx)
    try:
        assert sender._sock.getsockopt(zmq.MAXMSGSIZE) == MAX_HANDSHAKE_FRAME_BYTES
        dealer = receiver._dealer(sender.endpoint)
        assert dealer.getsockopt(zmq.MAXMSGSIZE) == MAX_HANDSHAKE_FRAME_BYTES
    finally:
        sender.close()
        receiver.close()
        ctx.destroy(linger=0)
    engine = EngineConfig.from_options(device="cpu", block_size=4, num_kv_blocks=16, max_num_seqs=2)
    control = WorkerControl(("tcp://127.0.0.1:1",), heartbeat_interval_s=60.0)
    fatal: list[str] = []  # NOTE: a dead thread must fail the test, not end the test process
    worker = EngineWorker(
        "colocated-0", "colocated", engine, TransferConfig(), new_secret(), control, on_fatal=fatal.append
    )
    try:
        assert worker._pull.getsockopt(zmq.MAXMSGSIZE) == DEFAULT_MAX_FRAME_BYTES
    finally:
        worker.shutdown()
    assert fatal == []
    assert MAX_IPC_MESSAGE_BYTES == 64 << 10  # CudaIpcChannel's PULL (needs a GPU to build)


def test_issue31_row4_kv_sender_drops_an_oversized_handshake_frame_unread() -> None:
    """A 1 MiB frame to a KV sender's handshake socket: its connection is dropped, the frame never reaches
    the verifier (no `too_large`), and the next frame from another connection is read."""
    kv = torch.zeros(2, 8, 2, 4, 2, 8)
    channel = PairChannel("127.0.0.1")
    sender = KVSender(
        kv, me=PeerId("p", "0"), channel=channel, secret=new_secret(), on_sent=lambda r, ok: None
    )
    sender.start()
    ctx: zmq.Context[Any] = zmq.Context()
    try:
        big, small = ctx.socket(zmq.DEALER), ctx.socket(zmq.DEALER)
        big.setsockopt(zmq.RECONNECT_IVL, -1)
        monitor = big.get_monitor_socket(zmq.EVENT_DISCONNECTED)
        for sock in (big, small):
            sock.setsockopt(zmq.LINGER, 0)
            sock.connect(sender.endpoint)
        big.send(b"x" * (1 << 20))
        assert monitor.poll(int(STRANGER_TIMEOUT_S * 1000)), "the oversized frame's connection was kept"
        small.send(b"PDC1" + b"\0" * 64)
        asyncio.run(_poll_until(lambda: sender.rejected_frames().get("bad_mac") == 1))
        assert sender.rejected_frames() == {"bad_mac": 1}
    finally:
        sender.close()
        ctx.destroy(linger=0)


async def _poll_until(condition: Any) -> None:
    await until(condition, "the frame counted")
