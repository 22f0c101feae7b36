"""The only place that touches tensors: KV cache, input preparation, forward, sampling.

Inputs of a step are built with numpy from the scheduler's plain lists (no per-token Python loop), moved
to the device in one go, and the sampled tokens come back in one device->host copy.
"""

from __future__ import annotations

import itertools
import logging
import time
from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass

import numpy as np
import torch

from cluster.config import EngineConfig
from cluster.protocol import SamplingParams
from workers.attention import AttentionMetadata, create_attention_backend
from workers.cuda_graphs import (
    DecodeGraphs,
    InputBuffers,
    graph_batch_sizes,
    is_decode_only,
    pick_graph_batch_size,
)
from workers.forward_context import ForwardContext, forward_context
from workers.models.arch import ArchConfig
from workers.models.loader import build_random_model, load_model
from workers.sampler import Sampler, advance_generator, is_greedy
from workers.scheduler import SampledToken, ScheduledRequest, SchedulerOutput

logger = logging.getLogger(__name__)

# NOTE: the sampling path that allocates the most (temperature + top-k + top-p sort + min-p + logprobs).
_PROFILE_PARAMS = SamplingParams(temperature=0.8, top_p=0.9, top_k=50, min_p=0.05, logprobs=20)
# NOTE: device memory a captured graph holds outside the torch allocator (kernel nodes, params); measured
# after capture and logged, this only has to be a safe upper bound.
_GRAPH_ALLOWANCE_BYTES = 4 << 20

_FIELD_DTYPES = {"query_start_loc": np.int32, "seq_lens": np.int32, "block_tables": np.int32}

_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise ValueError("device 'cuda' requested but torch sees no CUDA device")
    return torch.device(name)


def resolve_dtype(name: str, arch: ArchConfig, device: torch.device) -> torch.dtype:
    """ "auto": the checkpoint's dtype on CUDA; float32 on CPU (the oracle runs there)."""
    if name != "auto":
        return _DTYPES[name]
    if device.type == "cpu":
        return torch.float32
    return _DTYPES.get(arch.torch_dtype or "bfloat16", torch.bfloat16)


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


