"""The sort-free top-p race and the batched seeded noise (``workers/sampling_kernels``, ``sampler``).

The rejection race must pick exactly what the sorting reference (``apply_top_k_top_p`` + softmax + the
exponential race) picks; the Triton kernel (interpreter on CPU) exactly what the torch rounds pick. A
``CounterStream`` row's noise depends only on (seed, draw index), so seeded tokens do not depend on the
batch, and an engine whose sampler uses it keeps seeded outputs independent of batching and preemption.
"""

from __future__ import annotations

import pytest
import torch

from cluster.protocol import SamplingParams
from workers.llm import LLM
from workers.sampler import (
    _MIN_NOISE,
    CounterStream,
    Sampler,
    apply_top_k_top_p,
    mask_top_k,
    top_p_race_torch,
)
from workers.sampling_kernels import seeded_noise, top_p_race

VOCAB = 300


def _case(seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """48 rows of logits at several sharpnesses, top-k per row (VOCAB = off), top-p per row (inf = off),
    and Exp(1) noise."""
    gen = torch.Generator().manual_seed(seed)
    sharpness = torch.tensor([0.5, 1.0, 3.0, 8.0]).repeat(12).unsqueeze(1)
    logits = torch.randn(48, VOCAB, generator=gen) * sharpness
    top_k = torch.tensor([VOCAB, 40, VOCAB, 5, VOCAB, 150] * 8)
    top_p = torch.tensor([0.3, 0.6, 0.9, 0.99, float("inf"), 0.75] * 8)
    noise = torch.empty(48, VOCAB).exponential_(generator=gen)
    return logits, top_k, top_p, noise


def _reference(
    logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor, noise: torch.Tensor
) -> torch.Tensor:
    masked = apply_top_k_top_p(logits.clone(), top_k, top_p, max_top_k=150)
    return (masked.softmax(dim=-1) / noise.clamp(min=_MIN_NOISE)).argmax(dim=-1)


def _probs(logits: torch.Tensor, top_k: torch.Tensor) -> torch.Tensor:
    return mask_top_k(logits.clone(), top_k, max_top_k=150).softmax(dim=-1)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_rejection_race_equals_sorting_reference(seed: int) -> None:
    logits, top_k, top_p, noise = _case(seed)
    probs = _probs(logits, top_k)
    winners = top_p_race_torch(probs, noise, top_p)
    assert torch.equal(winners, _reference(logits, top_k, top_p, noise))
    # The nucleus mattered: for many rows the unrestricted winner lies outside it (rejected at least once).
    unrestricted = (probs / noise).argmax(dim=-1)
    assert int((unrestricted != winners).sum()) >= 4


@pytest.mark.parametrize("seed", [0, 3])
def test_triton_race_equals_torch_race(seed: int) -> None:
    logits, top_k, top_p, noise = _case(seed)
    probs = _probs(logits, top_k)
    before = probs.clone()
    assert torch.equal(top_p_race(probs, noise, top_p, _MIN_NOISE), top_p_race_torch(probs, noise, top_p))
    assert torch.equal(probs, before)


def test_seeded_noise_depends_only_on_seed_and_draw() -> None:
    def noise_for(streams: list[tuple[int, int]], vocab: int = 2500) -> torch.Tensor:
        out = torch.full((len(streams), vocab), -1.0)
        rows = torch.arange(len(streams))
        seeds = torch.tensor([s for s, _ in streams])
        draws = torch.tensor([d for _, d in streams])
        seeded_noise(out, rows, seeds, draws)
        return out

    alone = noise_for([(7, 3)])[0]
    mixed = noise_for([(1, 0), (7, 2), (7, 3), (2**40 + 5, 3)])
    assert torch.equal(mixed[2], alone)
    assert not torch.equal(mixed[1], alone) and not torch.equal(mixed[3], alone)
    big = noise_for([(s, d) for s in (11, 12) for d in range(8)])
    assert bool((big >= 0).all())
    assert abs(float(big.mean()) - 1.0) < 0.03  # Exp(1): 40000 draws, 5+ standard errors of room


def _sample_stream(
    seed: int, steps: int, others: list[tuple[SamplingParams, CounterStream | None]]
) -> list[int]:
    target = SamplingParams(temperature=1.0, top_p=0.9, top_k=100, seed=seed)
    sampler = Sampler(use_triton=True)
    tokens = []
    for step in range(steps):
        target_logits = torch.randn(1, VOCAB, generator=torch.Generator().manual_seed(100 + step))
        other_logits = torch.randn(len(others), VOCAB, generator=torch.Generator().manual_seed(500 + step))
        logits = torch.cat([other_logits, target_logits])  # the target row sits last
        params = [p for p, _ in others] + [target]
        streams = [s if s is None else CounterStream(s.seed, s.draw + step) for _, s in others]
        out = sampler(logits, params, [*streams, CounterStream(seed, step)])
        tokens.append(int(out.token_ids[-1]))
    return tokens


def test_counter_stream_rows_are_independent_of_the_batch() -> None:
    alone = _sample_stream(7, 16, [])
    assert len(set(alone)) > 4
    others = [
        (SamplingParams(temperature=0.7, seed=3), CounterStream(3, 5)),
        (SamplingParams(temperature=0.0), None),
        (SamplingParams(temperature=1.3, top_k=4), None),
    ]
    with torch.random.fork_rng():
        torch.manual_seed(99)
        assert _sample_stream(7, 16, others) == alone
    assert _sample_stream(8, 16, []) != alone


def test_engine_with_counter_streams_keeps_seeded_outputs_under_batching_and_preemption() -> None:
    prompts = [[5, 9, 33, 2, 100], list(range(3, 40)), [7] * 12, [300, 301, 302]]
    seeded = SamplingParams(max_tokens=16, temperature=0.9, top_p=0.95, top_k=50, seed=7, ignore_eos=True)
    others = [
        SamplingParams(max_tokens=20, temperature=1.0, seed=1, ignore_eos=True),
        SamplingParams(max_tokens=14, temperature=1.2, ignore_eos=True),
        SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True),
    ]

    def run(
        prompt_list: list[list[int]], params: list[SamplingParams], **options: int
    ) -> tuple[LLM, list[list[int]]]:
        llm = LLM(**options)  # type: ignore[arg-type]
        llm.engine.runner.sampler.use_triton = True  # CounterStream rows + the Triton race, as on CUDA
        return llm, [o.token_ids for o in llm.generate(prompt_list, params)]

    _, (alone,) = run([prompts[1]], [seeded], block_size=4)
    assert len(set(alone)) > 4
    llm, outs = run([prompts[0], prompts[2], prompts[1], prompts[3]], [others[0], others[1], seeded, others[2]],
                    block_size=4, num_kv_blocks=20)  # fmt: skip
    assert outs[2] == alone
    assert llm.stats().num_preemptions > 0
    assert not llm.engine.runner.generators  # stateless streams: nothing kept per request
    llm.check_no_leaks()
