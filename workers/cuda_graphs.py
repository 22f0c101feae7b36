"""Reusable step-input buffers and CUDA graphs for decode-only steps.

``InputBuffers`` holds one host staging array (pinned on CUDA, written through numpy views) and one
device tensor per input field; a step writes its inputs into the staging arrays and uploads them with
``non_blocking`` copies, so building a step's tensors allocates nothing and never waits for the device.

``DecodeGraphs`` captures the model forward of a decode-only step (every sequence has exactly one query
token) for a ladder of padded batch sizes. A captured graph reads its inputs from fixed slices of the
same device tensors: ``input_ids / positions / slot_mapping [:G]``, ``seq_lens [:G]``,
``query_start_loc [:G + 1]`` and a ``[G, max_blocks_per_seq]`` block table; every replay rewrites all of
them. Padding rows are harmless sequences: token 0 at position 0, slot -1 (no KV write), seq_len 1 over
block 0 (the reserved null block), block-table row all 0.

Why a replay with shorter sequences is correct: the graph is captured with ``max_seq_len =
max_model_len``, which fixes only the *number* of decode splits (a host int baked into the launch grid)
and the scratch size. ``decode_kernel`` loads each sequence's ``seq_len`` on the device and derives its
split's ``[start, end)`` from it; splits past the end are empty and get weight 0 in the reduce kernel,
and split 0 always holds the first visible key. Sliding windows are likewise applied from the loaded
seq_len.
"""

from __future__ import annotations

import bisect
import logging

import numpy as np
import torch

from workers.attention.base import AttentionBackend, AttentionMetadata
from workers.forward_context import ForwardContext, forward_context
from workers.models.layers import CausalLM
from workers.scheduler import SchedulerOutput

logger = logging.getLogger(__name__)


def graph_batch_sizes(max_num_seqs: int, cuda_graph_max_batch_size: int) -> list[int]:
    """1, 2, 4, 8, then every 8 up to ``limit = min(max_num_seqs, cuda_graph_max_batch_size)``; the limit
    itself is always last so every decode step of at most ``limit`` sequences has a graph."""
    limit = min(max_num_seqs, cuda_graph_max_batch_size)
    sizes = [s for s in (1, 2, 4) if s < limit] + list(range(8, limit, 8))
    return [*sizes, limit]


def pick_graph_batch_size(sizes: list[int], num_seqs: int) -> int | None:
    """The smallest captured size >= num_seqs (sizes ascending); None when the step is too large."""
    i = bisect.bisect_left(sizes, num_seqs)
    return sizes[i] if i < len(sizes) else None


class _Staged:
    """One input field: ``host`` (pinned on CUDA) with numpy view ``np``, and its ``device`` twin."""

    def __init__(self, size: int, dtype: torch.dtype, device: torch.device) -> None:
        is_cuda = device.type == "cuda"
        self.host = torch.zeros(size, dtype=dtype, pin_memory=is_cuda)
        self.np: np.ndarray = self.host.numpy()
        self.device = torch.zeros(size, dtype=dtype, device=device) if is_cuda else self.host

    def upload(self, n: int) -> torch.Tensor:
        """Enqueue the copy of the first ``n`` entries; returns the device slice (valid in stream order)."""
        if self.device is self.host:
            return self.host[:n]
        return self.device[:n].copy_(self.host[:n], non_blocking=True)


class InputBuffers:
    """Step inputs, reused every step. Lifecycle: ``wait_writable()`` before writing the host arrays of
    a new step (returns at once unless the previous step's uploads may still be reading them), write
    ``*.np``, ``upload`` each field, then ``mark_uploaded()``.

    Decode graphs read their block table from ``graph_block_tables`` ``[max graph size,
    max_blocks_per_seq]``: a step uploads only its own ``[n, width]`` table (through ``block_tables``) and
    copies it there on the device. Columns past a row's blocks and rows past ``n`` keep stale block ids
    of earlier steps: always valid ids, and never read (a sequence reads only the blocks its seq_len
    covers; a padding row has seq_len 1 and reads column 0 of some valid block, writing nothing)."""

    def __init__(self, max_tokens: int, max_seqs: int, max_blocks_per_seq: int, device: torch.device) -> None:
        self.max_blocks_per_seq = max_blocks_per_seq
        self.input_ids = _Staged(max_tokens, torch.int64, device)
        self.positions = _Staged(max_tokens, torch.int64, device)
        self.slot_mapping = _Staged(max_tokens, torch.int64, device)
        self.logits_indices = _Staged(max_tokens, torch.int64, device)
        self.query_start_loc = _Staged(max_seqs + 1, torch.int32, device)
        self.seq_lens = _Staged(max_seqs, torch.int32, device)
        self.block_tables = _Staged(max_seqs * max_blocks_per_seq, torch.int32, device)
        self.placeholders = _Staged(2 * max_seqs, torch.int64, device)
        self.graph_block_tables = torch.zeros(
            (max_seqs, max_blocks_per_seq), dtype=torch.int32, device=device
        )
        self.num_uploaded_table_entries = 0  # block-table entries the last graph step uploaded
        self._table_shape: tuple[int, int] = (0, 0)
        self._copied = torch.cuda.Event() if device.type == "cuda" else None
        self._is_recorded = False

    def wait_writable(self) -> None:
        # NOTE: an event that already completed returns at once; under asynchronous scheduling the last
        # uploads may still be queued behind the step before them.
        if self._is_recorded and self._copied is not None:
            self._copied.synchronize()

    def mark_uploaded(self) -> None:
        if self._copied is not None:
            self._copied.record()
            self._is_recorded = True

    def stage(self, name: str, values: np.ndarray) -> torch.Tensor:
        """Writes ``values`` (flattened) into field ``name``'s host array and uploads them."""
        field: _Staged = getattr(self, name)
        flat = values.reshape(-1)
        field.np[: flat.size] = flat
        return field.upload(flat.size)

    def fill_decode_graph(
        self,
        input_ids: np.ndarray,
        positions: np.ndarray,
        slots: np.ndarray,
        seq_lens: np.ndarray,
        block_tables: np.ndarray,
        graph_size: int,
    ) -> None:
        """Writes a decode-only step of ``n = len(seq_lens)`` sequences, padded to ``graph_size``, into
        the host arrays: per-token fields padded to ``graph_size``, the block table compact ``[n, width]``
        (``upload_decode_graph`` places it into ``graph_block_tables``)."""
        n, g = len(seq_lens), graph_size
        self.input_ids.np[:n] = input_ids
        self.input_ids.np[n:g] = 0
        self.positions.np[:n] = positions
        self.positions.np[n:g] = 0
        self.slot_mapping.np[:n] = slots
        self.slot_mapping.np[n:g] = -1
        self.seq_lens.np[:n] = seq_lens
        self.seq_lens.np[n:g] = 1
        self.query_start_loc.np[: g + 1] = np.arange(g + 1, dtype=np.int32)
        self._table_shape = (block_tables.shape[0], block_tables.shape[1])
        self.block_tables.np[: block_tables.size] = block_tables.reshape(-1)

    def upload_decode_graph(self, graph_size: int) -> None:
        """Uploads what ``fill_decode_graph`` wrote: ``graph_size`` entries per token field and the
        ``[n, width]`` block table (copied into ``graph_block_tables`` on the device)."""
        g = graph_size
        for field in (self.input_ids, self.positions, self.slot_mapping, self.seq_lens):
            field.upload(g)
        self.query_start_loc.upload(g + 1)
        n, width = self._table_shape
        table = self.block_tables.upload(n * width).view(n, width)
        self.graph_block_tables[:n, :width].copy_(table)
        self.num_uploaded_table_entries = n * width


