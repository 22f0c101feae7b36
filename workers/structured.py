"""Structured outputs on the worker: compile a request's :class:`StructuredOutput` with xgrammar (cached),
keep one grammar matcher per request, and mask the logits of the rows that carry one.

Per request, per step (the sampler's contract, for the engine to follow):
  1. ``fill(bitmask, row)`` writes the tokens the grammar allows next into row ``row`` of a bitmask
     from ``allocate_bitmask``; ``apply_bitmask`` sets every other logit of those rows to -inf;
  2. after sampling, ``accept(token_id)`` advances the matcher (False: the token broke the grammar).
A request that already has output tokens (the decode side of a handoff, whose first token was sampled
on the prefill side; a recomputed request) is advanced over them with ``accept_all`` before its first
masked step. The matcher finishes by allowing the model's stop tokens once the grammar is complete.

Compiled grammars depend only on the spec and the tokenizer, so one :class:`GrammarCache` per engine
keeps the most recently used ones (LRU, ``max_entries``); matchers are per request and cheap.
xgrammar (and with it torch) is imported when the first cache is built, never at module import.
:class:`StructuredRequests` is the engine's side of it: the lazily built cache, every live request's
state, and the :class:`StepMask` of a step's sampled rows. Compiles (and building the cache) run on a
bounded pool of helper threads (workers/structured_compile.py), never on the engine's thread: a
request whose grammar is not compiled yet waits outside the batch (``start``, then ``activate`` until
it returns True or raises).
"""

from __future__ import annotations

import json
import threading
from collections import OrderedDict
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from cluster.protocol import StructuredOutput
from cluster.tokenizer import Tokenizer
from workers.request import RequestStatus
from workers.structured_compile import CompileLimits, CompilePool, CompileTicket

DEFAULT_MAX_ENTRIES = 128


def _xgr() -> Any:
    import xgrammar

    return xgrammar


def choice_grammar(choices: Sequence[str]) -> str:
    """An EBNF grammar whose language is exactly ``choices`` (each a JSON-escaped string literal)."""
    alternatives = " | ".join(json.dumps(c, ensure_ascii=False) for c in choices)
    return f"root ::= {alternatives}"


