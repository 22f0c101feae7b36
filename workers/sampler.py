"""Batched token sampler: greedy, temperature, top-k, top-p, min-p, per-request seeds and logprobs.

One call takes the float32 logits of every request that needs a token this step (``[N, V]``) and returns
the chosen ids plus the logprobs asked for, all still on the logits' device. Nothing inside ``__call__``
waits for the device on the CUDA path; the engine copies the result back once per step.

Sampling is an exponential race, ``argmax(p / E)`` with E ~ Exp(1) per token: it picks token i with
probability p_i and needs no renormalisation after filtering. Top-k masks by the k-th largest value
(``topk``, no sort); top-p restricts the race to the nucleus by rejection (see ``top_p_race_torch``), so
no step sorts the vocabulary. Seeded rows draw their noise from their own stream: a ``torch.Generator``
per request (CPU: one [V] draw per token, the historical stream) or a ``CounterStream`` (CUDA: Philox of
(seed, draw index), all seeded rows in one launch; see ``sampling_kernels``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Union

import torch

from cluster.protocol import SamplingParams, TokenLogprobs

# NOTE: below this a temperature only amplifies float noise; vLLM treats it as greedy too.
_MIN_TEMPERATURE = 1e-5
# The lowest logprob reported (a token the structured-output mask forbids), as vLLM reports it.
MIN_LOGPROB = -9999.0
# NOTE: exponential_() may return exactly 0 on some backends; 0 in the denominator would turn a
# masked token's 0 probability into NaN, which argmax prefers over every real score.
_MIN_NOISE = 1e-30


def is_greedy(params: SamplingParams) -> bool:
    return params.temperature < _MIN_TEMPERATURE or params.top_k == 1


def is_argmax_only(params: Sequence[SamplingParams], has_processors: bool | None = None) -> bool:
    """Every row greedy, none asks for logprobs and none has logits processors: the winner is the argmax
    of the raw logits (a monotonic soft-cap and an fp32 upcast cannot change it), so the logits need no
    further work. ``has_processors``: whether any row has a logits processor to apply, when the caller
    knows it already (the runner's registry of such requests: it spares a pass over every row, ~50 us
    per step at 256 rows); None: read from each row's params."""
    if has_processors is None:
        has_processors = any(p.has_logits_processors for p in params)
    return not has_processors and all(is_greedy(p) and p.logprobs is None for p in params)


@dataclass(frozen=True)
class CounterStream:
    """A seeded row's noise on the batched path: draw number ``draw`` (tokens sampled before) of
    ``seed``. Stateless: the stream continues wherever the request's earlier tokens were sampled."""

    seed: int
    draw: int


RowGenerator = Union[torch.Generator, CounterStream, None]  # noqa: UP007 - a runtime alias


@dataclass
class SamplerOutput:
    """What one sampling step chose, on the logits' device.

    token_ids: [N] int64. logprobs: [N] float32, the chosen token's logprob under the raw model logits
    (before temperature and filters; after a structured-output mask, as in vLLM, with -inf reported as
    ``MIN_LOGPROB``); None when no row asked for logprobs. top_token_ids / top_logprobs:
    [N, K] with K the largest ``logprobs`` asked in the batch (rows asking fewer read a prefix); None
    when K is 0.
    """

    token_ids: torch.Tensor
    logprobs: torch.Tensor | None = None
    top_token_ids: torch.Tensor | None = None
    top_logprobs: torch.Tensor | None = None

    def to_host(self, params: list[SamplingParams]) -> tuple[list[int], list[TokenLogprobs | None]]:
        """Copy everything to the host in ONE device->host transfer and wait for it."""
        return self.start_copy().wait(params)

    def start_copy(self) -> HostCopy:
        """Enqueue the one device->host transfer of every field (non-blocking on CUDA, into pinned memory).

        All fields are packed into one tensor first (int64 token ids alone; else float64, where token
        ids (< 2**53) and float32 logprobs are both exact), so the round trip loses nothing.
        """
        num_top = 0
        if self.logprobs is None:
            packed = self.token_ids
        else:
            columns = [self.token_ids.unsqueeze(1).double(), self.logprobs.unsqueeze(1).double()]
            if self.top_token_ids is not None and self.top_logprobs is not None:
                num_top = self.top_token_ids.shape[1]
                columns += [self.top_token_ids.double(), self.top_logprobs.double()]
            packed = torch.cat(columns, dim=1)
        if packed.device.type == "cpu":
            return HostCopy(packed, None, self.logprobs is not None, num_top)
        host = torch.empty(packed.shape, dtype=packed.dtype, pin_memory=True)
        host.copy_(packed, non_blocking=True)
        done = torch.cuda.Event()
        done.record()
        return HostCopy(host, done, self.logprobs is not None, num_top)


