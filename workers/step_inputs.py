"""One step's inputs: host arrays built from the schedule with numpy, and their device tensors.

``build_step_arrays`` turns the scheduler's plain lists into the flat ragged batch (no per-token Python
loop); the model runner uploads the arrays (``StepInputs``). A token id < 0 is a placeholder for the
token the previous step is still sampling on the device (asynchronous scheduling): the runner fills it in
on the device before the forward (``placeholder_sources``).
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import numpy as np
import torch

from cluster.protocol import SamplingParams
from workers.attention import AttentionMetadata
from workers.scheduler import ScheduledRequest


@dataclass
class StepArrays:
    """One step's inputs as host numpy arrays (what ``build_step_arrays`` derives from the schedule)."""

    input_ids: np.ndarray  # [T] int64
    positions: np.ndarray  # [T] int64
    slots: np.ndarray  # [T] int64
    cu_q: np.ndarray  # [B + 1] int64
    seq_lens: np.ndarray  # [B] int64
    block_tables: np.ndarray  # [B, max blocks of the step] int32, padded with 0
    logits_indices: np.ndarray  # [N] int64: rows of the hidden states to sample from
    sample_rows: list[int]  # which sequences those N rows belong to
    max_query_len: int


def build_step_arrays(sched: list[ScheduledRequest], block_size: int) -> StepArrays:
    """Flat ragged batch of ``sched`` with numpy: no per-token Python loop."""
    num_seqs = len(sched)
    bs = block_size
    q_lens = np.fromiter((len(s.token_ids) for s in sched), np.int64, num_seqs)
    starts = np.fromiter((s.start_position for s in sched), np.int64, num_seqs)
    num_tokens = int(q_lens.sum())
    input_ids = np.fromiter(itertools.chain.from_iterable(s.token_ids for s in sched), np.int64, num_tokens)
    cu_q = np.zeros(num_seqs + 1, np.int64)
    np.cumsum(q_lens, out=cu_q[1:])
    seq_idx = np.repeat(np.arange(num_seqs), q_lens)
    positions = np.arange(num_tokens) - cu_q[seq_idx] + starts[seq_idx]
    seq_lens = starts + q_lens
    num_blocks = -(-seq_lens // bs)
    block_tables = np.zeros((num_seqs, int(num_blocks.max())), np.int32)
    # NOTE: one fromiter + one masked store instead of a numpy call per row (256 rows: ~0.3 ms saved)
    flat = np.fromiter(
        itertools.chain.from_iterable(
            s.block_ids[:n] for s, n in zip(sched, num_blocks.tolist(), strict=True)
        ),
        np.int32,
        int(num_blocks.sum()),
    )
    block_tables[np.arange(block_tables.shape[1]) < num_blocks[:, None]] = flat
    slots = block_tables[seq_idx, positions // bs].astype(np.int64) * bs + positions % bs
    sample_rows = [i for i, s in enumerate(sched) if s.needs_sample]
    logits_indices = cu_q[1:][sample_rows] - 1
    return StepArrays(
        input_ids,
        positions,
        slots,
        cu_q,
        seq_lens,
        block_tables,
        logits_indices,
        sample_rows,
        int(q_lens.max()),
    )


@dataclass
class StepInputs:
    input_ids: torch.Tensor
    positions: torch.Tensor
    meta: AttentionMetadata | None  # None: a captured decode graph runs the step (it owns its metadata)
    logits_indices: torch.Tensor  # rows of the hidden states to sample from
    sample_ids: list[str]
    sample_params: list[SamplingParams]
    sample_num_outputs: list[int]
    graph_size: int | None = None  # the captured batch size this step is padded to


def placeholder_sources(
    arrays: StepArrays, sched: list[ScheduledRequest], last_rows: dict[str, int]
) -> tuple[np.ndarray, np.ndarray]:
    """(token positions in the batch, rows of the previous step's sampled tokens) of every placeholder.

    Raises RuntimeError when a placeholder's request sampled nothing in the previous step."""
    token_idx = np.flatnonzero(arrays.input_ids < 0)
    seqs = np.searchsorted(arrays.cu_q, token_idx, side="right") - 1
    try:
        rows = np.fromiter((last_rows[sched[i].request_id] for i in seqs.tolist()), np.int64, len(seqs))
    except KeyError as e:
        raise RuntimeError(f"placeholder token of {e} has no token sampled in the previous step") from e
    return token_idx, rows
