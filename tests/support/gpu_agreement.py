"""How two runs of the same model are compared when one of them cannot be exact (bf16, another kernel).

Two measures, both against a float32 reference run that returns its top-2 logprobs:

- **logit tolerance**: on every step where the two runs chose the same token, the chosen token's logprob
  differs by at most ``tol``;
- **per-token divergence**: a sequence is compared token by token up to its first divergence (after it
  the two runs continue different texts). A divergence is allowed only to a token the reference ranked
  within ``2 * tol`` of its top (two logits can swap order only when each moves by up to ``tol``; a
  random-weight model often has three or more such tokens, so the reference returns its top 5). So the number of divergences is at most
  the number of near-tie steps compared, and the divergence rate is reported per compared token.

``step_logits_by_schedule`` gives a step's logits in the scheduler's order of requests: a backend may
reorder a step's sequences (the torch backend sorts decodes by length), so rows are matched by request id.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from cluster.protocol import RequestOutput
from workers.model_runner import ModelRunner
from workers.scheduler import SchedulerOutput

# NOTE: why these bf16 bounds: bf16 keeps 8 significand bits, so each rounding of a value near 8 moves it by
# up to 1/32, and the residual stream is rounded once per layer. Measured on CPU (torch backend, bf16 against
# float32, the random test models of tests/support/hf_models.py, 8 prompts, ~100 agreeing tokens each):
# largest error 0.43 / 0.14 / 0.04 nats and mean 0.073 / 0.027 / 0.012 for llama / qwen3 / gemma2. The bounds
# sit above those; a wrong kernel (a wrong block, mask or scale) moves logprobs by whole nats.
BF16_LOGPROB_TOL = 0.5  # largest error on one agreeing token
BF16_MEAN_LOGPROB_TOL = 0.1  # mean error over the agreeing tokens


@dataclass
class Agreement:
    """Greedy agreement of a run with its float32 reference (see the module docstring)."""

    num_compared: int = 0  # tokens compared, each sequence up to and including its first divergence
    num_diverged: int = 0
    num_near_ties: int = 0  # compared steps where the reference's top-2 gap was under 2 * tol
    max_logprob_error: float = 0.0  # over the agreeing steps
    sum_logprob_error: float = 0.0
    num_agreeing: int = 0
    violations: list[str] = field(default_factory=list)  # divergences the tolerance cannot explain

    @property
    def mean_logprob_error(self) -> float:
        return self.sum_logprob_error / max(1, self.num_agreeing)

    @property
    def divergence_rate(self) -> float:
        return self.num_diverged / max(1, self.num_compared)

    def check(self, tol: float, mean_tol: float) -> None:
        """Every divergence at a reference near-tie, every agreeing logprob within ``tol`` and their mean
        within ``mean_tol``."""
        assert not self.violations, self.violations
        assert self.max_logprob_error <= tol, (self.max_logprob_error, tol)
        assert self.mean_logprob_error <= mean_tol, (self.mean_logprob_error, mean_tol)
        assert self.num_diverged <= self.num_near_ties, self


def greedy_agreement(ref: Sequence[RequestOutput], got: Sequence[RequestOutput], tol: float) -> Agreement:
    """``ref``: float32 run with ``logprobs >= 2`` (5 in the tests); ``got``: the run under test with ``logprobs >= 1``."""
    a = Agreement()
    for r, (ref_out, got_out) in enumerate(zip(ref, got, strict=True)):
        assert ref_out.logprobs is not None and got_out.logprobs is not None, "both runs need logprobs"
        for i, (want, have) in enumerate(zip(ref_out.token_ids, got_out.token_ids, strict=True)):
            top = ref_out.logprobs[i]
            gap = top.top_logprobs[0] - top.top_logprobs[1]
            a.num_compared += 1
            a.num_near_ties += gap < 2 * tol
            if want == have:
                error = abs(got_out.logprobs[i].logprob - top.logprob)
                a.max_logprob_error = max(a.max_logprob_error, error)
                a.sum_logprob_error += error
                a.num_agreeing += 1
                continue
            a.num_diverged += 1
            if have not in top.top_token_ids:
                a.violations.append(
                    f"seq {r} step {i}: {have} is not in the reference's top {len(top.top_token_ids)}"
                )
            elif (gap_to := top.top_logprobs[0] - top.top_logprobs[top.top_token_ids.index(have)]) >= 2 * tol:
                a.violations.append(
                    f"seq {r} step {i}: {have} is {gap_to:.3f} under the top >= 2 * {tol}: not a near-tie"
                )
            break
    return a


def step_logits_by_schedule(runner: ModelRunner, out: SchedulerOutput) -> torch.Tensor:
    """One step's logits, one row per sampled request in ``out.scheduled`` order."""
    inputs = runner.prepare_inputs(out)
    if inputs.meta is None:
        raise ValueError("a captured graph would run this step: build the runner with enforce_eager")
    with torch.inference_mode(), runner.forward_context(inputs.meta):
        hidden = runner.model(inputs.input_ids, inputs.positions)
        logits = runner.model.compute_logits(hidden[inputs.logits_indices])
    row_of = {request_id: row for row, request_id in enumerate(inputs.sample_ids)}
    order = [row_of[s.request_id] for s in out.scheduled if s.needs_sample]
    return logits[torch.tensor(order, device=logits.device)]
