"""Prompt logprobs (``SamplingParams.prompt_logprobs``) on the worker that prefills the prompt: each prompt
token's logprob and the top k equal transformers' log-softmax of the prompt's logits on every
architecture, whether the prompt is computed in one step or in chunks beside other requests. A request
scoring its prompt takes no prefix-cache hit (its result equals the uncached one) yet publishes its
blocks; a preemption before its first token recomputes them (synchronous and asynchronous scheduling);
they travel with the first token only: on a prefill worker, in the handoff's delta (through the wire
codec), and the decode worker sends none, nor does a migrated request that streamed tokens already."""

from __future__ import annotations

import pathlib
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
import torch

from cluster.config import EngineConfig
from cluster.frames import new_secret
from cluster.protocol import SamplingParams, TokenDelta, TokenLogprobs
from cluster.wire import ROUTER_ID, Prefilled, WireDecoder, WireEncoder
from tests.support.handoff_fakes import DecodeSide, PrefillSide
from tests.support.hf_models import ARCHS, make_random_hf_model
from tests.support.oracle_cache import qwen3_model
from workers.engine import Engine
from workers.llm import LLM
from workers.request import Request, RequestStatus
from workers.scheduler import PromptLogprobRows, SampledTokens, Scheduler
from workers.step_inputs import build_step_arrays

LONG = [(37 * i + 11) % 500 + 3 for i in range(45)]  # over the 16-token budget: three chunks
SHORT = [9, 400, 21, 77, 5, 130]
NUM_TOP = 5
ABS = 1e-4


def greedy(max_tokens: int, prompt_logprobs: int | None = None) -> SamplingParams:
    return SamplingParams(
        max_tokens=max_tokens, temperature=0.0, ignore_eos=True, prompt_logprobs=prompt_logprobs
    )


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], str]:
    """arch -> a random checkpoint, built once per module (qwen3: the session's)."""
    paths: dict[str, str] = {}

    def get(arch: str) -> str:
        if arch not in paths:
            if arch == "qwen3":
                paths[arch] = qwen3_model(tmp_path_factory)
            else:
                paths[arch] = str(make_random_hf_model(arch, pathlib.Path(tmp_path_factory.mktemp(arch))))
        return paths[arch]

    return get


@pytest.fixture(scope="module")
def hf_logprobs() -> Callable[[str, list[int]], torch.Tensor]:
    """(checkpoint, prompt) -> transformers' float32 log-softmax of the prompt's logits [len, vocab]."""
    import transformers

    models: dict[str, Any] = {}

    def get(path: str, prompt: list[int]) -> torch.Tensor:
        if path not in models:
            models[path] = transformers.AutoModelForCausalLM.from_pretrained(
                path, dtype=torch.float32, attn_implementation="eager"
            ).eval()
        with torch.no_grad():
            logits = models[path](torch.tensor([prompt])).logits[0].float()
        return logits.log_softmax(dim=-1)

    return get


def assert_matches(
    scored: list[TokenLogprobs | None] | None, prompt: list[int], reference: torch.Tensor, k: int
) -> None:
    """``scored`` is transformers' ``reference`` for ``prompt`` with the top ``k``: logprobs within ABS, top
    ids equal at every position without a near-tie among its k + 1 best (all but a few positions)."""
    assert scored is not None and len(scored) == len(prompt) and scored[0] is None
    entries = [e for e in scored[1:] if e is not None]
    assert len(entries) == len(prompt) - 1
    assert [e.token_id for e in entries] == prompt[1:]
    expected = reference[:-1].gather(1, torch.tensor(prompt[1:]).unsqueeze(1)).squeeze(1).numpy()
    np.testing.assert_allclose([e.logprob for e in entries], expected, rtol=0, atol=ABS)
    assert all(len(e.top_token_ids) == len(e.top_logprobs) == k for e in entries)
    if k == 0:
        return
    top = reference[:-1].topk(k + 1, dim=-1)
    np.testing.assert_allclose([e.top_logprobs for e in entries], top.values[:, :k].numpy(), rtol=0, atol=ABS)
    is_tied = (top.values[:, :-1] - top.values[:, 1:] < 10 * ABS).any(dim=1).tolist()
    compared = [
        (e.top_token_ids, ids)
        for e, ids, tied in zip(entries, top.indices[:, :k].tolist(), is_tied, strict=True)
        if not tied
    ]
    assert len(compared) >= len(entries) - 3
    assert [got for got, _ in compared] == [want for _, want in compared]