@dataclass
class HostCopy:
    """A sampler result on its way to the host: ``wait`` blocks until the copy landed (the step's one
    device sync) and unpacks it. ``host`` stays valid until then (pinned memory on CUDA)."""

    host: torch.Tensor
    done: torch.cuda.Event | None
    has_logprobs: bool
    num_top: int

    def wait(self, params: list[SamplingParams]) -> tuple[list[int], list[TokenLogprobs | None]]:
        if self.done is not None:
            self.done.synchronize()
        if not self.has_logprobs:
            ids: list[int] = self.host.tolist()
            return ids, [None] * len(ids)
        rows: list[list[float]] = self.host.tolist()
        num_top = self.num_top
        token_ids: list[int] = []
        logprobs: list[TokenLogprobs | None] = []
        for row, p in zip(rows, params, strict=True):
            token_id = int(row[0])
            token_ids.append(token_id)
            if p.logprobs is None:
                logprobs.append(None)
                continue
            k = p.logprobs
            logprobs.append(
                TokenLogprobs(
                    token_id=token_id,
                    logprob=row[1],
                    top_token_ids=[int(t) for t in row[2 : 2 + k]],
                    top_logprobs=row[2 + num_top : 2 + num_top + k],
                )
            )
        return token_ids, logprobs


def _to_device(values: Sequence[float], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    # NOTE: a pinned staging tensor lets the host->device copy run async instead of blocking the host.
    host = torch.tensor(values, dtype=dtype, pin_memory=device.type == "cuda")
    return host.to(device, non_blocking=True)


def mask_top_k(logits: torch.Tensor, top_k: torch.Tensor, max_top_k: int) -> torch.Tensor:
    """Mask (in place) every token below each row's k-th largest logit; rows with k > max_top_k keep all."""
    # NOTE: needs only the k-th largest value per row (topk of max_top_k), far cheaper than a full sort.
    kth = logits.topk(max_top_k, dim=-1).values.gather(1, (top_k.clamp(max=max_top_k) - 1).unsqueeze(1))
    kth = torch.where(top_k.unsqueeze(1) > max_top_k, float("-inf"), kth)
    return logits.masked_fill_(logits < kth, float("-inf"))


def top_p_race_torch(probs: torch.Tensor, noise: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """[N] winners of ``argmax(probs / noise)`` inside each row's nucleus {i : mass of the tokens strictly
    more probable than i < top_p} (``top_p`` [N], inf: no restriction), without sorting.

    Rejection: the unrestricted winner c is the nucleus winner too when the mass above it is < top_p
    (the nucleus is a subset); otherwise no token at most as probable as c is in the nucleus, so they
    leave the race and it is run again. The loop checks on the host (free on CPU); the CUDA path runs
    the same rounds on the device (``sampling_kernels.top_p_race``).
    """
    scores = probs / noise.clamp(min=_MIN_NOISE)
    winners = scores.argmax(dim=-1)
    while True:
        p_win = probs.gather(1, winners.unsqueeze(1))
        mass_above = torch.where(probs > p_win, probs, 0.0).sum(dim=-1)
        rejected = mass_above >= top_p
        if not bool(rejected.any()):
            return winners
        scores.masked_fill_(rejected.unsqueeze(1) & (probs <= p_win), -1.0)
        winners = torch.where(rejected, scores.argmax(dim=-1), winners)


def apply_top_k_top_p(
    logits: torch.Tensor, top_k: torch.Tensor | None, top_p: torch.Tensor | None, max_top_k: int
) -> torch.Tensor:
    """Mask (set to -inf, in place) every token outside each row's top-k and then its top-p nucleus.

    The sorting reference of the sampler's filters (tests check the sampler against it); the sampler
    itself never sorts: ``mask_top_k`` and ``top_p_race_torch`` / ``sampling_kernels.top_p_race``.

    top_k: [N] int64 with V for rows that keep everything; top_p: [N] float32 with inf for rows that
    keep everything; max_top_k is the largest top_k over rows that use it (a host int, so no sync).
    """
    vocab_size = logits.shape[1]
    if top_p is None:
        if top_k is None:
            return logits
        return mask_top_k(logits, top_k, max_top_k)
    sorted_logits, sorted_ids = logits.sort(dim=-1, descending=True)
    if top_k is not None:
        positions = torch.arange(vocab_size, device=logits.device).unsqueeze(0)
        sorted_logits.masked_fill_(positions >= top_k.unsqueeze(1), float("-inf"))
    probs = sorted_logits.softmax(dim=-1)
    # Keep a token while the mass strictly before it is below top_p: the smallest set reaching top_p.
    # The top token has zero mass before it, so it always survives (top_p > 0).
    mass_before = probs.cumsum(dim=-1) - probs
    sorted_logits.masked_fill_(mass_before >= top_p.unsqueeze(1), float("-inf"))
    return logits.scatter_(1, sorted_ids, sorted_logits)


class Sampler:
    """Picks one token per row of ``[N, V]`` float32 logits; see the module docstring.

    generators[i] is row i's own stream when its request has a seed, else None: a ``torch.Generator``
    on the logits' device (the engine seeds it once and keeps it for the request's life) or a
    ``CounterStream`` (needs Triton). A seeded row's [V] noise comes from its stream alone, so its tokens
    do not depend on the rest of the batch; the unseeded rows share one batched draw from the device's
    default generator. ``use_triton``: the top-p race runs as one Triton kernel (no host sync) instead
    of torch rounds checked on the host. ``logits`` is not modified.
    """

    def __init__(self, use_triton: bool = False) -> None:
        self.use_triton = use_triton

    def __call__(
        self,
        logits: torch.Tensor,
        params: list[SamplingParams],
        generators: Sequence[RowGenerator],
        raw_logits: torch.Tensor | None = None,
    ) -> SamplerOutput:
        """``raw_logits``: what the logprobs are reported from, when ``logits`` went through logits
        processors (None: ``logits`` itself)."""
        num_rows = logits.shape[0]
        if len(params) != num_rows or len(generators) != num_rows:
            raise ValueError(
                f"sampler got {num_rows} logits rows but {len(params)} params and {len(generators)} generators"
            )
        greedy = [is_greedy(p) for p in params]
        if all(greedy):
            token_ids = logits.argmax(dim=-1)
        else:
            token_ids = self._sample(logits, params, generators, greedy)
            if any(greedy):
                is_greedy_row = _to_device(greedy, torch.bool, logits.device)
                token_ids = torch.where(is_greedy_row, logits.argmax(dim=-1), token_ids)
        return self._with_logprobs(logits if raw_logits is None else raw_logits, token_ids, params)

    def _sample(
        self,
        logits: torch.Tensor,
        params: list[SamplingParams],
        generators: Sequence[RowGenerator],
        greedy: list[bool],
    ) -> torch.Tensor:
        device = logits.device
        vocab_size = logits.shape[1]
        # Greedy rows go through the same arithmetic with neutral settings; the caller discards their draw.
        neutral = [p if not g else SamplingParams() for p, g in zip(params, greedy, strict=True)]
        temperatures = [p.temperature for p in neutral]
        scaled = logits.float() / _to_device(temperatures, torch.float32, device).unsqueeze(1)

        top_ks = [p.top_k if 0 < p.top_k < vocab_size else vocab_size for p in neutral]
        active_ks = [k for k in top_ks if k < vocab_size]
        if active_ks:
            mask_top_k(scaled, _to_device(top_ks, torch.int64, device), max(active_ks))

        probs = scaled.softmax(dim=-1)
        if any(p.min_p > 0.0 for p in neutral):
            min_p = _to_device([p.min_p for p in neutral], torch.float32, device).unsqueeze(1)
            probs.masked_fill_(probs < probs.amax(dim=-1, keepdim=True) * min_p, 0.0)

        noise = self._noise(probs, generators, greedy)
        if any(p.top_p < 1.0 for p in neutral):
            top_ps = _to_device(
                [p.top_p if p.top_p < 1.0 else float("inf") for p in neutral], torch.float32, device
            )
            if self.use_triton:
                from workers.sampling_kernels import top_p_race

                return top_p_race(probs, noise, top_ps, _MIN_NOISE)
            return top_p_race_torch(probs, noise, top_ps)
        return probs.div_(noise.clamp_(min=_MIN_NOISE)).argmax(dim=-1)

    @staticmethod
    def _noise(probs: torch.Tensor, generators: Sequence[RowGenerator], greedy: list[bool]) -> torch.Tensor:
        """Exp(1) noise [N, V]: unseeded rows from the default generator (one batched draw), seeded rows
        from their own streams (``torch.Generator``: one draw per row; ``CounterStream``: one launch)."""
        noise = torch.empty_like(probs)
        seeded_rows = [row for row, gen in enumerate(generators) if gen is not None and not greedy[row]]
        if len(seeded_rows) + sum(greedy) < len(greedy):
            noise.exponential_()
        counter_rows = [row for row in seeded_rows if isinstance(generators[row], CounterStream)]
        for row in seeded_rows:
            gen = generators[row]
            if isinstance(gen, torch.Generator):
                noise[row].exponential_(generator=gen)
        if counter_rows:
            from workers.sampling_kernels import seeded_noise

            streams = [generators[row] for row in counter_rows]
            seeds = [s.seed & 0xFFFFFFFFFFFFFFFF for s in streams if isinstance(s, CounterStream)]
            seeds = [s - (1 << 64) if s >= 1 << 63 else s for s in seeds]  # two's complement int64
            draws = [s.draw for s in streams if isinstance(s, CounterStream)]
            device = probs.device
            seeded_noise(
                noise,
                _to_device(counter_rows, torch.int64, device),
                _to_device(seeds, torch.int64, device),
                _to_device(draws, torch.int64, device),
            )
        return noise

    @staticmethod
    def _with_logprobs(
        logits: torch.Tensor, token_ids: torch.Tensor, params: list[SamplingParams]
    ) -> SamplerOutput:
        asked = [p.logprobs for p in params if p.logprobs is not None]
        if not asked:
            return SamplerOutput(token_ids=token_ids)
        raw_logprobs = logits.float().log_softmax(dim=-1)
        # NOTE: a structured-output mask leaves -inf logits (fewer allowed tokens than a top-k asks for);
        # -inf is not JSON, so it is reported as vLLM does, -9999.0.
        chosen = raw_logprobs.gather(1, token_ids.unsqueeze(1)).squeeze(1).clamp_(min=MIN_LOGPROB)
        num_top = min(max(asked), logits.shape[1])
        if num_top == 0:
            return SamplerOutput(token_ids=token_ids, logprobs=chosen)
        top = raw_logprobs.topk(num_top, dim=-1)
        return SamplerOutput(token_ids, chosen, top.indices, top.values.clamp_(min=MIN_LOGPROB))


def advance_generator(
    generator: torch.Generator, vocab_size: int, num_draws: int, device: torch.device
) -> None:
    """Consume exactly what ``num_draws`` sampled tokens of one seeded row consume (one [V] draw each),
    so a request resumed elsewhere (e.g. the decode worker after a handoff) continues its random stream."""
    buf = torch.empty(vocab_size, dtype=torch.float32, device=device)
    for _ in range(num_draws):
        buf.exponential_(generator=generator)
