"""Engine: the streaming core under the offline LLM API and the workers.

Single-threaded by contract: ``add_request``, ``step``, ``abort`` and ``release`` are called from one
thread (a worker's step loop); callers in other threads hand work over through a queue.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from pathlib import Path

from cluster.config import EngineConfig
from cluster.protocol import EngineStats, ErrorCode, KvEventBatch, SamplingParams, TokenDelta
from cluster.tokenizer import Tokenizer
from workers.async_scheduler import AsyncScheduler
from workers.detokenizer import (
    DetokenizerStage,
    IncrementalDetokenizer,
    detokenizes_on_step_thread,
    update_all,
)
from workers.host_tier import LoadRule
from workers.model_runner import ForwardStep, ModelRunner, PendingStep
from workers.request import Request, RequestStatus
from workers.scheduler import SampledTokens, Scheduler, SchedulerOutput
from workers.step_output import StepItem, StepOutput
from workers.structured import StructuredRequests
from workers.structured_compile import CompileFailed, CompileLimits, RequestFailure

logger = logging.getLogger(__name__)

BUNDLED_MODEL = str(Path(__file__).resolve().parent / "assets" / "pdserve-tiny")
# NOTE: an engine whose only work is requests waiting for their grammars sleeps this long per step
# (woken early when a compile ends) instead of spinning
_GRAMMAR_WAIT_S = 0.005


@dataclass
class _AwaitingGrammar:
    """A request whose grammar is still compiling: outside the batch until it is active.
    ``is_reserved``: the decode side of a handoff, reserved and committed (its KV landed), whose
    scheduler commit waits for the grammar."""

    request: Request
    output_token_ids: list[int]
    is_reserved: bool


class Engine:
    """Requests in, token deltas out, one ``step()`` at a time (see the module docstring).

    With ``config.async_scheduling`` each ``step()`` schedules and launches step N+1 before it waits for
    step N's tokens, and returns step N's deltas (``AsyncScheduler``); the first call returns none, and
    ``has_unfinished()`` stays true until the last launched step is resolved. Tokens, stops, aborts (no
    delta for a request after ``abort``), holds and handoffs behave exactly as in the synchronous mode.

    Structured outputs (``params.structured``): every sampled row of a constrained request is masked to
    what its grammar allows next, and its matcher takes each token as the token is resolved; the
    request ends (STOP) once the grammar takes a stop token. The mask of a step depends on the previous
    step's token, so under asynchronous scheduling a step that samples a constrained request whose
    previous token is still on the device is launched in two halves: the forward before waiting for
    the previous step, the mask and the sampling after resolving it. Logits processors
    (workers/logits_processors.py) that read the output tokens (penalties, bad words) take the same path.

    Grammars compile on helper threads (``StructuredRequests``): a request whose grammar is not compiled
    yet waits outside the scheduler (the batch never waits for it) and joins once it is; one whose
    grammar fails (too complex, over the time budget, rejected) ends without a delta and is reported by
    ``take_failed()`` (a worker sends it as RequestFailed). A failure known at admission (a size cap, a
    spec known to be too complex, a full compile queue) is raised there instead (CompileFailed).

    ``detokenize=False`` leaves the text of most requests to a ``DetokenizerStage`` on another thread:
    their deltas carry token ids and ``text=""``; the engine still detokenizes the requests whose text
    decides their end (``detokenizes_on_step_thread``: stop strings, held prefills).
    """

    def __init__(self, config: EngineConfig, detokenize: bool = True) -> None:
        self.config = config
        self.detokenize = detokenize
        self.model_dir = config.model.path or BUNDLED_MODEL
        self.runner = ModelRunner(config, self.model_dir)
        self.arch = self.runner.arch
        self.tokenizer = Tokenizer.from_pretrained(self.model_dir)
        self.max_model_len = self.runner.max_model_len  # EngineConfig.max_model_len, capped by the KV pool
        scheduler_class = AsyncScheduler if self.runner.is_async else Scheduler
        host_kv = self.runner.host_kv
        # the host tier's rule (workers/host_tier.py): measured copies (CPU) and forwards feed it
        self.load_rule = None if host_kv is None else LoadRule(host_kv.bytes_per_block, config.block_size)
        self.scheduler = scheduler_class(
            config,
            self.runner.num_blocks,
            self.max_model_len,
            0 if host_kv is None else host_kv.num_slots,
            self.load_rule,
        )
        self._in_flight: tuple[SchedulerOutput, PendingStep] | None = None  # async: launched, unresolved
        self._launched, self._resolved_at = (0.0, 0.0), 0.0  # async: in-flight launch (s, end), last resolve
        self.detokenizers: dict[str, IncrementalDetokenizer] = {}
        self.stage: DetokenizerStage | None = None  # see use_stage
        self.structured = StructuredRequests(
            self.tokenizer,
            self.vocab_size,
            self.eos_token_ids,
            self.runner.device,
            CompileLimits.from_config(config),
        )
        self._awaiting: dict[str, _AwaitingGrammar] = {}
        self._copied = (0, 0.0)  # the host tier's copied bytes and seconds at the last measurement
        self._failed: list[RequestFailure] = []
        self._stats = EngineStats()

    @property
    def vocab_size(self) -> int:
        return self.arch.vocab_size

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        ids = set(self.arch.eos_token_ids)
        if self.tokenizer is not None:
            ids.update(self.tokenizer.eos_token_ids)
        return tuple(sorted(ids))

    def close(self) -> None:
        """Stops what the engine started beside itself: a tensor-parallel engine's other ranks (bounded;
        workers/rank_process.py). Idempotent; an engine at one rank has nothing to stop."""
        self.runner.close()

    def use_stage(self, stage: DetokenizerStage) -> None:
        """Leave the text of most requests to ``stage`` (before any request is added): the engine
        registers each request with it as it arrives (or, reserved for a handoff, once its first token
        is known) and drops it there when it ends without a final delta (an abort). The caller submits
        each step's deltas to the stage."""
        if self.scheduler.requests:
            raise RuntimeError("use_stage() before any request")
        self.detokenize, self.stage = False, stage

    # ---- admission -------------------------------------------------------------------------------
    def validate(self, prompt_token_ids: list[int], params: SamplingParams) -> None:
        """Raise ValueError naming the field and the limit; nothing is queued. Compiles the request's
        grammar, blocking (bounded by the compile budget): for callers that validate before queueing
        (the offline API); admission itself never waits for a compile."""
        self._check(prompt_token_ids, params)
        if params.structured is not None:
            self.structured.compile(params.structured)

    def _check(self, prompt_token_ids: list[int], params: SamplingParams) -> None:
        if not prompt_token_ids:
            raise ValueError("prompt must contain at least 1 token")
        bad = [t for t in prompt_token_ids if not 0 <= t < self.vocab_size]
        if bad:
            raise ValueError(f"prompt token id {bad[0]} is outside the vocabulary [0, {self.vocab_size})")
        params.validate(self.vocab_size)
        total = len(prompt_token_ids) + params.max_tokens
        if total > self.max_model_len:
            raise ValueError(
                f"prompt ({len(prompt_token_ids)} tokens) + max_tokens ({params.max_tokens}) = {total} "
                f"exceeds max_model_len ({self.max_model_len})"
            )

    def _new_request(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        hold: bool,
        output_token_ids: list[int] | None = None,
    ) -> Request:
        """A request with its per-request state (detokenizer, grammar matcher advanced over
        ``output_token_ids``, if its grammar is compiled already); ValueError before anything is kept."""
        self._check(prompt_token_ids, params)
        if request_id in self.scheduler.requests or request_id in self._awaiting:
            raise ValueError(f"request_id {request_id!r} is already in use")
        request = Request(request_id, list(prompt_token_ids), params, self.eos_token_ids, hold)
        if params.structured is not None:
            self.structured.start(request_id, params.structured)
            if output_token_ids is not None:
                try:
                    self.structured.activate(request_id, output_token_ids)
                except ValueError:
                    self.structured.remove(request_id)
                    raise
        if self.tokenizer is not None and (self.detokenize or detokenizes_on_step_thread(params, hold)):
            self.detokenizers[request_id] = IncrementalDetokenizer.for_request(
                self.tokenizer, request.prompt_token_ids, params
            )
        if params.has_logits_processors:
            self.runner.logits_processors.add(request)
        return request

    def add_request(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        *,
        hold_after_prefill: bool = False,
        output_token_ids: list[int] | None = None,
    ) -> None:
        """Queue a request. With ``hold_after_prefill`` (prefill worker) it stops after its first token
        and keeps its blocks in SENDING_KV until ``release`` (or ``abort``). ``output_token_ids``: tokens
        already generated elsewhere (a handoff recomputed here); they are computed, not re-sampled."""
        request = self._new_request(
            request_id, prompt_token_ids, params, hold_after_prefill, output_token_ids or []
        )
        if params.structured is not None and not self.structured.is_active(request_id):
            self._awaiting[request_id] = _AwaitingGrammar(request, list(output_token_ids or []), False)
            return
        if output_token_ids:
            self._resume(request, output_token_ids)
        self.scheduler.add_request(request)
        self._to_stage(request, output_token_ids)

    def _to_stage(self, request: Request, output_token_ids: list[int] | None) -> None:
        """Register a request with the stage (see use_stage), with the tokens it has streamed already."""
        if self.stage is not None:
            self.stage.add_request(
                request.request_id,
                request.prompt_token_ids,
                request.params,
                request.hold_after_prefill,
                output_token_ids,
            )

    def _resume(self, request: Request, output_token_ids: list[int]) -> None:
        request.output_token_ids.extend(output_token_ids)
        request.first_token_time = time.time()
        detok = self.detokenizers.get(request.request_id)
        if detok is not None:
            detok.update(output_token_ids)
            detok.get_delta(finished=False)  # that text already went to the client

    def add_prefilled_request(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        first_token_id: int | None,
        params: SamplingParams,
    ) -> tuple[list[int], int] | None:
        """Decode side of a handoff: reserve blocks for the prompt's KV. Returns (block ids, leading
        blocks already held from the prefix cache) or None when blocks or seats are short; then
        ``commit_prefilled`` once the KV landed, or ``abort`` on failure (frees the blocks).
        ``first_token_id`` None: reserved while the prefill still runs (early decode admission); the
        first token then comes with ``commit_prefilled``."""
        first = [] if first_token_id is None else [first_token_id]
        request = self._new_request(request_id, prompt_token_ids, params, hold=False, output_token_ids=first)
        if first:
            self._resume(request, first)
        reserved = self.scheduler.reserve_prefilled(request)
        if reserved is None:
            self._drop(request_id)
        elif first:
            self._to_stage(request, first)
        return reserved

    def commit_prefilled(self, request_id: str, first_token_id: int | None = None) -> None:
        """The prompt's KV has landed: decode on. ``first_token_id``: the first token of a request
        reserved without it (its grammar matcher and detokenizer take it here)."""
        if first_token_id is not None:
            request = self.scheduler.requests[request_id]
            if request.output_token_ids:
                raise RuntimeError(f"commit_prefilled({request_id!r}): its first token is known already")
            spec = request.params.structured
            if spec is not None and self.structured.is_active(request_id):
                # NOTE: its matcher was built before the first token was known: built again over it below
                self.structured.remove(request_id)
                self.structured.start(request_id, spec)
            self._resume(request, [first_token_id])
            self._to_stage(request, [first_token_id])
        request = self.scheduler.requests[request_id]
        if request.params.structured is not None and not self.structured.is_active(request_id):
            # NOTE: its KV has landed, so failing it here frees nothing a transfer still writes
            waiting = _AwaitingGrammar(request, list(request.output_token_ids), True)
            try:
                is_active = self.structured.activate(request_id, waiting.output_token_ids)
            except ValueError as e:
                self._fail_waiting(waiting, e)
                return
            if not is_active:
                self._awaiting[request_id] = waiting
                return
        self.scheduler.commit_prefilled(request_id)

    # ---- requests waiting for their grammar ----------------------------------------------------------
    def _admit_compiled(self) -> None:
        """Requests whose grammar is now compiled join the scheduler (or commit); failed ones end."""
        for request_id, waiting in list(self._awaiting.items()):
            try:
                if not self.structured.activate(request_id, waiting.output_token_ids):
                    continue
            except ValueError as e:
                del self._awaiting[request_id]
                self._fail_waiting(waiting, e)
                continue
            del self._awaiting[request_id]
            request = waiting.request
            if waiting.is_reserved:
                self.scheduler.commit_prefilled(request_id)
                continue
            if waiting.output_token_ids:
                self._resume(request, waiting.output_token_ids)
            self.scheduler.add_request(request)
            self._to_stage(request, waiting.output_token_ids)

    def _fail_waiting(self, waiting: _AwaitingGrammar, error: ValueError) -> None:
        request_id = waiting.request.request_id
        if waiting.is_reserved:
            self.scheduler.finish_request(request_id, RequestStatus.FINISHED_ERROR)
            if self.stage is not None:
                self.stage.drop(request_id)
        self._drop(request_id)
        code = error.code if isinstance(error, CompileFailed) else ErrorCode.INVALID_REQUEST
        logger.info("request %s: structured output failed: %s", request_id, error)
        self._failed.append(RequestFailure(request_id, code, str(error)))

    def take_failed(self) -> list[RequestFailure]:
        """The requests ended since the last call because their grammar failed (no delta says so)."""
        failed, self._failed = self._failed, []
        return failed

    # ---- stepping ----------------------------------------------------------------------------------
    def has_unfinished(self) -> bool:
        return bool(self.scheduler.waiting or self.scheduler.running or self._in_flight or self._awaiting)

    def step(self) -> list[TokenDelta]:
        """Schedule, run one forward, sample; returns one delta per request that got a token."""
        return self.step_output().deltas()

    def step_output(self) -> StepOutput:
        """``step()`` with its deltas left to build (``StepOutput.deltas()``, on any thread, any time
        later): what a worker's step thread calls."""
        if self._awaiting:
            self._admit_compiled()
            if self._awaiting and not (self.scheduler.waiting or self.scheduler.running or self._in_flight):
                self.structured.wait(_GRAMMAR_WAIT_S)
                self._admit_compiled()
        if isinstance(self.scheduler, AsyncScheduler):
            return self._step_async(self.scheduler)
        t0 = time.perf_counter()
        out = self.scheduler.schedule()
        t1 = time.perf_counter()
        if out.is_empty:
            return StepOutput()
        sampled = self.runner.execute(out, self.structured.step_mask)
        t2 = time.perf_counter()
        if sampled.prompt_logprobs:
            self._add_prompt_logprobs(sampled)
        updated = self.scheduler.update_from_output(out, sampled)
        t3 = time.perf_counter()
        output = self._output([(r, len(r.output_token_ids) - 1) for r in updated])
        t4 = time.perf_counter()
        self._count_launch(out)
        self._stats.num_generation_tokens += len(sampled)
        forward_s = t2 - t1 - self.runner.prepare_time_s
        self._observe_prefill(out, forward_s)
        self._count_times((t1 - t0) + (t3 - t2), forward_s, t4 - t3)
        return output

    def _observe_prefill(self, out: SchedulerOutput, forward_s: float) -> None:
        """A step that computed prompt blocks teaches the host tier's load rule a recompute's cost."""
        if self.load_rule is not None and out.num_prompt_tokens >= self.config.block_size:
            self.load_rule.observe_forward(out.num_batched_tokens, forward_s)

    def _step_async(self, scheduler: AsyncScheduler) -> StepOutput:
        """Launch the next step, then wait for and apply the previous one (see the class docstring)."""
        t0 = time.perf_counter()
        out = scheduler.schedule()
        t1 = time.perf_counter()
        previous, launched, self._in_flight = self._in_flight, self._launched, None
        deferred: ForwardStep | None = None
        if not out.is_empty:
            if previous is not None and self._needs_resolved_history(out):
                deferred = self.runner.forward(out)  # sampled below, once `previous` is resolved
            else:
                self._in_flight = (out, self.runner.launch(out, self.structured.step_mask))
            self._count_launch(out)
        t2 = time.perf_counter()
        launch_s = t2 - t1 - (self.runner.prepare_time_s if not out.is_empty else 0.0)
        self._launched = (launch_s, t2)
        if previous is None:
            self._count_times(t1 - t0, launch_s, 0.0)
            return StepOutput()
        sampled = previous[1].result()
        t3 = time.perf_counter()
        # NOTE: its forward: its launch (all of it on CPU) + the wait for it once the device could start it
        self._observe_prefill(previous[0], launched[0] + t3 - max(launched[1], self._resolved_at))
        self._resolved_at = t3
        if sampled.prompt_logprobs:
            self._add_prompt_logprobs(sampled)
        resolved = scheduler.resolve(previous[0], sampled)
        t4 = time.perf_counter()
        output = self._output(resolved)
        if deferred is not None:
            # NOTE: the matchers now stand after `previous`'s tokens, so the mask is the right one.
            mask = self.structured.step_mask(deferred.sample_ids)
            self._in_flight = (out, self.runner.sample(deferred, mask))
            for rid in deferred.sample_ids:
                if rid not in self.scheduler.requests:
                    # NOTE: ended while `previous` resolved (its token here is discarded); the sampling
                    # just recreated its seeded generator, which nothing would free.
                    self.runner.remove(rid)
        t5 = time.perf_counter()
        self._stats.num_generation_tokens += len(resolved)
        self._count_times(t1 - t0 + t4 - t3, launch_s + t3 - t2, t5 - t4)
        return output

    def _add_prompt_logprobs(self, sampled: SampledTokens) -> None:
        """A step's prompt logprobs to their requests, before its tokens (the first token's delta carries
        them, and a request may end with that token)."""
        requests = self.scheduler.requests
        for request_id, (start_position, entries) in sampled.prompt_logprobs.items():
            request = requests.get(request_id)
            if request is not None:  # NOTE: None: it ended (an abort) while the step ran
                request.add_prompt_logprobs(start_position, entries)

    def _needs_resolved_history(self, out: SchedulerOutput) -> bool:
        """A request that needs its token history on the host to sample (a grammar's mask; penalties or
        bad words) samples in ``out`` while its previous token is still unresolved (its input is that
        token's placeholder, always the newest token of a sampling row). NOTE: min_tokens reads only the
        number of outputs, which counts the placeholder, so it needs no resolved history."""
        structured, processors = self.structured, self.runner.logits_processors
        if not len(structured) and not processors.num_needing_history:
            return False
        needs_history = processors.needs_history
        return any(
            s.needs_sample
            and s.token_ids[-1] < 0
            and (s.request_id in structured or needs_history(s.request_id))
            for s in out.scheduled
        )

    def _count_launch(self, out: SchedulerOutput) -> None:
        if out.kv_copies and self.load_rule is not None and self.runner.host_kv is not None:
            host_kv = self.runner.host_kv
            self.load_rule.observe_copy(
                host_kv.num_copied_bytes - self._copied[0], host_kv.copy_seconds - self._copied[1]
            )
            self._copied = (host_kv.num_copied_bytes, host_kv.copy_seconds)
        st = self._stats
        st.num_steps += 1
        st.num_mixed_steps += out.is_mixed
        st.num_prompt_tokens += out.num_prompt_tokens
        st.prepare_time_s += self.runner.prepare_time_s

    def _count_times(self, schedule_s: float, forward_s: float, detokenize_s: float) -> None:
        st = self._stats
        st.schedule_time_s += schedule_s
        st.forward_time_s += forward_s
        st.detokenize_time_s += detokenize_s

    def _output(self, items: list[tuple[Request, int]]) -> StepOutput:
        """The output of each (request, index of its newest resolved output token) of one step.

        Grammars, then text (one batched decode for every request this engine detokenizes), then each
        request's item: its end is decided before its item is taken (requests are independent)."""
        if len(self.structured):
            for request, index in items:
                self._advance_grammar(request, request.output_token_ids[index])
        texts = self._texts(items) if self.detokenizers else None
        taken: list[StepItem] = []
        append = taken.append
        for request, index in items:
            finish_reason = request.status.finish_reason
            logprobs = request.logprobs
            append(
                (
                    request,
                    index,
                    request.output_token_ids[index],
                    finish_reason,
                    logprobs[-1] if logprobs and request.params.logprobs is not None else None,
                )
            )
            if finish_reason is not None:
                self._drop(request.request_id)
        return StepOutput(taken, texts)

    def _advance_grammar(self, request: Request, token_id: int) -> None:
        end = self.structured.advance(request.request_id, token_id)
        if end is RequestStatus.FINISHED_ERROR:
            # NOTE: cannot happen while the mask reaches the sampler; fail loudly, never emit such text.
            logger.error("request %s: sampled token %d breaks its grammar", request.request_id, token_id)
        if end is not None and not request.status.is_finished:
            if end is RequestStatus.FINISHED_ERROR:
                request.error = f"sampled token {token_id} is not allowed by the request's structured output"
            self.scheduler.finish_request(request.request_id, end)

    def _texts(self, items: list[tuple[Request, int]]) -> dict[str, str]:
        """The new text of each request of ``items`` this engine detokenizes; a stop string ends its
        request here."""
        detokenizers, tokenizer = self.detokenizers, self.tokenizer
        if tokenizer is None:
            raise RuntimeError("a detokenizer without a tokenizer")
        owned = [(r, i, d) for r, i in items if (d := detokenizers.get(r.request_id)) is not None]
        # NOTE: a request already STOPPED here ended on its stop token (EOS, a stop id, its grammar's end)
        matches = update_all(
            tokenizer,
            [d for _, _, d in owned],
            [[r.output_token_ids[i]] for r, i, _ in owned],
            [r.status is RequestStatus.FINISHED_STOPPED for r, _, _ in owned],
        )
        texts: dict[str, str] = {}
        for (request, _, detok), matched in zip(owned, matches, strict=True):
            if matched is not None and not request.status.is_finished:
                self.scheduler.finish_request(request.request_id, RequestStatus.FINISHED_STOPPED)
            texts[request.request_id] = detok.get_delta(finished=request.status.is_finished)
        return texts

    # ---- endings -----------------------------------------------------------------------------------
    def abort(self, request_id: str) -> bool:
        """Cancel a request in any state and free its blocks; False if it is not (or no longer) here."""
        waiting = self._awaiting.pop(request_id, None)
        found = self.scheduler.finish_request(request_id, RequestStatus.FINISHED_ABORTED) is not None
        found = found or waiting is not None
        self._drop(request_id)
        if self.stage is not None:
            self.stage.drop(request_id)  # NOTE: after this request's deltas already submitted to it
        return found

    def release(self, request_id: str) -> None:
        """Prefill side: the handoff of a held request is over; its blocks go free (or to the cache)."""
        self.scheduler.release(request_id)
        self._drop(request_id)

    def _drop(self, request_id: str) -> None:
        self.detokenizers.pop(request_id, None)
        self.structured.remove(request_id)
        self.runner.remove(request_id)

    def request_status(self, request_id: str) -> RequestStatus | None:
        request = self.scheduler.requests.get(request_id)
        return None if request is None else request.status

    def held_block_ids(self, request_id: str) -> list[int] | None:
        """Block table of a request (e.g. held for a handoff); None if it holds none."""
        return self.scheduler.kv.block_tables.get(request_id)

    # ---- observability -----------------------------------------------------------------------------
    def take_kv_events(self) -> KvEventBatch:
        """The block hashes this engine's KV tiers stored and removed since the last call (net; see
        workers/kv_events.py). The first call subscribes: its batch holds everything cached then, and from
        then on the engine records changes until it ends, so call it every step or so (a worker's step
        thread does, for the router's index). Raises RuntimeError without prefix caching."""
        return self.scheduler.kv.subscribe_events().take()

    def kv_snapshot(self) -> KvEventBatch:
        """Everything the KV tiers hold, as stored events; it covers the changes not yet taken (dropped:
        ``take_kv_events`` goes on from here). RuntimeError without prefix caching."""
        return self.scheduler.kv.kv_snapshot()

    @property
    def num_prompt_tokens(self) -> int:
        """Prompt tokens computed so far (prefix-cache hits excluded): ``stats()``'s, without the copy."""
        return self._stats.num_prompt_tokens

    def stats(self) -> EngineStats:
        st = self._stats
        kv = self.scheduler.kv
        if kv.prefix_cache is not None:
            st.prefix_cache_queries = kv.prefix_cache.num_query_tokens
            st.prefix_cache_hits = kv.prefix_cache.num_hit_tokens
        host, host_kv = kv.host, self.runner.host_kv
        if host is not None and host_kv is not None:
            ranks = self.config.tensor_parallel_size
            st.prefix_cache_host_hits = host.num_loaded * self.config.block_size  # a hit is a load
            st.num_host_blocks, st.num_host_blocks_used = host.num_slots, len(host)
            st.kv_offloaded_blocks, st.kv_loaded_blocks = host.num_offloaded, host.num_loaded
            st.kv_offloaded_bytes = host.num_offloaded * host_kv.bytes_per_block * ranks
            st.kv_loaded_bytes = host.num_loaded * host_kv.bytes_per_block * ranks
            ratio = None if self.load_rule is None else self.load_rule.load_cost_ratio()
            st.host_load_cost = -1.0 if ratio is None else ratio
        st.num_preemptions = self.scheduler.num_preemptions
        st.num_free_blocks = kv.pool.num_free
        st.num_total_blocks = kv.pool.num_usable
        st.num_running = len(self.scheduler.running)
        st.num_waiting = len(self.scheduler.waiting)
        return EngineStats(**vars(st))

    def check_no_leaks(self) -> None:
        """Leak invariant: every block free or cache-owned with ref count 0, and every map empty."""
        if self._in_flight is not None:
            raise AssertionError(
                "a launched step was never resolved (step() until has_unfinished() is false)"
            )
        self.scheduler.check_no_leaks()
        if self._awaiting:
            raise AssertionError(f"requests left waiting for their grammar: {sorted(self._awaiting)}")
        if (
            self.detokenizers
            or self.runner.generators
            or len(self.structured)
            or self.runner.block_tables.num_requests
            or len(self.runner.logits_processors)
        ):
            raise AssertionError(
                f"per-request state left: detokenizers {sorted(self.detokenizers)}, "
                f"generators {sorted(self.runner.generators)}, grammars {sorted(self.structured)}, "
                f"block-table rows {self.runner.block_tables.num_requests}, "
                f"logits processors {len(self.runner.logits_processors)}"
            )