@pytest.mark.parametrize("arch", ARCHS)
def test_prompt_logprobs_equal_transformers_chunked_beside_other_requests(
    arch: str, checkpoints: Callable[[str], str], hf_logprobs: Callable[[str, list[int]], torch.Tensor]
) -> None:
    path = checkpoints(arch)
    llm = LLM(path, device="cpu", block_size=4, num_kv_blocks=64, max_num_batched_tokens=16)
    prompts = [LONG, SHORT, [17], SHORT[::-1]]
    params = [greedy(3, NUM_TOP), greedy(3, 0), greedy(3, 2), greedy(3)]
    long, short, single, plain = llm.generate(prompts, params)
    assert llm.stats().num_mixed_steps > 0
    assert_matches(long.prompt_logprobs, LONG, hf_logprobs(path, LONG), NUM_TOP)
    assert_matches(short.prompt_logprobs, SHORT, hf_logprobs(path, SHORT), 0)
    assert single.prompt_logprobs == [None]  # nothing precedes a prompt's only token
    assert plain.prompt_logprobs is None
    assert [len(o.token_ids) for o in (long, short, single, plain)] == [3, 3, 3, 3]
    llm.check_no_leaks()


def test_the_rows_of_each_prompt_chunk_score_the_next_prompt_token_and_sampling_rows_stay() -> None:
    """Scheduler and step arrays alone: the rows are every prompt position but the last (which samples),
    apart from ``logits_indices``; a scoring request takes no hit but publishes its blocks; a request
    that has tokens (migrated) scores nothing and hits."""
    s = Scheduler(EngineConfig(block_size=4, num_kv_blocks=32, max_num_batched_tokens=8), 32, 1024)
    prompt = list(range(100, 111))  # 11 tokens

    def add(rid: str, prompt_logprobs: int | None, outputs: list[int] | None = None) -> Request:
        request = Request(rid, list(prompt), SamplingParams(max_tokens=4, prompt_logprobs=prompt_logprobs))
        request.output_token_ids.extend(outputs or [])
        s.add_request(request)
        return request

    def step() -> Any:
        out = s.schedule()
        s.update_from_output(out, SampledTokens({x.request_id: 7 for x in out.scheduled if x.needs_sample}))
        return out

    add("plain", None)
    step()
    step()  # prompt in two chunks: its first two blocks are cached
    scored = add("scored", 3)
    out = step()  # plain decodes (row 0), scored's first chunk takes the 7 left
    assert [(x.request_id, x.start_position, len(x.token_ids)) for x in out.scheduled] == [
        ("plain", 11, 1),
        ("scored", 0, 7),
    ]
    assert scored.num_cached_tokens == 0 and s.kv.prefix_cache is not None
    assert out.prompt_logprob_rows == [PromptLogprobRows("scored", 0, prompt[1:8], 3)]
    arrays = build_step_arrays(out.scheduled, 4, prompt_rows=out.prompt_logprob_rows)
    assert arrays.logits_indices.tolist() == [0] and arrays.sample_rows == [0]
    assert arrays.prompt_logits_indices is not None and arrays.prompt_target_ids is not None
    assert arrays.prompt_logits_indices.tolist() == [1, 2, 3, 4, 5, 6, 7]
    assert arrays.prompt_target_ids.tolist() == prompt[1:8]
    out = step()  # scored's last chunk: positions 7..10; 10 samples the first token
    assert out.prompt_logprob_rows == [PromptLogprobRows("scored", 7, prompt[8:11], 3)]
    arrays = build_step_arrays(out.scheduled, 4, prompt_rows=out.prompt_logprob_rows)
    assert arrays.logits_indices.tolist() == [0, 4] and arrays.prompt_logits_indices is not None
    assert arrays.prompt_logits_indices.tolist() == [1, 2, 3]
    assert scored.output_token_ids == [7]
    assert build_step_arrays(out.scheduled, 4).prompt_logits_indices is None  # no rows asked: none
    migrated = add("migrated", 3, outputs=[5, 6])
    out = step()
    assert migrated.num_cached_tokens == 8 and out.prompt_logprob_rows == []
    for rid in ("plain", "scored", "migrated"):
        s.finish_request(rid, RequestStatus.FINISHED_ABORTED)
    s.check_no_leaks()


