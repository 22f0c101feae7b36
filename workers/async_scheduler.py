"""Scheduling one step ahead: step N+1 is scheduled (and its inputs prepared) while step N runs.

``AsyncScheduler`` is the ``Scheduler`` with its bookkeeping moved from "after a step's tokens are back"
to "when the step is scheduled", as vLLM's asynchronous scheduling does:

- ``schedule()`` advances ``num_computed_tokens`` of what it schedules at once and appends a placeholder
  (``PLACEHOLDER``, -1) for each token the step will sample. The next ``schedule()`` (called before this
  step's tokens are known) then schedules that placeholder as the request's next decode input; the model
  runner replaces it on the device with the sampled token.
- ``resolve(out, sampled)``, called once the step's tokens are on the host, writes each token over its
  placeholder and applies the stop rules. A request that ended meanwhile (abort, stop, release) is
  skipped, so no token of it is ever reported after it ended. Steps resolve in launch order.
- A request that will certainly end with its in-flight token (max_tokens or max_model_len reached, or
  held for a handoff after its first token) is not scheduled again; one that may stop on EOS, a stop
  token or a stop string is (its extra step's token is discarded when the stop is seen).
- Blocks full of computed tokens enter the prefix cache at the next ``schedule()`` (their tokens are
  known by then), the same moment the synchronous scheduler registers them.

Only the engine's asynchronous mode uses it; nothing here touches tensors.
"""

from __future__ import annotations

import time
from collections import deque

from cluster.config import EngineConfig
from workers.request import Request, RequestStatus
from workers.scheduler import SampledTokens, Scheduler, SchedulerOutput

PLACEHOLDER = -1

# (request, index of its placeholder in output_token_ids, or None when the step samples nothing for it)
_Flight = tuple[SchedulerOutput, list[tuple[Request, int | None]]]


class AsyncScheduler(Scheduler):
    """See the module docstring. ``has_in_flight``: steps scheduled but not yet resolved.
    ``num_discarded_tokens``: tokens sampled for requests that had ended meanwhile (the price of not
    knowing a stop one step ahead)."""

    def __init__(self, config: EngineConfig, num_blocks: int, max_model_len: int) -> None:
        super().__init__(config, num_blocks, max_model_len)
        self._in_flight: deque[_Flight] = deque()
        self.num_discarded_tokens = 0

    @property
    def has_in_flight(self) -> bool:
        return bool(self._in_flight)

    def schedule(self) -> SchedulerOutput:
        if self._in_flight:
            self._cache_in_flight_blocks(self._in_flight[-1])
        # NOTE: requests that end with their in-flight token sit this step out (their seat and budget go
        # to others, as after a synchronous update); they are back in `running` for their resolve.
        ends = [self._ends_in_flight(r) for r in self.running]
        ending = [r for r, end in zip(self.running, ends, strict=True) if end]
        if ending:
            self.running = [r for r, end in zip(self.running, ends, strict=True) if not end]
        try:
            out = super().schedule()
        finally:
            if ending:
                self.running[:0] = ending
        if not out.is_empty:
            records = [self._advance(s.request_id, s.needs_sample, len(s.token_ids)) for s in out.scheduled]
            self._in_flight.append((out, records))
        return out

    def _advance(self, request_id: str, needs_sample: bool, num_new: int) -> tuple[Request, int | None]:
        request = self.requests[request_id]
        request.num_computed_tokens += num_new
        if not needs_sample:
            return request, None
        request.output_token_ids.append(PLACEHOLDER)
        return request, len(request.output_token_ids) - 1

    def _ends_in_flight(self, request: Request) -> bool:
        outputs = request.output_token_ids
        if not outputs or outputs[-1] != PLACEHOLDER:
            return False
        return (
            request.hold_after_prefill
            or len(outputs) >= request.params.max_tokens
            or request.num_tokens >= self.max_model_len
        )

    def _cache_in_flight_blocks(self, flight: _Flight) -> None:
        for request, _ in flight[1]:
            if request.status is RequestStatus.RUNNING and self.requests.get(request.request_id) is request:
                self.kv.cache_full_blocks(request)

    def update_from_output(self, output: SchedulerOutput, sampled: SampledTokens) -> list[Request]:
        raise RuntimeError("AsyncScheduler steps are resolved with resolve(), not update_from_output()")

    def resolve(self, out: SchedulerOutput, sampled: SampledTokens) -> list[tuple[Request, int]]:
        """Apply the sampled tokens of the oldest unresolved step (``out``). Returns (request, index of
        its new token) for every request that received one, finished ones included (already freed
        unless held for a handoff)."""
        if not self._in_flight or self._in_flight[0][0] is not out:
            raise RuntimeError("steps must be resolved in the order they were scheduled")
        _, records = self._in_flight.popleft()
        now = time.time()
        updated: list[tuple[Request, int]] = []
        token_ids, logprobs = sampled.token_ids, sampled.logprobs
        for request, index in records:
            token_id = token_ids.get(request.request_id)
            if index is None or token_id is None:
                continue
            if self.requests.get(request.request_id) is not request:
                self.num_discarded_tokens += 1  # ended (stop, abort, release) while the step ran
                continue
            request.output_token_ids[index] = token_id
            if logprobs:
                token_logprobs = logprobs.get(request.request_id)
                if token_logprobs is not None:
                    request.logprobs.append(token_logprobs)
            if request.first_token_time is None:
                request.first_token_time = now
            updated.append((request, index))
            stop = self._stop_at(request, index)
            if stop is not None:
                self.finish_request(request.request_id, stop)
            elif request.hold_after_prefill and request.status is RequestStatus.RUNNING:
                self.running.remove(request)
                request.status = RequestStatus.SENDING_KV
        return updated

    def _stop_at(self, request: Request, index: int) -> RequestStatus | None:
        """``Request.check_stop`` as of the token at ``index`` (a newer placeholder may follow it)."""
        # NOTE: the one definition of the stop rules stays Request.check_stop; hide the tail for it.
        tail = request.output_token_ids[index + 1 :]
        del request.output_token_ids[index + 1 :]
        try:
            return request.check_stop(self.max_model_len)
        finally:
            request.output_token_ids.extend(tail)

    def finish_request(self, request_id: str, status: RequestStatus) -> Request | None:
        request = super().finish_request(request_id, status)
        if request is not None:
            while request.output_token_ids and request.output_token_ids[-1] == PLACEHOLDER:
                request.output_token_ids.pop()
        return request

    def check_no_leaks(self) -> None:
        if self._in_flight:
            raise AssertionError(f"{len(self._in_flight)} scheduled step(s) never resolved")
        super().check_no_leaks()
