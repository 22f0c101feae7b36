"""HF equivalence: the engine's greedy tokens equal transformers' greedy tokens, token for token, on
small random-weight models of every supported architecture, under settings that force every mechanism
(tiny blocks, chunked prefill, mixed steps, preemption, prefix caching on and off)."""

from __future__ import annotations

import pathlib
import random
from collections.abc import Callable
from typing import Any

import pytest

from cluster.protocol import SamplingParams
from tests.support.hf_models import ARCHS, hf_greedy, make_random_hf_model
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


@pytest.fixture(scope="module")
def references(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], Any]:
    """arch -> (checkpoint, prompts, transformers' greedy outputs), each built once per module.

    NOTE: a cache rather than a parametrized module fixture: in random test order (pytest-randomly)
    the parametrized fixture would be torn down and rebuilt at every change of architecture."""
    cache: dict[str, Any] = {}

    def get(arch: str) -> Any:
        if arch not in cache:
            cache[arch] = _build_reference(arch, tmp_path_factory.mktemp(f"hf-{arch}"))
        return cache[arch]

    return get


@pytest.fixture(params=ARCHS)
def model_and_reference(request: pytest.FixtureRequest, references: Callable[[str], Any]) -> Any:
    return references(request.param)


def _build_reference(arch: str, out_dir: pathlib.Path) -> Any:
    path = make_random_hf_model(arch, out_dir)
    prompts = make_prompts()
    reference = hf_greedy(path, prompts, list(MAX_TOKENS))
    # NOTE: a model that repeats a few tokens would make equality cheap. The references have 3-19
    # distinct tokens per output, at least 65% of each output's length on every architecture.
    for tokens in reference:
        assert 5 * len(set(tokens)) >= 3 * len(tokens), tokens
    return path, prompts, reference


def greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)


# NOTE: "plain" sizes its KV pool from memory (the default path); the others name a pool that holds every
# request at once (but block4_preempt's), which also spares allocating the default 1 GiB each time.
SETTINGS: dict[str, dict[str, Any]] = {
    "plain": dict(block_size=16, enable_prefix_caching=False),
    "block1_chunked_mixed": dict(
        block_size=1, num_kv_blocks=1200, max_num_batched_tokens=48, enable_prefix_caching=False
    ),
    "block4_preempt": dict(block_size=4, num_kv_blocks=96, max_num_batched_tokens=128),
    "block16_prefix_cache": dict(
        block_size=16, num_kv_blocks=128, enable_prefix_caching=True, max_num_seqs=4
    ),
}


@pytest.mark.parametrize("setting", list(SETTINGS))
def test_greedy_equals_transformers(model_and_reference: Any, setting: str) -> None:
    path, prompts, reference = model_and_reference
    llm = LLM(str(path), device="cpu", **SETTINGS[setting])
    params = [greedy(m) for m in MAX_TOKENS]
    outs = llm.generate(prompts, params)
    assert [o.token_ids for o in outs] == reference
    assert all(o.finish_reason is not None and o.finish_reason.value == "length" for o in outs)
    stats = llm.stats()
    if setting == "block1_chunked_mixed":
        assert stats.num_mixed_steps > 0
    # only the small pool preempts: the others hold every request at once
    assert (stats.num_preemptions > 0) == (setting == "block4_preempt")
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
    llm = LLM(
        str(path),
        device="cpu",
        block_size=4,
        num_kv_blocks=256,
        enable_prefix_caching=True,
        max_num_batched_tokens=96,
    )
    assert [o.token_ids for o in llm.generate(family, greedy(6))] == ref
    assert [o.token_ids for o in llm.generate(family, greedy(6))] == ref
    assert llm.stats().prefix_cache_hits > 0
    llm.check_no_leaks()