def test_a_cached_prefix_is_computed_again_and_the_scored_blocks_are_published(
    checkpoints: Callable[[str], str], hf_logprobs: Callable[[str, list[int]], torch.Tensor]
) -> None:
    path = checkpoints("qwen3")
    llm = LLM(path, device="cpu", block_size=4, num_kv_blocks=64, enable_prefix_caching=True)
    shared = LONG[:16]
    prompt = shared + SHORT + SHORT[:3] + [44, 45, 46, 47]  # 29 tokens: 7 full blocks before the last
    llm.generate([[*shared, 8, 9]], greedy(2))
    (scored,) = llm.generate([prompt], greedy(2, NUM_TOP))
    assert scored.num_cached_tokens == 0  # the shared 16 tokens were cached, and not taken
    assert_matches(scored.prompt_logprobs, prompt, hf_logprobs(path, prompt), NUM_TOP)
    (again,) = llm.generate([prompt], greedy(4))
    assert again.num_cached_tokens == 28  # every full block before the last token: the scored one's
    assert again.token_ids[:2] == scored.token_ids
    # a request that streamed tokens elsewhere (migrated) hits and sends no prompt logprobs again
    engine = llm.engine
    engine.add_request("migrated", prompt, greedy(4, NUM_TOP), output_token_ids=scored.token_ids)
    deltas: list[TokenDelta] = []
    while engine.has_unfinished():
        deltas += engine.step()
    assert [t for d in deltas for t in d.token_ids] == again.token_ids[2:]
    assert deltas and all(d.prompt_logprobs is None for d in deltas)
    assert deltas[0].num_cached_tokens == 28
    llm.check_no_leaks()


@pytest.mark.parametrize("is_async", [False, True], ids=["sync", "async"])
def test_a_preemption_before_the_first_token_scores_the_prompt_again(
    is_async: bool, checkpoints: Callable[[str], str], hf_logprobs: Callable[[str, list[int]], torch.Tensor]
) -> None:
    """A pool too small for both: the scoring request (the newest) is preempted mid-prompt, repeatedly,
    while the other decodes; its prompt logprobs still equal transformers', on its first delta only."""
    path = checkpoints("qwen3")
    config = EngineConfig.from_options(
        path,
        device="cpu",
        block_size=4,
        num_kv_blocks=13,
        max_num_batched_tokens=8,
        async_scheduling=is_async,
    )
    engine = Engine(config)
    prompt = [(29 * i + 7) % 500 + 3 for i in range(36)]
    engine.add_request("decoding", [*SHORT, 1, 2], greedy(24))
    engine.add_request("scored", prompt, greedy(2, 3))
    request = engine.scheduler.requests["scored"]
    num_partial_preemptions = 0
    deltas: list[TokenDelta] = []
    while engine.has_unfinished():
        num_scored = len(request.prompt_logprobs or [])
        deltas += [d for d in engine.step() if d.request_id == "scored"]
        if request.status is RequestStatus.PREEMPTED and not request.output_token_ids and num_scored > 1:
            num_partial_preemptions += 1
    assert num_partial_preemptions >= 2 and request.num_preemptions >= 2
    assert [d.prompt_logprobs is not None for d in deltas] == [True, False]
    assert_matches(deltas[0].prompt_logprobs, prompt, hf_logprobs(path, prompt), 3)
    engine.check_no_leaks()


def test_a_prefill_worker_sends_them_with_the_handoff_and_the_decode_worker_none(
    checkpoints: Callable[[str], str],
) -> None:
    path = checkpoints("qwen3")
    params = greedy(4, NUM_TOP)
    (colocated,) = LLM(
        path, device="cpu", block_size=4, num_kv_blocks=64, max_num_batched_tokens=16
    ).generate([LONG], params)
    p = PrefillSide(path, num_kv_blocks=64, max_num_batched_tokens=16)
    p.engine.add_request("A", LONG, params, hold_after_prefill=True)
    while p.engine.request_status("A") is not RequestStatus.SENDING_KV:
        p.turn()
    (event,) = p.events
    assert isinstance(event, Prefilled) and event.delta.token_ids == colocated.token_ids[:1]
    assert event.delta.prompt_logprobs == colocated.prompt_logprobs  # the same computation, exactly
    secret = new_secret()
    frame = WireEncoder(secret).encode(ROUTER_ID, event)
    assert WireDecoder(secret, ROUTER_ID, (Prefilled,)).decode(frame) == event
    block_ids, _ = p.sender.offers["A"]
    rows = p.engine.runner.kv_cache[:, block_ids].clone()
    p.sent("A", True)
    p.turn()
    d = DecodeSide(path, num_kv_blocks=64)
    d.handoff("A", LONG, event.delta.token_ids[0], params)
    d.receiver.land("A", rows)
    deltas: list[TokenDelta] = []
    while d.engine.has_unfinished() or d.role.num_waiting_for_kv():
        deltas += d.turn()
    assert [t for x in deltas for t in x.token_ids] == colocated.token_ids[1:]
    assert all(x.prompt_logprobs is None for x in deltas)
    p.engine.check_no_leaks()
    d.check_no_leaks()
