"""One request's engine-side state.

There is no prefill or decode phase: ``num_computed_tokens`` catches up with ``num_tokens`` (prompt plus
generated tokens). A request whose next step computes exactly one token and samples is decoding.
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

from cluster.protocol import FinishReason, SamplingParams, TokenLogprobs


class RequestStatus(enum.Enum):
    WAITING = "waiting"  # queued; holds no blocks
    RUNNING = "running"  # scheduled in the running set; holds blocks
    PREEMPTED = "preempted"  # blocks freed, back at the front of waiting, recomputes from its prefix
    WAITING_FOR_KV = "waiting_for_kv"  # decode side: blocks reserved, KV bytes still arriving
    SENDING_KV = "sending_kv"  # prefill side: finished its prompt, blocks held for the handoff
    FINISHED_STOPPED = "finished_stopped"
    FINISHED_LENGTH = "finished_length"
    FINISHED_ABORTED = "finished_aborted"
    FINISHED_ERROR = "finished_error"

    # NOTE: read for every request on every step; a plain attribute set once per member below, since
    # Enum's own hash (a Python-level function) would make a dict lookup cost a call, and a property a
    # call too.
    finish_reason: FinishReason | None

    @property
    def is_finished(self) -> bool:
        return self.finish_reason is not None


_FINISH_REASONS = {
    RequestStatus.FINISHED_STOPPED: FinishReason.STOP,
    RequestStatus.FINISHED_LENGTH: FinishReason.LENGTH,
    RequestStatus.FINISHED_ABORTED: FinishReason.ABORT,
    RequestStatus.FINISHED_ERROR: FinishReason.ERROR,
}
for _status in RequestStatus:
    _status.finish_reason = _FINISH_REASONS.get(_status)


# NOTE: eq=False: requests are compared by identity (``running.remove(request)`` must not compare every
# field of every running request).
@dataclass(eq=False)
class Request:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    eos_token_ids: tuple[int, ...] = ()
    # prefill worker of a disaggregated pair: stop after the first token and keep the blocks (SENDING_KV)
    hold_after_prefill: bool = False
    arrival_time: float = field(default_factory=time.time)

    status: RequestStatus = RequestStatus.WAITING
    output_token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprobs] = field(default_factory=list)
    # SamplingParams.prompt_logprobs asked: entry i scores prompt token i (entry 0 None: nothing precedes
    # it), filled chunk by chunk (``add_prompt_logprobs``) and complete once the first token is sampled;
    # the delta of that token carries it. None: not asked.
    prompt_logprobs: list[TokenLogprobs | None] | None = field(default=None, init=False)
    num_computed_tokens: int = 0
    num_cached_tokens: int = 0  # prompt tokens served by the prefix cache at first schedule
    num_preemptions: int = 0
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    finish_time: float | None = None
    error: str | None = None
    # the token ids that stop this request (EOS unless ignore_eos, and stop_token_ids), gathered once
    stop_ids: frozenset[int] = field(init=False, repr=False)
    # NOTE: the output count at which `check_stop` may end the request on length, set by the scheduler
    # that takes it (it knows max_model_len); 0 asks `check_stop` after every token. A pre-check, so the
    # scheduler's step calls `check_stop` only for a token that may stop its request.
    length_check_at: int = field(default=0, init=False, repr=False)

    def __post_init__(self) -> None:
        params = self.params
        ids = set(params.stop_token_ids or ())
        if not params.ignore_eos:
            ids.update(self.eos_token_ids)
        self.stop_ids = frozenset(ids)
        if params.prompt_logprobs is not None:
            self.prompt_logprobs = [None]

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def is_scoring_prompt(self) -> bool:
        """Its prompt chunks score the prompt (prompt logprobs asked, no token sampled yet): they take no
        prefix-cache hit, for a cached position has no logits. A request that has tokens (sampled here,
        or streamed elsewhere before a migration or a handoff) sent its prompt logprobs already, if ever."""
        return self.prompt_logprobs is not None and not self.output_token_ids

    def add_prompt_logprobs(self, start_position: int, entries: list[TokenLogprobs]) -> None:
        """The entries of one computed prompt chunk: those of prompt tokens ``start_position + 1`` on.

        NOTE: written at their place, over whatever an earlier computation of the same positions left
        (a preemption before the first token recomputes the prompt from position 0, and under
        asynchronous scheduling a chunk launched before the preemption may resolve after it): the list
        always ends with the newest chunk. Entries that would leave a gap are dropped (a stale chunk whose
        predecessors the recompute has not reached yet; it computes them again)."""
        scored = self.prompt_logprobs
        if scored is None or start_position + 1 > len(scored):
            return
        del scored[start_position + 1 :]
        scored.extend(entries)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    def token_slice(self, start: int, end: int) -> list[int]:
        """Token ids [start, end) of prompt + output without building the whole list."""
        num_prompt = len(self.prompt_token_ids)
        if end <= num_prompt:
            return self.prompt_token_ids[start:end]
        if start >= num_prompt:
            return self.output_token_ids[start - num_prompt : end - num_prompt]
        return self.prompt_token_ids[start:] + self.output_token_ids[: end - num_prompt]

    def set_length_check(self, max_model_len: int) -> None:
        """Set `length_check_at` for an engine whose context holds `max_model_len` tokens."""
        self.length_check_at = min(self.params.max_tokens, max_model_len - len(self.prompt_token_ids))

    def check_stop(self, max_model_len: int, num_outputs: int | None = None) -> RequestStatus | None:
        """Token-level stop after appending a token: EOS / stop_token_ids / max_tokens / max_model_len.
        ``num_outputs``: as of the output token ``num_outputs - 1`` (newer placeholders may follow it);
        default, as of the newest."""
        outputs = self.output_token_ids
        if num_outputs is None:
            num_outputs = len(outputs)
        if outputs[num_outputs - 1] in self.stop_ids:
            return RequestStatus.FINISHED_STOPPED
        if num_outputs >= self.params.max_tokens or len(self.prompt_token_ids) + num_outputs >= max_model_len:
            return RequestStatus.FINISHED_LENGTH
        return None
