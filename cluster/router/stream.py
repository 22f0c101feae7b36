"""One request's output on its way from the router to whoever asked for it: :class:`RequestStream`.

The router puts each delta of a request into its stream while it handles the worker's frame (on the
router's loop, in ``Router._on_event``); the consumer takes it. What the consumer has not taken yet is
merged: token ids and text appended, logprobs appended, the latest finish, error, timings and cached
count kept, the first delta's scheduled time and prompt logprobs kept (vLLM's ``RequestOutputCollector``
does the same). A consumer that keeps up takes each step's delta as it came; one that falls behind holds
one merged output per request, its token ids in one machine-int array and its text in a few strings
(never an object per token), and the router aborts the request once that output passes the consumer's
bound (``max_unread_bytes``).

A consumer is told of output in one of two ways:

* a :class:`OutputListener` (the HTTP edge): ``on_output`` is called on the loop, from the router's
  frame handling, for every delta as it arrives and once when the stream fails; it must not call back
  into the router (it notes the output and takes it later in the same turn of the loop);
* none: the stream is an async iterator of merged deltas (``Router.generate``), waking its reader with
  one future, made only when the reader finds nothing to take.

Lifecycle: the router ends a stream (its final delta, or ``fail``) and then forgets the request; the
consumer calls ``close()`` when it leaves, which aborts the request everywhere if it has not ended.
"""

from __future__ import annotations

import asyncio
from array import array
from collections.abc import Callable
from typing import Protocol

from cluster.protocol import TokenDelta, TokenLogprobs, delta_nbytes

# NOTE: a lagging stream's text pieces are joined once this many wait, so it holds a few strings, not a
# string per token
_MAX_TEXT_PIECES = 64


class OutputListener(Protocol):
    """What a stream tells of its output, as it arrives (see the module docstring)."""

    def on_output(self, stream: RequestStream, delta: TokenDelta | None) -> None:
        """``delta``: what just arrived, before it was merged into the untaken output (None: the stream
        failed; ``stream.error`` says how). Called on the router's loop; must not call into the router."""


class _Merged:
    """More than one untaken delta, merged (see the module docstring)."""

    __slots__ = ("first", "last", "logprobs", "texts", "token_ids")

    def __init__(self, first: TokenDelta) -> None:
        self.first = self.last = first
        self.token_ids = array("q", first.token_ids)
        self.texts = [first.text] if first.text else []
        self.logprobs: list[TokenLogprobs] | None = list(first.logprobs) if first.logprobs else None

    def add(self, delta: TokenDelta) -> None:
        self.last = delta
        self.token_ids.extend(delta.token_ids)
        if delta.text:
            texts = self.texts
            texts.append(delta.text)
            if len(texts) >= _MAX_TEXT_PIECES:
                texts[:] = ["".join(texts)]
        if delta.logprobs:
            if self.logprobs is None:
                self.logprobs = []
            self.logprobs += delta.logprobs

    def delta(self, request_id: str) -> TokenDelta:
        first, last = self.first, self.last
        return TokenDelta(
            request_id,
            self.token_ids.tolist(),
            "".join(self.texts),
            self.logprobs,
            last.finish_reason,
            last.num_cached_tokens,
            last.error,
            last.timings,
            first.scheduled_time,
            first.prompt_logprobs,
        )


