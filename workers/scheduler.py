"""Continuous-batching scheduler: policy only, never touches tensors.

Each step packs, under ``max_num_batched_tokens`` and ``max_num_seqs``, first the running requests (a
decode costs one token; an unfinished prefill continues with its next chunk), then waiting requests
(prefix-cache hit first, then a chunk of what is left). Everything goes into ONE flat ragged batch.
When blocks run out, the lowest-priority running request (the newest) is preempted by recompute: its
blocks are freed and it goes back to the front of the waiting queue.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field

from cluster.config import EngineConfig
from cluster.protocol import SamplingParams, TokenLogprobs
from workers.block_manager import KVCacheManager, PrefixHit
from workers.host_tier import KvCopies, LoadRule
from workers.request import Request, RequestStatus


@dataclass(slots=True)
class ScheduledRequest:
    request_id: str
    token_ids: list[int]  # the tokens computed this step
    start_position: int  # num_computed_tokens before this step
    block_ids: list[int]  # the request's whole block table (shared list: read, never mutate)
    needs_sample: bool  # this chunk reaches the last known token, so a token is sampled
    is_decode: bool  # generating (one token after the prompt), as opposed to a prompt chunk / recompute
    params: SamplingParams
    num_output_tokens: int  # tokens sampled before this step (a seeded generator skips that many draws)


@dataclass(slots=True)
class PromptLogprobRows:
    """The rows of one prompt chunk that score the prompt (``SamplingParams.prompt_logprobs``): the
    chunk's first ``len(target_ids)`` tokens, from position ``start_position`` on, each scored at the
    prompt token after it (``target_ids``), with the top ``num_top``. A chunk that ends the prompt leaves
    its last row out: that row's logits sample the first token."""

    request_id: str
    start_position: int
    target_ids: list[int]
    num_top: int


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledRequest]  # sequences with one query token first
    num_batched_tokens: int
    preempted_ids: list[str] = field(default_factory=list)
    # NOTE: counts the scheduler knows while it schedules, so consumers need no pass over `scheduled`;
    # None (an output built elsewhere): derived from `scheduled` when asked.
    num_one_token_seqs: int | None = None
    num_decode_seqs: int | None = None
    num_sampling_seqs: int | None = None
    # the prompt chunks whose rows score the prompt (requests asking for prompt logprobs), if any
    prompt_logprob_rows: list[PromptLogprobRows] = field(default_factory=list)
    # copies between the device cache and the host tier, run before the step's forward (host_tier.py)
    kv_copies: KvCopies | None = None

    @property
    def num_single_token_seqs(self) -> int:
        """Leading sequences with exactly one query token (decode-like for the attention kernels, whether
        they generate or are one-token prompt chunks; ``num_one_token_seqs`` when the scheduler counted
        them). Not ``num_decode_seqs``: the sequences that generate."""
        if self.num_one_token_seqs is not None:
            return self.num_one_token_seqs
        n = 0
        for s in self.scheduled:
            if len(s.token_ids) != 1:
                break
            n += 1
        return n

    @property
    def num_sampling(self) -> int:
        """Sequences that sample a token this step."""
        if self.num_sampling_seqs is not None:
            return self.num_sampling_seqs
        return sum(1 for s in self.scheduled if s.needs_sample)

    def _num_decode_seqs(self) -> int:
        if self.num_decode_seqs is not None:
            return self.num_decode_seqs
        return sum(1 for s in self.scheduled if s.is_decode)

    @property
    def is_mixed(self) -> bool:
        return 0 < self._num_decode_seqs() < len(self.scheduled)

    @property
    def num_prompt_tokens(self) -> int:
        """Tokens computed this step that are not decodes (prompt chunks, recomputed outputs)."""
        return self.num_batched_tokens - self._num_decode_seqs()

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


