"""Bounded HTTP connections: the uvicorn h11 protocol with a request-head deadline, a request-body
deadline and a cap on open connections, so slow or stalled clients cannot hold sockets forever.

uvicorn itself bounds only the idle time between requests (``timeout_keep_alive``); a client that sends
half a request head, or a head and then part of its body, keeps its connection (and a file descriptor)
open indefinitely, and ``limit_concurrency`` answers 503 only once a full head has arrived. Here:

* head: a connection must deliver each complete request head within ``header_timeout_s`` of the moment
  the server starts waiting for it (the connection opening, or the previous response ending); else the
  connection is answered 408 and closed;
* body: a request's body must arrive in full within ``body_timeout_s`` of its head; else 408 and close
  (the route reading it sees a disconnect, which the edge answers quietly);
* cap: a connection beyond ``max_connections`` open ones is answered 503 (Retry-After) and closed at once.

Each request's scope also carries a :class:`BodyWriter` (``scope["extensions"][BODY_WRITER]``): a
streaming response writes its body chunks with it straight to the transport, as uvicorn's ``send`` would
(same bytes, same flow control), without an ASGI message and an h11 event per chunk. Under any other ASGI
server, :class:`AsgiWriter` is the same :class:`Writer` over plain ASGI messages (``writer_for``).
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar, cast

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol, RequestResponseCycle

BODY_WRITER = "pdserve.body_writer"  # the scope extension that holds a request's BodyWriter
T = TypeVar("T")


class ConnectionLost(Exception):
    """The client's connection closed while ``BodyWriter.run`` awaited its work."""


@dataclass(frozen=True)
class ConnectionLimits:
    """Per-connection bounds of the edge (``server:`` config); 0 turns ``max_connections`` off."""

    max_connections: int = 1024
    header_timeout_s: float = 10.0
    body_timeout_s: float = 30.0
    keep_alive_timeout_s: float = 5.0


class Writer(Protocol):
    """How an answer writes its body to its client (the response head is sent through ASGI first)."""

    @property
    def is_paused(self) -> bool:
        """The connection's buffer is full (a client that does not read): write nothing until ``drain``."""

    @property
    def num_buffered_bytes(self) -> int:
        """Bytes written and not yet taken by the client's connection."""

    def write(self, data: bytes) -> None: ...

    async def drain(self) -> None:
        """Until the connection takes writes again (the caller bounds the wait)."""

    async def run(self, work: Awaitable[T]) -> T:
        """Await ``work``; ConnectionLost (and ``work`` cancelled) if the client goes away first."""

    def abandon(self) -> None:
        """The client reads nothing: close its connection now, dropping what is buffered for it."""


