"""Asynchronous scheduling (step N+1 scheduled and launched before step N's tokens are back) changes
nothing a caller sees: the same tokens, texts and finish reasons (logprobs to float rounding) as the
synchronous engine,
through greedy and seeded sampling, EOS / stop-token / stop-string ends (a request scheduled once more
before its stop was known), preemption, prefix-cache hits, chunked prefill, aborts (never a delta after
``abort``), and both halves of a handoff (``hold_after_prefill`` + ``release``; ``add_prefilled_request``
+ ``commit_prefilled``). Every run ends with the leak check.

Events are triggered by what the caller has seen (e.g. "abort r3 once it has 3 tokens"), which is how
a server drives an engine; in asynchronous mode the deltas trail the device by one step.
"""

from __future__ import annotations

import pathlib
from collections.abc import Callable
from dataclasses import dataclass, field

import pytest
import torch

from cluster.protocol import FinishReason, SamplingParams, TokenDelta
from tests.support.hf_models import make_random_hf_model
from workers.async_scheduler import AsyncScheduler
from workers.engine import Engine
from workers.llm import LLM
from workers.request import RequestStatus


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> pathlib.Path:
    return make_random_hf_model("llama", tmp_path_factory.mktemp("async"))


@dataclass
class Seen:
    """What a caller received for one request."""

    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    logprobs: list[float] = field(default_factory=list)
    finish_reason: FinishReason | None = None

    def add(self, delta: TokenDelta) -> None:
        assert self.finish_reason is None, f"delta after the end of {delta.request_id}"
        self.token_ids += delta.token_ids
        self.text += delta.text
        self.logprobs += [lp.logprob for lp in delta.logprobs or []]
        self.finish_reason = delta.finish_reason


Hook = Callable[[Engine, dict[str, Seen], TokenDelta], None]


def drive(engine: Engine, on_delta: Hook | None = None, max_steps: int = 2000) -> dict[str, Seen]:
    seen: dict[str, Seen] = {}
    for _ in range(max_steps):
        if not engine.has_unfinished():
            return seen
        for delta in engine.step():
            seen.setdefault(delta.request_id, Seen()).add(delta)
            if on_delta is not None:
                on_delta(engine, seen, delta)
    raise AssertionError(f"engine still busy after {max_steps} steps")


def both_modes(
    make: Callable[[bool], Engine], on_delta: Hook | None = None
) -> tuple[dict[str, Seen], Engine]:
    """Runs the same scenario synchronously and asynchronously; returns the async run's view."""
    runs = []
    for is_async in (False, True):
        engine = make(is_async)
        assert isinstance(engine.scheduler, AsyncScheduler) == is_async
        runs.append((drive(engine, on_delta), engine))
        engine.check_no_leaks()
    (sync_seen, _), (async_seen, async_engine) = runs
    assert sorted(async_seen) == sorted(sync_seen)
    for rid, seen in sync_seen.items():
        got = async_seen[rid]
        assert (got.token_ids, got.text, got.finish_reason) == (
            seen.token_ids,
            seen.text,
            seen.finish_reason,
        ), rid
        # NOTE: batch composition differs (the async engine runs one step of a request whose stop it does not
        # know yet, and its preemptions may fall elsewhere), so float sums differ in the last bits.
        assert got.logprobs == pytest.approx(seen.logprobs, abs=1e-4), rid
    return async_seen, async_engine


PROMPTS = [[5, 9, 33, 2, 100], list(range(3, 40)), [7] * 12, [300, 301, 302], list(range(100, 170)), [1, 2]]


def test_mixed_sampling_stops_preemption_and_chunking_match(model_dir: pathlib.Path) -> None:
    greedy = SamplingParams(max_tokens=14, temperature=0.0, logprobs=2)
    free = LLM(str(model_dir), block_size=4).generate(
        [PROMPTS[1]], SamplingParams(max_tokens=14, temperature=0.0)
    )
    stop_token = free[0].token_ids[5]  # ends a request mid-way: its next step is already launched
    params = [
        SamplingParams(max_tokens=20, temperature=0.9, top_p=0.9, top_k=40, seed=3, ignore_eos=True),
        SamplingParams(max_tokens=14, temperature=0.0, stop_token_ids=[stop_token]),
        greedy,
        SamplingParams(max_tokens=9, temperature=1.1, min_p=0.05, seed=11, ignore_eos=True),
        SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True),
        SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True),
    ]

    def make(is_async: bool) -> Engine:
        llm = LLM(str(model_dir), block_size=4, num_kv_blocks=24, max_num_batched_tokens=20,
                  async_scheduling=is_async)  # fmt: skip
        for i, (prompt, p) in enumerate(zip(PROMPTS, params, strict=True)):
            llm.engine.add_request(f"r{i}", prompt, p)
        return llm.engine

    seen, engine = both_modes(make)
    assert seen["r1"].finish_reason == FinishReason.STOP and seen["r1"].token_ids[-1] == stop_token
    assert len(seen["r1"].token_ids) < 14
    assert [len(seen[f"r{i}"].token_ids) for i in (0, 3, 4, 5)] == [20, 9, 6, 1]
    assert engine.stats().num_preemptions > 0 and engine.stats().num_mixed_steps > 0
    assert isinstance(engine.scheduler, AsyncScheduler) and engine.scheduler.num_discarded_tokens > 0


