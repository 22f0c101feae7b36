"""The only place that touches tensors: KV cache, input preparation, forward, sampling.

Inputs of a step are built with numpy from the scheduler's plain lists (no per-token Python loop), moved
to the device in one go, and the sampled tokens come back in one device->host copy. ``launch`` enqueues a
step and returns at once (on CUDA) with a ``PendingStep`` whose ``result()`` waits for that copy, so the
engine can prepare the next step meanwhile; ``execute`` is both in one call. ``launch`` is ``forward``
then ``sample``: the engine calls them apart when a step's structured-output mask needs the previous
step's tokens first (asynchronous scheduling).
"""

from __future__ import annotations

import logging
import operator
import time
from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import Union

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
from workers.host_kv import HostKv
from workers.host_memory import retain_freed_memory
from workers.kv_sizing import ProfiledModel, size_kv_cache_cuda
from workers.logits_processors import LogitsProcessors
from workers.mock_runner import build_mock_model, paced_host_copies
from workers.models.arch import ArchConfig
from workers.models.loader import build_random_model, load_model
from workers.models.parallel import SINGLE, Sharding, TensorParallel
from workers.parallel_kv import KvRelay
from workers.parallel_steps import broadcast_step, head_rows, receive_step, stop_ranks
from workers.prompt_logprobs import score_prompt_rows
from workers.rank_process import RankGroup
from workers.runner_steps import ForwardStep, PendingStep
from workers.sampler import (
    CounterStream,
    RowGenerator,
    Sampler,
    SamplerOutput,
    advance_generator,
    is_argmax_only,
    is_greedy,
)
from workers.scheduler import SampledTokens, ScheduledRequest, SchedulerOutput
from workers.step_inputs import (
    PersistentBlockTables,
    StepArrays,
    StepInputs,
    build_step_arrays,
    placeholder_sources,
    prompt_row_inputs,
    sort_decodes_by_length,
)
from workers.structured import StepMask

# The structured-output mask of a step, given its sampled request ids in row order (None: unconstrained).
MaskSource = Callable[[list[str]], Union[StepMask, None]]  # noqa: UP007 - a runtime alias

logger = logging.getLogger(__name__)

# NOTE: the sampling path that allocates the most (temperature + top-k + top-p + min-p + logprobs); the
# warm-up samples with it and a seed, so every sampling kernel is compiled before a run.
_PROFILE_PARAMS = SamplingParams(temperature=0.8, top_p=0.9, top_k=50, min_p=0.05, logprobs=20, seed=0)
# NOTE: device memory a captured graph holds outside the torch allocator (kernel nodes, params); measured
# after capture and logged, this only has to be a safe upper bound.
_GRAPH_ALLOWANCE_BYTES = 4 << 20

_FIELD_DTYPES = {"query_start_loc": np.int32, "seq_lens": np.int32, "block_tables": np.int32}

_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}

_request_id = operator.attrgetter("request_id")
_params = operator.attrgetter("params")
_num_output_tokens = operator.attrgetter("num_output_tokens")


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


