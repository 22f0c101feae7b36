"""Running a plan against the router: :class:`Fanout` sends a plan's router requests (n x prompts) and
merges their deltas into one :class:`EventBuffer`, bounded in bytes (``StreamLimits``), recording the
latency metrics as tokens arrive."""

from __future__ import annotations

import asyncio
import logging
import time
import weakref
from collections import deque
from collections.abc import AsyncIterator, Callable
from typing import Protocol, cast

from cluster.http.connections import BodyWriter
from cluster.http.errors import ApiError
from cluster.http.metrics import Metrics
from cluster.http.planning import Plan
from cluster.http.responses import SseChunks
from cluster.http.server_state import RouterLike, StreamLimits
from cluster.protocol import FinishReason, GenerateRequest, RouterError, TokenDelta, delta_nbytes

logger = logging.getLogger(__name__)

Event = tuple[int, TokenDelta | BaseException]  # (choice index, its delta or the error that ended it)
STALLED_CODE = "stream_stalled"


def stalled_error(limits: StreamLimits, what: str) -> ApiError:
    return ApiError(
        499,
        f"stream aborted: {what} for {limits.stall_timeout_s:g} s (stream_stall_timeout_s)",
        code=STALLED_CODE,
    )


class EventBuffer:
    """A fanout's merged events its writer has not taken yet, counted in estimated bytes
    (``protocol.delta_nbytes``). ``put`` never blocks (an error or a final delta always fits); a
    producer ``wait_room``s before it takes another delta from the router, which is how a client that
    does not read stops its stream's generation reaching this process (the router bounds the rest).

    NOTE: a deque and one shared waiter future rather than an asyncio.Queue: its one reader (the
    response's writer) takes what is there without a future per event (a token per stream per step)."""

    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        self.num_bytes = 0
        self._items: deque[tuple[Event, int]] = deque()
        self._waiter: asyncio.Future[None] | None = None
        self._room = asyncio.Event()
        self._room.set()

    def put(self, event: Event, num_bytes: int | None = None) -> None:
        """Queue ``event``; ``num_bytes``: its ``delta_nbytes`` when the caller has it already."""
        if num_bytes is None:
            num_bytes = delta_nbytes(event[1]) if isinstance(event[1], TokenDelta) else 0
        self._items.append((event, num_bytes))
        self.num_bytes += num_bytes
        if self.num_bytes >= self.max_bytes:
            self._room.clear()
        self.wake()

    def wake(self) -> None:
        """Wake whoever waits in ``wait`` (an event arrived, or its keep-alive is due)."""
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    def _took(self, item: tuple[Event, int]) -> Event:
        self.num_bytes -= item[1]
        if self.num_bytes < self.max_bytes and not self._room.is_set():
            self._room.set()
        return item[0]

    async def wait(self) -> None:
        """Until an event is there or ``wake`` is called (returns at once when one is there)."""
        if self._items:
            return
        waiter = self._waiter
        if waiter is None or waiter.done():
            waiter = self._waiter = asyncio.get_running_loop().create_future()
        await waiter

    async def get(self) -> Event:
        while not self._items:
            await self.wait()
        return self._took(self._items.popleft())

    def get_nowait(self) -> Event:
        if not self._items:
            raise asyncio.QueueEmpty
        return self._took(self._items.popleft())

    def empty(self) -> bool:
        return not self._items

    def qsize(self) -> int:
        return len(self._items)

    @property
    def is_full(self) -> bool:
        return not self._room.is_set()

    async def wait_room(self) -> None:
        await self._room.wait()


class _DueFlushes:
    """The fanouts of one event loop that rendered chunks in this turn of the loop: one callback writes
    them all once the turn's frames are handled (not a callback per stream per step)."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self._due: list[Fanout] = []

    def add(self, fanout: Fanout) -> None:
        if not self._due:
            self._loop.call_soon(self._flush)
        self._due.append(fanout)

    def _flush(self) -> None:
        due, self._due = self._due, []
        for fanout in due:
            try:
                fanout.flush_direct()
            except Exception:  # NOTE: one broken connection must not keep the others' chunks back
                logger.exception("writing a stream's chunks failed")


_DUE_FLUSHES: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, _DueFlushes] = weakref.WeakKeyDictionary()


def _due_flushes(loop: asyncio.AbstractEventLoop) -> _DueFlushes:
    flushes = _DUE_FLUSHES.get(loop)
    if flushes is None:
        flushes = _DUE_FLUSHES[loop] = _DueFlushes(loop)
    return flushes


class PushingRouter(Protocol):
    """A router that can hand a request's plain deltas to a sink (``Router.generate_into``)."""

    def generate_into(
        self, req: GenerateRequest, sink: Callable[[TokenDelta], bool]
    ) -> AsyncIterator[TokenDelta]: ...


