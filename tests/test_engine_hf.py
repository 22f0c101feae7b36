"""HF equivalence: the engine's greedy tokens equal transformers' greedy tokens, token for token, on
small random-weight models of every supported architecture, under settings that force every mechanism
(tiny blocks, chunked prefill, mixed steps, preemption, prefix caching on and off)."""

from __future__ import annotations

import pathlib
import random
from typing import Any

import pytest

from cluster.protocol import SamplingParams
from tests.hf_models import ARCHS, hf_greedy, make_random_hf_model
from workers.llm import LLM

PROMPT_LENS = (1, 5, 17, 33, 64, 100, 180, 300)
MAX_TOKENS = (12, 3, 20, 7, 16, 9, 14, 5, 10, 8)
SHARED_PREFIX_LEN = 70


def make_prompts(seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    prompts = [[rng.randrange(3, 512) for _ in range(n)] for n in PROMPT_LENS]
    prefix = [rng.randrange(3, 512) for _ in range(SHARED_PREFIX_LEN)]
    prompts += [prefix + [rng.randrange(3, 512) for _ in range(n)] for n in (20, 40)]
    return prompts


@pytest.fixture(scope="module", params=ARCHS)
def model_and_reference(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Any:
    path = make_random_hf_model(request.param, tmp_path_factory.mktemp("hf"))
    prompts = make_prompts()
    reference = hf_greedy(path, prompts, list(MAX_TOKENS))
    # NOTE: a model repeating one token would make equality meaningless.
    assert all(len(set(r)) > 1 for r in reference if len(r) >= 5)
    return path, prompts, reference


def greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)


SETTINGS: dict[str, dict[str, Any]] = {
    "plain": dict(block_size=16, enable_prefix_caching=False),
    "block1_chunked_mixed": dict(block_size=1, max_num_batched_tokens=48, enable_prefix_caching=False),
    "block4_preempt": dict(block_size=4, num_kv_blocks=96, max_num_batched_tokens=128),
    "block16_prefix_cache": dict(block_size=16, enable_prefix_caching=True, max_num_seqs=4),
}


@pytest.mark.parametrize("setting", list(SETTINGS))
def test_greedy_equals_transformers(model_and_reference: Any, setting: str) -> None:
    path, prompts, reference = model_and_reference
    llm = LLM(str(path), **SETTINGS[setting])
    params = [greedy(m) for m in MAX_TOKENS]
    outs = llm.generate(prompts, params)
    assert [o.token_ids for o in outs] == reference
    assert all(o.finish_reason is not None and o.finish_reason.value == "length" for o in outs)
    stats = llm.stats()
    if setting == "block1_chunked_mixed":
        assert stats.num_mixed_steps > 0
    if setting == "block4_preempt":
        assert stats.num_preemptions > 0
    if setting == "block16_prefix_cache":
        # shared prefixes hit (max_num_seqs 4 staggers admission); a second pass hits every prompt
        first_hits = stats.prefix_cache_hits
        assert first_hits > 0
        again = llm.generate(prompts, params)
        assert [o.token_ids for o in again] == reference
        assert llm.stats().prefix_cache_hits > first_hits
        assert sum(o.num_cached_tokens > 0 for o in again) >= 8
    llm.check_no_leaks()


def test_prefix_sharing_prompts_in_one_batch(model_and_reference: Any, tmp_path: pathlib.Path) -> None:
    """Many prompts sharing prefixes of several lengths, all admitted at once, tiny blocks."""
    path, prompts, _ = model_and_reference
    base = prompts[7]  # 300 tokens
    family = [base[:n] for n in (40, 41, 64, 65, 120, 200)]
    ref = hf_greedy(path, family, [6] * len(family))
    llm = LLM(str(path), block_size=4, enable_prefix_caching=True, max_num_batched_tokens=96)
    assert [o.token_ids for o in llm.generate(family, greedy(6))] == ref
    assert [o.token_ids for o in llm.generate(family, greedy(6))] == ref
    assert llm.stats().prefix_cache_hits > 0
    llm.check_no_leaks()