class BodyWriter:
    """Writes one response's body chunks to its connection, between the response's start and its last
    body message (both still sent through ASGI ``send``): each ``write`` frames its bytes as h11 would
    (a chunk of chunked encoding to an HTTP/1.1 client, raw to HTTP/1.0) and hands them to the
    transport. Flow control is the caller's: ``is_paused`` while the transport's buffer is past its
    high-water mark (a client that does not read), and ``drain()`` until it is not; a disconnected
    client's writes are dropped, as uvicorn's ``send`` drops them."""

    def __init__(self, cycle: RequestResponseCycle) -> None:
        self._cycle = cycle
        self._is_chunked = (cycle.conn.their_http_version or b"1.0") >= b"1.1"
        self._is_head = cycle.scope["method"] == "HEAD"
        self.is_lost = False  # the connection closed before the response was complete
        self._on_loss: asyncio.Task[Any] | None = None

    async def run(self, work: Awaitable[T]) -> T:
        """Await ``work`` on the calling task; if the connection is lost first (or already is), the task
        is cancelled there and ``ConnectionLost`` raised instead. NOTE: what Starlette's disconnect
        listener does, without a task group and a listener task per response."""
        task = asyncio.current_task()
        assert task is not None
        self._on_loss = task
        try:
            if self._cycle.disconnected:
                self.lost()
            return await work
        except asyncio.CancelledError:
            if not self.is_lost or task.uncancel() > 0:  # NOTE: also cancelled from elsewhere: let it through
                raise
            raise ConnectionLost from None
        finally:
            self._on_loss = None

    def abandon(self) -> None:
        """Close the connection now, its buffered bytes dropped (a client that reads nothing would
        otherwise keep its socket and buffer until it goes away); the response counts as disconnected."""
        cycle = self._cycle
        cycle.disconnected = True
        cycle.transport.abort()

    def lost(self) -> None:
        """The connection is gone (the protocol calls it)."""
        self.is_lost = True
        task, self._on_loss = self._on_loss, None
        if task is not None:
            task.cancel()

    @property
    def is_paused(self) -> bool:
        return self._cycle.flow.write_paused and not self._cycle.disconnected

    @property
    def num_buffered_bytes(self) -> int:
        transport = self._cycle.transport
        return 0 if transport.is_closing() else transport.get_write_buffer_size()

    async def drain(self) -> None:
        await self._cycle.flow.drain()

    def write(self, data: bytes) -> None:
        cycle = self._cycle
        if cycle.disconnected or not data or self._is_head:
            return
        if not cycle.response_started or cycle.response_complete:
            raise RuntimeError("BodyWriter.write outside a started, unfinished response")
        cycle.transport.write(b"%x\r\n%b\r\n" % (len(data), data) if self._is_chunked else data)


class AsgiWriter:
    """A :class:`Writer` over plain ASGI messages, for a server that is not pdserve's (an ASGI test
    transport, say): what ``write`` takes waits until ``drain`` sends it as one ``http.response.body``
    message, and counts as a full buffer meanwhile, so the answer's task drains it within the stall bound
    like any full connection. ``run`` watches ``receive`` for the client's disconnect."""

    def __init__(
        self, receive: Callable[[], Awaitable[Any]], send: Callable[[Any], Awaitable[None]] | None = None
    ):
        self._receive = receive
        self.send = send  # set once the response starts
        self._pending: list[bytes] = []

    @property
    def is_paused(self) -> bool:
        return bool(self._pending)

    @property
    def num_buffered_bytes(self) -> int:
        return sum(map(len, self._pending))

    def write(self, data: bytes) -> None:
        if data:
            self._pending.append(data)

    def abandon(self) -> None:
        self._pending.clear()  # NOTE: plain ASGI cannot close a connection; the server does once we return

    async def drain(self) -> None:
        if self.send is None:
            raise RuntimeError("AsgiWriter.drain before the response started")
        data, self._pending = b"".join(self._pending), []
        await self.send({"type": "http.response.body", "body": data, "more_body": True})

    async def run(self, work: Awaitable[T]) -> T:
        task = asyncio.ensure_future(work)

        async def watch() -> None:
            # NOTE: the body is read by now, so the next ASGI message is the disconnect, which the server
            # sends the moment the connection drops
            while (await self._receive())["type"] != "http.disconnect":
                pass

        watcher = asyncio.ensure_future(watch())
        try:
            done, _ = await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
            if task in done:
                return task.result()
            raise ConnectionLost
        finally:
            watcher.cancel()
            task.cancel()


def writer_for(scope: Any, receive: Callable[[], Awaitable[Any]]) -> Writer:
    """The request's writer from its connection (``BODY_WRITER``: pdserve's connections), else an
    :class:`AsgiWriter`."""
    writer = scope.get("extensions", {}).get(BODY_WRITER)
    return cast(Writer, writer) if writer is not None else AsgiWriter(receive)


def _plain_response(status_line: bytes, extra_headers: bytes, message: str) -> bytes:
    body = message.encode()
    return (
        b"HTTP/1.1 "
        + status_line
        + b"\r\ncontent-type: text/plain; charset=utf-8\r\n"
        + extra_headers
        + b"connection: close\r\ncontent-length: "
        + str(len(body)).encode()
        + b"\r\n\r\n"
        + body
    )


