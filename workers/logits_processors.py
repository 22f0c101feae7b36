"""Logits processors, as vLLM v1 defines them, applied to one step's sampled rows in a few batched ops.

In vLLM's order (its sampler's): allowed_token_ids (every other token -inf), bad words (the last token of
a bad word whose other tokens end the output so far: -inf), min_tokens (the request's stop ids -inf while
fewer outputs exist), logit_bias (added), then the repetition penalty (over prompt and output tokens: a
positive logit divided by it, any other multiplied), the frequency and presence penalties (over output
tokens: ``logit -= frequency * count``, then ``logit -= presence * (count > 0)``).

The engine registers every request that uses one (``LogitsProcessors.add``) and the runner drops it with
the request's other state (``remove``). Each step, ``prepare`` reads the histories of the registered rows
on the host (each request's prompt and output tokens, so a handoff, a migration or a preemption
continues exactly) into flat arrays of ``row * V + token`` keys; ``ProcessorStep.apply`` uploads them in
one copy per dtype and works on the logits through those keys: no per-request loop in the tensor math,
no host sync, and the penalties read and write only the positions a history names (their counts come
from one ``[penalized rows, V]`` int32 table).
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import numpy as np
import torch

from workers.request import Request

_NEG_INF = float("-inf")
_EMPTY = np.zeros(0, np.int64)


@dataclass
class _Entry:
    """What one registered request's processors need, derived once from its params and prompt."""

    request: Request
    allowed_ids: np.ndarray | None  # distinct allowed token ids (None: every token)
    banned_ids: np.ndarray  # the one-token bad words: masked at every step
    bad_prefixes: list[tuple[list[int], int]]  # (prefix, last token) of each longer bad word
    stop_ids: np.ndarray  # masked while fewer than min_tokens outputs exist
    bias_ids: np.ndarray
    bias_values: np.ndarray
    prompt_ids: np.ndarray | None  # the prompt's distinct tokens, when a repetition penalty reads them
    has_penalties: bool
    needs_history: bool  # penalties or a longer bad word read the output tokens

    @classmethod
    def of(cls, request: Request) -> _Entry:
        p = request.params
        words = p.bad_words_token_ids
        bad_prefixes = [(list(w[:-1]), w[-1]) for w in words if len(w) > 1]
        has_penalties = p.has_penalties
        allowed = p.allowed_token_ids
        return cls(
            request=request,
            allowed_ids=None if allowed is None else np.unique(np.array(allowed, np.int64)),
            banned_ids=np.unique(np.array([w[0] for w in words if len(w) == 1], np.int64)),
            bad_prefixes=bad_prefixes,
            stop_ids=np.array(sorted(request.stop_ids), np.int64),
            bias_ids=np.fromiter(p.logit_bias.keys(), np.int64, len(p.logit_bias)),
            bias_values=np.fromiter(p.logit_bias.values(), np.float32, len(p.logit_bias)),
            prompt_ids=(
                np.unique(np.array(request.prompt_token_ids, np.int64))
                if p.repetition_penalty != 1.0
                else None
            ),
            has_penalties=has_penalties,
            needs_history=has_penalties or bool(bad_prefixes),
        )


