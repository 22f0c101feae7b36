"""End-to-end checks that need CUDA: Triton vs torch attention in bf16 at real shapes, CUDA graphs on vs
off with requests coming and going, KV sizing under gpu_memory_utilization, one host sync per step.

fp32 comparisons are exact. bf16 ones are stated the way they can hold (tests/support/gpu_agreement.py):
against a float32 reference, every agreeing step's logprob within BF16_LOGPROB_TOL and every divergence at
a reference near-tie, with the per-token divergence rate reported. Runs compiled: ``pytest -m gpu``.
"""

from __future__ import annotations

import gc
import pathlib
import random
import warnings
from typing import Any

import pytest
import torch

from cluster.config import EngineConfig, ModelConfig
from cluster.protocol import SamplingParams
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

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

REPO = pathlib.Path(__file__).resolve().parents[2]
GREEDY = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)


def _free() -> None:
    gc.collect()
    torch.cuda.empty_cache()


def _prompts(num: int, vocab: int, seed: int, max_len: int = 300) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(rng.randrange(1, max_len))] for _ in range(num)]


@pytest.mark.parametrize("shape", ["gemma-2-2b", "qwen3-0.6b"])
def test_triton_matches_torch_logits_bf16_real_shapes(shape: str) -> None:
    """Prefill (ragged, 3 prompts) then one decode step: logits of both backends within bf16 tolerance."""
    logits: dict[str, list[torch.Tensor]] = {}
    prompts = _prompts(3, 1000, seed=1, max_len=600)
    for backend in ("torch", "triton"):
        config = EngineConfig(
            model=ModelConfig(path=str(REPO / "bench/configs" / shape), dtype="bfloat16", max_model_len=1024),
            device="cuda", num_kv_blocks=256, attention_backend=backend, load_format="dummy", enforce_eager=True,
        )  # fmt: skip
        runner = ModelRunner(config, config.model.path)
        tables, next_block = [], 1
        for p in prompts:
            n = -(-(len(p) + 1) // 16)
            tables.append(list(range(next_block, next_block + n)))
            next_block += n
        prefill = [
            ScheduledRequest(f"r{i}", p, 0, t, True, False, GREEDY, 0)
            for i, (p, t) in enumerate(zip(prompts, tables, strict=True))
        ]
        decode = [
            ScheduledRequest(f"r{i}", [7 + i], len(p), t, True, True, GREEDY, 1)
            for i, (p, t) in enumerate(zip(prompts, tables, strict=True))
        ]
        logits[backend] = [
            step_logits_by_schedule(runner, SchedulerOutput(prefill, sum(len(p) for p in prompts))),
            step_logits_by_schedule(runner, SchedulerOutput(decode, len(decode))),
        ]
        del runner
        _free()
    for ref, got in zip(logits["torch"], logits["triton"], strict=True):
        scale = float(ref.abs().max())
        # NOTE: a few bf16 ulps of the logit scale: 26-28 layers of one-ulp hidden-state differences.
        torch.testing.assert_close(got, ref, rtol=0.0, atol=0.03 * scale)
        assert float((got - ref).abs().mean()) < 0.003 * scale


@pytest.mark.parametrize("arch", ["llama", "qwen3", "gemma2"])
def test_triton_matches_torch_greedy(arch: str, tmp_path: pathlib.Path) -> None:
    path = str(make_random_hf_model(arch, tmp_path))
    prompts = _prompts(12, 512, seed=2)
    max_tokens = [random.Random(i).randrange(8, 40) for i in range(12)]
    # fp32: exact (the Triton kernels use IEEE dots for fp32).
    fp32 = {}
    for backend in ("torch", "triton"):
        llm = LLM(
            path, device="cuda", dtype="float32", attention_backend=backend, max_num_seqs=8, num_kv_blocks=512
        )
        params = [SamplingParams(max_tokens=m, temperature=0.0, ignore_eos=True) for m in max_tokens]
        fp32[backend] = [o.token_ids for o in llm.generate(prompts, params)]
        llm.check_no_leaks()
        del llm
    assert fp32["triton"] == fp32["torch"]
    # bf16, both backends, each against the float32 torch reference (which returns its top-2 logprobs).
    ref = LLM(path, device="cuda", dtype="float32", attention_backend="torch", num_kv_blocks=512).generate(
        prompts,
        [SamplingParams(max_tokens=m, temperature=0.0, ignore_eos=True, logprobs=5) for m in max_tokens],
    )
    for backend in ("torch", "triton"):
        got = LLM(
            path, device="cuda", dtype="bfloat16", attention_backend=backend, num_kv_blocks=512
        ).generate(
            prompts,
            [SamplingParams(max_tokens=m, temperature=0.0, ignore_eos=True, logprobs=1) for m in max_tokens],
        )
        agreement = greedy_agreement(ref, got, BF16_LOGPROB_TOL)
        print(f"{arch} bf16 {backend}: {agreement}, divergence rate {agreement.divergence_rate:.4f}/token")
        agreement.check(BF16_LOGPROB_TOL, BF16_MEAN_LOGPROB_TOL)
    _free()


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_cuda_graphs_match_eager(dtype: str, tmp_path: pathlib.Path) -> None:
    """30 requests through 8 seats: decode batches of every size 1..8 come and go; graphs exist for
    1, 2, 4, 6 (5 pads to 6, 3 to 4; 7 and 8 run eagerly)."""
    path = str(make_random_hf_model("gemma2", tmp_path))
    prompts = _prompts(30, 512, seed=3, max_len=200)
    max_tokens = [random.Random(100 + i).randrange(1, 60) for i in range(30)]
    options: dict[str, Any] = dict(
        device="cuda", dtype=dtype, attention_backend="triton", max_num_seqs=8, cuda_graph_max_batch_size=6,
        num_kv_blocks=400, block_size=16, max_num_batched_tokens=256,
    )  # fmt: skip
    params = [SamplingParams(max_tokens=m, temperature=0.0, ignore_eos=True, logprobs=5) for m in max_tokens]
    eager = LLM(path, enforce_eager=True, **options).generate(prompts, params)
    graphed_llm = LLM(path, **options)
    runner = graphed_llm.engine.runner
    assert runner.graphs is not None and runner.graph_sizes == [1, 2, 4, 6]
    replays: list[int] = []
    replay = runner.graphs.replay

    def counting_replay(graph_size: int) -> torch.Tensor:
        replays.append(graph_size)
        return replay(graph_size)

    runner.graphs.replay = counting_replay  # type: ignore[method-assign]
    graphed = graphed_llm.generate(prompts, params)
    graphed_llm.check_no_leaks()
    assert {1, 2, 4, 6} <= set(replays)
    if dtype == "float32":
        assert [o.token_ids for o in graphed] == [o.token_ids for o in eager]
    else:
        # NOTE: graphed decodes size split-K from max_model_len, eager ones from the actual length: bf16
        # sums in another order, so both are held to the float32 reference instead of to each other.
        ref = LLM(path, enforce_eager=True, **{**options, "dtype": "float32"}).generate(prompts, params)
        for name, run in (("eager", eager), ("graphed", graphed)):
            agreement = greedy_agreement(ref, run, BF16_LOGPROB_TOL)
            print(f"bf16 {name}: {agreement}, divergence rate {agreement.divergence_rate:.4f}/token")
            agreement.check(BF16_LOGPROB_TOL, BF16_MEAN_LOGPROB_TOL)
    _free()


def test_one_host_sync_per_step(tmp_path: pathlib.Path) -> None:
    path = str(make_random_hf_model("llama", tmp_path))
    llm = LLM(path, device="cuda", attention_backend="triton", max_num_seqs=8, num_kv_blocks=256)
    engine = llm.engine
    for i, prompt in enumerate(_prompts(6, 512, seed=4)):
        engine.add_request(f"r{i}", prompt, SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True))
    engine.step()  # the prefill step (first Triton launches) is not counted
    torch.cuda.set_sync_debug_mode("warn")
    try:
        for _ in range(10):
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                engine.step()
            syncs = [w for w in caught if "synchroniz" in str(w.message)]
            assert len(syncs) <= 1, [str(w.message) for w in syncs]
    finally:
        torch.cuda.set_sync_debug_mode("default")
    while engine.has_unfinished():
        engine.step()
    engine.check_no_leaks()


