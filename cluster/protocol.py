"""Boundary types: sampling parameters, token deltas, request outputs, error codes, stats.

Plain dataclasses; the router <-> worker messages that carry them, and their strict msgpack codec, are
cluster/wire.py (each dataclass travels as its strict form: cluster/wire_forms.py). This module imports
nothing of the project and nothing heavy, so the router, server, client and workers all use it.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

MAX_LOGPROBS = 20
# Caps on the sampling fields a request may carry (each a 400 at the edge, a ValueError offline).
MAX_LOGIT_BIAS_ENTRIES = 1024  # logit_bias entries
MAX_BAD_WORDS = 256  # bad_words entries (each tokenized into at most MAX_BAD_WORD_TOKENS ids)
MAX_BAD_WORD_TOKENS = 64
MAX_PENALTY = 2.0  # presence_penalty and frequency_penalty lie in [-MAX_PENALTY, MAX_PENALTY] (OpenAI)
MAX_LOGIT_BIAS = 100.0  # a logit_bias value lies in [-100, 100] (OpenAI)
STRUCTURED_KINDS = ("json", "json_object", "regex", "choice", "grammar")


class FinishReason(str, enum.Enum):
    STOP = "stop"  # EOS, a stop token id or a stop string
    LENGTH = "length"  # max_tokens or max_model_len reached
    ABORT = "abort"  # cancelled by the caller
    ERROR = "error"  # failed inside the cluster (message carried separately)


@dataclass
class StructuredOutput:
    """A constraint on a request's output, applied by the worker as a per-step token mask
    (workers/structured.py compiles it with xgrammar).

    kind "json": ``spec`` is a JSON schema as JSON text; "json_object": any JSON object; "regex":
    ``spec`` is the pattern; "choice": the output is exactly one of ``choices``; "grammar": ``spec``
    is an EBNF grammar (xgrammar's dialect, as vLLM's ``guided_grammar``).
    """

    kind: str
    spec: str = ""
    choices: list[str] = field(default_factory=list)

    def validate(self) -> None:
        """Raise ValueError naming what is wrong (the worker's compiler checks the rest)."""
        if self.kind not in STRUCTURED_KINDS:
            raise ValueError(f"structured output kind must be one of {STRUCTURED_KINDS}, got {self.kind!r}")
        if self.kind == "choice":
            if not self.choices or any(not isinstance(c, str) or not c for c in self.choices):
                raise ValueError("choice needs a non-empty list of non-empty strings")
        elif self.kind != "json_object" and not self.spec:
            raise ValueError(f"structured output {self.kind} needs a non-empty spec")

    @property
    def cache_key(self) -> tuple[str, str, tuple[str, ...]]:
        return (self.kind, self.spec, tuple(self.choices))

    @property
    def num_grammar_rules(self) -> int:
        """EBNF rule definitions in a grammar spec (its ``::=``; 0 for other kinds): a complexity cap
        the edge and the worker check before anything compiles."""
        return self.spec.count("::=") if self.kind == "grammar" else 0


@dataclass
class SamplingParams:
    """How to pick the next tokens for one request (the fields vLLM's offline API accepts).

    temperature 0 is greedy. top_k 0 (or -1) and top_p 1 and min_p 0 disable those filters.
    seed makes the request's random draws independent of whatever else shares the batch.
    logprobs None returns none; k >= 0 returns the chosen token's logprob plus the top k.
    structured: constrain the output (JSON schema, regex, choice, grammar); None: free text.

    Logits processors, as vLLM defines them (applied to the logits before temperature and the filters;
    the reported logprobs stay those of the raw distribution, as vLLM's default ``raw_logprobs``):
    presence_penalty / frequency_penalty (OpenAI's, over the output tokens: ``logit -= frequency *
    count + presence * (count > 0)``); repetition_penalty (transformers' / vLLM's, over prompt and
    output tokens: a positive logit is divided by it, a negative one multiplied); logit_bias (token id
    -> value added); min_tokens (EOS and stop_token_ids masked until that many tokens are out);
    bad_words (strings, as the user gave them) resolve to bad_words_token_ids (each a token sequence
    whose last token is masked when the output ends with the rest, as transformers'
    ``NoBadWordsLogitsProcessor``); allowed_token_ids (None: every token); prompt_logprobs (None: none;
    k: each prompt token's logprob plus the top k, computed where the prompt is prefilled).
    Detokenization: include_stop_str_in_output keeps a matched stop string in the text;
    skip_special_tokens False keeps special tokens in the text.
    """

    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    logprobs: int | None = None
    structured: StructuredOutput | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[int, float] = field(default_factory=dict)
    min_tokens: int = 0
    bad_words: list[str] = field(default_factory=list)
    bad_words_token_ids: list[list[int]] = field(default_factory=list)
    allowed_token_ids: list[int] | None = None
    prompt_logprobs: int | None = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0.0 or self.top_k == 1

    @property
    def has_penalties(self) -> bool:
        """Any of the three penalties is on (they read the request's token history)."""
        return self.presence_penalty != 0.0 or self.frequency_penalty != 0.0 or self.repetition_penalty != 1.0

    @property
    def has_logits_processors(self) -> bool:
        """Any logits processor is on: penalties, logit_bias, min_tokens, bad words, allowed ids."""
        return (
            self.has_penalties
            or bool(self.logit_bias)
            or self.min_tokens > 0
            or bool(self.bad_words_token_ids)
            or self.allowed_token_ids is not None
        )

    def validate(self, vocab_size: int | None = None) -> None:
        """Raise ValueError naming the offending field and its limit."""
        if not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise ValueError(f"max_tokens must be an integer >= 1, got {self.max_tokens!r}")
        if self.temperature < 0.0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < -1:
            raise ValueError(f"top_k must be -1, 0 (disabled) or >= 1, got {self.top_k}")
        if not 0.0 <= self.min_p <= 1.0:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")
        if self.logprobs is not None and not 0 <= self.logprobs <= MAX_LOGPROBS:
            raise ValueError(f"logprobs must be in [0, {MAX_LOGPROBS}], got {self.logprobs}")
        if any(not isinstance(s, str) or not s for s in self.stop):
            raise ValueError("stop must be a list of non-empty strings")
        if self.structured is not None:
            self.structured.validate()
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not -MAX_PENALTY <= value <= MAX_PENALTY:
                raise ValueError(f"{name} must be in [{-MAX_PENALTY}, {MAX_PENALTY}], got {value}")
        if not self.repetition_penalty > 0.0:
            raise ValueError(f"repetition_penalty must be > 0, got {self.repetition_penalty}")
        if len(self.logit_bias) > MAX_LOGIT_BIAS_ENTRIES:
            raise ValueError(
                f"logit_bias may hold at most {MAX_LOGIT_BIAS_ENTRIES} entries, got {len(self.logit_bias)}"
            )
        for value in self.logit_bias.values():
            if not -MAX_LOGIT_BIAS <= value <= MAX_LOGIT_BIAS:
                raise ValueError(
                    f"logit_bias values must be in [{-MAX_LOGIT_BIAS}, {MAX_LOGIT_BIAS}], got {value}"
                )
        if not isinstance(self.min_tokens, int) or not 0 <= self.min_tokens <= self.max_tokens:
            raise ValueError(
                f"min_tokens must be in [0, max_tokens={self.max_tokens}], got {self.min_tokens!r}"
            )
        if len(self.bad_words) > MAX_BAD_WORDS or len(self.bad_words_token_ids) > 2 * MAX_BAD_WORDS:
            raise ValueError(f"bad_words may hold at most {MAX_BAD_WORDS} entries, got {len(self.bad_words)}")
        if any(not isinstance(w, str) or not w for w in self.bad_words):
            raise ValueError("bad_words must be a list of non-empty strings")
        if any(not 1 <= len(ids) <= MAX_BAD_WORD_TOKENS for ids in self.bad_words_token_ids):
            raise ValueError(f"each bad word must be 1 to {MAX_BAD_WORD_TOKENS} tokens")
        if self.allowed_token_ids is not None and not self.allowed_token_ids:
            raise ValueError("allowed_token_ids must hold at least one token id (None allows every token)")
        if self.prompt_logprobs is not None and not 0 <= self.prompt_logprobs <= MAX_LOGPROBS:
            raise ValueError(f"prompt_logprobs must be in [0, {MAX_LOGPROBS}], got {self.prompt_logprobs}")
        if vocab_size is not None:
            for t in self.stop_token_ids:
                if not 0 <= t < vocab_size:
                    raise ValueError(f"stop_token_ids entries must be in [0, {vocab_size}), got {t}")
            for name, ids in (
                ("logit_bias", list(self.logit_bias)),
                ("allowed_token_ids", self.allowed_token_ids or []),
                ("bad_words", [t for word in self.bad_words_token_ids for t in word]),
            ):
                for t in ids:
                    if not 0 <= t < vocab_size:
                        raise ValueError(f"{name} token ids must be in [0, {vocab_size}), got {t}")


@dataclass
class TokenLogprobs:
    """Logprobs of one generated position: the chosen token's, then the top-n (raw model distribution)."""

    token_id: int
    logprob: float
    top_token_ids: list[int] = field(default_factory=list)
    top_logprobs: list[float] = field(default_factory=list)


@dataclass
class RequestOutput:
    """A finished (or, when streaming, in-progress) request as the offline API and router return it.

    Timestamps are time.time() seconds: arrival (engine accepted it), first token, finish.
    """

    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    finish_reason: FinishReason | None = None
    logprobs: list[TokenLogprobs] | None = None
    num_cached_tokens: int = 0
    arrival_time: float = 0.0
    # one entry per prompt token (the first None: nothing precedes it), when ``prompt_logprobs`` was asked
    prompt_logprobs: list[TokenLogprobs | None] | None = None
    first_token_time: float | None = None
    finish_time: float | None = None
    error: str | None = None

    @classmethod
    def start(
        cls, request_id: str, prompt_token_ids: list[int], params: SamplingParams, now: float
    ) -> RequestOutput:
        """An empty output that ``apply`` fills from the request's stream of deltas."""
        return cls(
            request_id,
            list(prompt_token_ids),
            arrival_time=now,
            logprobs=[] if params.logprobs is not None else None,
        )

    def apply(self, delta: TokenDelta, now: float) -> None:
        """Append one delta of this request's stream (``now``: when it arrived)."""
        if self.first_token_time is None:
            self.first_token_time = now
        self.token_ids.extend(delta.token_ids)
        self.text += delta.text
        self.num_cached_tokens = delta.num_cached_tokens
        if delta.logprobs is not None and self.logprobs is not None:
            self.logprobs.extend(delta.logprobs)
        if delta.prompt_logprobs is not None:
            self.prompt_logprobs = delta.prompt_logprobs
        if delta.finish_reason is not None:
            self.finish_reason = delta.finish_reason
            self.finish_time = now
            self.error = delta.error


@dataclass(slots=True)
class TokenDelta:
    """What one engine step produced for one request: new tokens, new text, and the end if it ended.

    Streaming consumers (router, offline LLM) concatenate deltas; ``num_cached_tokens`` is the prompt's
    prefix-cache hit, set on every delta. NOTE: slots: a step builds one per request (256 at a time);
    ~30 ns less each.
    """

    request_id: str
    token_ids: list[int]
    text: str = ""
    logprobs: list[TokenLogprobs] | None = None
    finish_reason: FinishReason | None = None
    num_cached_tokens: int = 0
    error: str | None = None
    timings: RequestTimings | None = None  # set by the router on the final delta
    scheduled_time: float | None = None  # engine: when the request was first scheduled (first delta only)
    # the prompt's logprobs (SamplingParams.prompt_logprobs), on the delta of the first token only: one
    # entry per prompt token, the first None
    prompt_logprobs: list[TokenLogprobs | None] | None = None


def delta_nbytes(delta: TokenDelta) -> int:
    """About what holding ``delta`` costs a Python process, in bytes (measured with tracemalloc: ~450
    for a one-token delta, ~2,200 with 20 top logprobs): what the router's and the edge's per-request
    buffers count against their bounds."""
    num_bytes = 400 + 40 * len(delta.token_ids) + len(delta.text) + len(delta.request_id)
    if delta.logprobs:
        num_bytes += sum(350 + 72 * len(lp.top_token_ids) for lp in delta.logprobs)
    if delta.prompt_logprobs:
        num_bytes += sum(350 + 72 * len(lp.top_token_ids) for lp in delta.prompt_logprobs if lp is not None)
    return num_bytes


@dataclass
class GenerateRequest:
    """What the HTTP server hands the router: already tokenized and validated at the edge.

    deadline: absolute time.time() after which the request fails with DeadlineExceeded (None: no bound
    beyond the router's default). ttft_slo_s: this request's TTFT SLO for SLO-aware admission (the
    ``x-pdserve-ttft-slo-ms`` header; None: the router's ``ttft_slo_ms``).
    """

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    deadline: float | None = None
    ttft_slo_s: float | None = None


@dataclass
class RouteInfo:
    """Why the router sent a request where it did (``RequestTimings.route``; the same mode and reason
    label ``pdserve_route_decisions_total``).

    mode: "colocated" (one worker ran it whole: colocated mode, or the fallback), "disaggregated"
    (prefill worker, then a KV handoff to a decode worker) or "conditional" (conditional routing prefilled
    it on the decode worker). Hits are the router's expectation of each side's prefix-cache hit (tokens),
    from what it routed there before; ``predicted_ttft_s`` / ``predicted_tbt_s`` are the cost model's TTFT
    and decode step on the chosen path (None without a profile).
    """

    mode: str = ""
    reason: str = ""
    prefill_worker: str | None = None
    decode_worker: str | None = None
    prefill_hit_tokens: int = 0
    decode_hit_tokens: int = 0
    predicted_ttft_s: float | None = None
    predicted_tbt_s: float | None = None


@dataclass
class RequestTimings:
    """Per-request split measured by the router (seconds); attached to the final TokenDelta."""

    queue_s: float = 0.0  # arrival at the router -> a worker started computing it
    prefill_s: float = 0.0  # prefill compute until the first token
    transfer_s: float = 0.0  # KV handoff (0 when colocated)
    decode_s: float = 0.0  # first token -> finish
    ttft_s: float = 0.0
    e2e_s: float = 0.0
    num_migrations: int = 0  # times the router dispatched it again after its worker died
    route: RouteInfo | None = None  # the router's decision for its last attempt


@dataclass
class ModelInfo:
    """What the edge needs to validate and label requests."""

    name: str
    model_dir: str
    max_model_len: int
    vocab_size: int


class ErrorCode(str, enum.Enum):
    """Why a request failed, as it travels between workers, router and server. Only the HTTP server
    maps a code to an HTTP status (cluster/http/errors.py)."""

    INVALID_REQUEST = "invalid_request"
    QUEUE_FULL = "queue_full"
    DEADLINE_EXCEEDED = "deadline_exceeded"
    UNAVAILABLE = "unavailable"
    ABORTED = "aborted"
    WORKER_FAILED = "worker_failed"
    KV_TRANSFER_FAILED = "kv_transfer_failed"
    SLO_UNATTAINABLE = "slo_unattainable"
    INTERNAL = "internal_error"
    STRUCTURED_OUTPUT_TOO_COMPLEX = "structured_output_too_complex"


class RouterError(Exception):
    """A request the cluster cannot serve; ``code`` says why. ``retry_after_s``: when a retry may
    succeed (the HTTP edge's Retry-After), None for its default."""

    code = ErrorCode.INTERNAL
    retry_after_s: int | None = None


class InvalidRequestError(RouterError):
    code = ErrorCode.INVALID_REQUEST


class QueueFullError(RouterError):
    code = ErrorCode.QUEUE_FULL


class StructuredOutputTooComplexError(InvalidRequestError):
    """A structured-output spec over a size cap or the worker's compile time budget (a 400)."""

    code = ErrorCode.STRUCTURED_OUTPUT_TOO_COMPLEX


class SloUnattainableError(RouterError):
    """SLO-aware admission refused the request: its predicted TTFT misses its SLO (nothing was queued)."""

    code = ErrorCode.SLO_UNATTAINABLE

    def __init__(self, message: str = "", retry_after_s: int = 1) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s


class DeadlineExceededError(RouterError):
    code = ErrorCode.DEADLINE_EXCEEDED


class ClusterUnavailableError(RouterError):
    code = ErrorCode.UNAVAILABLE


class RequestAbortedError(RouterError):
    code = ErrorCode.ABORTED


class WorkerFailedError(RouterError):
    code = ErrorCode.WORKER_FAILED


class KVTransferFailedError(WorkerFailedError):
    code = ErrorCode.KV_TRANSFER_FAILED


ROUTER_ERRORS: dict[ErrorCode, type[RouterError]] = {
    cls.code: cls
    for cls in (
        RouterError,
        InvalidRequestError,
        QueueFullError,
        StructuredOutputTooComplexError,
        SloUnattainableError,
        DeadlineExceededError,
        ClusterUnavailableError,
        RequestAbortedError,
        WorkerFailedError,
        KVTransferFailedError,
    )
}


def router_error(code: ErrorCode, message: str) -> RouterError:
    """The RouterError subclass for ``code``."""
    return ROUTER_ERRORS[code](message)


@dataclass
class EngineStats:
    """One engine's gauges and cumulative counters (the offline API's ``LLM.stats()``; inside
    ``WorkerStats`` on a worker)."""

    num_steps: int = 0
    num_mixed_steps: int = 0
    num_preemptions: int = 0
    num_prompt_tokens: int = 0  # prompt tokens computed (prefix-cache hits excluded)
    num_generation_tokens: int = 0
    prefix_cache_queries: int = 0  # tokens looked up
    prefix_cache_hits: int = 0  # tokens found (either tier)
    prefix_cache_host_hits: int = 0  # of those, tokens found in the host tier (loaded back)
    num_host_blocks: int = 0  # the host tier's size in blocks (0: no tier)
    num_host_blocks_used: int = 0  # host blocks holding a cached block
    kv_offloaded_blocks: int = 0  # blocks copied device -> host
    kv_loaded_blocks: int = 0  # blocks copied host -> device
    kv_offloaded_bytes: int = 0  # bytes of those copies, summed over ranks
    kv_loaded_bytes: int = 0
    # a host-tier hit's cost against recomputing its tokens, as the load rule measured it (the copy time
    # of a block over its tokens' prefill time: >= 1 means they are recomputed); -1: not measured / no tier
    host_load_cost: float = -1.0
    num_free_blocks: int = 0
    num_total_blocks: int = 0
    num_running: int = 0
    num_waiting: int = 0
    schedule_time_s: float = 0.0  # host time: schedule() + update_from_output() (forward excluded)
    prepare_time_s: float = 0.0  # host time: building the step's input tensors
    detokenize_time_s: float = 0.0  # host time: incremental detokenization, stop strings, deltas
    forward_time_s: float = 0.0  # model forward + sampling (includes the one device sync)

    @property
    def kv_usage(self) -> float:
        """Fraction of usable KV blocks with a user."""
        return 1.0 - self.num_free_blocks / max(1, self.num_total_blocks)


@dataclass
class KvEventBatch:
    """The net change of what one worker's KV tiers hold since its last batch (workers/kv_events.py):
    ``(tier, block hash)`` pairs stored and removed; tier 0 is the device cache, 1 the host tier. A hash
    is the chained content hash of a full block (cluster/block_hash.py)."""

    stored: list[tuple[int, bytes]] = field(default_factory=list)
    removed: list[tuple[int, bytes]] = field(default_factory=list)

    def __len__(self) -> int:
        return len(self.stored) + len(self.removed)


@dataclass
class TransferStats:
    """Cumulative KV-transfer counters of one side (sender or receiver)."""

    num_ok: int = 0
    num_failed: int = 0
    bytes_total: int = 0
    seconds_total: float = 0.0
    # received chunks whose digest or MAC tag did not verify (issue 31: forged or corrupt KV, refused)
    num_rejected_chunks: int = 0


@dataclass
class StepSplit:
    """The step thread's engine steps (wall seconds, tokens out, prompt tokens computed) and the share of
    them during which this worker's transfer side finished KV transfers (``beside_*``;
    ``beside_transfers``: how many finished then). The transfer threads share the process, the
    interpreter lock and the cores with the step thread: ``pdserve plan calibrate``'s probe reads what a
    received transfer adds to the steps beside it from the two shares
    (``CostProfile.handoff_receive_step_s``)."""

    num_steps: int = 0
    seconds: float = 0.0
    num_tokens: int = 0
    prompt_tokens: int = 0
    beside_steps: int = 0
    beside_seconds: float = 0.0
    beside_tokens: int = 0
    beside_prompt_tokens: int = 0
    beside_transfers: int = 0

    def count(self, seconds: float, num_tokens: int, prompt_tokens: int, finished_transfers: int) -> None:
        """One more step (on the step thread)."""
        self.num_steps += 1
        self.seconds += seconds
        self.num_tokens += num_tokens
        self.prompt_tokens += prompt_tokens
        if finished_transfers > 0:
            self.beside_steps += 1
            self.beside_seconds += seconds
            self.beside_tokens += num_tokens
            self.beside_prompt_tokens += prompt_tokens
            self.beside_transfers += finished_transfers


@dataclass
class WorkerStats:
    """One worker's snapshot, published by its step thread with every heartbeat; the router keeps the
    latest and /metrics exports it.

    healthy: every worker thread is alive and nothing failed; the router adds heartbeat freshness.
    rejected_frames: control frames this worker dropped, by reason (cluster/frames.py), the KV-transfer
    handshake's included.
    broken_peers: KV-transfer peers (``peer_name``) whose pair with this worker is broken (its connection
    closed, or building it failed): not used until rebuilt, with the next generation, on its next use.
    steps: the step thread's steps, split by whether a KV transfer finished beside them.
    num_freed_for_router: requests this worker freed because the router that owned them went silent past
    its lease or was replaced by a restarted one (front-end replicas, workers/router_links.py).
    num_pulled_*: prefix blocks pulled from other workers' caches into this one.
    """

    worker_id: str
    pool: str  # "prefill" | "decode" | "colocated"
    healthy: bool = True
    num_waiting_for_kv: int = 0
    engine: EngineStats = field(default_factory=EngineStats)
    transfer: TransferStats = field(default_factory=TransferStats)
    rejected_frames: dict[str, int] = field(default_factory=dict)
    broken_peers: list[str] = field(default_factory=list)
    steps: StepSplit = field(default_factory=StepSplit)
    num_freed_for_router: int = 0
    num_pulled_blocks: int = 0  # prefix blocks this worker pulled from others (workers/prefix_pulls.py)
    num_pulled_bytes: int = 0
    num_pull_failures: int = 0  # pulls that failed or found nothing to take (the prompt computed as usual)


def peer_name(worker_id: str, incarnation: str) -> str:
    """One process of a worker (a restarted worker is another peer): names KV-transfer peers and the
    recipients of their handshake frames."""
    return f"{worker_id}/{incarnation}"
