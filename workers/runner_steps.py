"""What the model runner hands back: a step whose forward is enqueued (``ForwardStep``) and a launched
step whose sampled tokens are still on the way (``PendingStep``)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from cluster.protocol import SamplingParams
from workers.prompt_logprobs import PromptLogprobsCopy
from workers.sampler import HostCopy
from workers.scheduler import SampledTokens
from workers.step_inputs import StepInputs


@dataclass
class ForwardStep:
    """A step whose forward is enqueued and whose sampling is not (``ModelRunner.sample`` finishes it).
    hidden_rows: the hidden states of the rows to sample (None: the step samples nothing); prompt_rows:
    those of the rows that score prompt tokens (None: none). Under tensor parallelism both hold the LM
    head's gathered output for those rows instead (``parallel_steps.head_rows``)."""

    inputs: StepInputs
    hidden_rows: torch.Tensor | None
    events: tuple[torch.cuda.Event, torch.cuda.Event] | None
    prompt_rows: torch.Tensor | None = None

    @property
    def sample_ids(self) -> list[str]:
        return self.inputs.sample_ids


@dataclass
class PendingStep:
    """A launched step; ``result()`` waits for its sampled tokens (the step's one device sync) and its
    prompt logprobs (``prompt_copy``: a second copy, only in a step that scores prompt tokens)."""

    sample_ids: list[str]
    sample_params: list[SamplingParams]
    copy: HostCopy | None
    prompt_copy: PromptLogprobsCopy | None = None

    def result(self) -> SampledTokens:
        if self.copy is None:
            sampled = SampledTokens({})
        else:
            token_ids, logprobs = self.copy.wait(self.sample_params)
            ids = self.sample_ids
            sampled = SampledTokens(dict(zip(ids, token_ids, strict=True)))
            if self.copy.has_logprobs:
                sampled.logprobs = {r: lp for r, lp in zip(ids, logprobs, strict=True) if lp is not None}
        if self.prompt_copy is not None:
            sampled.prompt_logprobs = self.prompt_copy.wait()
        return sampled