def test_kv_sizing_respects_gpu_memory_utilization() -> None:
    """Gemma-2-2B shapes (bf16 dummy weights, graphs on): blocks grow with the utilization by about
    the added memory, and after a run the device use stays under utilization x total."""
    total = torch.cuda.mem_get_info()[1]
    blocks: dict[float, int] = {}
    for util in (0.2, 0.3):
        _free()
        llm = LLM(
            str(REPO / "bench/configs/gemma-2-2b"), load_format="dummy", dtype="bfloat16", device="cuda",
            attention_backend="triton", gpu_memory_utilization=util, max_num_seqs=32, max_model_len=2048,
        )  # fmt: skip
        runner = llm.engine.runner
        assert runner.num_blocks > 1
        blocks[util] = runner.num_blocks
        prompts = _prompts(40, 1000, seed=5, max_len=1500)
        llm.generate(
            prompts, SamplingParams(max_tokens=8, temperature=0.8, top_p=0.9, logprobs=3, ignore_eos=True)
        )
        torch.cuda.synchronize()
        free = torch.cuda.mem_get_info()[0]
        assert total - free <= util * total + (256 << 20), (total - free) / total
        bytes_per_block = runner.bytes_per_block
        del llm, runner
    expected = 0.1 * total / bytes_per_block
    assert abs((blocks[0.3] - blocks[0.2]) - expected) < 0.05 * expected