class BoundedH11Protocol(H11Protocol):
    """uvicorn's h11 protocol with the bounds of ``limits`` (a class attribute: uvicorn builds one
    protocol per connection from the class; :func:`bounded_protocol` makes a class per server).

    Lifecycle: at most one head timer and one body timer are armed; both are cancelled when the
    connection is lost, so a closed connection leaves no timer behind."""

    limits = ConnectionLimits()

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.timeout_keep_alive = self.limits.keep_alive_timeout_s  # type: ignore[assignment]
        self._head_timer: asyncio.TimerHandle | None = None
        self._body_timer: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        cap = self.limits.max_connections
        if cap and len(self.connections) > cap:
            # NOTE: answered before any byte is read; a client at the cap learns why and when to retry,
            # and the socket is freed now rather than after a head timeout.
            transport.write(
                _plain_response(
                    b"503 Service Unavailable", b"retry-after: 1\r\n", "too many open connections to pdserve"
                )
            )
            transport.close()
            return
        self._track()

    def connection_lost(self, exc: Exception | None) -> None:
        self._cancel_timers()
        super().connection_lost(exc)
        cycle = self.cycle
        if cycle is not None and cycle.disconnected:
            writer = cycle.scope.get("extensions", {}).get(BODY_WRITER)
            if isinstance(writer, BodyWriter):
                writer.lost()

    def handle_events(self) -> None:
        super().handle_events()
        cycle = self.cycle
        if cycle is not None:
            # NOTE: the request's task has not started yet: its scope has the writer before the app runs
            extensions = cast(dict[str, Any], cycle.scope.setdefault("extensions", {}))
            if BODY_WRITER not in extensions:
                extensions[BODY_WRITER] = BodyWriter(cycle)
        self._track()

    def _track(self) -> None:
        """Arm or cancel the head and body timers for where the client now is in its request."""
        if self.transport is None or self.transport.is_closing():
            self._cancel_timers()
            return
        state = self.conn.their_state
        if state is h11.IDLE:
            if self._head_timer is None:
                self._head_timer = self.loop.call_later(self.limits.header_timeout_s, self._head_timed_out)
        elif self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None
        if state is h11.SEND_BODY:
            if self._body_timer is None:
                self._body_timer = self.loop.call_later(self.limits.body_timeout_s, self._body_timed_out)
        elif self._body_timer is not None:
            self._body_timer.cancel()
            self._body_timer = None

    def _cancel_timers(self) -> None:
        for timer in (self._head_timer, self._body_timer):
            if timer is not None:
                timer.cancel()
        self._head_timer = self._body_timer = None

    def _head_timed_out(self) -> None:
        self._head_timer = None
        if self.transport.is_closing() or self.conn.their_state is not h11.IDLE:
            return
        self._close_with_408("request head not received within header_timeout_s\n")

    def _body_timed_out(self) -> None:
        self._body_timer = None
        if self.transport.is_closing() or self.conn.their_state is not h11.SEND_BODY:
            return
        cycle = self.cycle
        if cycle is not None and not cycle.response_started:
            # NOTE: the route still waits for the body: it sees a disconnect (answered quietly) and its
            # own response goes nowhere; the client gets this 408 instead.
            cycle.disconnected = True
            cycle.message_event.set()
            self._close_with_408("request body not received within body_timeout_s\n")
        else:
            self.transport.close()

    def _close_with_408(self, message: str) -> None:
        self.transport.write(_plain_response(b"408 Request Timeout", b"", message))
        self.transport.close()


def bounded_protocol(limits: ConnectionLimits) -> type[BoundedH11Protocol]:
    """A :class:`BoundedH11Protocol` class bound to ``limits`` (uvicorn's ``http=`` setting)."""
    return type("BoundedH11Protocol", (BoundedH11Protocol,), {"limits": limits})
