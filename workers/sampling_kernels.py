# NOTE: @triton.jit bodies are Triton DSL (constexpr/pointer parameters), not annotatable Python.
# mypy: disable-error-code="no-untyped-def"
"""Triton kernels of the sampler (the CUDA path; on CPU they run under ``TRITON_INTERPRET=1`` in tests).

``seeded_noise``: the Exp(1) noise of every seeded row in ONE launch. A row's noise is a pure function
of (seed, draw index, vocabulary position) through Philox-4x32-10, so it does not depend on the batch,
needs no per-request generator object, and a request resumed elsewhere continues its stream by passing
its number of sampled tokens as the draw index.

``top_p_race``: the exponential race ``argmax(p / E)`` restricted to each row's top-p nucleus, without
sorting the vocabulary. The nucleus is {i : mass of the tokens strictly more probable than i < top_p}.
Rejection: take the unrestricted winner c; if the mass above c is < top_p it is the winner inside the
nucleus too (the nucleus is a subset); otherwise every token no more probable than c is outside the
nucleus, so drop them and race again. Each round is two passes over the row; all rounds run on the
device (no host sync). ``sampler.top_p_race_torch`` is the same algorithm in torch (the oracle).
"""

from __future__ import annotations

import torch

import workers.attention.triton_kernels  # noqa: F401  # isort: skip  (sets TRITON_INTERPRET without CUDA)
import triton  # isort: skip
import triton.language as tl  # isort: skip

_BLOCK = 1024


@triton.jit
def seeded_noise_kernel(
    noise_ptr, rows_ptr, seeds_ptr, draws_ptr, stride_n, vocab_size, BLOCK: tl.constexpr,
):  # fmt: skip
    """Grid (num_seeded_rows, cdiv(V, BLOCK)): noise[rows[i], v] = -log(1 - U(seed_i, draw_i, v))."""
    i = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < vocab_size
    row = tl.load(rows_ptr + i).to(tl.int64)
    seed = tl.load(seeds_ptr + i)
    draw = tl.load(draws_ptr + i)
    zero = tl.zeros_like(cols).to(tl.uint32)
    draw_lo = (zero + (draw & 0xFFFFFFFF).to(tl.uint32)).to(tl.uint32)
    draw_hi = (zero + ((draw >> 32) & 0xFFFFFFFF).to(tl.uint32)).to(tl.uint32)
    bits, _, _, _ = tl.philox(seed, cols.to(tl.uint32), draw_lo, draw_hi, zero)
    u = tl.uint_to_uniform_float(bits)
    tl.store(noise_ptr + row * stride_n + cols, -tl.log(1.0 - u), mask=mask)


@triton.jit
def top_p_race_kernel(
    probs_ptr, noise_ptr, top_p_ptr, out_ptr, stride_p, stride_n, vocab_size, min_noise,
    BLOCK: tl.constexpr,
):  # fmt: skip
    """Grid (rows,): out[row] = argmax over the row's nucleus of probs / max(noise, min_noise)."""
    row = tl.program_id(0).to(tl.int64)
    top_p = tl.load(top_p_ptr + row)
    p_row = probs_ptr + row * stride_p
    n_row = noise_ptr + row * stride_n
    pivot = tl.full([], -1.0, tl.float32)  # tokens with probability <= pivot are outside the nucleus
    best = tl.full([], 0, tl.int32)
    is_done = tl.full([], False, tl.int1)
    while not is_done:
        best_score = tl.full([], -1.0, tl.float32)
        for start in range(0, vocab_size, BLOCK):
            cols = start + tl.arange(0, BLOCK)
            mask = cols < vocab_size
            p = tl.load(p_row + cols, mask=mask, other=0.0)
            e = tl.maximum(tl.load(n_row + cols, mask=mask, other=1.0), min_noise)
            score = tl.where(mask & (p > pivot), tl.div_rn(p, e), -1.0)
            block_best = tl.max(score, 0)
            # NOTE: strictly greater keeps the first index of equal scores, as torch.argmax does.
            if block_best > best_score:
                best_score = block_best
                best = start + tl.argmax(score, 0)
        p_best = tl.load(p_row + best)
        mass = tl.full([], 0.0, tl.float32)
        for start in range(0, vocab_size, BLOCK):
            cols = start + tl.arange(0, BLOCK)
            p = tl.load(p_row + cols, mask=cols < vocab_size, other=0.0)
            mass += tl.sum(tl.where(p > p_best, p, 0.0), 0)
        is_done = mass < top_p
        pivot = p_best
    tl.store(out_ptr + row, best.to(tl.int64))


def seeded_noise(noise: torch.Tensor, rows: torch.Tensor, seeds: torch.Tensor, draws: torch.Tensor) -> None:
    """Fill ``noise[rows[i]]`` ([N, V] float32) from (seeds[i], draws[i]) (int64 device tensors)."""
    if rows.numel():
        vocab_size = noise.shape[1]
        grid = (rows.numel(), triton.cdiv(vocab_size, _BLOCK))
        seeded_noise_kernel[grid](noise, rows, seeds, draws, noise.stride(0), vocab_size, BLOCK=_BLOCK)


def top_p_race(
    probs: torch.Tensor, noise: torch.Tensor, top_p: torch.Tensor, min_noise: float
) -> torch.Tensor:
    """[N] int64 winners; ``top_p`` is [N] float32 (inf: no nucleus restriction). Reads, never writes, probs."""
    out = torch.empty(probs.shape[0], dtype=torch.int64, device=probs.device)
    if probs.shape[0]:
        top_p_race_kernel[(probs.shape[0],)](
            probs,
            noise,
            top_p,
            out,
            probs.stride(0),
            noise.stride(0),
            probs.shape[1],
            min_noise,
            BLOCK=_BLOCK,
        )
    return out