class _Choice:
    """One choice's stream as its consumer sees it: when its last token came, how many so far."""

    __slots__ = ("last", "num_tokens")

    def __init__(self) -> None:
        self.last: float | None = None
        self.num_tokens = 0


class Fanout:
    """Runs a plan's router requests (n x prompts) as tasks and merges their deltas into one
    :class:`EventBuffer` (``queue``).

    Memory: the buffer holds at most ``limits.buffer_bytes`` (plus one delta per choice); past it the
    tasks take nothing more from the router until the writer makes room, and a task that waited
    ``limits.stall_timeout_s`` for room ends its router stream (aborted everywhere) with a
    ``stream_stalled`` error.

    Lifecycle: ``close()`` must run once the answer is done or abandoned (it is idempotent and must be
    shielded from cancellation): it cancels the consumer tasks, which closes each router stream, then
    awaits ``router.abort`` for every request that did not finish, so a disconnect, an error or a sibling
    choice's failure frees KV blocks everywhere.
    """

    def __init__(
        self,
        router: RouterLike,
        metrics: Metrics,
        plan: Plan,
        arrival: float,
        limits: StreamLimits | None = None,
    ) -> None:
        self.router, self.metrics, self.arrival, self.mode = router, metrics, arrival, router.mode
        self.limits = limits or StreamLimits()
        self.queue = EventBuffer(self.limits.buffer_bytes)
        self.unfinished = {req.request_id for _, req in plan.jobs}
        self.generated: list[int] = []  # tokens of each finished choice (vllm:request_max_num_...)
        self.failed: set[str] = set()
        self.closed = False
        self._loop = asyncio.get_running_loop()
        # the keep-alive of ``next``: one timer per fanout, re-armed only when it fires (not per event)
        self._idle_due: float | None = None
        self._idle_timeout = 0.0
        self._idle_timer: asyncio.TimerHandle | None = None
        self._is_waiting = False  # the writer waits in ``next`` (everything before is written)
        # the SSE answer's renderer and its connection's writer, set once it streams: a pushed delta is
        # then written at once (``_write_direct``)
        self.chunks: SseChunks | None = None
        self.body_writer: BodyWriter | None = None
        self._direct: list[bytes] = []  # rendered, written once this loop iteration's frames are in
        self._is_flush_due = False
        self._due_flushes = _due_flushes(self._loop)
        self._observe_gap = metrics.token_gap_observer(self.mode)
        self.tasks = [asyncio.create_task(self._consume(i, req)) for i, req in plan.jobs]

    def _sink(self, index: int, choice: _Choice) -> Callable[[TokenDelta], bool]:
        """What a router that pushes (``PushingRouter``) hands a choice's plain deltas to, from its
        receive loop: the consumer's own steps for an unfinished delta (the latency metrics, the buffer),
        taken only while it leaves the buffer below its bound, so the consumer task still does every
        step that can wait (for room) or end the stream."""
        queue, observe_gap = self.queue, self._observe_gap

        def push(delta: TokenDelta) -> bool:
            num_bytes = delta_nbytes(delta)
            if queue.num_bytes + num_bytes >= queue.max_bytes:
                return False
            if delta.token_ids:
                now = time.perf_counter()
                if choice.last is None:
                    self.metrics.observe_first_token(now - self.arrival, self.mode)
                else:
                    observe_gap(now - choice.last)
                choice.last, choice.num_tokens = now, choice.num_tokens + len(delta.token_ids)
            if not self._write_direct(index, delta):
                queue.put((index, delta), num_bytes)
            return True

        return push

    def _write_direct(self, index: int, delta: TokenDelta) -> bool:
        """Once the SSE answer set ``chunks`` and ``body_writer``: while its writer waits in ``next`` with
        nothing buffered, a pushed plain delta is rendered here and written when the loop has taken the
        frames at hand (``flush_direct``: one write for them, as the writer would write them after taking
        them from the buffer, without a wake-up of its task); False leaves it to the buffer (the
        connection's buffer is full, say)."""
        chunks, writer = self.chunks, self.body_writer
        if (
            chunks is None
            or writer is None
            or not self._is_waiting
            or not self.queue.empty()
            or writer.is_paused
            or not chunks.is_plain(index, delta)
        ):
            return False
        self._direct.append(chunks.chunk(index, delta))
        if not self._is_flush_due:
            self._is_flush_due = True
            self._due_flushes.add(self)
        if self._idle_due is not None:  # NOTE: the keep-alive counts from the last event
            self._idle_due = self._loop.time() + self._idle_timeout
        return True

    def flush_direct(self) -> None:
        """Write what ``_write_direct`` rendered (the writer calls it before writing anything itself)."""
        self._is_flush_due = False
        if self._direct and self.body_writer is not None:
            data = self._direct[0] if len(self._direct) == 1 else b"".join(self._direct)
            self._direct.clear()
            self.body_writer.write(data)

    async def _consume(self, index: int, req: GenerateRequest) -> None:
        choice = _Choice()
        generate_into = getattr(self.router, "generate_into", None)
        stream = (
            cast(PushingRouter, self.router).generate_into(req, self._sink(index, choice))
            if generate_into is not None
            else self.router.generate(req)
        )
        observe_gap = self._observe_gap
        try:
            async for delta in stream:
                now = time.perf_counter()
                if delta.token_ids:
                    if choice.last is None:
                        self.metrics.observe_first_token(now - self.arrival, self.mode)
                    else:
                        observe_gap(now - choice.last)
                    choice.last, choice.num_tokens = now, choice.num_tokens + len(delta.token_ids)
                num_tokens = choice.num_tokens
                if delta.finish_reason == FinishReason.ERROR:
                    raise ApiError(
                        500, f"worker failed: {delta.error or 'unknown error'}", code="worker_failed"
                    )
                if delta.finish_reason is not None:
                    self.unfinished.discard(req.request_id)
                    self.generated.append(num_tokens)
                    if not self.unfinished:
                        self.metrics.observe_group(self.generated)
                    self.metrics.observe_finished(
                        delta.timings,
                        delta.finish_reason.value,
                        self.mode,
                        e2e_s=now - self.arrival,
                        num_prompt_tokens=len(req.prompt_token_ids),
                        num_generation_tokens=num_tokens,
                        num_cached_tokens=delta.num_cached_tokens,
                    )
                self.queue.put((index, delta))
                if delta.finish_reason is not None:
                    return
                if self.queue.is_full:
                    await self._wait_room()
            raise ApiError(500, "router stream ended without a finish_reason", code="internal_error")
        except asyncio.CancelledError:
            raise
        except Exception as e:
            if not isinstance(e, (RouterError, ApiError)):
                logger.exception("request %s failed", req.request_id)
            self.failed.add(req.request_id)
            self.queue.put((index, e))
        finally:
            aclose = getattr(stream, "aclose", None)
            if aclose is not None:
                await aclose()

    async def _wait_room(self) -> None:
        """Until the writer took enough of the buffer; ApiError ``stream_stalled`` past the stall bound."""
        try:
            async with asyncio.timeout(self.limits.stall_timeout_s):
                await self.queue.wait_room()
        except TimeoutError:
            raise stalled_error(self.limits, "its buffer stayed full") from None

    async def next(self, timeout: float | None = None) -> Event | None:
        """The next event; None once ``timeout`` seconds passed without one (the keep-alive; events
        written directly while it waits count, ``open_direct``)."""
        queue = self.queue
        if not queue.empty():
            return queue.get_nowait()
        if timeout is not None:
            self._idle_timeout = timeout
            self._idle_due = self._loop.time() + timeout
            if self._idle_timer is None:
                self._idle_timer = self._loop.call_at(self._idle_due, self._idle_check)
        try:
            while queue.empty():
                if self._idle_due is not None and self._loop.time() >= self._idle_due:
                    return None
                self._is_waiting = True
                try:
                    await queue.wait()
                finally:
                    self._is_waiting = False
        finally:
            self._idle_due = None
        return queue.get_nowait()

    def _idle_check(self) -> None:
        """The keep-alive timer: wake a ``next`` whose wait is due, else re-arm for the current wait.
        NOTE: armed when a wait finds none armed, so a stream streaming tokens costs no timer per token."""
        self._idle_timer = None
        due = self._idle_due
        if due is None:
            return
        if self._loop.time() >= due:
            self.queue.wake()
        else:
            self._idle_timer = self._loop.call_at(due, self._idle_check)

    async def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        if self._idle_timer is not None:
            self._idle_timer.cancel()
            self._idle_timer = None
        for task in self.tasks:
            task.cancel()
        await asyncio.gather(*self.tasks, return_exceptions=True)
        for request_id in sorted(self.unfinished):
            if request_id not in self.failed:
                self.metrics.observe_abort(self.mode)
            try:
                await self.router.abort(request_id)
            except Exception:
                logger.exception("router.abort(%s) failed", request_id)