class GrammarCache:
    """xgrammar's compiler for one tokenizer + an LRU of compiled grammars keyed by the spec.

    vocab_size is the model's logit width (it may exceed the tokenizer's vocabulary); stop_token_ids
    are the ids that end a request whose grammar is complete. Thread-safe (the engine may compile on a
    helper thread while the step thread builds matchers).
    """

    def __init__(
        self,
        tokenizer: Tokenizer,
        vocab_size: int,
        stop_token_ids: Sequence[int],
        *,
        max_entries: int = DEFAULT_MAX_ENTRIES,
        max_threads: int = 1,
    ) -> None:
        from transformers import PreTrainedTokenizerFast

        xgr = _xgr()
        hf_tokenizer = PreTrainedTokenizerFast(tokenizer_object=tokenizer.backend)
        self.tokenizer_info = xgr.TokenizerInfo.from_huggingface(
            hf_tokenizer, vocab_size=vocab_size, stop_token_ids=list(stop_token_ids)
        )
        # NOTE: xgrammar's own cache is off: this LRU bounds the entries and counts hits.
        self._compiler = xgr.GrammarCompiler(
            self.tokenizer_info, max_threads=max_threads, cache_enabled=False
        )
        self.vocab_size = vocab_size
        self._printable_row = _printable_row(self.tokenizer_info.decoded_vocab, vocab_size)
        self.max_entries = max_entries
        self._entries: OrderedDict[tuple[str, str, tuple[str, ...]], Any] = OrderedDict()
        self._lock = threading.Lock()
        self.num_hits = 0
        self.num_misses = 0

    def compile(self, spec: StructuredOutput) -> Any:
        """The compiled grammar for ``spec`` (an xgrammar CompiledGrammar), from the cache when there.
        Raises ValueError naming the spec's kind when xgrammar rejects it. Blocks for the whole compile
        (tests, tools): an engine compiles through its :class:`CompilePool` instead."""
        compiled = self.lookup(spec)
        if compiled is None:
            compiled = self.compile_uncached(spec)
            self.put(spec, compiled)
        return compiled

    def lookup(self, spec: StructuredOutput) -> Any | None:
        """The cached compile of ``spec`` (counted as a hit), or None."""
        key = spec.cache_key
        with self._lock:
            compiled = self._entries.get(key)
            if compiled is not None:
                self._entries.move_to_end(key)
                self.num_hits += 1
            return compiled

    def put(self, spec: StructuredOutput, compiled: Any) -> None:
        """Cache a fresh compile of ``spec`` (counted as a miss), evicting the least recently used."""
        key = spec.cache_key
        with self._lock:
            self.num_misses += 1
            self._entries[key] = compiled
            self._entries.move_to_end(key)
            while len(self._entries) > self.max_entries:
                self._entries.popitem(last=False)

    def compile_uncached(self, spec: StructuredOutput) -> Any:
        """Compile ``spec`` (any thread: xgrammar releases the GIL while it compiles); ValueError naming
        its kind when xgrammar rejects it."""
        spec.validate()
        try:
            if spec.kind == "json":
                # NOTE: no free whitespace between JSON tokens (vLLM's disable_any_whitespace): a sampled
                # output cannot spend its max_tokens on spaces and newlines.
                return self._compiler.compile_json_schema(spec.spec, any_whitespace=False)
            if spec.kind == "json_object":
                return self._compiler.compile_json_schema(
                    '{"type": "object"}', any_whitespace=False, strict_mode=False
                )
            if spec.kind == "regex":
                return self._compiler.compile_regex(spec.spec)
            if spec.kind == "choice":
                return self._compiler.compile_grammar(choice_grammar(spec.choices))
            return self._compiler.compile_grammar(spec.spec)
        except (RuntimeError, ValueError, TypeError) as e:
            # NOTE: xgrammar raises RuntimeError (and subclasses) for schemas, regexes and grammars it
            # cannot parse or does not support; the first line says which.
            first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            raise ValueError(f"invalid {spec.kind} for structured output: {first}"[:500]) from None

    def matcher(self, spec: StructuredOutput, compiled: Any | None = None) -> GrammarState:
        """A fresh per-request state (over ``compiled``, else ``spec`` compiled here). JSON kinds also
        forbid tokens holding raw control characters: xgrammar's JSON strings admit them, JSON
        (RFC 8259) does not (they must be escaped)."""
        extra = self._printable_row if spec.kind in ("json", "json_object") else None
        return GrammarState(self.compile(spec) if compiled is None else compiled, self.vocab_size, extra)

    def __len__(self) -> int:
        return len(self._entries)


class GrammarState:
    """One request's position in its grammar. Lifecycle: created at admission, advanced once per
    sampled token, dropped with the request (nothing to free beyond the object)."""

    def __init__(self, compiled: Any, vocab_size: int, extra_row: torch.Tensor | None = None) -> None:
        self._matcher = _xgr().GrammarMatcher(compiled)
        self.vocab_size = vocab_size
        self._extra_row = extra_row  # ANDed into every filled row (tokens forbidden beyond the grammar)
        self.num_accepted = 0

    def fill(self, bitmask: torch.Tensor, row: int) -> bool:
        """Write the allowed next tokens into ``bitmask[row]``; False when every token is allowed."""
        needed = bool(self._matcher.fill_next_token_bitmask(bitmask, row))
        if self._extra_row is None:
            return needed
        bitmask[row] &= self._extra_row
        return True

    def accept(self, token_id: int) -> bool:
        """Advance over a sampled token; False (state unchanged) when the grammar forbids it."""
        ok = bool(self._matcher.accept_token(int(token_id)))
        self.num_accepted += ok
        return ok

    def accept_all(self, token_ids: Sequence[int]) -> None:
        """Advance over tokens sampled elsewhere (a handoff's first token); ValueError if one breaks it."""
        for i, token_id in enumerate(token_ids):
            if not self.accept(token_id):
                raise ValueError(f"token {token_id} (output position {i}) does not fit the request's grammar")

    def allowed_token_ids(self) -> list[int]:
        """The ids the grammar allows next (tests and debugging; the step path uses ``fill``)."""
        bitmask = allocate_bitmask(1, self.vocab_size)
        self.fill(bitmask, 0)
        logits = torch.zeros(1, self.vocab_size)
        apply_bitmask(logits, bitmask)
        return [int(i) for i in torch.nonzero(logits[0] == 0).flatten().tolist()]

    @property
    def is_terminated(self) -> bool:
        """The grammar accepted a stop token: nothing more may be generated."""
        return bool(self._matcher.is_terminated())

    @property
    def is_completed(self) -> bool:
        """The output so far is a complete sentence of the grammar (a stop token may come next)."""
        return bool(self._matcher.is_completed())