@dataclass(slots=True)
class SampledTokens:
    """What one step sampled: the token of each request that sampled one, and the logprobs of those
    that asked for them. Plain ints in a dict: a step of 256 requests builds no per-token object."""

    token_ids: dict[str, int]
    logprobs: dict[str, TokenLogprobs] = field(default_factory=dict)
    # the prompt logprobs the step's prompt chunks computed: request id -> (the chunk's start position,
    # one entry per row of its PromptLogprobRows)
    prompt_logprobs: dict[str, tuple[int, list[TokenLogprobs]]] = field(default_factory=dict)

    def __len__(self) -> int:
        return len(self.token_ids)


class Scheduler:
    def __init__(
        self,
        config: EngineConfig,
        num_blocks: int,
        max_model_len: int,
        num_host_blocks: int = 0,
        load_rule: LoadRule | None = None,
    ) -> None:
        self.config = config
        self.max_model_len = max_model_len
        self.kv = KVCacheManager(
            num_blocks, config.block_size, config.enable_prefix_caching, num_host_blocks, load_rule
        )
        self.requests: dict[str, Request] = {}
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.num_preemptions = 0
        self._waiting_for_kv: set[str] = set()

    # ---- admission -------------------------------------------------------------------------------
    def add_request(self, request: Request) -> None:
        if request.request_id in self.requests:
            raise ValueError(f"request_id {request.request_id!r} is already in use")
        request.set_length_check(self.max_model_len)
        self.requests[request.request_id] = request
        self.waiting.append(request)

    def reserve_prefilled(self, request: Request) -> tuple[list[int], int] | None:
        """Decode side of a handoff: reserve blocks for the prompt's KV (its first token is already in
        ``output_token_ids``). Returns (block ids, number of leading blocks already filled from the
        prefix cache) or None if blocks are short. The request waits in WAITING_FOR_KV, holding its
        blocks and a seat among max_num_seqs, until ``commit_prefilled`` or ``finish_request``."""
        if request.request_id in self.requests:
            raise ValueError(f"request_id {request.request_id!r} is already in use")
        if len(self.running) + self._num_waiting_for_kv() >= self.config.max_num_seqs:
            return None
        # NOTE: reserved before its first token is known (early decode admission), the request still
        # has that token to compute: every full prompt block may hit, as when the token is known.
        # NOTE: device hits only, and evicted blocks dropped: the transfer writes the reserved blocks from
        # its own thread, outside any step, so no copy between the tiers could run before it
        hit = self.kv.get_computed_blocks(
            request, num_pending_tokens=0 if request.output_token_ids else 1, use_host=False
        )
        num_hit = len(hit.block_ids)
        num_new = request.num_prompt_tokens - num_hit * self.kv.block_size
        if not self.kv.allocate_slots(request, num_new, hit, can_offload=False):
            self.kv.free(request.request_id)  # NOTE: the lookup's per-request hash state must not outlive it
            return None
        request.set_length_check(self.max_model_len)
        request.status = RequestStatus.WAITING_FOR_KV
        request.num_cached_tokens = num_hit * self.kv.block_size
        self.requests[request.request_id] = request
        self._waiting_for_kv.add(request.request_id)
        return self.kv.block_tables[request.request_id], num_hit

    def commit_prefilled(self, request_id: str) -> None:
        """The prompt's KV has landed: the request decodes from its first token on."""
        request = self.requests[request_id]
        if request.status != RequestStatus.WAITING_FOR_KV:
            raise RuntimeError(f"commit_prefilled({request_id!r}) in status {request.status}")
        request.num_computed_tokens = request.num_prompt_tokens
        self.kv.cache_full_blocks(request)
        request.status = RequestStatus.RUNNING
        self._waiting_for_kv.discard(request_id)
        self.running.append(request)

    def _num_waiting_for_kv(self) -> int:
        return len(self._waiting_for_kv)

    # ---- one step --------------------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        budget = self.config.max_num_batched_tokens
        # NOTE: one-token sequences first is the kernels' contract; two lists keep each kind in running
        # order (what a stable sort would give) without sorting.
        ones: list[ScheduledRequest] = []
        others: list[ScheduledRequest] = []
        num_decode_seqs = 0
        num_sampling = 0
        preempted: list[str] = []
        prompt_rows: list[PromptLogprobRows] = []

        kv = self.kv
        tables = kv.block_tables
        block_size = kv.block_size
        running = self.running
        # NOTE: a preemption pops requests off the end of `running` not reached yet; the iterator stops
        # before them
        for request in running:
            if budget <= 0:
                break
            computed = request.num_computed_tokens
            outputs = request.output_token_ids
            num_prompt = len(request.prompt_token_ids)
            num_new = num_prompt + len(outputs) - computed
            is_decode = num_new == 1 and computed >= num_prompt  # NOTE: before the budget caps num_new
            if num_new > budget:
                num_new = budget
            table = tables.get(request.request_id)
            # NOTE: most steps of a decode fit the tokens in the blocks it holds: no allocation call.
            if table is None or computed + num_new > len(table) * block_size:
                while not kv.allocate_slots(request, num_new):
                    victim = running.pop()
                    self._preempt(victim)
                    preempted.append(victim.request_id)
                    if victim is request:
                        break
                if request.status != RequestStatus.RUNNING:
                    break
                table = tables[request.request_id]
            if is_decode:
                # a decode, the usual case, built here (what _scheduled builds, without the call)
                s = ScheduledRequest(
                    request.request_id,
                    [outputs[-1]],
                    computed,
                    table,
                    True,
                    True,
                    request.params,
                    len(outputs),
                )
                ones.append(s)
                num_decode_seqs += 1
                num_sampling += 1
            else:
                s = self._scheduled(request, num_new, table)
                (ones if num_new == 1 else others).append(s)
                num_decode_seqs += s.is_decode
                num_sampling += s.needs_sample
                if request.prompt_logprobs is not None:
                    self._score_prompt(request, s, prompt_rows)
            budget -= num_new

        if not preempted:
            num_seats = self.config.max_num_seqs - self._num_waiting_for_kv()
            while self.waiting and budget > 0 and len(self.running) < num_seats:
                request = self.waiting[0]
                # NOTE: a request scoring its prompt takes no hit (as in vLLM): a cached position has no logits
                hit = (
                    self.kv.get_computed_blocks(request)
                    if request.num_computed_tokens == 0 and not request.is_scoring_prompt
                    else PrefixHit([])
                )
                num_hit_tokens = hit.num_tokens(self.kv.block_size)
                num_new = min(request.num_tokens - request.num_computed_tokens - num_hit_tokens, budget)
                if not self.kv.allocate_slots(request, num_new, hit):
                    break
                self.waiting.popleft()
                if request.status == RequestStatus.WAITING:
                    request.num_cached_tokens = num_hit_tokens
                request.num_computed_tokens += num_hit_tokens
                request.status = RequestStatus.RUNNING
                if request.first_scheduled_time is None:
                    request.first_scheduled_time = time.time()
                self.running.append(request)
                s = self._scheduled(request, num_new, self.kv.block_tables[request.request_id])
                (ones if num_new == 1 else others).append(s)
                num_decode_seqs += s.is_decode
                num_sampling += s.needs_sample
                if request.prompt_logprobs is not None:
                    self._score_prompt(request, s, prompt_rows)
                budget -= num_new

        return SchedulerOutput(
            ones + others,
            self.config.max_num_batched_tokens - budget,
            preempted,
            num_one_token_seqs=len(ones),
            num_decode_seqs=num_decode_seqs,
            num_sampling_seqs=num_sampling,
            prompt_logprob_rows=prompt_rows,
            # NOTE: copies are decided only where something is scheduled, so they never wait a step
            kv_copies=kv.take_copies(),
        )

    @staticmethod
    def _scheduled(request: Request, num_new: int, table: list[int]) -> ScheduledRequest:
        start = request.num_computed_tokens
        end = start + num_new
        num_prompt = len(request.prompt_token_ids)
        outputs = request.output_token_ids
        num_output = len(outputs)
        is_decode = num_new == 1 and start >= num_prompt
        # a decode reads the newest token, no slicing
        token_ids = [outputs[start - num_prompt]] if is_decode else request.token_slice(start, end)
        return ScheduledRequest(
            request.request_id,
            token_ids,
            start,
            table,
            end == num_prompt + num_output,
            is_decode,
            request.params,
            num_output,
        )

    @staticmethod
    def _score_prompt(request: Request, s: ScheduledRequest, rows: list[PromptLogprobRows]) -> None:
        """Add the rows of ``s`` that score ``request``'s prompt (none once it has a token)."""
        num_top = request.params.prompt_logprobs
        if num_top is None or not request.is_scoring_prompt:
            return
        start = s.start_position
        prompt = request.prompt_token_ids
        targets = prompt[start + 1 : min(start + len(s.token_ids) + 1, len(prompt))]
        if targets:
            rows.append(PromptLogprobRows(request.request_id, start, targets, num_top))

    def _preempt(self, request: Request) -> None:
        self.kv.free(request.request_id)
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        request.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(request)

    def update_from_output(self, output: SchedulerOutput, sampled: SampledTokens) -> list[Request]:
        """Advance computed counts, append sampled tokens, apply token-level stops.

        Returns the requests that received a token this step (finished ones included, already freed
        unless held for a handoff)."""
        now = time.time()
        updated: list[Request] = []
        block_size = self.kv.block_size
        running = RequestStatus.RUNNING
        requests = self.requests
        max_model_len = self.max_model_len
        token_ids, logprobs = sampled.token_ids, sampled.logprobs
        for s in output.scheduled:
            request = requests.get(s.request_id)
            if request is None or request.status is not running:
                continue  # aborted while the step ran
            num_new = len(s.token_ids)
            request.num_computed_tokens += num_new
            # NOTE: one new token fills a block only when it lands on the block's last slot
            if num_new > 1 or request.num_computed_tokens % block_size == 0:
                self.kv.cache_full_blocks(request)
            token_id = token_ids.get(s.request_id)
            if token_id is None:
                continue
            outputs = request.output_token_ids
            outputs.append(token_id)
            if logprobs:
                token_logprobs = logprobs.get(s.request_id)
                if token_logprobs is not None:
                    request.logprobs.append(token_logprobs)
            if request.first_token_time is None:
                request.first_token_time = now
            updated.append(request)
            # NOTE: check_stop (the one definition of the stop rules) only where it may stop: a stop id,
            # or as many outputs as `length_check_at` (a length stop needs at least that many)
            if token_id in request.stop_ids or len(outputs) >= request.length_check_at:
                stop = request.check_stop(max_model_len)
                if stop is not None:
                    self.finish_request(request.request_id, stop)
                    continue
            if request.hold_after_prefill:
                self.running.remove(request)
                request.status = RequestStatus.SENDING_KV
        return updated

    # ---- endings ---------------------------------------------------------------------------------
    def finish_request(self, request_id: str, status: RequestStatus) -> Request | None:
        """End a request in any state (waiting, running, held for a handoff, waiting for KV) and free
        every block it holds. Returns the request, or None if it is unknown (already ended)."""
        request = self.requests.get(request_id)
        if request is None:
            return None
        if request.status == RequestStatus.RUNNING:
            self.running.remove(request)
        elif request.status in (RequestStatus.WAITING, RequestStatus.PREEMPTED):
            self.waiting.remove(request)
        elif request.status == RequestStatus.WAITING_FOR_KV:
            self._waiting_for_kv.discard(request_id)
        request.status = status
        request.finish_time = time.time()
        del self.requests[request_id]
        self.kv.free(request_id)
        return request

    def release(self, request_id: str) -> None:
        """Prefill side: the handoff of a held request is over (acked, aborted or lease expired)."""
        request = self.requests.get(request_id)
        if request is None or request.status != RequestStatus.SENDING_KV:
            raise RuntimeError(f"release({request_id!r}): not a held request")
        self.finish_request(request_id, RequestStatus.FINISHED_STOPPED)

    @property
    def num_unfinished(self) -> int:
        return len(self.requests)

    def check_no_leaks(self) -> None:
        if self.requests or self.waiting or self.running:
            raise AssertionError(f"requests left: {sorted(self.requests)}")
        self.kv.check_no_leaks()
