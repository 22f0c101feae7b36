"""Prompt logprobs (``SamplingParams.prompt_logprobs``): each prompt token's logprob under the model's raw
logits at the position before it, with the top k there, as vLLM reports them.

The path of one request that asks for them:

- the scheduler names, in each of its prompt chunks, the rows that score the prompt
  (``PromptLogprobRows``: every row of the chunk, but the last one of the prompt, whose logits sample
  the first token); such a request takes no prefix-cache hit (a cached position has no logits);
- ``build_step_arrays`` turns them into row indices kept apart from the sampling rows; the runner
  gathers those rows' hidden states after the forward, and ``score_prompt_rows`` computes their float32
  logits (the model's final soft-cap included), log-softmax, the prompt token's logprob and the top k,
  all on the device, packed into one tensor copied to the host once;
- ``PromptLogprobsCopy.wait`` (when the step's sampled tokens are read) unpacks each chunk's entries;
  the engine hands them to their request (``Request.add_prompt_logprobs``), and the delta of the first
  token carries the whole list (on a prefill worker of a disaggregated pair, the delta that goes to the
  router with the handoff: the decode worker needs nothing).

A step with no such request pays nothing (no rows, no copy).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from cluster.protocol import TokenLogprobs
from workers.sampler import MIN_LOGPROB
from workers.scheduler import PromptLogprobRows
from workers.step_inputs import PromptRowInputs


@dataclass
class PromptLogprobsCopy:
    """The prompt logprobs of one step on their way to the host: ``host`` [P, 1 + 2K] float64 (each
    row's logprob, its top K ids, their logprobs), valid once ``done`` completed (None: on the host)."""

    host: torch.Tensor
    done: torch.cuda.Event | None
    chunks: list[PromptLogprobRows]
    num_top: int

    def wait(self) -> dict[str, tuple[int, list[TokenLogprobs]]]:
        """Request id -> (its chunk's start position, one entry per row of the chunk)."""
        if self.done is not None:
            self.done.synchronize()
        values = self.host.numpy()
        num_top = self.num_top
        scored: dict[str, tuple[int, list[TokenLogprobs]]] = {}
        row = 0
        for chunk in self.chunks:
            targets = chunk.target_ids
            k = min(chunk.num_top, num_top)
            part = values[row : row + len(targets)]
            row += len(targets)
            # NOTE: column by column (three tolist calls), not an int()/float() per value
            logprobs = part[:, 0].tolist()
            top_ids = part[:, 1 : 1 + k].astype("int64").tolist()
            top_logprobs = part[:, 1 + num_top : 1 + num_top + k].tolist()
            scored[chunk.request_id] = (
                chunk.start_position,
                [
                    TokenLogprobs(t, lp, ids, lps)
                    for t, lp, ids, lps in zip(targets, logprobs, top_ids, top_logprobs, strict=True)
                ],
            )
        return scored


def score_prompt_rows(
    hidden_rows: torch.Tensor,
    rows: PromptRowInputs,
    compute_logits: Callable[[torch.Tensor], torch.Tensor],
    max_rows_per_pass: int,
) -> PromptLogprobsCopy:
    """The prompt logprobs of ``hidden_rows`` (the hidden states of ``rows``, in order), enqueued with
    their copy to the host (non-blocking on CUDA, into pinned memory).

    ``compute_logits``: hidden states -> float32 logits (the sampler's). NOTE: at most
    ``max_rows_per_pass`` rows of logits at once (the runner passes ``max_num_seqs``, the rows its memory
    profile samples): a chunk of thousands of prompt rows would otherwise hold [rows, vocab] float32
    logits, gigabytes at a large vocabulary, beside the step's activations."""
    num_rows = hidden_rows.shape[0]
    num_top = rows.num_top
    packed = torch.empty(0)
    step = max(1, max_rows_per_pass)
    for start in range(0, num_rows, step):
        end = min(start + step, num_rows)
        logprobs = compute_logits(hidden_rows[start:end]).log_softmax(dim=-1)
        if start == 0:
            num_top = min(num_top, logprobs.shape[1])
            packed = torch.empty((num_rows, 1 + 2 * num_top), dtype=torch.float64, device=logprobs.device)
        targets = rows.target_ids[start:end].unsqueeze(1)
        packed[start:end, 0] = logprobs.gather(1, targets).squeeze(1)
        if num_top:
            top = logprobs.topk(num_top, dim=-1)
            packed[start:end, 1 : 1 + num_top] = top.indices
            packed[start:end, 1 + num_top :] = top.values
    # NOTE: a soft-capped or masked logit may be -inf; -inf is not JSON (reported as the sampler does)
    packed[:, 0].clamp_(min=MIN_LOGPROB)
    packed[:, 1 + num_top :].clamp_(min=MIN_LOGPROB)
    if packed.device.type == "cpu":
        return PromptLogprobsCopy(packed, None, rows.chunks, num_top)
    host = torch.empty(packed.shape, dtype=packed.dtype, pin_memory=True)
    host.copy_(packed, non_blocking=True)
    done = torch.cuda.Event()
    done.record()
    return PromptLogprobsCopy(host, done, rows.chunks, num_top)