class ModelRunner:
    """Owns the model, the KV cache ``[num_layers, num_blocks, 2, block_size, num_kv_heads, head_dim]``
    (block 0 reserved), the sampler, each seeded request's generator (dropped by ``remove``) and, on
    CUDA, the reused input buffers and the decode CUDA graphs (captured after the KV cache exists, with
    their memory reserved by the sizing, and kept for the runner's life)."""

    def __init__(self, config: EngineConfig, model_dir: str) -> None:
        self.config = config
        self.device = resolve_device(config.device)
        self.arch = ArchConfig.from_pretrained(model_dir)
        self.dtype = resolve_dtype(config.model.dtype, self.arch, self.device)
        # NOTE: before the model: building it imports torch._dynamo, which imports triton, and on CPU the
        # Triton backend must set TRITON_INTERPRET before triton is first imported.
        self.backend = create_attention_backend(config.attention_backend)
        # NOTE: the Triton path also fuses the layers' elementwise work; the torch path stays the oracle.
        self.fused_ops = config.attention_backend == "triton"
        if config.load_format == "dummy":
            self.model = build_random_model(self.arch, self.dtype, self.device, seed=config.seed)
        else:
            self.model, _ = load_model(model_dir, self.dtype, self.device)
        self.block_size = config.block_size
        self.sampler = Sampler()
        self.generators: dict[str, torch.Generator] = {}
        is_graphed = (
            self.device.type == "cuda" and config.attention_backend == "triton" and not config.enforce_eager
        )
        self.graph_sizes = (
            graph_batch_sizes(config.max_num_seqs, config.cuda_graph_max_batch_size) if is_graphed else []
        )
        self.num_blocks = config.num_kv_blocks or self._size_kv_cache()
        self.kv_cache = torch.zeros(
            (
                self.arch.num_hidden_layers,
                self.num_blocks,
                2,
                self.block_size,
                self.arch.num_key_value_heads,
                self.arch.head_dim,
            ),
            dtype=self.dtype,
            device=self.device,
        )
        self.kv_caches = list(self.kv_cache.unbind(0))
        # NOTE: the same bound the engine applies (a sequence can never outgrow the KV pool).
        self.max_model_len = min(self._configured_max_len, (self.num_blocks - 1) * self.block_size)
        self.max_blocks_per_seq = -(-self.max_model_len // self.block_size)
        self.buffers: InputBuffers | None = None
        self.graphs: DecodeGraphs | None = None
        self.graph_memory_bytes = 0  # device memory the captured graphs took (measured)
        if self.device.type == "cuda":
            max_tokens = max(config.max_num_batched_tokens, config.max_num_seqs)
            self.buffers = InputBuffers(max_tokens, config.max_num_seqs, self.max_blocks_per_seq, self.device)
        if self.device.type == "cuda" and config.attention_backend == "triton":
            self.warm_up_kernels()
        if self.graph_sizes and self.buffers is not None:
            self.graphs = DecodeGraphs(
                self.model, self.buffers, self.kv_caches, self.backend, self.graph_sizes,
                self.max_model_len, self.block_size, self.fused_ops,
            )  # fmt: skip
            free_before = torch.cuda.mem_get_info(self.device)[0]
            self.graphs.capture()
            self.graph_memory_bytes = free_before - torch.cuda.mem_get_info(self.device)[0]
            logger.info("CUDA graphs hold %.1f MiB", self.graph_memory_bytes / 2**20)
        self.prepare_time_s = 0.0
        # Set to a list to time every forward on the device: (start, end) CUDA events are appended.
        self.forward_events: list[tuple[torch.cuda.Event, torch.cuda.Event]] | None = None

    @property
    def _configured_max_len(self) -> int:
        return self.config.model.max_model_len or self.arch.max_position_embeddings

    @property
    def bytes_per_block(self) -> int:
        a = self.arch
        elem = torch.empty((), dtype=self.dtype).element_size()
        return a.num_hidden_layers * 2 * self.block_size * a.num_key_value_heads * a.head_dim * elem

    def _size_kv_cache(self) -> int:
        if self.device.type == "cpu":
            return max(2, self.config.cpu_kv_cache_bytes // self.bytes_per_block + 1)
        return self._size_kv_cache_cuda()

    def _profile_schedule(self, query_lens: list[int]) -> SchedulerOutput:
        """Fresh sequences of the given lengths over consecutive blocks 1.. (block 0 stays null)."""
        scheduled: list[ScheduledRequest] = []
        next_block = 1
        for i, n in enumerate(query_lens):
            num_blocks = -(-n // self.block_size)
            blocks = list(range(next_block, next_block + num_blocks))
            next_block += num_blocks
            scheduled.append(
                ScheduledRequest(f"profile-{i}", [0] * n, 0, blocks, True, False, _PROFILE_PARAMS, 0)
            )
        return SchedulerOutput(scheduled, sum(query_lens))

    def _profile_peak(self, query_lens: list[int], num_logits_rows: int) -> int:
        """Peak bytes a step of fresh sequences allocates beyond what is held now (model forward, then
        ``num_logits_rows`` rows of logits through the most expensive sampling path)."""
        out = self._profile_schedule(query_lens)
        arrays = build_step_arrays(out.scheduled, self.block_size)
        num_profile_blocks = int(arrays.block_tables.max()) + 1
        shape = (num_profile_blocks, 2, self.block_size, self.arch.num_key_value_heads, self.arch.head_dim)
        caches = [
            torch.zeros(shape, dtype=self.dtype, device=self.device)
            for _ in range(self.arch.num_hidden_layers)
        ]
        torch.cuda.synchronize(self.device)
        torch.cuda.reset_peak_memory_stats(self.device)
        before = torch.cuda.memory_allocated(self.device)
        inputs = self._step_inputs(arrays, out, self._upload_fresh)
        if inputs.meta is None:
            raise RuntimeError("profile step unexpectedly has no attention metadata")
        ctx = ForwardContext(inputs.meta, caches, self.backend, self.fused_ops)
        with torch.inference_mode(), forward_context(ctx):
            hidden = self.model(inputs.input_ids, inputs.positions)
            rows = torch.arange(num_logits_rows, device=self.device) % hidden.shape[0]
            logits = self.model.compute_logits(hidden[rows])
            del hidden
            self.sampler(logits, [_PROFILE_PARAMS] * num_logits_rows, [None] * num_logits_rows)
        torch.cuda.synchronize(self.device)
        peak = torch.cuda.max_memory_allocated(self.device) - before
        del caches, inputs, logits
        return peak

    def _size_kv_cache_cuda(self) -> int:
        """Blocks that fit in gpu_memory_utilization of the card, after what a step can need on top of
        the weights: the peak of a profiling step of max_num_batched_tokens prompt tokens (split into
        sequences no longer than max_model_len) with max_num_seqs rows sampled, plus, when decode
        graphs will be captured, their pool (peak of a decode step at the largest graph size) and a
        per-graph allowance for the graph objects. The sum is what stays free beside the KV cache."""
        num_tokens = self.config.max_num_batched_tokens
        max_len = self._configured_max_len
        lens = [max_len] * (num_tokens // max_len) + ([num_tokens % max_len] if num_tokens % max_len else [])
        activation_peak = self._profile_peak(lens, self.config.max_num_seqs)
        graph_reserve = 0
        if self.graph_sizes:
            graph_reserve = self._profile_peak([1] * max(self.graph_sizes), 1)
            graph_reserve += _GRAPH_ALLOWANCE_BYTES * len(self.graph_sizes)
        torch.cuda.empty_cache()
        free, total = torch.cuda.mem_get_info(self.device)
        kv_bytes = free - total * (1.0 - self.config.gpu_memory_utilization) - activation_peak - graph_reserve
        num_blocks = int(kv_bytes // self.bytes_per_block)
        if num_blocks < 2:
            raise RuntimeError(
                f"no room for a KV cache: {free / 2**30:.1f} GiB free of {total / 2**30:.1f} GiB, "
                f"activation peak {activation_peak / 2**30:.2f} GiB, graph reserve "
                f"{graph_reserve / 2**30:.2f} GiB; raise gpu_memory_utilization"
            )
        logger.info(
            "KV cache: %d blocks (%.2f GiB); activation peak %.2f GiB, graph reserve %.2f GiB",
            num_blocks, num_blocks * self.bytes_per_block / 2**30, activation_peak / 2**30, graph_reserve / 2**30,
        )  # fmt: skip
        return num_blocks

    def forward_context(self, meta: AttentionMetadata) -> AbstractContextManager[ForwardContext]:
        """The scope a forward of this runner's model runs in (its KV caches, backend and op path)."""
        return forward_context(ForwardContext(meta, self.kv_caches, self.backend, self.fused_ops))

    @torch.inference_mode()
    def warm_up_kernels(self) -> None:
        """Launch every Triton kernel variant a step can need, so none compiles in the middle of a run.

        Per-step integers are not specialised on (see ``triton_kernels``), so the variants are fixed by
        the layers' constants and by whether the decode kernel splits its keys: two mixed steps cover
        them, one whose decode sees 1 key (never split) and one whose decode sees ``max_model_len`` keys
        (split whenever any step can be). Both point at the null block with slot -1: nothing is written.
        """
        for decode_len in sorted({1, self.max_model_len}):
            bs = self.block_size
            sched = [
                ScheduledRequest("warm-decode", [0], decode_len - 1, [0] * -(-decode_len // bs), True, True,
                                 _PROFILE_PARAMS, 0),
                ScheduledRequest("warm-prefill", [0, 0], 0, [0] * -(-2 // bs), True, False, _PROFILE_PARAMS, 0),
            ]  # fmt: skip
            out = SchedulerOutput(sched, 3)
            arrays = build_step_arrays(sched, bs)
            arrays.slots[:] = -1
            inputs = self._step_inputs(arrays, out, self._upload_fresh)
            if inputs.meta is None:
                raise RuntimeError("warm-up step unexpectedly has no attention metadata")
            with self.forward_context(inputs.meta):
                self.model(inputs.input_ids, inputs.positions)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def prepare_inputs(self, out: SchedulerOutput) -> StepInputs:
        """Device tensors of one step. On CUDA they are slices of the reused buffers, uploaded with
        non-blocking copies from pinned staging; a decode-only step that fits a captured graph is
        padded to that graph's size and laid out where the graph reads."""
        arrays = build_step_arrays(out.scheduled, self.block_size)
        buffers = self.buffers
        num_seqs, num_tokens = len(arrays.seq_lens), len(arrays.input_ids)
        if (
            buffers is None
            or num_tokens > len(buffers.input_ids.np)
            or num_seqs > self.config.max_num_seqs
            or arrays.block_tables.size > len(buffers.block_tables.np)
        ):
            return self._step_inputs(arrays, out, self._upload_fresh)
        buffers.wait_writable()
        graph_size = None
        if self.graphs is not None and is_decode_only(out):
            graph_size = pick_graph_batch_size(self.graph_sizes, num_seqs)
        if graph_size is not None:
            a = arrays
            buffers.fill_decode_graph(
                a.input_ids, a.positions, a.slots, a.seq_lens, a.block_tables, graph_size
            )
            buffers.upload_decode_graph(graph_size)
        inputs = self._step_inputs(arrays, out, buffers.stage, graph_size)
        buffers.mark_uploaded()
        return inputs

    def _upload_fresh(self, name: str, values: np.ndarray) -> torch.Tensor:
        """A new tensor per step (the CPU path, the profile, and any step larger than the buffers)."""
        host = torch.from_numpy(np.ascontiguousarray(values, dtype=_FIELD_DTYPES.get(name, np.int64)))
        return host.to(self.device, non_blocking=True)

    def _step_inputs(
        self,
        arrays: StepArrays,
        out: SchedulerOutput,
        upload: Callable[[str, np.ndarray], torch.Tensor],
        graph_size: int | None = None,
    ) -> StepInputs:
        """``upload(field, values)`` puts one field on the device; a graph step's inputs are already
        staged (``graph_size``): it needs only the views its graph reads and the logits rows."""
        sched = out.scheduled
        meta: AttentionMetadata | None = None
        if graph_size is not None and self.buffers is not None:
            input_ids = self.buffers.input_ids.device[:graph_size]
            positions = self.buffers.positions.device[:graph_size]
        else:
            num_seqs, width = arrays.block_tables.shape
            input_ids = upload("input_ids", arrays.input_ids)
            positions = upload("positions", arrays.positions)
            meta = AttentionMetadata(
                slot_mapping=upload("slot_mapping", arrays.slots),
                query_start_loc=upload("query_start_loc", arrays.cu_q),
                seq_lens=upload("seq_lens", arrays.seq_lens),
                block_tables=upload("block_tables", arrays.block_tables.reshape(-1)).view(num_seqs, width),
                query_start_loc_cpu=torch.from_numpy(arrays.cu_q.astype(np.int32)),
                seq_lens_cpu=torch.from_numpy(arrays.seq_lens.astype(np.int32)),
                num_decodes=out.num_decodes,
                max_query_len=arrays.max_query_len,
                max_seq_len=int(arrays.seq_lens.max()),
                block_size=self.block_size,
            )
        return StepInputs(
            input_ids=input_ids,
            positions=positions,
            meta=meta,
            logits_indices=upload("logits_indices", arrays.logits_indices),
            sample_ids=[sched[i].request_id for i in arrays.sample_rows],
            sample_params=[sched[i].params for i in arrays.sample_rows],
            sample_num_outputs=[sched[i].num_output_tokens for i in arrays.sample_rows],
            graph_size=graph_size,
        )

    @torch.inference_mode()
    def execute(self, out: SchedulerOutput) -> dict[str, SampledToken]:
        """Run one step; returns the sampled token (and logprobs) of every request that needs one.

        On CUDA the only host<->device sync is the copy of the sampled tokens back (``to_host``)."""
        t0 = time.perf_counter()
        inputs = self.prepare_inputs(out)
        self.prepare_time_s = time.perf_counter() - t0
        events = None
        if self.forward_events is not None:
            events = (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
            events[0].record()
        if inputs.graph_size is not None and self.graphs is not None:
            hidden = self.graphs.replay(inputs.graph_size)
        else:
            if inputs.meta is None:
                raise RuntimeError("an eager step needs attention metadata")
            with self.forward_context(inputs.meta):
                hidden = self.model(inputs.input_ids, inputs.positions)
        if events is not None and self.forward_events is not None:
            events[1].record()
            self.forward_events.append(events)
        if not inputs.sample_ids:
            return {}
        logits = self.model.compute_logits(hidden[inputs.logits_indices])
        generators = [
            self._generator(rid, p, n)
            for rid, p, n in zip(
                inputs.sample_ids, inputs.sample_params, inputs.sample_num_outputs, strict=True
            )
        ]
        token_ids, logprobs = self.sampler(logits, inputs.sample_params, generators).to_host(
            inputs.sample_params
        )
        if self.buffers is not None:
            self.buffers.mark_synced()
        return {
            rid: SampledToken(t, lp)
            for rid, t, lp in zip(inputs.sample_ids, token_ids, logprobs, strict=True)
        }

    def _generator(self, request_id: str, params: SamplingParams, num_sampled: int) -> torch.Generator | None:
        """A seeded request's own generator: its state is a function of (seed, tokens sampled so far),
        so it is the same wherever the request's earlier tokens were sampled."""
        if params.seed is None or is_greedy(params):
            return None
        gen = self.generators.get(request_id)
        if gen is None:
            gen = self.generators[request_id] = torch.Generator(device=self.device)
            gen.manual_seed(params.seed)
            advance_generator(gen, self.arch.vocab_size, num_sampled, self.device)
        return gen

    def remove(self, request_id: str) -> None:
        self.generators.pop(request_id, None)
