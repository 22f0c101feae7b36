"""``Engine.step_output()``: a worker's detokenizer stage builds a step's deltas after the step thread ran
on (workers/step_output.py); they must be the deltas ``step()`` builds at once."""

from __future__ import annotations

import pathlib
from dataclasses import replace

import pytest

from cluster.protocol import FinishReason, SamplingParams, TokenDelta
from tests.support.hf_models import make_random_hf_model
from workers.engine import Engine
from workers.llm import LLM


def _same_clock(delta: TokenDelta) -> TokenDelta:
    """`delta` with its time of first scheduling as 0.0 (None stays None)."""
    return replace(delta, scheduled_time=None if delta.scheduled_time is None else 0.0)


PROMPTS = [[5, 9, 33, 2, 100], list(range(3, 40)), [7] * 12, [300, 301, 302], list(range(100, 170))]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> pathlib.Path:
    return make_random_hf_model("llama", tmp_path_factory.mktemp("step-output"))


@pytest.mark.parametrize("is_async", [False, True])
def test_deltas_built_after_later_steps_are_the_ones_step_builds(
    model_dir: pathlib.Path, is_async: bool
) -> None:
    free = LLM(str(model_dir), block_size=4).generate(
        [PROMPTS[1]], SamplingParams(max_tokens=14, temperature=0.0)
    )
    stop_token = free[0].token_ids[4]
    params = [
        SamplingParams(max_tokens=12, temperature=0.9, top_k=40, seed=3, logprobs=2, ignore_eos=True),
        SamplingParams(max_tokens=14, temperature=0.0, stop_token_ids=[stop_token], logprobs=1),
        SamplingParams(max_tokens=9, temperature=0.0, logprobs=3, ignore_eos=True),
        SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True),
        SamplingParams(max_tokens=6, temperature=1.1, seed=11, ignore_eos=True),
    ]

    def make() -> Engine:
        # NOTE: 24 blocks of 4 tokens and 20 tokens a step: preemption and chunked prefill
        llm = LLM(str(model_dir), block_size=4, num_kv_blocks=24, max_num_batched_tokens=20,
                  async_scheduling=is_async)  # fmt: skip
        for i, (prompt, p) in enumerate(zip(PROMPTS, params, strict=True)):
            llm.engine.add_request(f"r{i}", prompt, p)
        return llm.engine

    at_once, later = make(), make()
    built_at_once, outputs = [], []
    num_steps = 0
    while at_once.has_unfinished():
        built_at_once.append(at_once.step())
        outputs.append(later.step_output())
        num_steps += 1
        if num_steps == 6:  # r3 ends by abort, mid-stream
            assert at_once.abort("r3") and later.abort("r3")
    assert not later.has_unfinished()
    # every output's deltas built only now, after the last step: what a step changes later (newer tokens,
    # logprobs entries, an end) must not leak into an earlier step's deltas
    # (each engine's own clock says when a request was first scheduled: compared apart)
    assert [[_same_clock(d) for d in o.deltas()] for o in outputs] == [
        [_same_clock(d) for d in step] for step in built_at_once
    ]
    deltas = [d for step in built_at_once for d in step]
    ends = {d.request_id: d.finish_reason for d in deltas if d.finish_reason is not None}
    assert ends == {"r0": FinishReason.LENGTH, "r1": FinishReason.STOP, "r2": FinishReason.LENGTH,
                    "r4": FinishReason.LENGTH}  # fmt: skip
    assert sum(1 for d in deltas if d.logprobs) == sum(
        1 for d in deltas if d.request_id in ("r0", "r1", "r2")
    )
    assert later.stats().num_preemptions > 0
    at_once.check_no_leaks()
    later.check_no_leaks()
