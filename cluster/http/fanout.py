"""Running a plan against the router: :class:`Fanout` sends a plan's router requests (n x prompts) and
merges their deltas into one queue, recording the latency metrics as tokens arrive."""

from __future__ import annotations

import asyncio
import logging
import time

from cluster.http.errors import ApiError
from cluster.http.metrics import Metrics
from cluster.http.planning import Plan
from cluster.http.server_state import RouterLike
from cluster.protocol import FinishReason, GenerateRequest, RouterError, TokenDelta

logger = logging.getLogger(__name__)


class Fanout:
    """Runs a plan's router requests (n x prompts) as tasks and merges their deltas into one queue.

    Lifecycle: ``close()`` must run once the answer is done or abandoned (it is idempotent and must be
    shielded from cancellation): it cancels the consumer tasks, which closes each router stream, then
    awaits ``router.abort`` for every request that did not finish, so a disconnect, an error or a sibling
    choice's failure frees KV blocks everywhere.
    """

    def __init__(self, router: RouterLike, metrics: Metrics, plan: Plan, arrival: float) -> None:
        self.router, self.metrics, self.arrival, self.mode = router, metrics, arrival, router.mode
        self.queue: asyncio.Queue[tuple[int, TokenDelta | BaseException]] = asyncio.Queue()
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
                await self.queue.put((index, delta))
                if delta.finish_reason is not None:
                    return
            raise ApiError(500, "router stream ended without a finish_reason", code="internal_error")
        except asyncio.CancelledError:
            raise
        except Exception as e:
            if not isinstance(e, (RouterError, ApiError)):
                logger.exception("request %s failed", req.request_id)
            self.failed.add(req.request_id)
            await self.queue.put((index, e))
        finally:
            aclose = getattr(stream, "aclose", None)
            if aclose is not None:
                await aclose()

    async def next(self, timeout: float | None = None) -> tuple[int, TokenDelta | BaseException] | None:
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
