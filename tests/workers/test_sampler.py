from __future__ import annotations

import math

import pytest
import torch

from cluster.protocol import SamplingParams
from workers.sampler import Sampler, SamplerOutput, apply_top_k_top_p

VOCAB = 64


def _seeded(seed: int) -> torch.Generator:
    gen = torch.Generator()
    gen.manual_seed(seed)
    return gen


def _logits(num_rows: int, seed: int = 0) -> torch.Tensor:
    gen = _seeded(seed)
    return torch.randn(num_rows, VOCAB, generator=gen) * 3.0


def _hand_made(probs: list[float]) -> torch.Tensor:
    return torch.tensor([probs], dtype=torch.float64).log().float()


def _draw_ids(logits: torch.Tensor, params: SamplingParams, num_draws: int) -> set[int]:
    batch = logits.expand(num_draws, -1).contiguous()
    out = Sampler()(batch, [params] * num_draws, [None] * num_draws)
    return set(out.token_ids.tolist())


def test_greedy_and_top_k_1_equal_argmax() -> None:
    logits = _logits(8)
    expected = logits.argmax(dim=-1)
    sampler = Sampler()
    greedy = sampler(logits, [SamplingParams(temperature=0.0)] * 8, [None] * 8)
    top1 = sampler(logits, [SamplingParams(temperature=1.5, top_k=1)] * 8, [None] * 8)
    assert greedy.token_ids.dtype == torch.int64
    assert torch.equal(greedy.token_ids, expected)
    assert torch.equal(top1.token_ids, expected)
    assert greedy.logprobs is None and greedy.top_token_ids is None


def test_mixed_batch_keeps_greedy_rows_exact() -> None:
    logits = _logits(6, seed=3)
    params = [SamplingParams(temperature=0.0 if i % 2 else 1.0) for i in range(6)]
    out = Sampler()(logits, params, [None] * 6)
    assert torch.equal(out.token_ids[1::2], logits.argmax(dim=-1)[1::2])


def _run_seeded_alone(params: SamplingParams, seed: int, steps: int) -> list[int]:
    gen = _seeded(seed)
    tokens = []
    for step in range(steps):
        logits = _logits(1, seed=100 + step)
        tokens.append(int(Sampler()(logits, [params], [gen]).token_ids[0]))
    return tokens


@pytest.mark.parametrize("position", [0, 2, 4])
def test_seeded_row_reproducible_across_batch_mix(position: int) -> None:
    target = SamplingParams(temperature=1.0, top_p=0.95, seed=7)
    alone = _run_seeded_alone(target, seed=7, steps=20)
    assert len(set(alone)) > 1  # really random, not a collapsed distribution

    others = [
        SamplingParams(temperature=0.8, seed=11),
        SamplingParams(temperature=1.2, top_k=5),
        SamplingParams(temperature=0.0),
        SamplingParams(temperature=1.0, min_p=0.1),
    ]
    gens: list[torch.Generator | None] = [_seeded(11), None, None, None]
    params = [*others[:position], target, *others[position:]]
    gens = [*gens[:position], _seeded(7), *gens[position:]]
    in_batch = []
    with torch.random.fork_rng():
        torch.manual_seed(1234 + position)  # unseeded rows draw from the default generator
        for step in range(20):
            logits = _logits(len(params), seed=500 + step)
            logits[position] = _logits(1, seed=100 + step)[0]
            in_batch.append(int(Sampler()(logits, params, gens).token_ids[position]))
    assert in_batch == alone


def test_different_seeds_differ() -> None:
    params = SamplingParams(temperature=1.0)
    assert _run_seeded_alone(params, seed=1, steps=20) != _run_seeded_alone(params, seed=2, steps=20)


def test_top_k_never_picks_outside_top_k() -> None:
    logits = _logits(1, seed=5)
    allowed = set(logits[0].topk(4).indices.tolist())
    drawn = _draw_ids(logits, SamplingParams(temperature=2.0, top_k=4), num_draws=2000)
    assert drawn == allowed


def test_top_p_picks_only_from_nucleus() -> None:
    logits = _hand_made([0.5, 0.25, 0.15, 0.06, 0.04])
    # Mass 0.5 + 0.25 = 0.75 < 0.8, so the nucleus needs the third token too.
    assert _draw_ids(logits, SamplingParams(top_p=0.8), num_draws=2000) == {0, 1, 2}
    assert _draw_ids(logits, SamplingParams(top_p=0.7), num_draws=2000) == {0, 1}
    assert _draw_ids(logits, SamplingParams(top_p=1e-6), num_draws=200) == {0}