def test_stop_strings_and_prefix_hits_match() -> None:
    prompt = "Once upon a time"

    def make(is_async: bool) -> Engine:
        llm = LLM(block_size=4, async_scheduling=is_async)
        tokens = llm.tokenizer.encode(prompt)
        free = llm.generate([tokens], SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True))[0]
        stop = " " + free.text.split()[len(free.text.split()) // 2]
        # Two prompts sharing the first one's cached blocks (prefix hits), one ended by a stop string.
        llm.engine.add_request("s", tokens, SamplingParams(max_tokens=30, temperature=0.0, stop=[stop]))
        llm.engine.add_request(
            "t", tokens + free.token_ids[:9], SamplingParams(max_tokens=8, temperature=0.0)
        )
        return llm.engine

    seen, engine = both_modes(make)
    assert seen["s"].finish_reason == FinishReason.STOP and seen["s"].text
    assert engine.stats().prefix_cache_hits > 0
    assert isinstance(engine.scheduler, AsyncScheduler) and engine.scheduler.num_discarded_tokens > 0


def test_abort_mid_flight_emits_nothing_more(model_dir: pathlib.Path) -> None:
    aborted: dict[str, int] = {}

    def on_delta(engine: Engine, seen: dict[str, Seen], delta: TokenDelta) -> None:
        if delta.request_id == "r1" and len(seen["r1"].token_ids) == 3:
            assert engine.abort("r1")
            aborted["r1"] = 3
        if delta.request_id == "r0" and len(seen["r0"].token_ids) == 2 and "r2" not in aborted:
            assert engine.abort("r2")  # still waiting or in its first chunks: never produced a token
            aborted["r2"] = 0

    def make(is_async: bool) -> Engine:
        aborted.clear()
        llm = LLM(str(model_dir), block_size=4, max_num_batched_tokens=16, async_scheduling=is_async)
        for i, prompt in enumerate(PROMPTS[:5]):
            llm.engine.add_request(
                f"r{i}", prompt, SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
            )
        return llm.engine

    seen, engine = both_modes(make, on_delta)
    assert len(seen["r1"].token_ids) == 3 and seen["r1"].finish_reason is None
    assert isinstance(engine.scheduler, AsyncScheduler) and engine.scheduler.num_discarded_tokens > 0
    assert "r2" not in seen
    assert all(len(seen[f"r{i}"].token_ids) == 10 for i in (0, 3, 4))
    assert not engine.abort("r1")  # already gone


def test_handoff_hold_release_and_prefilled_commit(model_dir: pathlib.Path) -> None:
    """One engine plays both sides: "p" is prefilled and held, its KV is copied into the blocks reserved
    for "d" (the same prompt arriving as already prefilled), "p" is released, "d" decodes on; "ref" is the
    same request run whole. "d" must produce exactly the tokens "ref" produced after its first."""
    prompt = list(range(40, 72))  # 32 tokens: a whole number of 4-token blocks
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    held_blocks: dict[bool, int] = {}

    def on_delta(engine: Engine, seen: dict[str, Seen], delta: TokenDelta) -> None:
        if delta.request_id != "p":
            return
        assert engine.request_status("p") == RequestStatus.SENDING_KV and delta.finish_reason is None
        source = engine.held_block_ids("p")
        assert source is not None
        held_blocks[isinstance(engine.scheduler, AsyncScheduler)] = len(source)
        reserved = engine.add_prefilled_request("d", prompt, delta.token_ids[0], params)
        assert reserved is not None
        blocks, num_cached = reserved
        kv = engine.runner.kv_cache
        kv[:, blocks[num_cached:]] = kv[:, source[num_cached : len(blocks)]]
        engine.release("p")
        engine.commit_prefilled("d")

    def make(is_async: bool) -> Engine:
        llm = LLM(str(model_dir), block_size=4, async_scheduling=is_async)
        llm.engine.add_request("ref", prompt, params)
        llm.engine.add_request("q", PROMPTS[1], params)
        llm.engine.add_request("p", prompt, params, hold_after_prefill=True)
        return llm.engine

    with torch.inference_mode():
        seen, _ = both_modes(make, on_delta)
    assert seen["p"].token_ids == seen["ref"].token_ids[:1] and seen["p"].finish_reason is None
    assert seen["d"].token_ids == seen["ref"].token_ids[1:]
    # The held request was never scheduled past its first token (no block for it beyond the prompt's).
    assert held_blocks == {False: 8, True: 8}


def test_async_scheduling_is_the_default_on_cuda_and_off_on_cpu() -> None:
    from cluster.config import EngineConfig

    unset = EngineConfig()
    assert unset.async_scheduling is None
    assert (unset.uses_async_scheduling("cuda"), unset.uses_async_scheduling("cpu")) == (True, False)
    for value in (True, False):
        set_ = EngineConfig(async_scheduling=value)
        assert (set_.uses_async_scheduling("cuda"), set_.uses_async_scheduling("cpu")) == (value, value)
    assert LLM(block_size=4).engine.runner.is_async is False  # the CPU engine (bundled model)