class RequestStream:
    """One request's output not yet taken by its consumer (see the module docstring).

    ``max_unread_bytes``: the bound on what the consumer may leave untaken, counted once: this stream's
    untaken output (``protocol.delta_nbytes`` of each delta in it) plus ``unread_elsewhere()`` (what the
    consumer holds of it itself, such as a connection's write buffer); None: no bound.
    """

    __slots__ = (
        "_merged",
        "_on_close",
        "_one",
        "_waiter",
        "error",
        "is_closed",
        "is_finished",
        "listener",
        "max_unread_bytes",
        "num_unread_bytes",
        "request_id",
        "unread_elsewhere",
    )

    def __init__(
        self,
        request_id: str,
        listener: OutputListener | None = None,
        *,
        max_unread_bytes: int | None = None,
        unread_elsewhere: Callable[[], int] | None = None,
    ) -> None:
        self.request_id = request_id
        self.listener = listener
        self.max_unread_bytes = max_unread_bytes
        self.unread_elsewhere = unread_elsewhere
        self.num_unread_bytes = 0
        self.error: BaseException | None = None
        self.is_finished = False  # its final delta arrived
        self.is_closed = False  # its consumer left
        self._one: TokenDelta | None = None  # the untaken output while it is one delta as it came
        self._merged: _Merged | None = None  # ... or several, merged
        self._waiter: asyncio.Future[None] | None = None
        # what close() does to the request (the router's: abort it everywhere if it has not ended)
        self._on_close: Callable[[], None] | None = None

    @property
    def is_ended(self) -> bool:
        """Nothing more will arrive: it finished or failed."""
        return self.is_finished or self.error is not None

    @property
    def has_output(self) -> bool:
        return self._one is not None or self._merged is not None

    # ---- the router's side --------------------------------------------------------------------------
    def put(self, delta: TokenDelta) -> bool:
        """Add ``delta`` to the untaken output and tell the consumer; True when the untaken output now
        passes ``max_unread_bytes`` (the router then aborts the request: ``fail``). Ignored once ended."""
        if self.is_ended or self.is_closed:
            return False
        was_behind = self.has_output
        if self._merged is not None:
            self._merged.add(delta)
        elif self._one is not None:
            self._merged = _Merged(self._one)
            self._merged.add(delta)
            self._one = None
        else:
            self._one = delta
        self.num_unread_bytes += delta_nbytes(delta)
        if delta.finish_reason is not None:
            self.is_finished = True
        self._tell(delta)
        limit = self.max_unread_bytes
        if limit is None or self.is_finished:
            return False
        unread = self.num_unread_bytes
        if was_behind and self.unread_elsewhere is not None:
            unread += self.unread_elsewhere()
        return unread > limit

    def fail(self, error: BaseException) -> None:
        """End the stream with ``error``, after the output it holds. Ignored once ended."""
        if self.is_ended or self.is_closed:
            return
        self.error = error
        self._tell(None)

    def _tell(self, delta: TokenDelta | None) -> None:
        listener = self.listener
        if listener is not None:
            listener.on_output(self, delta)
            return
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    def on_close(self, action: Callable[[], None]) -> None:
        """What ``close()`` does to the request (the router sets it when it takes the request)."""
        self._on_close = action

    # ---- the consumer's side ------------------------------------------------------------------------
    def take(self) -> TokenDelta | None:
        """The output not taken yet, merged into one delta; None when there is none (then ``error``, if
        set, is how the stream ended)."""
        one = self._one
        if one is not None:
            self._one = None
            self.num_unread_bytes = 0
            return one
        merged = self._merged
        if merged is None:
            return None
        self._merged = None
        self.num_unread_bytes = 0
        return merged.delta(self.request_id)

    def close(self) -> None:
        """The consumer leaves (idempotent): the untaken output is dropped and, if the request has not
        ended, it is aborted everywhere."""
        if self.is_closed:
            return
        self.is_closed = True
        self._one = self._merged = None
        self.num_unread_bytes = 0
        action, self._on_close = self._on_close, None
        if action is not None:
            action()

    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> TokenDelta:
        """The next merged output (without a listener); raises the error that ended the stream, and
        StopAsyncIteration after the final delta."""
        while True:
            delta = self.take()
            if delta is not None:
                return delta
            if self.error is not None:
                raise self.error
            if self.is_finished or self.is_closed:
                raise StopAsyncIteration
            waiter = self._waiter
            if waiter is None or waiter.done():
                waiter = self._waiter = asyncio.get_running_loop().create_future()
            await waiter
