"""Engine-level scheduling, checked against transformers: multi-turn follow-ups reuse every computed
block (decode-filled ones included), and each step packs the decodes first, so a long prompt arriving
beside running requests never starves them."""

from __future__ import annotations

import pathlib
from typing import Any

import pytest

from cluster.protocol import SamplingParams
from tests.support.hf_models import hf_greedy, make_random_hf_model
from workers.llm import LLM
from workers.scheduler import SchedulerOutput


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> pathlib.Path:
    return make_random_hf_model("qwen3", tmp_path_factory.mktemp("scheduling"))


def greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)


def test_multi_turn_follow_ups_hit_every_computed_block(model_dir: pathlib.Path) -> None:
    """Each turn's prompt is the previous prompt + its answer + new text. Its cached prefix is every full
    block of what the previous turn computed: all of its tokens but the last sampled one (never fed
    back), including the blocks its decode filled."""
    block_size = 4
    llm = LLM(str(model_dir), device="cpu", block_size=block_size, num_kv_blocks=64)
    max_tokens = [9, 6, 5]
    new_text = [[5, 77, 402, 18, 260], [90, 91, 92]]
    prompts = [[11, 48, 301, 7, 250, 99, 3, 480, 17, 64]]  # 10 tokens: ends inside block 2
    outputs: list[list[int]] = []
    cached: list[int] = []
    for turn, num_new in enumerate(max_tokens):
        if turn > 0:
            prompts.append(prompts[-1] + outputs[-1] + new_text[turn - 1])
        hits_before = llm.stats().prefix_cache_hits
        out = llm.generate([prompts[-1]], greedy(num_new))[0]
        assert llm.stats().prefix_cache_hits - hits_before == out.num_cached_tokens
        outputs.append(out.token_ids)
        cached.append(out.num_cached_tokens)
    # (10 + 9 - 1) // 4 = 4 blocks; (24 + 6 - 1) // 4 = 7 blocks
    assert cached == [0, 16, 28]
    assert outputs == hf_greedy(model_dir, prompts, max_tokens)
    llm.check_no_leaks()


def test_each_step_packs_decodes_first_and_equals_transformers(
    model_dir: pathlib.Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    llm = LLM(str(model_dir), device="cpu", block_size=4, num_kv_blocks=64, max_num_batched_tokens=8)
    engine = llm.engine
    steps: list[SchedulerOutput] = []
    schedule = engine.scheduler.schedule

    def recording_schedule() -> SchedulerOutput:
        out = schedule()
        steps.append(out)
        return out

    monkeypatch.setattr(engine.scheduler, "schedule", recording_schedule)
    prompts = {"a": [5, 9, 33, 2, 100], "b": list(range(3, 40)), "c": [7, 300, 301, 302]}
    max_tokens = {"a": 6, "b": 3, "c": 3}
    tokens: dict[str, list[int]] = {rid: [] for rid in prompts}
    got_token: list[list[str]] = []

    def run_step() -> None:
        deltas = engine.step()
        for d in deltas:
            tokens[d.request_id].extend(d.token_ids)
        got_token.append(sorted(d.request_id for d in deltas))

    engine.add_request("a", prompts["a"], greedy(max_tokens["a"]))
    run_step()  # a's prompt alone
    engine.add_request("b", prompts["b"], greedy(max_tokens["b"]))  # 37 tokens: chunked over 6 steps
    engine.add_request("c", prompts["c"], greedy(max_tokens["c"]))
    while engine.has_unfinished():
        run_step()

    shapes = [[(s.request_id, s.start_position, len(s.token_ids)) for s in out.scheduled] for out in steps]
    # a's decode goes first and keeps its token every step while b's prompt takes the rest of the budget
    assert shapes == [
        [("a", 0, 5)],
        [("a", 5, 1), ("b", 0, 7)],
        [("a", 6, 1), ("b", 7, 7)],
        [("a", 7, 1), ("b", 14, 7)],
        [("a", 8, 1), ("b", 21, 7)],
        [("a", 9, 1), ("b", 28, 7)],
        [("b", 35, 2), ("c", 0, 4)],
        [("b", 37, 1), ("c", 4, 1)],
        [("b", 38, 1), ("c", 5, 1)],
    ]
    assert got_token == [["a"]] * 6 + [["b", "c"]] * 3
    for out in steps:
        flags: list[Any] = [s.is_decode for s in out.scheduled]
        assert flags == sorted(flags, reverse=True)  # decodes, then prompt chunks
        assert out.num_single_token_seqs == sum(flags)
    assert [out.is_mixed for out in steps] == [False] + [True] * 5 + [False, False, False]
    reference = hf_greedy(model_dir, list(prompts.values()), list(max_tokens.values()))
    assert list(tokens.values()) == reference
    engine.check_no_leaks()
