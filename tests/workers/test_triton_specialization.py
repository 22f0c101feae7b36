"""No Triton recompilation inside a run: after a warm-up, steps of any shape reuse compiled variants.

Under ``TRITON_INTERPRET=1`` nothing compiles, so the test computes, for every launch, the key Triton's
JIT would look its compiled variant up by on an sm_90 GPU (``kernel_probe.specialization_key``) and
checks that, after the model runner's kernel warm-up, a run of mixed steps of many shapes (batch sizes,
prompt and chunk lengths, block-table widths, decode split counts, prefix hits, seeded top-p sampling)
meets no key the warm-up did not.
"""

from __future__ import annotations

import random

from cluster.protocol import SamplingParams
from workers.attention.kernel_probe import SpecializationLog, probe_launches
from workers.attention.triton_backend import TritonLaunchConfig
from workers.llm import LLM

# Tiny tiles: decode splits appear from 9 visible keys on, so split and unsplit steps both occur.
TINY = TritonLaunchConfig(
    prefill_block_m=16, prefill_block_n=16, decode_block_n=16, min_kv_per_split=8, target_programs=64
)


def _greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)


def test_mixed_steps_meet_no_new_variant_after_the_runners_warm_up() -> None:
    llm = LLM(
        attention_backend="triton", block_size=2, max_num_seqs=8, max_num_batched_tokens=24, num_kv_blocks=160
    )
    llm.engine.runner.backend.launch_config = TINY  # type: ignore[attr-defined]
    llm.engine.runner.sampler.use_triton = True  # the CUDA sampler's kernels (seeded noise, top-p race)
    rng = random.Random(0)
    vocab = llm.engine.vocab_size
    log = SpecializationLog()
    with probe_launches(log.hook):
        llm.engine.runner.warm_up_kernels()  # what the runner runs at start-up on CUDA
        warm = log.snapshot()
        warm_ints = {k: {p: set(v) for p, v in d.items()} for k, d in log.int_values.items()}
        num_warm_launches = log.num_launches

        prompts = [[rng.randrange(3, vocab) for _ in range(n)] for n in (1, 3, 14, 30, 9)]
        params = [_greedy(m) for m in (7, 2, 5, 4)]
        params.append(SamplingParams(max_tokens=3, temperature=0.8, top_p=0.9, seed=5, ignore_eos=True))
        outs = llm.generate(prompts, params)
        # Prompts extending a finished one: prefix-cache hits (extend steps over cached blocks).
        family = [prompts[3][:n] + [rng.randrange(3, vocab) for _ in range(5)] for n in (12, 24)]
        outs += llm.generate(family, _greedy(3))
        params += [_greedy(3)] * 2
    assert [len(o.token_ids) for o in outs] == [p.max_tokens for p in params]
    llm.check_no_leaks()
    assert llm.stats().num_mixed_steps > 0 and llm.stats().prefix_cache_hits > 0
    assert log.num_launches > 4 * num_warm_launches

    # The mixed run really varied the per-step integers, into values Triton would specialise on
    # (== 1, multiples of 16) that the warm-up never passed.
    decode = log.int_values["decode_kernel"]
    new_widths = decode["stride_bt"] - warm_ints["decode_kernel"]["stride_bt"]
    assert any(w == 1 or w % 16 == 0 for w in new_widths), sorted(decode["stride_bt"])
    assert len(decode["num_splits"]) >= 3, sorted(decode["num_splits"])
    assert len(log.int_values["prefill_kernel"]["first_seq"]) >= 4
    assert {"top_p_race_kernel", "seeded_noise_kernel", "rms_norm_kernel"} <= set(log.keys)
    assert log.new_since(warm) == {}
