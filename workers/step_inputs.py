"""One step's inputs: host arrays built from the schedule with numpy, and their device tensors.

``build_step_arrays`` turns the scheduler's plain lists into the flat ragged batch (no per-token Python
loop); the model runner uploads the arrays (``StepInputs``). A token id < 0 is a placeholder for the
token the previous step is still sampling on the device (asynchronous scheduling): the runner fills it in
on the device before the forward (``placeholder_sources``).
"""

from __future__ import annotations

import dataclasses
import itertools
import operator
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from cluster.protocol import SamplingParams
from workers.attention import AttentionMetadata
from workers.scheduler import PromptLogprobRows, ScheduledRequest, SchedulerOutput


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
    # the rows that score prompt tokens (SchedulerOutput.prompt_logprob_rows, in that order) and the
    # prompt token each scores: [P] int64 each; None when the step scores none
    prompt_logits_indices: np.ndarray | None = None
    prompt_target_ids: np.ndarray | None = None


_token_ids = operator.attrgetter("token_ids")
_start_position = operator.attrgetter("start_position")
_block_ids = operator.attrgetter("block_ids")
_needs_sample = operator.attrgetter("needs_sample")
_first = operator.itemgetter(0)
_target_ids = operator.attrgetter("target_ids")


class PersistentBlockTables:
    """Every scheduled request's block table as a row of one numpy array kept across steps (the block
    tables of vLLM's persistent InputBatch): a step copies into a row only the block ids its request
    gained since the last step, instead of flattening every request's whole table again (at long
    contexts, thousands of ids per step).

    A row is tied to the request's block list object: the scheduler's table list only ever grows while
    the request holds blocks, and a preempted / resumed request gets a new list, which rewrites the row.
    ``remove`` frees a request's row (the runner calls it when the request ends).
    """

    def __init__(self, num_rows: int, max_blocks: int) -> None:
        self.table = np.zeros((max(1, num_rows), max(1, max_blocks)), np.int32)
        self._row_of: dict[str, int] = {}
        self._free_rows = list(range(self.table.shape[0] - 1, -1, -1))
        self._source: list[list[int] | None] = [None] * self.table.shape[0]
        self._num_ids = [0] * self.table.shape[0]

    def rows(self, sched: list[ScheduledRequest]) -> np.ndarray:
        """The row of each scheduled request, with every row brought up to date."""
        row_of, source, num_ids, table = self._row_of, self._source, self._num_ids, self.table
        rows = []
        for s in sched:
            row = row_of.get(s.request_id)
            if row is None:
                row = self._new_row(s.request_id)
                table = self.table
            ids = s.block_ids
            n = len(ids)
            if source[row] is not ids or num_ids[row] != n:
                start = num_ids[row] if source[row] is ids else 0
                if n > table.shape[1]:
                    table = self._widen(n)
                table[row, start:n] = ids[start:]
                source[row], num_ids[row] = ids, n
            rows.append(row)
        return np.array(rows, dtype=np.int64)

    def remove(self, request_id: str) -> None:
        row = self._row_of.pop(request_id, None)
        if row is not None:
            self._source[row] = None
            self._num_ids[row] = 0
            self._free_rows.append(row)

    @property
    def num_requests(self) -> int:
        return len(self._row_of)

    def _new_row(self, request_id: str) -> int:
        if not self._free_rows:  # more requests than rows: grow (held / waiting-for-KV ones keep rows)
            old = self.table.shape[0]
            self.table = np.concatenate([self.table, np.zeros_like(self.table)])
            self._source += [None] * old
            self._num_ids += [0] * old
            self._free_rows = list(range(2 * old - 1, old - 1, -1))
        row = self._free_rows.pop()
        self._row_of[request_id] = row
        return row

    def _widen(self, num_blocks: int) -> np.ndarray:
        wider = np.zeros((self.table.shape[0], max(num_blocks, 2 * self.table.shape[1])), np.int32)
        wider[:, : self.table.shape[1]] = self.table
        self.table = wider
        return wider


