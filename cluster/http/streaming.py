"""The SSE answer of a streamed plan: :func:`sse_stream` renders a :class:`Fanout`'s deltas as OpenAI
chunks (keep-alive comments while idle, the usage chunk, ``[DONE]``); :class:`ClosingStreamingResponse`
bounds every write by the stall timeout and closes the fanout however the response ends.

NOTE: the edge's hot path, a chunk per token per stream: chunks are rendered by ``SseChunks`` (no dict
or JSON encoder per plain chunk), the events already waiting are written together (one write, the same
bytes), and body writes go straight to the connection (``connections.BodyWriter``) where the server
offers it, with no timer per write (the stall bound is armed only while the connection's buffer is full)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Callable
from typing import Any

import anyio
from fastapi.responses import StreamingResponse

from cluster.http.connections import BODY_WRITER, BodyWriter, ConnectionLost
from cluster.http.errors import as_api_error, error_body
from cluster.http.fanout import Fanout, stalled_error
from cluster.http.metrics import Metrics
from cluster.http.planning import Plan
from cluster.http.responses import SseChunks, choice_builders, sse_event, usage
from cluster.protocol import TokenDelta
from cluster.tokenizer import Tokenizer

KEEPALIVE_S = 15.0  # an SSE comment while idle, so a vanished client is noticed on the next send

logger = logging.getLogger(__name__)


class _ClientStalled(Exception):
    """A write to the client did not complete within the stall timeout."""


class ClosingStreamingResponse(StreamingResponse):
    """A StreamingResponse that runs ``on_close`` however the response ends (done, client gone, stalled,
    error).

    A stalled client: uvicorn's ``send`` waits while the connection's write buffer is above its
    high-water mark (flow control), so a client that reads nothing shows up as a send that does not
    return; after ``stream_stall_timeout_s`` of that the response ends and ``on_close`` aborts the
    stream's requests everywhere. NOTE: uvicorn then closes the transport, which waits to flush: a
    client that never reads keeps its socket (and at most its ~64 KiB write buffer) until it goes away.

    NOTE: a generator's own ``finally`` never runs if the response fails before its first iteration.
    """

    def __init__(
        self,
        content: AsyncIterator[bytes],
        on_close: Fanout,
        headers: dict[str, str] | None = None,
        on_complete: Callable[[], None] | None = None,
    ) -> None:
        """``on_complete``: called once the whole answer is written, just before the message that ends
        it, so what it gives back (the tenant's lease) is free before the client can see the end and
        send its next request."""
        super().__init__(
            content, media_type="text/event-stream", headers={"Cache-Control": "no-cache", **(headers or {})}
        )
        self.fanout = on_close
        self.writer: BodyWriter | None = None
        self.on_complete = on_complete

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        stall_s = self.fanout.limits.stall_timeout_s
        self.writer = scope.get("extensions", {}).get(BODY_WRITER)

        async def bounded_send(message: Any) -> None:
            if (
                self.on_complete is not None
                and message["type"] == "http.response.body"
                and not message.get("more_body", False)
            ):
                self.on_complete()
            try:
                async with asyncio.timeout(stall_s):
                    await send(message)
            except TimeoutError:
                raise _ClientStalled from None

        try:
            if self.writer is None:
                await super().__call__(scope, receive, bounded_send)
            else:
                # NOTE: a client gone mid-stream ends the answer here, as Starlette's disconnect listener does
                with contextlib.suppress(ConnectionLost):
                    await self.writer.run(self.stream_response(bounded_send))
        except _ClientStalled:
            error = stalled_error(self.fanout.limits, "its client read nothing")
            self.fanout.metrics.observe_error(error.status, error.code)
            logger.warning("%s (%d choices)", error.message, len(self.fanout.tasks))
        finally:
            with anyio.move_on_after(30, shield=True):
                await self.fanout.close()

    async def stream_response(self, send: Any) -> None:
        writer = self.writer
        if writer is None:
            await super().stream_response(send)
            return
        await send({"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers})
        self.fanout.body_writer = writer
        stall_s = self.fanout.limits.stall_timeout_s
        async for chunk in self.body_iterator:
            self.fanout.flush_direct()  # NOTE: what the fanout rendered came first
            if writer.is_paused:  # NOTE: as uvicorn's send: wait for room before writing, within the bound
                try:
                    async with asyncio.timeout(stall_s):
                        await writer.drain()
                except TimeoutError:
                    raise _ClientStalled from None
            writer.write(chunk.encode(self.charset) if isinstance(chunk, str) else bytes(chunk))
        self.fanout.flush_direct()
        await send({"type": "http.response.body", "body": b"", "more_body": False})


async def sse_stream(
    plan: Plan,
    fanout: Fanout,
    first: tuple[int, TokenDelta | BaseException],
    tokenizer: Tokenizer | None,
    metrics: Metrics,
) -> AsyncIterator[bytes]:
    """The SSE events of ``plan``, starting from its ``first`` event (already awaited by the caller).
    Each yield is one event or several (the events already waiting, rendered together)."""
    choices = choice_builders(plan, tokenizer)
    chunks = SseChunks(plan, choices)
    if plan.kind == "chat":
        for i in choices:
            role = {
                "index": i,
                "delta": {"role": "assistant", "content": ""},
                "logprobs": None,
                "finish_reason": None,
            }
            yield sse_event({**chunks.envelope, "choices": [role], **chunks.usage})
    remaining = len(choices)
    item: tuple[int, TokenDelta | BaseException] | None = first
    queue = fanout.queue
    fanout.chunks = chunks  # NOTE: from here on every chunk is rendered by it, here or by the fanout
    while remaining:
        if item is None:
            yield b": keep-alive\n\n"
        else:
            events: list[bytes] = []
            failed = False
            while True:
                index, event = item
                if isinstance(event, BaseException):
                    error = as_api_error(event)
                    metrics.observe_error(error.status, error.code)
                    events.append(sse_event(error_body(error)))
                    failed = True
                    break
                events.append(chunks.chunk(index, event))
                remaining -= event.finish_reason is not None
                if not remaining or queue.empty():
                    break
                item = queue.get_nowait()
            yield events[0] if len(events) == 1 else b"".join(events)
            if failed:
                break
        if remaining:
            item = await fanout.next(KEEPALIVE_S)
    fanout.chunks = None
    if remaining == 0 and plan.include_usage:
        yield sse_event({**chunks.envelope, "choices": [], "usage": usage(plan, choices)})
    yield b"data: [DONE]\n\n"