class LogitsProcessors:
    """The live requests that use a logits processor, by id, and each step's work for the rows among them.

    Lifecycle: the engine ``add``s a request whose params have a processor when it creates it (the same
    ``Request`` object the scheduler updates, so its history is always current) and the runner's
    ``remove(request_id)`` drops it with the request's other per-request state; the engine's leak check
    asserts none is left. Single-threaded (the step thread)."""

    def __init__(self, vocab_size: int) -> None:
        self.vocab_size = vocab_size
        self._entries: dict[str, _Entry] = {}
        self._num_needing_history = 0

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, request_id: object) -> bool:
        return request_id in self._entries

    def add(self, request: Request) -> None:
        if request.request_id in self._entries:
            raise ValueError(f"request_id {request.request_id!r} already has logits processors")
        entry = _Entry.of(request)
        self._entries[request.request_id] = entry
        self._num_needing_history += entry.needs_history

    def remove(self, request_id: str) -> None:
        entry = self._entries.pop(request_id, None)
        if entry is not None:
            self._num_needing_history -= entry.needs_history

    @property
    def num_needing_history(self) -> int:
        """Registered requests whose processors read their output tokens (penalties, longer bad words)."""
        return self._num_needing_history

    def needs_history(self, request_id: str) -> bool:
        """Whether sampling ``request_id`` reads its output tokens, not only their count: under
        asynchronous scheduling its previous token must be on the host before it samples."""
        entry = self._entries.get(request_id)
        return entry is not None and entry.needs_history

    def prepare(self, sample_ids: list[str], num_outputs: list[int]) -> ProcessorStep | None:
        """The host half of one step: keys of every registered row (``sample_ids[i]`` is row i, which has
        ``num_outputs[i]`` output tokens before this step). None: no row has anything to apply.

        Raises RuntimeError when a row reads an output token that is still a placeholder (the engine
        must resolve it first)."""
        entries = self._entries
        rows = [(i, e) for i, rid in enumerate(sample_ids) if (e := entries.get(rid)) is not None]
        if not rows:
            return None
        num_rows = len(sample_ids)
        allowed_rows: list[int] = []
        allowed: list[np.ndarray] = []
        banned: list[np.ndarray] = []
        bias_keys: list[np.ndarray] = []
        bias_values: list[np.ndarray] = []
        penalized: list[tuple[int, _Entry, int]] = []
        vocab_size = self.vocab_size
        for i, e in rows:
            n = num_outputs[i]
            offset = i * vocab_size
            if e.needs_history:
                _check_resolved(e.request, n)
            if e.allowed_ids is not None:
                allowed_rows.append(i)
                allowed.append(e.allowed_ids + offset)
            if e.banned_ids.size:
                banned.append(e.banned_ids + offset)
            if e.bad_prefixes:
                outputs = e.request.output_token_ids
                hits = [last for prefix, last in e.bad_prefixes if _ends_with(outputs, n, prefix)]
                if hits:
                    banned.append(np.array(hits, np.int64) + offset)
            if n < e.request.params.min_tokens and e.stop_ids.size:
                banned.append(e.stop_ids + offset)
            if e.bias_ids.size:
                bias_keys.append(e.bias_ids + offset)
                bias_values.append(e.bias_values)
            if e.has_penalties:
                penalized.append((i, e, n))
        penalty_keys, penalty_local_keys, num_prompt_keys, penalties = _penalty_keys(penalized, vocab_size)
        step = ProcessorStep(
            num_rows=num_rows,
            vocab_size=vocab_size,
            allowed_rows=np.array(allowed_rows, np.int64),
            allowed_keys=_cat(allowed),
            banned_keys=_cat(banned),
            bias_keys=_cat(bias_keys),
            bias_values=np.concatenate(bias_values) if bias_values else np.zeros(0, np.float32),
            penalty_keys=penalty_keys,
            penalty_local_keys=penalty_local_keys,
            num_prompt_keys=num_prompt_keys,
            penalties=penalties,
        )
        return None if step.is_empty else step


def _cat(parts: list[np.ndarray]) -> np.ndarray:
    return np.concatenate(parts) if parts else _EMPTY


def _ends_with(outputs: list[int], n: int, prefix: list[int]) -> bool:
    """The first ``n`` outputs end with ``prefix``."""
    # NOTE: vLLM v1's rule: the output tokens only, so a bad word longer than the outputs + 1 never
    # matches. transformers' NoBadWordsLogitsProcessor matches against prompt + output instead (a prefix
    # that straddles the end of the prompt masks there, not here) and drops one-token bad words equal to
    # an EOS id it is given (vLLM, and this, mask them).
    k = len(prefix)
    return k <= n and outputs[n - k : n] == prefix


def _check_resolved(request: Request, n: int) -> None:
    # NOTE: a placeholder (< 0) is only ever the newest output tokens, so the n-th one stands for all
    if n and request.output_token_ids[n - 1] < 0:
        raise RuntimeError(
            f"request {request.request_id}: its logits processors read output token {n - 1}, still a "
            "placeholder (the engine must resolve the previous step before sampling it)"
        )


def _penalty_keys(
    penalized: list[tuple[int, _Entry, int]], vocab_size: int
) -> tuple[np.ndarray, np.ndarray, int, np.ndarray | None]:
    """Keys of the penalized rows: every distinct prompt token of a row with a repetition penalty, then
    one key per output token (a token output 3 times: 3 keys), as positions in the step's logits and in
    a ``[penalized rows, V]`` table (``local``, the same order); and each penalized row's three penalties
    ([3, penalized rows] float32)."""
    if not penalized:
        return _EMPTY, _EMPTY, 0, None
    num_penalized = len(penalized)
    rows = np.fromiter((i for i, _, _ in penalized), np.int64, num_penalized)
    prompts = [(j, e.prompt_ids) for j, (_, e, _) in enumerate(penalized) if e.prompt_ids is not None]
    prompt_lens = np.fromiter((len(ids) for _, ids in prompts), np.int64, len(prompts))
    prompt_rows = np.fromiter((j for j, _ in prompts), np.int64, len(prompts))
    counts = np.fromiter((n for _, _, n in penalized), np.int64, num_penalized)
    tokens = np.concatenate(
        [
            _cat([ids for _, ids in prompts]),
            np.fromiter(
                itertools.chain.from_iterable(
                    itertools.islice(e.request.output_token_ids, n) for _, e, n in penalized
                ),
                np.int64,
                int(counts.sum()),
            ),
        ]
    )
    local_rows = np.concatenate(
        [np.repeat(prompt_rows, prompt_lens), np.repeat(np.arange(num_penalized), counts)]
    )
    local_keys = local_rows * vocab_size + tokens
    keys = rows[local_rows] * vocab_size + tokens
    penalties = np.array(
        [
            (p.repetition_penalty, p.frequency_penalty, p.presence_penalty)
            for p in (e.request.params for _, e, _ in penalized)
        ],
        np.float32,
    ).T
    return keys, local_keys, int(prompt_lens.sum()), penalties


