"""Engine behaviour beyond greedy equality: input validation, seeded sampling, logprobs, stops."""

from __future__ import annotations

import json
import os
import pathlib
import shutil

import pytest
import torch

from cluster.protocol import FinishReason, SamplingParams
from tests.support.hf_models import make_random_hf_model
from workers.llm import LLM


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> pathlib.Path:
    return make_random_hf_model("llama", tmp_path_factory.mktemp("engine"))


@pytest.fixture(scope="module")
def llm(model_dir: pathlib.Path) -> LLM:
    return LLM(str(model_dir), device="cpu", block_size=4, num_kv_blocks=256, max_model_len=256)


PROMPTS = [[5, 9, 33, 2, 100], list(range(3, 40)), [7] * 12, [300, 301, 302]]


@pytest.mark.parametrize(
    ("prompt", "params", "message"),
    [
        ([], SamplingParams(), "prompt must contain at least 1 token"),
        ([1, 2, 512], SamplingParams(), r"prompt token id 512 is outside the vocabulary \[0, 512\)"),
        ([-1], SamplingParams(), r"prompt token id -1 is outside the vocabulary \[0, 512\)"),
        (
            [1] * 250,
            SamplingParams(max_tokens=10),
            r"\+ max_tokens \(10\) = 260 exceeds max_model_len \(256\)",
        ),
        ([1], SamplingParams(max_tokens=0), "max_tokens must be an integer >= 1, got 0"),
        ([1], SamplingParams(temperature=-0.5), "temperature must be >= 0, got -0.5"),
        ([1], SamplingParams(top_p=0.0), r"top_p must be in \(0, 1\], got 0.0"),
        ([1], SamplingParams(top_p=1.5), r"top_p must be in \(0, 1\], got 1.5"),
        ([1], SamplingParams(top_k=-2), "top_k must be -1, 0"),
        ([1], SamplingParams(min_p=2.0), r"min_p must be in \[0, 1\], got 2.0"),
        ([1], SamplingParams(stop_token_ids=[999]), r"stop_token_ids entries must be in \[0, 512\), got 999"),
        ([1], SamplingParams(logprobs=50), r"logprobs must be in \[0, 20\], got 50"),
    ],
)
def test_bad_input_is_rejected_and_nothing_is_queued(
    llm: LLM, prompt: list[int], params: SamplingParams, message: str
) -> None:
    good = SamplingParams(max_tokens=3, temperature=0.0)
    with pytest.raises(ValueError, match=message):
        llm.generate([PROMPTS[0], prompt], [good, params])
    assert not llm.engine.has_unfinished()
    llm.check_no_leaks()
    # the engine keeps serving
    out = llm.generate([PROMPTS[0]], good)[0]
    assert len(out.token_ids) == 3 and out.finish_reason == FinishReason.LENGTH
    llm.check_no_leaks()


def test_seeded_sampling_is_independent_of_batch_and_preemption(model_dir: pathlib.Path) -> None:
    seeded = SamplingParams(max_tokens=24, temperature=0.9, top_p=0.95, top_k=50, seed=7, ignore_eos=True)
    alone = (
        LLM(str(model_dir), device="cpu", block_size=4, num_kv_blocks=64)
        .generate([PROMPTS[1]], seeded)[0]
        .token_ids
    )
    assert len(set(alone)) > 4  # really sampling

    others = [
        SamplingParams(max_tokens=30, temperature=1.0, seed=1, ignore_eos=True),
        SamplingParams(max_tokens=20, temperature=1.2, ignore_eos=True),  # unseeded: default generator
        SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True),
    ]
    # other requests before and after it, a small budget (chunking, mixed steps), then a pool so
    # small that requests get preempted and recomputed
    for options in (
        dict(block_size=4, num_kv_blocks=64),
        dict(block_size=1, num_kv_blocks=256, max_num_batched_tokens=16),
        dict(block_size=4, num_kv_blocks=24),
    ):
        llm = LLM(str(model_dir), device="cpu", **options)  # type: ignore[arg-type]
        outs = llm.generate(
            [PROMPTS[0], PROMPTS[2], PROMPTS[1], PROMPTS[3]], [others[0], others[1], seeded, others[2]]
        )
        assert outs[2].token_ids == alone, options
        # only the 24-block pool is small enough to preempt
        assert (llm.stats().num_preemptions > 0) == (options["num_kv_blocks"] == 24)
        llm.check_no_leaks()

    other_seed = SamplingParams(**{**seeded.__dict__, "seed": 8})
    assert (
        LLM(str(model_dir), device="cpu", block_size=4, num_kv_blocks=64)
        .generate([PROMPTS[1]], other_seed)[0]
        .token_ids
        != alone
    )


def test_top_k_1_equals_transformers_greedy(model_dir: pathlib.Path, llm: LLM) -> None:
    from tests.support.hf_models import hf_greedy

    reference = hf_greedy(model_dir, PROMPTS, [12] * len(PROMPTS))
    top1 = llm.generate(PROMPTS, SamplingParams(max_tokens=12, temperature=1.3, top_k=1, ignore_eos=True))
    assert [o.token_ids for o in top1] == reference
    # and the hot temperature does sample when top-k lets it (the guard against a no-op test)
    hot = llm.generate(PROMPTS, SamplingParams(max_tokens=12, temperature=1.3, seed=0, ignore_eos=True))
    assert [o.token_ids for o in hot] != reference


