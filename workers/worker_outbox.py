"""A worker's outgoing events: every frame it sends its routers goes through its ``Outbox``.

The frames go out on the worker's ``RouterLinks`` (workers/router_links.py: a PUSH socket per router,
each request's events to the router that owns it, never blocking). The step thread, the detokenizer
thread (a step's ``Deltas``) and a dying thread (its last words, ``WorkerFailed``) all send; each frame is
signed and queued under one lock, so every router gets a worker's frame counters in order (it rejects a
counter at or below the last as a replay). The requests whose events were dropped (their router is down
or not reading) are aborted: an ``Abort`` posted to the step thread, since nobody would hear them.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from typing import Any

import zmq

from cluster.protocol import ErrorCode, TokenDelta
from cluster.wire import Abort, Deltas, Event, RequestFailed, WireEncoder
from workers.router_links import RouterLinks

# NOTE: bounds a Deltas frame (a one-token delta with 20 logprobs is ~0.5 KB) far below max_frame_bytes
_DELTAS_PER_FRAME = 512


class Outbox:
    """See the module docstring. ``post`` queues a command for the step thread (any thread may call it).
    Closed by ``close`` (shutdown) or by the last words (``send`` with ``last_words_s``): then silent."""

    def __init__(
        self, worker_id: str, endpoints: Sequence[str], secret: bytes, post: Callable[[object], None]
    ) -> None:
        self.worker_id = worker_id
        # NOTE: a context of its own, so the last words can be flushed by terminating it (see send)
        self._ctx: zmq.Context[Any] = zmq.Context()
        self.links = RouterLinks(endpoints, WireEncoder(secret), self._ctx)
        self._lock = threading.Lock()
        self._silent = False  # the last words were said (or the worker shut down): nothing more goes out
        self._post = post

    def send(self, message: Event, last_words_s: float | None = None) -> None:
        """Send one frame to the router(s) it is for. ``last_words_s``: it is the last one; wait (bounded)
        till it left the process, for the process may exit next (a frame still queued in ZMQ would die)."""
        with self._lock:
            if self._silent:
                return
            # NOTE: signed under the lock: the frame counter must reach the router in order (it rejects
            # a counter at or below the last as a replay), and the step thread, the detokenizer thread
            # and a dying thread all send.
            dropped = self.links.send(message)
            if last_words_s is None:
                for rid in dropped:  # NOTE: their router cannot hear them: free them (on the step thread)
                    self._post(Abort(rid))
                return
            # NOTE: a socket closed with a linger keeps sending its queue until the linger ends, and
            # terminating its context waits for that (a message tracker would not: ZMQ copies small
            # frames and reports them done at once).
            self._silent = True
            self.links.close(linger_ms=int(last_words_s * 1000))
            self._ctx.term()

    def send_to(self, replica: int, messages: list[Event]) -> None:
        """Send ``messages`` to router ``replica`` only, whoever owns their requests (a router whose
        lease ran out is told what was freed, in case it is only slow); what it cannot take is dropped."""
        with self._lock:
            for message in messages:
                if not self._silent:
                    self.links.send_to(replica, message)

    def send_deltas(self, deltas: list[TokenDelta]) -> None:
        """Deltas to the router in ``Deltas`` frames of at most _DELTAS_PER_FRAME (the stage's thread)."""
        for start in range(0, len(deltas), _DELTAS_PER_FRAME):
            self.send(Deltas(self.worker_id, deltas[start : start + _DELTAS_PER_FRAME]))

    def fail_request(self, request_id: str, code: ErrorCode, message: str) -> None:
        self.send(RequestFailed(self.worker_id, request_id, code, message))

    def close(self) -> None:
        with self._lock:
            self._silent = True
            self.links.close()
            self._ctx.term()