class ModelRunner:
    """Owns the model, the KV cache ``[num_layers, num_blocks, 2, block_size, num_kv_heads, head_dim]``
    (block 0 reserved), the sampler, each seeded request's generator (dropped by ``remove``) and, on
    CUDA, the reused input buffers and the decode CUDA graphs (captured after the KV cache exists, with
    their memory reserved by the sizing, and kept for the runner's life)."""

    def __init__(self, config: EngineConfig, model_dir: str, tp: TensorParallel = SINGLE) -> None:
        self.config = config
        # NOTE: under tensor parallelism every rank builds its runner with the same calls in the same
        # order (warm-ups and sizing run collectives); after that only rank 0 steps (``forward``), and
        # the other ranks follow what it broadcasts (``follow``). Rank 0 starts the others here.
        self.ranks: RankGroup | None = None
        # NOTE: a mock engine (load_format mock) stands for a device but runs on the host
        self.device = resolve_device("cpu" if config.load_format == "mock" else config.device)
        self.is_async = config.uses_async_scheduling(self.device.type)  # launch step N+1 before N is read
        if self.device.type == "cpu" and config.retain_host_memory:
            retain_freed_memory()
        self.arch = ArchConfig.from_pretrained(model_dir)
        Sharding.check(self.arch, config.tensor_parallel_size)
        if tp is SINGLE and config.tensor_parallel_size > 1:
            self.ranks = RankGroup.start(config, model_dir, self.device)
            try:
                self._build(config, model_dir, self.ranks.tp)
            except BaseException:
                self.ranks.close()
                raise
        else:
            self._build(config, model_dir, tp)

    def _build(self, config: EngineConfig, model_dir: str, tp: TensorParallel) -> None:
        """The rest of ``__init__``: the same on every rank (the model's shard, the KV cache, warm-ups)."""
        self.tp = tp
        self.num_kv_heads = tp.sharding(self.arch).num_kv_heads  # this rank's
        self.dtype = resolve_dtype(config.model.dtype, self.arch, self.device)
        # NOTE: before the model: building it imports torch._dynamo, which imports triton, and on CPU the
        # Triton backend must set TRITON_INTERPRET before triton is first imported.
        self.backend = create_attention_backend(config.attention_backend)
        # NOTE: the Triton path also fuses the layers' elementwise work; the torch path stays the oracle.
        self.fused_ops = config.attention_backend == "triton"
        if config.load_format == "dummy":
            self.model = build_random_model(self.arch, self.dtype, self.device, seed=config.seed, tp=tp)
        elif config.load_format == "mock":
            # NOTE: "auto" is the dtype the model has on the GPU the mock stands for (its KV bytes too)
            self.dtype = resolve_dtype(config.model.dtype, self.arch, torch.device("cuda"))
            self.model = build_mock_model(config, self.arch, model_dir)
        else:
            self.model, _ = load_model(model_dir, self.dtype, self.device, tp)
        self.block_size = config.block_size
        # NOTE: on CUDA the top-p race and the seeded noise are single Triton launches (no host sync, no
        # launch per seeded row); on CPU the torch path keeps the historical per-request generators.
        self.sampler = Sampler(use_triton=self.device.type == "cuda")
        self.generators: dict[str, torch.Generator] = {}
        # The live requests with logits processors (the engine adds them; ``remove`` drops them).
        self.logits_processors = LogitsProcessors(self.arch.vocab_size)
        # Rows of the last launched step's sampled tokens (device tensor) by request: the source of the
        # next step's placeholder tokens under asynchronous scheduling.
        self._last_sampled: tuple[dict[str, int], torch.Tensor] | None = None
        # NOTE: a tensor-parallel worker runs eagerly: its decode graphs (the all-reduce captured inside,
        # on every rank) are not built yet
        is_graphed = (
            self.device.type == "cuda"
            and config.attention_backend == "triton"
            and not config.enforce_eager
            and not tp.is_parallel
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
                self.num_kv_heads,
                self.arch.head_dim,
            ),
            dtype=self.dtype,
            device=self.device,
        )
        self.kv_caches = list(self.kv_cache.unbind(0))
        # the host tier: this rank's heads (a mock's copies paced at its profile's host link)
        self.host_kv = HostKv.create(self.kv_cache, config.kv_offload_gib, paced_host_copies(self.model))
        # rank 0 of a tensor-parallel worker: every rank's heads, for KV handoffs (workers/parallel_kv.py)
        self.kv_relay = (
            None
            if tp.kv is None or not tp.is_driver
            else KvRelay(tp.kv, self.kv_cache, tp.sharding(self.arch))
        )
        if self.kv_relay is not None and self.ranks is not None:
            self.kv_relay.on_error = self.ranks.fail_if_a_rank_died
        self.max_model_len = config.max_model_len(self.arch.max_position_embeddings, self.num_blocks)
        self.max_blocks_per_seq = -(-self.max_model_len // self.block_size)
        self.block_tables = PersistentBlockTables(config.max_num_seqs, self.max_blocks_per_seq)
        self.buffers: InputBuffers | None = None
        self.graphs: DecodeGraphs | None = None
        self.graph_memory_bytes = 0  # device memory the captured graphs took (measured)
        if self.device.type == "cuda":
            max_tokens = max(config.max_num_batched_tokens, config.max_num_seqs)
            self.buffers = InputBuffers(max_tokens, config.max_num_seqs, self.max_blocks_per_seq, self.device)
        if self.device.type == "cuda" and config.attention_backend == "triton":
            self.warm_up_kernels()
        if self.device.type == "cpu" and config.attention_backend == "torch":
            # NOTE: not the Triton path on CPU (the interpreter, for tests; or no driver at all, when a
            # script only compiles kernels for a GPU)
            self.warm_up_largest_prefill()
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
        # Wall and calling-thread CPU seconds of every launch's forward, logits and sampling (on CUDA:
        # enqueueing them), summed: what benchmarks subtract from a step to get its host overhead.
        self.forward_time_total_s = 0.0
        self.forward_cpu_total_s = 0.0
        # Set to a list to time every step on the device: (start, end) CUDA events around its forward,
        # logits and sampling are appended.
        self.forward_events: list[tuple[torch.cuda.Event, torch.cuda.Event]] | None = None

    @property
    def configured_max_len(self) -> int:
        return self.config.max_model_len(self.arch.max_position_embeddings)

    @property
    def bytes_per_block(self) -> int:
        a = self.arch
        elem = torch.empty((), dtype=self.dtype).element_size()
        return a.num_hidden_layers * 2 * self.block_size * self.num_kv_heads * a.head_dim * elem

    def _size_kv_cache(self) -> int:
        if self.device.type == "cpu":
            return max(2, self.config.cpu_kv_cache_bytes // self.bytes_per_block + 1)
        profiled = ProfiledModel(
            model=self.model,
            sampler=self.sampler,
            backend=self.backend,
            fused_ops=self.fused_ops,
            arch=self.arch,
            dtype=self.dtype,
            device=self.device,
            block_size=self.block_size,
            bytes_per_block=self.bytes_per_block,
            num_kv_heads=self.num_kv_heads,
            fresh_inputs=self.fresh_inputs,
        )
        max_len = self.configured_max_len
        num_blocks = size_kv_cache_cuda(
            profiled, self.config, max_len, self.graph_sizes, _PROFILE_PARAMS, _GRAPH_ALLOWANCE_BYTES
        )
        return self.tp.min_over_ranks(num_blocks)  # NOTE: every rank holds the same blocks

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
        Each also samples a seeded top-k/top-p/min-p row (the sampler's kernels).
        """
        for decode_len in sorted({1, self.max_model_len}):
            bs = self.block_size
            sched = [
                ScheduledRequest("warm-decode", [0], decode_len - 1, [0] * -(-decode_len // bs), True, True,
                                 _PROFILE_PARAMS, 0),
                ScheduledRequest("warm-prefill", [0, 0], 0, [0] * -(-2 // bs), True, False, _PROFILE_PARAMS, 0),
            ]  # fmt: skip
            logits = self._warm_up_step(sched)
            if self.tp.is_driver:  # NOTE: only rank 0 samples (the others hold a vocabulary shard)
                params = [_PROFILE_PARAMS, _PROFILE_PARAMS]
                self.sampler(logits, params, [self._generator("warm-up", _PROFILE_PARAMS, 0), None])
                self.remove("warm-up")
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    @torch.inference_mode()
    def warm_up_largest_prefill(self) -> None:
        """On CPU (torch backend): one forward of the largest prompt chunk a step can hold (the token
        budget, within ``max_model_len``), every token at slot -1 (nothing is written to the cache), so
        the first long prompt served does not pay for the buffers of a shape never seen before.

        Measured (bundled model, 2048-token budget, 2-core box; a fresh engine's prompts of 1024 and 1536
        tokens, then again): 87-93 / 130-142 ms, then 72 / 118-126 ms without it; 79-81 / 118-122 ms,
        then 70-76 / 113-119 ms with it. Start-up takes ~0.15 s longer."""
        num_tokens = min(self.config.max_num_batched_tokens, self.max_model_len)
        if num_tokens < 2:
            return
        blocks = [0] * -(-num_tokens // self.block_size)
        self._warm_up_step([ScheduledRequest("warm-up-prefill", [0] * num_tokens, 0, blocks, True, False,
                                             _PROFILE_PARAMS, 0)])  # fmt: skip

    def _warm_up_step(self, sched: list[ScheduledRequest]) -> torch.Tensor:
        """The forward and logits of a throwaway step, every token at slot -1 (nothing is written)."""
        arrays = build_step_arrays(sched, self.block_size)
        arrays.slots[:] = -1
        inputs = self.fresh_inputs(arrays, SchedulerOutput(sched, len(arrays.input_ids)))
        if inputs.meta is None:
            raise RuntimeError("warm-up step unexpectedly has no attention metadata")
        with self.forward_context(inputs.meta):
            hidden = self.model(inputs.input_ids, inputs.positions)
        return self.model.compute_logits(hidden[inputs.logits_indices], fused=self.fused_ops)

    def prepare_inputs(self, out: SchedulerOutput) -> StepInputs:
        """Device tensors of one step. On CUDA they are slices of the reused buffers, uploaded with
        non-blocking copies from pinned staging; a decode-only step that fits a captured graph is
        padded to that graph's size and laid out where the graph reads. Placeholder tokens are then
        filled in on the device from the previous step's sampled tokens."""
        if self.config.attention_backend == "torch":
            out = sort_decodes_by_length(out)  # NOTE: the torch backend pads decodes per length bucket
        arrays = build_step_arrays(
            out.scheduled,
            self.block_size,
            self.block_tables,
            out.num_batched_tokens,
            out.num_sampling,
            out.prompt_logprob_rows,
        )
        buffers = self.buffers
        num_seqs, num_tokens = len(arrays.seq_lens), len(arrays.input_ids)
        if (
            buffers is None
            or num_tokens > len(buffers.input_ids.np)
            or num_seqs > self.config.max_num_seqs
            or arrays.block_tables.size > len(buffers.block_tables.np)
        ):
            inputs = self.fresh_inputs(arrays, out)
            self._fill_placeholders(arrays, out, inputs, self._upload_fresh)
            return inputs
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
        self._fill_placeholders(arrays, out, inputs, buffers.stage)
        buffers.mark_uploaded()
        return inputs

    def _fill_placeholders(
        self,
        arrays: StepArrays,
        out: SchedulerOutput,
        inputs: StepInputs,
        upload: Callable[[str, np.ndarray], torch.Tensor],
    ) -> None:
        """Overwrite every placeholder input token (id < 0) on the device with the token the previous
        launched step sampled for that request (stream order makes it ready; the host never waits)."""
        if not arrays.input_ids.size or arrays.input_ids.min() >= 0:
            return
        if self._last_sampled is None:
            raise RuntimeError("a step has placeholder tokens but no step sampled before it")
        last_rows, last_tokens = self._last_sampled
        token_idx, rows = placeholder_sources(arrays, out.scheduled, last_rows)
        pairs = upload("placeholders", np.concatenate([token_idx, rows])).view(2, -1)
        inputs.input_ids.index_copy_(0, pairs[0], last_tokens.index_select(0, pairs[1]))

    def fresh_inputs(self, arrays: StepArrays, out: SchedulerOutput) -> StepInputs:
        """The step's device tensors, freshly allocated (no reused buffers, no placeholders)."""
        return self._step_inputs(arrays, out, self._upload_fresh)

    def _upload_fresh(self, name: str, values: np.ndarray) -> torch.Tensor:
        """A new tensor per step (the CPU path, the profile, and any step larger than the buffers)."""
        host = torch.from_numpy(np.ascontiguousarray(values, dtype=_FIELD_DTYPES.get(name, np.int64)))
        return host if self.device.type == "cpu" else host.to(self.device, non_blocking=True)

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
                num_decodes=out.num_single_token_seqs,
                max_query_len=arrays.max_query_len,
                max_seq_len=int(arrays.seq_lens.max()),
                block_size=self.block_size,
            )
        rows = arrays.sample_rows
        sampled = sched if len(rows) == len(sched) else [sched[i] for i in rows]
        return StepInputs(
            input_ids=input_ids,
            positions=positions,
            meta=meta,
            logits_indices=upload("logits_indices", arrays.logits_indices),
            sample_ids=list(map(_request_id, sampled)),
            sample_params=list(map(_params, sampled)),
            sample_num_outputs=list(map(_num_output_tokens, sampled)),
            graph_size=graph_size,
            # NOTE: a fresh upload, not a staged buffer: only steps with prompt-scoring rows have it
            prompt_rows=prompt_row_inputs(arrays, out.prompt_logprob_rows, self._upload_fresh),
        )

    def execute(self, out: SchedulerOutput, mask_for: MaskSource | None = None) -> SampledTokens:
        """Run one step and wait for it: the sampled token (and logprobs) of every request needing one."""
        return self.launch(out, mask_for).result()

    def launch(self, out: SchedulerOutput, mask_for: MaskSource | None = None) -> PendingStep:
        """Enqueue one step (inputs, forward, sampling, the copy of the tokens back); on CUDA it returns
        before the device has run it. Steps are consumed in launch order (``PendingStep.result``).
        ``mask_for(sample ids)``: the step's structured-output mask, asked for once the forward is
        enqueued (None: no row is constrained)."""
        forward = self.forward(out)
        mask = mask_for(forward.sample_ids) if mask_for is not None and forward.sample_ids else None
        return self.sample(forward, mask)

    def forward(self, out: SchedulerOutput) -> ForwardStep:
        """The first half of ``launch``: inputs and forward enqueued; ``sample`` must follow (before the
        next step is launched: its placeholder tokens come from this step's sampled tokens). A step of a
        tensor-parallel worker whose collective failed for a dead rank fails the worker as a unit first."""
        if self.ranks is None:
            return self._forward(out)
        try:
            return self._forward(out)
        except Exception:
            self.ranks.fail_if_a_rank_died()
            raise

    @torch.inference_mode()
    def _forward(self, out: SchedulerOutput) -> ForwardStep:
        t0 = time.perf_counter()
        inputs = self.prepare_inputs(out)
        copies = out.kv_copies if self.host_kv is not None else None
        if self.ranks is not None:
            if self.ranks.failure is not None:
                raise RuntimeError(self.ranks.failure)
            broadcast_step(self.tp, inputs, copies)
        if copies and self.host_kv is not None:
            self.host_kv.apply(self.kv_cache, copies)  # NOTE: before the forward writes an evicted block
        self.prepare_time_s = time.perf_counter() - t0
        events = None
        if self.forward_events is not None:
            events = (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
            events[0].record()
        t_forward, c_forward = time.perf_counter(), time.thread_time()
        if inputs.graph_size is not None and self.graphs is not None:
            hidden = self.graphs.replay(inputs.graph_size)
        else:
            if inputs.meta is None:
                raise RuntimeError("an eager step needs attention metadata")
            with self.forward_context(inputs.meta):
                hidden = self.model(inputs.input_ids, inputs.positions)
        hidden_rows = None
        prompt_rows = None if inputs.prompt_rows is None else inputs.prompt_rows.logits_indices
        if self.tp.is_parallel:
            # NOTE: the LM head is a collective: its rows' logits (the model dtype) are gathered here, on
            # every rank, and sampling starts from them (``parallel_steps.head_rows``)
            hidden_rows, prompt_rows = head_rows(
                self.model, hidden, inputs.logits_indices if inputs.sample_ids else None, prompt_rows
            )
        else:
            if inputs.sample_ids:
                # NOTE: a graph's output buffer is reused by the next replay: its rows are gathered (a copy).
                # An eager decode-only step samples every row, in order: its hidden states are the rows.
                every_row = len(inputs.sample_ids) == hidden.shape[0] and inputs.graph_size is None
                hidden_rows = hidden if every_row else hidden[inputs.logits_indices]
            prompt_rows = None if prompt_rows is None else hidden[prompt_rows]
        self.forward_time_total_s += time.perf_counter() - t_forward
        self.forward_cpu_total_s += time.thread_time() - c_forward
        return ForwardStep(inputs, hidden_rows, events, prompt_rows)

    @torch.inference_mode()
    def sample(self, forward: ForwardStep, mask: StepMask | None = None) -> PendingStep:
        """The second half of ``launch``: logits, ``mask`` (rows of ``forward.sample_ids``), sampling and
        the copy of the tokens back, enqueued."""
        inputs = forward.inputs
        pending = PendingStep([], [], None)
        t_sample, c_sample = time.perf_counter(), time.thread_time()
        prompt_copy = None
        if forward.prompt_rows is not None and inputs.prompt_rows is not None:
            prompt_copy = score_prompt_rows(
                forward.prompt_rows, inputs.prompt_rows, self._row_logits, self.config.max_num_seqs
            )
            pending.prompt_copy = prompt_copy
        if forward.hidden_rows is not None:
            sampled = self._sample(forward.hidden_rows, inputs, mask)
            if self.is_async:
                self._last_sampled = ({rid: i for i, rid in enumerate(inputs.sample_ids)}, sampled.token_ids)
            pending = PendingStep(inputs.sample_ids, inputs.sample_params, sampled.start_copy(), prompt_copy)
        events = forward.events
        self.forward_time_total_s += time.perf_counter() - t_sample
        self.forward_cpu_total_s += time.thread_time() - c_sample
        if events is not None and self.forward_events is not None:
            events[1].record()
            self.forward_events.append(events)
        return pending

    def _sample(self, hidden_rows: torch.Tensor, inputs: StepInputs, mask: StepMask | None) -> SamplerOutput:
        params = inputs.sample_params
        processors = None
        if len(self.logits_processors):
            processors = self.logits_processors.prepare(inputs.sample_ids, inputs.sample_num_outputs)
        if mask is None and processors is None and is_argmax_only(params, has_processors=False):
            # NOTE: no fp32 copy and no soft-cap (monotonic) when only the argmax is wanted.
            if self.tp.is_parallel:
                return SamplerOutput(self.model.argmax_logits(hidden_rows))
            return SamplerOutput(self.model.argmax_tokens(hidden_rows))
        logits = self._row_logits(hidden_rows)
        if mask is not None:
            # NOTE: before the sampler, as vLLM does: greedy rows, the random race and the reported
            # logprobs all see only the tokens the grammar allows.
            mask.apply(logits)
        nums = inputs.sample_num_outputs
        generators = [
            self._generator(r, p, n) for r, p, n in zip(inputs.sample_ids, params, nums, strict=True)
        ]
        if processors is None:
            return self.sampler(logits, params, generators)
        # NOTE: greedy rows and the random race see the processed logits; the reported logprobs stay the
        # raw distribution's (after the structured-output mask: vLLM's default raw_logprobs), so the
        # processors work on a copy when a row asks for logprobs.
        asks_logprobs = any(p.logprobs is not None for p in params)
        processed = logits.clone() if asks_logprobs or not logits.is_contiguous() else logits
        processors.apply(processed)
        return self.sampler(processed, params, generators, raw_logits=logits if asks_logprobs else None)

    def _row_logits(self, hidden_rows: torch.Tensor) -> torch.Tensor:
        """Float32 logits of rows (final soft-cap included), no processor. Under tensor parallelism the
        rows are already the LM head's gathered output (``parallel_steps.head_rows``)."""
        if self.tp.is_parallel:
            return self.model.finish_logits(hidden_rows, fused=self.fused_ops)
        return self.model.compute_logits(hidden_rows, fused=self.fused_ops)

    def _generator(self, request_id: str, params: SamplingParams, num_sampled: int) -> RowGenerator:
        """A seeded request's random stream, a function of (seed, tokens sampled so far), so the same
        wherever the request's earlier tokens were sampled. CUDA: a stateless ``CounterStream``; CPU:
        the request's own ``torch.Generator`` (kept until ``remove``)."""
        if params.seed is None or is_greedy(params):
            return None
        if self.sampler.use_triton:
            return CounterStream(params.seed, num_sampled)
        gen = self.generators.get(request_id)
        if gen is None:
            gen = self.generators[request_id] = torch.Generator(device=self.device)
            gen.manual_seed(params.seed)
            advance_generator(gen, self.arch.vocab_size, num_sampled, self.device)
        return gen

    def remove(self, request_id: str) -> None:
        self.generators.pop(request_id, None)
        self.logits_processors.remove(request_id)
        self.block_tables.remove(request_id)

    # ---- tensor parallelism: rank 0 broadcasts each step, the other ranks follow --------------------
    def close(self) -> None:
        """Rank 0 of a tensor-parallel worker: the other ranks leave ``follow`` and exit (bounded; the
        ones left are killed). Nothing to do at one rank. Idempotent."""
        if self.ranks is not None:
            self.ranks.close(lambda: stop_ranks(self.tp, self.kv_relay))

    @torch.inference_mode()
    def follow(self) -> None:
        """Ranks 1..N-1: run every step rank 0 broadcasts, until it says stop (or the group fails: the
        error propagates and the rank exits)."""
        if self.tp.is_driver:
            raise RuntimeError("rank 0 drives the steps; only the other ranks follow")
        while (step := receive_step(self.tp, self.device, self.block_size)) is not None:
            if step.copies and self.host_kv is not None:
                self.host_kv.apply(self.kv_cache, step.copies)
            with self.forward_context(step.meta):
                hidden = self.model(step.input_ids, step.positions)
            head_rows(self.model, hidden, step.sample_idx, step.prompt_idx)