def test_logprobs_match_log_softmax_of_reference_logits(model_dir: pathlib.Path, llm: LLM) -> None:
    import transformers

    hf = transformers.AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    params = SamplingParams(max_tokens=6, temperature=0.0, logprobs=3, ignore_eos=True)
    for prompt, out in zip(PROMPTS, llm.generate(PROMPTS, params), strict=True):
        assert out.logprobs is not None and len(out.logprobs) == 6
        with torch.no_grad():
            logits = hf(torch.tensor([prompt + out.token_ids])).logits[0]
        ref = torch.log_softmax(logits.float(), dim=-1)
        for i, lp in enumerate(out.logprobs):
            row = ref[len(prompt) - 1 + i]
            assert lp.token_id == out.token_ids[i]
            assert lp.logprob == pytest.approx(row[lp.token_id].item(), abs=1e-4)
            top = torch.topk(row, 3)
            assert lp.top_token_ids == top.indices.tolist()
            assert lp.top_logprobs == pytest.approx(top.values.tolist(), abs=1e-4)


def test_eos_and_stop_token_ids_end_requests(
    model_dir: pathlib.Path, tmp_path: pathlib.Path, llm: LLM
) -> None:
    free = llm.generate([PROMPTS[1]], SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True))[
        0
    ].token_ids
    stop_at = free[3]
    cut = free.index(stop_at) + 1
    out = llm.generate(
        [PROMPTS[1]], SamplingParams(max_tokens=10, temperature=0.0, stop_token_ids=[stop_at])
    )[0]
    assert (out.token_ids, out.finish_reason) == (free[:cut], FinishReason.STOP)

    # the same token as the model's EOS: stops, unless ignore_eos
    eos_dir = tmp_path / "eos"
    shutil.copytree(model_dir, eos_dir)
    config = json.loads((eos_dir / "config.json").read_text())
    config["eos_token_id"] = stop_at
    (eos_dir / "config.json").write_text(json.dumps(config))
    (eos_dir / "generation_config.json").unlink(missing_ok=True)
    eos_llm = LLM(str(eos_dir), device="cpu", block_size=4, num_kv_blocks=64)
    out = eos_llm.generate([PROMPTS[1]], SamplingParams(max_tokens=10, temperature=0.0))[0]
    assert (out.token_ids, out.finish_reason) == (free[:cut], FinishReason.STOP)
    out = eos_llm.generate([PROMPTS[1]], SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True))[0]
    assert (out.token_ids, out.finish_reason) == (free, FinishReason.LENGTH)
    eos_llm.check_no_leaks()


def test_stop_strings_are_trimmed_with_the_bundled_model() -> None:
    llm = LLM(device="cpu", block_size=8, num_kv_blocks=64)
    free = llm.generate(
        ["Once upon a time"], SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    )[0]
    words = free.text.split()
    stop = " " + words[len(words) // 2]  # a word from the middle of the greedy text
    out = llm.generate(["Once upon a time"], SamplingParams(max_tokens=40, temperature=0.0, stop=[stop]))[0]
    assert out.finish_reason == FinishReason.STOP
    assert out.text == free.text[: free.text.index(stop)]
    assert out.token_ids == free.token_ids[: len(out.token_ids)]
    llm.check_no_leaks()


@pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET") != "1",
    reason="Triton runs on CPU tensors only in its interpreter (set when CUDA is absent); test_gpu.py covers CUDA",
)
def test_triton_backend_end_to_end_equals_transformers_on_bundled_model() -> None:
    """The Triton kernels (interpreter on CPU) drive a whole greedy run, token for token equal to HF."""
    from tests.support.hf_models import hf_greedy
    from workers.engine import BUNDLED_MODEL

    llm = LLM(
        device="cpu", attention_backend="triton", block_size=16, num_kv_blocks=32, max_num_batched_tokens=8
    )
    tok = llm.tokenizer
    prompts = [
        tok.encode(p) for p in ("Once upon a time", 'Tom said, "Do you want to', "A cow says moo. A duck")
    ]
    ref = hf_greedy(BUNDLED_MODEL, prompts, [6, 5, 4])
    params = [SamplingParams(max_tokens=m, temperature=0.0, ignore_eos=True) for m in (6, 5, 4)]
    assert [o.token_ids for o in llm.generate(prompts, params)] == ref
    assert llm.stats().num_mixed_steps > 0  # chunked prompts ran beside decodes in one forward
    llm.check_no_leaks()


def test_the_cpu_warm_up_prefill_leaves_no_trace() -> None:
    """The start-up forward of a full-budget prompt (ModelRunner.warm_up_largest_prefill) writes nothing
    to the KV cache and leaves no per-request state."""
    llm = LLM(device="cpu", block_size=4, max_num_batched_tokens=64)
    runner = llm.engine.runner
    assert int(torch.count_nonzero(runner.kv_cache)) == 0
    assert not runner.generators and runner.block_tables.num_requests == 0
    llm.engine.check_no_leaks()