def test_top_k_then_top_p_mask_exact() -> None:
    logits = torch.cat([_hand_made([0.5, 0.25, 0.15, 0.06, 0.04]), _hand_made([0.04, 0.06, 0.15, 0.25, 0.5])])
    top_k = torch.tensor([3, 5])
    top_p = torch.tensor([float("inf"), 0.8])
    masked = apply_top_k_top_p(logits.clone(), top_k, top_p, max_top_k=3)
    assert torch.isfinite(masked).tolist() == [
        [True, True, True, False, False],
        [False, False, True, True, True],
    ]
    only_k = apply_top_k_top_p(logits.clone(), torch.tensor([2, 5]), None, max_top_k=2)
    assert torch.isfinite(only_k).tolist() == [[True, True, False, False, False], [True] * 5]


def test_min_p_filter_exact() -> None:
    logits = _hand_made([0.4, 0.3, 0.15, 0.1, 0.05])
    # min_p 0.3: threshold 0.12 keeps 0.4, 0.3, 0.15; min_p 0.5: threshold 0.2 keeps 0.4, 0.3.
    assert _draw_ids(logits, SamplingParams(min_p=0.3), num_draws=2000) == {0, 1, 2}
    assert _draw_ids(logits, SamplingParams(min_p=0.5), num_draws=2000) == {0, 1}


def test_temperature_to_zero_is_argmax() -> None:
    logits = _logits(32, seed=9)
    for temperature in (1e-3, 1e-6):
        out = Sampler()(logits, [SamplingParams(temperature=temperature)] * 32, [None] * 32)
        assert torch.equal(out.token_ids, logits.argmax(dim=-1))


def test_logprobs_are_raw_model_logprobs() -> None:
    logits = _logits(4, seed=13)
    params = [
        SamplingParams(temperature=0.7, top_k=10, logprobs=3),
        SamplingParams(temperature=0.0, logprobs=0),
        SamplingParams(temperature=1.0),
        SamplingParams(temperature=1.3, top_p=0.9, logprobs=5),
    ]
    out = Sampler()(logits, params, [None] * 4)
    raw = torch.log_softmax(logits, dim=-1)
    assert out.logprobs is not None and out.top_token_ids is not None and out.top_logprobs is not None
    assert out.logprobs.dtype == torch.float32
    assert torch.equal(out.logprobs, raw.gather(1, out.token_ids.unsqueeze(1)).squeeze(1))
    expected_top = raw.topk(5, dim=-1)
    assert torch.equal(out.top_token_ids, expected_top.indices)
    assert torch.equal(out.top_logprobs, expected_top.values)

    token_ids, logprobs = out.to_host(params)
    assert token_ids == out.token_ids.tolist()
    assert logprobs[2] is None
    for row, k in ((0, 3), (1, 0), (3, 5)):
        entry = logprobs[row]
        assert entry is not None
        assert entry.token_id == token_ids[row]
        assert entry.logprob == raw[row, token_ids[row]].item()
        assert entry.top_token_ids == expected_top.indices[row, :k].tolist()
        assert entry.top_logprobs == expected_top.values[row, :k].tolist()
        assert all(isinstance(t, int) for t in entry.top_token_ids)


def test_to_host_shapes_without_logprobs() -> None:
    out = SamplerOutput(token_ids=torch.tensor([3, 1, 4]))
    token_ids, logprobs = out.to_host([SamplingParams()] * 3)
    assert token_ids == [3, 1, 4]
    assert logprobs == [None, None, None]

    only_chosen = Sampler()(_logits(2), [SamplingParams(temperature=0.0, logprobs=0)] * 2, [None] * 2)
    assert only_chosen.top_token_ids is None
    assert only_chosen.logprobs is not None and only_chosen.logprobs.shape == (2,)
    _, entries = only_chosen.to_host([SamplingParams(logprobs=0)] * 2)
    assert all(e is not None and e.top_token_ids == [] and math.isfinite(e.logprob) for e in entries)


def test_input_logits_not_modified_and_rows_checked() -> None:
    logits = _logits(3)
    before = logits.clone()
    Sampler()(logits, [SamplingParams(temperature=0.5, top_k=3, top_p=0.5, min_p=0.2)] * 3, [None] * 3)
    assert torch.equal(logits, before)
    with pytest.raises(ValueError, match="3 logits rows but 2 params"):
        Sampler()(logits, [SamplingParams()] * 2, [None] * 2)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_seeded_sampling_on_cuda_matches_batch_mix() -> None:
    logits = _logits(3, seed=21).cuda()
    params = [SamplingParams(seed=7), SamplingParams(), SamplingParams(top_k=5, seed=3)]

    def gen(seed: int) -> torch.Generator:
        g = torch.Generator(device="cuda")
        g.manual_seed(seed)
        return g

    batch = Sampler()(logits, params, [gen(7), None, gen(3)])
    alone = Sampler()(logits[:1], params[:1], [gen(7)])
    assert batch.token_ids.device.type == "cuda"
    assert batch.token_ids[0].item() == alone.token_ids[0].item()
