"""Running a plan against the router: :class:`Fanout` sends a plan's router requests (n x prompts) and
merges their deltas into one :class:`EventBuffer`, bounded in bytes (``StreamLimits``), recording the
latency metrics as tokens arrive."""

from __future__ import annotations

import asyncio
import logging
import time

from cluster.http.errors import ApiError
from cluster.http.metrics import Metrics
from cluster.http.planning import Plan
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
    does not read stops its stream's generation reaching this process (the router bounds the rest)."""

    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        self.num_bytes = 0
        self._items: asyncio.Queue[tuple[Event, int]] = asyncio.Queue()
        self._room = asyncio.Event()
        self._room.set()

    def put(self, event: Event) -> None:
        num_bytes = delta_nbytes(event[1]) if isinstance(event[1], TokenDelta) else 0
        self._items.put_nowait((event, num_bytes))
        self.num_bytes += num_bytes
        if self.num_bytes >= self.max_bytes:
            self._room.clear()

    def _took(self, item: tuple[Event, int]) -> Event:
        self.num_bytes -= item[1]
        if self.num_bytes < self.max_bytes:
            self._room.set()
        return item[0]

    async def get(self) -> Event:
        return self._took(await self._items.get())

    def get_nowait(self) -> Event:
        return self._took(self._items.get_nowait())

    def empty(self) -> bool:
        return self._items.empty()

    def qsize(self) -> int:
        return self._items.qsize()

    @property
    def is_full(self) -> bool:
        return not self._room.is_set()

    async def wait_room(self) -> None:
        await self._room.wait()


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
        self.tasks = [asyncio.create_task(self._consume(i, req)) for i, req in plan.jobs]

    async def _consume(self, index: int, req: GenerateRequest) -> None:
        stream = self.router.generate(req)
        last: float | None = None
        num_tokens = 0
        try:
            async for delta in stream:
                now = time.perf_counter()
                if delta.token_ids:
                    if last is None:
                        self.metrics.observe_first_token(now - self.arrival, self.mode)
                    else:
                        self.metrics.observe_token_gap(now - last, self.mode)
                    last, num_tokens = now, num_tokens + len(delta.token_ids)
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
        if not self.queue.empty():  # NOTE: the common case; skips the timeout's timer per delta
            return self.queue.get_nowait()
        try:
            async with asyncio.timeout(timeout):  # NOTE: not wait_for, which can swallow a cancel (3.11)
                return await self.queue.get()
        except TimeoutError:
            return None

    async def close(self) -> None:
        if self.closed:
            return
        self.closed = True
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