def _printable_row(decoded_vocab: Sequence[bytes], vocab_size: int) -> torch.Tensor:
    """A bitmask row allowing every token except those whose bytes hold a control character (< 0x20)."""
    row = allocate_bitmask(1, vocab_size)[0]
    for token_id, piece in enumerate(decoded_vocab[:vocab_size]):
        if any(b < 0x20 for b in piece):
            row[token_id // 32] &= ~(1 << (token_id % 32))
    return row


def allocate_bitmask(num_rows: int, vocab_size: int, pin_memory: bool = False) -> torch.Tensor:
    """An int32 CPU bitmask of ``num_rows`` rows, every token allowed (xgrammar's layout); pinned for an
    asynchronous upload to a CUDA device."""
    shape = _xgr().get_bitmask_shape(num_rows, vocab_size)
    return torch.full(shape, -1, dtype=torch.int32, pin_memory=pin_memory)


def reset_bitmask(bitmask: torch.Tensor) -> None:
    """Allow every token in every row again (before refilling for the next step)."""
    _xgr().reset_token_bitmask(bitmask)


def apply_bitmask(logits_RV: torch.Tensor, bitmask: torch.Tensor, rows: Sequence[int] | None = None) -> None:
    """In place: the logits of tokens a row's mask forbids become -inf. Bitmask row i belongs to logits
    row i (allocate one row per logits row); ``rows``: the only rows to mask (the constrained
    requests of a mixed batch); None: every row."""
    if bitmask.device != logits_RV.device:
        bitmask = bitmask.to(logits_RV.device, non_blocking=True)
    _xgr().apply_token_bitmask_inplace(
        logits_RV, bitmask, vocab_size=logits_RV.shape[-1], indices=None if rows is None else list(rows)
    )


@dataclass
class StepMask:
    """The token bitmask of one step's sampled rows: ``bitmask[i]`` belongs to sample row i (CPU, pinned
    when the logits are on CUDA; one fresh tensor per step, so an asynchronous upload never races a
    refill); only ``rows`` carry a grammar, the other rows are left as they are."""

    bitmask: torch.Tensor  # [num sampled rows, ceil(V / 32)] int32
    rows: list[int]

    def apply(self, logits_RV: torch.Tensor) -> None:
        apply_bitmask(logits_RV, self.bitmask, self.rows)


class StructuredRequests:
    """The engine's structured-output state: one :class:`GrammarCache`, built on first use on a compile
    thread (importing xgrammar and reading the vocabulary takes seconds, so an engine that never sees
    a spec never pays it), the :class:`CompilePool`, and the :class:`GrammarState` of every live
    request that has a spec.

    Lifecycle (the engine's contract): ``start`` at admission (submits the compile, never blocks);
    ``activate`` until it returns True (the matcher exists, advanced over the tokens the request already
    has: the first token sampled on the prefill side of a handoff, a migrated request's tokens) or
    raises (CompileFailed: the grammar failed; ValueError: a token does not fit it; nothing is kept);
    ``advance`` once per sampled token, in order; ``remove`` when the request ends (finish, abort,
    release, a failed reservation). Preemption keeps the state: a preempted request keeps its output
    tokens and recomputes them, and its matcher already stands after them.
    """

    def __init__(
        self,
        tokenizer: Tokenizer | None,
        vocab_size: int,
        stop_token_ids: Sequence[int],
        device: torch.device,
        limits: CompileLimits | None = None,
    ) -> None:
        self._tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.stop_token_ids = tuple(stop_token_ids)
        self.device = device
        self.limits = limits or CompileLimits()
        self._cache: GrammarCache | None = None
        self._cache_lock = threading.Lock()
        self._pool: CompilePool | None = None
        self._states: dict[str, GrammarState] = {}
        self._waiting: dict[str, tuple[CompileTicket, StructuredOutput]] = {}  # started, not active

    @property
    def cache(self) -> GrammarCache:
        """The cache, built here on first use (blocking: compile threads and tests)."""
        with self._cache_lock:
            if self._cache is None:
                if self._tokenizer is None:
                    raise ValueError("structured outputs need the model's tokenizer.json")
                cache = GrammarCache(self._tokenizer, self.vocab_size, self.stop_token_ids)
                _warm_up_apply(self.vocab_size, self.device)
                self._cache = cache
            return self._cache

    @property
    def pool(self) -> CompilePool:
        if self._pool is None:
            self._pool = CompilePool(
                lambda spec: self.cache.compile_uncached(spec),
                self.limits,
                on_compiled=lambda spec, compiled: self.cache.put(spec, compiled),
            )
        return self._pool

    def _ticket(self, spec: StructuredOutput) -> CompileTicket:
        spec.validate()
        cache = self._cache  # NOTE: not built here: building it blocks for seconds (a compile thread does)
        compiled = cache.lookup(spec) if cache is not None else None
        if compiled is not None:
            return CompileTicket.done(spec.cache_key, compiled)
        return self.pool.submit(spec)

    def compile(self, spec: StructuredOutput) -> None:
        """Compile (or find cached) ``spec``, blocking up to the pool's bounds (the offline API validates
        every prompt before queueing any); ValueError naming its kind or the limit when it fails."""
        self.pool.result(self._ticket(spec))

    def start(self, request_id: str, spec: StructuredOutput) -> None:
        """Submit ``request_id``'s compile (or find it cached); never blocks."""
        self._waiting[request_id] = (self._ticket(spec), spec)

    def activate(self, request_id: str, output_token_ids: Sequence[int]) -> bool:
        """Build the started request's matcher, advanced over ``output_token_ids``, if its grammar is
        compiled: True once active (also when it already was), False while it compiles. Raises
        CompileFailed (its grammar failed) or ValueError (a token does not fit it), keeping nothing."""
        waiting = self._waiting.get(request_id)
        if waiting is None:
            return request_id in self._states
        ticket, spec = waiting
        try:
            compiled = self.pool.poll(ticket)
            if compiled is None:
                return False
            state = self.cache.matcher(spec, compiled)
            state.accept_all(output_token_ids)
        except ValueError:
            del self._waiting[request_id]
            raise
        del self._waiting[request_id]
        self._states[request_id] = state
        return True

    def is_active(self, request_id: str) -> bool:
        return request_id in self._states

    def wait(self, timeout_s: float) -> None:
        """Block up to ``timeout_s`` until a waiting request's compile ends (nothing else to run)."""
        if self._waiting and self._pool is not None:
            self._pool.wait([ticket for ticket, _ in self._waiting.values()], timeout_s)

    def close(self) -> None:
        if self._pool is not None:
            self._pool.close()

    def remove(self, request_id: str) -> None:
        self._states.pop(request_id, None)
        self._waiting.pop(request_id, None)

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._states or request_id in self._waiting

    def __len__(self) -> int:
        return len(self._states) + len(self._waiting)

    def __iter__(self) -> Iterator[str]:
        yield from self._states
        yield from self._waiting

    def step_mask(self, sample_ids: Sequence[str]) -> StepMask | None:
        """The mask of a step whose sampled rows belong to ``sample_ids`` (in row order), filled from each
        matcher's current state; None when no row is constrained. A terminated matcher (its request
        ends with this step's token discarded) leaves its row unconstrained."""
        if not self._states:
            return None
        rows = [
            (row, state)
            for row, rid in enumerate(sample_ids)
            if (state := self._states.get(rid)) is not None and not state.is_terminated
        ]
        if not rows:
            return None
        bitmask = allocate_bitmask(len(sample_ids), self.vocab_size, pin_memory=self.device.type == "cuda")
        masked = [row for row, state in rows if state.fill(bitmask, row)]
        return StepMask(bitmask, masked) if masked else None

    def advance(self, request_id: str, token_id: int) -> RequestStatus | None:
        """Advance ``request_id``'s matcher over its newly sampled token. Returns FINISHED_STOPPED when
        the grammar is now terminated (it took a stop token), FINISHED_ERROR when the token breaks it
        (the mask did not reach the sampler: never expected), else None (also for a free-text request)."""
        state = self._states.get(request_id)
        if state is None:
            return None
        if not state.accept(token_id):
            return RequestStatus.FINISHED_ERROR
        return RequestStatus.FINISHED_STOPPED if state.is_terminated else None


def _warm_up_apply(vocab_size: int, device: torch.device) -> None:
    """Mask dummy logits once per kind of row count, so xgrammar's kernel (Triton on CUDA: specialised on
    a count of 1 and on multiples of 16) compiles now, on first use, rather than in the middle of a run."""
    for num_rows in (1, 2, 16):
        logits = torch.zeros(num_rows, vocab_size, device=device)
        apply_bitmask(logits, allocate_bitmask(num_rows, vocab_size).to(device), list(range(num_rows)))
