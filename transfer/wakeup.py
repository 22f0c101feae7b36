"""Wakeup: lets any thread cut short a transfer thread's poll of its ZMQ sockets.

A transfer thread waits for frames with ``zmq.Poller``; work handed to it from another thread (an offer
that a parked fetch was waiting for, a fetch posted early, a cancellation) must not wait out the poll
interval. ``set`` writes a byte to a pipe whose read end sits in the same poller; ``drain`` empties it.
"""

from __future__ import annotations

import contextlib
import os
import threading

import zmq


class Wakeup:
    """A self-pipe to register in a ``zmq.Poller``. ``set`` is safe from any thread (and after ``close``,
    where it does nothing); ``drain`` and ``close`` belong to the polling thread."""

    def __init__(self) -> None:
        self._read_fd, self._write_fd = os.pipe()
        os.set_blocking(self._read_fd, False)
        os.set_blocking(self._write_fd, False)
        self._lock = threading.Lock()
        self._is_closed = False

    def register(self, poller: zmq.Poller) -> None:
        poller.register(self._read_fd, zmq.POLLIN)

    def set(self) -> None:
        # NOTE: under the lock, so a closed (and maybe reused) fd number is never written to; a full pipe
        # already wakes the poller.
        with self._lock, contextlib.suppress(BlockingIOError):
            if not self._is_closed:
                os.write(self._write_fd, b"\0")

    def drain(self) -> None:
        with contextlib.suppress(BlockingIOError, OSError):
            while os.read(self._read_fd, 4096):
                pass

    def is_set(self, events: dict[object, int]) -> bool:
        """Whether a ``dict(poller.poll())`` result includes this wakeup."""
        return self._read_fd in events

    def close(self) -> None:
        with self._lock:
            if self._is_closed:
                return
            self._is_closed = True
            os.close(self._read_fd)
            os.close(self._write_fd)
