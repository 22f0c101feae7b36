"""The SSE answer of a streamed plan: :class:`SseResponse` sends the response head, hands its connection's
:class:`~cluster.http.connections.Writer` to the plan's :class:`~cluster.http.answer.Answer` (which writes
every chunk from then on, ``[DONE]`` included) and waits until the answer is written: woken only to drain a
full connection (within ``stream_stall_timeout_s``) and at the end, never per token. However it ends
(done, client gone, stalled, error) it closes the answer, which aborts what did not finish.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable
from typing import Any

from starlette.responses import Response
from starlette.types import Receive, Scope, Send

from cluster.http.answer import Answer, ClientStalled, stalled_error
from cluster.http.connections import AsgiWriter, ConnectionLost, writer_for

logger = logging.getLogger(__name__)


class SseResponse(Response):
    """A ``text/event-stream`` response whose body ``answer`` writes (see the module docstring).

    ``on_complete``: called once the whole answer is written, just before the message that ends it, so
    what it gives back (the tenant's lease) is free before the client can see the end and send its next
    request.

    A stalled client: its connection's buffer stays full; after ``stream_stall_timeout_s`` of that the
    response ends, the answer's requests are aborted everywhere and the connection is closed at once, what
    was buffered for it dropped (``Writer.abandon``).
    """

    media_type = "text/event-stream"

    def __init__(
        self,
        answer: Answer,
        headers: dict[str, str] | None = None,
        on_complete: Callable[[], None] | None = None,
    ) -> None:
        # NOTE: no super().__init__: the body is the answer's, written as it comes (no content-length)
        self.answer, self.on_complete = answer, on_complete
        self.status_code, self.background = 200, None
        self.init_headers({"Cache-Control": "no-cache", **(headers or {})})

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        answer = self.answer
        stall_s = answer.limits.stall_timeout_s
        writer = writer_for(scope, receive)
        if isinstance(writer, AsgiWriter):
            writer.send = send

        async def bounded_send(message: Any) -> None:
            try:
                async with asyncio.timeout(stall_s):
                    await send(message)
            except TimeoutError:
                raise ClientStalled from None

        async def respond() -> None:
            await bounded_send(
                {"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers}
            )
            answer.attach(writer)
            await answer.written()
            if self.on_complete is not None:
                self.on_complete()
            await bounded_send({"type": "http.response.body", "body": b"", "more_body": False})

        try:
            # NOTE: a client gone mid-stream ends the answer here
            with contextlib.suppress(ConnectionLost):
                await writer.run(respond())
        except ClientStalled:
            writer.abandon()
            error = stalled_error(answer.limits, "its client read nothing")
            answer.metrics.observe_error(error.status, error.code)
            logger.warning("%s (%d choices)", error.message, len(answer.choices))
        finally:
            answer.close()