def test_no_triton_compilation_after_the_runners_warm_up(tmp_path: pathlib.Path) -> None:
    """The runner's start-up warm-up compiles every variant: a run of mixed steps of many shapes (graphs
    on, eager mixed steps, split and unsplit decodes, sampling with seeds) compiles nothing more."""
    from workers.attention.kernel_probe import count_compiled_variants

    path = str(make_random_hf_model("gemma2", tmp_path))
    llm = LLM(path, device="cuda", dtype="bfloat16", attention_backend="triton", max_num_seqs=16,
              cuda_graph_max_batch_size=8, num_kv_blocks=512, max_num_batched_tokens=128)  # fmt: skip
    before = count_compiled_variants()
    assert before > 0
    prompts = _prompts(40, 512, seed=6, max_len=400)
    params = [
        SamplingParams(max_tokens=random.Random(i).randrange(1, 40), temperature=0.8 * (i % 2), top_p=0.9,
                       top_k=20 * (i % 3), seed=i if i % 4 == 0 else None, ignore_eos=True)
        for i in range(40)
    ]  # fmt: skip
    llm.generate(prompts, params)
    llm.check_no_leaks()
    assert count_compiled_variants() == before


@pytest.mark.parametrize("enforce_eager", [False, True])
def test_async_scheduling_matches_sync(enforce_eager: bool, tmp_path: pathlib.Path) -> None:
    """fp32, Triton: asynchronous scheduling (placeholder tokens filled on the device, graph replays
    included) gives exactly the synchronous engine's tokens, greedy and seeded, with EOS stops."""
    path = str(make_random_hf_model("llama", tmp_path))
    prompts = _prompts(24, 512, seed=7, max_len=200)
    params = [
        SamplingParams(max_tokens=random.Random(200 + i).randrange(1, 50), temperature=0.9 * (i % 2),
                       top_p=0.95, seed=i, ignore_eos=i % 3 != 0)
        for i in range(24)
    ]  # fmt: skip
    outs = {}
    for is_async in (False, True):
        llm = LLM(path, device="cuda", dtype="float32", attention_backend="triton", max_num_seqs=8,
                  num_kv_blocks=512, enforce_eager=enforce_eager, async_scheduling=is_async)  # fmt: skip
        outs[is_async] = [(o.token_ids, o.finish_reason) for o in llm.generate(prompts, params)]
        llm.check_no_leaks()
        del llm
        _free()
    assert outs[True] == outs[False]


def test_sampling_kernels_on_cuda() -> None:
    """The Triton top-p race equals the torch rounds on CUDA; seeded noise rows do not depend on the batch."""
    from workers.sampler import _MIN_NOISE, top_p_race_torch
    from workers.sampling_kernels import seeded_noise, top_p_race

    gen = torch.Generator(device="cuda").manual_seed(0)
    logits = torch.randn(64, 32000, device="cuda", generator=gen) * 3.0
    probs = logits.softmax(dim=-1)
    noise = torch.empty_like(probs).exponential_(generator=gen)
    top_p = torch.tensor([0.5, 0.9, 0.99, float("inf")] * 16, device="cuda")
    assert torch.equal(top_p_race(probs, noise, top_p, _MIN_NOISE), top_p_race_torch(probs, noise, top_p))

    def noise_rows(seeds: list[int], draws: list[int]) -> torch.Tensor:
        out = torch.empty(len(seeds), 32000, device="cuda")
        as_tensor = lambda v: torch.tensor(v, device="cuda")  # noqa: E731
        seeded_noise(out, as_tensor(list(range(len(seeds)))), as_tensor(seeds), as_tensor(draws))
        return out

    assert torch.equal(noise_rows([5], [9])[0], noise_rows([1, 5, 2], [0, 9, 9])[1])