def build_step_arrays(
    sched: list[ScheduledRequest],
    block_size: int,
    tables: PersistentBlockTables | None = None,
    num_tokens: int | None = None,
    num_sampling: int | None = None,
    prompt_rows: list[PromptLogprobRows] | None = None,
) -> StepArrays:
    """Flat ragged batch of ``sched`` with numpy: no per-token Python loop. With ``tables`` the block
    tables come from its persistent rows (updated in place) instead of being flattened again.
    ``num_tokens`` / ``num_sampling``: the step's token count and its number of sequences that sample,
    when the caller knows them (``SchedulerOutput``): a decode-only step then reads neither the query
    lengths nor the ``needs_sample`` flags. ``prompt_rows``: the prompt chunks whose rows score the
    prompt (apart from ``logits_indices``, which stay the sampling rows).

    NOTE: every per-sequence column is read with ``map`` over attrgetters (C-level iteration): at 256
    sequences a step does several such passes, and generator expressions cost ~2x as much."""
    num_seqs = len(sched)
    bs = block_size
    starts = np.fromiter(map(_start_position, sched), np.int64, num_seqs)
    q_lens = None
    if num_tokens is None:
        q_lens = np.fromiter(map(len, map(_token_ids, sched)), np.int64, num_seqs)
        num_tokens = int(q_lens.sum())
    if num_tokens == num_seqs:  # one token per sequence (decodes): no ragged arithmetic
        input_ids = np.fromiter(map(_first, map(_token_ids, sched)), np.int64, num_tokens)
        cu_q = np.arange(num_seqs + 1, dtype=np.int64)
        seq_idx = cu_q[:-1]
        positions = starts
        seq_lens = starts + 1
        max_query_len = 1
    else:
        if q_lens is None:
            q_lens = np.fromiter(map(len, map(_token_ids, sched)), np.int64, num_seqs)
        input_ids = np.fromiter(itertools.chain.from_iterable(map(_token_ids, sched)), np.int64, num_tokens)
        cu_q = np.zeros(num_seqs + 1, np.int64)
        np.cumsum(q_lens, out=cu_q[1:])
        seq_idx = np.repeat(np.arange(num_seqs), q_lens)
        positions = np.arange(num_tokens) - cu_q[seq_idx] + starts[seq_idx]
        seq_lens = starts + q_lens
        max_query_len = int(q_lens.max())
    num_blocks = -(-seq_lens // bs)
    width = int(num_blocks.max())
    if tables is not None:
        rows = tables.rows(sched)  # NOTE: before reading `tables.table`, which rows() may replace
        block_tables = tables.table[rows, :width]
        # NOTE: zero the ids past each sequence's own blocks, as the flattened path leaves them
        block_tables[np.arange(width) >= num_blocks[:, None]] = 0
    else:
        block_tables = _flat_block_tables(sched, num_blocks, width)
    slots = block_tables[seq_idx, positions // bs].astype(np.int64) * bs + positions % bs
    if num_sampling == num_seqs:
        sample_rows = list(range(num_seqs))
        logits_indices = cu_q[1:] - 1
    else:
        needs = np.fromiter(map(_needs_sample, sched), np.bool_, num_seqs)
        sample_rows = np.flatnonzero(needs).tolist()
        logits_indices = cu_q[1:][needs] - 1
    arrays = StepArrays(
        input_ids,
        positions,
        slots,
        cu_q,
        seq_lens,
        block_tables,
        logits_indices,
        sample_rows,
        max_query_len,
    )
    if prompt_rows:
        arrays.prompt_logits_indices, arrays.prompt_target_ids = _prompt_rows(sched, cu_q, prompt_rows)
    return arrays


def _prompt_rows(
    sched: list[ScheduledRequest], cu_q: np.ndarray, prompt_rows: list[PromptLogprobRows]
) -> tuple[np.ndarray, np.ndarray]:
    """(rows of the hidden states, the prompt token each scores) of ``prompt_rows``, in their order.
    NOTE: found by request id: the runner may reorder the step's one-token sequences (a one-token
    prompt chunk among them)."""
    seq_of = {s.request_id: i for i, s in enumerate(sched)}
    indices = []
    for rows in prompt_rows:
        i = seq_of.get(rows.request_id)
        num_rows = len(rows.target_ids)
        if i is None or sched[i].start_position != rows.start_position or num_rows > len(sched[i].token_ids):
            raise RuntimeError(
                f"prompt logprob rows of {rows.request_id!r} (position {rows.start_position}, {num_rows} "
                "rows) match no chunk of the step"
            )
        indices.append(np.arange(cu_q[i], cu_q[i] + num_rows))
    num_targets = sum(len(rows.target_ids) for rows in prompt_rows)
    targets = np.fromiter(itertools.chain.from_iterable(map(_target_ids, prompt_rows)), np.int64, num_targets)
    return np.concatenate(indices), targets


def _flat_block_tables(sched: list[ScheduledRequest], num_blocks: np.ndarray, width: int) -> np.ndarray:
    table_lens = np.fromiter(map(len, map(_block_ids, sched)), np.int64, len(sched))
    block_tables = np.zeros((len(sched), width), np.int32)
    # NOTE: one fromiter + one masked store instead of a numpy call per row (256 rows: ~0.3 ms saved);
    # the whole tables are read (no per-row slice) and the blocks past each sequence's end dropped.
    flat = np.fromiter(itertools.chain.from_iterable(map(_block_ids, sched)), np.int32, int(table_lens.sum()))
    if not np.array_equal(table_lens, num_blocks):
        held = np.arange(int(table_lens.max())) < table_lens[:, None]
        flat = flat[(np.arange(held.shape[1]) < num_blocks[:, None])[held]]
    block_tables[np.arange(width) < num_blocks[:, None]] = flat
    return block_tables


@dataclass
class PromptRowInputs:
    """The rows of a step that score prompt tokens, on the device: ``logits_indices`` [P] (rows of the
    hidden states), ``target_ids`` [P] (the prompt token each scores); ``chunks``: whose rows they are,
    in order; ``num_top``: the most top logprobs a chunk asks for."""

    logits_indices: torch.Tensor
    target_ids: torch.Tensor
    chunks: list[PromptLogprobRows]
    num_top: int


def prompt_row_inputs(
    arrays: StepArrays, chunks: list[PromptLogprobRows], upload: Callable[[str, np.ndarray], torch.Tensor]
) -> PromptRowInputs | None:
    """The step's prompt-scoring rows on the device (one upload), or None when it has none."""
    if arrays.prompt_logits_indices is None or arrays.prompt_target_ids is None:
        return None
    both = upload("prompt_rows", np.stack([arrays.prompt_logits_indices, arrays.prompt_target_ids]))
    return PromptRowInputs(both[0], both[1], chunks, max(c.num_top for c in chunks))


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
    prompt_rows: PromptRowInputs | None = None  # the rows scoring prompt tokens (None: none)


def sort_decodes_by_length(out: SchedulerOutput) -> SchedulerOutput:
    """``out`` with its leading one-token sequences ordered by length (a shallow copy; ``out`` is left as
    the scheduler made it): the torch attention backend pads decodes per bucket of similar length."""
    num_single = out.num_single_token_seqs
    if num_single < 2:
        return out
    sched = out.scheduled
    decodes = sorted(sched[:num_single], key=_start_position)
    return dataclasses.replace(out, scheduled=decodes + sched[num_single:])


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
