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
from workers.host_tier import LoadRule
from workers.request import Request, RequestStatus
from workers.scheduler import SampledTokens, Scheduler, SchedulerOutput

PLACEHOLDER = -1

# A scheduled step: (its output, (request, index of its placeholder in output_token_ids, or None when the
# step samples nothing for it) per scheduled request, the requests whose computed tokens may fill a block)
_Flight = tuple[SchedulerOutput, list[tuple[Request, int | None]], list[Request]]


class AsyncScheduler(Scheduler):
    """See the module docstring. ``has_in_flight``: steps scheduled but not yet resolved.
    ``num_discarded_tokens``: tokens sampled for requests that had ended meanwhile (the price of not
    knowing a stop one step ahead)."""

    def __init__(
        self,
        config: EngineConfig,
        num_blocks: int,
        max_model_len: int,
        num_host_blocks: int = 0,
        load_rule: LoadRule | None = None,
    ) -> None:
        super().__init__(config, num_blocks, max_model_len, num_host_blocks, load_rule)
        self._in_flight: deque[_Flight] = deque()
        self.num_discarded_tokens = 0

    @property
    def has_in_flight(self) -> bool:
        return bool(self._in_flight)

    def schedule(self) -> SchedulerOutput:
        if self._in_flight:
            self._cache_in_flight_blocks(self._in_flight[-1])
        # NOTE: requests that end with their in-flight token sit this step out (their seat and budget go
        # to others, as after a synchronous update); they are back in `running` for their resolve. Such a
        # request's newest output is a placeholder and it is held for a handoff, or it reaches
        # max_tokens or max_model_len with that token (`length_check_at` outputs: see set_length_check).
        running = self.running
        ending = [
            r
            for r in running
            if (outputs := r.output_token_ids)
            and outputs[-1] == PLACEHOLDER
            and (r.hold_after_prefill or len(outputs) >= r.length_check_at)
        ]
        if ending:
            is_ending = set(ending)
            self.running = [r for r in running if r not in is_ending]
        try:
            out = super().schedule()
        finally:
            if ending:
                self.running[:0] = ending
        if not out.is_empty:
            self._in_flight.append(self._advance(out))
        return out

    def _advance(self, out: SchedulerOutput) -> _Flight:
        """Advance the computed tokens of what ``out`` schedules and give each sampling row its
        placeholder: the step's record, and the requests that may fill a block with it (what the
        synchronous update registers: a chunk of several tokens, or one landing on a block's last slot)."""
        requests = self.requests
        block_size = self.kv.block_size
        records: list[tuple[Request, int | None]] = []
        may_fill: list[Request] = []
        for s in out.scheduled:
            request = requests[s.request_id]
            num_new = len(s.token_ids)
            computed = request.num_computed_tokens = request.num_computed_tokens + num_new
            if num_new > 1 or computed % block_size == 0:
                may_fill.append(request)
            if s.needs_sample:
                outputs = request.output_token_ids
                outputs.append(PLACEHOLDER)
                records.append((request, len(outputs) - 1))
            else:
                records.append((request, None))
        return out, records, may_fill

    def _cache_in_flight_blocks(self, flight: _Flight) -> None:
        """Register the blocks the newest scheduled step filled (their tokens are known by now).

        NOTE: only that step's ``may_fill`` requests: a one-token step fills a block only when its token
        lands on the block's last slot, so the others would find nothing new to register."""
        if self.kv.prefix_cache is None:
            return
        requests, running = self.requests, RequestStatus.RUNNING
        for request in flight[2]:
            if request.status is running and requests.get(request.request_id) is request:
                self.kv.cache_full_blocks(request)

    def update_from_output(self, output: SchedulerOutput, sampled: SampledTokens) -> list[Request]:
        raise RuntimeError("AsyncScheduler steps are resolved with resolve(), not update_from_output()")

    def resolve(self, out: SchedulerOutput, sampled: SampledTokens) -> list[tuple[Request, int]]:
        """Apply the sampled tokens of the oldest unresolved step (``out``). Returns (request, index of
        its new token) for every request that received one, finished ones included (already freed
        unless held for a handoff)."""
        if not self._in_flight or self._in_flight[0][0] is not out:
            raise RuntimeError("steps must be resolved in the order they were scheduled")
        records = self._in_flight.popleft()[1]
        now = time.time()
        updated: list[tuple[Request, int]] = []
        token_ids, logprobs = sampled.token_ids, sampled.logprobs
        requests, running, max_model_len = self.requests, RequestStatus.RUNNING, self.max_model_len
        for request, index in records:
            if index is None:
                continue
            request_id = request.request_id
            token_id = token_ids.get(request_id)
            if token_id is None:
                continue
            if requests.get(request_id) is not request:
                self.num_discarded_tokens += 1  # ended (stop, abort, release) while the step ran
                continue
            request.output_token_ids[index] = token_id
            if logprobs:
                token_logprobs = logprobs.get(request_id)
                if token_logprobs is not None:
                    request.logprobs.append(token_logprobs)
            if request.first_token_time is None:
                request.first_token_time = now
            updated.append((request, index))
            # NOTE: check_stop as of this token (a newer placeholder may follow it), asked only where it
            # may stop: a stop id, or as many outputs as `length_check_at` (as the synchronous update)
            if token_id in request.stop_ids or index >= request.length_check_at - 1:
                stop = request.check_stop(max_model_len, index + 1)
                if stop is not None:
                    self.finish_request(request_id, stop)
                    continue
            if request.hold_after_prefill and request.status is running:
                self.running.remove(request)
                request.status = RequestStatus.SENDING_KV
        return updated

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