@dataclass
class ProcessorStep:
    """One step's processor work as flat host arrays over its sampled rows; a key is a position in the
    flattened logits, ``row * V + token``. ``apply`` does it to the step's logits."""

    num_rows: int
    vocab_size: int
    allowed_rows: np.ndarray  # rows restricted to their allowed_token_ids
    allowed_keys: np.ndarray  # their allowed tokens
    banned_keys: np.ndarray  # -inf: bad words that match, stop ids under min_tokens
    bias_keys: np.ndarray
    bias_values: np.ndarray  # float32, one per bias key
    penalty_keys: np.ndarray  # the penalized rows' distinct prompt tokens, then one per output token
    penalty_local_keys: np.ndarray  # the same, as positions in a [penalized rows, V] table
    num_prompt_keys: int
    penalties: np.ndarray | None  # [3, penalized rows] float32: repetition, frequency, presence

    @property
    def is_empty(self) -> bool:
        return not (
            self.allowed_rows.size or self.banned_keys.size or self.bias_keys.size or self.penalty_keys.size
        )

    def apply(self, logits: torch.Tensor) -> None:
        """Apply every processor to ``logits`` ([rows, V] float32, contiguous) in place, in vLLM's order."""
        num_rows, vocab_size = self.num_rows, self.vocab_size
        if tuple(logits.shape) != (num_rows, vocab_size) or not logits.is_contiguous():
            raise ValueError(
                f"processors of {num_rows} rows of {vocab_size} tokens got logits {tuple(logits.shape)} "
                f"(contiguous: {logits.is_contiguous()})"
            )
        parts = [
            self.allowed_rows,
            self.allowed_keys,
            self.banned_keys,
            self.bias_keys,
            self.penalty_keys,
            self.penalty_local_keys,
        ]
        ints = _upload(np.concatenate(parts), logits.device)
        allowed_rows, allowed_keys, banned_keys, bias_keys, penalty_keys, local_keys = ints.split(
            [len(a) for a in parts]
        )
        flat = logits.view(-1)
        if len(self.allowed_rows):
            kept = flat[allowed_keys]
            logits.index_fill_(0, allowed_rows, _NEG_INF)
            flat.index_copy_(0, allowed_keys, kept)
        if len(self.banned_keys):
            flat.index_fill_(0, banned_keys, _NEG_INF)
        floats = None
        if len(self.bias_keys) or self.penalties is not None:
            host = [self.bias_values] + ([self.penalties.reshape(-1)] if self.penalties is not None else [])
            floats = _upload(np.concatenate(host), logits.device)
        if len(self.bias_keys) and floats is not None:
            flat.index_add_(0, bias_keys, floats[: len(self.bias_keys)])
        if self.penalties is not None and floats is not None:
            penalties = floats[len(self.bias_keys) :].view(3, -1)
            _apply_penalties(flat, penalty_keys, local_keys, self.num_prompt_keys, penalties, vocab_size)


def _apply_penalties(
    flat: torch.Tensor,
    keys: torch.Tensor,
    local_keys: torch.Tensor,
    num_prompt_keys: int,
    penalties: torch.Tensor,
    vocab_size: int,
) -> None:
    """Penalize the positions ``keys`` name. Each key's output count comes from a ``[penalized rows, V]``
    int32 table (one scatter_add_, no host sync; the dense tensor vLLM builds too, in int32 and for the
    penalized rows only); every position gets the same new value however often it is named."""
    output_keys = local_keys[num_prompt_keys:]
    table = torch.zeros(penalties.shape[1] * vocab_size, dtype=torch.int32, device=flat.device)
    table.scatter_add_(0, output_keys, torch.ones_like(output_keys, dtype=torch.int32))
    counts = table[local_keys]
    repetition, frequency, presence = penalties.index_select(1, local_keys // vocab_size)
    values = flat[keys]
    # NOTE: transformers' / vLLM's rule (a logit of exactly 0 stays 0 either way); x / 1.0 and x * 1.0 are
    # exact, so rows without a repetition penalty pass through unchanged, as do 0 * count and 0 * presence.
    values = torch.where(values > 0, values / repetition, values * repetition)
    values -= frequency * counts
    values -= presence * (counts > 0)
    flat.index_copy_(0, keys, values)  # NOTE: duplicate keys all carry the same value


def _upload(values: np.ndarray, device: torch.device) -> torch.Tensor:
    host = torch.from_numpy(np.ascontiguousarray(values))
    if device.type == "cpu":
        return host
    # NOTE: a pinned staging copy lets the host->device copy run async instead of blocking the host
    return host.pin_memory().to(device, non_blocking=True)