class DecodeGraphs:
    """Captured forwards of decode-only steps, one per size of ``batch_sizes``, over ``buffers``.

    Memory: every graph shares one pool; the largest is captured first so the smaller ones reuse its
    intermediates. Each graph's output ``[G, hidden]`` stays alive in the pool and is overwritten by
    that graph's next replay, so a caller consumes it (gathers its rows) before the next step.
    """

    def __init__(
        self,
        model: CausalLM,
        buffers: InputBuffers,
        kv_caches: list[torch.Tensor],
        backend: AttentionBackend,
        batch_sizes: list[int],
        max_model_len: int,
        block_size: int,
        fused_ops: bool = False,
    ) -> None:
        self.model, self.buffers, self.kv_caches, self.backend = model, buffers, kv_caches, backend
        self.fused_ops = fused_ops
        self.batch_sizes = sorted(batch_sizes)
        self.max_model_len, self.block_size = max_model_len, block_size
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}

    def metadata(self, graph_size: int) -> AttentionMetadata:
        """Static views of the buffers for a padded decode batch of ``graph_size`` one-token sequences,
        with ``max_seq_len = max_model_len`` (fixes the decode split count). The ``*_cpu`` fields view
        the host staging arrays: what the step wrote there (the Triton backend reads only their sizes,
        which a replay keeps)."""
        g, b = graph_size, self.buffers
        return AttentionMetadata(
            slot_mapping=b.slot_mapping.device[:g],
            query_start_loc=b.query_start_loc.device[: g + 1],
            seq_lens=b.seq_lens.device[:g],
            block_tables=b.graph_block_tables[:g],
            query_start_loc_cpu=b.query_start_loc.host[: g + 1],
            seq_lens_cpu=b.seq_lens.host[:g],
            num_decodes=g,
            max_query_len=1,
            max_seq_len=self.max_model_len,
            block_size=self.block_size,
        )

    def forward(self, graph_size: int) -> torch.Tensor:
        """The eager forward a graph records (warm-up; also how CPU tests check the padded layout)."""
        g = graph_size
        ctx = ForwardContext(self.metadata(g), self.kv_caches, self.backend, self.fused_ops)
        with forward_context(ctx):
            hidden: torch.Tensor = self.model(
                self.buffers.input_ids.device[:g], self.buffers.positions.device[:g]
            )
        return hidden

    @torch.inference_mode()
    def capture(self) -> None:
        """Captures every size, largest first, into one shared pool (CUDA only).

        Before each capture the buffers hold a padding-only batch (slots -1: the KV cache is never
        written) and one eager run compiles the Triton kernels for that size's launch configuration.
        """
        pool = torch.cuda.graph_pool_handle()
        empty = np.zeros(0, dtype=np.int64)
        for g in sorted(self.batch_sizes, reverse=True):
            self.buffers.fill_decode_graph(
                empty, empty, empty, empty.astype(np.int32), np.zeros((0, 0), np.int32), g
            )
            self.buffers.upload_decode_graph(g)
            self.forward(g)
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                self.outputs[g] = self.forward(g)
            self.graphs[g] = graph
        torch.cuda.synchronize()
        logger.info("captured %d CUDA graphs (batch sizes %s)", len(self.graphs), self.batch_sizes)

    def replay(self, graph_size: int) -> torch.Tensor:
        """Replays graph ``graph_size`` on the inputs already uploaded; returns its static ``[G, hidden]``."""
        self.graphs[graph_size].replay()
        return self.outputs[graph_size]


def is_decode_only(out: SchedulerOutput) -> bool:
    """A step a decode graph can run: at least one sequence, each with exactly one query token."""
    return bool(out.scheduled) and out.num_single_token_seqs == len(out.scheduled)
