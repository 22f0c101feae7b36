"""Batched token sampler: greedy, temperature, top-k, top-p, min-p, per-request seeds and logprobs.

One call takes the float32 logits of every request that needs a token this step (``[N, V]``) and returns
the chosen ids plus the logprobs asked for, all still on the logits' device. Nothing inside ``__call__``
waits for the device; the engine calls ``SamplerOutput.to_host`` once per step for a single copy back.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from cluster.protocol import SamplingParams, TokenLogprobs

# NOTE: below this a temperature only amplifies float noise; vLLM treats it as greedy too.
_MIN_TEMPERATURE = 1e-5
# NOTE: exponential_() may return exactly 0 on some backends; 0 in the denominator would turn a
# masked token's 0 probability into NaN, which argmax prefers over every real score.
_MIN_NOISE = 1e-30


def is_greedy(params: SamplingParams) -> bool:
    return params.temperature < _MIN_TEMPERATURE or params.top_k == 1


@dataclass
class SamplerOutput:
    """What one sampling step chose, on the logits' device.

    token_ids: [N] int64. logprobs: [N] float32, the chosen token's logprob under the raw model logits
    (before temperature and filters); None when no row asked for logprobs. top_token_ids / top_logprobs:
    [N, K] with K the largest ``logprobs`` asked in the batch (rows asking fewer read a prefix); None
    when K is 0.
    """

    token_ids: torch.Tensor
    logprobs: torch.Tensor | None = None
    top_token_ids: torch.Tensor | None = None
    top_logprobs: torch.Tensor | None = None

    def to_host(self, params: list[SamplingParams]) -> tuple[list[int], list[TokenLogprobs | None]]:
        """Copy everything to the host in ONE device->host transfer (the step's only sync point).

        All fields are packed into one float64 tensor first: token ids (< 2**53) and float32 logprobs
        are both exactly representable there, so the round trip loses nothing.
        """
        num_rows = self.token_ids.shape[0]
        if self.logprobs is None:
            return self.token_ids.tolist(), [None] * num_rows
        columns = [self.token_ids.unsqueeze(1).double(), self.logprobs.unsqueeze(1).double()]
        num_top = 0
        if self.top_token_ids is not None and self.top_logprobs is not None:
            num_top = self.top_token_ids.shape[1]
            columns += [self.top_token_ids.double(), self.top_logprobs.double()]
        rows: list[list[float]] = torch.cat(columns, dim=1).cpu().tolist()
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


def apply_top_k_top_p(
    logits: torch.Tensor, top_k: torch.Tensor | None, top_p: torch.Tensor | None, max_top_k: int
) -> torch.Tensor:
    """Mask (set to -inf, in place) every token outside each row's top-k and then its top-p nucleus.

    top_k: [N] int64 with V for rows that keep everything; top_p: [N] float32 with inf for rows that
    keep everything; max_top_k is the largest top_k over rows that use it (a host int, so no sync).
    """
    vocab_size = logits.shape[1]
    if top_p is None:
        if top_k is None:
            return logits
        # NOTE: top-k alone needs only the k-th largest value per row, far cheaper than a full sort.
        kth = logits.topk(max_top_k, dim=-1).values.gather(1, (top_k.clamp(max=max_top_k) - 1).unsqueeze(1))
        kth = torch.where(top_k.unsqueeze(1) > max_top_k, float("-inf"), kth)
        return logits.masked_fill_(logits < kth, float("-inf"))
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

    generators[i] is row i's own ``torch.Generator`` on the logits' device when its request has a seed
    (the engine seeds it once and keeps it for the request's life), else None. A seeded row draws its
    [V] noise from its generator alone, so its tokens do not depend on the rest of the batch; the
    unseeded rows share one batched draw from the device's default generator. ``logits`` is not modified.
    """

    def __call__(
        self,
        logits: torch.Tensor,
        params: list[SamplingParams],
        generators: list[torch.Generator | None],
    ) -> SamplerOutput:
        num_rows = logits.shape[0]
        if len(params) != num_rows or len(generators) != num_rows:
            raise ValueError(
                f"sampler got {num_rows} logits rows but {len(params)} params and {len(generators)} generators"
            )
        greedy = [is_greedy(p) for p in params]
        token_ids = logits.argmax(dim=-1)
        if not all(greedy):
            sampled = self._sample(logits, params, generators, greedy)
            if any(greedy):
                token_ids = torch.where(_to_device(greedy, torch.bool, logits.device), token_ids, sampled)
            else:
                token_ids = sampled
        return self._with_logprobs(logits, token_ids, params)

    @staticmethod
    def _sample(
        logits: torch.Tensor,
        params: list[SamplingParams],
        generators: list[torch.Generator | None],
        greedy: list[bool],
    ) -> torch.Tensor:
        device = logits.device
        vocab_size = logits.shape[1]
        # Greedy rows go through the same arithmetic with neutral settings; the caller discards their draw.
        neutral = [p if not g else SamplingParams() for p, g in zip(params, greedy, strict=True)]
        temperatures = [p.temperature for p in neutral]
        scaled = logits.float() / _to_device(temperatures, torch.float32, device).unsqueeze(1)

        top_ks = [p.top_k if 0 < p.top_k < vocab_size else vocab_size for p in neutral]
        top_ps = [p.top_p if p.top_p < 1.0 else float("inf") for p in neutral]
        active_ks = [k for k in top_ks if k < vocab_size]
        use_top_p = any(p.top_p < 1.0 for p in neutral)
        if active_ks or use_top_p:
            apply_top_k_top_p(
                scaled,
                _to_device(top_ks, torch.int64, device) if active_ks else None,
                _to_device(top_ps, torch.float32, device) if use_top_p else None,
                max(active_ks, default=vocab_size),
            )

        probs = scaled.softmax(dim=-1)
        if any(p.min_p > 0.0 for p in neutral):
            min_p = _to_device([p.min_p for p in neutral], torch.float32, device).unsqueeze(1)
            probs.masked_fill_(probs < probs.amax(dim=-1, keepdim=True) * min_p, 0.0)

        # Exponential race: argmax(p_i / E_i) with E_i ~ Exp(1) picks i with probability p_i, and needs
        # no renormalisation after the filters.
        noise = torch.empty_like(probs)
        seeded_rows = [row for row, gen in enumerate(generators) if gen is not None and not greedy[row]]
        if len(seeded_rows) + sum(greedy) < len(params):
            noise.exponential_()
        for row in seeded_rows:
            noise[row].exponential_(generator=generators[row])
        return probs.div_(noise.clamp_(min=_MIN_NOISE)).argmax(dim=-1)

    @staticmethod
    def _with_logprobs(
        logits: torch.Tensor, token_ids: torch.Tensor, params: list[SamplingParams]
    ) -> SamplerOutput:
        asked = [p.logprobs for p in params if p.logprobs is not None]
        if not asked:
            return SamplerOutput(token_ids=token_ids)
        raw_logprobs = logits.float().log_softmax(dim=-1)
        chosen = raw_logprobs.gather(1, token_ids.unsqueeze(1)).squeeze(1)
        num_top = min(max(asked), logits.shape[1])
        if num_top == 0:
            return SamplerOutput(token_ids=token_ids, logprobs=chosen)
        top = raw_logprobs.topk(num_top, dim=-1)
        return SamplerOutput(token_ids, chosen, top.indices, top.values)


def advance_generator(generator: torch.Generator, vocab_size: int, num_draws: int, device: torch.device) -> None:
    """Consume exactly what ``num_draws`` sampled tokens of one seeded row consume (one [V] draw each),
    so a request resumed elsewhere (e.g. the decode worker after a handoff) continues its random stream."""
    buf = torch.empty(vocab_size, dtype=torch.float32, device=device)
    for _ in range(num_draws):
        buf.exponential_(generator=generator)
