"""The loads of the probe's phases (``pdserve plan calibrate --probe``; deploy/plan/probe.py runs them):
idle prompts of four lengths, decode batches, bursts of short requests and of prompts, many short
streams (a handoff every few steps), long prompts prefilled beside two streams, and what a decode
phase's steps are in the step model's terms (``step_ratio``)."""

from __future__ import annotations

from cluster.cost_model import CostProfile, shape_of
from deploy.loadgen import Scenario
from deploy.plan.harness import EngineTotals

DECODE_PROMPT = 256  # the decode probe's prompts: contexts like the benchmark scenarios
IDLE_PROMPT_LENS = (16, 256, 1024, 1792)  # the idle prefills: each prompt alone, four of each length
DECODE_BATCHES = (8, 32)  # the decode phases' batches (at most max_num_seqs)
LIGHT_BATCH, LIGHT_WAVES = 2, 8  # the probe's light decode batch: 16 requests, 2 at a time
# the probe's bursts: short requests sent at once, a few and many (smoke and long_decode send 4 and 8 at
# once, batch_pressure 64)
BURSTS = (Scenario(8, (16, 16), (2, 2)), Scenario(32, (16, 16), (2, 2)))
# bursts of prompts like batch_pressure's (64-256 tokens, 64 at once) and stress's (64-512, all at once)
# for the prefill fit: steps full of prompts, each prompt's handoff leaving beside the next ones' step
PREFILL_BURSTS = (
    Scenario(24, (128, 192), (2, 2)),
    Scenario(48, (64, 256), (2, 2)),
    Scenario(32, (64, 512), (2, 2)),
)
# two streams at a time whose successors' long prompts prefill beside them: the delivery jitter of a
# step that runs while another worker computes (CostProfile.delivery_jitter_contended_s)
BESIDE_PREFILLS = Scenario(16, (1024, 1024), (48, 48), max_concurrency=2)


def idle_scenario(prompt_len: int) -> Scenario:
    return Scenario(4, (prompt_len, prompt_len), (2, 2), max_concurrency=1)


def decode_scenario(batch: int, waves: int = 1) -> Scenario:
    return Scenario(batch * waves, (DECODE_PROMPT, DECODE_PROMPT), (96, 96), max_concurrency=batch)


def handoff_scenario(batch: int) -> Scenario:
    return Scenario(16 * batch, (DECODE_PROMPT, DECODE_PROMPT), (16, 16), max_concurrency=batch)


def prefill_load_scenario() -> Scenario:
    """The contended phase's prefill load: prompts like the scenarios' (256 tokens), two at a time."""
    return Scenario(96, (DECODE_PROMPT, DECODE_PROMPT), (2, 2), max_concurrency=2)


def step_ratio(profile: CostProfile, ran: EngineTotals) -> float:
    """Measured seconds per decode step over the model's, at the mean batch that ran (nearly every step
    decodes the whole batch, at about prompt + 48 tokens of context)."""
    batch = max(1, round(ran.num_generated / max(1, ran.num_steps)))
    shape = shape_of([(DECODE_PROMPT + 48, 1, True)] * batch)
    return ran.seconds / max(1, ran.num_steps) / profile.step.step_s(shape)
