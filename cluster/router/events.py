"""The router's event socket: one ZMQ PULL socket every worker's events come back on, read from the event
loop's selector.

Each time the socket's descriptor signals, the frames at hand are taken without blocking, at most
``MAX_FRAMES_PER_TURN`` a turn of the loop (the rest in a later turn: the descriptor signals edges, so it
will not signal them again), with no future or task step per frame. Each frame is verified and decoded
(cluster/wire.py: a bad one is counted and dropped) and handed to the router's handler; a handler that
raises is logged and the frames after it are still read.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

import zmq

from cluster.wire import EVENTS, Event, WireDecoder, router_recipient

logger = logging.getLogger(__name__)

MAX_FRAMES_PER_TURN = 64  # event frames handled in one turn of the loop before the HTTP edge gets its turn


class EventSocket:
    """The event socket of front-end replica ``replica``'s router, bound on ``bind_host:port`` (0: any free
    port; a restarted replica takes its predecessor's, which the workers' sockets reconnect to by
    themselves); ``handle`` gets every event that verifies.

    Lifecycle: ``run`` (a task on the router's loop) reads until cancelled; ``close`` closes the socket."""

    def __init__(
        self,
        ctx: zmq.Context[zmq.Socket[bytes]],
        secret: bytes,
        replica: int,
        bind_host: str,
        port: int,
        handle: Callable[[Event], None],
    ) -> None:
        self.decoder: WireDecoder[Event] = WireDecoder(secret, router_recipient(replica), EVENTS)
        self._handle = handle
        self._pull = ctx.socket(zmq.PULL)
        self._pull.setsockopt(zmq.LINGER, 0)
        # NOTE: libzmq drops a larger frame while reading its length (the sender's connection is closed)
        # instead of buffering it whole for the verifier to refuse: the verifier's own cap, on the socket
        self._pull.setsockopt(zmq.MAXMSGSIZE, self.decoder.verifier.max_frame_bytes)
        self._pull.bind(f"tcp://{bind_host}:{port or '*'}")
        self.endpoint: str = self._pull.getsockopt_string(zmq.LAST_ENDPOINT)

    async def run(self) -> None:
        """Reads the socket from the loop's selector until cancelled."""
        loop = asyncio.get_running_loop()
        fd = int(self._pull.getsockopt(zmq.FD))
        loop.add_reader(fd, self._take)
        try:
            # NOTE: ZMQ's descriptor signals edges: frames that came before the reader are taken now
            self._take()
            await loop.create_future()
        finally:
            loop.remove_reader(fd)

    def _take(self) -> None:
        """Handles up to MAX_FRAMES_PER_TURN frames; if more wait, a later turn of the loop takes them, so a
        flood of frames cannot keep the HTTP edge from its turn."""
        pull, decode, handle = self._pull, self.decoder.decode, self._handle
        if pull.closed:  # NOTE: a turn scheduled before close()
            return
        for _ in range(MAX_FRAMES_PER_TURN):
            try:
                frame = pull.recv(zmq.NOBLOCK)
            except zmq.Again:
                return
            # NOTE: a failure is logged and the next frame read: one raised out of here would leave the
            # frames at hand unread until another arrives (the descriptor signals edges)
            try:
                event = decode(frame)
                if event is not None:
                    handle(event)
            except Exception:
                logger.exception("router: failed to handle an event frame")
        asyncio.get_running_loop().call_soon(self._take)

    def close(self) -> None:
        self._pull.close(linger=0)
