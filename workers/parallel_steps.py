"""How rank 0 of a tensor-parallel worker hands each step to its other ranks.

Rank 0 schedules and prepares a step as at one rank, then broadcasts it: a fixed-size header on the host
group (the op and the sizes), then every input the forward and the LM head need as one packed int64
tensor on the device group (token ids after asynchronous scheduling's placeholders were filled in on the
device, positions, slots, the attention metadata, the rows to sample and to score). No pickle, no
per-request loop: two broadcasts a step. The other ranks (``ModelRunner.follow``) unpack it into the same
``AttentionMetadata`` and run the same forward, whose all-reduces and LM-head gather meet rank 0's.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import ClassVar

import torch

from workers.attention import AttentionMetadata
from workers.host_tier import KvCopies
from workers.models.layers import CausalLM
from workers.models.parallel import TensorParallel
from workers.parallel_kv import KvRelay
from workers.step_inputs import StepInputs


@dataclass(frozen=True)
class StepHeader:
    """What the other ranks must know of a step before its packed inputs arrive (int64 fields)."""

    STEP: ClassVar[int] = 1
    STOP: ClassVar[int] = 2
    SIZE: ClassVar[int] = 11

    op: int
    num_tokens: int = 0
    num_seqs: int = 0
    width: int = 0
    num_sample: int = 0
    num_prompt: int = 0
    num_decodes: int = 0
    max_query_len: int = 0
    max_seq_len: int = 0
    num_offloads: int = 0  # copies between the tiers before the forward (workers/host_tier.py)
    num_loads: int = 0

    def pack(self) -> torch.Tensor:
        return torch.tensor(dataclasses.astuple(self), dtype=torch.int64)

    @classmethod
    def unpack(cls, header: torch.Tensor) -> StepHeader:
        return cls(*header.tolist())


@dataclass(frozen=True)
class FollowedStep:
    """A step as another rank receives it: the forward's inputs and the LM head's rows."""

    input_ids: torch.Tensor
    positions: torch.Tensor
    meta: AttentionMetadata
    sample_idx: torch.Tensor | None
    prompt_idx: torch.Tensor | None
    copies: KvCopies | None = None


def broadcast_step(tp: TensorParallel, inputs: StepInputs, copies: KvCopies | None = None) -> None:
    """Rank 0: ``inputs`` (an eager step's) and the step's copies between the KV tiers (each rank copies
    its own heads) to the other ranks."""
    meta = inputs.meta
    if meta is None:
        raise RuntimeError("a tensor-parallel step runs eagerly: it needs attention metadata")
    sample_idx = inputs.logits_indices if inputs.sample_ids else None
    prompt_idx = None if inputs.prompt_rows is None else inputs.prompt_rows.logits_indices
    num_seqs, width = meta.block_tables.shape
    header = StepHeader(
        op=StepHeader.STEP,
        num_tokens=int(inputs.input_ids.shape[0]),
        num_seqs=int(num_seqs),
        width=int(width),
        num_sample=0 if sample_idx is None else int(sample_idx.shape[0]),
        num_prompt=0 if prompt_idx is None else int(prompt_idx.shape[0]),
        num_decodes=meta.num_decodes,
        max_query_len=meta.max_query_len,
        max_seq_len=meta.max_seq_len,
        num_offloads=len(copies.offload_blocks) if copies else 0,
        num_loads=len(copies.load_blocks) if copies else 0,
    )
    tp.broadcast(header.pack(), host=True)
    parts = [
        inputs.input_ids,
        inputs.positions,
        meta.slot_mapping,
        meta.query_start_loc.long(),
        meta.seq_lens.long(),
        meta.block_tables.reshape(-1).long(),
    ]
    parts += [idx for idx in (sample_idx, prompt_idx) if idx is not None]
    if copies:
        lists = (copies.offload_blocks, copies.offload_slots, copies.load_slots, copies.load_blocks)
        parts.append(
            torch.tensor([i for ids in lists for i in ids], dtype=torch.int64, device=inputs.positions.device)
        )
    tp.broadcast(torch.cat(parts))


def stop_ranks(tp: TensorParallel, kv_relay: KvRelay | None) -> None:
    """Rank 0: the other ranks' KV threads end and they leave ``ModelRunner.follow``."""
    if kv_relay is not None:
        kv_relay.close()
    tp.broadcast(StepHeader(op=StepHeader.STOP).pack(), host=True)


def head_rows(
    model: CausalLM, hidden: torch.Tensor, sample_idx: torch.Tensor | None, prompt_idx: torch.Tensor | None
) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """The LM head over a step's sampling rows and prompt-scoring rows, in one gather, on every rank:
    (logits of the sampling rows, of the prompt rows) on rank 0; the other ranks get their shards."""
    parts = [idx for idx in (sample_idx, prompt_idx) if idx is not None]
    if not parts:
        return None, None
    rows = hidden[parts[0] if len(parts) == 1 else torch.cat(parts)]
    logits = model.head(rows)
    num_sample = 0 if sample_idx is None else int(sample_idx.shape[0])
    return (
        None if sample_idx is None else logits[:num_sample],
        None if prompt_idx is None else logits[num_sample:],
    )


def receive_step(tp: TensorParallel, device: torch.device, block_size: int) -> FollowedStep | None:
    """Ranks 1..N-1: the next step rank 0 broadcasts (None: stop). Blocks until it comes; a rank 0 that
    died fails the broadcast (the group's error or timeout), which propagates."""
    header = torch.zeros(StepHeader.SIZE, dtype=torch.int64)
    tp.broadcast(header, host=True)
    step = StepHeader.unpack(header)
    if step.op == StepHeader.STOP:
        return None
    if step.op != StepHeader.STEP:
        raise RuntimeError(f"unknown tensor-parallel op {step.op}")
    t, b = step.num_tokens, step.num_seqs
    n_off, n_load = step.num_offloads, step.num_loads
    sizes = [
        t,
        t,
        t,
        b + 1,
        b,
        b * step.width,
        step.num_sample,
        step.num_prompt,
        n_off,
        n_off,
        n_load,
        n_load,
    ]
    packed = torch.empty(sum(sizes), dtype=torch.int64, device=device)
    tp.broadcast(packed)
    ids, pos, slots, qsl, seq_lens, tables, sample_idx, prompt_idx, *copy_parts = packed.split(sizes)
    copies = KvCopies(*(part.tolist() for part in copy_parts)) if n_off or n_load else None
    qsl32, seq_lens32 = qsl.int(), seq_lens.int()
    meta = AttentionMetadata(
        slot_mapping=slots,
        query_start_loc=qsl32,
        seq_lens=seq_lens32,
        block_tables=tables.int().view(b, step.width),
        query_start_loc_cpu=qsl32.cpu(),
        seq_lens_cpu=seq_lens32.cpu(),
        num_decodes=step.num_decodes,
        max_query_len=step.max_query_len,
        max_seq_len=step.max_seq_len,
        block_size=block_size,
    )
    return FollowedStep(
        ids,
        pos,
        meta,
        sample_idx if step.num_sample else None,
        prompt_idx if step.num_prompt else None,
        copies,
    )
