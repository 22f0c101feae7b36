"""The measures the GPU tests compare by (tests/support/gpu_agreement.py), checked on CPU: rows matched by
request id whatever order a backend runs a step's sequences in, and the bf16 greedy agreement against a
float32 reference (the torch backend in bf16 on CPU holds it; a corrupted run does not)."""

from __future__ import annotations

import dataclasses
import pathlib
import random

import pytest
import torch

from cluster.config import EngineConfig, ModelConfig
from cluster.protocol import RequestOutput, SamplingParams, TokenLogprobs
from tests.support.gpu_agreement import (
    BF16_LOGPROB_TOL,
    BF16_MEAN_LOGPROB_TOL,
    greedy_agreement,
    step_logits_by_schedule,
)
from tests.support.hf_models import make_random_hf_model
from workers.llm import LLM
from workers.model_runner import ModelRunner
from workers.scheduler import ScheduledRequest, SchedulerOutput

GREEDY = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def llama(tmp_path_factory: pytest.TempPathFactory) -> pathlib.Path:
    return make_random_hf_model("llama", tmp_path_factory.mktemp("agreement"))


def test_step_logits_follow_the_schedule_when_the_torch_backend_sorts_decodes(llama: pathlib.Path) -> None:
    """Decodes of lengths 50, 10, 30: the torch backend runs them sorted by length (10, 30, 50); each row
    still equals that request's logits run alone."""
    config = EngineConfig(model=ModelConfig(path=str(llama), max_model_len=256), device="cpu",
                          num_kv_blocks=64, attention_backend="torch", enforce_eager=True)  # fmt: skip
    runner = ModelRunner(config, str(llama))
    rng = random.Random(0)
    prompts = [[rng.randrange(3, 500) for _ in range(n)] for n in (50, 10, 30)]
    tables = [list(range(1 + 8 * i, 9 + 8 * i)) for i in range(3)]
    prefill = [
        ScheduledRequest(f"r{i}", p, 0, tables[i], True, False, GREEDY, 0) for i, p in enumerate(prompts)
    ]
    step_logits_by_schedule(runner, SchedulerOutput(prefill, sum(map(len, prompts))))
    decode = [
        ScheduledRequest(f"r{i}", [7 + i], len(p), tables[i], True, True, GREEDY, 1)
        for i, p in enumerate(prompts)
    ]
    batched = step_logits_by_schedule(runner, SchedulerOutput(decode, 3))
    inputs = runner.prepare_inputs(SchedulerOutput(decode, 3))
    assert inputs.sample_ids == ["r1", "r2", "r0"]  # the reordering the rows must survive
    for i, request in enumerate(decode):
        alone = step_logits_by_schedule(runner, SchedulerOutput([request], 1))
        torch.testing.assert_close(batched[i], alone[0], rtol=1e-5, atol=1e-5)


def test_bf16_greedy_agrees_with_float32_within_the_stated_tolerance(llama: pathlib.Path) -> None:
    rng = random.Random(1)
    prompts = [[rng.randrange(3, 500) for _ in range(rng.randrange(1, 120))] for _ in range(8)]
    max_tokens = [rng.randrange(8, 30) for _ in range(8)]
    outs = {}
    for dtype, num_logprobs in (("float32", 5), ("bfloat16", 1)):
        llm = LLM(str(llama), device="cpu", dtype=dtype, attention_backend="torch", num_kv_blocks=256)
        params = [SamplingParams(max_tokens=m, temperature=0.0, ignore_eos=True, logprobs=num_logprobs)
                  for m in max_tokens]  # fmt: skip
        outs[dtype] = llm.generate(prompts, params)
    agreement = greedy_agreement(outs["float32"], outs["bfloat16"], BF16_LOGPROB_TOL)
    agreement.check(BF16_LOGPROB_TOL, BF16_MEAN_LOGPROB_TOL)
    assert agreement.num_compared >= 8 and agreement.max_logprob_error > 0.0  # bf16 really differs
    # the same run with one token swapped for a non-runner-up fails the check
    bad = outs["bfloat16"][0]
    wrong = (bad.token_ids[0] + 1) % 500
    if wrong == outs["float32"][0].logprobs[0].top_token_ids[1]:
        wrong = (wrong + 1) % 500
    corrupted = [dataclasses.replace(bad, token_ids=[wrong, *bad.token_ids[1:]]), *outs["bfloat16"][1:]]
    assert greedy_agreement(outs["float32"], corrupted, BF16_LOGPROB_TOL).violations


def _out(token_ids: list[int], steps: list[tuple[int, float, int, float]]) -> RequestOutput:
    """(chosen/top token, its logprob, runner-up, runner-up logprob) per step."""
    logprobs = [TokenLogprobs(t, lp, [t, u], [lp, ulp]) for t, lp, u, ulp in steps]
    return RequestOutput("r", [], token_ids, "", logprobs=logprobs)


def test_a_divergence_counts_only_at_a_near_tie_to_the_runner_up() -> None:
    ref = _out([5, 6, 7], [(5, -1.0, 9, -3.0), (6, -1.0, 8, -1.2), (7, -1.0, 9, -4.0)])
    near_tie = greedy_agreement(
        [ref], [_out([5, 8, 3], [(5, -1.1, 0, 0), (8, -1.2, 0, 0), (3, -1, 0, 0)])], 0.25
    )
    assert (near_tie.num_compared, near_tie.num_diverged, near_tie.num_near_ties) == (2, 1, 1)
    assert near_tie.violations == [] and near_tie.max_logprob_error == pytest.approx(0.1)
    near_tie.check(0.25, 0.25)
    wide = greedy_agreement([ref], [_out([9, 6, 7], [(9, -3.0, 0, 0)] * 3)], 0.25)
    assert wide.violations == ["seq 0 step 0: 9 is 2.000 under the top >= 2 * 0.25: not a near-tie"]
    stranger = greedy_agreement([ref], [_out([5, 4, 7], [(5, -1.0, 0, 0)] * 3)], 0.25)
    assert stranger.violations == ["seq 0 step 1: 4 is not in the reference's top 2"]
    drift = greedy_agreement(
        [ref], [_out([5, 6, 7], [(5, -1.0, 0, 0), (6, -1.5, 0, 0), (7, -1.0, 0, 0)])], 0.25
    )
    with pytest.raises(AssertionError):
        drift.check(0.25, 0.25)
