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
state, and the :class:`StepMask` of a step's sampled rows.
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
        Raises ValueError naming the spec's kind when xgrammar rejects it."""
        key = spec.cache_key
        with self._lock:
            compiled = self._entries.get(key)
            if compiled is not None:
                self._entries.move_to_end(key)
                self.num_hits += 1
                return compiled
        compiled = self._compile(spec)
        with self._lock:
            self.num_misses += 1
            self._entries[key] = compiled
            self._entries.move_to_end(key)
            while len(self._entries) > self.max_entries:
                self._entries.popitem(last=False)
        return compiled

    def _compile(self, spec: StructuredOutput) -> Any:
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

    def matcher(self, spec: StructuredOutput) -> GrammarState:
        """A fresh per-request state. JSON kinds also forbid tokens holding raw control characters:
        xgrammar's JSON strings admit them, JSON (RFC 8259) does not (they must be escaped)."""
        extra = self._printable_row if spec.kind in ("json", "json_object") else None
        return GrammarState(self.compile(spec), self.vocab_size, extra)

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
    """The engine's structured-output state: one :class:`GrammarCache`, built on first use (importing
    xgrammar and reading the vocabulary takes seconds, so an engine that never sees a spec never pays
    it), and the :class:`GrammarState` of every live request that has a spec.

    Lifecycle (the engine's contract): ``add`` at admission, advanced over the tokens the request
    already has (the first token sampled on the prefill side of a handoff, a migrated request's tokens);
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
    ) -> None:
        self._tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.stop_token_ids = tuple(stop_token_ids)
        self.device = device
        self._cache: GrammarCache | None = None
        self._states: dict[str, GrammarState] = {}

    @property
    def cache(self) -> GrammarCache:
        if self._cache is None:
            if self._tokenizer is None:
                raise ValueError("structured outputs need the model's tokenizer.json")
            self._cache = GrammarCache(self._tokenizer, self.vocab_size, self.stop_token_ids)
            _warm_up_apply(self.vocab_size, self.device)
        return self._cache

    def compile(self, spec: StructuredOutput) -> None:
        """Compile (or find cached) ``spec``; ValueError naming its kind when xgrammar rejects it."""
        self.cache.compile(spec)

    def add(self, request_id: str, spec: StructuredOutput, output_token_ids: Sequence[int]) -> None:
        """A matcher for a new request, advanced over ``output_token_ids``; ValueError (nothing kept)
        when the spec does not compile or a token does not fit it."""
        state = self.cache.matcher(spec)
        state.accept_all(output_token_ids)
        self._states[request_id] = state

    def remove(self, request_id: str) -> None:
        self._states.pop(request_id, None)

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._states

    def __len__(self) -> int:
        return len(self._states)

    def __iter__(self) -> Iterator[str]:
        return iter(self._states)

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
